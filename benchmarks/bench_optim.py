"""Benchmark: a DistributedOptimizer step against its floor and against torch's.

A step sends one request to each owner, so its floor is a no-op ``rpc_sync`` round trip to the
owner plus the owner's own update. This spawns a world of 3 over loopback (rank 0 drives, every
parameter lives on worker1, worker2 idles), once per configuration:

* ``metadist``: ``auto_init_rpc``'s defaults (TensorPipe over TCP only, one malloc arena);
* ``torch``: torch's defaults (TensorPipe's default transports, shared memory included, and
  glibc's default malloc arenas: ``METADIST_MALLOC_ARENA_MAX=0``), as ``rpc.init_rpc`` gives.

For Adam and SGD (momentum 0.9) on 100 x 1,000 and 10 x 100,000 float32 parameters it times, in
interleaved rounds: the round trip (``rpc_sync`` of a no-op), the update on worker1 itself
(``torch.optim`` with ``fused=True``, the kernel metadist picks there, over the same parameters;
floor = round trip + update), ``rpc(upd)``: an ``rpc_sync`` whose function runs that same update
(what a step costs with no optimizer machinery at all), metadist's ``step`` and
``torch.distributed.optim.DistributedOptimizer.step``.

Two ways, both printed:

* **fresh** (the main one): as a training loop steps, each timed call in a distributed-autograd
  context of its own, right after that context's forward and backward (untimed); the update reads
  that backward's gradients;
* **same**: every call repeated in one context (warm caches, no context traffic).

It prints medians, the spread of the round medians, and metadist / floor (target <= 1.3).

Usage: python benchmarks/bench_optim.py [--world both|metadist|torch] [--reps 40] [--rounds 5]
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


def _prepare_update(algo: str, rrefs: list[rpc.RRef[torch.Tensor]]) -> None:
    """Build, on this owner, the same update metadist runs there (torch.optim, fused kernel), over
    the same parameters."""
    cls, kwargs = ALGOS[algo]
    params = [r.local_value() for r in rrefs]
    for p in params:
        p.grad = 2 * p.detach()
    _OWNED["opt"] = cls(params, fused=True, **kwargs)
    _OWNED["opt"].step()


def _update(context_id: int | None = None) -> float:
    """One update (with the gradients of ``context_id`` when given); return its duration."""
    opt = _OWNED["opt"]
    if context_id is not None:
        grads = dist_autograd.get_gradients(context_id)
        for p in opt.param_groups[0]["params"]:
            p.grad = grads[p]
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def _local_update(reps: int) -> list[float]:
    """Time ``reps`` back-to-back updates here, in an RPC thread like a real step."""
    return [_update() for _ in range(reps)]


def _timed(call: Any, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


KEYS = ("rtt", "update", "rpc_update", "ours", "torch")


def _fresh_round(rrefs: list[Any], ours: Any, theirs: Any, reps: int) -> dict[str, list[float]]:
    """``reps`` samples of every key, each in a fresh context right after its backward; the keys
    interleaved so that they share the machine's state alike."""
    out: dict[str, list[float]] = {k: [] for k in KEYS}
    for _ in range(reps):
        for key in KEYS:
            with dist_autograd.context() as cid:
                loss = rpc.rpc_sync(OWNER, _owner_loss, args=(rrefs,))
                dist_autograd.backward(cid, [loss])
                start = time.perf_counter()
                if key == "rtt":
                    rpc.rpc_sync(OWNER, _noop)
                elif key == "update":
                    out[key].append(rpc.rpc_sync(OWNER, _update, args=(cid,)))
                    continue
                elif key == "rpc_update":
                    rpc.rpc_sync(OWNER, _update, args=(cid,))
                else:
                    (ours if key == "ours" else theirs).step(cid)
                out[key].append(time.perf_counter() - start)
    return out


def _same_round(ours: Any, theirs: Any, cid: int, reps: int) -> dict[str, list[float]]:
    """``reps`` samples of every key, all in the one context ``cid``."""
    return {
        "rtt": _timed(lambda: rpc.rpc_sync(OWNER, _noop), reps),
        "update": rpc.rpc_sync(OWNER, _local_update, args=(reps,)),
        "rpc_update": _timed(lambda: rpc.rpc_sync(OWNER, _update), reps),
        "ours": _timed(lambda: ours.step(cid), reps),
        "torch": _timed(lambda: theirs.step(cid), reps),
    }


def _summary(rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in KEYS:
        out[key] = statistics.median(t for r in rounds for t in r[key])
        medians = [statistics.median(r[key]) for r in rounds]
        out[key + "_spread"] = (min(medians), max(medians))
    out["floor"] = out["rtt"] + out["update"]
    return out


def _measure(algo: str, count: int, numel: int, reps: int, rounds: int) -> dict[str, Any]:
    cls, kwargs = ALGOS[algo]
    rrefs = [rpc.remote(OWNER, _make_param, args=(numel, i)) for i in range(count)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's TorchScript deprecation notices
        theirs = torch_dist_optim.DistributedOptimizer(cls, rrefs, **kwargs)
    ours = DistributedOptimizer(cls, rrefs, **kwargs)
    rpc.rpc_sync(OWNER, _prepare_update, args=(algo, rrefs))
    fresh, same = [], []
    for n in range(rounds + 1):
        if n:
            fresh.append(_fresh_round(rrefs, ours, theirs, reps))
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [rpc.rpc_sync(OWNER, _owner_loss, args=(rrefs,))])
            if not n:  # warm up both (torch's compiles its TorchScript here)
                for _ in range(3):
                    ours.step(cid)
                    theirs.step(cid)
            else:
                same.append(_same_round(ours, theirs, cid, reps))
    return {"kernel": ours.describe()[OWNER][1], "fresh": _summary(fresh), "same": _summary(same)}


def _driver(world: str, reps: int, rounds: int, quick: bool) -> None:
    shapes = ((10, 100), (2, 1_000)) if quick else SHAPES
    print(f"\n== {world} world ({rounds} rounds x {reps} steps; ms, medians [round spread]) ==")
    print(
        f"{'algo':<5} {'params':>10} {'contexts':>8} {'rtt':>6} {'update':>7} {'floor':>6} "
        f"{'rpc(upd)':>8} {'metadist':>18} {'torch':>18} {'md/floor':>11} {'md/torch':>8}"
    )
    for count, numel in shapes:
        for algo in ALGOS:
            m = _measure(algo, count, numel, reps, rounds)
            for way in ("fresh", "same"):
                r = m[way]
                to_floor = r["ours"] / r["floor"]
                (lo, hi), (tlo, thi) = r["ours_spread"], r["torch_spread"]
                print(
                    f"{algo:<5} {f'{count}x{numel:,}':>10} {way:>8} {r['rtt'] * 1e3:6.3f} "
                    f"{r['update'] * 1e3:7.3f} {r['floor'] * 1e3:6.3f} "
                    f"{r['rpc_update'] * 1e3:8.3f} "
                    f"{r['ours'] * 1e3:6.3f} [{lo * 1e3:.2f}-{hi * 1e3:.2f}] "
                    f"{r['torch'] * 1e3:6.3f} [{tlo * 1e3:.2f}-{thi * 1e3:.2f}] "
                    f"{to_floor:5.2f} {'ok' if to_floor <= 1.3 else '>1.3':>5} "
                    f"{r['ours'] / r['torch']:8.2f}",
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
    parser.add_argument("--reps", type=int, default=40, help="timed steps per round")
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
