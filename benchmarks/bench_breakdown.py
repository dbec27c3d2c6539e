"""Where each millisecond of a 2-worker MAML step goes, on both processes, beside its floor.

The step is ``bench_overhead``'s sinusoid MAML step as metadist runs it in a world of 2 (rank 0
drives and computes its half in-process, rank 1 the other half), plain ``loss.backward()`` or
(``--form context``) ``metadist.autograd.context()``. Both processes note timestamps
(``time.perf_counter``, one clock for the whole machine) at the points below; the script prints,
for each interval, the median over ``--steps`` steps. To find those points it wraps a few
functions for the length of the run: torch RPC's pickler (private: the only place that sees a
message being pickled and unpickled), metadist's worker entry points and the partition's
function (a row whose function is gone from metadist shows ``-``). The wrappers cost about a
microsecond each.

The floors, measured in the same world right after: a round trip of a no-op ``rpc_sync``
without tensors and with the step's request arguments (the parameters and the worker's half of
the batch, as tensors), and the worker's half of the step (forward, then backward) run alone
on rank 0 while rank 1 idles.

``--workload conv`` runs ``bench_maml``'s convolutional MAML step instead (8 tasks, a per-task
loop; ``--tasks`` is ignored). The four rows before the totals show the step's shape: how long
the caller waits for the reply after its own forward (negative: the reply came first), how long
the worker idles between its reply and the gradient request, how long the caller runs its own
backward, and how long it then waits for the worker's answer.

Run: ``python benchmarks/bench_breakdown.py`` (``--tasks 2,25``, ``--steps``, ``--form``,
``--workload conv --steps 12``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead as workload

import metadist
from metadist import link
from metadist import worker as remote_worker
from metadist.network import free_loopback_port

WARMUP = 20
_MARKS: list[tuple[str, float]] = []


def _mark(label: str) -> None:
    _MARKS.append((label, time.perf_counter()))


def _around(owner: Any, name: str, label: str) -> None:
    """Mark ``label<`` and ``label>`` around every call of ``owner.name``."""
    original = getattr(owner, name, None)
    if original is None:  # (renamed or gone in this metadist: its rows stay empty)
        return

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _mark(label + "<")
        try:
            return original(*args, **kwargs)
        finally:
            _mark(label + ">")

    setattr(owner, name, wrapped)


_LOSS: list[Any] = [workload.module_meta_loss]  # the workload's, set per process by _child


def timed_loss(*args: Any) -> Any:
    """The partition's function: the workload's loss between two marks."""
    _mark("fn<")
    try:
        return _LOSS[0](*args)
    finally:
        _mark("fn>")


def _instrument() -> None:
    _around(rpc_api._default_pickler, "serialize", "pickle")
    _around(rpc_api._default_pickler, "deserialize", "unpickle")
    _around(remote_worker, "_vjp", "vjp")
    _around(link.RemoteGradients, "collect", "collect")


def noop(*_: Any) -> int:
    return 0


def clear_marks() -> None:
    _MARKS.clear()


def marks() -> list[tuple[str, float]]:
    return _MARKS


def _floors(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...], repeats: int
) -> dict[str, float]:
    half = [torch.tensor_split(t, 2)[1] for t in batch]
    tensors = [p.detach() for p in model.parameters()] + half
    out = {}
    for label, args in (("bare", ()), ("request", tuple(tensors))):
        times = []
        for _ in range(200):
            start = time.perf_counter()
            rpc.rpc_sync(1, noop, args=args)
            times.append(time.perf_counter() - start)
        out[label] = statistics.median(times[20:]) * 1e3
    forward, backward = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        loss = _LOSS[0](model, *half)
        middle = time.perf_counter()
        loss.backward()
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    out["forward"] = statistics.median(forward[repeats // 6 :]) * 1e3
    out["backward"] = statistics.median(backward[repeats // 6 :]) * 1e3
    return out


def _child(rank: int, port: int, cfg: dict[str, Any], out: str) -> None:
    workload._env(rank, 2, port)
    _instrument()
    # Both processes run the loss; rank 0 also builds the model and batch below.
    _LOSS[0] = workload.step_workload(cfg["workload"], 1)[0]
    warmup = 3 if cfg["workload"] == "conv" else WARMUP

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank != 0:
            return
        call = metadist.parallelize(
            partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer
        )(timed_loss)
        results: dict[str, Any] = {}
        for tasks in cfg["tasks"]:
            _, model, batch = workload.step_workload(cfg["workload"], tasks)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            for i in range(warmup + cfg["steps"]):
                if i == warmup:
                    clear_marks()
                    rpc.rpc_sync(1, clear_marks)
                _mark("step<")
                opt.zero_grad()
                if cfg["form"] == "plain":
                    loss = call(model, *batch)
                    _mark("forward>")
                    loss.backward()
                else:
                    with metadist.autograd.context() as ctx:
                        loss = call(model, *batch)
                        _mark("forward>")
                        metadist.autograd.backward(ctx, [loss])
                _mark("backward>")
                opt.step()
                _mark("step>")
            theirs = rpc.rpc_sync(1, marks)
            results[str(tasks)] = {
                "caller": list(_MARKS),
                "worker": theirs,
                "floors": _floors(model, batch, 6 if cfg["workload"] == "conv" else 60),
            }
        Path(out).write_text(json.dumps(results))

    main()


# Intervals: (label, (side, event, occurrence), (side, event, occurrence)); occurrences count
# within a step: the forward's request is the caller's first pickling, the gradient request its
# second, and so on.
C, W = "C", "W"
INTERVALS = [
    ("caller: partition, checks, encode", (C, "step<", 0), (C, "pickle<", 0)),
    ("caller: pickle the request", (C, "pickle<", 0), (C, "pickle>", 0)),
    ("wire: request to worker (RPC)", (C, "pickle>", 0), (W, "unpickle<", 0)),
    ("worker: unpickle the request", (W, "unpickle<", 0), (W, "unpickle>", 0)),
    ("worker: hand-off and decode until the function", (W, "unpickle>", 0), (W, "fn<", 0)),
    ("worker: the function (forward of its half)", (W, "fn<", 0), (W, "fn>", 0)),
    ("caller: the function (forward of its half)", (C, "fn<", 0), (C, "fn>", 0)),
    ("worker: keep the graph, pickle the reply", (W, "fn>", 0), (W, "pickle>", 0)),
    ("wire: reply to caller (RPC)", (W, "pickle>", 0), (C, "unpickle<", 0)),
    ("caller: unpickle, link, reduce, return", (C, "unpickle<", 0), (C, "forward>", 0)),
    (
        "backward: start until the gradient request is pickled",
        (C, "forward>", 0),
        (C, "pickle>", 1),
    ),
    ("wire: gradient request to worker (RPC)", (C, "pickle>", 1), (W, "unpickle<", 1)),
    ("worker: unpickle, hand-off", (W, "unpickle<", 1), (W, "vjp<", 0)),
    ("worker: torch.autograd.grad of its half", (W, "vjp<", 0), (W, "vjp>", 0)),
    ("worker: pickle the answer", (W, "vjp>", 0), (W, "pickle>", 1)),
    ("wire: answer to caller (RPC)", (W, "pickle>", 1), (C, "unpickle<", 1)),
    ("caller: answer applied, backward returns", (C, "unpickle<", 1), (C, "backward>", 0)),
    ("caller: waits for the worker's reply", (C, "fn>", 0), (C, "unpickle<", 0)),
    ("worker: idle from its reply to the gradient request", (W, "pickle>", 0), (W, "unpickle<", 1)),
    ("caller: own backward, until it needs the answers", (C, "pickle>", 1), (C, "collect<", 0)),
    ("caller: waits for the worker's answer", (C, "collect<", 0), (C, "collect>", 0)),
    ("forward (call returns)", (C, "step<", 0), (C, "forward>", 0)),
    ("backward", (C, "forward>", 0), (C, "backward>", 0)),
    ("Adam step", (C, "backward>", 0), (C, "step>", 0)),
    ("whole step", (C, "step<", 0), (C, "step>", 0)),
]


def _steps(caller: list[Any], worker: list[Any]) -> list[dict[tuple[str, str, int], float]]:
    """Per step, each event's time by (side, label, occurrence)."""
    events = sorted([(t, C, label) for label, t in caller] + [(t, W, label) for label, t in worker])
    steps: list[dict[tuple[str, str, int], float]] = []
    for t, side, label in events:
        if side == C and label == "step<":
            steps.append({})
        if not steps:
            continue
        seen = steps[-1]
        n = sum(1 for key in seen if key[:2] == (side, label))
        seen[side, label, n] = t
    return steps[:-1]  # the last one may miss the worker's last events


def report(results: dict[str, Any], form: str) -> list[str]:
    tasks = list(results)
    lines = [f"2 workers, {form} form; ms, median over steps (spread: 10th-90th percentile)"]
    lines.append(f"{'':56}" + "".join(f"{t + ' tasks':>22}" for t in tasks))
    per_tasks = {t: _steps(results[t]["caller"], results[t]["worker"]) for t in tasks}
    for label, a, b in INTERVALS:
        cells = []
        for t in tasks:
            values = sorted((s[b] - s[a]) * 1e3 for s in per_tasks[t] if a in s and b in s)
            if not values:
                cells.append(f"{'-':>22}")
                continue
            lo, hi = values[len(values) // 10], values[(len(values) * 9) // 10]
            cells.append(f"{statistics.median(values):7.3f} [{lo:5.2f}-{hi:5.2f}]".rjust(22))
        lines.append(f"{label:56}" + "".join(cells))
    lines.append("")
    lines.append("floors (same world, right after)")
    names = {
        "bare": "no-op rpc_sync round trip, no tensors",
        "request": "no-op rpc_sync round trip, the request's tensors",
        "forward": "the worker's half alone on rank 0: forward",
        "backward": "the worker's half alone on rank 0: backward",
    }
    for key, name in names.items():
        cells = "".join(f"{results[t]['floors'][key]:7.3f}".rjust(22) for t in tasks)
        lines.append(f"{name:56}" + cells)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="2,25", help="tasks per meta-batch")
    parser.add_argument("--steps", type=int, default=200, help="timed steps")
    parser.add_argument("--form", choices=("plain", "context"), default="plain")
    parser.add_argument("--workload", choices=("sinusoid", "conv"), default="sinusoid")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun starts them
    cfg = {
        "tasks": [int(t) for t in args.tasks.split(",")],
        "steps": args.steps,
        "form": args.form,
        "workload": args.workload,
    }
    if args.workload == "conv":
        cfg["tasks"] = [8]  # bench_maml's batch
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "marks.json")
        mp.start_processes(
            _child, args=(free_loopback_port(), cfg, out), nprocs=2, start_method="spawn"
        )
        results = json.loads(Path(out).read_text())
    print("\n".join(report(results, args.form)))


if __name__ == "__main__":
    main()
