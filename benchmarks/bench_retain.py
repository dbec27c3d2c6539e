"""What keeping a graph through its backward costs: ``retain_graph=True`` against a freeing pass.

A backward run ahead (``metadist.ahead``) keeps its graph for a pass that may expect other
gradients. A freeing backward releases each node's saved tensors as it goes, and the allocator
hands that memory straight to the next ones; a keeping backward asks for fresh memory, which
glibc takes from the system page by page (a minor page fault each, the kernel zeroing it).
``metadist.ahead.MAX_FORWARD_S`` is set from what this costs against a round trip.

Two processes (one thread each) compute their half of a MAML step together, a barrier before
every step, as the two workers of a metadist step do; each step's backward alternates between
``torch.autograd.grad(loss, params)`` and the same with ``retain_graph=True``. For each
workload the script prints the backward's median ms (the slower process), its minor page
faults, and the ratio; ``--keep-memory`` runs the processes with glibc told to keep freed
memory (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``), which
takes the faults, and the difference, away.

Run: ``python benchmarks/bench_retain.py`` (``--tasks 25,400``, ``--steps``, ``--conv-steps``,
``--keep-memory``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "maml"))

KEEP_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 32),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 34),
    "MALLOC_TOP_PAD_": str(1 << 29),
}
WARMUP = 6


def _workload(kind: str, tasks: int, rank: int) -> tuple[Any, torch.nn.Module, list[torch.Tensor]]:
    import bench_overhead

    loss_fn, net, batch = bench_overhead.step_workload(kind, tasks)
    return loss_fn, net, [torch.tensor_split(t, 2)[rank] for t in batch]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _child(rank: int, barrier: Any, queue: Any, run: tuple[str, int, int]) -> None:
    kind, tasks, steps = run
    torch.set_num_threads(1)
    loss_fn, net, half = _workload(kind, tasks, rank)
    params = list(net.parameters())
    times: dict[bool, list[float]] = {False: [], True: []}
    faults: dict[bool, list[int]] = {False: [], True: []}
    for i in range(WARMUP + 2 * steps):
        retain = bool(i % 2)
        barrier.wait()
        loss = loss_fn(net, *half)
        before, start = _faults(), time.perf_counter()
        grads = torch.autograd.grad(loss, params, retain_graph=retain)
        took, faulted = time.perf_counter() - start, _faults() - before
        del loss, grads
        if i >= WARMUP:
            times[retain].append(took * 1e3)
            faults[retain].append(faulted)
    queue.put(
        {
            keep: (statistics.median(times[keep]), statistics.median(faults[keep]))
            for keep in (False, True)
        }
    )


def measure(kind: str, tasks: int, steps: int) -> dict[bool, tuple[float, float]]:
    """Per mode (retained or not), the slower process's median ms and its median faults."""
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, barrier, queue, (kind, tasks, steps))) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return {keep: max(r[keep] for r in results) for keep in (False, True)}


def main() -> None:
    """Parse options, time each workload, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="25,400", help="sinusoid meta-batch sizes")
    p.add_argument("--steps", type=int, default=100, help="steps per mode, sinusoid")
    p.add_argument("--conv-steps", type=int, default=6, help="steps per mode, conv (0: skip)")
    p.add_argument("--keep-memory", action="store_true", help="glibc keeps freed memory")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.keep_memory:
        os.environ.update(KEEP_MEMORY)  # read by the children's glibc when they start
    runs = [("sinusoid", int(n), args.steps) for n in args.tasks.split(",") if n]
    if args.conv_steps:
        runs.append(("conv", 8, args.conv_steps))
    memory = "glibc keeps freed memory" if args.keep_memory else "glibc defaults"
    print(f"backward of each process's half, 2 processes together; torch {torch.__version__}")
    print(f"{memory}; ms and minor page faults per backward, median (the slower process)")
    print(f"{'workload':<18}{'freeing':>10}{'retained':>10}{'ratio':>8}{'faults':>18}")
    for kind, tasks, steps in runs:
        r = measure(kind, tasks, steps)
        (free, free_faults), (kept, kept_faults) = r[False], r[True]
        name = f"{kind} {tasks} tasks"
        faults = f"{free_faults:.0f} / {kept_faults:.0f}"
        print(f"{name:<18}{free:>10.2f}{kept:>10.2f}{kept / free:>8.3f}{faults:>18}")


if __name__ == "__main__":
    main()
