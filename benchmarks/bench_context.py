"""What the context form's backward costs: torch's distributed engine on a local graph.

``metadist.autograd.backward(ctx, [loss])`` runs torch's distributed autograd engine, which
writes the context's gradient map, and then adds this pass's share of the map to ``.grad``;
``loss.backward()`` runs the local engine. In a metadist step the caller's own partition is
such a local graph. In a world of 1 this script times, step after step in turn, the backward of
the same MAML loss four ways:

* ``local``: ``loss.backward()``;
* ``torch``: ``torch.distributed.autograd.backward`` in a context, then the map into ``.grad``;
* ``metadist``: ``metadist.autograd.backward`` in ``metadist.autograd.context()``;
* ``local+map``: a design not adopted, ``torch.autograd.grad`` by the local engine, then the
  gradients written into the context's map (where torch's ``DistributedOptimizer`` and
  ``get_gradients`` read them) by a distributed pass through one node that returns them. It
  would run a leaf's tensor hooks twice (both engines run them), so it is timed, not used.

The loss is ``bench_overhead``'s sinusoid step on ``--tasks`` tasks (a worker's half of
``bench_overhead``'s batch sizes by default) and, unless ``--conv-steps 0``, ``bench_maml``'s
conv step on 4 tasks (half its batch). It prints each mode's median backward in ms, with the
10th-90th percentiles, its ratio to ``local``, and checks that all give the same gradients
bit for bit.

Run: ``python benchmarks/bench_context.py`` (``--tasks 12,200``, ``--steps``, ``--conv-steps``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "maml"))

import metadist  # noqa: E402

Loss = Callable[[], Tensor]
MODES = ("local", "torch", "metadist", "local+map")


class _Inject(torch.autograd.Function):
    """A root whose backward hands each leaf a given gradient."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[Tensor, ...], *leaves: Tensor) -> Tensor:
        ctx.grads = grads
        return leaves[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.grads)


def _backward(mode: str, net: nn.Module, loss_fn: Loss) -> float:
    """One forward, then the timed backward of ``mode``: seconds."""
    for p in net.parameters():
        p.grad = None
    if mode == "local":
        loss = loss_fn()
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start
    if mode == "torch":
        with dist_autograd.context() as ctx:
            loss = loss_fn()
            start = time.perf_counter()
            dist_autograd.backward(ctx, [loss])  # type: ignore[attr-defined]
            for p, g in dist_autograd.get_gradients(ctx).items():  # type: ignore[attr-defined]
                p.grad = g
            return time.perf_counter() - start
    if mode == "metadist":
        with metadist.autograd.context() as ctx:
            loss = loss_fn()
            start = time.perf_counter()
            metadist.autograd.backward(ctx, [loss])
            return time.perf_counter() - start
    params = [p for p in net.parameters() if p.requires_grad]
    with dist_autograd.context() as ctx:
        loss = loss_fn()
        start = time.perf_counter()
        grads = torch.autograd.grad(loss, params)
        dist_autograd.backward(ctx, [_Inject.apply(grads, *params)])  # type: ignore[attr-defined]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        took = time.perf_counter() - start
        written = dist_autograd.get_gradients(ctx)  # type: ignore[attr-defined]
    if not all(torch.equal(written[p], g) for p, g in zip(params, grads, strict=True)):
        raise AssertionError("local+map: the context's map differs from the gradients")
    return took


def measure(net: nn.Module, loss_fn: Loss, steps: int) -> dict[str, list[float]]:
    """Per mode, the backward's ms of each step; modes take turns, in a rotating order."""
    grads = {}
    for mode in MODES:
        _backward(mode, net, loss_fn)
        grads[mode] = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    for mode in MODES[1:]:
        same = len(grads[mode]) == len(grads["local"]) and all(
            torch.equal(a, b) for a, b in zip(grads[mode], grads["local"], strict=True)
        )
        if not same:
            raise AssertionError(f"{mode}'s gradients differ from the local engine's")
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(steps):
        k = i % len(MODES)
        for mode in MODES[k:] + MODES[:k]:
            times[mode].append(_backward(mode, net, loss_fn) * 1e3)
    return times


def _row(name: str, times: dict[str, list[float]]) -> str:
    base = statistics.median(times["local"])
    cells = []
    for mode in MODES:
        got = sorted(times[mode])
        med = statistics.median(got)
        p10, p90 = got[len(got) // 10], got[(len(got) * 9) // 10]
        cells.append(f"{med:.3f} [{p10:.2f}-{p90:.2f}] {med / base:.3f}x")
    return f"{name:<16}" + "".join(f"{c:>31}" for c in cells)


def main() -> None:
    """Parse options, time each workload, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="12,200", help="sinusoid tasks (a worker's half)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per mode, sinusoid")
    p.add_argument("--conv-steps", type=int, default=8, help="timed steps per mode, conv (0: none)")
    args = p.parse_args()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        os.environ.pop(name, None)  # a world of 1, whatever launched this
    torch.set_num_threads(1)

    @metadist.auto_init_rpc()
    def run() -> None:
        import bench_overhead

        print(f"backward of one MAML loss, world of 1, 1 thread; torch {torch.__version__}")
        print("ms per backward: median [p10-p90] and ratio to local; gradients equal bit for bit")
        print(f"{'workload':<16}" + "".join(f"{m:>31}" for m in MODES))
        runs = [("sinusoid", int(n), args.steps) for n in args.tasks.split(",") if n]
        if args.conv_steps:
            runs.append(("conv", 8, args.conv_steps))
        for kind, tasks, steps in runs:
            loss, net, batch = bench_overhead.step_workload(kind, tasks)
            if kind == "conv":
                batch = tuple(torch.tensor_split(t, 2)[0] for t in batch)  # a worker's half
            times = measure(net, functools.partial(loss, net, *batch), steps)
            print(_row(f"{kind} {len(batch[0])} tasks", times), flush=True)

    run()


if __name__ == "__main__":
    main()
