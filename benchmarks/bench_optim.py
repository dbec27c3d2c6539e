"""Benchmark: a DistributedOptimizer step against its floor and against torch's.

A step sends one request to each owner, so its floor is a no-op ``rpc_sync`` round trip to the
owner plus the owner's own update. This spawns a world of 3 over loopback (rank 0 drives, every
parameter lives on worker1, worker2 idles), once per configuration:

* ``metadist``: ``auto_init_rpc``'s defaults (TensorPipe over TCP only, one malloc arena);
* ``torch``: torch's defaults (TensorPipe's default transports, shared memory included, and
  glibc's default malloc arenas: ``METADIST_MALLOC_ARENA_MAX=0``), as ``rpc.init_rpc`` gives.

For Adam and SGD (momentum 0.9) on 100 x 1,000 and 10 x 100,000 float32 parameters it times, in
interleaved rounds: the round trip (``rpc_sync`` of a no-op), the update run back to back on
worker1 itself (``torch.optim`` with ``fused=True``, the kernel metadist picks there; floor = round
trip + update), ``rpc(upd)``: an ``rpc_sync`` whose function runs that same update (what a step
costs with no optimizer machinery at all), metadist's ``step`` and
``torch.distributed.optim.DistributedOptimizer.step``. It prints medians, the spread of the round
medians, and the ratios against the targets (metadist <= 1.3 x floor; <= 0.5 x torch for Adam on
100 x 1,000).

Usage: python benchmarks/bench_optim.py [--world both|metadist|torch] [--reps 60] [--rounds 5]
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

OWNER = "worker1"
SHAPES = ((100, 1_000), (10, 100_000))
ALGOS: dict[str, tuple[type, dict[str, Any]]] = {
    "Adam": (torch.optim.Adam, {"lr": 1e-3}),
    "SGD": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
}


def _make_param(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).requires_grad_(True)


def _owner_loss(rrefs: list[rpc.RRef[torch.Tensor]]) -> torch.Tensor:
    # A loss whose gradient is dense and non-trivial for every element.
    return sum((r.local_value() * r.local_value()).sum() for r in rrefs)  # type: ignore[return-value]


def _noop() -> None:
    return None


_OWNED: dict[str, torch.optim.Optimizer] = {}


def _prepare_update(algo: str, count: int, numel: int) -> None:
    """Build, on this owner, the same update metadist runs there: torch.optim, fused kernel."""
    cls, kwargs = ALGOS[algo]
    params = [_make_param(numel, i) for i in range(count)]
    for p in params:
        p.grad = 2 * p.detach()
    _OWNED["opt"] = cls(params, fused=True, **kwargs)
    _OWNED["opt"].step()


def _update() -> None:
    _OWNED["opt"].step()


def _local_update(reps: int) -> list[float]:
    """Time ``reps`` back-to-back updates here, in an RPC thread like a real step."""
    return _timed(_update, reps)


def _timed(call: Any, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _measure(algo: str, count: int, numel: int, reps: int, rounds: int) -> dict[str, Any]:
    cls, kwargs = ALGOS[algo]
    rrefs = [rpc.remote(OWNER, _make_param, args=(numel, i)) for i in range(count)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's TorchScript deprecation notices
        theirs = torch_dist_optim.DistributedOptimizer(cls, rrefs, **kwargs)
    ours = DistributedOptimizer(cls, rrefs, **kwargs)
    rpc.rpc_sync(OWNER, _prepare_update, args=(algo, count, numel))
    keys = ("rtt", "update", "rpc_update", "ours", "torch")
    samples: dict[str, list[list[float]]] = {k: [] for k in keys}
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [rpc.rpc_sync(OWNER, _owner_loss, args=(rrefs,))])
        for opt in (ours, theirs):  # warm up both (torch's compiles its TorchScript here)
            for _ in range(3):
                opt.step(cid)
        for _ in range(rounds):
            samples["rtt"].append(_timed(lambda: rpc.rpc_sync(OWNER, _noop), reps))
            samples["update"].append(rpc.rpc_sync(OWNER, _local_update, args=(reps,)))
            samples["rpc_update"].append(_timed(lambda: rpc.rpc_sync(OWNER, _update), reps))
            samples["ours"].append(_timed(lambda: ours.step(cid), reps))
            samples["torch"].append(_timed(lambda: theirs.step(cid), reps))
    out: dict[str, Any] = {"kernel": ours.describe()[OWNER][1]}
    for key, per_round in samples.items():
        out[key] = statistics.median(t for r in per_round for t in r)
        medians = [statistics.median(r) for r in per_round]
        out[key + "_spread"] = (min(medians), max(medians))
    return out


def _driver(world: str, reps: int, rounds: int, quick: bool) -> None:
    shapes = ((10, 100), (2, 1_000)) if quick else SHAPES
    print(f"\n== {world} world ({rounds} rounds x {reps} steps; ms, medians [round spread]) ==")
    print(
        f"{'algo':<5} {'params':>10} {'rtt':>6} {'update':>7} {'floor':>6} {'rpc(upd)':>8} "
        f"{'metadist':>18} {'torch':>18} {'md/floor':>11} {'md/rpc(upd)':>11} {'md/torch':>11}"
    )
    for count, numel in shapes:
        for algo in ALGOS:
            r = _measure(algo, count, numel, reps, rounds)
            floor = r["rtt"] + r["update"]
            to_floor, to_torch = r["ours"] / floor, r["ours"] / r["torch"]
            big = (algo, count, numel) == ("Adam", 100, 1_000)
            (lo, hi), (tlo, thi) = r["ours_spread"], r["torch_spread"]
            print(
                f"{algo:<5} {f'{count}x{numel:,}':>10} {r['rtt'] * 1e3:6.3f} "
                f"{r['update'] * 1e3:7.3f} {floor * 1e3:6.3f} {r['rpc_update'] * 1e3:8.3f} "
                f"{r['ours'] * 1e3:6.3f} [{lo * 1e3:.2f}-{hi * 1e3:.2f}] "
                f"{r['torch'] * 1e3:6.3f} [{tlo * 1e3:.2f}-{thi * 1e3:.2f}] "
                f"{to_floor:5.2f} {'ok' if to_floor <= 1.3 else '>1.3':>5} "
                f"{r['ours'] / r['rpc_update']:11.2f} "
                f"{to_torch:5.2f} {('ok' if to_torch <= 0.5 else '>0.5') if big else '':>5}",
                flush=True,
            )


def _child(rank: int, world: str, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="3",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="3",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    options = None
    if world == "torch":
        os.environ["METADIST_MALLOC_ARENA_MAX"] = "0"  # leave glibc's arenas as torch has them
        options = rpc.TensorPipeRpcBackendOptions()  # torch's default transports
    # torch's own DistributedOptimizer (the baseline) warns that TorchScript is deprecated in
    # every process, under simplefilter("always") so no filter reaches it: drop it at display.
    show = warnings.showwarning

    def showwarning(message: Warning | str, *args: Any, **kwargs: Any) -> None:
        if "support for functional optimizers is deprecated" not in str(message):
            show(message, *args, **kwargs)

    warnings.showwarning = showwarning

    @metadist.auto_init_rpc(rpc_backend_options=options)
    def main() -> None:
        if rank == 0:
            _driver(world, args.reps, args.rounds, args.quick)

    main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", choices=("both", "metadist", "torch"), default="both")
    parser.add_argument("--reps", type=int, default=60, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args()
    worlds = ("metadist", "torch") if args.world == "both" else (args.world,)
    for world in worlds:
        mp.start_processes(
            _child,
            args=(world, free_loopback_port(), args),
            nprocs=3,
            join=True,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
