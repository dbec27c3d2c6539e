"""Several RPC worlds, one after the other, in every process of a job of 2 launched by hand;
tests/test_world.py drives it. ``PORTS`` lists one MASTER_PORT per world (a port serves one
world: rank 0's store keeps it). Rank 0 makes the checks; each prints one ``CHECK name ok`` or
``CHECK name FAIL error`` line, and each world's end ``WORLD n ok (seconds)`` or ``WORLD n
FAIL error (seconds)``, on every rank.

Modes: ``user`` (world 1 uses RRefs; world 2 none, and refuses metadist's RRef check; rank 0
alone tries a third world on world 1's port; the last world calls ``rpc.remote``, whose shutdown
stalls and must name the cause) and ``metadist`` (world 2 makes a metadist call with an RRef
argument, which must be refused before it is sent, so that its shutdown does not stall).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc

import metadist
from metadist import world

SHUTDOWN_S = 5.0


def check(name: str, body: Callable[[], None]) -> None:
    try:
        body()
    except Exception as error:
        message = " ".join(f"{type(error).__name__}: {error}".split())
        print(f"CHECK {name} FAIL {message}", flush=True)
    else:
        print(f"CHECK {name} ok", flush=True)


def expect_error(call: Callable[[], object], kind: type[Exception], *patterns: str) -> None:
    try:
        call()
    except kind as error:
        for pattern in patterns:
            if re.search(pattern, str(error)) is None:
                raise AssertionError(f"{pattern!r} not in: {error}") from error
        return
    raise AssertionError(f"no {kind.__name__} raised")


def value_of(rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return rref.to_here() * 2


def rrefs_work() -> None:
    world.check_rref_world("this test")  # the first world: no refusal
    owned = rpc.remote(1, torch.add, args=(torch.ones(2), 1))
    assert owned.to_here().tolist() == [2.0, 2.0]
    (doubled,) = metadist.remote_sync_call(value_of, args=(owned,), partitioner="worker1")
    assert doubled.tolist() == [4.0, 4.0]


def plain_calls_work() -> None:
    assert rpc.rpc_sync(1, torch.add, args=(torch.ones(2), 2)).tolist() == [3.0, 3.0]
    results = metadist.remote_sync_call(torch.add, args=(torch.ones(2), 3), partitioner="worker1")
    assert [r.tolist() for r in results] == [[4.0, 4.0]]


def check_refuses() -> None:
    expect_error(
        lambda: world.check_rref_world("my_api"),
        RuntimeError,
        r"my_api cannot send an RRef: this is RPC world 2 in this process",
        r"RRefContext\) is process-wide and ended with the first world",
        r"Run one RPC world per process",
    )


def metadist_rref_call_refused() -> None:
    expect_error(
        lambda: metadist.remote_sync_call(
            value_of, args=(rpc.RRef(torch.ones(2)),), partitioner="worker1"
        ),
        RuntimeError,
        r"cannot send an RRef: this is RPC world 2 in this process",
    )


def user_rref() -> None:
    owned = rpc.remote(1, torch.add, args=(torch.ones(2), 1))
    assert owned.to_here().tolist() == [2.0, 2.0]  # works; only its release never comes


CHECKS: dict[tuple[str, int], list[Callable[[], None]]] = {
    ("user", 1): [rrefs_work],
    ("user", 2): [plain_calls_work, check_refuses],
    ("user", 3): [user_rref],
    ("metadist", 1): [plain_calls_work],
    ("metadist", 2): [metadist_rref_call_refused],
}


@metadist.auto_init_rpc(shutdown_timeout=SHUTDOWN_S)
def job(mode: str, n: int) -> None:
    if metadist.get_rank() == 0:
        for body in CHECKS[(mode, n)]:
            check(f"world{n}_{body.__name__}", body)


def run_world(mode: str, n: int, port: str) -> None:
    os.environ["MASTER_PORT"] = port
    start = time.monotonic()
    try:
        job(mode, n)
    except Exception as error:
        message = " ".join(f"{type(error).__name__}: {error}".split())
        print(f"WORLD {n} FAIL {message} ({time.monotonic() - start:.1f} s)", flush=True)
    else:
        print(f"WORLD {n} ok ({time.monotonic() - start:.1f} s)", flush=True)


def main() -> None:
    mode = sys.argv[1]
    ports = os.environ["PORTS"].split(",")
    run_world(mode, 1, ports[0])
    run_world(mode, 2, ports[1])
    if mode == "user":
        if metadist.get_rank() == 0:
            # The first world's store still listens on its port: a world there cannot start.
            os.environ["MASTER_PORT"] = ports[0]
            held = f"MASTER_PORT={ports[0]} served the rendezvous of an earlier RPC world"
            check("reused_port", lambda: expect_error(lambda: job(mode, 0), OSError, held))
        run_world(mode, 3, ports[2])  # last: after a stalled shutdown no world can start


if __name__ == "__main__":
    main()
