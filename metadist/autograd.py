"""Gradients through remote calls: the caller's half of a call's backward, and contexts.

A remote call is a differentiable function. Each remote partition's graph stays on its worker
(:mod:`metadist.worker`); on the caller, the call is two nodes (:class:`Link`) whose backward
sends the results' gradients in one request per worker and returns the arguments' gradients.
So plain ``loss.backward()``, ``torch.autograd.grad`` (also with ``create_graph``) and
``torch.optim`` work as in one process, and so does torch's distributed autograd engine, which
runs these nodes like any other: inside a distributed autograd context (:func:`context`, or
``torch.distributed.autograd.context()``), the gradients land in the context's map, as
:func:`get_gradients` and owners' optimizers expect. Only a call with an RRef among its
arguments travels attached to the context and is differentiated by torch's engine (torchopt's
``rref.to_here()`` pattern needs it).

torch never writes ``.grad`` inside a context: it accumulates every gradient of a context into
the context's map, which owners' optimizers apply. :func:`backward` gives the semantics of
``torch.autograd`` on top (this pass's contribution only): a later pass in one context gets its
contribution as ``map_after - map_before``, exact up to the last bits. :func:`grad` is
``torch.autograd.grad`` itself while nothing in the context came through torch's RPC with a
graph (metadist's own calls never do): it then writes nothing, the map included, as in one
process; otherwise it runs torch's engine too, and its gradients join the map.

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
import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

# Re-exported by torch.distributed.autograd from its C extension; typed as untyped there.
from torch.distributed.autograd import backward as _dist_backward  # type: ignore[attr-defined]
from torch.distributed.autograd import get_gradients as _dist_get_gradients  # type: ignore[attr-defined]

from metadist import ahead, timeline, transport
from metadist import worker as remote_worker
from metadist._pytree import tree_flatten, tree_unflatten
from metadist.errors import RemoteError, RemoteFailure, is_connection_lost, worker_gone
from metadist.world import rank_of, require_rpc

__all__ = ["backward", "context", "get_gradients", "grad", "is_available"]

# ------------------------------------------------------------------------------------------------
# A remote call as a differentiable function
#
# On the caller, a call is three kinds of node. ``_Arguments`` is made before the caller's own
# partitions run, so the engine, which runs the newest ready node first, reaches it after their
# backward: it waits for the answers and returns the arguments' gradients. ``_Results`` is made
# when the results arrive, so it runs as soon as their gradients are known: it sends them, one
# request per worker, and hands ``_Arguments`` the number of its pass, so that concurrent passes
# through one call each collect their own answers. ``_Probe``, one per result, on the results'
# side of ``_Results``, tells it whether the pass keeps the graph: a custom node cannot see
# ``retain_graph``, but torch frees a node's saved tensors right after it runs in a pass without
# it, so the probe's saved marker is gone by the time ``_Results`` runs. A partition that ran
# on the caller and answered its backward ahead (metadist.ahead) is one more node, ``_Ready``.

# Keys of graphs the caller no longer needs, per (world, worker): sent along with the next
# message to that worker rather than in messages of their own.
_RELEASED: dict[tuple[object, str], list[int]] = {}
_RELEASED_LOCK = threading.Lock()
_KEYS = itertools.count(1)
_PASSES = itertools.count(1)


def released(world_token: object, worker: str) -> tuple[int, ...]:
    """Take the keys of ``worker``'s graphs that the caller no longer needs."""
    with _RELEASED_LOCK:
        keys = _RELEASED.pop((world_token, worker), None)
    return tuple(keys) if keys else ()


def release(world_token: object, graphs: Sequence[tuple[str, int]]) -> None:
    """Note that the graphs ``(worker, key)`` are no longer needed."""
    with _RELEASED_LOCK:
        for worker, key in graphs:
            _RELEASED.setdefault((world_token, worker), []).append(key)


class Graph(NamedTuple):
    """One remote partition's kept graph, as the caller sees it."""

    worker: str
    key: int
    inputs: list[int]  # positions in the call's argument list
    outputs: int  # how many of the results' tensors require grad
    record: Any  # the partition's timeline record, or None
    part: int = -1  # the partition's index in its call (for metadist.ahead)


class RemoteGradients:
    """The state one call's nodes share: its kept graphs, and each pass's requests in flight."""

    # No tensor with a graph here (answers sent ahead have none): the nodes hold this object,
    # and a tensor whose graph holds them would make a reference cycle through torch's C++
    # nodes that Python's collector cannot see.
    def __init__(
        self, world_token: object, compression: Any, key_base: int, site: Any = None
    ) -> None:
        self.world_token = world_token
        self.compression = compression
        self.key_base = key_base
        self.site = site  # the call site (metadist.ahead), or None
        self.graphs: list[Graph] = []  # also what the release marker releases
        self.sent: dict[int, tuple[dict[str, tuple[list[_Item], Any]], list[_Answer]]] = {}
        self.probes: list[Any] = []  # per output: see _Probe
        self.retain = False  # keep the workers' graphs whatever the pass (see _second_order)
        self.passes = 0
        # Per graph key: the gradients expected and the answer the worker sent ahead for them;
        # keys whose answer a pass used and freed.
        self.ready: dict[int, tuple[ahead.Expectation, list[torch.Tensor | None]]] = {}
        self.spent: set[int] = set()

    def new_key(self) -> int:
        """A key no other graph on any worker has: this caller's rank, then a counter."""
        return self.key_base | next(_KEYS)

    def send(self, grads: tuple[torch.Tensor | None, ...], create_graph: bool, retain: bool) -> int:
        """Send the results' gradients, one request per worker; return the pass's number."""
        per_worker: dict[str, list[_Item]] = {}
        answered: list[_Answer] = []
        offset = 0
        for graph in self.graphs:
            mine = list(grads[offset : offset + graph.outputs])
            offset += graph.outputs
            if self.site is not None and not create_graph:
                ahead.note(self.site, graph.part, mine)
            if not any(g is not None for g in mine):
                continue
            if graph.key in self.spent:
                raise RuntimeError(SECOND_PASS)
            ready = self.ready.pop(graph.key, None) if not retain else self.ready.get(graph.key)
            if ready is not None and not create_graph and ahead.same(ready[0], mine):
                # Every result got its gradient (see ahead.backward): freed, as a local pass
                # frees what it went through.
                if not retain:
                    self.spent.add(graph.key)
                    release(self.world_token, [(graph.worker, graph.key)])
                answered.append((graph, mine, -1, ready[1], ()))
            else:
                answer_key = self.new_key() if create_graph else -1
                per_worker.setdefault(graph.worker, []).append((graph, mine, answer_key))
        log = timeline.active()
        sent = {}
        for worker, items in per_worker.items():
            if log is not None:
                log.add_request(worker)
                for graph, _, _ in items:
                    if graph.record is not None:
                        graph.record.gradients_sent = timeline.now()
            wired = [
                (p.key, [None if g is None else transport.wire(g, self.compression) for g in gs], k)
                for p, gs, k in items
            ]
            args = (wired, create_graph or retain, create_graph, self.compression)
            sent[worker] = (items, rpc.rpc_async(worker, remote_worker.vjp, args=args))
        number = next(_PASSES)
        self.passes += 1
        self.sent[number] = (sent, answered)
        return number

    def collect(
        self, number: int, inputs: tuple[torch.Tensor, ...], create_graph: bool
    ) -> list[Any]:
        """Wait for pass ``number``'s answers; return each argument's gradient (or ``None``)."""
        totals: list[torch.Tensor | None] = [None] * len(inputs)
        sent, answers = self.sent.pop(number)
        for worker, (items, future) in sent.items():
            for (graph, grads, answer_key), (found, diff) in zip(
                items, _answers(worker, future), strict=True
            ):
                answers.append((graph, grads, answer_key, found, diff))
        for graph, grads, answer_key, found, diff in answers:
            if diff:
                found = _second_order(graph, inputs, grads, found, answer_key, diff, self)  # noqa: PLW2901
            for position, g in zip(graph.inputs, found, strict=True):
                if g is not None:
                    total = totals[position]
                    totals[position] = g if total is None else total + g
        return totals


# A gradient request's item (graph, its results' gradients, the key for the answer's graph), and
# an answered one (the same, then the answer's gradients and their indices that are kept).
_Item = tuple[Graph, list[Any], int]
_Answer = tuple[Graph, list[Any], int, list[Any], tuple[int, ...]]

SECOND_PASS = (
    "Trying to backward through the graph a second time: a remote call's partition answered its "
    "backward ahead (see metadist.ahead), and an earlier pass without retain_graph=True freed "
    "it. Specify retain_graph=True in the first pass to backward through it again"
)


def _answers(worker: str, future: Any) -> list[Any]:
    """The answers of a gradient request, or the worker's error raised here."""
    try:
        value = future.wait()
    except Exception as error:
        what = f"to worker {worker!r} failed in RPC"
        if is_connection_lost(error):
            what = f"failed: {worker_gone(worker, rank_of(worker))}. torch's RPC error"
        raise RemoteError(
            f"the gradient request {what}: {type(error).__name__}: {error}", worker_name=worker
        ) from error
    if isinstance(value, RemoteFailure):
        raise value.to_exception(-1, 0, "backward of a remote call")
    return [([transport.unwire(g) for g in found], diff) for found, diff in value]


def _second_order(  # noqa: PLR0917
    graph: Graph,
    inputs: tuple[torch.Tensor, ...],
    grads: list[torch.Tensor | None],
    found: list[torch.Tensor | None],
    key: int,
    diff: tuple[int, ...],
    state: RemoteGradients,
) -> list[torch.Tensor | None]:
    """The answer as the result of a call of its own, differentiable again (create_graph).

    The worker kept the answer's graph under ``key``; its leaves are the partition's arguments
    followed by the received gradients, so the answer links to both, through the same nodes as
    any call.
    """
    sources = [inputs[p] for p in graph.inputs] + [g for g in grads if g is not None]
    kept = RemoteGradients(state.world_token, state.compression, state.key_base)
    # The answer's graph on the worker runs through the partition's, which a request for the
    # first-order results may still need in this pass: keep it for every pass (dropped with
    # the caller's graph).
    kept.retain = True
    kept.graphs.append(Graph(graph.worker, key, list(range(len(sources))), len(diff), None))
    token = _Arguments.apply(kept, *sources)
    result = list(found)
    outputs = [t for i in diff if (t := found[i]) is not None]  # none is None: see _vjp_one
    for i, t in zip(diff, _linked(kept, token, outputs), strict=True):
        result[i] = t
    return result


def _refuse_batched(grads: Sequence[torch.Tensor | None]) -> None:
    if any(g is not None and transport.storageless(g) for g in grads):
        raise RuntimeError(
            "a remote call's result is differentiated inside a torch.func transform (vmap over "
            "the backward pass: torch.autograd.functional.jacobian(..., vectorize=True), "
            "torch.autograd.grad(..., is_grads_batched=True), torch.func.jacrev, ...): its "
            "gradients cannot travel to the workers. Use vectorize=False / is_grads_batched=False "
            "(one backward pass per row)"
        )


def _release_graphs(state: RemoteGradients) -> None:
    release(
        state.world_token, [(g.worker, g.key) for g in state.graphs if g.key not in state.spent]
    )
    if not state.passes and state.site is not None:
        ahead.forget(state.site)  # not differentiated: answers ahead would be wasted work


class _Arguments(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, state: RemoteGradients, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.state = state
        ctx.inputs = inputs  # for create_graph; inputs make no reference cycle
        # Freed with the caller's graph, and then releases the workers' graphs (``state.graphs``
        # may still grow).
        ctx.marker = torch.empty(0)
        weakref.finalize(ctx.marker, _release_graphs, state)
        return torch.zeros((), dtype=torch.float64)

    @staticmethod
    def backward(ctx: Any, number: torch.Tensor) -> Any:
        state: RemoteGradients = ctx.state
        return (None, *state.collect(int(number), ctx.inputs, torch.is_grad_enabled()))


class _Results(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, state: RemoteGradients, outputs: list[torch.Tensor], token: torch.Tensor
    ) -> Any:
        ctx.state = state
        ctx.set_materialize_grads(False)
        # New tensors (sharing the data), not the reply's own: those stay in RPC's future until
        # its threads let go of it, and the graph, with the workers' graphs it releases, would
        # live as long.
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        _refuse_batched(grads)
        state: RemoteGradients = ctx.state
        retain = state.retain or any(
            _retained(probe) for probe, g in zip(state.probes, grads, strict=True) if g is not None
        )
        number = state.send(grads, torch.is_grad_enabled(), retain)
        return None, None, torch.tensor(float(number), dtype=torch.float64)


class _Probe(torch.autograd.Function):
    """Pass one result through; its saved marker outlives only a pass that keeps the graph.

    One per result, so that passes through different results of one call are independent, as
    they are locally when the results share no saved tensors.
    """

    @staticmethod
    def forward(ctx: Any, state: Any, output: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(torch.empty(0))
        state.probes.append(weakref.ref(ctx))
        return output.detach()  # not the input itself: in-place ops on it work as on any result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return None, grad


def _retained(probe: Any) -> bool:
    """Whether the probe's node still holds its saved marker (the pass keeps the graph).

    ``_raw_saved_tensors`` reads the slot without unpacking it, so saved-tensor hooks (e.g.
    non-reentrant checkpointing, which would recompute it) play no part; torch has no public
    way to ask.
    """
    node = probe()
    if node is None:
        return True
    try:
        node._raw_saved_tensors  # noqa: B018 - raises once the pass freed it
    except RuntimeError:
        return False
    return True


def _linked(
    state: RemoteGradients, token: torch.Tensor, outputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    return [_Probe.apply(state, t) for t in _Results.apply(state, outputs, token)]


class _Ahead:
    """A partition run here whose backward ran ahead (see :func:`run_ahead`)."""

    def __init__(
        self,
        output: torch.Tensor,
        sources: list[torch.Tensor],
        expect: ahead.Expectation,
        found: tuple[torch.Tensor | None, ...],
    ) -> None:
        self.output: torch.Tensor | None = output  # its graph, kept for another gradient
        self.sources = sources
        self.expect = expect
        self.found: tuple[torch.Tensor | None, ...] | None = found
        # Changed in place since (an optimizer step before the pass): the pass computes the
        # gradients from the kept graph, where torch raises if its saved tensors changed.
        self.versions = [s._version for s in sources]
        self.probes: list[Any] = []  # see _Probe


class _Ready(torch.autograd.Function):
    """The result of a partition run here, its backward answered ahead for the expected
    gradient; any other gradient goes through the partition's own graph."""

    @staticmethod
    def forward(ctx: Any, box: _Ahead, *sources: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        assert box.output is not None
        return box.output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        box: _Ahead = ctx.box
        output = box.output
        if output is None:
            raise RuntimeError(SECOND_PASS)
        retain = _retained(box.probes[0])
        create_graph = torch.is_grad_enabled()
        if (
            box.found is not None
            and not create_graph
            and ahead.same(box.expect, (grad,))
            and [s._version for s in box.sources] == box.versions
        ):
            found = box.found
        else:
            # Hooks put on the sources since the call run once, in this pass, as locally.
            with ahead.hooks_off(box.sources):
                found = torch.autograd.grad(
                    output,
                    box.sources,
                    grad,
                    retain_graph=retain,
                    create_graph=create_graph,
                    allow_unused=True,
                )
        if not retain:  # what the pass went through is freed, as in a local pass
            box.output = box.found = None
        return (None, *found)


def _shares_storage(result: torch.Tensor, sources: list[torch.Tensor]) -> bool:
    try:
        data = result.untyped_storage().data_ptr()
        return any(s.untyped_storage().data_ptr() == data for s in sources)
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, ...): not ahead
        return True


def _noted(site: Any, index: int, grad: torch.Tensor) -> None:
    if not torch.is_grad_enabled():  # first-order passes only
        ahead.note(site, index, (grad,))


def run_ahead(
    site: Any, index: int, result: Any, sources: list[torch.Tensor] | None, took: float
) -> Any:
    """Partition ``index`` of a call from ``site``, run here, returned ``result`` after
    ``took`` seconds: its backward run now if its gradient is expected and the forward was
    short (:mod:`metadist.ahead`), else noted when it comes.

    ``sources``: the partition's arguments that require grad (``None`` inside a torch.func
    transform, where nothing is done).
    """
    if (
        sources is None
        or not sources
        or not isinstance(result, torch.Tensor)
        or result.grad_fn is None  # not computed here: an argument, or a leaf it made
        or result.numel() != 1
        or _shares_storage(result, sources)  # a view of an argument stays one, as locally
    ):
        return result
    expect = ahead.expected(site, index) if ahead.worth(took) else None
    found = None
    if expect is not None and ahead.answerable(result, sources):
        found = ahead.backward([result], sources, expect)
    if expect is None or found is None:
        result.register_hook(functools.partial(_noted, site, index))
        return result
    box = _Ahead(result, sources, expect, found)
    with torch.enable_grad():
        ready = _Ready.apply(box, *sources)
        ready = _Probe.apply(box, ready)  # tells _Ready whether the pass keeps the graph
    ready.register_hook(functools.partial(_noted, site, index))
    return ready


def result_of(reply: remote_worker.Reply) -> Any:
    """The result of a reply whose graph was not kept: its tensors that required grad are
    fresh leaves, as a leaf made inside a local call would be."""
    value = transport.unwire_tree(reply.value) if reply.wired else reply.value
    if reply.outputs:
        flat, _ = tree_flatten(value)
        for i in reply.outputs:
            flat[i].requires_grad_(True)
    return value


class _Held(NamedTuple):
    """A result whose tensors wait to be linked (see :meth:`Link.finish`)."""

    flat: list[Any]
    spec: Any
    outputs: tuple[int, ...]


class Link:
    """One call's gradient on the caller: its arguments that require grad, and the graphs of
    its remote partitions' results (what :mod:`metadist.api` hands each remote reply to)."""

    def __init__(
        self, world_token: object, compression: Any, key_base: int, site: Any = None
    ) -> None:
        self.state = RemoteGradients(world_token, compression, key_base, site)
        self.expects: dict[int, ahead.Expectation] = {}  # what each partition was told
        self.sources: list[torch.Tensor] = []
        self._where: dict[int, int] = {}
        self.positions: dict[int, list[int]] = {}
        self.keys: dict[int, int] = {}
        self.token: torch.Tensor | None = None
        self._pending: list[_Held] = []
        self._written: list[tuple[torch.Tensor, torch.Tensor]] = []  # on non-leaf arguments

    def add(self, index: int, sources: list[torch.Tensor]) -> int:
        """Note partition ``index``'s arguments that require grad; the key for its graph."""
        positions = []
        for t in sources:
            if id(t) not in self._where:
                self._where[id(t)] = len(self.sources)
                self.sources.append(t)
            positions.append(self._where[id(t)])
        self.positions[index] = positions
        key = self.keys[index] = self.state.new_key() if sources else 0
        return key

    def expect(self, index: int) -> ahead.Expectation | None:
        """The gradients partition ``index``'s results can expect (see :mod:`metadist.ahead`),
        for its request."""
        site = self.state.site
        if site is None or not self.keys.get(index):
            return None
        expect = ahead.expected(site, index)
        if expect is not None:
            self.expects[index] = expect
        return expect

    def start(self) -> None:
        """Make the arguments' node (before the caller runs partitions of its own)."""
        if self.sources and self.token is None:
            with torch.enable_grad():
                self.token = _Arguments.apply(self.state, *self.sources)

    def receive(self, index: int, worker: str, reply: remote_worker.Reply, record: Any) -> Any:
        """A remote partition's reply: its ``.grad`` writes applied, its result returned, or
        held until :meth:`finish` links it."""
        positions = self.positions.get(index, [])
        for k, wired in reply.written:
            source = self.sources[positions[k]]
            g = transport.unwire(wired).to(source.dtype)
            if source.is_leaf:
                with torch.no_grad():
                    source.grad = g if source.grad is None else source.grad + g
            else:  # see finish
                self._written.append((source, g))
        if not reply.kept:
            return result_of(reply)
        flat, spec = tree_flatten(
            transport.unwire_tree(reply.value) if reply.wired else reply.value
        )
        key = self.keys[index]
        self.state.graphs.append(Graph(worker, key, positions, len(reply.outputs), record, index))
        if reply.ahead is not None and index in self.expects:
            answer = [None if g is None else transport.unwire(g) for g in reply.ahead]
            self.state.ready[key] = (self.expects[index], answer)
        held = _Held(flat, spec, reply.outputs)
        self._pending.append(held)
        return held

    def finish(self, values: list[Any]) -> list[Any]:
        """``values`` with every held result's tensors made outputs of the call's nodes."""
        if self._written:
            # A backward inside a partition went on, in one process, through a non-leaf
            # argument's history to the leaves behind it (a chunk of a batch, adapted weights):
            # one pass for all of a call's partitions, whose chunks share that history.
            sources, grads = zip(*self._written, strict=True)
            self._written = []
            try:
                torch.autograd.backward(list(sources), list(grads))
            except RuntimeError as error:
                error.add_note(
                    "[metadist] a backward inside a remote partition went on through a non-leaf "
                    "argument's history, which an earlier backward freed (the caller's own "
                    "partition's, say, as the function run chunk by chunk in one process would "
                    "find it): run the earlier one with retain_graph=True"
                )
                raise
        if not self._pending:
            return values
        self.start()
        assert self.token is not None
        outputs = [flat[i] for flat, _, indices in self._pending for i in indices]
        with torch.enable_grad():
            linked = iter(_linked(self.state, self.token, outputs))
        for flat, _, indices in self._pending:
            for i in indices:
                flat[i] = next(linked)
        self._pending = []
        return [tree_unflatten(v.flat, v.spec) if isinstance(v, _Held) else v for v in values]

    def abandon(self, lost: Sequence[tuple[str, int]]) -> None:
        """The call failed: release its kept graphs and those of partitions ``(worker,
        index)`` whose fate is unknown (timed out, failed in RPC)."""
        graphs = list(self.state.graphs)
        self.state.graphs.clear()  # the list the release marker holds: released here, once
        self._pending = []
        release(
            self.state.world_token,
            [(p.worker, p.key) for p in graphs]
            + [(w, self.keys[i]) for w, i in lost if self.keys.get(i)],
        )


# ------------------------------------------------------------------------------------------------
# Distributed autograd contexts


@contextlib.contextmanager
def context() -> Iterator[int]:
    """Open a distributed autograd context; yields its id.

    Pass the id to :func:`backward`, :func:`grad` or :func:`get_gradients`, or to an owner's
    optimizer (:class:`metadist.optim.DistributedOptimizer`).

    Yields:
        The context id.

    Raises:
        RuntimeError: RPC is not running (see :func:`metadist.auto_init_rpc`).
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
    """Run one backward pass; its own gradient of each leaf reached (among ``targets``): the
    context's map accumulates over passes, so this pass's share is ``after - before``."""
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
    ``to_here()``, ``rpc_sync`` of tensors that require grad): only torch's engine goes on
    from there. Private, like the context itself: torch has no public way to ask."""
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
        RuntimeError: RPC is not running; a root does not require grad.
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
    """Return the gradients of ``outputs`` with respect to ``inputs`` (new tensors).

    ``torch.autograd.grad``: neither ``.grad`` nor the context's map (what owners' optimizers
    apply) is touched. Once torch's RPC brought a tensor with a graph into the context (an
    RRef's ``to_here()``), the pass runs in torch's engine instead: its gradients join the map,
    and it returns this pass's share (``after - before``, exact up to the last bits).

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

    The map holds the sum over every backward pass run in the context so far.

    Args:
        context_id: The id from :func:`context`.

    Returns:
        A new dict of cloned gradients.

    Raises:
        RuntimeError: RPC is not running.
        ValueError: ``context_id`` is not a live context of this process.
    """
    check_context(context_id, "metadist.autograd.get_gradients")
    return {t: g.clone() for t, g in _dist_get_gradients(context_id).items()}


def gradients_here(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The context's map on this worker, what an owner's optimizer reads (not copied; empty
    if this worker took no part)."""
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
