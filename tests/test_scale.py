"""A world of 32 workers on this machine: start, a 32-way differentiable call (twice), optimizer
steps over parameters owned by all 32 (the first and the second), and a clean shutdown, each
timed; the first optimizer step costs at most twice the second.

Kept out of ``make test`` (marker ``scale``, and skipped unless ``-m scale`` selects it): run it
with ``python -m pytest -m scale -s tests/test_scale.py`` to see the timings.
``METADIST_SCALE_WORLD`` changes the number of workers.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

import metadist
from metadist.network import free_loopback_port
from metadist.optim import DistributedOptimizer

WORLD = int(os.environ.get("METADIST_SCALE_WORLD", "32"))
pytestmark = pytest.mark.scale


def _tanh_sum(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).sum()


def _where(x: torch.Tensor) -> str:
    return metadist.get_worker_name()


def _owned(rank: int) -> torch.Tensor:
    return torch.full((4,), float(rank + 1), requires_grad=True)


def _square_sum(param: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return (param.local_value() ** 2).sum()


def _value(param: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return param.local_value().detach().clone()


def _resources() -> tuple[float, int, int]:
    """This worker's resident memory (MiB), threads and open file descriptors."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rss_mib = int(status["VmRSS"].split()[0]) / 1024
    return rss_mib, int(status["Threads"]), len(os.listdir("/proc/self/fd"))


def _map_reduce(world_size: int, x: torch.Tensor, w: torch.nn.Parameter) -> float:
    """A 32-way map/reduce whose gradient reaches the caller's weights; its seconds, checked
    against one process."""
    w.grad = None
    start = time.monotonic()
    with metadist.autograd.context() as context_id:
        parts = metadist.remote_sync_call(_tanh_sum, args=(w, x))
        assert len(parts) == world_size
        loss = metadist.sum_reducer(parts)
        metadist.autograd.backward(context_id, [loss])
    seconds = time.monotonic() - start
    local_w = w.detach().clone().requires_grad_()
    local_loss = _tanh_sum(local_w, x)
    local_loss.backward()
    torch.testing.assert_close(loss.detach(), local_loss.detach())
    assert w.grad is not None
    torch.testing.assert_close(w.grad, local_w.grad)
    return seconds


def _optimizer_step(opt: DistributedOptimizer, params: list[rpc.RRef[torch.Tensor]]) -> float:
    """A backward through every owner and one step; its seconds."""
    start = time.monotonic()
    with dist_autograd.context() as context_id:
        futures = [rpc.rpc_async(p.owner(), _square_sum, args=(p,)) for p in params]
        total = torch.stack([future.wait() for future in futures]).sum()
        dist_autograd.backward(context_id, [total])
        opt.step(context_id)
    return time.monotonic() - start


def _drive(world_size: int) -> dict[str, float]:
    timings: dict[str, float] = {}
    names = metadist.get_worker_names()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(world_size * 2, 8, generator=generator)
    # A parameter is replicated to every partition; the batch x is split.
    w = torch.nn.Parameter(torch.randn(8, 3, generator=generator))
    placed = metadist.remote_sync_call(_where, args=(x,))
    assert sorted(placed) == sorted(names), placed  # one partition on every worker
    timings["first_map_reduce_s"] = _map_reduce(world_size, x, w)
    timings["second_map_reduce_s"] = _map_reduce(world_size, x, w)

    # Steps over parameters owned by every worker: the first one in each owner's process, then
    # a second. d/dp sum(p^2) = 2p, so each SGD step with lr 0.1 multiplies p by 0.8.
    params = [rpc.remote(name, _owned, args=(rank,)) for rank, name in enumerate(names)]
    start = time.monotonic()
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    timings["optimizer_made_s"] = time.monotonic() - start
    for which, factor in (("first", 0.8), ("second", 0.64)):
        timings[f"{which}_optimizer_step_s"] = _optimizer_step(opt, params)
        for rank, param in enumerate(params):
            value = rpc.rpc_sync(param.owner(), _value, args=(param,))
            torch.testing.assert_close(value, torch.full((4,), factor * (rank + 1)))

    # What a worker costs once it has served calls from the others.
    used = [rpc.rpc_sync(name, _resources) for name in names]
    timings["max_rss_mib"] = max(rss for rss, _, _ in used)
    timings["max_threads"] = max(threads for _, threads, _ in used)
    timings["max_fds"] = max(fds for _, _, fds in used)
    return timings


def _job(rank: int, world_size: int, launched: float, out: str) -> None:
    if rank != 0:
        return  # serve rank 0's calls until it is done
    timings = {"start_up_s": time.time() - launched}
    timings.update(_drive(world_size))
    timings["job_done_at"] = time.time()
    Path(out).write_text(json.dumps(timings))


def _child(rank: int, world_size: int, port: int, launched: float, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    # On a busy machine the last of 32 workers may start well after the first: give the
    # rendezvous and every call more than the default 60 s. TCP transport only, as
    # auto_init_rpc's default: the shared-memory one busy-polls a core per worker.
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=150, _transports=["uv"])
    metadist.auto_init_rpc(rpc_backend_options=options)(_job)(rank, world_size, launched, out)
    if rank == 0:
        Path(out + ".rpc_down").write_text(str(time.time()))


@pytest.mark.timeout(240)
def test_world_of_32_on_one_machine(request: pytest.FixtureRequest) -> None:
    # Two minutes of every core: only when asked for by marker (`make scale`), never as part of
    # a plain `pytest tests` run.
    if "scale" not in (request.config.getoption("markexpr", "") or ""):
        pytest.skip("a world of 32 runs only when selected with `-m scale` (make scale)")
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "timings.json")
        launched = time.time()
        context = mp.start_processes(
            _child,
            args=(WORLD, free_loopback_port(), launched, out),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + 200
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a world of {WORLD} exceeded 200 s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
        ended = time.time()
        assert os.path.exists(out), "rank 0 did not finish its job"
        timings: dict[str, Any] = json.loads(Path(out).read_text())
        rpc_down = float(Path(out + ".rpc_down").read_text())
    # RPC shutdown on rank 0 (every worker done, graceful teardown), then the processes exit.
    timings["rpc_shutdown_s"] = rpc_down - timings["job_done_at"]
    timings["shutdown_s"] = ended - timings.pop("job_done_at")
    print(
        f"\nworld of {WORLD}: "
        + ", ".join(f"{name} {value:.4g}" for name, value in timings.items())
    )
    for which in ("first", "second"):
        print(f"{which} map/reduce {timings[f'{which}_map_reduce_s']:.3f} s")
    print(f"optimizer made {timings['optimizer_made_s']:.3f} s")
    first, second = timings["first_optimizer_step_s"], timings["second_optimizer_step_s"]
    print(f"first optimizer step {first:.3f} s\nsecond optimizer step {second:.3f} s")
    assert timings["shutdown_s"] < 60, timings
    # The first step pays no one-time cost on the owners (issue 41: 22-26 s, then 2x a later
    # step's), with 50 ms for the noise of 32 processes on a small machine.
    assert first <= 2 * second + 0.05, (first, second)
