"""Optimizer checkpoints survive a job restart bit for bit (CPU), over real spawned worlds.

Job 1 (a world of 3) trains one model for 20 uninterrupted steps, and another from the same
initial values for 10 steps, then saves parameters and ``DistributedOptimizer.state_dict()`` with
``torch.save`` and ends (RPC shuts down, the processes exit). Job 2 is a NEW world (new
processes): it loads the file, puts the parameters back on their owners, loads the optimizer state
into a fresh ``DistributedOptimizer`` and trains the last 10 steps. The parameters must equal the
uninterrupted run exactly (``torch.equal``), for Adam (AMSGrad; ``step``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq`` state), SGD with momentum and metadist's QHM, with an LR
scheduler whose ``lr`` also has to come back, and for Adam accumulating over 3 passes, whose
checkpoint falls in the middle of a window. The example's ``--resume`` is checked in
``tests/test_examples.py::test_sinusoid_trains_on_two_workers_and_resumes_exactly``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from _dist import run_world

from metadist.optim import QHM, DistributedOptimizer

# Parameters on two remote owners and on the caller; the caller is not needed for any of them.
OWNERS = ("worker1", "worker2", "worker1", "worker0", "worker2")
DIM = 5
STEPS = 20
HALF = 10
CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "qhm": (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7}),
    # Three passes per step: the checkpoint after pass 10 falls inside a window (10 = 3 * 3 + 1).
    "adam-window": (torch.optim.Adam, {"lr": 0.05, "backward_passes_per_step": 3}),
}


def _make_param(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_(True)


def _layer(w: rpc.RRef[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ w.local_value())


def _fetch(rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return rref.local_value().detach().clone()


def _initial(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(DIM, DIM, generator=gen) * 0.6 for _ in OWNERS]


def _inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return [torch.randn(4, DIM, generator=gen) for _ in range(STEPS)]


def _place(values: list[torch.Tensor]) -> list[rpc.RRef[torch.Tensor]]:
    return [rpc.remote(o, _make_param, args=(v,)) for o, v in zip(OWNERS, values, strict=True)]


def _values(rrefs: list[rpc.RRef[torch.Tensor]]) -> list[torch.Tensor]:
    return [rpc.rpc_sync(r.owner(), _fetch, args=(r,)) for r in rrefs]


def _make_optimizer(
    name: str, rrefs: list[rpc.RRef[torch.Tensor]]
) -> tuple[DistributedOptimizer, torch.optim.lr_scheduler.LRScheduler]:
    cls, kwargs = CONFIGS[name]
    opt = DistributedOptimizer(cls, rrefs, **kwargs)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)


def _train(
    opt: DistributedOptimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rrefs: list[rpc.RRef[torch.Tensor]],
    xs: list[torch.Tensor],
) -> None:
    for x in xs:
        with dist_autograd.context() as cid:
            h = x
            for r in rrefs:
                h = rpc.rpc_sync(r.owner(), _layer, args=(r, h))
            dist_autograd.backward(cid, [h.pow(2).sum()])
            opt.step(cid)
        scheduler.step()


def _first_job(rank: int, world_size: int, out: str) -> None:
    if rank != 0:
        return
    saved: dict[str, Any] = {}
    for seed, name in enumerate(CONFIGS):
        init, xs = _initial(seed), _inputs(seed)
        straight = _place(init)
        opt, sched = _make_optimizer(name, straight)
        _train(opt, sched, straight, xs)
        half = _place(init)
        opt, sched = _make_optimizer(name, half)
        _train(opt, sched, half, xs[:HALF])
        state = opt.state_dict()
        # The state really is sharded on the owners and comes back complete.
        assert sorted(state["state"]) == list(range(len(OWNERS))), name
        assert len(opt.describe()) == 3, opt.describe()
        saved[name] = {
            "params": _values(half),
            "optimizer": state,
            "scheduler": sched.state_dict(),
            "straight": _values(straight),
        }
        window = state.get("accumulation")
        if name == "adam-window":  # mid-window: the passes so far and their gradients come along
            assert window is not None
            assert window["passes"] == 1, window
            assert sorted(window["gradients"]) == list(range(len(OWNERS))), window
        else:
            assert window is None, window
        # The first half is not already the end (the check below must be able to fail).
        assert not torch.equal(saved[name]["params"][0], saved[name]["straight"][0])
    torch.save(saved, Path(out) / "checkpoint.pt")


def _second_job(rank: int, world_size: int, out: str) -> None:
    if rank != 0:
        return
    saved = torch.load(Path(out) / "checkpoint.pt", weights_only=True)
    for seed, name in enumerate(CONFIGS):
        entry = saved[name]
        rrefs = _place(entry["params"])
        opt, sched = _make_optimizer(name, rrefs)
        opt.load_state_dict(entry["optimizer"])
        sched.load_state_dict(entry["scheduler"])
        assert opt.param_groups[0]["lr"] == entry["optimizer"]["param_groups"][0]["lr"]
        assert opt.param_groups[0]["lr"] != CONFIGS[name][1]["lr"]  # the scheduler had moved it
        _train(opt, sched, rrefs, _inputs(seed)[HALF:])
        for i, (got, want) in enumerate(zip(_values(rrefs), entry["straight"], strict=True)):
            assert torch.equal(got, want), (
                f"{name}: parameter {i} on {OWNERS[i]} differs after resume by "
                f"{(got - want).abs().max().item():.3e}"
            )


@pytest.mark.timeout(150)
def test_optimizer_checkpoint_resumes_bit_exactly_in_a_new_job(tmp_path: Path) -> None:
    run_world(_first_job, 3, str(tmp_path), timeout=70)
    assert (tmp_path / "checkpoint.pt").stat().st_size > 0
    run_world(_second_job, 3, str(tmp_path), timeout=70)
