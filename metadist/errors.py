"""Exceptions raised by metadist's remote calls."""

from __future__ import annotations

__all__ = ["RemoteError"]


class RemoteError(RuntimeError):
    """A remote function failed and its exception type cannot be rebuilt on the caller.

    When the remote exception's type is importable on the caller and accepts a single message
    argument, metadist re-raises that type instead; either way the exception carries the
    attributes below and its message names the worker, the partition and the remote traceback.

    Args:
        message: The error message (metadist's include the remote traceback).
        worker_name: Name of the worker the partition ran on.
        partition_index: Index of the failed partition.
        remote_type: ``module.qualname`` of the remote exception's type.
        remote_traceback: The formatted traceback captured on the worker.

    Attributes:
        worker_name: Name of the worker the partition ran on.
        partition_index: Index of the failed partition (partition order).
        remote_type: ``module.qualname`` of the remote exception's type.
        remote_traceback: The formatted traceback captured on the worker.

    Example:
        >>> err = RemoteError("boom", worker_name="worker1", partition_index=0)
        >>> err.worker_name, err.partition_index
        ('worker1', 0)
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
