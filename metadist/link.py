"""A remote call as a differentiable function: the caller's half of its backward.

Each remote partition's graph stays on its worker (:mod:`metadist.worker`); on the caller, the
call is two autograd nodes whose backward sends the results' gradients in one request per worker
and returns the arguments' gradients. So plain ``loss.backward()``, ``torch.autograd.grad``
(also with ``create_graph``) and ``torch.optim`` work as in one process, and so does torch's
distributed autograd engine, which runs these nodes like any other (see :mod:`metadist.autograd`).

``_Arguments`` is made before the caller's own partitions run, so the engine, which runs the
newest ready node first, reaches it after their backward: it waits for the answers and returns
the arguments' gradients. ``_Results`` is made when the results arrive, so it runs as soon as
their gradients are known: it sends them, one request per worker, and hands ``_Arguments`` the
number of its pass, so that concurrent passes through one call each collect their own answers.
``_Probe``, one per result, on the results' side of ``_Results``, tells it whether the pass keeps
the graph: a custom node cannot see ``retain_graph``, but torch frees a node's saved tensors
right after it runs in a pass without it, so the probe's saved marker is gone by then.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc

from metadist import timeline, transport, world
from metadist import worker as remote_worker
from metadist._pytree import tree_flatten, tree_unflatten
from metadist.errors import RemoteError, RemoteFailure, is_connection_lost, is_timeout, worker_gone
from metadist.messages import Answer, GradientItem, GradientRequest, Reply

__all__ = ["Link", "release", "released", "result_of"]

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


class _Sent(NamedTuple):
    """One graph's part of a pass: its results' gradients, the key for the answer's graph."""

    graph: Graph
    grads: list[Any]
    answer_graph: int | None


class RemoteGradients:
    """The state one call's nodes share: its kept graphs, and each pass's requests in flight."""

    # No tensor with a graph here: the nodes hold this object, and a tensor whose graph holds
    # them would make a reference cycle through torch's C++ nodes that Python's collector
    # cannot see.
    def __init__(
        self, world_token: object, compression: Any, key_base: int, timeout: float
    ) -> None:
        self.world_token = world_token
        self.compression = compression
        self.key_base = key_base
        self.timeout = timeout  # the call's, in seconds (0: no limit)
        self.graphs: list[Graph] = []  # also what the release marker releases
        self.sent: dict[int, list[tuple[str, list[_Sent], Any]]] = {}
        self.probes: list[Any] = []  # per output: see _Probe
        self.retain = False  # keep the workers' graphs whatever the pass (see _second_order)

    def new_key(self) -> int:
        """A key no other graph on any worker has: this caller's rank, then a counter."""
        return self.key_base | next(_KEYS)

    def send(self, grads: tuple[torch.Tensor | None, ...], create_graph: bool, retain: bool) -> int:
        """Send the results' gradients, one request per worker; return the pass's number."""
        per_worker: dict[str, list[_Sent]] = {}
        offset = 0
        for graph in self.graphs:
            mine = list(grads[offset : offset + graph.outputs])
            offset += graph.outputs
            if any(g is not None for g in mine):
                answer_graph = self.new_key() if create_graph else None
                per_worker.setdefault(graph.worker, []).append(_Sent(graph, mine, answer_graph))
        log = timeline.active()
        requests = []
        for worker, items in per_worker.items():
            if log is not None:
                log.add_request(worker)
                for item in items:
                    if item.graph.record is not None:
                        item.graph.record.gradients_sent = timeline.now()
            request = GradientRequest(
                items=[
                    GradientItem(
                        graph=item.graph.key,
                        grads=[self._wire(g) for g in item.grads],
                        answer_graph=item.answer_graph,
                        with_graph=tuple(g is not None and g.requires_grad for g in item.grads)
                        if create_graph
                        else (),
                    )
                    for item in items
                ],
                retain=create_graph or retain,
                create_graph=create_graph,
                compression=self.compression,
            )
            future = rpc.rpc_async(worker, remote_worker.vjp, args=(request,), timeout=self.timeout)
            requests.append((worker, items, future))
        number = next(_PASSES)
        self.sent[number] = requests
        return number

    def _wire(self, grad: torch.Tensor | None) -> Any:
        return None if grad is None else transport.wire(grad, self.compression)

    def collect(self, number: int, inputs: tuple[torch.Tensor, ...]) -> list[Any]:
        """Wait for pass ``number``'s answers; return each argument's gradient (or ``None``)."""
        totals: list[torch.Tensor | None] = [None] * len(inputs)
        requests = self.sent.pop(number)
        # Interruptible by Ctrl-C on the main thread, where a local backward runs.
        world.wait_all([future for _, _, future in requests])
        for worker, items, future in requests:
            for item, answer in zip(items, self._answers(worker, future), strict=True):
                found = [transport.unwire(g) for g in answer.grads]
                if answer.kept:
                    found = _second_order(item, inputs, found, answer.kept, self)
                for position, g in zip(item.graph.inputs, found, strict=True):
                    if g is not None:
                        total = totals[position]
                        totals[position] = g if total is None else total + g
        return totals

    def _answers(self, worker: str, future: Any) -> list[Answer]:
        """The answers of a gradient request, or the worker's error raised here."""
        try:
            value = future.wait()
        except Exception as error:
            if is_timeout(error):
                raise TimeoutError(
                    f"the gradient request to worker {worker!r} did not finish within the "
                    f"call's timeout of {self.timeout} s: {error}"
                ) from error
            what = f"to worker {worker!r} failed in RPC"
            if is_connection_lost(error):
                what = f"failed: {worker_gone(worker, world.rank_of(worker))}. torch's RPC error"
            raise RemoteError(
                f"the gradient request {what}: {type(error).__name__}: {error}",
                worker_name=worker,
            ) from error
        if isinstance(value, RemoteFailure):
            raise value.to_exception(-1, 0, "the backward of a remote call")
        return value


def _second_order(
    item: _Sent,
    inputs: tuple[torch.Tensor, ...],
    found: list[torch.Tensor | None],
    kept: tuple[int, ...],
    state: RemoteGradients,
) -> list[torch.Tensor | None]:
    """The answer as the result of a call of its own, differentiable again (create_graph).

    The worker kept the answer's graph under ``item.answer_graph``; its leaves are the
    partition's arguments followed by the received gradients, so the answer links to both,
    through the same nodes as any call.
    """
    assert item.answer_graph is not None
    sources = [inputs[p] for p in item.graph.inputs] + [g for g in item.grads if g is not None]
    answers = RemoteGradients(state.world_token, state.compression, state.key_base, state.timeout)
    # The answer's graph on the worker runs through the partition's, which a request for the
    # first-order results may still need in this pass: keep it for every pass (dropped with
    # the caller's graph).
    answers.retain = True
    graph = Graph(item.graph.worker, item.answer_graph, list(range(len(sources))), len(kept), None)
    answers.graphs.append(graph)
    token = _Arguments.apply(answers, *sources)
    outputs = [t for i in kept if (t := found[i]) is not None]  # none is None: see _vjp_one
    for i, t in zip(kept, _linked(answers, token, outputs), strict=True):
        found[i] = t
    return found


def _release_graphs(state: RemoteGradients) -> None:
    release(state.world_token, [(g.worker, g.key) for g in state.graphs])


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
        return (None, *state.collect(int(number), ctx.inputs))


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
        if any(g is not None and transport.storageless(g) for g in grads):
            raise RuntimeError(
                "a remote call's result is differentiated inside a torch.func transform (vmap "
                "over the backward pass: torch.autograd.functional.jacobian(..., vectorize=True), "
                "torch.autograd.grad(..., is_grads_batched=True), torch.func.jacrev, ...): its "
                "gradients cannot travel to the workers. Use vectorize=False / "
                "is_grads_batched=False (one backward pass per row)"
            )
        state: RemoteGradients = ctx.state
        retain = state.retain or any(
            _retained(probe) for probe, g in zip(state.probes, grads, strict=True) if g is not None
        )
        number = state.send(grads, torch.is_grad_enabled(), retain)
        return None, None, torch.tensor(float(number), dtype=torch.float64)


class _Probe(torch.autograd.Function):
    """Pass one result through; its saved marker outlives only a pass that keeps the graph.

    One per result, so that passes through different results of one call are independent, as
    they are locally when the results share no saved tensors. Results that share memory on the
    worker (a tensor and a view of it) arrive sharing it, but as separate outputs: each probe
    also saves the others, so that a backward through one after an in-place change of another
    is refused (in one process the change would reach it through the view).
    """

    @staticmethod
    def forward(ctx: Any, state: Any, output: torch.Tensor, *aliases: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(torch.empty(0), *aliases)
        state.probes.append(weakref.ref(ctx))
        return output.detach()  # not the input itself: in-place ops on it work as on any result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if len(ctx.needs_input_grad) > 2:  # aliased: torch checks the saved versions on unpacking
            try:
                ctx.saved_tensors  # noqa: B018
            except RuntimeError as error:
                raise RuntimeError(_ALIASED) from error
        return None, grad, *[None] * (len(ctx.needs_input_grad) - 2)


_ALIASED = (
    "a result of a remote call shares memory with another result of the same partition (a "
    "tensor and a view of it, say), and that other result was changed in place after the call: "
    "in one process the change would reach this one's gradient through the view, but the worker "
    "returned them as separate tensors. Change a copy (result.clone()) instead, or return only "
    "one of them"
)


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
    results = _Results.apply(state, outputs, token)
    aliases = _aliases(outputs)
    return [
        _Probe.apply(state, t, *(results[j] for j in aliases.get(i, ())))
        for i, t in enumerate(results)
    ]


def _aliases(outputs: list[torch.Tensor]) -> dict[int, list[int]]:
    """For each output sharing memory with others, their positions (outputs of one message
    share memory only where they did on the worker)."""
    by_storage: dict[int, list[int]] = {}
    for i, t in enumerate(outputs):
        if t.layout == torch.strided and not t.is_meta and t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    return {
        i: [j for j in group if j != i]
        for group in by_storage.values()
        if len(group) > 1
        for i in group
    }


def result_of(reply: Reply) -> Any:
    """The result of a reply whose graph was not kept: its tensors that required grad are
    fresh leaves, as a leaf made inside a local call would be."""
    value = transport.unwire_tree(reply.value) if reply.wired else reply.value
    if reply.outputs or reply.fresh:
        flat, _ = tree_flatten(value)
        for i in (*reply.outputs, *reply.fresh):
            flat[i].requires_grad_(True)
    return value


class _Held(NamedTuple):
    """A result whose tensors wait to be linked (see :meth:`Link.finish`), and the ``.grad``
    with a graph its partition left (linked after them)."""

    flat: list[Any]
    spec: Any
    to_link: list[torch.Tensor]  # in the order of its kept graph's outputs


class _GradState(NamedTuple):
    """A leaf argument's ``.grad`` when the call encoded it: the workers got it, to start from."""

    grad: torch.Tensor
    copy: torch.Tensor  # to tell whether the caller's own partitions changed it


class Link:
    """One call's gradient on the caller: its arguments that require grad, the graphs of its
    remote partitions' results, and the ``.grad`` they wrote (what :mod:`metadist.api` hands
    each remote reply to)."""

    def __init__(
        self, world_token: object, compression: Any, key_base: int, timeout: float
    ) -> None:
        self.state = RemoteGradients(world_token, compression, key_base, timeout)
        self.sources: list[torch.Tensor] = []
        self._where: dict[int, int] = {}
        self._grads: dict[int, _GradState] = {}  # by position in sources
        self.positions: dict[int, list[int]] = {}
        self.keys: dict[int, int] = {}
        self.token: torch.Tensor | None = None
        self._pending: list[_Held] = []
        # (partition and its worker, position in sources, the .grad it left, changed in place)
        self._written: list[tuple[str, int, torch.Tensor | None, bool]] = []

    def add(self, index: int, sources: list[torch.Tensor]) -> int | None:
        """Note partition ``index``'s arguments that require grad; the key for its graph."""
        positions = []
        for t in sources:
            if id(t) not in self._where:
                self._where[id(t)] = len(self.sources)
                if t.is_leaf and t.grad is not None:  # sent along: see transport._grad_of
                    self._grads[len(self.sources)] = _GradState(t.grad, t.grad.clone())
                self.sources.append(t)
            positions.append(self._where[id(t)])
        self.positions[index] = positions
        if not sources:
            return None
        key = self.keys[index] = self.state.new_key()
        return key

    def start(self) -> None:
        """Make the arguments' node (before the caller runs partitions of its own)."""
        if self.sources and self.token is None:
            with torch.enable_grad():
                self.token = _Arguments.apply(self.state, *self.sources)

    def receive(self, index: int, worker: str, reply: Reply, record: Any) -> Any:
        """A remote partition's reply: its ``.grad`` writes noted, its result returned, or
        held until :meth:`finish` links it."""
        positions = self.positions.get(index, [])
        with_graph: list[torch.Tensor] = []  # linked by finish, then written
        for k, wired, in_place, linked in reply.grads:
            grad = None if wired is None else transport.unwire(wired)
            if linked and grad is not None:
                with_graph.append(grad)
            partition = f"partition {index} (on {worker!r})"
            self._written.append((partition, positions[k], grad, in_place))
        if not reply.kept:
            return result_of(reply)
        flat, spec = tree_flatten(
            transport.unwire_tree(reply.value) if reply.wired else reply.value
        )
        for i in reply.fresh:
            flat[i].requires_grad_(True)
        held = _Held(flat, spec, [*(flat[i] for i in reply.outputs), *with_graph])
        graph = Graph(worker, self.keys[index], positions, len(held.to_link), record)
        self.state.graphs.append(graph)
        self._pending.append(held)
        return held

    def finish(self, values: list[Any]) -> list[Any]:
        """``values`` with every held result's tensors made outputs of the call's nodes, and
        the ``.grad`` the remote partitions wrote applied."""
        if self._pending:
            self.start()
            assert self.token is not None
            outputs = [t for held in self._pending for t in held.to_link]
            with torch.enable_grad():
                linked = iter(_linked(self.state, self.token, outputs))
            made: dict[int, torch.Tensor] = {}
            for held in self._pending:
                # A tensor in two places of a result arrived as one object: both get its output.
                made |= {id(t): next(linked) for t in held.to_link}
                for j, leaf in enumerate(held.flat):
                    held.flat[j] = made.get(id(leaf), leaf)
            self._written = [(p, k, made.get(id(g), g), i) for p, k, g, i in self._written]
            self._pending = []
        self._apply_written()
        return [tree_unflatten(v.flat, v.spec) if isinstance(v, _Held) else v for v in values]

    def _apply_written(self) -> None:
        """The ``.grad`` that remote partitions left on their leaves, as one process leaves it.

        A leaf with no ``.grad`` at the call: each partition's write is what its backward
        passes accumulated, added in partition order. A leaf with one: every worker started
        from it (so a ``zero_grad()`` there cleared it, as locally), and the one partition that
        changed it gives its new ``.grad``; partitions that run side by side cannot give what
        one after the other would, so two that change it (the caller's own among them) are
        refused. A non-leaf argument (a chunk of a batch, adapted weights): the writes go on
        through its history to the leaves behind it, in one pass for all of a call's
        partitions, whose chunks share that history.
        """
        written, self._written = self._written, []
        through: list[tuple[torch.Tensor, torch.Tensor]] = []
        by_source: dict[int, list[tuple[str, torch.Tensor | None, bool]]] = {}
        for partition, position, grad, in_place in written:
            by_source.setdefault(position, []).append((partition, grad, in_place))
        for position, writes in by_source.items():
            source = self.sources[position]
            start = self._grads.get(position)
            if not source.is_leaf:
                through += [(source, g.to(source.dtype)) for _, g, _ in writes if g is not None]
            elif start is None:
                for _, g, _ in writes:
                    assert g is not None  # a leaf that had none only gains one
                    g = g.to(source.dtype)  # noqa: PLW2901
                    # A .grad with a graph accumulates with it, as create_graph's does.
                    with torch.set_grad_enabled(g.requires_grad):
                        source.grad = g if source.grad is None else source.grad + g
            else:
                mine = source.grad is not start.grad or not transport.unchanged(
                    source.grad, start.copy
                )
                if len(writes) > 1 or mine:
                    writers = [partition for partition, _, _ in writes]
                    if mine:
                        writers.insert(0, "the caller's own partition")
                    what = f"a tensor of shape {tuple(source.shape)} among its arguments"
                    raise RuntimeError(
                        _TWO_WRITERS.format(partitions=", ".join(writers), what=what)
                    )
                _, g, in_place = writes[0]
                if in_place and g is not None:  # as a backward there accumulates: in place
                    with torch.no_grad():
                        start.grad.copy_(g)
                else:
                    source.grad = None if g is None else g.to(source.dtype)
        if through:
            _go_through(through)

    def abandon(self, lost: Sequence[tuple[str, int]]) -> None:
        """The call failed: release its kept graphs and those of partitions ``(worker,
        index)`` whose fate is unknown (timed out, failed in RPC)."""
        graphs = [(g.worker, g.key) for g in self.state.graphs]
        self.state.graphs.clear()  # the list the release marker holds: released here, once
        self._pending = []
        self._written = []
        lost_graphs = [(w, self.keys[i]) for w, i in lost if i in self.keys]
        release(self.state.world_token, graphs + lost_graphs)


def _go_through(through: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Carry the ``.grad`` written on non-leaf arguments on through their history, in one pass."""
    sources, grads = zip(*through, strict=True)
    try:
        # A .grad with a graph (create_graph inside) leaves one with a graph there too.
        with_graph = any(g.requires_grad for g in grads)
        torch.autograd.backward(list(sources), list(grads), create_graph=with_graph)
    except RuntimeError as error:
        error.add_note(
            "[metadist] a backward inside a remote partition went on through a non-leaf "
            "argument's history, which an earlier backward freed (the caller's own "
            "partition's, say, as the function run chunk by chunk in one process would "
            "find it): run the earlier one with retain_graph=True"
        )
        raise


_TWO_WRITERS = (
    "{partitions} of this call each changed the .grad of {what}, which had a .grad "
    "when the call started: in one process they run one after the other, each starting from "
    "the .grad the one before left, but here they ran side by side, each from the caller's "
    ".grad, so no order of their results gives the .grad of one process. Clear .grad before "
    "the call (opt.zero_grad()), change it in one partition only, or return the gradients "
    "(torch.autograd.grad) and combine them on the caller"
)
