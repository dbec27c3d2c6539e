"""Benchmark: metadist's DistributedOptimizer vs torch.distributed.optim.DistributedOptimizer.

Spawns its own world of 3 over loopback (rank 0 drives; the parameters live on worker1 and
worker2, half each). For Adam and SGD (momentum 0.9), for 100 x 1,000 and 10 x 100,000 float32
parameters, it times ``step(context_id)`` (the gradients are computed once per context; both
optimizers re-read them from the context on every step) and prints median step times and the
ratio metadist / torch. Targets: <= 0.5 for the many small parameters, <= 1.0 for the few large.
It also prints metadist's modes side by side: "auto" (eager, fused/foreach kernels) vs
"scripted" (TorchScript).

Usage: python benchmarks/bench_optim.py [--reps 50] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.optim as torch_dist_optim
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

import metadist
from metadist.network import free_loopback_port
from metadist.optim import DistributedOptimizer

OWNERS = ("worker1", "worker2")


def _make_param(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).requires_grad_(True)


def _owner_loss(rrefs: list[rpc.RRef[torch.Tensor]]) -> torch.Tensor:
    # A loss whose gradient is dense and non-trivial for every element.
    return sum((r.local_value() * r.local_value()).sum() for r in rrefs)  # type: ignore[return-value]


def _time_steps(opt: Any, rrefs_by_owner: dict[str, list[Any]], reps: int) -> float:
    with dist_autograd.context() as cid:
        losses = [rpc.rpc_sync(o, _owner_loss, args=(rs,)) for o, rs in rrefs_by_owner.items()]
        dist_autograd.backward(cid, [torch.stack(losses).sum()])
        for _ in range(3):
            opt.step(cid)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            opt.step(cid)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _driver(reps: int, quick: bool) -> None:
    shapes = [(100, 1_000), (10, 100_000)]
    if quick:
        shapes = [(10, 100), (2, 1_000)]
    algos: list[tuple[str, type, dict[str, Any]]] = [
        ("Adam", torch.optim.Adam, {"lr": 1e-3}),
        ("SGD", torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    ]
    print(
        f"{'algorithm':<6} {'params':>12} {'torch ms':>9} {'metadist ms':>12} {'ratio':>6} "
        f"{'target':>6} {'scripted ms':>12} {'kernel':>8}"
    )
    for count, numel in shapes:
        rrefs = [
            rpc.remote(OWNERS[i % len(OWNERS)], _make_param, args=(numel, i)) for i in range(count)
        ]
        by_owner: dict[str, list[Any]] = {}
        for r in rrefs:
            by_owner.setdefault(r.owner().name, []).append(r)
        target = 0.5 if numel < 10_000 else 1.0
        for name, cls, kwargs in algos:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's TorchScript deprecation notices
                theirs = torch_dist_optim.DistributedOptimizer(cls, rrefs, **kwargs)
            ours = DistributedOptimizer(cls, rrefs, **kwargs)
            scripted = DistributedOptimizer(cls, rrefs, mode="scripted", **kwargs)
            kernel = next(iter(ours.describe().values()))[1]
            t_theirs = _time_steps(theirs, by_owner, reps)
            t_ours = _time_steps(ours, by_owner, reps)
            t_scripted = _time_steps(scripted, by_owner, reps)
            ratio = t_ours / t_theirs
            print(
                f"{name:<6} {f'{count}x{numel:,}':>12} {t_theirs * 1e3:9.3f} {t_ours * 1e3:12.3f} "
                f"{ratio:6.2f} {'<=' + str(target):>6} {t_scripted * 1e3:12.3f} {kernel:>8}",
                flush=True,
            )


def _child(rank: int, world_size: int, port: int, reps: int, quick: bool) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    # torch's own DistributedOptimizer (the baseline) warns that TorchScript is deprecated in
    # every process, under simplefilter("always") so no filter reaches it: drop it at display.
    show = warnings.showwarning

    def showwarning(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if "support for functional optimizers is deprecated" not in str(message):
            show(message, *args, **kwargs)

    warnings.showwarning = showwarning

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank == 0:
            _driver(reps, quick)

    main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50, help="timed steps per configuration")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args()
    mp.start_processes(
        _child,
        args=(3, free_loopback_port(), args.reps, args.quick),
        nprocs=3,
        join=True,
        start_method="spawn",
    )


if __name__ == "__main__":
    main()
