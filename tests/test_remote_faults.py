"""Remote-call faults in one spawned world of 3: hangs, timeouts, remote exceptions, shutdown.

* A remote function that hangs: the call raises ``TimeoutError`` after the configured timeout,
  naming the worker, the partition and the timeout; ``timeout=None`` keeps waiting past it until
  another call releases the function.
* A remote function that raises (a user subclass of ``ValueError``): the caller gets that type
  with worker, partition index and the remote traceback as attributes; a second failing
  partition is named in a note; the error is delivered only once every other partition has
  finished, so no request is left in flight. (``tests/test_api.py`` covers the basic type /
  ``RemoteError`` cases.)
* Shutdown while calls are in flight: the job's function returns with two calls pending; one
  finishes during shutdown and delivers its result, the other fails with ``TimeoutError``; the
  world ends promptly.

(Killed workers and signals are in ``tests/test_faults.py``.)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.rpc as rpc
from _dist import run_world

from metadist.api import remote_async_call, remote_sync_call

# -- functions that run on the workers -----------------------------------------------------

_GATES: dict[str, threading.Event] = {}
_GATES_LOCK = threading.Lock()
_FINISHED: list[int] = []
GATE_LIMIT = 6.0  # a gate nobody opens gives up after this, so a broken test cannot hang


def _gate(key: str) -> threading.Event:
    with _GATES_LOCK:
        return _GATES.setdefault(key, threading.Event())


def _block(key: str, limit: float = GATE_LIMIT) -> str:
    return "released" if _gate(key).wait(limit) else "gave up"


def _release(key: str) -> None:
    _gate(key).set()


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


class DataError(ValueError):
    """A user exception type, importable on the caller."""


def _check_rows(x: torch.Tensor) -> torch.Tensor:
    if bool((x < 0).any()):
        raise DataError(f"negative value {float(x.min())} in a batch of {len(x)}")
    return x * 2


def _fail_fast_or_finish(x: torch.Tensor) -> torch.Tensor:
    if bool((x < 0).any()):
        raise DataError("partition with a negative value fails at once")
    time.sleep(1.0)
    _FINISHED.append(int(x.numel()))
    return x


def _finished() -> int:
    return len(_FINISHED)


def _client_active_calls() -> int:
    # The agent's gauge of requests this process sent that have no reply yet. Private API:
    # torch has no public one; acceptable in a test.
    return int(rpc.api._get_current_rpc_agent().get_metrics()["agent.client_active_calls"])


def _settled_active_calls(limit: float = 2.0) -> int:
    # TensorPipe decrements the gauge on its worker thread *after* completing the future (so
    # callbacks that send more calls cannot make it dip to zero), so a waiter woken by the last
    # reply can read it one call high for a moment: let it settle. (An error delivered before
    # the slow partitions finished is caught by the elapsed-time check, not by this gauge.)
    deadline = time.monotonic() + limit
    while (active := _client_active_calls()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return active


# -- the scenarios (rank 0 drives) ---------------------------------------------------------------


def _hang_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        remote_sync_call(_block, args=("hang",), partitioner="worker1", timeout=1.5)
    elapsed = time.monotonic() - start
    assert 1.4 <= elapsed <= 1.5 + 5, elapsed
    message = str(info.value)
    assert "worker 'worker1'" in message, message
    assert "partition 0 of 1" in message, message
    assert "timeout of 1.5 s" in message, message
    remote_sync_call(_release, args=("hang",), partitioner=1)
    # timeout=None: still waiting well after 1.5 s, until another call opens the gate.
    # Its gate gives up only after 30 s, so a stalled machine cannot fail the check.
    future = remote_async_call(_block, args=("forever", 30.0), partitioner=2, timeout=None)
    time.sleep(3.0)
    assert not future.done()
    remote_sync_call(_release, args=("forever",), partitioner=2, timeout=10)
    assert future.wait() == ["released"]


def _raise_keeps_type_worker_partition_traceback() -> None:
    x = torch.arange(6.0)
    x[3] = -1.0  # partition 1 of 3 (rows 2..3) on worker1
    with pytest.raises(DataError) as info:
        remote_sync_call(_check_rows, args=(x,))
    error = info.value
    message = str(error)
    assert error.worker_name == "worker1"  # type: ignore[attr-defined]
    assert error.partition_index == 1  # type: ignore[attr-defined]
    assert "negative value -1.0 in a batch of 2" in message
    assert "worker 'worker1'" in message
    assert "partition 1 of 3" in message
    # The remote traceback names the function and the failing line on the worker.
    assert "in _check_rows" in error.remote_traceback  # type: ignore[attr-defined]
    assert 'raise DataError(f"negative value' in error.remote_traceback  # type: ignore[attr-defined]
    assert "Traceback (most recent call last)" in message

    # Two partitions fail: the first is raised and the other is named, not lost.
    z = torch.arange(6.0)
    z[0], z[5] = -2.0, -3.0
    with pytest.raises(DataError) as both:
        remote_sync_call(_check_rows, args=(z,))
    assert both.value.partition_index == 0  # type: ignore[attr-defined]
    notes = "\n".join(getattr(both.value, "__notes__", []))
    assert "1 more partition(s) failed: partition 2 (DataError)" in notes, notes


def _failed_call_leaves_nothing_in_flight() -> None:
    x = torch.tensor([-1.0, 2.0, 3.0])  # partition 0 fails at once; 1 and 2 take 1 s
    start = time.monotonic()
    future = remote_async_call(_fail_fast_or_finish, args=(x,))
    with pytest.raises(DataError):
        future.wait()
    elapsed = time.monotonic() - start
    # The error was delivered only after the slow partitions finished, so no request leaks.
    assert elapsed >= 0.9, elapsed
    assert _settled_active_calls() == 0
    finished = [remote_sync_call(_finished, partitioner=w) for w in (1, 2)]
    assert finished == [[1], [1]], finished
    # The world still works after the failures above.
    assert remote_sync_call(_check_rows, args=(torch.ones(3),)) == [torch.full((1,), 2.0)] * 3


def _leave_calls_in_flight(out: Path) -> None:
    """Return from the job with two calls pending; their callbacks record what happened."""
    start = time.monotonic()

    def record(tag: str) -> Any:
        def callback(future: torch.futures.Future[Any]) -> None:
            try:
                outcome = f"ok {future.value()!r}"
            except Exception as error:
                outcome = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            with (out / "in_flight.log").open("a") as log:
                log.write(f"{tag} after {time.monotonic() - start:.2f}s: {outcome}\n")

        return callback

    finishing = remote_async_call(_sleep, args=(2.0,), partitioner=1, timeout=None)
    finishing.add_done_callback(record("finishing"))
    stuck = remote_async_call(_block, args=("never",), partitioner=2, timeout=3.0)
    stuck.add_done_callback(record("stuck"))


def _world(rank: int, world_size: int, out: str) -> None:
    if rank != 0:
        return
    _hang_times_out()
    _raise_keeps_type_worker_partition_traceback()
    _failed_call_leaves_nothing_in_flight()
    _leave_calls_in_flight(Path(out))


@pytest.mark.timeout(120)
def test_remote_call_faults(tmp_path: Path) -> None:
    start = time.monotonic()
    run_world(_world, 3, str(tmp_path), timeout=100)
    elapsed = time.monotonic() - start
    log = (tmp_path / "in_flight.log").read_text()
    lines = sorted(log.splitlines())
    assert len(lines) == 2, log
    assert lines[0].startswith("finishing"), log
    assert lines[0].endswith("ok [2.0]"), log
    assert lines[1].startswith("stuck"), log
    assert "TimeoutError: partition 0 of 1 on worker 'worker2'" in lines[1], log
    assert "timeout of 3.0 s" in lines[1], log
    assert elapsed < 60, elapsed
