"""DistributedOptimizer over a real spawned world of 3 (no mocks of RPC).

One world runs every scenario from rank 0: parameters of a 3-layer pipeline are owned by two
remote workers and the caller, and every result is checked against the same training run with a
local ``torch.optim`` optimizer.
"""

from __future__ import annotations

import copy
import io
import math
import pickle
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F  # noqa: N812
from _dist import Scenarios, run_scenarios
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from metadist.optim import (
    QHM,
    DistributedGradScaler,
    DistributedOptimizer,
    FunctionalAdam,
    clip_grad_norm_,
    register_functional_optimizer,
)
from metadist.optim.qhm import qhm
from metadist.world import DEFAULT_TIMEOUT

OWNERS = ("worker1", "worker2", "worker0")  # pipeline order; worker0 is the caller
DIM = 4
TOL = {"atol": 1e-6, "rtol": 1e-6}


# -- functions that run on the owners (module level: pickled by reference) -------------------


def _make_param(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_(True)


def _layer(
    w: rpc.RRef[torch.Tensor],
    b: rpc.RRef[torch.Tensor],
    h: torch.Tensor,
    poison: bool,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    weight = w.local_value()
    if poison:
        # Forward value unchanged; the gradient reaching this weight becomes inf.
        weight = weight * 1.0
        weight.register_hook(lambda g: torch.full_like(g, math.inf))
    if dtype is not None:
        with torch.autocast("cpu", dtype=dtype):
            return torch.tanh(h @ weight + b.local_value())
    return torch.tanh(h @ weight + b.local_value())


def _fetch(rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return rref.local_value().detach().clone()


class MyQHM(QHM):
    """A user's optimizer class, registered with a twin that takes no foreach/fused."""


@register_functional_optimizer(MyQHM)
class FunctionalMyQHM:
    def __init__(self, params: list[torch.Tensor], lr: float, momentum: float, nu: float) -> None:
        self.defaults = {"lr": lr, "momentum": momentum, "nu": nu}
        self.params = params
        self.state = torch.jit.annotate(dict[torch.Tensor, dict[str, torch.Tensor]], {})

    def step(self, gradients: list[torch.Tensor | None]) -> None:
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        bufs: list[torch.Tensor] = []
        for p, g in zip(self.params, gradients):  # noqa: B905 (TorchScript)
            if g is not None:
                if p not in self.state:
                    self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
                params.append(p)
                grads.append(g)
                bufs.append(self.state[p]["momentum_buffer"])
        d = self.defaults
        with torch.no_grad():
            qhm(params, grads, bufs, d["lr"], d["momentum"], d["nu"], 0.0, "grad")


# -- the model, distributed and local ---------------------------------------------------------


class Model:
    """Six parameters, two per owner, listed in an interleaved order to exercise index mapping."""

    ORDER = ((0, "w"), (2, "b"), (1, "w"), (0, "b"), (2, "w"), (1, "b"))

    def __init__(self, seed: int, values: list[torch.Tensor] | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.init = values or [
            torch.randn(DIM, DIM, generator=gen) * 0.5
            if kind == "w"
            else torch.randn(DIM, generator=gen) * 0.1
            for _, kind in self.ORDER
        ]
        self.rrefs = [
            rpc.remote(OWNERS[layer], _make_param, args=(v,))
            for (layer, _), v in zip(self.ORDER, self.init, strict=True)
        ]
        self.local = [torch.nn.Parameter(v.clone()) for v in self.init]

    def _pick(self, layer: int, seq: list[Any]) -> tuple[Any, Any]:
        w = next(seq[i] for i, (lay, k) in enumerate(self.ORDER) if lay == layer and k == "w")
        b = next(seq[i] for i, (lay, k) in enumerate(self.ORDER) if lay == layer and k == "b")
        return w, b

    def dist_loss(
        self,
        x: torch.Tensor,
        skip: int | None = None,
        poison: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        h = x
        for layer, owner in enumerate(OWNERS):
            if layer == skip:
                continue
            w, b = self._pick(layer, self.rrefs)
            args = (w, b, h, layer == poison, dtype)
            h = _layer(*args) if owner == "worker0" else rpc.rpc_sync(owner, _layer, args=args)
        return h.float().pow(2).sum()

    def local_loss(
        self, x: torch.Tensor, skip: int | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        h = x
        for layer in range(len(OWNERS)):
            if layer == skip:
                continue
            w, b = self._pick(layer, self.local)
            if dtype is not None:
                with torch.autocast("cpu", dtype=dtype):
                    h = torch.tanh(h @ w + b)
            else:
                h = torch.tanh(h @ w + b)
        return h.float().pow(2).sum()

    def values(self) -> list[torch.Tensor]:
        return [rpc.rpc_sync(r.owner(), _fetch, args=(r,)) for r in self.rrefs]

    def assert_matches_local(self, tol: dict[str, float] | None = None, what: str = "") -> None:
        for i, (got, ref) in enumerate(zip(self.values(), self.local, strict=True)):
            torch.testing.assert_close(
                got, ref.detach(), **(tol or TOL), msg=lambda m, i=i: f"{what} param {i}: {m}"
            )


def _inputs(n: int, seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, DIM, generator=gen) for _ in range(n)]


def _assert_same_state(sd: dict[str, Any], ref_sd: dict[str, Any], what: str) -> None:
    """The optimizer state of ``sd`` equals the local optimizer's ``ref_sd``, entry by entry."""
    assert set(sd["state"]) == set(ref_sd["state"]), what
    for i, entry in ref_sd["state"].items():
        assert set(sd["state"][i]) == set(entry), what
        for key, value in entry.items():
            torch.testing.assert_close(sd["state"][i][key], value, **TOL)


def _dist_step(
    model: Model, opt: DistributedOptimizer, x: torch.Tensor, skip: int | None = None
) -> None:
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [model.dist_loss(x, skip)])
        opt.step(cid)


def _local_step(
    model: Model, opt: torch.optim.Optimizer, x: torch.Tensor, skip: int | None = None
) -> None:
    opt.zero_grad(set_to_none=True)
    model.local_loss(x, skip).backward()
    opt.step()


# -- scenarios (all run on rank 0) --------------------------------------------------------------


def _check_equivalence(world_size: int) -> None:
    cases: list[tuple[type, dict[str, Any], Any]] = [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "auto"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "eager"),
        (torch.optim.Adam, {"lr": 0.05}, "auto"),
        (torch.optim.Adam, {"lr": 0.05, "amsgrad": True}, {"worker1": "eager", 2: "auto"}),
        (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7}, "auto"),
        (torch.optim.NAdam, {"lr": 0.05}, "auto"),  # no functional twin: runs torch.optim itself
        # Kernel choice overridden off: the per-tensor loop, still equal to torch.optim.
        (torch.optim.Adam, {"lr": 0.05, "foreach": False, "fused": False}, "auto"),
    ]
    for n, (cls, kwargs, mode) in enumerate(cases):
        model = Model(seed=n)
        opt = DistributedOptimizer(cls, model.rrefs, mode=mode, **kwargs)
        ref = cls(model.local, **kwargs)
        for step, x in enumerate(_inputs(5)):
            skip = 1 if step == 2 else None  # step 3: worker2's layer unused
            before = model.values()
            _dist_step(model, opt, x, skip)
            _local_step(model, ref, x, skip)
            if skip is not None:
                # No stale-gradient reuse: worker2's params (ORDER indices 2 and 5) untouched.
                after = model.values()
                for i in (2, 5):
                    assert torch.equal(before[i], after[i]), f"{cls.__name__}: param {i} moved"
            model.assert_matches_local(what=f"{cls.__name__} mode={mode} step {step}")
        described = opt.describe()
        assert set(described) == set(OWNERS)
        if cls is not torch.optim.NAdam:
            assert {m for m, _, _ in described.values()} == {"eager"}
        if cls is torch.optim.NAdam:
            assert {m for m, _, _ in described.values()} == {"torch"}
        if kwargs.get("fused") is False:
            assert set(described.values()) == {("eager", "single-tensor", 2)}, described


def _check_kernels(world_size: int) -> None:
    """Owners auto-pick only the kernel flags the user left unset; explicit values are obeyed."""
    model = Model(seed=70)
    qhm = {"lr": 0.1, "momentum": 0.9, "nu": 0.7}
    cases: list[tuple[type, dict[str, Any], str]] = [
        (torch.optim.Adam, {}, "fused"),
        (torch.optim.Adam, {"fused": False}, "foreach"),  # 2 small params per owner
        (torch.optim.Adam, {"foreach": False}, "fused"),
        (torch.optim.Adam, {"foreach": True}, "foreach"),
        (torch.optim.SGD, {"fused": False, "foreach": False}, "single-tensor"),
        # QHM and the functional classes default the flags to False: not passing them still
        # means "unset", passing False means off.
        (QHM, qhm, "foreach"),
        (QHM, {**qhm, "foreach": False}, "single-tensor"),
        (FunctionalAdam, {}, "fused"),
        (FunctionalAdam, {"fused": False, "foreach": False}, "single-tensor"),
    ]
    for cls, kwargs, expected in cases:
        opt = DistributedOptimizer(cls, model.rrefs, **{"lr": 0.1, **kwargs})
        kernels = {kernel for _, kernel, _ in opt.describe().values()}
        assert kernels == {expected}, (cls.__name__, kwargs, kernels)


def _check_kernels_unasked_follow_torch_optim(world_size: int) -> None:
    """An unasked fused kernel only where it steps as torch.optim's default does: not on half
    precision (torch's fused CPU SGD drifts there), and not for a sparse gradient (which the
    fused kernels refuse): the owner then moves to the kernel torch.optim would use."""
    torch.manual_seed(71)
    base = torch.randn(256)
    for dtype in (torch.bfloat16, torch.float16):
        mine = base.to(dtype).requires_grad_(True)
        theirs = base.to(dtype).requires_grad_(True)
        opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(mine)], lr=0.1, momentum=0.9)
        ref = torch.optim.SGD([theirs], lr=0.1, momentum=0.9)
        assert "fused" not in {k for _, k, _ in opt.describe().values()}, opt.describe()
        for _ in range(6):
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [(mine.float() ** 3).sum()])
                opt.step(cid)
            ref.zero_grad()
            (theirs.float() ** 3).sum().backward()
            ref.step()
        assert torch.equal(mine, theirs), (dtype, (mine.float() - theirs.float()).abs().max())
    init = torch.randn(10, 3)
    rows = [torch.tensor([1, 2, 2, 5]), torch.tensor([0, 5, 9]), torch.tensor([3, 3])]
    for cls, kwargs in ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.Adagrad, {})):
        mine = init.clone().requires_grad_(True)
        theirs = init.clone().requires_grad_(True)
        opt = DistributedOptimizer(cls, [rpc.RRef(mine)], lr=0.1, **kwargs)
        ref = cls([theirs], lr=0.1, **kwargs)
        assert {k for _, k, _ in opt.describe().values()} == {"fused"}
        for i in rows:
            with dist_autograd.context() as cid:
                dist_autograd.backward(cid, [F.embedding(i, mine, sparse=True).pow(2).sum()])
                opt.step(cid)
            ref.zero_grad()
            F.embedding(i, theirs, sparse=True).pow(2).sum().backward()
            ref.step()
        assert "fused" not in {k for _, k, _ in opt.describe().values()}, opt.describe()
        torch.testing.assert_close(mine, theirs, **TOL)


def _check_flags_stay_fixed(world_size: int) -> None:
    """Owners are built with a group's flags: a changed flag is refused by name, on the next
    step or in a loaded state dict, never silently ignored (floats follow, see schedulers)."""
    model = Model(seed=72)
    opt = DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.1, momentum=0.9)
    x = _inputs(1, seed=73)[0]
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [model.dist_loss(x)])
        opt.step(cid)
    saved = opt.state_dict()
    before = model.values()
    opt.param_groups[0]["nesterov"] = True
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [model.dist_loss(x)])
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['nesterov'\] is True"):
            opt.step(cid)
    opt.param_groups[0]["nesterov"] = False
    flipped = copy.deepcopy(saved)
    flipped["param_groups"][0]["maximize"] = True
    with pytest.raises(ValueError, match=r"\['param_groups'\]\[0\]\['maximize'\] is True"):
        opt.load_state_dict(flipped)
    assert all(torch.equal(a, b) for a, b in zip(before, model.values(), strict=True))
    opt.load_state_dict(saved)  # the same flags: fine
    opt.param_groups[0]["lr"] = 0.05  # a float follows
    opt.param_groups[0]["name"] = "the encoder"  # a key of the user's, unknown to the class
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [model.dist_loss(x)])
        opt.step(cid)


def _window(
    model: Model, opt: DistributedOptimizer, ref: torch.optim.Optimizer, xs: list[torch.Tensor]
) -> None:
    """One averaged accumulation window, distributed and local."""
    ref.zero_grad()
    for x in xs:
        _dist_step(model, opt, x)
        (model.local_loss(x) / len(xs)).backward()
    ref.step()


def _check_load_resets_accumulation(world_size: int) -> None:
    """Gradients accumulated before load_state_dict are never applied after it."""
    for cls in (torch.optim.Adam, torch.optim.NAdam):  # functional twin / torch.optim itself
        model = Model(seed=80)
        opt = DistributedOptimizer(cls, model.rrefs, lr=0.05, backward_passes_per_step=2)
        ref = cls(model.local, lr=0.05)
        xs = _inputs(7, seed=81)

        _window(model, opt, ref, xs[0:2])
        sd = opt.state_dict()
        ref_sd = copy.deepcopy(ref.state_dict())  # torch's holds the live state tensors
        _window(model, opt, ref, xs[2:4])
        model.assert_matches_local(what=f"{cls.__name__} before the load")
        before = model.values()
        _dist_step(model, opt, xs[4])  # first pass of a window: accumulated on the owners only
        assert all(torch.equal(a, b) for a, b in zip(before, model.values(), strict=True))
        opt.load_state_dict(sd)
        ref.load_state_dict(ref_sd)
        assert not opt.next_step_applies  # a fresh window
        _window(model, opt, ref, xs[5:7])  # must use xs[5] and xs[6] only, from the loaded state
        model.assert_matches_local(what=f"{cls.__name__} after load_state_dict")


def _check_accumulation(world_size: int) -> None:
    for average in (True, False):
        model = Model(seed=10)
        opt = DistributedOptimizer(
            torch.optim.Adam,
            model.rrefs,
            lr=0.05,
            backward_passes_per_step=2,
            average_accumulated=average,
        )
        ref = torch.optim.Adam(model.local, lr=0.05)
        xs = _inputs(4, seed=11)
        for window in range(2):
            ref.zero_grad()
            for k in range(2):
                x = xs[2 * window + k]
                skip = 0 if (window, k) == (1, 0) else None
                before = model.values()
                assert opt.next_step_applies == (k == 1)
                _dist_step(model, opt, x, skip)
                if k == 0:
                    assert all(
                        torch.equal(a, b) for a, b in zip(before, model.values(), strict=True)
                    )
                loss = model.local_loss(x, skip)
                (loss / 2 if average else loss).backward()
            ref.step()
            model.assert_matches_local(what=f"accumulation average={average} window {window}")


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor([value], requires_grad=True)


def _square_loss(w: rpc.RRef[torch.Tensor], target: float) -> torch.Tensor:
    return (w.local_value() - target).pow(2).sum()


def _window_pass(ws: list[rpc.RRef[torch.Tensor]], opt: DistributedOptimizer, t: float) -> None:
    with dist_autograd.context() as cid:
        losses = [
            _square_loss(w, t) if w.is_owner() else rpc.rpc_sync(w.owner(), _square_loss, (w, t))
            for w in ws
        ]
        dist_autograd.backward(cid, [torch.stack(losses).sum()])
        opt.step(cid)


def _check_window_checkpoint(world_size: int) -> None:
    """SGD lr=1, 2 passes per step, loss (w - t)^2 with t=1 then t=3, from w=0: w becomes 4.0.

    A checkpoint after the first pass carries the window (bit-exact resume); one at the window's
    boundary is a plain torch.optim dict and resumes too. One parameter remote, one on the caller.
    """
    owners = ("worker1", "worker0")

    def fresh(value: float, **kwargs: Any) -> tuple[list[Any], DistributedOptimizer]:
        ws = [rpc.remote(o, _scalar, args=(value,)) for o in owners]
        sgd = {"lr": 1.0, "backward_passes_per_step": 2, **kwargs}
        return ws, DistributedOptimizer(torch.optim.SGD, ws, **sgd)

    def values(ws: list[Any]) -> list[float]:
        return [rpc.rpc_sync(w.owner(), _fetch, args=(w,)).item() for w in ws]

    ws, opt = fresh(0.0)
    _window_pass(ws, opt, 1.0)
    mid = opt.state_dict()
    assert mid["accumulation"]["passes"] == 1
    assert sorted(mid["accumulation"]["gradients"]) == [0, 1]
    _window_pass(ws, opt, 3.0)
    assert values(ws) == [4.0, 4.0]  # uninterrupted
    boundary = opt.state_dict()
    assert "accumulation" not in boundary
    _window_pass(ws, opt, 1.0)
    _window_pass(ws, opt, 3.0)
    assert values(ws) == [0.0, 0.0]

    # Mid-window resume: a new job would torch.save / torch.load the dict.
    buffer = io.BytesIO()
    torch.save(mid, buffer)
    buffer.seek(0)
    ws2, opt2 = fresh(0.0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt2.next_step_applies
    _window_pass(ws2, opt2, 3.0)
    assert values(ws2) == [4.0, 4.0]
    # Boundary resume: a fresh window.
    ws3, opt3 = fresh(4.0)
    opt3.load_state_dict(boundary)
    assert not opt3.next_step_applies
    _window_pass(ws3, opt3, 1.0)
    _window_pass(ws3, opt3, 3.0)
    assert values(ws3) == [0.0, 0.0]
    # A window that does not fit is refused before anything is sent.
    _, opt4 = fresh(0.0, backward_passes_per_step=1)
    with pytest.raises(ValueError, match=r"0 < k < backward_passes_per_step \(1\)"):
        opt4.load_state_dict(mid)


def _check_scaler(world_size: int) -> None:
    model = Model(seed=20)
    opt = DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(model.local, lr=0.1, momentum=0.9)
    scaler = DistributedGradScaler(init_scale=2.0**8, growth_interval=100)
    xs = _inputs(3, seed=21)
    # Clean step: same as unscaled local training.
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [scaler.scale(model.dist_loss(xs[0]))])
        assert scaler.step(opt, cid) is True
    scaler.update()
    _local_step(model, ref, xs[0])
    model.assert_matches_local(tol={"atol": 1e-5, "rtol": 1e-5}, what="scaler clean step")
    # inf only in worker1's weight gradient: every owner must skip, the scale backs off.
    before = model.values()
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [scaler.scale(model.dist_loss(xs[1], poison=0))])
        found = scaler.unscale_(opt, cid)
        assert found is True
        assert scaler.step(opt, cid) is False
    scaler.update()
    assert scaler.get_scale() == 2.0**7
    after = model.values()
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert torch.equal(a, b), f"param {i} (owner {OWNERS[Model.ORDER[i][0]]}) stepped on inf"
    # Training continues correctly after the skip.
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [scaler.scale(model.dist_loss(xs[2]))])
        assert scaler.step(opt, cid) is True
    scaler.update()
    _local_step(model, ref, xs[2])
    model.assert_matches_local(tol={"atol": 1e-5, "rtol": 1e-5}, what="scaler after skip")
    # CPU autocast, bf16 and fp16, on every owner.
    for dtype in (torch.bfloat16, torch.float16):
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [scaler.scale(model.dist_loss(xs[0], dtype=dtype))])
            assert scaler.step(opt, cid) is True
        scaler.update()
        ref.zero_grad()
        model.local_loss(xs[0], dtype=dtype).backward()
        ref.step()
        model.assert_matches_local(tol={"atol": 1e-3, "rtol": 1e-3}, what=f"autocast {dtype}")
        assert all(bool(torch.isfinite(v).all()) for v in model.values())


def _check_clipping(world_size: int) -> None:
    for norm_type in (2.0, math.inf):
        model = Model(seed=30)
        opt = DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.5)
        ref = torch.optim.SGD(model.local, lr=0.5)
        x = _inputs(1, seed=31)[0] * 3
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [model.dist_loss(x)])
            total = clip_grad_norm_(opt, cid, max_norm=0.25, norm_type=norm_type)
            opt.step(cid)
        ref.zero_grad()
        model.local_loss(x).backward()
        ref_total = torch.nn.utils.clip_grad_norm_(model.local, max_norm=0.25, norm_type=norm_type)
        assert float(ref_total) > 0.25  # clipping really happened
        torch.testing.assert_close(total, ref_total, **TOL)
        ref.step()
        model.assert_matches_local(what=f"clipping norm_type={norm_type}")


def _check_state_dict(world_size: int) -> None:
    model = Model(seed=40)
    opt = DistributedOptimizer(torch.optim.Adam, model.rrefs, lr=0.05, amsgrad=True)
    ref = torch.optim.Adam(model.local, lr=0.05, amsgrad=True)
    xs = _inputs(5, seed=41)
    for x in xs[:3]:
        _dist_step(model, opt, x)
        _local_step(model, ref, x)
    sd = opt.state_dict()
    ref_sd = ref.state_dict()
    assert sd["param_groups"][0]["params"] == ref_sd["param_groups"][0]["params"]
    assert sd["param_groups"][0]["lr"] == 0.05
    _assert_same_state(sd, ref_sd, "")
    snapshot = model.values()
    for x in xs[3:]:
        _dist_step(model, opt, x)
    continued = model.values()
    # Fresh parameters at the snapshot, fresh optimizer, loaded state: bit-exact resume.
    resumed = Model(seed=0, values=snapshot)
    opt2 = DistributedOptimizer(torch.optim.Adam, resumed.rrefs, lr=0.5, amsgrad=True)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.05
    for x in xs[3:]:
        _dist_step(resumed, opt2, x)
    for i, (a, b) in enumerate(zip(continued, resumed.values(), strict=True)):
        assert torch.equal(a, b), f"param {i} differs after resume"
    with pytest.raises(ValueError, match=r"1 param group\(s\) of \[6\] parameters, got \[2\]"):
        opt2.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


def _check_lr_scheduler(world_size: int) -> None:
    model = Model(seed=50)
    opt = DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.2, momentum=0.5)
    ref = torch.optim.SGD(model.local, lr=0.2, momentum=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    for step, x in enumerate(_inputs(4, seed=51)):
        _dist_step(model, opt, x)
        _local_step(model, ref, x)
        sched.step()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5 ** (step + 1))
        model.assert_matches_local(what=f"scheduler step {step}")


def _ps_forward(w: rpc.RRef[torch.Tensor], c: torch.Tensor) -> torch.Tensor:
    return (w.local_value() * c).sum()


def _check_parameter_server(world_size: int) -> None:
    threads_n, steps = 4, 10
    w1 = rpc.remote("worker1", _make_param, args=(torch.zeros(1000),))
    w2 = rpc.remote("worker2", _make_param, args=(torch.zeros(10),))
    opt = DistributedOptimizer(
        torch.optim.SGD, [w1, w2], lr=1.0, mode={"worker1": "eager", "worker2": "auto"}
    )
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n)

    def trainer(t: int) -> None:
        try:
            barrier.wait(timeout=30)
            c1 = torch.full((1000,), float(t + 1))
            c2 = torch.full((10,), float(t + 1))
            for _ in range(steps):
                with dist_autograd.context() as cid:
                    loss = rpc.rpc_sync("worker1", _ps_forward, args=(w1, c1)) + rpc.rpc_sync(
                        "worker2", _ps_forward, args=(w2, c2)
                    )
                    dist_autograd.backward(cid, [loss])
                    opt.step(cid)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(t,)) for t in range(threads_n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a trainer thread hung"
    assert not errors, errors
    # Each update subtracts (t + 1): every one of the 40 landed exactly once.
    expected = -float(steps * sum(range(1, threads_n + 1)))
    for rref in (w1, w2):
        value = rpc.rpc_sync(rref.owner(), _fetch, args=(rref,))
        assert bool(torch.isfinite(value).all())
        assert torch.equal(value, torch.full_like(value, expected)), value[:3]


def _check_bad_input(world_size: int) -> None:
    model = Model(seed=60)
    with pytest.raises(ValueError, match="params_rref is empty"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
    with pytest.raises(TypeError, match=r"params_rref\[1\] must be an RRef"):
        DistributedOptimizer(torch.optim.SGD, [model.rrefs[0], torch.zeros(1)], lr=0.1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"params_rref\[1\] is listed twice"):
        DistributedOptimizer(torch.optim.SGD, [model.rrefs[0], model.rrefs[0]], lr=0.1)
    with pytest.raises(ValueError, match="mode must be one of"):
        DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.1, mode="fast")
    with pytest.raises(ValueError, match="Invalid learning rate"):
        DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=-1.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.1, backward_passes_per_step=0)
    # MyQHM's twin takes lr, momentum and nu only: any other key cannot differ between groups.
    qhm_groups = [{"params": model.rrefs[:3]}, {"params": model.rrefs[3:], "weight_decay": 0.1}]
    with pytest.raises(
        ValueError, match=r"param group 1 sets weight_decay=0.1, but FunctionalMyQHM takes no"
    ):
        DistributedOptimizer(MyQHM, qhm_groups, lr=0.1, momentum=0.9, nu=0.7)
    qhm_groups[1] = {"params": model.rrefs[3:], "lr": 0.2}  # lr it takes, per group
    DistributedOptimizer(MyQHM, qhm_groups, lr=0.1, momentum=0.9, nu=0.7)
    opt = DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.1)
    with pytest.raises(ValueError, match="context_id 987654321 is not a live"):
        opt.step(987654321)
    with pytest.raises(ValueError, match="context_id must be an int"):
        opt.step("1")  # type: ignore[arg-type]
    with dist_autograd.context() as cid, pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(opt, cid, max_norm=-1.0)
    # Wrong types are named up front, not left to fail obscurely on an owner.
    wrong_types: list[tuple[Callable[[], object], type[Exception], str]] = [
        (
            lambda: DistributedOptimizer(int, model.rrefs, lr=0.1),
            TypeError,
            r"optimizer_class must be a torch\.optim\.Optimizer subclass .*got <class 'int'>",
        ),
        (
            lambda: DistributedOptimizer(
                torch.optim.SGD, model.rrefs, lr=0.1, average_accumulated="no"
            ),
            TypeError,
            r"average_accumulated must be a bool, got 'no'",
        ),
        (
            lambda: DistributedOptimizer(torch.optim.Adam, model.rrefs, lr=0.1, foreach="x"),
            TypeError,
            r"foreach must be True, False or None .*got 'x'",
        ),
        (
            lambda: DistributedOptimizer(FunctionalAdam, model.rrefs, foreach=True, fused=True),
            ValueError,
            r"fused=True and foreach=True",
        ),
        (
            lambda: DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.1, timeout=True),
            TypeError,
            r"DistributedOptimizer: timeout must be a number of seconds, DEFAULT_TIMEOUT or None, "
            r"got True",
        ),
        (
            lambda: opt.load_state_dict(
                {"state": [], "param_groups": [{"params": list(range(6))}]}
            ),
            ValueError,
            r"state_dict\['state'\] must be a dict",
        ),
        (
            lambda: opt.load_state_dict({"state": {}, "param_groups": {"params": [0]}}),
            ValueError,
            r"state_dict\['param_groups'\] must be a list of dicts",
        ),
        (
            lambda: opt.load_state_dict(
                {"state": {0: 3}, "param_groups": [{"params": list(range(6))}]}
            ),
            ValueError,
            r"state_dict\['state'\]\[0\] must be a dict of state tensors .*, got 'int'",
        ),
    ]
    for call, error, message in wrong_types:
        with pytest.raises(error, match=message):
            call()


def _check_user_twin_and_scripted_mode(world_size: int) -> None:
    """A user's registered functional class steps eagerly, as its torch.optim class would;
    mode="scripted" (TorchScript support removed) is refused by name before anything is sent."""
    model = Model(seed=90)
    kwargs = {"lr": 0.1, "momentum": 0.9, "nu": 0.7}
    opt = DistributedOptimizer(MyQHM, model.rrefs, **kwargs)
    assert {m for m, _, _ in opt.describe().values()} == {"eager"}, opt.describe()
    ref = QHM(model.local, **kwargs)
    for x in _inputs(3, seed=91):
        _dist_step(model, opt, x)
        _local_step(model, ref, x)
    model.assert_matches_local(what="user-registered QHM under mode='auto'")
    message = r"mode.* must be one of \('auto', 'eager'\) \(TorchScript's 'scripted' is gone"
    for mode in ("scripted", {"worker1": "scripted"}):
        with pytest.raises(ValueError, match=message):
            DistributedOptimizer(MyQHM, model.rrefs, mode=mode, **kwargs)


# -- param groups and the rest of torch.optim.Optimizer's interface ----------------------------

W, B = [0, 2, 4], [1, 3, 5]  # Model.ORDER: the weights' and the biases' positions


def _groups(seq: list[Any], *extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Weights at their own lr, biases without weight decay (``extra`` merged per group)."""
    return [
        {"params": [seq[i] for i in W], "lr": 0.03, **extra[0]},
        {"params": [seq[i] for i in B], "weight_decay": 0.0, **extra[1]},
    ]


def _check_param_groups(world_size: int) -> None:
    """Per-group hyperparameters, a LambdaLR with one lambda per group, add_param_group mid
    training, state_dict / load_state_dict with the groups (bit-exact resume): as torch.optim."""
    cases: list[tuple[type, dict[str, Any], str]] = [
        (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}, "auto"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, "eager"),
        (torch.optim.NAdam, {"lr": 0.05, "weight_decay": 0.1}, "auto"),  # torch.optim itself
        (QHM, {"lr": 0.1, "momentum": 0.9, "nu": 0.7, "weight_decay": 0.1}, "auto"),
    ]
    lambdas = [lambda k: 0.9**k, lambda k: 1.0 / (k + 1)]
    for n, (cls, kwargs, mode) in enumerate(cases):
        what = f"{cls.__name__} mode={mode}"
        model = Model(seed=100 + n)
        # The last bias joins later, in a group of its own.
        extra = ({}, {"lr": 0.02})
        first = _groups(model.rrefs, *extra)
        first[1]["params"] = first[1]["params"][:2]
        opt = DistributedOptimizer(cls, first, mode=mode, **kwargs)
        ref_groups = _groups(model.local, *extra)
        ref_groups[1]["params"] = ref_groups[1]["params"][:2]
        ref = cls(ref_groups, **kwargs)
        assert [len(g["params"]) for g in opt.param_groups] == [3, 2]
        for mine, theirs in zip(opt.param_groups, ref.param_groups, strict=True):
            assert {k: v for k, v in mine.items() if k != "params"} == {
                k: v for k, v in theirs.items() if k != "params"
            }, what
        xs = _inputs(6, seed=101)
        for step, x in enumerate(xs[:2]):
            _dist_step(model, opt, x)
            _local_step(model, ref, x)
            model.assert_matches_local(what=f"{what} step {step}")
        opt.add_param_group({"params": [model.rrefs[5]], "lr": 0.07})
        ref.add_param_group({"params": [model.local[5]], "lr": 0.07})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [*lambdas, lambdas[0]])
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, [*lambdas, lambdas[0]])
        for step, x in enumerate(xs[2:4]):
            _dist_step(model, opt, x)
            _local_step(model, ref, x)
            sched.step()
            ref_sched.step()
            assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
            model.assert_matches_local(what=f"{what} after add_param_group, step {step}")
        sd, ref_sd = opt.state_dict(), ref.state_dict()
        assert sd["param_groups"] == ref_sd["param_groups"], what
        _assert_same_state(sd, ref_sd, what)
        snapshot = model.values()
        for x in xs[4:]:
            _dist_step(model, opt, x)
        continued = model.values()
        # A fresh optimizer over fresh parameters, grouped alike, with other values: resumes.
        resumed = Model(seed=0, values=snapshot)
        groups = _groups(resumed.rrefs, {"lr": 9.0}, {})
        groups[1]["params"] = groups[1]["params"][:2]
        groups.append({"params": [resumed.rrefs[5]]})
        opt2 = DistributedOptimizer(cls, groups, mode=mode, **kwargs)
        opt2.load_state_dict(sd)
        assert opt2.param_groups[0]["lr"] == sd["param_groups"][0]["lr"]
        for x in xs[4:]:
            _dist_step(resumed, opt2, x)
        for i, (a, b) in enumerate(zip(continued, resumed.values(), strict=True)):
            assert torch.equal(a, b), f"{what}: param {i} differs after resume"
        with pytest.raises(ValueError, match=r"3 param group\(s\) of \[3, 2, 1\] parameters"):
            opt2.load_state_dict(ref_sd | {"param_groups": ref_sd["param_groups"][:2]})


def _check_param_groups_window_clip_scaler(world_size: int) -> None:
    """Accumulation, clipping and the grad scaler over param groups, as torch.optim does them."""
    kwargs = {"lr": 0.05, "weight_decay": 0.1}
    model = Model(seed=110)
    opt = DistributedOptimizer(
        torch.optim.AdamW, _groups(model.rrefs, {}, {}), backward_passes_per_step=2, **kwargs
    )
    ref = torch.optim.AdamW(_groups(model.local, {}, {}), **kwargs)
    xs = _inputs(4, seed=111)
    _window(model, opt, ref, xs[0:2])
    model.assert_matches_local(what="groups: accumulation window")
    scaler = DistributedGradScaler(init_scale=2.0**8)
    x = xs[2] * 3
    for k in range(2):  # one window: clip on the applying pass, after unscaling
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [scaler.scale(model.dist_loss(x))])
            if opt.next_step_applies:
                scaler.unscale_(opt, cid)
                total = clip_grad_norm_(opt, cid, max_norm=0.1)
            assert scaler.step(opt, cid) is (k == 1)
    scaler.update()
    ref.zero_grad()
    model.local_loss(x).backward()
    ref_total = torch.nn.utils.clip_grad_norm_(model.local, max_norm=0.1)
    ref.step()
    assert float(ref_total) > 0.1
    torch.testing.assert_close(total, ref_total, **TOL)
    model.assert_matches_local(what="groups: scaled, clipped window")


def _check_schedulers(world_size: int) -> None:
    """OneCycleLR (lr and betas per group) and ReduceLROnPlateau drive the groups as torch's."""
    model = Model(seed=120)
    opt = DistributedOptimizer(torch.optim.Adam, _groups(model.rrefs, {}, {}), lr=0.05)
    ref = torch.optim.Adam(_groups(model.local, {}, {}), lr=0.05)
    one = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.1, 0.05], total_steps=8)
    ref_one = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=[0.1, 0.05], total_steps=8)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    ref_plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(ref, patience=0, factor=0.5)
    for step, x in enumerate(_inputs(5, seed=121)):
        _dist_step(model, opt, x)
        _local_step(model, ref, x)
        one.step()
        ref_one.step()
        plateau.step(1.0)  # never improves: halves every lr after the first step
        ref_plateau.step(1.0)
        for mine, theirs in zip(opt.param_groups, ref.param_groups, strict=True):
            assert (mine["lr"], mine["betas"]) == (theirs["lr"], theirs["betas"]), step
        model.assert_matches_local(what=f"OneCycleLR + ReduceLROnPlateau step {step}")


def _check_optimizer_interface(world_size: int) -> None:
    """Hooks, zero_grad, __repr__ and pickling, each beside the same call on torch.optim."""
    model = Model(seed=130)
    opt = DistributedOptimizer(torch.optim.Adam, _groups(model.rrefs, {}, {}), lr=0.05)
    ref = torch.optim.Adam(_groups(model.local, {}, {}), lr=0.05)
    assert repr(opt) == repr(ref).replace("Adam (", "DistributedOptimizer of Adam (", 1)
    # step runs torch's hooks itself: torch did not wrap it (its wrapper costs 0.12 ms a step).
    assert not hasattr(DistributedOptimizer.step, "__wrapped__")
    calls: dict[str, list[str]] = {"opt": [], "ref": []}

    def recorder(name: str) -> Callable[..., None]:
        def hook(optimizer: Any, *args: Any) -> None:
            calls["opt" if optimizer is opt else "ref"].append(name)

        return hook

    handles = []
    for o in (opt, ref):
        handles += [
            o.register_step_pre_hook(recorder("pre")),
            o.register_step_post_hook(recorder("post")),
            o.register_state_dict_pre_hook(recorder("sd_pre")),
            o.register_load_state_dict_post_hook(recorder("load_post")),
        ]
    handles += [
        register_optimizer_step_pre_hook(recorder("global_pre")),
        register_optimizer_step_post_hook(recorder("global_post")),
    ]

    def mark(optimizer: Any, sd: dict[str, Any]) -> dict[str, Any]:
        return {**sd, "marked": len(sd["state"])}

    def halve_lr(optimizer: Any, sd: dict[str, Any]) -> None:
        sd["param_groups"] = [{**g, "lr": g["lr"] / 2} for g in sd["param_groups"]]

    for o in (opt, ref):
        o.register_state_dict_post_hook(mark)
        o.register_load_state_dict_pre_hook(halve_lr, prepend=True)
    try:
        for x in _inputs(2, seed=131):
            opt.zero_grad()  # a no-op here: no stale gradient reaches the next step anyway
            _dist_step(model, opt, x)
            _local_step(model, ref, x)  # (calls ref.zero_grad())
        model.assert_matches_local(what="with hooks and zero_grad")
        sd, ref_sd = opt.state_dict(), ref.state_dict()
        assert sd["marked"] == ref_sd["marked"] == 6
        opt.load_state_dict(sd)
        ref.load_state_dict(ref_sd)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
        assert opt.param_groups[0]["lr"] == 0.015
        assert calls["opt"] == calls["ref"], calls
        expected = ["global_pre", "pre", "post", "global_post"] * 2 + ["sd_pre", "load_post"]
        assert calls["opt"] == expected, calls
    finally:
        for handle in handles:
            handle.remove()
    # A step pre hook sees step's arguments and may replace them, as torch's may.
    other = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(_scalar(0.0))], lr=1.0)
    seen: list[Any] = []
    other.register_step_pre_hook(lambda o, args, kwargs: seen.append(args) or (args, kwargs))
    with dist_autograd.context() as cid:
        w = other.params_rref[0]
        dist_autograd.backward(cid, [w.local_value().sum() * 3])
        other.step(cid)
    assert seen == [(other, cid)]  # as torch's: (self, *args)
    assert w.local_value().item() == -3.0
    other.register_step_pre_hook(lambda o, args, kwargs: "wrong")
    with dist_autograd.context() as cid, pytest.raises(RuntimeError, match="must return None"):
        other.step(cid)
    for copy_it in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cannot be pickled or copied.*state_dict"):
            copy_it(opt)
    copy.deepcopy(ref)  # torch's own copies: a local optimizer holds its tensors


def _check_add_group_on_new_owners(world_size: int) -> None:
    """add_param_group mid-training with parameters of owners the optimizer had none on."""
    model = Model(seed=140)
    first = [i for i, (layer, _) in enumerate(Model.ORDER) if OWNERS[layer] == "worker1"]
    rest = [i for i in range(len(Model.ORDER)) if i not in first]
    kwargs = {"lr": 0.1, "momentum": 0.9}
    opt = DistributedOptimizer(torch.optim.SGD, [model.rrefs[i] for i in first], **kwargs)
    ref = torch.optim.SGD([model.local[i] for i in first], **kwargs)
    assert set(opt.describe()) == {"worker1"}
    for step, x in enumerate(_inputs(4, seed=141)):
        if step == 2:
            opt.add_param_group({"params": [model.rrefs[i] for i in rest], "lr": 0.05})
            ref.add_param_group({"params": [model.local[i] for i in rest], "lr": 0.05})
            assert set(opt.describe()) == set(OWNERS)
        _dist_step(model, opt, x)
        _local_step(model, ref, x)
        model.assert_matches_local(what=f"groups added on new owners, step {step}")


def _check_timeouts(world_size: int) -> None:
    """metadist's one convention: DEFAULT_TIMEOUT (the default) is the world's RPC timeout, None
    no limit (0.0, as torch's rpc_async takes it), a number that many seconds; each steps."""
    model = Model(seed=150)
    ref = torch.optim.SGD(model.local, lr=0.1)
    world = rpc.get_rpc_timeout()
    passed: list[tuple[dict[str, Any], float]] = [
        ({}, world),
        ({"timeout": DEFAULT_TIMEOUT}, world),
    ]
    passed += [({"timeout": None}, 0.0), ({"timeout": 30}, 30.0)]
    for kwargs, seconds in passed:
        opt = DistributedOptimizer(torch.optim.SGD, model.rrefs, lr=0.1, **kwargs)
        assert opt.timeout == seconds, (kwargs, opt.timeout)
        assert opt._lock.timeout == seconds
        x = _inputs(1, seed=151)[0]
        _dist_step(model, opt, x)
        _local_step(model, ref, x)
        model.assert_matches_local(what=f"{kwargs}")


SCENARIOS = [
    _check_timeouts,
    _check_bad_input,
    _check_equivalence,
    _check_accumulation,
    _check_window_checkpoint,
    _check_kernels,
    _check_kernels_unasked_follow_torch_optim,
    _check_flags_stay_fixed,
    _check_load_resets_accumulation,
    _check_scaler,
    _check_clipping,
    _check_state_dict,
    _check_lr_scheduler,
    _check_parameter_server,
    _check_user_twin_and_scripted_mode,
    _check_param_groups,
    _check_param_groups_window_clip_scaler,
    _check_schedulers,
    _check_optimizer_interface,
    _check_add_group_on_new_owners,
]


@pytest.fixture(scope="module")
def world() -> Scenarios:
    torch.manual_seed(0)
    return run_scenarios(SCENARIOS, 3, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s.__name__ for s in SCENARIOS])
def test_distributed_optimizer(world: Scenarios, name: str) -> None:
    world.check(name)


def test_requires_rpc_world() -> None:
    with pytest.raises(RuntimeError, match="auto_init_rpc"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
