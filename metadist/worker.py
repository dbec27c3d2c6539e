"""The worker's side of a remote call: run one partition, keep its graph, answer its backward.

A partition runs as a local function call would: module parameters arrive as ``nn.Parameter``
leaves and tensors that require grad as leaf tensors (see :mod:`metadist.transport`), so code
that builds a ``torch.optim`` optimizer, checks ``p.is_leaf`` or calls ``loss.backward()``
inside the function behaves as in one process. When the result depends on those leaves, the
worker keeps the graph under a number and answers a later *gradient request* for it with
``torch.autograd.grad``: the vector-Jacobian product of the partition, in the sense of
``torch.func.vjp``. With ``create_graph`` the answer is itself differentiable and kept the same
way, which is how a gradient of a gradient crosses a call. The caller's half is in
:mod:`metadist.autograd`; a graph is dropped when the caller's is, told with the caller's next
message here.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from metadist import timeline, transport, world
from metadist._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from metadist.errors import RemoteFailure

__all__ = ["Graph", "kept_graphs", "lend_main_thread", "run_partition", "vjp", "wake"]

#: Where a ``parallelize`` wrapper keeps the function it wraps (workers run that one).
ORIGINAL = "__metadist_original__"

NO_GRAD, GRAD, INFERENCE = 0, 1, 2


def grad_mode() -> int:
    """The caller's autograd mode, re-created around the partition wherever it runs."""
    if torch.is_inference_mode_enabled():
        return INFERENCE
    return GRAD if torch.is_grad_enabled() else NO_GRAD


def in_grad_mode(mode: int) -> contextlib.AbstractContextManager[Any]:
    """A context manager that puts this thread in ``mode`` (a :func:`grad_mode` value)."""
    if mode == INFERENCE:
        return torch.inference_mode()
    if torch.is_grad_enabled() == (mode == GRAD) and not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()  # already so (RPC threads run with grad enabled)
    return torch.set_grad_enabled(mode == GRAD)


# ----------------------------------------------------------------------------------------------
# The main thread: a worker's is idle while it waits for the others to finish, and computes
# faster than RPC's handler threads (measured: a 12-task MAML chunk's forward and backward took
# 5.1 ms there against 5.6 ms on a handler thread). A request runs there when it is free;
# otherwise on its handler thread, as before, so that a partition whose nested call comes back
# to this worker never waits for the thread it holds.


class _MainThread:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.lock = threading.Lock()
        self.idle = False

    def run(self, job: Callable[[], Any]) -> Future[Any]:
        with self.lock:
            lent, self.idle = self.idle, False
        future: Future[Any] = Future()
        if lent:
            self.jobs.put((job, future))
        else:
            future.set_result(job())
        return future

    def serve(self, until: threading.Event, timeout: float) -> bool:
        with self.lock:
            self.idle = True
        try:
            with contextlib.suppress(queue.Empty):
                while not until.is_set():
                    item = self.jobs.get(timeout=timeout)
                    if item is not None:
                        _finish(*item)
                        with self.lock:
                            self.idle = True
        finally:
            with self.lock:
                self.idle = False
            # A job handed over just before the end still runs.
            with contextlib.suppress(queue.Empty):
                while (item := self.jobs.get_nowait()) is not None:
                    _finish(*item)
        return until.is_set()


def _finish(job: Callable[[], Any], future: Future[Any]) -> None:
    try:
        result = job()  # jobs return their own errors; this is for Ctrl-C and the like
    except BaseException as error:
        future.set_exception(error)
        raise
    future.set_result(result)


_MAIN = _MainThread()


def lend_main_thread(until: threading.Event, timeout: float) -> bool:
    """Run partitions on the calling (main) thread until ``until`` is set or ``timeout`` passes.

    For :mod:`metadist.launch`, while a worker waits for the others to finish. Returns whether
    ``until`` is set; :func:`wake` ends the wait early.
    """
    return _MAIN.serve(until, timeout)


def wake() -> None:
    """End a :func:`lend_main_thread` wait now (its event was just set)."""
    _MAIN.jobs.put(None)


# ----------------------------------------------------------------------------------------------
# Kept graphs: {number: (leaves, differentiable outputs)}, dropped when the caller says so

_GRAPHS: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
_GRAPHS_LOCK = threading.Lock()
_NUMBERS = itertools.count()
_SERVING = threading.local()


def kept_graphs() -> int:
    """How many partition graphs this worker keeps for a later gradient request."""
    with _GRAPHS_LOCK:
        return len(_GRAPHS)


def serving() -> bool:
    """Whether this thread is running a partition (a nested call starts from a worker)."""
    return getattr(_SERVING, "depth", 0) > 0


def _keep(leaves: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    number = next(_NUMBERS)
    with _GRAPHS_LOCK:
        _GRAPHS[number] = (leaves, outputs)
    return number


def _drop(numbers: tuple[int, ...]) -> None:
    if numbers:
        with _GRAPHS_LOCK:
            for number in numbers:
                _GRAPHS.pop(number, None)


class Graph(NamedTuple):
    """A partition's result whose graph the worker kept: the result detached, and its number.

    ``outputs`` are the flat indices (in the result's pytree) of the tensors that require grad;
    the caller makes them the outputs of its node for this call (see :mod:`metadist.autograd`).
    ``number`` is -1 when no leaf of the caller's is under them. ``written`` holds the ``.grad``
    that the function itself left on leaves (by index into the leaves), which the caller adds
    to its own tensors' ``.grad``, as the same code run in its process would have.
    """

    value: Any
    number: int
    outputs: tuple[int, ...]
    written: tuple[tuple[int, torch.Tensor], ...] = ()


class Timed(NamedTuple):
    """A partition's result with the worker's clock at the start and the end of the function."""

    value: Any
    start: float
    end: float


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


def _kept(result: Any, leaves: list[torch.Tensor]) -> Any:
    """``result`` as a :class:`Graph` when it depends on ``leaves``, else as it is."""
    written = tuple((k, t.grad) for k, t in enumerate(leaves) if t.grad is not None)
    flat, spec = tree_flatten(result)
    outputs = tuple(
        i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
    )
    if not outputs and not written:
        return result
    # Without leaves of the caller's under them, the tensors travel as leaves that require
    # grad, as a fresh leaf made inside a local call would be.
    number = _keep(leaves, [flat[i] for i in outputs]) if outputs and leaves else -1
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in flat]
    value = tree_unflatten(detached, spec) if outputs else result
    return Graph(value, number, outputs, written)


class _TieToInput(torch.autograd.Function):
    """Pass ``output`` through, and give ``received`` a (zero) gradient in the backward pass.

    Inside a distributed autograd context only: torch's distributed autograd waits, in every
    backward pass of a context, until the node that received a message's tensors on a worker
    has sent their gradients back. A result that depends on none of them (a fresh leaf made on
    the worker, arguments it ignores) would leave that wait unfinished forever. All tensors of
    one message share that node, so tying the result to one of them is enough.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype = received.shape, received.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(()).to(ctx.dtype).expand(ctx.shape)


def _tied(result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Tie the result to a tensor that arrived through distributed autograd, if any."""
    received = None
    for leaf in tree_flatten((args, kwargs))[0]:
        tensors = leaf.parameters() if isinstance(leaf, torch.nn.Module) else (leaf,)
        received = next(
            (t for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None), None
        )
        if received is not None:
            break
    if received is None:
        return result
    flat, spec = tree_flatten(result)
    for i, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            flat[i] = _TieToInput.apply(leaf, received)
            return tree_unflatten(flat, spec)
    return result


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def run_partition(*args: Any) -> Future[Any]:
    """Run one partition on this worker (the RPC target of every remote call).

    On the main thread when it is free, unless the call travels in a distributed autograd
    context (whose handler thread alone holds it); see :func:`_run_partition`.
    """
    attached = len(args) > 7 and args[7]
    if attached:
        future: Future[Any] = Future()
        future.set_result(_run_partition(*args))
        return future
    return _MAIN.run(lambda: _run_partition(*args))


def _run_partition(  # noqa: PLR0917 - positional on the wire
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    needs_decode: bool,
    compression: torch.dtype | None,
    mode: int = GRAD,
    timed: bool = False,
    attached: bool = False,
    release: tuple[int, ...] = (),
) -> Any:
    """Run one partition on this worker.

    ``attached``: the call travels inside the caller's distributed autograd context, whose
    engine differentiates it; otherwise the worker keeps the graph itself. ``release``: graphs
    the caller no longer needs.
    """
    _drop(release)
    start = timeline.now() if timed else 0.0
    world.use_process_threads()  # an RPC handler thread: see world.use_process_threads
    me = rpc.get_worker_info().name
    try:
        leaves: list[torch.Tensor] = []
        if needs_decode:
            args, kwargs, leaves = transport.decode(args, kwargs, leaves=not attached)
    except Exception as error:
        return RemoteFailure.capture(error, me, "decode")
    _SERVING.depth = getattr(_SERVING, "depth", 0) + 1
    try:
        with in_grad_mode(mode):
            result = getattr(func, ORIGINAL, func)(*args, **kwargs)
            check_result(result)
            if attached:
                result = _tied(result, args, kwargs)
            elif mode == GRAD:
                result = _kept(result, leaves)
        if compression is not None:
            if isinstance(result, Graph):
                result = result._replace(value=transport.compress_tree(result.value, compression))
            else:
                result = transport.compress_tree(result, compression)
    except Exception as error:
        return RemoteFailure.capture(error, me, "call")
    finally:
        _SERVING.depth -= 1
    return Timed(result, start, timeline.now()) if timed else result


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def vjp(*args: Any) -> Future[Any]:
    """Answer one gradient request (the RPC target); on the main thread when it is free."""
    return _MAIN.run(lambda: _vjp(*args))


def _vjp(
    requests: list[tuple[int, list[torch.Tensor | None], bool]],
    retain: bool,
    create_graph: bool,
    compression: torch.dtype | None,
) -> Any:
    """Answer one gradient request: the gradients of the kept graphs' leaves.

    ``requests`` holds, per graph, its number, the gradient of each output (``None`` where the
    caller's backward pass did not reach it) and whether to forget the graph afterwards (the
    pass reached every output and does not keep the graph). ``retain`` is the caller's
    ``retain_graph``: without it, what the pass went through is freed, as in a local pass. With
    ``create_graph``, each answer is kept as a graph of its own whose leaves are the graph's
    leaves followed by the received gradients.

    Returns:
        Per graph, ``(gradients, number, outputs)``: the gradient of each leaf (``None`` where
        the outputs do not depend on it); with ``create_graph``, the number and output indices
        of the answer's own graph (else ``-1`` and ``()``); or a ``RemoteFailure``.
    """
    world.use_process_threads()
    try:
        with _GRAPHS_LOCK:
            graphs = [_GRAPHS[number] for number, _, _ in requests]
    except KeyError as error:
        return RemoteFailure.capture(
            RuntimeError(
                f"graph {error} is gone from this worker: it was released after the caller's "
                f"graph was freed. Pass retain_graph=True to the earlier backward pass to "
                f"differentiate a remote call twice"
            ),
            rpc.get_worker_info().name,
            "call",
        )
    try:
        with torch.enable_grad():
            answers = [
                _vjp_one(graph, grads, retain, create_graph, compression)
                for graph, (_, grads, _) in zip(graphs, requests, strict=True)
            ]
    except Exception as error:
        return RemoteFailure.capture(error, rpc.get_worker_info().name, "backward")
    finally:
        _drop(tuple(number for number, _, forget in requests if forget))
    return answers


def _vjp_one(
    graph: tuple[list[torch.Tensor], list[torch.Tensor]],
    grads: list[torch.Tensor | None],
    retain: bool,
    create_graph: bool,
    compression: torch.dtype | None,
) -> tuple[list[torch.Tensor | None], int, tuple[int, ...]]:
    leaves, outputs = graph
    if compression is not None:
        grads = transport.decompress_tree(grads)
    reached = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
    grad_leaves: list[torch.Tensor] = []
    if create_graph:
        # The received gradients become leaves of the answer's graph, so that the caller can
        # differentiate the answer with respect to them too.
        grad_leaves = [g.detach().requires_grad_(True) for _, g in reached]
    found = torch.autograd.grad(
        [o for o, _ in reached],
        leaves,
        grad_leaves if create_graph else [g for _, g in reached],
        retain_graph=retain,
        create_graph=create_graph,
        allow_unused=True,
    )
    answer: list[torch.Tensor | None] = list(found)
    number, diff = -1, tuple[int, ...]()
    if create_graph:
        diff = tuple(i for i, g in enumerate(answer) if g is not None and g.requires_grad)
        if diff:
            number = _keep([*leaves, *grad_leaves], [found[i] for i in diff])
        answer = [None if g is None else g.detach() for g in answer]
    if compression is not None:
        return transport.compress_tree(answer, compression), number, diff
    return answer, number, diff
