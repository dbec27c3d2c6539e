"""A job that misbehaves on purpose; tests/test_faults.py drives it.

Modes: ``hang`` (rank 0 waits forever on a remote call, for signal tests; ``hang-self`` is
the same in a world of 1, run without torchrun), ``kill`` (the
worker serving rank 0's call is SIGKILLed in the middle of it), ``inflight`` (rank 0 returns
while a ``timeout=None`` call that never ends is still running) and ``dead`` (a world of 4:
worker2 exits at once and worker1 returns from its job, then rank 0 calls the dead worker, meets
both in barriers, and kills worker1 in the middle of a call; worker3 waits in a barrier with
worker2). ``dead`` prints one ``STEP name -> outcome (seconds)`` line per step.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed.rpc as rpc

import metadist


def sleep_forever() -> None:
    time.sleep(10_000)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


_PIDS: dict[int, int] = {}


def note_pid(rank: int, pid: int) -> None:
    _PIDS[rank] = pid


def one() -> int:
    return 1


def _wait_for_pid(rank: int, limit: float = 30.0) -> int:
    deadline = time.monotonic() + limit
    while rank not in _PIDS and time.monotonic() < deadline:
        time.sleep(0.05)
    return _PIDS[rank]


def _wait_gone(pid: int, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:  # gone, or a zombie its parent (the test) has not reaped yet
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} still runs after {limit} s")


def _step(name: str, action: Callable[[], object]) -> None:
    start = time.monotonic()
    try:
        outcome = f"returned {action()!r}"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    outcome = outcome.replace("\n", " | ")
    print(f"STEP {name} -> {outcome} ({time.monotonic() - start:.2f}s)", flush=True)


def dead(rank: int) -> None:
    """The ``dead`` mode: calls and barriers that meet a dead or finished worker."""
    if rank == 1:
        return  # finished: it serves calls until rank 0 kills it in one of them
    if rank == 2:
        rpc.rpc_sync(0, note_pid, args=(2, os.getpid()))
        os._exit(3)
    if rank == 3:  # waits for worker2 in a barrier that rank 0, its coordinator, joins later
        _step("member barrier with a dead worker", lambda: metadist.barrier([0, 2, 3], timeout=30))
        return
    _wait_gone(_wait_for_pid(2))
    _step("first call to a dead worker", lambda: metadist.remote_sync_call(one, partitioner=2))
    _step("barrier with a dead worker", lambda: metadist.barrier([0, 2, 3], timeout=30))
    _step("barrier with a finished worker", lambda: metadist.barrier([0, 1], timeout=30))
    _step(
        "call during which the worker dies", lambda: metadist.remote_sync_call(die, partitioner=1)
    )
    _step("call after the worker died", lambda: metadist.remote_sync_call(one, partitioner=1))


def main(mode: str) -> None:
    # One write per line: the workers share torchrun's stdout.
    sys.stdout.write(f"READY rank={metadist.get_rank()} pid={os.getpid()}\n")
    sys.stdout.flush()
    if mode == "dead":
        dead(metadist.get_rank())
        return
    if metadist.get_rank() != 0:
        return
    if mode == "hang":
        metadist.remote_sync_call(sleep_forever, partitioner=1, timeout=None)
    elif mode == "hang-self":  # `python fault_job.py hang-self`: a world of 1 calling itself
        metadist.remote_sync_call(sleep_forever, partitioner=0, timeout=None)
    elif mode == "kill":
        start = time.monotonic()
        try:
            metadist.remote_sync_call(die, partitioner=1, timeout=20)
        except Exception as error:  # report whatever the caller sees
            elapsed = time.monotonic() - start
            print(f"CAUGHT {type(error).__name__} after {elapsed:.2f}s: {error}", flush=True)
        else:
            print("NO ERROR", flush=True)
    elif mode == "inflight":
        metadist.remote_async_call(sleep_forever, partitioner=1, timeout=None)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that sees a hang asks
    # Ctrl-C as in a terminal: a shell runs background jobs with SIGINT ignored, and Python then
    # leaves it ignored (a CI rehearsal started with `&` saw the Ctrl-C test wait 47 s).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The signal tests (hang) keep the default shutdown_timeout, as users do: Ctrl-C must not
    # wait for it. The others shorten it to keep the tests quick.
    chosen = sys.argv[1]
    options = {} if chosen.startswith("hang") else {"shutdown_timeout": 3.0}
    metadist.auto_init_rpc(**options)(main)(chosen)
