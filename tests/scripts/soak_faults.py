"""A soak with a fault: mixed load on a world of 4, worker 3 killed half-way (tests/test_soak.py).

Started as 4 plain processes (torchrun would tear the job down when a worker dies). Rank 0
drives for ``--seconds``: map/reduce calls with gradients through a module argument, nested
calls, bf16-compressed calls and ``DistributedOptimizer`` steps over parameters owned by workers 1
and 2. Half-way it SIGKILLs worker 3, then keeps the same load on the survivors and, every few
iterations, makes a call to worker 3, which must fail fast naming it. Every result is checked.
Rank 0 writes its figures (calls per second before and after, failure latencies, RSS of the
survivors) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
from torch import nn

import metadist as md
from metadist.optim import DistributedOptimizer


def model_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def nested(x: torch.Tensor) -> torch.Tensor:
    other = 1 if md.get_rank() != 1 else 2
    return md.remote_sync_call(leaf, args=(x,), partitioner=other, timeout=20)[0]


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def make_param() -> torch.Tensor:
    return torch.ones(3, requires_grad=True)


def owned_loss(rref: rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    return (rref.local_value() * x).sum()


def one_round(
    i: int, workers: list[int], model: nn.Module, opt: DistributedOptimizer, rrefs: list
) -> int:
    """One iteration of the mixed load; returns the number of remote calls it made."""
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(5 + i % 7, 3, generator=gen)
    part = md.dim_partitioner(0, workers=workers)
    model.zero_grad()
    with md.autograd.context() as ctx:
        loss = md.remote_sync_call(
            model_loss, args=(model, x), partitioner=part, reducer=md.sum_reducer
        )
        md.autograd.backward(ctx, [loss])
    ref = model(x).pow(2).sum()
    grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)
    got = md.remote_sync_call(nested, args=(x,), partitioner=part, reducer=md.cat_reducer)
    assert torch.equal(got, x * 2)
    packed = md.remote_sync_call(
        leaf, args=(x,), partitioner=part, reducer=md.cat_reducer, compression="bf16"
    )
    torch.testing.assert_close(packed, x * 2, rtol=1e-2, atol=1e-2)
    with md.autograd.context() as ctx:
        losses = [rpc.rpc_async(r.owner(), owned_loss, args=(r, x[0])) for r in rrefs]
        total = torch.stack([f.wait() for f in losses]).sum()
        md.autograd.backward(ctx, [total])
        opt.step(ctx)
    return 4 + len(workers)


def drive(seconds: float) -> dict[str, object]:
    pids = [md.remote_sync_call(os.getpid, partitioner=w)[0] for w in range(4)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    rrefs = [rpc.remote(f"worker{w}", make_param) for w in (1, 2)]
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.01)
    half = seconds / 2
    figures: dict[str, object] = {"pids": pids}
    i = calls = 0
    start = time.monotonic()
    while time.monotonic() - start < half:
        calls += one_round(i, [0, 1, 2, 3], model, opt, rrefs)
        i += 1
    figures["calls_per_s_before"] = calls / (time.monotonic() - start)
    os.kill(pids[3], signal.SIGKILL)
    time.sleep(0.5)
    rss_start = [md.remote_sync_call(rss_kib, partitioner=w)[0] for w in range(3)]
    latencies = []
    i0, calls, start = i, 0, time.monotonic()
    while time.monotonic() - start < half:
        calls += one_round(i, [0, 1, 2], model, opt, rrefs)
        i += 1
        if (i - i0) % 10 == 1:
            t0 = time.monotonic()
            try:
                md.remote_sync_call(leaf, args=(torch.ones(2),), partitioner=3, timeout=30)
            except Exception as error:
                latencies.append(time.monotonic() - t0)
                message = str(error)
            else:
                message = "a call to the killed worker succeeded"
            if "worker3" not in message:
                raise AssertionError(message)
    figures["calls_per_s_after"] = calls / (time.monotonic() - start)
    figures["rounds"] = i
    figures["failure_latency_s"] = latencies
    figures["rss_kib_start"] = rss_start
    figures["rss_kib_end"] = [md.remote_sync_call(rss_kib, partitioner=w)[0] for w in range(3)]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    @md.auto_init_rpc(shutdown_timeout=5.0)
    def job() -> None:
        if md.get_rank() == 0:
            figures = drive(args.seconds)
            args.out.write_text(json.dumps(figures))

    job()


if __name__ == "__main__":
    main()
