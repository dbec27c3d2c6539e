"""A job that misbehaves on purpose; tests/test_faults.py drives it.

Modes: ``hang`` (rank 0 waits forever on a remote call, for signal tests; ``hang-self`` is
the same in a world of 1, run without torchrun), ``kill`` (the
worker serving rank 0's call is SIGKILLed in the middle of it) and ``inflight`` (rank 0 returns
while a ``timeout=None`` call that never ends is still running).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import metadist


def sleep_forever() -> None:
    time.sleep(10_000)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(mode: str) -> None:
    # One write per line: the workers share torchrun's stdout.
    sys.stdout.write(f"READY rank={metadist.get_rank()} pid={os.getpid()}\n")
    sys.stdout.flush()
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
    # The signal tests (hang) keep the default shutdown_timeout, as users do: Ctrl-C must not
    # wait for it. The others shorten it to keep the tests quick.
    chosen = sys.argv[1]
    options = {} if chosen.startswith("hang") else {"shutdown_timeout": 3.0}
    metadist.auto_init_rpc(**options)(main)(chosen)
