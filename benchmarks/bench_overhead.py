"""What distributing a small MAML step costs: metadist against plain torch, the limit and peers.

The step is the sinusoid MAML of Finn et al.: a 1-40-40-1 MLP, 10 support and 10 query points
per task, one inner SGD step (lr 0.01) vectorised over the tasks with ``torch.func.vmap``, a
second-order meta-gradient and an Adam meta-step. Every variant computes the same mean loss over
the same meta-batch, on one thread per process, and is timed per full step (forward, backward,
meta-step):

* ``plain``: one process, no RPC, ``loss.backward()``, one thread; ``plain 2T``: the same on
  two threads (``torch.set_num_threads(2)``), what one process makes of both cores.
* ``limit``: what two processes can do at best: two plain processes with half the tasks each,
  started together before every step (a Gloo barrier), no communication; the slower one's
  median. The other two-process rows are reported as ratios to it.
* ``sync W=2``: the limit's two processes with one Gloo ``barrier`` after every step, and no data
  sent: each step now lasts as long as the slower half's, plus the barrier. It is the floor of
  any two-process step whose result needs both halves, whatever carries the data.
* ``md W=1``: metadist in a world of 1 (``python script.py``): ``remote_sync_call`` with the
  default partitioner, plain ``loss.backward()``; ``md ctx W=1``: the same in the torchopt form
  (below); ``torch ctx W=1``: plain torch's step in that form (``dist_autograd.context()``,
  ``dist_autograd.backward``, ``get_gradients`` into ``.grad``), its floor.
* ``md W=2``: the same call in a world of 2; rank 0 drives and computes its own half in-process.
* ``md ctx W=2``: the same in the torchopt form, ``metadist.autograd.context()`` and
  ``metadist.autograd.backward``.
* ``raw W=2``: hand-written ``torch.distributed.rpc``: the tasks split in two, one ``rpc_async``
  per worker (rank 0's own half included, as a plain fan-out does), parameters sent as
  ``p.view_as(p)`` so that distributed autograd links them, ``dist_autograd.backward``.
* ``spmd W=2``: the learn2learn pattern: each process computes the loss of its half, runs a
  local backward and averages the gradients with ``all_reduce`` (Gloo), then steps its own copy.

Every two-process variant runs in one world of 2 (RPC and a Gloo group in the same two
processes), interleaved round by round, so that all of them meet the machine in the same state;
``plain``, ``plain 2T`` and ``md W=1`` also run in a process of their own, interleaved. The
ratios printed are
medians of the per-round ratios (each round: the median of ``--steps`` steps), with their spread
(min-max). Each variant's meta-gradient is checked against ``plain``'s (relative error <= 1e-5).
``--plot`` saves speed-up against tasks per meta-batch, ``--json`` the rounds' medians.

``--summary DIR`` prints nothing but the one-screen table of every benchmark's JSON in ``DIR``
(what ``make bench`` ends with): per workload, each variant's median time and its ratio to that
workload's baseline (median of the per-round ratios, min-max).

Run: ``python benchmarks/bench_overhead.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import metadist
from metadist.network import free_loopback_port

INNER_LR = 0.01
SHOTS = 10
Params = dict[str, Tensor]


# --------------------------------------------------------------------------------------------
# The workload


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )


def make_batch(tasks: int) -> tuple[Tensor, ...]:
    """``(xs, ys, xq, yq)``: support and query points of ``tasks`` sinusoids."""
    g = torch.Generator().manual_seed(tasks)
    amp = torch.empty(tasks, 1, 1).uniform_(0.1, 5.0, generator=g)
    phase = torch.empty(tasks, 1, 1).uniform_(0.0, torch.pi, generator=g)
    x = torch.empty(tasks, 2 * SHOTS, 1).uniform_(-5.0, 5.0, generator=g)
    y = amp * torch.sin(x - phase)
    return x[:, :SHOTS], y[:, :SHOTS], x[:, SHOTS:], y[:, SHOTS:]


_MODEL = make_model()  # the architecture functional_call runs; its own tensors are never used


def _task_loss(params: Params, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> Tensor:
    def support_loss(p: Params) -> Tensor:
        return nn.functional.mse_loss(functional_call(_MODEL, p, (xs,)), ys)

    grads = grad(support_loss)(params)
    adapted = {k: v - INNER_LR * grads[k] for k, v in params.items()}
    return nn.functional.mse_loss(functional_call(_MODEL, adapted, (xq,)), yq)


def meta_loss(params: Params, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> Tensor:
    """Mean query loss after adaptation, over the tasks of the batch."""
    return vmap(_task_loss, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq).mean()


def module_meta_loss(model: nn.Module, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> Tensor:
    """What metadist runs per partition: the model travels as a differentiable argument."""
    return meta_loss(dict(model.named_parameters()), xs, ys, xq, yq)


def tensors_meta_loss(
    values: list[Tensor], xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor
) -> Tensor:
    """What the hand-written RPC version runs: parameters as a list of plain tensors."""
    names = [name for name, _ in _MODEL.named_parameters()]
    return meta_loss(dict(zip(names, values, strict=True)), xs, ys, xq, yq)


def step_workload(
    kind: str, tasks: int
) -> tuple[Callable[..., Tensor], nn.Module, tuple[Tensor, ...]]:
    """The loss, model and batch of a MAML step the other benchmarks time: this module's
    sinusoid step on ``tasks`` tasks, or (``kind="conv"``) ``bench_maml``'s conv step on its 8
    tasks, ``tasks`` ignored."""
    if kind == "conv":
        import bench_maml

        net, batch = bench_maml.workload_tensors()
        return bench_maml._metadist_loss, net, batch
    return module_meta_loss, make_model(), make_batch(tasks)


def flat_grad(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------
# One step of each variant (rank 0 / the single process drives)


def step_plain(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[Tensor, ...]) -> None:
    opt.zero_grad()
    module_meta_loss(model, *batch).backward()
    opt.step()


def metadist_loss(
    model: nn.Module, batch: tuple[Tensor, ...], partitioner: metadist.DimPartitioner | None
) -> Tensor:
    return metadist.remote_sync_call(
        module_meta_loss,
        args=(model, *batch),
        partitioner=partitioner,
        reducer=metadist.mean_reducer,
    )


def step_metadist(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[Tensor, ...],
    partitioner: metadist.DimPartitioner | None = None,
) -> None:
    opt.zero_grad()
    metadist_loss(model, batch, partitioner).backward()
    opt.step()


def step_metadist_context(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[Tensor, ...],
    partitioner: metadist.DimPartitioner | None = None,
) -> None:
    opt.zero_grad()
    with metadist.autograd.context() as ctx:
        metadist.autograd.backward(ctx, [metadist_loss(model, batch, partitioner)])
    opt.step()


def step_torch_context(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[Tensor, ...]
) -> None:
    opt.zero_grad()
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [module_meta_loss(model, *batch)])
        for p, g in dist_autograd.get_gradients(ctx).items():
            p.grad = g
    opt.step()


def step_plain_2t(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[Tensor, ...]) -> None:
    torch.set_num_threads(2)
    try:
        step_plain(model, opt, batch)
    finally:
        torch.set_num_threads(1)


def step_raw(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[Tensor, ...]) -> None:
    opt.zero_grad()
    world = 2  # ranks 0 and 1
    params = list(model.parameters())
    with dist_autograd.context() as ctx:
        chunks = [torch.tensor_split(t, world) for t in batch]
        futures = [
            rpc.rpc_async(
                r,
                tensors_meta_loss,
                args=([p.view_as(p) for p in params], *(c[r] for c in chunks)),
            )
            for r in range(world)
        ]
        sizes = [len(c) for c in chunks[0]]
        loss = sum(f.wait() * n for f, n in zip(futures, sizes, strict=True)) / sum(sizes)
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)
        for p in params:
            p.grad = grads[p]
    opt.step()


STEPS: dict[str, Callable[[nn.Module, torch.optim.Optimizer, tuple[Tensor, ...]], None]] = {
    "plain": step_plain,
    "plain 2T": step_plain_2t,
    "md W=1": step_metadist,
    "md ctx W=1": step_metadist_context,
    "torch ctx W=1": step_torch_context,
    "md W=2": step_metadist,
    "md ctx W=2": step_metadist_context,
    "raw W=2": step_raw,
}


def reference_grad(tasks: int) -> Tensor:
    model = make_model()
    module_meta_loss(model, *make_batch(tasks)).backward()
    return flat_grad(model)


def check_grad(name: str, tasks: int, step: Callable[..., None]) -> float:
    """Relative error of the variant's first meta-gradient against plain torch's."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step(model, opt, make_batch(tasks))
    ref = reference_grad(tasks)
    err = float((flat_grad(model) - ref).norm() / ref.norm())
    if err > 1e-5:
        raise AssertionError(f"{name}, {tasks} tasks: meta-gradient relative error {err:.2e}")
    return err


# --------------------------------------------------------------------------------------------
# Two-process variants without a driver: both ranks run them together


def _half(tasks: int, rank: int) -> tuple[list[Tensor], float]:
    half = [torch.tensor_split(t, 2)[rank] for t in make_batch(tasks)]
    return half, len(half[0]) / tasks  # the weight of this half in the global mean


def _spmd_step(model: nn.Module, opt: torch.optim.Optimizer, half: list[Tensor], w: float) -> None:
    opt.zero_grad()
    (module_meta_loss(model, *half) * w).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(reduced.view_as(g))
    opt.step()


def _limit_step(model: nn.Module, opt: torch.optim.Optimizer, half: list[Tensor], _: float) -> None:
    opt.zero_grad()
    module_meta_loss(model, *half).backward()
    opt.step()


def _sync_step(model: nn.Module, opt: torch.optim.Optimizer, half: list[Tensor], _: float) -> None:
    _limit_step(model, opt, half, _)
    dist.barrier()  # wait for the slower half, as any step that needs both halves does


PAIRS = {"limit": _limit_step, "sync W=2": _sync_step, "spmd W=2": _spmd_step}
_PAIR_SETUPS: dict[tuple[str, int], tuple[nn.Module, torch.optim.Optimizer]] = {}


def pair_round(name: str, tasks: int, steps: int) -> float:
    """This process's median ms over ``steps`` steps of two-process variant ``name``.

    Both ranks call it at once (rank 1 through RPC); a barrier starts every step together.
    """
    half, weight = _half(tasks, dist.get_rank())
    step = PAIRS[name]
    if (name, tasks) not in _PAIR_SETUPS:
        model = make_model()
        _PAIR_SETUPS[name, tasks] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
        for _ in range(3):  # warm up
            dist.barrier()
            step(*_PAIR_SETUPS[name, tasks], half, weight)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(*_PAIR_SETUPS[name, tasks], half, weight)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def spmd_grad(tasks: int) -> Tensor:
    """The SPMD variant's meta-gradient on this rank, from fresh parameters."""
    model = make_model()
    _spmd_step(model, torch.optim.SGD(model.parameters(), lr=0.0), *_half(tasks, dist.get_rank()))
    return flat_grad(model)


def leave() -> None:
    dist.barrier()  # leave together: a peer gone mid-teardown aborts Gloo's threads
    dist.destroy_process_group()


def _both(fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """``fn(*args)`` run on rank 0 (here) and on rank 1 at once: both results."""
    theirs = rpc.rpc_async(1, fn, args=args)
    mine = fn(*args)
    return mine, theirs.wait()


def time_interleaved(
    variants: list[str], tasks: int, steps: int, rounds: int
) -> dict[str, list[float]]:
    """Per variant, the median step time (ms) of each round; variants alternate every round.

    In the world of 2, the two-process variants (``PAIRS``) take their turn in each round too.
    """
    batch = make_batch(tasks)
    setups = {}
    for name in variants:
        model = make_model()
        setups[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
        for _ in range(3):  # warm up
            STEPS[name](*setups[name], batch)
    order = variants + (list(PAIRS) if dist.is_initialized() else [])
    out: dict[str, list[float]] = {name: [] for name in order}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            if name in PAIRS:
                out[name].append(max(_both(pair_round, name, tasks, steps)))  # the slower one
                continue
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                STEPS[name](*setups[name], batch)
                times.append((time.perf_counter() - start) * 1e3)
            out[name].append(statistics.median(times))
    return out


# --------------------------------------------------------------------------------------------
# Worlds


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


DRIVEN = ["plain", "md W=2", "md ctx W=2", "raw W=2"]


def _pair_child(rank: int, ports: tuple[int, int], cfg: dict[str, Any], out: str) -> None:
    _env(rank, 2, ports[0])

    @metadist.auto_init_rpc()
    def main() -> None:
        # A Gloo group beside RPC, in the same processes: every variant shares one world.
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=2
        )
        if rank != 0:
            return  # serves RPC, and through it its half of the two-process variants
        results: dict[str, Any] = {"times": {}, "errors": {}}
        for tasks in cfg["tasks"]:
            for name in DRIVEN[1:]:
                results["errors"][f"{name}/{tasks}"] = check_grad(name, tasks, STEPS[name])
            ref = reference_grad(tasks)
            errors = [float((g - ref).norm() / ref.norm()) for g in _both(spmd_grad, tasks)]
            results["errors"][f"spmd W=2/{tasks}"] = max(errors)
            results["times"][str(tasks)] = time_interleaved(
                DRIVEN, tasks, cfg["steps"], cfg["rounds"]
            )
        _both(leave)
        Path(out).write_text(json.dumps(results))

    main()


# The world of 1: metadist's two forms and their floor, beside plain torch on 1 and 2 threads.
W1 = ["md W=1", "md ctx W=1", "torch ctx W=1"]
ONE = ["plain", "plain 2T", *W1]


def _world_of_one(cfg: dict[str, Any], out: str) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)

    @metadist.auto_init_rpc()
    def main() -> None:
        results: dict[str, Any] = {"times": {}, "errors": {}}
        for tasks in cfg["tasks"]:
            for name in ONE[1:]:  # checked against plain
                results["errors"][f"{name}/{tasks}"] = check_grad(name, tasks, STEPS[name])
            results["times"][str(tasks)] = time_interleaved(ONE, tasks, cfg["steps"], cfg["rounds"])
        Path(out).write_text(json.dumps(results))

    main()


def _spawn_pair(cfg: dict[str, Any], out: str) -> None:
    ports = (free_loopback_port(), free_loopback_port())
    mp.start_processes(_pair_child, args=(ports, cfg, out), nprocs=2, start_method="spawn")


def _single(cfg: dict[str, Any], out: str) -> None:
    context = mp.get_context("spawn")
    process = context.Process(target=_world_of_one, args=(cfg, out))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"world of 1 failed with exit code {process.exitcode}")


# --------------------------------------------------------------------------------------------
# Report


def _merge(
    parts: list[dict[str, Any]],
) -> tuple[dict[int, dict[str, list[float]]], dict[str, float]]:
    times: dict[int, dict[str, list[float]]] = {}
    errors: dict[str, float] = {}
    for part in parts:
        errors.update(part["errors"])
        for tasks, per in part["times"].items():
            for name, rounds in per.items():
                key = name if name != "plain" or "md W=1" not in per else "plain (1)"
                key = "plain 2T (1)" if name == "plain 2T" else key
                times.setdefault(int(tasks), {})[key] = rounds
    return times, errors


def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median and spread of the per-round ratios a/b (rounds were interleaved)."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


NAMES = ["plain", "plain 2T", "limit", "md W=1", "md ctx W=1", "torch ctx W=1", "md W=2"]
NAMES += ["md ctx W=2", "raw W=2", "sync W=2", "spmd W=2"]


def report(times: dict[int, dict[str, list[float]]], errors: dict[str, float]) -> list[str]:
    lines = [
        "ms per step, median over rounds (median per-round ratio to the limit; md W=1 and plain "
        "2T: to the plain step timed beside them in their own process)",
        f"{'tasks':>5} " + " ".join(f"{n:>17}" for n in NAMES),
    ]
    for tasks in sorted(times):
        per = times[tasks]
        cells = []
        for name in NAMES:
            rounds = per.get(name if name != "plain 2T" else "plain 2T (1)")
            if rounds is None:
                cells.append(f"{'-':>17}")
                continue
            base = per["plain (1)"] if name in ("plain 2T", *W1) else per["limit"]
            ratio = _ratio(rounds, base)[0]
            cells.append(f"{statistics.median(rounds):6.2f} ({ratio:4.2f}x)".rjust(17))
        lines.append(f"{tasks:>5} " + " ".join(cells))
    lines += ["", "targets (ratios of interleaved rounds: median [min-max])"]

    def show(label: str, value: tuple[float, float, float], target: str, ok: bool | None) -> None:
        med, lo, hi = value
        verdict = "(a floor, not a target)" if ok is None else "met" if ok else "MISSED"
        lines.append(
            f"  {label:<38} {med:5.2f} [{lo:4.2f}-{hi:4.2f}]  target {target:<7} {verdict}"
        )

    for tasks in sorted(times):
        per = times[tasks]
        if tasks == 25 and "md W=1" in per:
            r = _ratio(per["torch ctx W=1"], per["plain (1)"])
            show("torch ctx W=1 / plain (25 tasks)", r, "-", None)
            for name in ("md W=1", "md ctx W=1"):
                r = _ratio(per[name], per["plain (1)"])
                show(f"{name} / plain (25 tasks)", r, "<= 1.05", r[0] <= 1.05)
        bound = {25: 1.3, 400: 1.15}.get(tasks)
        if bound is None:
            continue
        for name in ("sync W=2", "spmd W=2"):  # what the targets sit on, for scale
            show(f"{name} / limit ({tasks} tasks)", _ratio(per[name], per["limit"]), "-", None)
        for name in ("md W=2", "md ctx W=2"):
            r = _ratio(per[name], per["limit"])
            show(f"{name} / limit ({tasks} tasks)", r, f"<= {bound}", r[0] <= bound)
            r = _ratio(per[name], per["spmd W=2"])
            show(f"{name} / spmd W=2 ({tasks} tasks)", r, "<= 1.0", r[0] <= 1.0)
    lines.append("")
    worst = max(errors.values()) if errors else float("nan")
    lines.append(f"meta-gradients equal plain torch's: max relative error {worst:.1e} (<= 1e-5)")
    return lines


def workloads(times: dict[int, dict[str, list[float]]]) -> dict[str, Any]:
    """The summary's rows (see :func:`summary`): each size's step in the world of 2 beside the
    plain step timed there, and the 25-task step in a world of 1 beside its own plain step."""
    out: dict[str, Any] = {}
    for tasks, per in sorted(times.items()):
        rows = {name: per[name] for name in NAMES if name in per and "2T" not in name}
        for name in W1:
            rows.pop(name, None)
        rows["torch rpc"] = rows.pop("raw W=2")
        if "plain 2T (1)" in per:  # timed beside the world of 1's plain step: scaled to this one
            scale = [p / q for p, q in zip(per["plain"], per["plain (1)"], strict=True)]
            rows["plain 2T"] = [t * k for t, k in zip(per["plain 2T (1)"], scale, strict=True)]
        out[f"sinusoid {tasks}"] = {"base": "plain", "rounds": rows}
        if tasks == min(times) and "md W=1" in per:
            rows = {"plain": per["plain (1)"]} | {name: per[name] for name in W1}
            out[f"world of 1 ({tasks})"] = {"base": "plain", "rounds": rows}
    return out


# The summary's rows: every benchmark names its variants with these ("torch rpc": hand-written
# torch RPC, or torch's own DistributedOptimizer).
VARIANTS = ["plain 2T", "limit", "sync W=2", "spmd W=2", "md W=2", "md ctx W=2", "md W=1"]
VARIANTS += ["md ctx W=1", "torch ctx W=1", "md static", "torch rpc", "torchopt W=2"]


def summary(folder: Path) -> list[str]:
    """One screen from every ``*.json`` in ``folder``: per workload (a column), the baseline's
    median (ms) and each variant's speed-up over it (base / variant; median of the per-round
    ratios, and their min-max over rounds)."""
    columns: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")):
        columns.update(json.loads(path.read_text()).get("workloads", {}))
    names = list(columns)
    lines = [
        "speed-up over each workload's baseline (base / variant): median of interleaved rounds "
        "[min-max]",
        f"{'':13}" + "".join(f"{n:>18}" for n in names),
    ]
    base = [
        f"{c['base']} {statistics.median(c['rounds'][c['base']]):.2f} ms" for c in columns.values()
    ]
    lines.append(f"{'baseline':13}" + "".join(f"{b:>18}" for b in base))
    for variant in VARIANTS:
        cells = []
        for column in columns.values():
            if variant not in column["rounds"]:
                cells.append(f"{'-':>18}")
                continue
            med, lo, hi = _ratio(column["rounds"][column["base"]], column["rounds"][variant])
            cells.append(f"{med:.2f} [{lo:.2f}-{hi:.2f}]".rjust(18))
        if any(c.strip() != "-" for c in cells):
            lines.append(f"{variant:13}" + "".join(cells))
    return lines


def plot(times: dict[int, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted(times)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    styles = {
        "limit": "k-",
        "md W=2": "o-",
        "md ctx W=2": "d-",
        "spmd W=2": "s--",
        "raw W=2": "^:",
    }
    for name, style in styles.items():
        if all(name in times[t] for t in tasks):
            speedup = [
                statistics.median(times[t]["plain"]) / statistics.median(times[t][name])
                for t in tasks
            ]
            ax.plot(tasks, speedup, style, label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(tasks, [str(t) for t in tasks])
    ax.set_xlabel("tasks per meta-batch")
    ax.set_ylabel("speed-up over plain torch")
    ax.set_title("Sinusoid MAML step, 2-core CPU, 1 thread per process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="25,50,100,200,400", help="meta-batch sizes")
    parser.add_argument("--steps", type=int, default=15, help="steps per round and variant")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few sizes and steps")
    parser.add_argument("--plot", type=Path, help="save the speed-up plot (PNG) here")
    parser.add_argument("--json", type=Path, help="save the rounds' medians here")
    parser.add_argument("--summary", type=Path, help="print the summary of this folder's JSON")
    args = parser.parse_args()
    if args.summary:
        print("\n".join(summary(args.summary)))
        return
    # One thread per process, as torchrun starts them: OpenMP reads OMP_NUM_THREADS when torch
    # loads, so the children must start with it; set later (as _env does), it reaches only the
    # threads torch starts itself, not RPC handler threads.
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = {
        "tasks": [int(t) for t in args.tasks.split(",")],
        "steps": args.steps,
        "rounds": args.rounds,
    }
    if args.quick:
        cfg = {"tasks": [25, 400], "steps": 3, "rounds": 2}
    print(
        f"sinusoid MAML step (1-40-40-1 MLP, {SHOTS}+{SHOTS} points, 1 inner step, second order); "
        f"torch {torch.__version__}, {os.cpu_count()} cores, 1 thread per process; "
        f"{cfg['rounds']} rounds x {cfg['steps']} steps",
        flush=True,
    )
    parts = []
    with tempfile.TemporaryDirectory() as folder:
        for i, run in enumerate((_single, _spawn_pair)):
            out = os.path.join(folder, f"{i}.json")
            run(cfg, out)
            parts.append(json.loads(Path(out).read_text()))
    times, errors = _merge(parts)
    print("\n".join(report(times, errors)))
    if args.json:
        args.json.write_text(json.dumps({"workloads": workloads(times)}))
    if args.plot:
        plot(times, args.plot)
        print(f"plot saved to {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
