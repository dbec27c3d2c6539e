"""Distributed autograd contexts, and backward passes in them with ``torch.autograd``'s rules.

A remote call is a differentiable function by itself (:mod:`metadist.link`), so plain
``loss.backward()`` needs no context. Inside a distributed autograd context (:func:`context`, or
``torch.distributed.autograd.context()``) torch's distributed engine runs the same nodes, and the
gradients land in the context's map, as :func:`get_gradients` and owners' optimizers expect.
Only a call with an RRef among its arguments travels attached to the context and is
differentiated by torch's engine (torchopt's ``rref.to_here()`` pattern needs it).

torch never writes ``.grad`` inside a context: it accumulates every gradient of a context into
the context's map, which owners' optimizers apply. :func:`backward` gives the semantics of
``torch.autograd`` on top (this pass's contribution only): a later pass in one context gets its
contribution as ``map_after - map_before``, exact up to the last bits. :func:`grad` is
``torch.autograd.grad`` itself while nothing in the context came through torch's RPC with a
graph (metadist's own calls never do): it then writes nothing, the map included, as in one
process; otherwise it runs torch's engine too, and its gradients join the map.

Each function raises ``RuntimeError`` if RPC is not running, and ``ValueError`` for a
``context_id`` that is not a live context of this process.

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
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed.autograd as dist_autograd

# Re-exported by torch.distributed.autograd from its C extension; typed as untyped there.
from torch.distributed.autograd import backward as _dist_backward  # type: ignore[attr-defined]
from torch.distributed.autograd import get_gradients as _dist_get_gradients  # type: ignore[attr-defined]

from metadist.world import require_rpc

__all__ = ["backward", "context", "get_gradients", "grad", "is_available"]


@contextlib.contextmanager
def context() -> Iterator[int]:
    """Open a distributed autograd context.

    Yields:
        The context id, for this module's functions or an owner's optimizer.
    """
    require_rpc("metadist.autograd.context")
    with dist_autograd.context() as context_id:
        yield context_id


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
    """Raise ``ValueError`` naming ``api`` unless ``context_id`` is a live context here (torch's
    own error is a bare ``RuntimeError`` from deep inside), ``RuntimeError`` without RPC."""
    require_rpc(api)
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


def _pass(
    context_id: int, roots: list[torch.Tensor], targets: list[torch.Tensor] | None, retain: bool
) -> dict[torch.Tensor, torch.Tensor]:
    """Run one backward pass: its own gradient of each leaf reached (among ``targets``)."""
    grads = _dist_get_gradients(context_id)
    keys = list(grads) if targets is None else [t for t in targets if t in grads]
    before = {t: grads[t].clone() for t in keys}
    # A leaf an earlier pass reached is in the map whether this one reaches it or not: a hook
    # tells (unreached, it gets no gradient, as in torch.autograd, not a zero one).
    reached: set[int] = set()
    handles = [
        t.register_hook(functools.partial(_reached, reached, id(t)))
        for t in keys
        if t.requires_grad  # a leaf frozen since then cannot be reached
    ]
    # A root that is a leaf gets a gradient of one, as in torch.autograd; torch's distributed
    # engine takes only roots with a graph.
    graphed = [r for r in roots if r.grad_fn is not None]
    try:
        if graphed:
            _dist_backward(context_id, graphed, retain_graph=retain)
    finally:
        for handle in handles:
            handle.remove()
    after: dict[torch.Tensor, torch.Tensor] = _dist_get_gradients(context_id)
    deltas: dict[torch.Tensor, torch.Tensor] = {}
    with torch.no_grad():
        for t in after if targets is None else targets:
            total = after.get(t)
            previous = before.get(t)
            if total is None or (previous is not None and id(t) not in reached):
                continue
            deltas[t] = total - previous if previous is not None else total.clone()
        for r in roots:
            if r.grad_fn is None and (targets is None or any(r is t for t in targets)):
                deltas[r] = deltas[r] + 1 if r in deltas else torch.ones_like(r)
    return deltas


def _through_rpc(context_id: int) -> bool:
    """Whether torch's RPC brought a tensor with a graph into this context here (an RRef's
    ``to_here()``, ``rpc_sync`` of tensors that require grad); torch has no public way to ask."""
    return bool(dist_autograd._retrieve_context(context_id)._recv_functions())  # type: ignore[attr-defined]


def _reached(reached: set[int], key: int, _: torch.Tensor) -> None:
    reached.add(key)


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
        RuntimeError: A root does not require grad.
        ValueError: A non-scalar root or a non-leaf input.

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
    check_context(context_id, "metadist.autograd.backward")
    roots = _roots(tensors, "tensors")
    targets = None if inputs is None else _leaves(inputs, "inputs")
    with torch.no_grad():
        for t, delta in _pass(context_id, roots, targets, retain_graph).items():
            if t.grad is None:
                t.grad = delta
            else:
                t.grad += delta
            # What torch's AccumulateGrad runs after it wrote .grad (an optimizer step in the
            # backward, say); torch keeps them there, with no public way to run them.
            for hook in (t._post_accumulate_grad_hooks or {}).values():
                hook(t)


def grad(
    context_id: int,
    outputs: torch.Tensor | Sequence[torch.Tensor],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    retain_graph: bool = False,
    allow_unused: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Return the gradients of ``outputs`` with respect to ``inputs`` (new tensors), as
    ``torch.autograd.grad`` (see the module's description).

    Args:
        context_id: The id from :func:`context`.
        outputs: Scalar root tensor(s).
        inputs: Leaf tensor(s) of this worker that require grad.
        retain_graph: Keep the graph for another pass.
        allow_unused: Return ``None`` for inputs the pass did not reach instead of raising.

    Returns:
        One gradient (or ``None``) per input.

    Raises:
        RuntimeError: An input was not reached and ``allow_unused`` is false, or as
            :func:`backward`.
    """
    check_context(context_id, "metadist.autograd.grad")
    roots = _roots(outputs, "outputs")
    targets = _leaves(inputs, "inputs")
    if not _through_rpc(context_id):
        found = torch.autograd.grad(roots, targets, retain_graph=retain_graph, allow_unused=True)
        deltas = {t: g for t, g in zip(targets, found, strict=True) if g is not None}
    else:
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

    Args:
        context_id: The id from :func:`context`.

    Returns:
        A new dict of cloned gradients.
    """
    check_context(context_id, "metadist.autograd.get_gradients")
    return {t: g.clone() for t, g in _dist_get_gradients(context_id).items()}


def gradients_here(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The context's map on this worker, what an owner's optimizer reads (not copied; empty
    if this worker took no part)."""
    try:
        return dict(_dist_get_gradients(context_id))
    except RuntimeError:
        return {}


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
