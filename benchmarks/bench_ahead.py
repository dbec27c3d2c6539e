"""What answering the backward ahead saves: the same 2-worker MAML step with and without it.

``bench_overhead``'s sinusoid MAML step in a world of 2 (rank 0 drives and computes its half
in-process), with ``metadist.ahead.ENABLED`` switched on the caller from one step to the next, so
both settings meet the machine in the same state: ``on``, the partitions run their backward
right after their forward with the gradient the last passes gave them (the worker's answer
travels with its reply), and the backward pass sends no gradient request; ``off``, every
backward is computed in its pass. Prints, per batch size and form (plain ``loss.backward()``,
``metadist.autograd.context()``), the median step of each setting and the median of the paired
ratios on/off with their 10th-90th percentiles; and, before timing, the largest relative
difference between the two settings' gradients of the same step.

``--workload conv`` times ``bench_maml``'s convolutional MAML step instead (8 tasks, a per-task
loop); there a partition's forward takes longer than ``metadist.ahead.MAX_FORWARD_S``, so
nothing runs ahead unless ``--max-forward`` raises that limit on both processes for the ``on``
steps (``--max-forward inf`` shows what the limit saves). ``--block N`` switches every N steps
and leaves the first step of each block untimed, so that a setting is timed after its own kind
of step (memory a step leaves behind shapes the next one's allocations).

Run: ``python benchmarks/bench_ahead.py`` (``--tasks 25,400``, ``--steps``, ``--forms``,
``--workload``, ``--block``, ``--max-forward``).
"""

from __future__ import annotations

import argparse
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
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead as workload

import metadist
from metadist import ahead
from metadist.network import free_loopback_port

WARMUP = 20


STEPS = {"plain": workload.step_metadist, "context": workload.step_metadist_context}
Step = Any  # (model, opt, batch) -> None


def conv_steps() -> dict[str, Step]:
    """``bench_maml``'s conv MAML step through metadist, in both forms."""
    import bench_maml

    call = metadist.parallelize(
        partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer
    )(bench_maml._metadist_loss)

    def plain(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
        opt.zero_grad()
        call(model, *batch).backward()
        opt.step()

    def context(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
        opt.zero_grad()
        with metadist.autograd.context() as ctx:
            metadist.autograd.backward(ctx, [call(model, *batch)])
        opt.step()

    return {"plain": plain, "context": context}


def _grads(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], step: Step) -> torch.Tensor:
    """The step's meta-gradient (the Adam step skipped: lr 0)."""
    step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch)
    return torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]


def set_max_forward(seconds: float) -> None:
    ahead.MAX_FORWARD_S = seconds


def _child(rank: int, port: int, cfg: dict[str, Any], out: str) -> None:
    workload._env(rank, 2, port)

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank != 0:
            return
        conv = cfg["workload"] == "conv"
        steps = conv_steps() if conv else STEPS
        block, limit, default = cfg["block"], cfg["max_forward"], ahead.MAX_FORWARD_S

        def switch(enabled: bool) -> None:
            ahead.ENABLED = enabled
            if limit is not None:  # the "on" steps under the given limit, on both processes
                seconds = limit if enabled else default
                set_max_forward(seconds)
                rpc.rpc_sync(1, set_max_forward, args=(seconds,))

        results: dict[str, Any] = {}
        for form in cfg["forms"]:
            for tasks in [8] if conv else cfg["tasks"]:
                _, model, batch = workload.step_workload(cfg["workload"], tasks)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                step = steps[form]
                switch(True)
                for _ in range(3):  # two passes agree: the next is answered ahead
                    _grads(model, batch, step)
                switch(False)
                off = _grads(model, batch, step)
                switch(True)
                _grads(model, batch, step)  # run ahead with the gradient of the pass before
                on = _grads(model, batch, step)
                error = ((on - off).norm() / off.norm()).item()
                times: dict[bool, list[float]] = {False: [], True: []}
                timed = block - 1 if block > 1 else 1  # timed steps per block
                warm = 2 if conv else WARMUP  # blocks
                for b in range(warm + 2 * -(-cfg["steps"] // timed)):
                    enabled = bool(b % 2)
                    switch(enabled)
                    for j in range(block):
                        start = time.perf_counter()
                        step(model, opt, batch)
                        if b >= warm and (block == 1 or j > 0):
                            times[enabled].append(time.perf_counter() - start)
                results[f"conv {form}" if conv else f"{form} {tasks}"] = {
                    "off": times[False],
                    "on": times[True],
                    "error": error,
                }
        Path(out).write_text(json.dumps(results))

    main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="25,400", help="tasks per meta-batch")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per setting")
    parser.add_argument("--forms", default="plain,context", help="plain, context or both")
    parser.add_argument("--workload", choices=("sinusoid", "conv"), default="sinusoid")
    parser.add_argument("--block", type=int, default=1, help="steps per setting in a row")
    parser.add_argument(
        "--max-forward", type=float, help="metadist.ahead.MAX_FORWARD_S for the on steps"
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun starts them
    cfg = {
        "tasks": [int(t) for t in args.tasks.split(",")],
        "steps": args.steps,
        "forms": args.forms.split(","),
        "workload": args.workload,
        "block": max(1, args.block),
        "max_forward": args.max_forward,
    }
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "times.json")
        mp.start_processes(
            _child, args=(free_loopback_port(), cfg, out), nprocs=2, start_method="spawn"
        )
        results = json.loads(Path(out).read_text())
    limit = "" if args.max_forward is None else f", on: MAX_FORWARD_S={args.max_forward}"
    print(
        f"2 workers, {args.workload} MAML step; torch {torch.__version__}; ms per step, "
        f"medians; blocks of {cfg['block']}{limit}"
    )
    print(f"{'form, tasks':<16}{'off':>9}{'on':>9}{'on/off [p10-p90]':>24}{'grad diff':>12}")
    for name, r in results.items():
        ratios = sorted(b / a for a, b in zip(r["off"], r["on"], strict=True))
        p10, p90 = ratios[len(ratios) // 10], ratios[len(ratios) * 9 // 10]
        print(
            f"{name:<16}{statistics.median(r['off']) * 1e3:>9.2f}"
            f"{statistics.median(r['on']) * 1e3:>9.2f}"
            f"{statistics.median(ratios):>10.3f} [{p10:.2f}-{p90:.2f}]"
            f"{r['error']:>12.1e}"
        )


if __name__ == "__main__":
    main()
