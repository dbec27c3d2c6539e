"""The worker's side of a remote call: run one partition, keep its graph, answer its backward.

A partition runs as a local function call would: module parameters arrive as ``nn.Parameter``
leaves and tensors that require grad as leaf tensors (see :mod:`metadist.transport`), under the
caller's grad mode and autocast state, so code that builds a ``torch.optim`` optimizer, checks
``p.is_leaf`` or calls ``loss.backward()`` inside the function behaves as in one process. When
the result depends on those leaves, the worker keeps the graph under the key the caller chose
and answers later *gradient requests* for it with ``torch.autograd.grad``: the vector-Jacobian
product of the partition, in the sense of ``torch.func.vjp``. With ``create_graph`` the answer is
itself kept the same way, which is how a gradient of a gradient crosses a call. The caller's
half is in :mod:`metadist.link`; it releases a key when its own graph is freed, or when the
partition's result never reached it (a timeout, a failed sibling).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.futures import Future

from metadist import timeline, transport, world
from metadist._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from metadist.errors import RemoteFailure
from metadist.messages import Answer, GradientItem, GradientRequest, Reply, Request

__all__ = ["current_context_id", "kept_graphs", "run_partition", "vjp"]

#: Where a ``parallelize`` wrapper keeps the function it wraps (workers run that one).
ORIGINAL = "__metadist_original__"


def _answered(job: Callable[[], Any]) -> Future[Any]:
    """``job()`` (which returns its own errors) as a completed future: torch sends the reply as
    it completes, and the dropped graphs are freed after the reply has left."""
    future: Future[Any] = Future()
    try:
        future.set_result(job())
    finally:
        _free()
    return future


# ----------------------------------------------------------------------------------------------
# Kept graphs: {key: (leaves, outputs)}, dropped when the caller releases the key. A key
# released before its partition finished (the caller gave up waiting) is remembered, so that
# the graph is never kept. Releases arrive with the next request; freeing a step's graph takes
# a fifth of a millisecond for a small MAML step, so a dropped graph is freed after that
# request's reply has left, not before its partition runs (a loop of forward-only calls under
# grad mode then holds one graph more at its peak).

_GRAPHS: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
_GONE: set[int] = set()
_DROPPED: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
_GRAPHS_LOCK = threading.Lock()


def kept_graphs() -> int:
    """How many graphs this worker keeps for a later gradient request."""
    with _GRAPHS_LOCK:
        return len(_GRAPHS)


def _keep(key: int, leaves: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    with _GRAPHS_LOCK:
        if key in _GONE:
            _GONE.discard(key)
        else:
            _GRAPHS[key] = (leaves, outputs)


def _drop(keys: tuple[int, ...]) -> None:
    if keys:
        with _GRAPHS_LOCK:
            for key in keys:
                graph = _GRAPHS.pop(key, None)
                if graph is None:
                    _GONE.add(key)
                else:
                    _DROPPED.append(graph)


def _free() -> None:
    """Free the memory of the dropped graphs."""
    with _GRAPHS_LOCK:
        dropped = _DROPPED.copy()
        _DROPPED.clear()
    del dropped


def check_result(result: Any) -> None:
    """Refuse results that would reach the caller as detached copies of user state."""
    if type(result) is torch.Tensor:
        return
    pairs, _ = tree_flatten_with_path(result)
    for path, leaf in pairs:
        if isinstance(leaf, (torch.nn.Module, torch.nn.Parameter)):
            kind = "a module" if isinstance(leaf, torch.nn.Module) else "an nn.Parameter"
            raise TypeError(
                f"the result holds {kind} ({type(leaf).__name__}) at result{keystr(path)}: it "
                f"would reach the caller as a detached copy, linked to no gradient. Return "
                f"tensors computed from it instead (for a module, e.g. "
                f"{{name: p * 1 for name, p in module.named_parameters()}})"
            )
        if not isinstance(leaf, torch.Tensor) and not transport.is_plain(leaf):
            transport.refuse_hidden_grad(leaf, f"the result at result{keystr(path)}")


def _grad_changes(
    leaves: list[torch.Tensor], given: list[tuple[Any, Any]]
) -> tuple[tuple[tuple[int, Any, bool, bool], ...], list[torch.Tensor]]:
    """Each leaf's ``.grad`` where the function changed it: ``given`` holds what the leaf got
    (the caller's ``.grad``, or ``None``) and a copy to compare with. A ``.grad`` with a graph
    (``backward(create_graph=True)``) is also returned apart: it travels as one more result of
    the partition, so that the caller can differentiate it as in one process."""
    changes = []
    with_graph = []
    for k, (leaf, (start, copy)) in enumerate(zip(leaves, given, strict=True)):
        now = leaf.grad
        if start is None and now is None:
            continue
        if start is not None and now is start and transport.unchanged(now, copy):
            continue
        wired = None
        linked = False
        if now is not None:
            wired = transport.wire(now.detach(), None)
            linked = now.requires_grad
            if linked:
                with_graph.append(now)
        # In place: the caller's .grad object takes it. Linked: one more output of the graph.
        changes.append((k, wired, now is start, linked))
    return tuple(changes), with_graph


def _fresh(
    flat: list[Any], differentiable: list[int], leaves: list[torch.Tensor]
) -> tuple[int, ...]:
    """The results that are leaves made by the function: they reach the caller as leaves of its
    own, so no kept result may depend on one (its share of the gradient would stay here)."""
    own = {id(t) for t in leaves}
    fresh = tuple(i for i in differentiable if flat[i].is_leaf and id(flat[i]) not in own)
    if not fresh or len(fresh) == len(differentiable):
        return fresh
    targets = {id(flat[i]) for i in fresh}
    seen: set[Any] = set()
    nodes = [flat[i].grad_fn for i in differentiable if i not in fresh]
    while nodes:  # the graph of the other results, for the fresh leaves' AccumulateGrad nodes
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in targets:
            raise RuntimeError(
                "the result holds a leaf tensor that requires grad, made by the function, and "
                "another result computed from it: the caller gets the leaf as a leaf of its own, "
                "and the gradient that reaches it through the other result would stay on the "
                "worker. Return one of them only, or make the leaf on the caller and pass it in"
            )
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return fresh


def _reply(
    result: Any, leaves: list[torch.Tensor], request: Request, given: list[Any], start: float
) -> Reply:
    """``result`` detached and wired, its graph kept under the request's key when it reaches
    ``leaves``."""
    grads, grads_with_graph = _grad_changes(leaves, given)
    flat, spec = tree_flatten(result)
    differentiable = [
        i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    fresh = _fresh(flat, differentiable, leaves)
    # One tensor in two places of the result is one output (and one object on the caller).
    firsts = {id(flat[i]): i for i in reversed(differentiable)}
    outputs = tuple(i for i in differentiable if firsts[id(flat[i])] == i and i not in fresh)
    kept = bool((outputs or grads_with_graph) and leaves) and request.graph is not None
    if kept:
        assert request.graph is not None
        _keep(request.graph, leaves, [*(flat[i] for i in outputs), *grads_with_graph])
    wired = False
    sent: dict[int, Any] = {}
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor):
            w = sent.get(id(t))
            if w is None:
                w = sent[id(t)] = transport.wire(t.detach(), request.compression)
            wired = wired or not isinstance(w, torch.Tensor)
            flat[i] = w
    return Reply(
        value=tree_unflatten(flat, spec),
        outputs=outputs,
        fresh=fresh,
        kept=kept,
        grads=grads,
        wired=wired,
        start=start,
        end=timeline.now(),
    )


def _recorded(context_id: int) -> tuple[set[int], set[int]]:
    """The messages distributed autograd recorded in ``context_id`` on this worker (torch offers
    no public way to ask: a context's send and receive functions are where it keeps them).
    Messages without tensors that require grad, such as metadist's own, record none."""
    context = dist_autograd._retrieve_context(context_id)  # type: ignore[attr-defined]
    return set(context._send_functions()), set(context._recv_functions())


@contextlib.contextmanager
def _watch_rpc() -> Iterator[None]:
    """Raise if the block makes RPC calls that distributed autograd records.

    Inside its caller's context (torch propagates it to the handler thread) or, on a thread
    without one, inside a context of its own: either way torch records what the block sends
    and receives with tensors that require grad, which metadist's own gradient path would miss.
    """
    context_id = current_context_id()
    with contextlib.ExitStack() as stack:
        if context_id is None:
            context_id = stack.enter_context(dist_autograd.context())
        before = _recorded(context_id)
        yield
        after = _recorded(context_id)
    if after[0] - before[0] or after[1] - before[1]:
        raise RuntimeError(_UNSEEN_RPC)


def current_context_id() -> int | None:
    """The id of the distributed autograd context active on this thread, opened by anyone
    (torch offers no public way to ask)."""
    # Asking for the current context raises when there is none, which costs 12-55 us; the
    # count of live contexts (on any thread) answers most calls first.
    try:
        if not int(dist_autograd._get_debug_info()["num_autograd_contexts"]):  # type: ignore[attr-defined]
            return None
        return int(dist_autograd._current_context()._context_id())  # type: ignore[attr-defined]
    except RuntimeError:
        return None


_UNSEEN_RPC = (
    "the partition made RPC calls that distributed autograd recorded (an RRef fetched with "
    "to_here(), or rpc_sync/rpc_async/remote with tensors that require grad) while its caller "
    "is in a distributed autograd context, but the call travelled detached: none of its "
    "arguments is an RRef, so metadist differentiates it itself and would lose the gradients "
    "of those RPC calls. Pass the RRef as an argument of the call (it then travels attached, and "
    "torch's distributed autograd differentiates it), or detach what the RPC calls return"
)


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def run_partition(request: Request) -> Future[Any]:
    """Run one partition on this worker (the RPC target of every remote call), on the RPC
    handler thread that received it."""
    _drop(request.release)
    return _answered(lambda: _run_partition(request))


def _run_partition(request: Request) -> Any:
    start = timeline.now() if request.timed else 0.0
    world.use_process_threads()  # an RPC handler thread: see world.use_process_threads
    me = rpc.get_worker_info().name
    args, kwargs = request.args, request.kwargs
    leaves: list[torch.Tensor] = []
    guards: list[Any] = []
    try:
        if request.decode:
            args, kwargs, leaves, guards = transport.decode(
                args, kwargs, leaves=not request.attached
            )
    except Exception as error:
        return RemoteFailure.capture(error, me, "decode")
    # What each leaf's .grad was (the caller's, sent along): the reply says where it changed.
    given = [(t.grad, None if t.grad is None else t.grad.clone()) for t in leaves]
    try:
        with contextlib.ExitStack() as stack:
            request.state.enter(stack)
            if request.in_context and not request.attached:
                stack.enter_context(_watch_rpc())
            try:
                result = getattr(request.func, ORIGINAL, request.func)(*args, **kwargs)
            finally:
                for guard in guards:  # see transport._hooks_skipped
                    guard.remove()
            check_result(result)
        if request.attached:  # torch's distributed autograd links the tensors of the reply
            return Reply(
                value=result,
                outputs=(),
                fresh=(),
                kept=False,
                grads=(),
                wired=False,
                start=start,
                end=timeline.now(),
            )
        return _reply(result, leaves, request, given, start)
    except Exception as error:
        return RemoteFailure.capture(error, me, "call")
    except (SystemExit, GeneratorExit) as error:
        # The function's, not this worker's: reported as any failure, and the worker serves on.
        wrapped = RuntimeError(f"the function raised {type(error).__name__}({error})")
        wrapped.__cause__ = error
        return RemoteFailure.capture(wrapped, me, "call")


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def vjp(request: GradientRequest) -> Future[Any]:
    """Answer one gradient request (the RPC target)."""
    return _answered(lambda: _vjp(request))


def _vjp(request: GradientRequest) -> Any:
    """Answer each item of a gradient request (a list of :class:`Answer`), or a
    ``RemoteFailure``. Without ``retain``, what the pass went through is freed, as in a local
    pass."""
    world.use_process_threads()
    me = rpc.get_worker_info().name
    try:
        with _GRAPHS_LOCK:
            graphs = [_GRAPHS[item.graph] for item in request.items]
    except KeyError as error:
        return RemoteFailure.capture(
            RuntimeError(f"graph {error} is gone from this worker: it was released"), me, "call"
        )
    try:
        with torch.enable_grad():
            return [
                _vjp_one(graph, item, request)
                for graph, item in zip(graphs, request.items, strict=True)
            ]
    except Exception as error:
        return RemoteFailure.capture(error, me, "backward")


def _vjp_one(
    graph: tuple[list[torch.Tensor], list[torch.Tensor]],
    item: GradientItem,
    request: GradientRequest,
) -> Answer:
    """The gradients of a kept graph's leaves for its results' gradients. With
    ``create_graph`` the received gradients become leaves of the answer's graph, after the
    partition's, so that the caller can differentiate the answer with respect to them too."""
    leaves, outputs = graph
    grads = [None if g is None else transport.unwire(g) for g in item.grads]
    if request.create_graph:
        # Only a gradient with a graph on the caller: the default ones of torch.autograd.grad
        # stay constants, and a gradient computed from them alone requires no grad, as locally.
        grads = [
            None if g is None else g.detach().requires_grad_(with_graph)
            for g, with_graph in zip(grads, item.with_graph, strict=True)
        ]
    reached = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
    roots, root_grads = _roots(reached)
    # A leaf the function froze (requires_grad_(False)) gets no gradient, as torch's
    # AccumulateGrad gives it none; asking torch for one would raise.
    wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
    found: list[torch.Tensor | None] = [None] * len(leaves)
    if wanted:
        computed = torch.autograd.grad(
            roots,
            [leaves[i] for i in wanted],
            root_grads,
            retain_graph=request.retain,
            create_graph=request.create_graph,
            allow_unused=True,
        )
        for i, g in zip(wanted, computed, strict=True):
            found[i] = g
    kept: tuple[int, ...] = ()
    if request.create_graph:
        kept = tuple(i for i, g in enumerate(found) if g is not None and g.requires_grad)
        if kept:
            assert item.answer_graph is not None
            grad_leaves = [g for _, g in reached]
            _keep(item.answer_graph, [*leaves, *grad_leaves], [found[i] for i in kept])  # type: ignore[misc]
    answer = [None if g is None else transport.wire(g.detach(), request.compression) for g in found]
    return Answer(grads=answer, kept=kept)


def _roots(reached: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, Any]:
    """``torch.autograd.grad``'s outputs and grad_outputs for results ``o`` with gradients
    ``g``: for real dense results, the scalars ``(o * g).sum()`` with no grad_outputs, whose
    backward hands ``o`` exactly ``1 * g == g`` (bit for bit), and which spare a step
    torch's first pass with grad_outputs (it imports sympy: 0.6 s of CPU on a worker's first
    backward); else the results with their gradients."""
    plain = (
        o.layout == torch.strided and not o.is_nested and o.dtype == g.dtype for o, g in reached
    )
    if all(plain) and all(o.is_floating_point() for o, _ in reached):
        return [(o * g).sum() for o, g in reached], None
    return [o for o, _ in reached], [g for _, g in reached]
