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

Run: ``python benchmarks/bench_ahead.py`` (``--tasks 25,400``, ``--steps``, ``--forms``).
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
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead as workload

import metadist
from metadist import ahead
from metadist.network import free_loopback_port

WARMUP = 20


STEPS = {"plain": workload.step_metadist, "context": workload.step_metadist_context}


def _grads(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], form: str) -> torch.Tensor:
    """The step's meta-gradient (the Adam step skipped: lr 0)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    STEPS[form](model, opt, batch)
    return torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]


def _child(rank: int, port: int, cfg: dict[str, Any], out: str) -> None:
    workload._env(rank, 2, port)

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank != 0:
            return
        results: dict[str, Any] = {}
        for form in cfg["forms"]:
            for tasks in cfg["tasks"]:
                model = workload.make_model()
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                batch = workload.make_batch(tasks)
                for _ in range(3):  # two passes agree: the next is answered ahead
                    _grads(model, batch, form)
                ahead.ENABLED = False
                off = _grads(model, batch, form)
                ahead.ENABLED = True
                _grads(model, batch, form)  # run ahead with the gradient of the pass before
                on = _grads(model, batch, form)
                error = ((on - off).norm() / off.norm()).item()
                times: dict[bool, list[float]] = {False: [], True: []}
                for i in range(WARMUP + 2 * cfg["steps"]):
                    ahead.ENABLED = enabled = bool(i % 2)
                    start = time.perf_counter()
                    STEPS[form](model, opt, batch)
                    if i >= WARMUP:
                        times[enabled].append(time.perf_counter() - start)
                ahead.ENABLED = True
                results[f"{form} {tasks}"] = {
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
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun starts them
    cfg = {
        "tasks": [int(t) for t in args.tasks.split(",")],
        "steps": args.steps,
        "forms": args.forms.split(","),
    }
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "times.json")
        mp.start_processes(
            _child, args=(free_loopback_port(), cfg, out), nprocs=2, start_method="spawn"
        )
        results = json.loads(Path(out).read_text())
    print(f"2 workers, sinusoid MAML step; torch {torch.__version__}; ms per step, medians")
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
