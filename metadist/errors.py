"""Exceptions of remote calls, and the form in which a worker's exception travels back."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import traceback
from typing import Any

__all__ = [
    "RemoteError",
    "RemoteFailure",
    "is_connection_lost",
    "is_timeout",
    "qualified_name",
    "resolve_qualified_name",
    "worker_gone",
]


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` says a wait timed out: torch's RPC reports that only in its message."""
    if isinstance(error, TimeoutError):
        return True
    text = str(error).lower()
    return "timeout" in text or "timed out" in text


# TensorPipe names a lost connection by its libuv error: EOF when the peer's process went away
# while a call was in flight or since (its socket closed), EPIPE / ECONNRESET when this side wrote
# to it, ECONNREFUSED when it had stopped listening before this side first connected.
_CONNECTION_LOST = re.compile(r"\b(EOF: end of file|EPIPE|ECONNRESET|ECONNREFUSED|ECONNABORTED)\b")


def is_connection_lost(error: BaseException) -> bool:
    """Whether ``error`` says the connection to the other worker is gone (its process exited or
    crashed): torch's RPC reports that only in its message, as TensorPipe's transport error."""
    return not isinstance(error, TimeoutError) and _CONNECTION_LOST.search(str(error)) is not None


def worker_gone(worker: str, rank: int | None = None) -> str:
    """The sentence that says ``worker`` (rank ``rank``, when known) is gone."""
    who = f"worker {worker!r}" if rank is None else f"worker {worker!r} (rank {rank})"
    return f"{who} closed its connection: the process exited or crashed"


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or type (``repr`` for an object without them)."""
    qualname = getattr(obj, "__qualname__", None)
    if qualname is None:
        return repr(obj)
    return f"{getattr(obj, '__module__', '?')}.{qualname}"


def resolve_qualified_name(module: str, qualname: str) -> Any:
    """The object a module's attribute path names, or ``None`` (the module is not imported here)."""
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


class RemoteError(RuntimeError):
    """A remote function failed and its exception type cannot be rebuilt on the caller.

    A type importable on the caller that takes one message is re-raised instead; either way the
    exception carries the attributes below, and its message names worker, partition, traceback.

    Args:
        message: The error message; the keyword arguments set the attributes of the same names.

    Attributes:
        worker_name: Name of the worker the partition ran on.
        partition_index: Index of the failed partition (partition order).
        remote_type: ``module.qualname`` of the remote exception's type.
        remote_traceback: The formatted traceback captured on the worker.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_name: str = "",
        partition_index: int = -1,
        remote_type: str = "",
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.worker_name = worker_name
        self.partition_index = partition_index
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


@dataclasses.dataclass
class RemoteFailure:
    """A partition's exception in a form that always unpickles on the caller (the exception
    itself may not); ``stage`` is ``"decode"`` (the arguments), ``"call"`` or ``"backward"``."""

    type_module: str
    type_qualname: str
    message: str
    trace: str
    worker: str
    stage: str

    @classmethod
    def capture(cls, error: BaseException, worker: str, stage: str) -> RemoteFailure:
        """Record ``error`` (raised on ``worker`` while in ``stage``) with its traceback."""
        kind, trace = type(error), "".join(traceback.format_exception(error))
        return cls(kind.__module__, kind.__qualname__, str(error), trace, worker, stage)

    def to_exception(self, index: int, count: int, func_name: str) -> BaseException:
        """The exception to raise on the caller for partition ``index`` of ``count`` (``count``
        0: for a gradient request, where ``func_name`` says what ran)."""
        type_name = f"{self.type_module}.{self.type_qualname}"
        if count:
            what = (
                f"{func_name}() raised {type_name} on worker {self.worker!r} (partition {index} "
                f"of {count})"
            )
        else:
            what = f"{func_name} raised {type_name} on worker {self.worker!r}"
        message = f"{self.message}\n\n[metadist] {what}. Remote traceback:\n{self.trace}"
        exc: BaseException = RemoteError(message)
        exc_type = resolve_qualified_name(self.type_module, self.type_qualname)
        if isinstance(exc_type, type) and issubclass(exc_type, Exception):
            with contextlib.suppress(Exception):  # a type that takes no message: RemoteError
                exc = exc_type(message)
        exc.worker_name = self.worker  # type: ignore[attr-defined]
        exc.partition_index = index  # type: ignore[attr-defined]
        exc.remote_type = type_name  # type: ignore[attr-defined]
        exc.remote_traceback = self.trace  # type: ignore[attr-defined]
        return exc
