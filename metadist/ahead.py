"""The backward run ahead: a partition's backward computed right after its forward.

A MAML step's loss is usually a mean over partitions, and ``loss.backward()`` then hands each
partition's result the same gradient step after step (its share of the mean). Once a call site
has seen the same gradients, bit for bit, in its last two first-order passes, the next call's
partitions run their backward with them as soon as their forward is done: a worker sends the
answer with its reply, and the caller computes its own partitions' answers while it waits for
the workers. The backward pass then only checks that the gradients are the expected ones, bit
for bit, and uses the answers; otherwise it computes them as it would have (the graphs are
kept for that). So the result is the same computation on the same numbers either way; what
moves is the time at which it runs, from the backward into the forward, where the caller
would otherwise wait for the workers.

Results of one element only (a loss), from a forward short enough for it to pay
(:data:`MAX_FORWARD_S`); the expectation is a float per result that requires grad, ``None``
where the result got no gradient. A call site is what the caller makes of a call
(its function, partition sizes and count), and a partition its index there.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "ENABLED",
    "MAX_FORWARD_S",
    "answerable",
    "backward",
    "expected",
    "forget",
    "hooks_off",
    "note",
    "same",
    "worth",
]

Expectation = tuple[float | None, ...]

# {site: {partition index: (the gradients of the last pass, whether the pass before had them)}}
_SEEN: dict[Any, dict[int, tuple[Expectation | None, bool]]] = {}
_SEEN_LOCK = threading.Lock()
#: Sites remembered at most; a balanced split makes a new site per set of sizes.
MAX_SITES = 1024
#: Set to ``False`` on the caller to compute every backward in its pass (for measurements, or
#: to free each worker's graph in the pass rather than with the next message).
ENABLED = True
#: A partition whose forward took longer runs its backward in the pass. Run ahead, a backward
#: keeps its graph for a pass that may bring other gradients, so the saved tensors a pass
#: would free as it goes stay taken and the backward's own tensors need fresh pages: up to 22 %
#: slower on glibc (benchmarks/bench_retain.py), which outweighs the one round trip saved
#: (1-3 ms) once the forward takes longer than a few round trips.
MAX_FORWARD_S = 0.01


def worth(forward_seconds: float) -> bool:
    """Whether a partition whose forward took ``forward_seconds`` should run its backward
    ahead (see :data:`MAX_FORWARD_S`)."""
    return forward_seconds <= MAX_FORWARD_S


def expected(site: Any, index: int) -> Expectation | None:
    """The gradients partition ``index`` of ``site`` got in each of its last two first-order
    passes, if those were the same; else ``None``."""
    seen = _SEEN.get(site) if ENABLED else None
    last = None if seen is None else seen.get(index)
    return last[0] if last is not None and last[1] else None


def note(site: Any, index: int, grads: Sequence[torch.Tensor | None]) -> None:
    """Note the gradients partition ``index`` of ``site`` got in a first-order pass."""
    value = (
        None
        if any(g is not None and g.numel() != 1 for g in grads)
        else tuple(None if g is None else g.item() for g in grads)
    )
    with _SEEN_LOCK:
        seen = _SEEN.get(site)
        if seen is None:
            if len(_SEEN) >= MAX_SITES:
                _SEEN.clear()
            seen = _SEEN[site] = {}
        last = seen.get(index)
        seen[index] = (value, value is not None and last is not None and same(last[0], value))


def forget(site: Any) -> None:
    """Forget ``site``: its last call was not differentiated, so the next one runs no backward
    ahead until two passes agree again."""
    with _SEEN_LOCK:
        _SEEN.pop(site, None)


def same(expect: Expectation | None, grads: Sequence[torch.Tensor | float | None]) -> bool:
    """Whether ``grads`` (one-element tensors or floats) are ``expect``, bit for bit."""
    if expect is None or len(expect) != len(grads):
        return False
    for e, g in zip(expect, grads, strict=True):
        if e is None or g is None:
            if (e is None) != (g is None):
                return False
            continue
        if isinstance(g, torch.Tensor) and (g.numel() != 1 or g.requires_grad):
            return False
        # Exact: a float64 holds any float32, float16 or bfloat16.
        v = g.item() if isinstance(g, torch.Tensor) else g
        if not (v == e and math.copysign(1.0, v) == math.copysign(1.0, e)):
            return False
    return True


def backward(
    outputs: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor], expect: Expectation
) -> tuple[torch.Tensor | None, ...] | None:
    """The gradients of ``leaves`` when ``outputs`` get the ``expect``-ed gradients, the graph
    kept for a pass that expects otherwise; ``None`` when they do not apply or the backward
    fails (the pass then computes, and reports, it).

    Only when every output gets a gradient: a pass that uses the answers frees the whole graph,
    as a local pass frees what it goes through. An output no pass reaches (the logits beside
    a loss) would keep it alive as long as the caller keeps that output, where a local pass
    through the loss frees their shared part; and a later pass through an output the first
    one did not reach needs the graph."""
    if len(expect) != len(outputs) or any(e is None for e in expect):
        return None
    reached: list[tuple[torch.Tensor, torch.Tensor]] = []
    for o, e in zip(outputs, expect, strict=True):
        assert e is not None
        if o.numel() != 1 or not o.is_floating_point() or not o.requires_grad:
            return None
        reached.append((o, torch.full_like(o, e)))
    try:
        with torch.enable_grad():
            found = torch.autograd.grad(
                [o for o, _ in reached],
                list(leaves),
                [g for _, g in reached],
                retain_graph=True,
                allow_unused=True,
            )
    except Exception:
        return None
    return tuple(found)


def answerable(output: torch.Tensor, sources: Sequence[torch.Tensor]) -> bool:
    """Whether answering ``output``'s backward ahead for ``sources``, the answers then handed on
    to them in the pass, does what the pass would do through ``output``'s graph:

    * every source is a leaf: a non-leaf's history may reach another source (MAML's fast
      weights passed beside the model), whose gradient ``torch.autograd.grad`` gives in full,
      and the pass would send the non-leaf's share down that history again;
    * no source has a tensor hook (``register_hook``): ``torch.autograd.grad`` runs it, and the
      pass would run it again;
    * every tensor that requires grad in the graph is a source (a function may also use one it
      was not given, such as a global parameter, whose gradient the answers would lose);
    * no module backward hook is on the way (``register_full_backward_hook`` on a module the
      function was given): it would run in the forward, where one process runs it in the pass.
    """
    leaves = set()
    for s in sources:
        # ``_backward_hooks``: where Tensor.register_hook keeps a tensor's hooks
        # (register_multi_grad_hook goes through it); torch has no public way to ask.
        if s.grad_fn is not None or s._backward_hooks:
            return False
        leaves.add(id(s))
    # Nodes themselves, not their ids: held here, no id is reused for another node.
    seen: set[Any] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        # By type name: getattr(node, "variable", None) raises inside for every other node,
        # which made the walk 1.8 times slower.
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            if id(node.variable) not in leaves:  # type: ignore[attr-defined]
                return False
            continue
        if kind == "BackwardHookFunctionBackward":
            return False
        for next_node, _ in node.next_functions:
            stack.append(next_node)
    return True


@contextlib.contextmanager
def hooks_off(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The tensor hooks of ``tensors`` taken off for the block, as their handles' ``remove``
    takes them off, and put back in their order after it."""
    held = [(hooks, list(hooks.items())) for t in tensors if (hooks := t._backward_hooks)]
    for hooks, _ in held:
        hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.update(items)
