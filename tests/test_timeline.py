"""The opt-in timeline records every partition of every call, and progress bars stay quiet.

One spawned world of 3; rank 0 records calls that run in-process and on two workers, with a
backward pass, and checks the records, the Chrome trace and the summary against the calls made.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from _dist import Scenarios, run_scenarios
from torch import nn

import metadist as md
from metadist import timeline


def run_module(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).pow(2).sum()


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def records_match_the_calls(world_size: int) -> None:
    model = nn.Linear(4, 2)
    x = torch.randn(6, 4)
    path = Path(f"/tmp/metadist-timeline-{md.get_rank()}-{id(model)}.json")
    with timeline.record(path) as tl:
        loss = md.remote_sync_call(run_module, args=(model, x), reducer=md.sum_reducer)
        loss.backward()
        md.remote_sync_call(double, args=(torch.ones(5),), partitioner=2)
    assert tl.calls == 2
    first = [r for r in tl.partitions if r.call == 0]
    second = [r for r in tl.partitions if r.call == 1]
    assert sorted(r.worker for r in first) == ["worker0", "worker1", "worker2"]
    assert [(r.worker, r.partition) for r in second] == [("worker2", 0)]
    for r in tl.partitions:
        assert r.sent <= r.start <= r.end <= r.done + 0.05, r  # clocks of one machine
        assert r.bytes_in > 0, r
        remote = r.worker != "worker0"
        assert (r.bytes_out > 0) == remote, r
    # gradients went back to the two remote partitions of the differentiable call only
    assert sorted(r.worker for r in first if r.gradients_sent is not None) == ["worker1", "worker2"]
    assert second[0].gradients_sent is None
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert len(spans) == 4
    assert names == {"worker0", "worker1", "worker2"}
    assert sum(e["ph"] == "i" for e in trace["traceEvents"]) == 2
    summary = tl.summary()
    for worker in ("worker0", "worker1", "worker2"):
        assert worker in summary, summary
    assert "slowest partitions" in summary
    path.unlink()


def nothing_is_recorded_when_off(world_size: int) -> None:
    assert timeline.active() is None
    md.remote_sync_call(double, args=(torch.ones(3),))  # before recording: nowhere
    with timeline.record() as tl:
        with pytest.raises(RuntimeError, match="already being recorded"), timeline.record():
            pass
        assert tl.partitions == []  # the call before the block is not in it
        md.remote_sync_call(double, args=(torch.ones(3),))  # this one is
    recorded = sorted((p.call, p.partition) for p in tl.partitions)
    assert recorded == [(0, i) for i in range(world_size)]  # one call, a partition per worker
    assert timeline.active() is None
    md.remote_sync_call(double, args=(torch.ones(3),))  # after the block: off again
    assert len(tl.partitions) == world_size


def progress_bar_is_quiet_off_a_terminal(world_size: int) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        total = md.remote_sync_call(
            double,
            args=(torch.arange(9.0),),
            partitioner=md.dim_partitioner(0, exclusive=True),
            reducer=md.sum_reducer,
            progress=True,
        )
        fut = md.remote_async_call(double, args=(torch.arange(3.0),), progress=True)
        fut.wait()
    assert total.item() == 72.0
    assert out.getvalue() == ""
    assert err.getvalue() == ""


SCENARIOS = [
    records_match_the_calls,
    nothing_is_recorded_when_off,
    progress_bar_is_quiet_off_a_terminal,
]


@pytest.fixture(scope="module")
def world() -> Scenarios:
    return run_scenarios(SCENARIOS, 3, timeout=200)


@pytest.mark.timeout(250)
@pytest.mark.parametrize("name", [s.__name__ for s in SCENARIOS])
def test_timeline(world: Scenarios, name: str) -> None:
    world.check(name)


PROGRESS_SCRIPT = """
import torch, metadist
def double(x):
    return x * 2
@metadist.auto_init_rpc()
def main():
    part = metadist.dim_partitioner(0, exclusive=True)
    metadist.remote_sync_call(double, args=(torch.arange(5.0),), partitioner=part, progress=True)
main()
"""


@pytest.mark.timeout(120)
def test_progress_bar_draws_on_a_terminal() -> None:
    """With a terminal as standard output, the bar counts the partitions to the end."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from _dist import REPO

    leader, follower = pty.openpty()
    # A real terminal has a size; tqdm draws nothing on one with zero rows.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen(
        [sys.executable, "-c", PROGRESS_SCRIPT], stdout=follower, stderr=follower, env=env
    ) as process:
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert process.wait(timeout=90) == 0, b"".join(chunks).decode(errors="replace")
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    assert "double" in text, text
    assert "5/5" in text, text
