"""Soak test (``make soak``; excluded from ``make test``): load on a world of 3 for <= 60 s.

10,000 small remote calls (single-worker, round-robin over the 3 workers, up to ``WINDOW`` in
flight) and 1,000 map/reduce calls (batch split over 3 workers; cat, sum and mean reducers; every
tenth one differentiable, with an ``nn.Module`` argument inside a distributed-autograd context).
Every result is checked. After a warm-up, the RSS of every worker must grow by less than 10 %.
At the end every worker reports no live RRefs, forks, pending users/futures or autograd contexts
(torch's own count), and torch's RRef leak check is switched on so that shutdown raises on a leak.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
from _dist import REPO, run_world
from torch import nn

from metadist import autograd as md_autograd
from metadist.api import remote_async_call, remote_sync_call
from metadist.network import free_loopback_port
from metadist.reduce import cat_reducer, mean_reducer, sum_reducer

SMALL_CALLS = 10_000
MAP_REDUCE_CALLS = 1_000
WARMUP_FRACTION = 0.2
WINDOW = 32
BUDGET_S = 60.0
MAX_RSS_GROWTH = 0.10


# -- on the workers ------------------------------------------------------------------------------


def _affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _colsum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


def _colmean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(0)


def _model_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


def _rss_kib() -> int:
    gc.collect()
    for line in open("/proc/self/status").read().splitlines():  # noqa: SIM115 - tiny file
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _leak_counts() -> dict[str, int]:
    # torch.distributed.rpc's debug info: RRef and distributed-autograd bookkeeping of this
    # worker (private helper; no public equivalent).
    info = rpc._get_debug_info()  # type: ignore[attr-defined]
    keys = (
        "num_owner_rrefs",
        "num_forks",
        "num_pending_users",
        "num_pending_futures",
        "num_autograd_contexts",
    )
    return {key: int(info[key]) for key in keys}


# -- the load (rank 0) -------------------------------------------------------------------------


def _small_calls(first: int, count: int) -> None:
    pending: deque[tuple[int, torch.futures.Future[Any]]] = deque()

    def check(i: int, future: torch.futures.Future[Any]) -> None:
        got = future.wait()
        want = _affine(torch.full((4,), float(i)))
        assert len(got) == 1, got
        assert torch.equal(got[0], want), (i, got, want)

    for i in range(first, first + count):
        x = torch.full((4,), float(i))
        pending.append((i, remote_async_call(_affine, args=(x,), partitioner=i % 3)))
        if len(pending) >= WINDOW:
            check(*pending.popleft())
    while pending:
        check(*pending.popleft())


def _map_reduce_calls(first: int, count: int, model: nn.Module) -> None:
    for i in range(first, first + count):
        gen = torch.Generator().manual_seed(i)
        rows = 5 + i % 8  # 5..12 rows: uneven splits over 3 workers
        x = torch.randn(rows, 3, generator=gen)
        kind = i % 10
        if kind == 0:
            model.zero_grad()
            with md_autograd.context() as cid:
                loss = remote_sync_call(_model_loss, args=(model, x), reducer=sum_reducer)
                md_autograd.backward(cid, loss)
            ref = model(x).pow(2).sum()
            grads = torch.autograd.grad(ref, list(model.parameters()))
            torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
            for p, g in zip(model.parameters(), grads, strict=True):
                assert p.grad is not None
                torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)
        elif kind % 3 == 0:
            got = remote_sync_call(_double, args=(x,), reducer=cat_reducer)
            assert torch.equal(got, x * 2), i
        elif kind % 3 == 1:
            got = remote_sync_call(_colsum, args=(x,), reducer=sum_reducer)
            torch.testing.assert_close(got, x.sum(0), rtol=1e-5, atol=1e-5)
        else:
            got = remote_sync_call(_colmean, args=(x,), reducer=mean_reducer)
            torch.testing.assert_close(got, x.mean(0), rtol=1e-5, atol=1e-5)


def _rss_all() -> list[int]:
    return [remote_sync_call(_rss_kib, partitioner=w)[0] for w in range(3)]


def _world(rank: int, world_size: int) -> None:
    # torch skips its RRef leak check at shutdown unless this private flag is off (test only).
    rpc_api._ignore_rref_leak = False
    if rank != 0:
        return
    start = time.monotonic()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    warm_small = int(SMALL_CALLS * WARMUP_FRACTION)
    warm_mr = int(MAP_REDUCE_CALLS * WARMUP_FRACTION)
    _small_calls(0, warm_small)
    _map_reduce_calls(0, warm_mr, model)
    before = _rss_all()
    _small_calls(warm_small, SMALL_CALLS - warm_small)
    _map_reduce_calls(warm_mr, MAP_REDUCE_CALLS - warm_mr, model)
    after = _rss_all()
    elapsed = time.monotonic() - start
    growth = [(a - b) / b for a, b in zip(after, before, strict=True)]
    print(
        f"soak: {SMALL_CALLS} small + {MAP_REDUCE_CALLS} map/reduce calls in {elapsed:.1f} s; "
        f"RSS KiB before {before} after {after} growth {[f'{g:+.1%}' for g in growth]}",
        flush=True,
    )
    assert all(g < MAX_RSS_GROWTH for g in growth), (before, after)
    # Releasing a context on the workers is a fire-and-forget message: allow it to arrive.
    deadline = time.monotonic() + 5.0
    while True:
        counts = [remote_sync_call(_leak_counts, partitioner=w)[0] for w in range(3)]
        if all(not any(c.values()) for c in counts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(not any(c.values()) for c in counts), counts


@pytest.mark.soak
@pytest.mark.timeout(90)
def test_soak_10k_calls_flat_memory_no_leaks() -> None:
    start = time.monotonic()
    run_world(_world, 3, timeout=BUDGET_S + 20)
    elapsed = time.monotonic() - start
    assert elapsed <= BUDGET_S, f"soak took {elapsed:.1f} s (budget {BUDGET_S} s)"


@pytest.mark.soak
@pytest.mark.timeout(150)
def test_soak_with_a_killed_worker(tmp_path: Path) -> None:
    """Mixed load on a world of 4; worker 3 is SIGKILLed half-way (tests/scripts/soak_faults.py).

    The caller's calls to the survivors keep working and stay correct, calls to the dead worker
    fail within seconds naming it, the survivors' memory stays flat, and every process exits.
    """
    port = free_loopback_port()
    out = tmp_path / "figures.json"
    processes = []
    for rank in range(4):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        log = (tmp_path / f"rank{rank}.log").open("w")
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "tests" / "scripts" / "soak_faults.py"),
                    "--seconds",
                    "40",
                    "--out",
                    str(out),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    try:
        for p in processes:
            p.wait(timeout=120)
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = "\n".join(
        f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(4)
    )
    assert out.exists(), logs
    figures = json.loads(out.read_text())
    latencies = figures["failure_latency_s"]
    growth = [
        (b - a) / a for a, b in zip(figures["rss_kib_start"], figures["rss_kib_end"], strict=True)
    ]
    print(
        f"soak with a fault: {figures['rounds']} rounds; calls/s "
        f"{figures['calls_per_s_before']:.0f} before the kill, {figures['calls_per_s_after']:.0f} "
        f"after; {len(latencies)} calls to the dead worker failed in "
        f"{1e3 * min(latencies, default=0):.2f}-{1e3 * max(latencies, default=0):.2f} ms; "
        f"survivors' RSS growth {[f'{g:+.2%}' for g in growth]}"
    )
    assert processes[3].returncode == -signal.SIGKILL
    assert latencies, figures
    assert max(latencies) < 5.0, latencies
    assert figures["calls_per_s_after"] > 0.25 * figures["calls_per_s_before"], figures
    assert all(g < MAX_RSS_GROWTH for g in growth), (growth, figures)
