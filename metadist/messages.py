"""The wire protocol between a caller and its workers: one named type per message.

Every message is built by keyword and read by field name. A partition travels as a
:class:`Request` and comes back as a :class:`Reply`; a backward pass sends one
:class:`GradientRequest` per worker, of one :class:`GradientItem` per kept graph, and gets one
:class:`Answer` per item. Tensors inside are wired by :mod:`metadist.transport`.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

__all__ = ["Answer", "CallerState", "GradientItem", "GradientRequest", "Reply", "Request"]


class CallerState(NamedTuple):
    """The caller's autograd mode and autocast state, re-created around the partition."""

    grad_mode: str  # "grad", "no_grad" or "inference"
    autocast: tuple[tuple[str, torch.dtype], ...]

    @staticmethod
    def here() -> CallerState:
        """This thread's state."""
        if torch.is_inference_mode_enabled():
            mode = "inference"
        elif torch.is_grad_enabled():
            mode = "grad"
        else:
            mode = "no_grad"
        autocast = tuple(
            (d, torch.get_autocast_dtype(d))
            for d in ("cpu", "cuda")
            if torch.is_autocast_enabled(d)
        )
        return CallerState(grad_mode=mode, autocast=autocast)

    def enter(self, stack: contextlib.ExitStack) -> None:
        """Put this thread in this state until ``stack`` closes."""
        if self.grad_mode == "inference":
            stack.enter_context(torch.inference_mode())
        elif torch.is_grad_enabled() != (self.grad_mode == "grad") or (
            torch.is_inference_mode_enabled()
        ):
            stack.enter_context(torch.set_grad_enabled(self.grad_mode == "grad"))
        for device, dtype in self.autocast:
            stack.enter_context(torch.autocast(device, dtype))


class Request(NamedTuple):
    """One partition, caller to worker."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    decode: bool  # the arguments hold transport's wire objects
    compression: torch.dtype | None
    state: CallerState
    graph: int | None  # the key to keep the partition's graph under; None: keep none
    attached: bool  # travels attached to the caller's distributed autograd context
    in_context: bool  # the caller is inside a distributed autograd context
    timed: bool  # the caller records a timeline
    release: tuple[int, ...]  # keys of this worker's graphs the caller no longer needs


class Reply(NamedTuple):
    """A partition's result, worker to caller."""

    value: Any  # the result, detached (its tensors wired where ``wired``)
    outputs: tuple[int, ...]  # flat indices of the result's tensors that required grad
    fresh: tuple[int, ...]  # flat indices of the leaves the function made (leaves on the caller)
    kept: bool  # the outputs' graph is kept under the request's key (else they are leaves too)
    # (leaf position, its .grad now (wired), whether changed in place, whether it has a graph:
    # then the kept graph's next output, after the result's) where it changed
    grads: tuple[tuple[int, Any, bool, bool], ...]
    wired: bool
    start: float
    end: float


class GradientItem(NamedTuple):
    """One kept graph in a gradient request: its results' gradients (wired, ``None`` where a
    result got none), and with ``create_graph`` the key to keep the answer's graph under and
    which gradients have a graph on the caller (the answer is differentiated with respect to
    those; empty without ``create_graph``)."""

    graph: int
    grads: list[Any]
    answer_graph: int | None
    with_graph: tuple[bool, ...]


class GradientRequest(NamedTuple):
    """One backward pass's gradients for one worker's kept graphs."""

    items: list[GradientItem]
    retain: bool  # the caller's retain_graph: else the pass frees what it went through
    create_graph: bool
    compression: torch.dtype | None


class Answer(NamedTuple):
    """One item's answer: the gradient of each of the graph's leaves (wired, or ``None``), and
    the indices of those whose graph the worker kept (``create_graph``)."""

    grads: list[Any]
    kept: tuple[int, ...]
