"""Remote calls: map a function over workers, reduce the results, differentiably.

``remote_async_call(func, args=..., partitioner=..., reducer=...)`` splits the arguments with the
partitioner, runs ``func`` on each partition's worker over RPC, and reduces the per-partition
results on the caller. The call is differentiable like a local function, ``nn.Module``
arguments included: the path reads caller (here) → partition (:mod:`metadist.partition`) →
send (:mod:`metadist.transport`) → worker (:mod:`metadist.worker`) → result
(:mod:`metadist.reduce`) → backward request (:mod:`metadist.autograd`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import pickle
import queue
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, ParamSpec, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from metadist import autograd, timeline, transport, world
from metadist import worker as remote_worker
from metadist._pytree import tree_flatten, tree_unflatten
from metadist.errors import (
    RemoteError,
    RemoteFailure,
    is_timeout,
    qualified_name,
    resolve_qualified_name,
)
from metadist.partition import batch_partitioner
from metadist.reduce import PartitionResults, check_sizes
from metadist.world import get_worker_id, get_worker_name, get_worker_names, require_rpc

__all__ = [
    "DEFAULT_TIMEOUT",
    "Partitioner",
    "Reducer",
    "parallelize",
    "parallelize_async",
    "parallelize_sync",
    "remote_async_call",
    "remote_sync_call",
]

P = ParamSpec("P")
T = TypeVar("T")


class _DefaultTimeout(float):
    """torch's "unset" timeout (-1.0), shown by name in signatures and error messages."""

    def __repr__(self) -> str:
        return "DEFAULT_TIMEOUT"


#: ``timeout`` default: the running world's RPC timeout (``rpc_backend_options.rpc_timeout``,
#: 60 s unless configured), per partition. Equal to torch's ``UNSET_RPC_TIMEOUT`` (-1.0), so
#: code written for torchopt that passes that constant keeps working.
DEFAULT_TIMEOUT: float = _DefaultTimeout(-1.0)

#: A worker rank, a worker name, or ``partitioner(*args, **kwargs) -> [(worker, args, kwargs)]``.
Partitioner = int | str | Callable[..., Sequence[tuple[int | str, Sequence[Any], dict[str, Any]]]]
#: ``reducer(results) -> value`` over the per-partition results in partition order.
Reducer = Callable[[list[Any]], Any]

_ORIGINAL = remote_worker.ORIGINAL

# ----------------------------------------------------------------------------------------------
# Which object to pickle for ``func`` (checked once per function)

_SENDABLE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _not_sendable(func: Any, why: str) -> TypeError:
    name = getattr(func, "__qualname__", repr(func))
    module = getattr(func, "__module__", "?")
    return TypeError(
        f"{name!s} (from module {module!s}) cannot be sent to other workers: {why}. Define it "
        f"with `def` at module level (every worker imports the function by its module and name; "
        f"under torchrun every worker runs the same script, so functions defined at the top "
        f"level of the script work)"
    )


def _check_definition(func: Callable[..., Any]) -> None:
    qualname = getattr(func, "__qualname__", "")
    if "<lambda>" in qualname:
        raise _not_sendable(func, "it is a lambda")
    if "<locals>" in qualname:
        raise _not_sendable(func, "it is a local function or closure")


def _resolve_sendable(func: Any) -> Any:
    if not callable(func):
        raise TypeError(f"func must be callable, got {func!r} of type {type(func).__name__}")
    if isinstance(func, types.FunctionType):
        original = getattr(func, _ORIGINAL, None)
        if original is not None and not isinstance(original, types.FunctionType):
            return _resolve_sendable(original)  # a wrapped builtin or callable: send it as is
        _check_definition(func)
        found = resolve_qualified_name(func.__module__, func.__qualname__)
        if found is func or (original is not None and found is original):
            # The name refers to this object (for a parallelize wrapper whose original kept the
            # name, send the original; the worker runs it directly).
            return found
        if found is not None and getattr(found, _ORIGINAL, None) is func:
            return found  # the name holds our wrapper: send it, the worker unwraps it
        raise _not_sendable(
            func,
            f"the name {func.__module__}.{func.__qualname__} does not refer to this function "
            f"(it was renamed, redefined or deleted)",
        )
    if isinstance(func, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return func
    try:
        pickle.dumps(func)
    except Exception as error:
        raise _not_sendable(func, f"pickling failed with {type(error).__name__}: {error}") from (
            error
        )
    return func


def _sendable(func: Any) -> Any:
    try:
        return _SENDABLE[func]
    except (KeyError, TypeError):
        pass
    sendable = _resolve_sendable(func)
    with contextlib.suppress(TypeError):  # not weak-referenceable: checked on every call
        _SENDABLE[func] = sendable
    return sendable


# ----------------------------------------------------------------------------------------------
# Caller side


def _resolve_timeout(timeout: float | None) -> float:
    if timeout is None:
        return 0.0  # torch's "no timeout"
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if timeout == DEFAULT_TIMEOUT:
        return rpc.constants.UNSET_RPC_TIMEOUT
    if not timeout > 0:
        raise ValueError(
            f"timeout must be > 0 seconds, None (no timeout) or DEFAULT_TIMEOUT, got {timeout}"
        )
    return float(timeout)


def _check_reducer(reducer: Any) -> None:
    if reducer is not None and not callable(reducer):
        raise TypeError(
            f"reducer must be callable (reducer(results) -> value) or None, got {reducer!r}"
        )


def _check_partitioner(partitioner: Any) -> None:
    if partitioner is None or callable(partitioner):
        return
    if isinstance(partitioner, bool) or not isinstance(partitioner, (int, str)):
        raise TypeError(
            f"partitioner must be a worker id (int), a worker name (str), a callable "
            f"partitioner(*args, **kwargs) -> [(worker, args, kwargs)] or None, got "
            f"{partitioner!r}"
        )


def _partitions(
    partitioner: Any, args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]
) -> tuple[list[tuple[str, tuple[Any, ...], dict[str, Any]]], tuple[int, ...] | None, str]:
    _check_partitioner(partitioner)
    if partitioner is None:
        partitioner = batch_partitioner
    if not callable(partitioner):
        try:
            worker_id = get_worker_id(partitioner)
        except (TypeError, ValueError) as error:
            raise type(error)(f"partitioner={partitioner!r}: {error}") from None
        return [(names[worker_id], args, kwargs)], None, "static"
    raw = partitioner(*args, **kwargs)
    name = getattr(partitioner, "__qualname__", repr(partitioner))
    if not isinstance(raw, (list, tuple)):
        raise TypeError(
            f"partitioner {name} must return a list of (worker, args, kwargs) triples, got "
            f"{type(raw).__name__}"
        )
    if not raw:
        raise ValueError(f"partitioner {name} returned no partitions")
    parts: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    for index, item in enumerate(raw):
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise TypeError(
                f"partitioner {name} returned a malformed partition {index}: expected a "
                f"(worker, args, kwargs) triple, got {item!r:.200}"
            )
        worker, p_args, p_kwargs = item
        try:
            worker_id = get_worker_id(worker)
        except (TypeError, ValueError) as error:
            raise type(error)(f"partitioner {name}, partition {index}: {error}") from None
        if p_args is None:
            p_args = ()
        if p_kwargs is None:
            p_kwargs = {}
        if not isinstance(p_args, (tuple, list)) or not isinstance(p_kwargs, dict):
            raise TypeError(
                f"partitioner {name} returned a malformed partition {index}: args must be a "
                f"tuple or list and kwargs a dict, got {type(p_args).__name__} and "
                f"{type(p_kwargs).__name__}"
            )
        parts.append((names[worker_id], tuple(p_args), p_kwargs))
    sizes = getattr(raw, "sizes", None)
    if sizes is not None:  # refused before sending: wrong sizes would skew a weighted mean
        sizes = check_sizes(
            sizes,
            len(parts),
            f"partitioner {name} returned {len(parts)} partitions: Partitions.sizes",
            "partition",
        )
    return parts, sizes, getattr(raw, "schedule", "static")


def _rpc_error(
    error: BaseException, index: int, count: int, worker: str, timeout: float
) -> BaseException:
    text = str(error)
    if is_timeout(error):
        if timeout == rpc.constants.UNSET_RPC_TIMEOUT:
            timeout = rpc.get_rpc_timeout()  # type: ignore[attr-defined]
        late = TimeoutError(
            f"partition {index} of {count} on worker {worker!r} did not finish within the "
            f"timeout of {timeout} s: {text}"
        )
        late.worker_name, late.partition_index = worker, index  # type: ignore[attr-defined]
        return late
    return RemoteError(
        f"partition {index} of {count} on worker {worker!r} failed in RPC: "
        f"{type(error).__name__}: {text}",
        worker_name=worker,
        partition_index=index,
        remote_type=qualified_name(type(error)),
    )


class _Linkable(NamedTuple):
    """A kept result's leaves until the call links them (see ``_Call._linked``)."""

    flat: list[Any]
    spec: Any
    outputs: tuple[int, ...]


#: Partitions a synchronous call keeps in flight on each remote worker; the others wait on the
#: caller until one finishes. Two keep a worker busy while the caller hands it the next one,
#: and bound how many RPC threads one call can hold on a worker, so that nested calls of any
#: width find a free thread.
IN_FLIGHT_PER_WORKER = 2


class _Call:
    """The partitions of one remote call, and how to turn them into its result.

    Partitions whose worker is the caller itself run in-process, on the calling thread
    (``local`` holds their outcomes); the others are RPC futures. An asynchronous call sends
    every remote partition at once; a synchronous one sends at most
    :data:`IN_FLIGHT_PER_WORKER` per worker (one for a dynamic schedule outside a context) and
    the next as each one finishes (for a dynamic schedule, to whichever worker finished): from
    the RPC thread that saw it finish, or, inside a distributed autograd context, from the
    calling thread, which alone holds the context.
    """

    def __init__(self, func_name: str, workers: list[str]) -> None:
        count = len(workers)
        self.func_name = func_name
        self.workers = workers
        self.futures: list[Future[Any] | None] = [None] * count
        self.local: dict[int, Any] = {}
        self.new_structures: list[tuple[str, ...]] = [()] * count
        self.differentiable = [False] * count
        self.input_nodes: list[list[Any]] = [[] for _ in range(count)]
        self.sizes: tuple[int, ...] | None = None
        self.reducer: Callable[[Any], Any] | None = None
        self.compression: torch.dtype | None = None
        self.timeout = 0.0
        self.world_token: object = None
        self.grad_mode = remote_worker.grad_mode()
        # Inside a distributed autograd context the call travels attached to it, and torch's
        # engine differentiates it (RRefs fetched inside partitions need that); a partition's
        # own nested calls are never attached, since the worker differentiates its partition.
        self.context_id = autograd.current_context()
        if self.context_id is None and not remote_worker.serving():
            self.context_id = autograd.torch_context_id()
        # Outside a context: the link to the workers' kept graphs (see metadist.autograd) and,
        # per remote partition, where its arguments that require grad sit in the link's list.
        self.gradients: autograd.RemoteGradients | None = None
        self.token: torch.Tensor | None = None
        self.positions: dict[int, list[int]] = {}
        self.sources: list[torch.Tensor] = []
        self.func: Any = None
        self.own = ""
        self.parts: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.encoded: dict[int, tuple[Any, ...]] = {}
        self.dynamic = False
        self.bound = IN_FLIGHT_PER_WORKER
        # Partitions waiting to be sent, per worker (a dynamic schedule has one shared queue,
        # keyed ""); the caller's own partitions wait under its own name.
        self.queues: dict[str, collections.deque[int]] = {}
        self.in_flight: dict[str, int] = {}
        # Guards the queues and in_flight, which RPC threads update too (see _arrived).
        self.lock = threading.RLock()
        self.arrivals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.bar: Any = None
        self.timeline = timeline.active()
        self.call_number = self.timeline.new_call() if self.timeline is not None else -1
        self.records: dict[int, timeline.PartitionRecord] = {}

    def _record(self, index: int, worker: str, bytes_out: int = 0) -> None:
        assert self.timeline is not None
        self.records[index] = self.timeline.add(
            timeline.PartitionRecord(
                self.call_number, self.func_name, index, worker, timeline.now(), bytes_out=bytes_out
            )
        )

    def send(self, index: int, worker: str) -> None:
        """Send partition ``index`` to ``worker`` (encoded already)."""
        self.workers[index] = worker
        e_args, e_kwargs, needs_decode, self.new_structures[index], _ = self.encoded.pop(index)
        timed = self.timeline is not None
        if timed:
            self._record(index, worker, transport.wire_bytes((e_args, e_kwargs)))
        try:
            future = rpc.rpc_async(
                worker,
                remote_worker.run_partition,
                args=(
                    self.func,
                    e_args,
                    e_kwargs,
                    needs_decode,
                    self.compression,
                    self.grad_mode,
                    timed,
                    self.context_id is not None and self.grad_mode == remote_worker.GRAD,
                    autograd.released(self.world_token, worker),
                ),
                timeout=self.timeout,
            )
        except Exception as error:
            future = Future()
            future.set_exception(error)
        self.futures[index] = future
        self.in_flight[worker] = self.in_flight.get(worker, 0) + 1
        if timed:
            record = self.records[index]
            future.add_done_callback(lambda _: setattr(record, "done", timeline.now()))
        if self.bar is not None:
            future.add_done_callback(lambda _: self.bar.update())
        future.add_done_callback(lambda _, index=index: self._arrived(index))

    def _arrived(self, index: int) -> None:
        """A partition's future completed (on an RPC thread, or here if it failed at once)."""
        if self.context_id is None:
            # Sends carry no distributed autograd context: hand the freed slot out from here,
            # so that the worker goes on while the caller computes partitions of its own.
            self._free(index)
            index = -1  # only wakes the caller
        self.arrivals.put(index)

    def run_here(self, index: int) -> None:
        """Run partition ``index`` in-process, as its worker would (errors included)."""
        self._link()
        self.workers[index] = self.own
        _, args, kwargs = self.parts[index]
        if self.timeline is not None:
            self._record(index, self.own)
            self.records[index].start = self.records[index].sent
        try:
            result = getattr(self.func, _ORIGINAL, self.func)(*args, **kwargs)
            remote_worker.check_result(result)
        except Exception as error:
            failure = RemoteFailure.capture(error, self.own, "call")
            raised = failure.to_exception(index, len(self.parts), self.func_name)
            raised.__cause__ = error
            self.local[index] = (False, raised)
        else:
            self.local[index] = (True, result)
        if self.bar is not None:
            self.bar.update()
        if self.timeline is not None:
            record = self.records[index]
            record.end = record.done = timeline.now()
            if self.local[index][0]:
                record.bytes_in = transport.wire_bytes(result)

    def _next_for(self, worker: str) -> int | None:
        pending = self.queues.get("" if self.dynamic else worker)
        return pending.popleft() if pending else None

    def _free(self, index: int) -> None:
        """Partition ``index`` finished: send its worker the next one."""
        with self.lock:
            worker = self.workers[index]
            self.in_flight[worker] -= 1
            self.fill(worker)

    def fill(self, worker: str, extra: int = 0) -> None:
        """Send ``worker`` its next partitions, up to ``self.bound + extra`` in flight."""
        with self.lock:
            while self.in_flight.get(worker, 0) < self.bound + extra:
                index = self._next_for(worker)
                if index is None:
                    return
                self.send(index, worker)

    def drive(self, remote_workers: list[str], runs_here: bool) -> None:
        """Send and run every partition; return when none is left to start or in flight."""
        for worker in remote_workers:
            self.fill(worker)
        while True:
            while True:  # hand out the slots that finished partitions freed
                try:
                    done = self.arrivals.get_nowait()
                except queue.Empty:
                    break
                if done >= 0:
                    self._free(done)
            if runs_here:
                with self.lock:
                    index = self._next_for(self.own)
                if index is not None:
                    if (
                        self.context_id is not None
                        and self.dynamic
                        and len(self.queues[""]) > len(remote_workers)
                    ):
                        # Nothing is handed out while this thread computes: give each worker
                        # one more to go on with meanwhile, unless the end is near (the last
                        # partitions go to whoever frees up first).
                        for worker in remote_workers:
                            self.fill(worker, extra=1)
                    self.run_here(index)
                    continue
            with self.lock:
                if not any(self.in_flight.values()):
                    return
            self.arrivals.put(self._wait_for_arrival())

    def _wait_for_arrival(self) -> int:
        """Block until a partition in flight finishes; never forever unless asked to."""
        if self.timeout == 0:  # timeout=None: the user asked to wait as long as it takes
            return self.arrivals.get()
        limit = rpc.get_rpc_timeout() if self.timeout < 0 else self.timeout  # type: ignore[attr-defined]
        try:
            # torch reports a timed-out partition itself; the margin covers its timer.
            return self.arrivals.get(timeout=limit + 5.0)
        except queue.Empty:
            busy = sorted(w for w, n in self.in_flight.items() if n)
            raise TimeoutError(
                f"{self.func_name}(): partitions on {', '.join(map(repr, busy))} did not finish "
                f"within the timeout of {limit} s and RPC did not report them: every RPC thread "
                f"of those workers is probably blocked in a nested synchronous call. Raise the "
                f"thread pool (rpc_backend_options.num_worker_threads, 16 by default), or make "
                f"fewer nested calls at a time"
            ) from None

    def _outcome(self, index: int) -> tuple[bool, Any]:
        """``(True, value)`` of one partition, or ``(False, exception to raise)``."""
        if index in self.local:
            return self.local[index]
        future = self.futures[index]
        assert future is not None
        worker = self.workers[index]
        try:
            value = future.wait()
        except Exception as error:
            return False, _rpc_error(error, index, len(self.workers), worker, self.timeout)
        if isinstance(value, remote_worker.Timed):
            record = self.records[index]
            record.start, record.end, value = value.start, value.end, value.value
            kept = value.value if isinstance(value, remote_worker.Graph) else value
            record.bytes_in = transport.wire_bytes(kept)
        failed = isinstance(value, RemoteFailure)
        if not failed or value.stage != "decode":  # the worker cached the structures it got
            transport.mark_structure_confirmed(self.world_token, worker, self.new_structures[index])
        if failed:
            return False, value.to_exception(index, len(self.workers), self.func_name)
        graph = None
        if isinstance(value, remote_worker.Graph):
            graph, value = value, value.value
        if self.compression is not None:
            value = transport.decompress_tree(value)
        if graph is not None:
            value = self._kept(index, worker, graph, value)
        if self.context_id is not None:
            value = autograd.receive(
                self.context_id,
                value,
                self.input_nodes[index],
                f"{self.func_name} (partition {index} on {worker!r})",
                self.differentiable[index],
            )
        return True, value

    def link_arguments(self, remote: list[int]) -> None:
        """Note where the remote partitions' arguments that require grad sit in the link."""
        inputs: list[torch.Tensor] = []
        where: dict[int, int] = {}
        for i in remote:
            sources = self.encoded[i][4]
            for t in sources:
                if id(t) not in where:
                    where[id(t)] = len(inputs)
                    inputs.append(t)
            self.positions[i] = [where[id(t)] for t in sources]
        self.sources = inputs
        if inputs:
            self.gradients = autograd.RemoteGradients(
                len(inputs), self.world_token, self.compression
            )

    def _link(self) -> None:
        """Make the node that will hold the gradients of the remote partitions' arguments.

        After the first sends (the workers need not wait for it), but before the caller runs
        any partition itself, so that a backward pass reaches it after the caller's own
        partitions (see :mod:`metadist.autograd`).
        """
        if self.gradients is not None and self.token is None:
            self.token = autograd.arguments_node(self.gradients, self.sources)

    def _kept(self, index: int, worker: str, graph: remote_worker.Graph, value: Any) -> Any:
        """A result whose graph ``worker`` kept: note its part of the call's link."""
        if graph.written:
            with torch.no_grad():
                for k, g in graph.written:
                    source = self.sources[self.positions[index][k]]
                    if source.is_leaf:  # a non-leaf's .grad is not kept locally either
                        if self.compression is not None:
                            g = g.to(source.dtype)  # noqa: PLW2901
                        source.grad = g if source.grad is None else source.grad + g
        flat, spec = tree_flatten(value)
        if not graph.outputs:
            return value
        if graph.number < 0 or self.gradients is None:
            # No argument of the caller's under it: its tensors are fresh leaves.
            for i in graph.outputs:
                flat[i].requires_grad_(True)
            return value
        record = self.records.get(index)
        self.gradients.parts.append(
            autograd.Part(worker, graph.number, self.positions[index], len(graph.outputs), record)
        )
        return _Linkable(flat, spec, graph.outputs)

    def _linked(self, outcomes: list[tuple[bool, Any]]) -> list[tuple[bool, Any]]:
        """The outcomes with the kept results' tensors made outputs of the call's link."""
        linkable = [v for ok, v in outcomes if ok and isinstance(v, _Linkable)]
        if not linkable:
            return outcomes
        self._link()
        assert self.gradients is not None
        assert self.token is not None
        outputs = [item.flat[i] for item in linkable for i in item.outputs]
        linked = iter(autograd.results_node(self.gradients, self.token, outputs))
        for item in linkable:
            for i in item.outputs:
                item.flat[i] = next(linked)
        return [
            (ok, tree_unflatten(v.flat, v.spec) if ok and isinstance(v, _Linkable) else v)
            for ok, v in outcomes
        ]

    def collect(self) -> Any:
        """Wait for *every* partition (none is left pending), then reduce or raise."""
        world.wait_all([f for f in self.futures if f is not None])
        if self.bar is not None:
            self.bar.close()
        outcomes = self._linked([self._outcome(i) for i in range(len(self.workers))])
        values = [value for ok, value in outcomes if ok]
        errors = [error for ok, error in outcomes if not ok]
        if errors:
            first = errors[0]
            if len(errors) > 1:
                others = ", ".join(
                    f"partition {getattr(e, 'partition_index', '?')} ({type(e).__name__})"
                    for e in errors[1:]
                )
                first.add_note(f"[metadist] {len(errors) - 1} more partition(s) failed: {others}")
            raise first
        if self.reducer is None:
            return values
        with remote_worker.in_grad_mode(self.grad_mode):
            return self.reducer(PartitionResults(values, self.sizes))

    def future(self) -> Future[Any]:
        """A future completed (by the last partition's callback) with :meth:`collect`."""
        result: Future[Any] = Future()

        def finish(_: Future[Any]) -> None:
            try:
                value = self.collect()
            except BaseException as error:
                result.set_exception(error)
            else:
                result.set_result(value)

        # collect_all completes once every future has, failed ones included (at once if none).
        torch.futures.collect_all([f for f in self.futures if f is not None]).add_done_callback(
            finish
        )
        return result


def _progress_bar(name: str, total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError(
            "progress=True draws its bar with tqdm, which is not installed: pip install tqdm"
        ) from None
    return tqdm(total=total, desc=name, unit="partition", disable=not sys.stdout.isatty())


def _start(  # noqa: PLR0917 - internal; mirrors the public signature
    func: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: dict[str, Any] | None,
    partitioner: Partitioner | None,
    reducer: Reducer | None,
    timeout: float | None,
    compression: str | None,
    progress: bool,
    *,
    sync: bool,
) -> _Call:
    """Check the arguments, partition them, and send (or, in-process, run) every partition.

    A synchronous call returns once every partition has finished; an asynchronous one as soon
    as the remote partitions are sent and its own ones have run.
    """
    require_rpc("metadist.remote_sync_call" if sync else "metadist.remote_async_call")
    sendable = _sendable(func)
    if args is None:
        args = ()
    elif not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    _check_reducer(reducer)
    rpc_timeout = _resolve_timeout(timeout)
    dtype = transport.resolve_compression(compression)
    names = get_worker_names()
    parts, sizes, schedule = _partitions(partitioner, tuple(args), kwargs, names)
    own = get_worker_name()

    call = _Call(
        getattr(func, "__qualname__", None) or type(func).__name__, [n for n, _, _ in parts]
    )
    call.sizes, call.reducer, call.compression, call.timeout = sizes, reducer, dtype, rpc_timeout
    call.func, call.own, call.parts = sendable, own, parts
    if progress:
        call.bar = _progress_bar(call.func_name, len(parts))
    # A dynamic schedule decides the workers as they free up (synchronous calls only: only the
    # calling thread holds the distributed autograd context the sends must carry).
    call.dynamic = sync and schedule == "dynamic" and len(parts) > 1
    if call.dynamic and call.context_id is None:
        # Slots are handed out from the RPC thread the moment a partition finishes, so a
        # second one in flight hides no latency: it only commits a task to a worker that may
        # be busy with a long one (8,1,1,1,8,1,1,1 inner steps: 1.40x faster than static with
        # one in flight, 1.25x with two; bench_schedule.py --costs).
        call.bound = 1
    workers = list(dict.fromkeys(name for name, _, _ in parts))
    remote = [i for i, (name, _, _) in enumerate(parts) if call.dynamic or name != own]
    if remote:
        call.world_token = world.world_token()
        # RPC attaches these partitions to the distributed autograd context; their argument
        # graphs let a backward pass follow results sent on to further calls (see autograd).
        attached = call.context_id is not None and call.grad_mode == remote_worker.GRAD
        memo = transport.CallMemo()
        # Encode every partition that may travel before sending anything, so that bad input
        # fails with no RPC sent.
        for i in remote:
            name, p_args, p_kwargs = parts[i]
            if attached:
                call.differentiable[i], call.input_nodes[i] = autograd.grad_inputs(p_args, p_kwargs)
            call.encoded[i] = transport.encode(
                p_args,
                p_kwargs,
                world=call.world_token,
                worker="" if call.dynamic else name,  # unknown yet: structures travel along
                dtype=dtype,
                memo=memo,
                attached=attached,
            )
        if not attached and call.grad_mode == remote_worker.GRAD:
            call.link_arguments(remote)
    for i, (_, p_args, p_kwargs) in enumerate(parts):
        if i not in call.encoded:  # runs in-process: the same checks as if it were sent
            transport.check_sendable(p_args, p_kwargs)
    if call.dynamic:
        call.queues[""] = collections.deque(range(len(parts)))
        call.drive([w for w in workers if w != own], own in workers)
    elif sync:
        for i, (name, _, _) in enumerate(parts):
            call.queues.setdefault(name, collections.deque()).append(i)
        call.drive([w for w in workers if w != own], own in workers)
    else:
        for i in remote:
            call.send(i, parts[i][0])
        # The caller's own partitions run here, on this thread, while the remote ones compute:
        # no RPC to itself, no encoding, and their graph is part of the caller's own.
        for i, (name, _, _) in enumerate(parts):
            if name == own:
                call.run_here(i)
    return call


def remote_async_call(
    func: Callable[..., Any],
    *,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
    progress: bool = False,
) -> Future[Any]:
    """Run ``func`` on workers over RPC, map/reduce style, and return a future of the result.

    The partitioner splits ``args``/``kwargs`` into ``(worker, args, kwargs)`` partitions, each
    partition runs ``func(*args, **kwargs)`` on its worker, and ``reducer`` combines the results
    in partition order. The result is differentiable as a local call's would be: ``backward()``
    reaches the tensors and ``nn.Module`` parameters among the arguments, with or without
    :func:`metadist.autograd.context`; a module's structure is sent to each worker once.

    Args:
        func: A module-level function (workers import it by name); lambdas and local functions
            raise ``TypeError``.
        args: Positional arguments for ``func``.
        kwargs: Keyword arguments for ``func``.
        partitioner: A worker rank (``int``) or name (``str``) to run one partition there, or a
            callable ``partitioner(*args, **kwargs) -> [(worker, args, kwargs), ...]``. ``None``
            means :func:`metadist.batch_partitioner` (split dim 0 over all workers).
        reducer: ``reducer(results) -> value``; ``None`` returns the list of per-partition
            results in partition order (a list of one for a worker-id partitioner).
        timeout: Seconds each partition may take; ``DEFAULT_TIMEOUT`` (the default) uses the
            world's RPC timeout (``rpc_backend_options.rpc_timeout``, 60 s unless configured);
            ``None`` waits forever.
        compression: ``"bf16"`` or ``"fp16"`` casts floating-point tensors (arguments, module
            tensors, results and their gradients) for the wire; ``None`` (default) sends them
            as they are.
        progress: Draw a progress bar of finished partitions on the caller (needs ``tqdm``;
            drawn only when standard output is a terminal).

    Returns:
        A ``torch.futures.Future``; ``wait()`` returns the (reduced) result or raises. It
        completes once every partition has finished or failed.

    Raises:
        RuntimeError: RPC is not running (see :func:`metadist.auto_init_rpc`).
        TypeError: ``func`` cannot be sent, or a bad ``partitioner``/``reducer``/argument.
        ValueError: The partitioner rejected the arguments, an unknown worker, a bad timeout.

    The future raises the remote exception's type where possible (else
    :class:`metadist.RemoteError`) with the worker, the partition index and the remote
    traceback in the message; a partition that timed out raises ``TimeoutError``.

    Example:
        >>> import torch
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     fut = remote_async_call(torch.square, args=(torch.arange(4.0),))
        ...     return fut.wait()
        >>> main()  # a world of 1: one partition
        [tensor([0., 1., 4., 9.])]
    """
    call = _start(
        func, args, kwargs, partitioner, reducer, timeout, compression, progress, sync=False
    )
    return call.future()


def remote_sync_call(
    func: Callable[..., Any],
    *,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
    progress: bool = False,
) -> Any:
    """Like :func:`remote_async_call`, but wait for and return the result.

    Args:
        func: A module-level function.
        args: Positional arguments for ``func``.
        kwargs: Keyword arguments for ``func``.
        partitioner: Worker id/name or partitioner callable (default: batch_partitioner).
        reducer: Reducer, or ``None`` for the list of per-partition results.
        timeout: Per-partition timeout (default: the world's RPC timeout; ``None``: forever).
        compression: ``None``, ``"bf16"`` or ``"fp16"``.
        progress: Draw a progress bar of finished partitions (see :func:`remote_async_call`).

    Returns:
        The (reduced) result.

    Raises:
        TimeoutError: A partition did not finish in time.
        RemoteError: A partition failed and its exception type could not be rebuilt (otherwise
            the remote exception's own type is raised).

    Example:
        >>> import torch
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     return remote_sync_call(torch.sum, args=(torch.ones(3),), partitioner=0)
        >>> main()
        [tensor(3.)]
    """
    # Waiting on the partitions directly is cheaper than chaining futures.
    call = _start(
        func, args, kwargs, partitioner, reducer, timeout, compression, progress, sync=True
    )
    return call.collect()


def parallelize_async(
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
    progress: bool = False,
) -> Callable[[Callable[P, Any]], Callable[P, Future[Any]]]:
    """Decorate a module-level function so that calling it runs a :func:`remote_async_call`.

    The decorated function returns a future. Workers run the undecorated function (the wrapper
    keeps it as ``__wrapped__``), so decorating a function defined at the top level of a
    torchrun script works.

    Args:
        partitioner: As for :func:`remote_async_call`.
        reducer: As for :func:`remote_async_call`.
        timeout: As for :func:`remote_async_call`.
        compression: As for :func:`remote_async_call`.
        progress: As for :func:`remote_async_call`.

    Returns:
        A decorator.

    Raises:
        TypeError: (when decorating) a lambda or local function, or bad arguments.

    Example:
        >>> import torch
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     square = parallelize_async(partitioner=0)(torch.square)
        ...     return square(torch.tensor(3.0)).wait()
        >>> main()
        [tensor(9.)]
    """
    return _parallelizer(partitioner, reducer, timeout, compression, progress, sync=False)


def parallelize_sync(
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
    progress: bool = False,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """Decorate a module-level function so that calling it runs a :func:`remote_sync_call`.

    Args:
        partitioner: As for :func:`remote_async_call`.
        reducer: As for :func:`remote_async_call`.
        timeout: As for :func:`remote_async_call`.
        compression: As for :func:`remote_async_call`.
        progress: As for :func:`remote_async_call`.

    Returns:
        A decorator; the decorated function returns the (reduced) result.

    Raises:
        TypeError: (when decorating) a lambda or local function, or bad arguments.

    Example:
        >>> import torch
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     total = parallelize_sync(reducer=metadist.sum_reducer)(torch.sum)
        ...     return total(torch.arange(6.0))
        >>> main()
        tensor(15.)
    """
    return _parallelizer(partitioner, reducer, timeout, compression, progress, sync=True)


def _parallelizer(
    partitioner: Partitioner | None,
    reducer: Reducer | None,
    timeout: float | None,
    compression: str | None,
    progress: bool,
    *,
    sync: bool,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    # Check everything at decoration time, so that a bad decorator fails at import.
    _check_partitioner(partitioner)
    _check_reducer(reducer)
    _resolve_timeout(timeout)
    transport.resolve_compression(compression)
    options = (partitioner, reducer, timeout, compression, progress)

    def decorator(func: Callable[P, Any]) -> Callable[P, Any]:
        if not callable(func):
            raise TypeError(f"parallelize decorates a function, got {func!r}")
        _check_definition(func)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            # The wrapper is what pickles by name; workers run _ORIGINAL (see run_partition).
            call = _start(wrapper, args, kwargs, *options, sync=sync)
            return call.collect() if sync else call.future()

        setattr(wrapper, _ORIGINAL, func)
        return wrapper

    return decorator


#: ``parallelize`` is :func:`parallelize_sync` (TorchOpt's name for it).
parallelize = parallelize_sync
