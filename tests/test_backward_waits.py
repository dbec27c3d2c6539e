"""A call's backward waits as its forward does: at most the call's timeout, and Ctrl-C ends it.

Each test runs a real job (``python`` for a world of 1; two ranks launched by hand, as torchrun
would, for a world of 2) whose backward pass blocks inside a custom ``autograd.Function`` that
sleeps, on the caller itself or on worker 1; the job writes ``READY`` once it is in the
backward pass.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _dist import REPO

from metadist.network import free_loopback_port

JOB = """
import signal, sys, time
import torch
import metadist

# Ctrl-C as in a terminal: a shell runs background jobs with SIGINT ignored, and Python then
# leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)


class Sleepy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        print("READY", flush=True)
        time.sleep(float(sys.argv[2]))
        return g * 2


def slow_backward(w):
    return Sleepy.apply(w).sum()


@metadist.auto_init_rpc()
def main():
    if metadist.get_rank() != 0:
        return
    w = torch.ones(3, requires_grad=True)
    worker = metadist.get_world_size() - 1
    loss = metadist.remote_sync_call(
        slow_backward, args=(w,), partitioner=worker, timeout=float(sys.argv[1])
    )[0]
    start = time.monotonic()
    try:
        loss.backward()
    except BaseException as error:
        print(f"RAISED {type(error).__name__} after {time.monotonic() - start:.1f} s: {error}")
        raise


if __name__ == "__main__":
    main()
"""


def _start(
    tmp_path: Path, world_size: int, timeout: float, sleep: float
) -> list[subprocess.Popen[bytes]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = free_loopback_port()
    jobs = []
    for rank in range(world_size):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        if world_size > 1:
            env |= {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        out = (tmp_path / f"rank{rank}.log").open("w")
        jobs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(timeout), str(sleep)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
                env=env,
            )
        )
    return jobs


def _wait_for(path: Path, text: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in {path.name}:\n{path.read_text()}"
        time.sleep(0.1)


def _finish(jobs: list[subprocess.Popen[bytes]], limit: float) -> float:
    start = time.monotonic()
    try:
        for job in jobs:
            job.wait(max(1.0, limit - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for job in jobs:
            job.kill()
            job.wait(10)
    return time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2], ids=["world of 1", "world of 2"])
def test_ctrl_c_interrupts_a_waiting_backward(tmp_path: Path, world_size: int) -> None:
    jobs = _start(tmp_path, world_size, timeout=600.0, sleep=600.0)
    log = tmp_path / f"rank{world_size - 1}.log"
    _wait_for(log, "READY")  # the partition's backward is running (and waited for)
    time.sleep(0.5)
    jobs[0].send_signal(signal.SIGINT)
    elapsed = _finish(jobs[:1], limit=45.0)
    _finish(jobs, limit=5.0)
    text = (tmp_path / "rank0.log").read_text()
    assert elapsed < 40, f"rank 0 still running {elapsed:.1f} s after Ctrl-C:\n{text}"
    assert "RAISED KeyboardInterrupt" in text, text


@pytest.mark.timeout(120)
def test_a_backward_waits_at_most_the_calls_timeout(tmp_path: Path) -> None:
    jobs = _start(tmp_path, 2, timeout=1.0, sleep=8.0)
    elapsed = _finish(jobs, limit=60.0)
    text = (tmp_path / "rank0.log").read_text()
    assert "RAISED TimeoutError" in text, text
    assert "the gradient request to worker 'worker1' did not finish within the call's" in text
    seconds = float(text.split("RAISED TimeoutError after ")[1].split(" s")[0])
    assert seconds < 6.0, text  # the call's 1 s (and torch's timer), not the worker's 8 s
    assert elapsed < 60, text
