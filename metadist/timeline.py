"""An opt-in timeline of remote calls: where each partition ran, when, and how many bytes moved.

While :func:`record` is open, every remote call of this process notes a :class:`PartitionRecord`
per partition. :meth:`Timeline.save` writes Chrome trace JSON (``chrome://tracing`` or
https://ui.perfetto.dev); :meth:`Timeline.summary` prints one screen per worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["PartitionRecord", "Timeline", "record"]


@dataclasses.dataclass
class PartitionRecord:
    """What the timeline knows of one partition (times are ``time.time()`` seconds).

    Attributes:
        call: Number of the remote call in this timeline (0, 1, ...).
        function: The remote function's name.
        partition: Index of the partition in its call.
        worker: Name of the worker that ran it.
        sent: When the caller sent it (or started it, in-process).
        done: When the caller had its result.
        start: When the worker started the function.
        end: When the worker finished it.
        bytes_out: Tensor bytes sent to the worker (0 in-process).
        bytes_in: Tensor bytes of the result.
        gradients_sent: When a backward pass last sent its result's gradients, else ``None``.
    """

    call: int
    function: str
    partition: int
    worker: str
    sent: float
    done: float = 0.0
    start: float = 0.0
    end: float = 0.0
    bytes_out: int = 0
    bytes_in: int = 0
    gradients_sent: float | None = None


class Timeline:
    """The partitions recorded by :func:`record`, in the order their calls were made."""

    def __init__(self) -> None:
        self.partitions: list[PartitionRecord] = []
        #: ``(worker, time)`` of each gradient request sent (one per worker and call reached).
        self.gradient_requests: list[tuple[str, float]] = []
        self.calls = 0
        self._lock = threading.Lock()

    def new_call(self) -> int:
        """Number the next remote call."""
        with self._lock:
            self.calls += 1
            return self.calls - 1

    def add_request(self, worker: str) -> None:
        """Note a gradient request sent to ``worker`` now."""
        with self._lock:
            self.gradient_requests.append((worker, now()))

    def add(self, record: PartitionRecord) -> PartitionRecord:
        """Keep ``record`` (filled in as the partition proceeds)."""
        with self._lock:
            self.partitions.append(record)
        return record

    def trace(self) -> dict[str, Any]:
        """The timeline as a Chrome trace (``{"traceEvents": [...]}``): a process per worker, a
        thread per call, an event per partition run, instant events for gradients sent."""
        workers = sorted({p.worker for p in self.partitions})
        pid = {w: i for i, w in enumerate(workers)}
        origin = min((p.sent for p in self.partitions), default=0.0)
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid[w], "args": {"name": w}} for w in workers
        ]
        for p in self.partitions:
            name, where = f"{p.function}[{p.partition}]", {"pid": pid[p.worker], "tid": p.call}
            args = {"call": p.call, "round trip ms": round((p.done - p.sent) * 1e3, 3)}
            args |= {"bytes out": p.bytes_out, "bytes in": p.bytes_in}
            span = {"ts": (p.start - origin) * 1e6, "dur": max(p.end - p.start, 0.0) * 1e6}
            events.append(
                {"ph": "X", "name": name, "cat": "forward", **where, **span, "args": args}
            )
            if p.gradients_sent is not None:
                sent = {"name": f"gradients of {name} sent", "cat": "backward", **where}
                events.append(
                    {"ph": "i", "s": "p", **sent, "ts": (p.gradients_sent - origin) * 1e6}
                )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`trace` as JSON to ``path``."""
        with open(path, "w") as file:
            json.dump(self.trace(), file)

    def summary(self, slowest: int = 3) -> str:
        """One screen per worker: partitions, busy time and share, bytes, slowest partitions."""
        if not self.partitions:
            return "no remote calls recorded"
        begin = min(p.sent for p in self.partitions)
        span = max(max(p.done, p.end) for p in self.partitions) - begin
        lines = [
            f"{self.calls} call(s), {len(self.partitions)} partition(s) over {span * 1e3:.1f} ms",
            f"{'worker':<12} {'parts':>5} {'busy ms':>9} {'busy %':>7} {'MB out':>8} {'MB in':>8}",
        ]
        for worker in sorted({p.worker for p in self.partitions}):
            mine = [p for p in self.partitions if p.worker == worker]
            busy = sum(p.end - p.start for p in mine)
            lines.append(
                f"{worker:<12} {len(mine):>5} {busy * 1e3:>9.1f} "
                f"{100 * busy / span if span else 0.0:>6.1f}% "
                f"{sum(p.bytes_out for p in mine) / 1e6:>8.3f} "
                f"{sum(p.bytes_in for p in mine) / 1e6:>8.3f}"
            )
        lines.append("slowest partitions:")
        for p in sorted(self.partitions, key=lambda p: p.start - p.end)[:slowest]:
            lines.append(
                f"  call {p.call} {p.function}[{p.partition}] on {p.worker}: "
                f"{(p.end - p.start) * 1e3:.1f} ms on the worker, "
                f"{(p.done - p.sent) * 1e3:.1f} ms round trip"
            )
        return "\n".join(lines)


_ACTIVE: Timeline | None = None
_ACTIVE_LOCK = threading.Lock()


def active() -> Timeline | None:
    """The timeline being recorded in this process, if any (for :mod:`metadist.api`)."""
    return _ACTIVE


@contextlib.contextmanager
def record(path: str | os.PathLike[str] | None = None) -> Iterator[Timeline]:
    """Record every remote call this process makes while the block runs.

    Args:
        path: Where to write the Chrome trace when the block ends (``None``: don't write).

    Yields:
        The :class:`Timeline`; it is complete once the block has ended.

    Raises:
        RuntimeError: A timeline is already being recorded in this process.
    """
    global _ACTIVE
    timeline = Timeline()
    with _ACTIVE_LOCK:
        if _ACTIVE is not None:
            raise RuntimeError("metadist.timeline.record: a timeline is already being recorded")
        _ACTIVE = timeline
    try:
        yield timeline
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE = None
        if path is not None:
            timeline.save(path)


#: The clock the timeline uses (comparable across processes of one machine).
now = time.time
