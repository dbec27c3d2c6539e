"""Distributed autograd with the semantics of ``torch.autograd``.

``torch.distributed.autograd`` does not write ``.grad``: it accumulates every gradient of a
context into that context's gradient map, across all backward passes run in the context.
metadist builds the familiar semantics on top:

* :func:`backward` accumulates into ``.grad`` of this worker's leaves exactly like
  ``torch.autograd.backward`` (only this pass's contribution is added);
* :func:`grad` returns new tensors and touches neither ``.grad`` nor earlier results, so calling
  it twice in one context does not double-count (TorchOpt's returns the map's accumulated
  tensors, which a second call both doubles and mutates in place).

Floating-point caveat: the first pass in a :func:`context` reads the map directly (exact). Later
passes in the same context get their contribution as ``map_after - map_before``, which can
differ from a fresh computation in the last bits (about 1e-7 relative in float32).

Distributed autograd (FAST mode) also needs every remote result received in a context, also
before an earlier backward pass in it, to be reachable from the roots of each backward pass, or
it waits forever. metadist checks this for results of :func:`metadist.remote_async_call` made
inside :func:`context` and raises instead; open one context per backward pass.

Example:
    >>> import torch
    >>> import metadist
    >>> @metadist.auto_init_rpc()
    ... def main():
    ...     w = torch.ones(2, requires_grad=True)
    ...     with context() as ctx:
    ...         (y,) = metadist.remote_sync_call(torch.mul, args=(w, 2.0), partitioner=0)
    ...         return grad(ctx, y.sum(), w)
    >>> main()
    (tensor([2., 2.]),)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd

# Re-exported by torch.distributed.autograd from its C extension; typed as untyped there.
from torch.distributed.autograd import backward as _dist_backward  # type: ignore[attr-defined]
from torch.distributed.autograd import get_gradients as _dist_get_gradients  # type: ignore[attr-defined]

from metadist import transport
from metadist.world import require_rpc

__all__ = ["backward", "context", "get_gradients", "grad"]

# Contexts opened by context() in which no backward pass has run yet: their map is empty, so a
# first pass needs no snapshot and its gradients are exact.
_FRESH: set[int] = set()
_FRESH_LOCK = threading.Lock()


@contextlib.contextmanager
def context() -> Iterator[int]:
    """Open a distributed autograd context; yields its id.

    Remote calls made inside it are recorded for distributed autograd; pass the id to
    :func:`backward`, :func:`grad` or :func:`get_gradients`.

    Yields:
        The context id.

    Raises:
        RuntimeError: RPC is not running (see :func:`metadist.auto_init_rpc`).

    Example:
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     with context() as context_id:
        ...         return isinstance(context_id, int)
        >>> main()
        True
    """
    require_rpc("metadist.autograd.context")
    with dist_autograd.context() as context_id:
        with _FRESH_LOCK:
            _FRESH.add(context_id)
        transport._push_context(context_id)
        try:
            yield context_id
        finally:
            transport._pop_context(context_id)
            with _FRESH_LOCK:
                _FRESH.discard(context_id)


def _roots(tensors: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not roots:
        raise ValueError(f"{name} must hold at least one tensor")
    for i, t in enumerate(roots):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.numel() != 1:
            raise ValueError(
                f"{name}[{i}] has shape {tuple(t.shape)}; distributed autograd starts from "
                f"scalars only: reduce it first (e.g. .sum() or .mean())"
            )
        if not t.requires_grad:
            raise RuntimeError(
                f"{name}[{i}] does not require grad and does not have a grad_fn; compute it "
                f"from tensors that require grad (inside metadist.autograd.context())"
            )
    return roots


def _leaves(tensors: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    leaves = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if not t.requires_grad or t.grad_fn is not None:
            raise ValueError(
                f"{name}[{i}] must be a leaf tensor that requires grad (distributed autograd "
                f"records gradients of leaves only), got requires_grad={t.requires_grad}, "
                f"grad_fn={t.grad_fn}"
            )
    return leaves


def check_context(context_id: int, api: str) -> None:
    """Raise ``ValueError`` unless ``context_id`` is a live distributed-autograd context here.

    Torch's own error for an unknown id is a bare ``RuntimeError`` raised deep inside the call;
    metadist checks first, so that the message names the argument and nothing is sent.

    Args:
        context_id: The id to check.
        api: The public name the user called, for the message.

    Raises:
        ValueError: ``context_id`` is not an int, or no such context exists in this process.

    Example:
        >>> check_context(987654321, "metadist.autograd.backward")  # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: metadist.autograd.backward: context_id 987654321 is not a live ...
    """
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise ValueError(f"{api}: context_id must be an int, got {context_id!r}")
    try:
        _dist_get_gradients(context_id)
    except RuntimeError:
        raise ValueError(
            f"{api}: context_id {context_id} is not a live distributed-autograd context of this "
            f"process; use the id from `with metadist.autograd.context() as context_id:` "
            f"(or torch.distributed.autograd.context()) while that block is open"
        ) from None


def _check_reachable(context_id: int, roots: list[torch.Tensor]) -> int:
    """Raise unless this pass can complete; return how many received nodes it reaches."""
    dangling = transport._dangling(context_id)
    if dangling:
        raise RuntimeError(
            f"{len(dangling)} remote call(s) in distributed autograd context {context_id} were "
            f"sent tensors that require grad but returned nothing that requires grad: "
            f"{', '.join(dangling)}. torch's distributed autograd would wait forever for "
            f"their gradients in every backward pass of this context. Make such calls "
            f"(metrics, evaluation) under torch.no_grad() or outside the context, or return a "
            f"result computed from the differentiable arguments"
        )
    nodes, passed, freed = transport._received(context_id)
    if not nodes:
        return 0
    pending = {id(node): i for i, node in enumerate(nodes)}
    # Holds the visited nodes: their Python wrappers may be created on access, and a freed
    # one's id could be reused by another node.
    seen: dict[int, Any] = {}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack and pending:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        pending.pop(id(node), None)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    if pending:
        earlier = sum(i < passed for i in pending.values())
        hint = (
            f" {earlier} of them were received before an earlier backward pass in this context "
            f"and every later pass in a context must reach them too: open a new "
            f"metadist.autograd.context() for each backward pass (e.g. one per step)"
            if earlier
            else ""
        )
        raise RuntimeError(
            f"{len(pending)} remote result(s) received in distributed autograd context "
            f"{context_id} are not reachable from the roots of this backward pass; torch's "
            f"distributed autograd would wait for their gradients forever. Include them in the "
            f"roots (e.g. backward on the sum of all losses), or compute them in their own "
            f"context.{hint}"
        )
    if freed:
        # Every result is reached, so those an earlier pass freed would fail on the workers.
        raise RuntimeError(
            f"{freed} remote result(s) reached by this backward pass were already "
            f"differentiated by an earlier backward pass in distributed autograd context "
            f"{context_id} without retain_graph=True, which freed their graph. Pass "
            f"retain_graph=True to the earlier pass, or open a new metadist.autograd.context() "
            f"for each backward pass (e.g. one per step)"
        )
    return len(nodes)


def _snapshot(context_id: int, only: list[torch.Tensor] | None) -> dict[torch.Tensor, torch.Tensor]:
    with _FRESH_LOCK:
        fresh = context_id in _FRESH
        _FRESH.discard(context_id)
    if fresh:
        return {}
    grads = _dist_get_gradients(context_id)
    if only is None:
        return {t: g.clone() for t, g in grads.items()}
    return {t: grads[t].clone() for t in only if t in grads}


def _pass(
    context_id: int,
    roots: list[torch.Tensor],
    targets: list[torch.Tensor] | None,
    retain_graph: bool,
) -> dict[torch.Tensor, torch.Tensor]:
    """Run one backward pass; return its own gradient of each leaf reached (among ``targets``).

    The context's map accumulates over passes, so this pass's share is ``after - before``.
    """
    reached = _check_reachable(context_id, roots)
    before = _snapshot(context_id, targets)
    _dist_backward(context_id, roots, retain_graph=retain_graph)
    # The received nodes stay until the context closes: later passes must reach them too.
    transport._record_pass(context_id, reached, retain_graph)
    after: dict[torch.Tensor, torch.Tensor] = _dist_get_gradients(context_id)
    deltas: dict[torch.Tensor, torch.Tensor] = {}
    with torch.no_grad():
        for t in after if targets is None else targets:
            total = after.get(t)
            if total is not None:
                previous = before.get(t)
                deltas[t] = total - previous if previous is not None else total.clone()
    return deltas


def backward(
    context_id: int,
    tensors: torch.Tensor | Sequence[torch.Tensor],
    retain_graph: bool = False,
    inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> None:
    """Run a distributed backward pass and accumulate into ``.grad`` like ``torch.autograd``.

    Gradients of this worker's leaves (e.g. the caller's model parameters, also when the model
    was an argument of a remote call) are added to their ``.grad``; leaves on other workers get
    theirs in the context's gradient map on that worker.

    Args:
        context_id: The id from :func:`context`.
        tensors: Scalar root tensor(s).
        retain_graph: Keep the graph for another pass.
        inputs: Only accumulate into these leaves (default: every leaf reached).

    Raises:
        RuntimeError: RPC is not running; a root does not require grad; a remote result of this
            context is unreachable from the roots (the pass would hang).
        ValueError: An unknown ``context_id``, a non-scalar root or a non-leaf input.

    Example:
        >>> import torch
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     w = torch.ones(2, requires_grad=True)
        ...     with context() as ctx:
        ...         (y,) = metadist.remote_sync_call(torch.mul, args=(w, 3.0), partitioner=0)
        ...         backward(ctx, [y.sum()])
        ...     return w.grad
        >>> main()
        tensor([3., 3.])
    """
    require_rpc("metadist.autograd.backward")
    check_context(context_id, "metadist.autograd.backward")
    roots = _roots(tensors, "tensors")
    targets = None if inputs is None else _leaves(inputs, "inputs")
    with torch.no_grad():
        for t, delta in _pass(context_id, roots, targets, retain_graph).items():
            if t.grad is None:
                t.grad = delta
            else:
                t.grad += delta


def grad(
    context_id: int,
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    retain_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Return the gradients of ``outputs`` with respect to ``inputs`` (new tensors).

    Neither ``.grad`` nor earlier results are touched; a second call in the same context
    returns only that pass's gradients (see the module notes for the float caveat).

    Args:
        context_id: The id from :func:`context`.
        outputs: Scalar root tensor(s).
        inputs: Leaf tensor(s) of this worker that require grad.
        retain_graph: Keep the graph for another pass.
        allow_unused: Return ``None`` for inputs the pass did not reach instead of raising.

    Returns:
        One gradient (or ``None``) per input.

    Raises:
        RuntimeError: An input was not reached and ``allow_unused`` is false, or see
            :func:`backward`.
        ValueError: An unknown ``context_id``, a non-scalar output or a non-leaf input.

    Example:
        >>> import torch
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     w = torch.ones(2, requires_grad=True)
        ...     with context() as ctx:
        ...         (y,) = metadist.remote_sync_call(torch.mul, args=(w, 3.0), partitioner=0)
        ...         loss = y.sum()
        ...         first = grad(ctx, loss, w, retain_graph=True)
        ...         second = grad(ctx, loss, w)
        ...     return first[0], second[0]
        >>> main()
        (tensor([3., 3.]), tensor([3., 3.]))
    """
    require_rpc("metadist.autograd.grad")
    check_context(context_id, "metadist.autograd.grad")
    roots = _roots(outputs, "outputs")
    targets = _leaves(inputs, "inputs")
    deltas = _pass(context_id, roots, targets, retain_graph)
    for i, t in enumerate(targets):
        if t not in deltas and not allow_unused:
            raise RuntimeError(
                f"inputs[{i}] was not reached by this backward pass (it was not used to "
                f"compute the outputs); pass allow_unused=True to get None for it"
            )
    return tuple(deltas.get(t) for t in targets)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """Return a copy of the context's gradient map on this worker (leaf tensor → gradient).

    The map holds the sum over every backward pass run in the context so far.

    Args:
        context_id: The id from :func:`context`.

    Returns:
        A new dict of cloned gradients.

    Raises:
        RuntimeError: RPC is not running.
        ValueError: ``context_id`` is not a live context of this process.

    Example:
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     with context() as ctx:
        ...         return get_gradients(ctx)
        >>> main()
        {}
    """
    require_rpc("metadist.autograd.get_gradients")
    check_context(context_id, "metadist.autograd.get_gradients")
    return {t: g.clone() for t, g in _dist_get_gradients(context_id).items()}


def is_available() -> bool:
    """Whether torch was built with distributed autograd (``torchopt.distributed.autograd``'s name).

    Returns:
        ``torch.distributed.autograd.is_available()``.

    Example:
        >>> is_available()
        True
    """
    return bool(dist_autograd.is_available())


# torch's context type, under the name torchopt.distributed.autograd re-exports; not in __all__,
# since it is torch's class, documented there.
DistAutogradContext = dist_autograd.DistAutogradContext  # type: ignore[attr-defined]

__all__ += ["is_available"]
