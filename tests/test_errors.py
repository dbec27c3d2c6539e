"""metadist.errors: the exception types of remote calls, the form a worker's error travels back
in, and the shared helpers that tell a timeout and name a function.

In-process: a ``RemoteFailure`` is built, pickled and rebuilt exactly as a worker and its caller
do. Real remote failures (a worker raising, dying, timing out) are in test_remote_faults.py.
"""

from __future__ import annotations

import pickle
import threading

import pytest

from metadist import RemoteError
from metadist.errors import (
    RemoteFailure,
    is_connection_lost,
    is_timeout,
    qualified_name,
    resolve_qualified_name,
    worker_gone,
)


class CustomError(Exception):
    class NestedError(Exception):
        pass


class NeedsTwoArgumentsError(Exception):
    def __init__(self, first: str, second: str) -> None:
        super().__init__(first, second)


def _failure(error: BaseException) -> RemoteFailure:
    try:
        raise error
    except BaseException as raised:
        failure = RemoteFailure.capture(raised, "worker2", "call")
    return pickle.loads(pickle.dumps(failure))  # the trip back to the caller


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("RPC ran for more than set timeout (5000 ms) and will now be marked"), True),
        (RuntimeError("Timed out waiting for the store"), True),
        (TimeoutError("anything"), True),
        (RuntimeError("Connection reset by peer"), False),
        (ValueError("bad value"), False),
    ],
)
def test_is_timeout(error: BaseException, expected: bool) -> None:
    assert is_timeout(error) is expected


_TP = " (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        # What TensorPipe said in tests/test_faults.py for a worker that died, during or before.
        (RuntimeError("EOF: end of file" + _TP), True),
        (RuntimeError("EPIPE: broken pipe" + _TP), True),
        (RuntimeError("ECONNRESET: connection reset by peer" + _TP), True),
        (RuntimeError("ECONNREFUSED: connection refused" + _TP), True),
        (TimeoutError("EOF: end of file"), False),  # a timeout is not a lost connection
        (RuntimeError("RPC ran for more than set timeout (5000 ms)"), False),
        (ValueError("bad value"), False),
        (RuntimeError("XEOF: end of file"), False),  # whole words only
    ],
)
def test_is_connection_lost(error: BaseException, expected: bool) -> None:
    assert is_connection_lost(error) is expected


def test_worker_gone_names_the_worker() -> None:
    assert worker_gone("worker1", 1) == (
        "worker 'worker1' (rank 1) closed its connection: the process exited or crashed"
    )
    assert worker_gone("w") == "worker 'w' closed its connection: the process exited or crashed"


def test_qualified_names_round_trip() -> None:
    assert qualified_name(CustomError.NestedError) == f"{__name__}.CustomError.NestedError"
    assert qualified_name(len) == "builtins.len"
    assert qualified_name(3) == "3"  # no __qualname__: its repr
    assert resolve_qualified_name(__name__, "CustomError.NestedError") is CustomError.NestedError
    assert resolve_qualified_name(__name__, "CustomError.MissingError") is None
    assert resolve_qualified_name("no_such_module_here", "X") is None  # never imported here


def test_remote_exception_is_rebuilt_with_its_type_and_location() -> None:
    error = _failure(CustomError.NestedError("bad batch")).to_exception(1, 3, "loss")
    assert type(error) is CustomError.NestedError
    message = str(error)
    assert message.startswith("bad batch\n")
    assert "loss() raised" in message
    assert "on worker 'worker2' (partition 1 of 3)" in message
    assert "Remote traceback" in message
    assert "raise error" in message  # the worker's own traceback travels with it
    assert (error.worker_name, error.partition_index) == ("worker2", 1)  # type: ignore[attr-defined]
    assert error.remote_type == f"{__name__}.CustomError.NestedError"  # type: ignore[attr-defined]


def test_unrebuildable_exception_becomes_remote_error() -> None:
    # A type whose constructor wants two arguments, and one the caller cannot import.
    failures = [_failure(NeedsTwoArgumentsError("a", "b")), _failure(KeyError("k"))]
    failures[1].type_module = "only_on_the_worker"
    for failure in failures:
        error = failure.to_exception(0, 2, "step")
        assert type(error) is RemoteError
        assert error.worker_name == "worker2"
        assert error.partition_index == 0
        assert error.remote_type.endswith(failure.type_qualname)


def test_an_unpicklable_exception_still_travels() -> None:
    class HoldsALockError(Exception):
        def __init__(self) -> None:
            super().__init__("locked")
            self.lock = threading.Lock()

    with pytest.raises((TypeError, AttributeError)):  # the lock, or the local class
        pickle.dumps(HoldsALockError())
    failure = _failure(HoldsALockError())
    assert (failure.message, failure.stage, failure.worker) == ("locked", "call", "worker2")
    # A local class cannot be found by name on the caller: a RemoteError names it instead.
    assert "HoldsALockError" in failure.to_exception(0, 1, "f").remote_type  # type: ignore[attr-defined]
