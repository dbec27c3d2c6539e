"""Probe: distributed autograd against local autograd on the same graph, in a world of 1.

Runs the few-shot MAML workload of ``bench_maml.py`` (8 tasks, second order) in one process,
once through ``@metadist.parallelize`` + ``metadist.autograd.backward`` (a world of 1: no
parallelism, one remote call to itself) and once as plain ``loss.backward()``, and prints the
median forward and backward times of both. The difference is the cost of the distributed
autograd machinery itself, which no amount of parallelism recovers.

Usage: python benchmarks/bench_dist_autograd.py [--repeats 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_maml import _metadist_loss, workload

import metadist

meta_loss = metadist.parallelize(
    partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer
)(_metadist_loss)


@metadist.auto_init_rpc()
def main(repeats: int) -> None:
    """Time both variants, interleaved so that drift affects them alike."""
    torch.set_num_threads(1)
    net, b = workload()
    args = (b.x_spt, b.y_spt, b.x_qry, b.y_qry)
    dist_times: list[tuple[float, float]] = []
    local_times: list[tuple[float, float]] = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        with metadist.autograd.context() as ctx:
            loss = meta_loss(net, *args)
            t1 = time.perf_counter()
            metadist.autograd.backward(ctx, [loss])
        t2 = time.perf_counter()
        net.zero_grad()
        t3 = time.perf_counter()
        local = _metadist_loss(net, *args)
        t4 = time.perf_counter()
        local.backward()
        t5 = time.perf_counter()
        net.zero_grad()
        if i >= 3:  # warm-up
            dist_times.append((t1 - t0, t2 - t1))
            local_times.append((t4 - t3, t5 - t4))

    def med(times: list[tuple[float, float]], k: int) -> float:
        return statistics.median(t[k] for t in times) * 1e3

    print(f"world of 1, 8 tasks, median of {repeats}:")
    print(
        f"  forward : metadist {med(dist_times, 0):6.1f} ms   local {med(local_times, 0):6.1f} ms"
    )
    print(
        f"  backward: metadist {med(dist_times, 1):6.1f} ms   local {med(local_times, 1):6.1f} ms"
    )
    print(f"  backward ratio distributed / local = {med(dist_times, 1) / med(local_times, 1):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    main(parser.parse_args().repeats)
