"""Forward and backward time of one 2-worker MAML step, for A/B runs of two metadist versions.

The step is ``bench_overhead``'s sinusoid MAML step as metadist runs it in a world of 2 (rank 0
drives and computes its half in-process, rank 1 the other half): ``forward`` is the
``parallelize``d call until its result is back, ``backward`` is ``loss.backward()`` (or, with
``--form context``, ``metadist.autograd.backward`` in a context),
``step`` the whole step with the Adam update. It prints the medians over ``--steps`` steps (after
10 untimed ones) as one JSON line, tagged with where ``metadist`` was imported from, so that two
versions can be compared by alternating runs, e.g. main against another checkout::

    python benchmarks/bench_phases.py --tasks 25
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_phases.py --tasks 25 --form context

Run: ``python benchmarks/bench_phases.py`` (``--tasks``, ``--steps``).
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

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead as workload

import metadist
from metadist.network import free_loopback_port

WARMUP = 10


def _child(rank: int, port: int, tasks: int, steps: int, out: str, form: str) -> None:  # noqa: PLR0917
    workload._env(rank, 2, port)  # the same world bench_overhead's variants run in

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank != 0:
            return
        model = workload.make_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        batch = workload.make_batch(tasks)
        call = metadist.parallelize(
            partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer
        )(workload.module_meta_loss)
        times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
        for i in range(WARMUP + steps):
            start = time.perf_counter()
            opt.zero_grad()
            if form == "plain":
                loss = call(model, *batch)
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
            else:
                with metadist.autograd.context() as ctx:
                    loss = call(model, *batch)
                    forward = time.perf_counter()
                    metadist.autograd.backward(ctx, [loss])
                    backward = time.perf_counter()
            opt.step()
            end = time.perf_counter()
            if i >= WARMUP:
                times["forward"].append(forward - start)
                times["backward"].append(backward - forward)
                times["step"].append(end - start)
        medians = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
        Path(out).write_text(json.dumps(medians))

    main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=25, help="tasks per meta-batch")
    parser.add_argument("--steps", type=int, default=200, help="timed steps")
    parser.add_argument(
        "--form",
        choices=("plain", "context"),
        default="plain",
        help="plain loss.backward() (metadist's main form since the own gradient path; the "
        "versions before it lose gradients that way) or a metadist.autograd.context",
    )
    args = parser.parse_args()
    # One thread per process, as torchrun starts them (OpenMP reads it when torch loads).
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "phases.json")
        spawn_args = (free_loopback_port(), args.tasks, args.steps, out, args.form)
        mp.spawn(_child, args=spawn_args, nprocs=2)
        medians = json.loads(Path(out).read_text())
    source = str(Path(metadist.__file__).resolve().parent.parent)
    print(json.dumps({"metadist": source, "form": args.form, "tasks": args.tasks, "ms": medians}))


if __name__ == "__main__":
    main()
