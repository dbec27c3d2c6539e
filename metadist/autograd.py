"""Gradients through remote calls: the caller's half of a call's backward, and contexts.

Outside a distributed autograd context, a remote call is a differentiable function: each
remote partition's graph stays on its worker (:mod:`metadist.worker`), and on the caller the
call is two nodes (:func:`arguments_node`, :func:`results_node`) whose backward sends the
results' gradients in one request per worker and returns the arguments' gradients, so plain
``loss.backward()``, ``torch.autograd.grad`` (also with ``create_graph``) and ``torch.optim``
work as in one process.

Inside a context (:func:`context`, or ``torch.distributed.autograd.context()``), calls travel
attached to it and torch's distributed autograd differentiates them, as programs built on RRefs
and owners' optimizers need. torch never writes ``.grad`` there: it accumulates every gradient
of a context into the context's map. :func:`backward` and :func:`grad` give the semantics of
``torch.autograd`` on top (this pass's contribution only; ``grad`` can be called twice), and
raise where torch would wait forever: each pass must reach every remote result received in
the context (FAST mode). Later passes in one context get their contribution as
``map_after - map_before``, exact up to the last bits; open one context per pass.

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

import collections
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

# Re-exported by torch.distributed.autograd from its C extension; typed as untyped there.
from torch.distributed.autograd import backward as _dist_backward  # type: ignore[attr-defined]
from torch.distributed.autograd import get_gradients as _dist_get_gradients  # type: ignore[attr-defined]

from metadist import timeline, transport
from metadist import worker as remote_worker
from metadist._pytree import tree_flatten
from metadist.errors import RemoteError, RemoteFailure
from metadist.world import require_rpc

# current_context, grad_inputs and receive are metadist.api's way in; not part of the user API.
__all__ = ["backward", "context", "get_gradients", "grad"]

# ------------------------------------------------------------------------------------------------
# A remote call as a differentiable function (outside distributed autograd contexts)
#
# The worker keeps each partition's graph (metadist.worker); on the caller, the call is three
# nodes. ``_Arguments`` is made before the caller's own partitions run, so the engine, which
# runs the newest ready node first, reaches it after their backward: it waits for the answers
# and returns the arguments' gradients. ``_Results`` is made when the results arrive, so it runs
# as soon as their gradients are known: it sends them, one request per worker, and hands
# ``_Arguments`` a zero so that the workers' backward overlaps the caller's own. ``_Probe``, on
# the results' side of ``_Results``, tells it whether the pass keeps the graph: a custom node
# cannot see ``retain_graph``, but torch frees a node's saved tensors right after it runs in a
# pass without it, so the probe's saved marker is gone by the time ``_Results`` runs.

# Graphs the caller no longer needs, per (world, worker): sent along with the next message to
# that worker rather than in messages of their own.
_RELEASED: dict[tuple[object, str], list[int]] = {}
_RELEASED_LOCK = threading.Lock()


def released(world_token: object, worker: str) -> tuple[int, ...]:
    """Take the numbers of ``worker``'s graphs that the caller's graph no longer holds."""
    with _RELEASED_LOCK:
        numbers = _RELEASED.pop((world_token, worker), None)
    return tuple(numbers) if numbers else ()


def _release(world_token: object, parts: list[Part]) -> None:
    with _RELEASED_LOCK:
        for part in parts:
            _RELEASED.setdefault((world_token, part.worker), []).append(part.number)


def _release_when_dropped(ctx: Any, world_token: object, parts: list[Part]) -> None:
    """Release the graphs of ``parts`` when the node ``ctx`` is freed with the caller's graph."""
    ctx.marker = torch.empty(0)
    weakref.finalize(ctx.marker, _release, world_token, parts)  # ``parts`` may still grow


class Part(NamedTuple):
    """One remote partition's kept graph, as the caller sees it."""

    worker: str
    number: int
    inputs: list[int]  # positions in the call's argument list
    outputs: int  # how many of the results' tensors require grad
    record: Any  # the partition's timeline record, or None


class RemoteGradients:
    """The state one remote call's two nodes share: its arguments, its parts, the answers."""

    # No tensors here: the nodes hold this object, and a tensor whose graph holds them would
    # make a reference cycle through torch's C++ nodes that Python's collector cannot see.
    def __init__(self, inputs: int, world_token: object, compression: Any) -> None:
        self.inputs = inputs
        self.world_token = world_token
        self.compression = compression
        self.parts: list[Part] = []  # also what the release marker releases
        # Per worker: the parts this pass reached, with their outputs' gradients, and the
        # future of the answer.
        self.sent: dict[str, tuple[list[tuple[Part, list[torch.Tensor | None]]], Any]] = {}
        self.probes: list[Callable[[], torch.Tensor | None]] = []  # per output: see _Probe
        self.retain = False  # keep the workers' graphs whatever the pass (see _second_order)

    def send(
        self, grads: tuple[torch.Tensor | None, ...], create_graph: bool, retain: bool
    ) -> None:
        """Send the results' gradients, one request per worker; don't wait for the answers.

        Without ``retain``, each worker frees what the pass went through, as a local backward
        pass would, and forgets the graphs whose every output it reached.
        """
        per_worker: dict[str, list[tuple[Part, list[torch.Tensor | None]]]] = {}
        offset = 0
        for part in self.parts:
            mine = list(grads[offset : offset + part.outputs])
            offset += part.outputs
            if any(g is not None for g in mine):
                per_worker.setdefault(part.worker, []).append((part, mine))
        self.sent = {}
        log = timeline.active()
        for worker, items in per_worker.items():
            if log is not None:
                log.add_request(worker)
                for part, _ in items:
                    if part.record is not None:
                        part.record.gradients_sent = timeline.now()
            future = request(
                worker,
                [(p.number, g, not retain and all(t is not None for t in g)) for p, g in items],
                create_graph or retain,
                create_graph,
                self.compression,
            )
            self.sent[worker] = (items, future)

    def collect(self, inputs: tuple[torch.Tensor, ...], create_graph: bool) -> list[Any]:
        """Wait for the answers; return the gradient of each argument (``None``: not reached)."""
        sent, self.sent = self.sent, {}
        answered = {worker: answers(worker, future) for worker, (_, future) in sent.items()}
        totals: list[torch.Tensor | None] = [None] * self.inputs
        for worker, (items, _) in sent.items():
            for (part, grads), (answer, number, diff) in zip(items, answered[worker], strict=True):
                found = answer
                if create_graph and number >= 0:
                    found = _second_order(part, inputs, grads, answer, number, diff, self)
                for position, g in zip(part.inputs, found, strict=True):
                    if g is not None:
                        total = totals[position]
                        totals[position] = g if total is None else total + g
        return totals


def request(
    worker: str,
    items: list[tuple[int, list[torch.Tensor | None], bool]],
    retain: bool,
    create_graph: bool,
    compression: Any,
) -> Any:
    """Send one gradient request to ``worker``; a future of its answers.

    ``items``: per graph, its number, the outputs' gradients and whether to forget it after.
    Releases never travel with it: another request of the same backward pass may still be
    reading a graph that this pass has just freed on the caller.
    """
    if compression is not None:
        items = [(n, transport.compress_tree(g, compression), d) for n, g, d in items]
    args = (items, retain, create_graph, compression)
    return rpc.rpc_async(worker, remote_worker.vjp, args=args)


def answers(worker: str, future: Any) -> list[Any]:
    """The answers of a gradient request, or the worker's error raised here."""
    try:
        value = future.wait()
    except Exception as error:
        raise RemoteError(
            f"the gradient request to worker {worker!r} failed in RPC: {type(error).__name__}: "
            f"{error}",
            worker_name=worker,
        ) from error
    if isinstance(value, RemoteFailure):
        raise value.to_exception(-1, 0, "backward of a remote call")
    return [(transport.decompress_tree(g), n, d) for g, n, d in value]


def _second_order(  # noqa: PLR0917
    part: Part,
    inputs: tuple[torch.Tensor, ...],
    grads: list[torch.Tensor | None],
    found: list[torch.Tensor | None],
    number: int,
    diff: tuple[int, ...],
    state: RemoteGradients,
) -> list[torch.Tensor | None]:
    """The answer as the result of a call of its own, differentiable again (create_graph).

    The worker kept the answer's graph; its leaves are the part's arguments followed by the
    received gradients, so the answer links to both, through the same two nodes as any call.
    """
    sources = [inputs[p] for p in part.inputs] + [g for g in grads if g is not None]
    kept = RemoteGradients(len(sources), state.world_token, state.compression)
    # The answer's graph on the worker runs through the partition's, which a request for the
    # first-order results may still need in this pass: keep it for every pass (dropped with
    # the caller's graph).
    kept.retain = True
    kept.parts.append(Part(part.worker, number, list(range(len(sources))), len(diff), None))
    token = arguments_node(kept, sources)
    result = list(found)
    outputs = [t for i in diff if (t := found[i]) is not None]  # none is None: see _vjp_one
    for i, t in zip(diff, results_node(kept, token, outputs), strict=True):
        result[i] = t
    return result


class _Arguments(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, state: RemoteGradients, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.state = state
        ctx.inputs = inputs  # for create_graph; inputs make no reference cycle
        _release_when_dropped(ctx, state.world_token, state.parts)
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> Any:
        state: RemoteGradients = ctx.state
        return (None, *state.collect(ctx.inputs, torch.is_grad_enabled()))


class _Results(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, state: RemoteGradients, outputs: list[torch.Tensor], token: torch.Tensor
    ) -> Any:
        ctx.state = state
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        state: RemoteGradients = ctx.state
        retain = state.retain or all(
            probe() is not None
            for probe, g in zip(state.probes, grads, strict=True)
            if g is not None
        )
        state.send(grads, torch.is_grad_enabled(), retain)
        return None, None, torch.zeros(())


class _Probe(torch.autograd.Function):
    """Pass one result through; its saved marker outlives only a pass that keeps the graph.

    One per result, so that passes through different results of one call are independent, as
    they are locally when the results share no saved tensors.
    """

    @staticmethod
    def forward(ctx: Any, state: RemoteGradients, output: torch.Tensor) -> torch.Tensor:
        marker = torch.empty(0)
        state.probes.append(weakref.ref(marker))
        ctx.save_for_backward(marker)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.saved_tensors  # noqa: B018 - raises, as locally, on a second pass through a freed graph
        return None, grad


def arguments_node(state: RemoteGradients, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Start a remote call's gradient link: the node that will hold its arguments' gradients.

    Made before the caller runs its own partitions (see the notes above). Returns the token
    to hand to :func:`results_node`.
    """
    return _Arguments.apply(state, *inputs)


def results_node(
    state: RemoteGradients, token: torch.Tensor, outputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Finish the link once every part has arrived: ``outputs`` made differentiable.

    ``outputs`` are the parts' received tensors that require grad, in the order of
    ``state.parts``.
    """
    return [_Probe.apply(state, t) for t in _Results.apply(state, outputs, token)]


# ------------------------------------------------------------------------------------------------
# What metadist knows about each open context: written by remote calls, read by backward passes

_THREAD = threading.local()


@dataclasses.dataclass(slots=True)
class _ContextRecord:
    """Autograd nodes of the remote results received in one metadist context.

    Every backward pass in the context must reach all of them, including those received before
    an earlier pass (torch's distributed autograd, FAST mode, waits for the gradients of every
    remote call made in the context), so they are kept until the context closes.
    """

    nodes: list[Any] = dataclasses.field(default_factory=list)
    # For each result node, the graph nodes of the differentiable arguments of the call that
    # produced it: the worker ties its results to every such argument, so reaching the result
    # reaches them too (how a result sent on to a second call gets its gradient).
    inputs_of: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    # Functions of calls that were sent tensors requiring grad but returned nothing
    # differentiable: the workers' half of their graph can never be reached.
    dangling: list[str] = dataclasses.field(default_factory=list)
    # nodes[:passed] were reached by a completed backward pass; nodes[:freed] by one without
    # retain_graph, which freed their graph (on the workers too).
    passed: int = 0
    freed: int = 0


_RECORDS: dict[int, _ContextRecord] = {}
_RECORDS_LOCK = threading.Lock()


def torch_context_id() -> int | None:
    """The id of the distributed autograd context active on this thread, opened by anyone.

    torch offers no public way to ask; ``_current_context`` is the one private name metadist
    reads, so that calls made inside a context the user opened with
    ``torch.distributed.autograd.context()`` travel attached to it.
    """
    try:
        return int(dist_autograd._current_context()._context_id())  # type: ignore[attr-defined]
    except RuntimeError:
        return None


def current_context() -> int | None:
    """Return the id of the innermost :func:`context` open on this thread, if any."""
    stack: list[int] | None = getattr(_THREAD, "stack", None)
    return stack[-1] if stack else None


def grad_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, list[Any]]:
    """Whether RPC would attach these arguments to distributed autograd, and their graph nodes.

    Returns ``(sends_grad, nodes)``: ``sends_grad`` is true when grad mode is on and a tensor (or
    a module's parameter) among the arguments requires grad; ``nodes`` are the ``grad_fn`` of
    the non-leaf tensors among them (what a backward pass reaches through this call).

    Example:
        >>> import torch
        >>> grad_inputs((torch.ones(1, requires_grad=True),), {})
        (True, [])
    """
    if not torch.is_grad_enabled():
        return False, []
    sends = False
    nodes = []
    leaves, _ = tree_flatten((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                sends = True
                if leaf.grad_fn is not None:
                    nodes.append(leaf.grad_fn)
        elif isinstance(leaf, torch.nn.Module) and not sends:
            sends = any(p.requires_grad for p in leaf.parameters())
    return sends, nodes


def receive(context_id: int, value: Any, inputs: list[Any], name: str, sent_grad: bool) -> Any:
    """Record a partition's result ``value`` received in ``context_id``; return it.

    ``inputs``: the graph nodes of its differentiable arguments (:func:`grad_inputs`); ``name``:
    the partition, for errors; ``sent_grad``: whether it was sent tensors that require grad.
    """
    if sent_grad and surely_not_differentiable(value):
        nodes: list[Any] = []
        dangling = [name]
    else:
        dangling = []
        leaves, _ = tree_flatten(value)
        nodes = [leaf.grad_fn for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.grad_fn]
    if nodes or dangling:
        with _RECORDS_LOCK:
            record = _RECORDS.get(context_id)
            if record is None:
                record = _RECORDS[context_id] = _ContextRecord()
            record.nodes.extend(nodes)
            record.dangling.extend(dangling)
            if inputs:
                for node in nodes:
                    record.inputs_of[id(node)] = inputs
    return value


_PLAIN = (torch.Tensor, int, float, complex, str, bytes, type(None))


def surely_not_differentiable(tree: Any) -> bool:
    """True only if no leaf of ``tree`` can hide a tensor that requires grad.

    A leaf pytree cannot look into (a dataclass, a custom result class) might hold one, so it
    makes the answer False: a false alarm would break correct code.

    Example:
        >>> import torch
        >>> surely_not_differentiable([torch.ones(1), 2.0])
        True
    """
    leaves, _ = tree_flatten(tree)
    for leaf in leaves:
        if not isinstance(leaf, _PLAIN):
            return False
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return False
    return True


def _open_contexts() -> int:
    """How many contexts still hold records (a leak check for tests)."""
    with _RECORDS_LOCK:
        return len(_RECORDS)


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
        stack: list[int] | None = getattr(_THREAD, "stack", None)
        if stack is None:
            stack = _THREAD.stack = []
        stack.append(context_id)
        try:
            yield context_id
        finally:
            stack.remove(context_id)
            with _RECORDS_LOCK:
                _RECORDS.pop(context_id, None)


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
    metadist checks first, so that the message names ``api`` and nothing is sent (and raises
    ``RuntimeError`` when RPC is not running).
    """
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


def _check_reachable(context_id: int, roots: list[torch.Tensor]) -> int:
    """Raise unless this pass can complete; return how many received nodes it reaches."""
    with _RECORDS_LOCK:
        record = _RECORDS.get(context_id)
        if record is None:
            return 0
        dangling = list(record.dangling)
        nodes, passed, freed = list(record.nodes), record.passed, record.freed
        inputs_of = dict(record.inputs_of)
    if dangling:
        raise RuntimeError(
            f"{len(dangling)} remote call(s) in distributed autograd context {context_id} were "
            f"sent tensors that require grad but returned nothing that requires grad: "
            f"{', '.join(dangling)}. torch's distributed autograd would wait forever for "
            f"their gradients in every backward pass of this context. Make such calls "
            f"(metrics, evaluation) under torch.no_grad() or outside the context, or return a "
            f"result computed from the differentiable arguments"
        )
    if not nodes:
        return 0
    pending = {id(node): i for i, node in enumerate(nodes)}
    # Holds the visited nodes: their Python wrappers may be created on access, and a freed
    # one's id could be reused by another node.
    seen: dict[int, Any] = {}
    # Breadth first: remote results sit a few nodes below the roots (under the reducer), while
    # the graph of an in-process partition can hold thousands of nodes; depth first could walk
    # all of them before finding the results.
    stack = collections.deque(t.grad_fn for t in roots if t.grad_fn is not None)
    while stack and pending:
        node = stack.popleft()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        pending.pop(id(node), None)
        stack.extend(child for child, _ in node.next_functions if child is not None)
        stack.extend(inputs_of.get(id(node), ()))
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
    with _RECORDS_LOCK:
        record = _RECORDS.get(context_id)
        if record is not None:
            record.passed = max(record.passed, reached)
            if not retain_graph:
                record.freed = max(record.freed, reached)
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
    check_context(context_id, "metadist.autograd.get_gradients")
    return {t: g.clone() for t, g in _dist_get_gradients(context_id).items()}


def gradients_here(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients of ``context_id`` (not copied; empty if it took no part).

    What an owner's optimizer reads: the context's map on this worker, for the leaves whose
    gradients a backward pass of the context delivered here.
    """
    try:
        return dict(_dist_get_gradients(context_id))
    except RuntimeError:  # no such context here: this worker took no part in it
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

__all__ += ["is_available"]
