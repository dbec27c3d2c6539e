"""What does the optimizer step cost? A DistributedOptimizer step against its floor.

A step sends one request to each owner, so its floor is a no-op ``rpc_sync`` round trip to the
owner plus the owner's own update. This spawns a world of 2 over loopback (``auto_init_rpc``'s
defaults; rank 0 drives, every parameter lives on worker1) and, as a training loop steps, times
each call in a distributed-autograd context of its own, right after that context's forward and
backward (untimed):

* **first steps**: the job's first DistributedOptimizer made (one request per owner, which
  builds the owner's optimizer), then its first, second and third steps (one-time imports and
  allocations included where they fall);
* in interleaved rounds (one sample of each per turn, ``--reps`` turns per round): **rtt**, a
  no-op ``rpc_sync``; **update**, ``torch.optim.X(fused=True).step()`` on the owner over the same
  parameters and that backward's gradients, timed there; **floor** = rtt + update;
  **metadist**'s ``step``; and torch's ``torch.distributed.optim.DistributedOptimizer.step``
  (made after the first steps above, as it imports what metadist's avoids).

For Adam and SGD (momentum 0.9) on 100 x 1,000 and 10 x 100,000 float32 parameters it prints
medians over all samples (ms), and metadist / floor and metadist / torch as the median of the
rounds' ratios with their min-max.

Usage: python benchmarks/bench_optim.py [--reps 30] [--rounds 5] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
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
KEYS = ("rtt", "update", "ours", "torch")


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
    """The update metadist runs on this owner (torch.optim, fused kernel), over copies of the
    parameters (the steps timed beside it keep stepping the originals)."""
    cls, kwargs = ALGOS[algo]
    _OWNED["opt"] = cls([r.local_value().detach().clone() for r in rrefs], fused=True, **kwargs)
    _OWNED["params"] = [r.local_value() for r in rrefs]  # type: ignore[assignment]


def _update(context_id: int) -> float:
    """One update with the gradients of ``context_id``; return its duration."""
    opt, grads = _OWNED["opt"], dist_autograd.get_gradients(context_id)
    for p, original in zip(opt.param_groups[0]["params"], _OWNED["params"], strict=True):  # type: ignore[call-overload]
        p.grad = grads[original]
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def _timed_step(rrefs: list[Any], step: Any) -> float:
    """Forward and backward in a fresh context (untimed), then ``step(context_id)`` timed."""
    with dist_autograd.context() as cid:
        dist_autograd.backward(cid, [rpc.rpc_sync(OWNER, _owner_loss, args=(rrefs,))])
        start = time.perf_counter()
        out = step(cid)
        return out if isinstance(out, float) else time.perf_counter() - start


def _first_steps(algo: str, count: int, numel: int) -> list[float]:
    """The first DistributedOptimizer of the job: [made, first step, second step, third step]."""
    cls, kwargs = ALGOS[algo]
    rrefs = [rpc.remote(OWNER, _make_param, args=(numel, i)) for i in range(count)]
    rpc.rpc_sync(OWNER, _noop)
    start = time.perf_counter()
    opt = DistributedOptimizer(cls, rrefs, **kwargs)
    times = [time.perf_counter() - start]
    return times + [_timed_step(rrefs, opt.step) for _ in range(3)]


def _measure(algo: str, count: int, numel: int, reps: int, rounds: int) -> dict[str, Any]:
    import torch.distributed.optim as torch_dist_optim  # (FSDP, DTensor: after the first steps)

    cls, kwargs = ALGOS[algo]
    rrefs = [rpc.remote(OWNER, _make_param, args=(numel, i)) for i in range(count)]
    theirs = torch_dist_optim.DistributedOptimizer(cls, rrefs, **kwargs)
    ours = DistributedOptimizer(cls, rrefs, **kwargs)
    rpc.rpc_sync(OWNER, _prepare_update, args=(algo, rrefs))
    calls = {
        "rtt": lambda cid: rpc.rpc_sync(OWNER, _noop),
        "update": lambda cid: rpc.rpc_sync(OWNER, _update, args=(cid,)),
        "ours": ours.step,
        "torch": theirs.step,
    }
    for call in calls.values():  # warm-up (torch's compiles its TorchScript here)
        for _ in range(3):
            _timed_step(rrefs, call)
    per_round = []
    for _ in range(rounds):
        samples: dict[str, list[float]] = {k: [] for k in KEYS}
        for _ in range(reps):
            for key in KEYS:
                samples[key].append(_timed_step(rrefs, calls[key]))
        per_round.append({k: statistics.median(v) for k, v in samples.items()})
    out: dict[str, Any] = {k: statistics.median(r[k] for r in per_round) for k in KEYS}
    out["floor"] = out["rtt"] + out["update"]
    out["kernel"] = ours.describe()[OWNER][1]
    out["rounds"] = {  # bench_overhead.py --summary's names
        "floor": [r["rtt"] + r["update"] for r in per_round],
        "metadist": [r["ours"] for r in per_round],
        "torch": [r["torch"] for r in per_round],
    }
    for name, over in (("md/floor", None), ("md/torch", "torch")):
        ratios = [r["ours"] / (r[over] if over else r["rtt"] + r["update"]) for r in per_round]
        out[name] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def _driver(args: argparse.Namespace) -> None:
    shapes = ((10, 100), (2, 1_000)) if args.quick else SHAPES
    first = _first_steps("Adam", *shapes[0])
    print(f"\nworld of 2, Adam {shapes[0][0]}x{shapes[0][1]:,} on {OWNER}:")
    print(
        f"optimizer made {first[0] * 1e3:.1f} ms; first optimizer step {first[1] * 1e3:.2f} ms, "
        f"second {first[2] * 1e3:.2f} ms, third {first[3] * 1e3:.2f} ms: first / second "
        f"{first[1] / first[2]:.2f}x",
        flush=True,
    )
    print(f"\n{args.rounds} interleaved rounds x {args.reps} steps, fresh contexts; ms, medians")
    print(
        f"{'algo':<5} {'params':>10} {'kernel':>7} {'rtt':>6} {'update':>7} {'floor':>6} "
        f"{'metadist':>8} {'torch':>6}   {'md/floor [min-max]':<20} md/torch [min-max]"
    )
    rows = []
    for count, numel in shapes:
        for algo in ALGOS:
            r = _measure(algo, count, numel, args.reps, args.rounds)
            ms = [f"{r[k] * 1e3:{w}.3f}" for k, w in (("rtt", 6), ("update", 7), ("floor", 6))]
            ms += [f"{r['ours'] * 1e3:8.3f}", f"{r['torch'] * 1e3:6.3f}"]
            ratios = [
                f"{m:.2f} [{lo:.2f}-{hi:.2f}]" for m, lo, hi in (r["md/floor"], r["md/torch"])
            ]
            line = f"{algo:<5} {f'{count}x{numel:,}':>10} {r['kernel']:>7} {' '.join(ms)}   "
            print(f"{line}{ratios[0]:<20} {ratios[1]}", flush=True)
            rows.append({"algo": algo, "count": count, "numel": numel, **r})
    if args.json:
        adam = next(r for r in rows if r["algo"] == "Adam")  # 100 x 1,000: many small tensors
        names = {"floor": "floor", "metadist": "md W=2", "torch": "torch rpc"}
        rounds = {names[k]: [t * 1e3 for t in v] for k, v in adam["rounds"].items()}
        workloads = {"optimizer step": {"base": "floor", "rounds": rounds}}
        Path(args.json).write_text(json.dumps({"workloads": workloads, "first_step_s": first}))


def _child(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    # torch's own DistributedOptimizer (the baseline) warns that TorchScript is deprecated, under
    # simplefilter("always") so no filter reaches it: dropped at display.
    show = warnings.showwarning

    def showwarning(message: Warning | str, *rest: Any, **kwargs: Any) -> None:
        if "functional optimizers is deprecated" not in str(message):
            show(message, *rest, **kwargs)

    warnings.showwarning = showwarning

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank == 0:
            _driver(args)

    main()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="timed steps per round and key")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    mp.start_processes(_child, args=(free_loopback_port(), args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
