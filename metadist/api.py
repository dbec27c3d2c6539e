"""Remote calls: map a function over workers, reduce the results, differentiably.

``remote_async_call(func, args=..., partitioner=..., reducer=...)`` splits the arguments with the
partitioner, runs ``func`` on each partition's worker over RPC, and reduces the per-partition
results on the caller. The call is differentiable like a local function, ``nn.Module``
arguments included: the path reads caller (here) → partition (:mod:`metadist.partition`) →
send (:mod:`metadist.transport`) → worker (:mod:`metadist.worker`) → result
(:mod:`metadist.reduce`) → backward request (:mod:`metadist.link`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import pickle
import queue
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import PyRRef  # type: ignore[attr-defined]
from torch.futures import Future

from metadist import link, structure, timeline, transport, world
from metadist import worker as remote_worker
from metadist._pytree import tree_flatten
from metadist.errors import (
    RemoteError,
    RemoteFailure,
    is_connection_lost,
    is_timeout,
    qualified_name,
    resolve_qualified_name,
    worker_gone,
)
from metadist.messages import CallerState, Reply, Request
from metadist.partition import DimPartitioner, batch_partitioner
from metadist.reduce import PartitionResults, check_sizes
from metadist.world import (
    DEFAULT_TIMEOUT,
    check_timeout,
    get_worker_id,
    get_worker_name,
    get_worker_names,
    require_rpc,
    resolve_timeout,
)

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


#: A worker rank, a worker name, or ``partitioner(*args, **kwargs) -> [(worker, args, kwargs)]``.
Partitioner = int | str | Callable[..., Sequence[tuple[int | str, Sequence[Any], dict[str, Any]]]]
#: ``reducer(results) -> value`` over the per-partition results in partition order.
Reducer = Callable[[list[Any]], Any]

_ORIGINAL = remote_worker.ORIGINAL
# The object to pickle for each ``func``, checked once per function.
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
        unwrapped = getattr(found, _ORIGINAL, None)
        if unwrapped is not None and (unwrapped is func or unwrapped is original):
            # The name holds our wrapper, or a decorator's wrapper of it (functools.wraps copies
            # the attribute): send it, the worker unwraps it.
            return found
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
        why = f"pickling failed with {type(error).__name__}: {error}"
        raise _not_sendable(func, why) from error
    return func


def _sendable(func: Any) -> Any:
    with contextlib.suppress(KeyError, TypeError):
        return _SENDABLE[func]
    sendable = _resolve_sendable(func)
    with contextlib.suppress(TypeError):  # not weak-referenceable: checked on every call
        _SENDABLE[func] = sendable
    return sendable


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
    """The partitions as ``(worker name, args, kwargs)``, their sizes and their schedule."""
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
    if partitioner is batch_partitioner or isinstance(partitioner, DimPartitioner):
        # metadist's own: worker ids, argument containers and sizes checked where it made them
        return [(names[w], a, k) for w, a, k in raw], raw.sizes, raw.schedule
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
        what = f"partitioner {name} returned {len(parts)} partitions: Partitions.sizes"
        sizes = check_sizes(sizes, len(parts), what, "partition")
    return parts, sizes, getattr(raw, "schedule", "static")


def _rpc_error(
    error: BaseException, index: int, count: int, worker: str, timeout: float
) -> BaseException:
    text = str(error)
    if is_timeout(error):
        late = TimeoutError(
            f"partition {index} of {count} on worker {worker!r} did not finish within the "
            f"timeout of {timeout} s: {text}"
        )
        late.worker_name, late.partition_index = worker, index  # type: ignore[attr-defined]
        return late
    message = f"partition {index} of {count} on worker {worker!r} failed in RPC: "
    if is_connection_lost(error):
        # torch says only "EOF: end of file" (or EPIPE, ...): say that the worker is gone.
        gone = worker_gone(worker, world.rank_of(worker))
        message = f"partition {index} of {count} failed: {gone}. torch's RPC error: "
    return RemoteError(
        f"{message}{type(error).__name__}: {text}",
        worker_name=worker,
        partition_index=index,
        remote_type=qualified_name(type(error)),
    )


#: Partitions a synchronous call keeps in flight on each remote worker; the others wait on the
#: caller until one finishes. Two keep a worker busy while the caller hands it the next one,
#: and bound how many RPC threads one call can hold on a worker, so that nested calls of any
#: width find a free thread.
IN_FLIGHT_PER_WORKER = 2


class _Telemetry:
    """The call's partitions in the active timeline (:mod:`metadist.timeline`)."""

    def __init__(self, log: timeline.Timeline, func_name: str) -> None:
        self.log = log
        self.func_name = func_name
        self.number = log.new_call()
        self.records: dict[int, timeline.PartitionRecord] = {}

    def sent(self, index: int, worker: str, bytes_out: int) -> None:
        self.records[index] = self.log.add(
            timeline.PartitionRecord(
                self.number, self.func_name, index, worker, timeline.now(), bytes_out=bytes_out
            )
        )

    def done(self, index: int, _: Future[Any]) -> None:
        self.records[index].done = timeline.now()

    def ran_here(self, index: int, result: Any) -> None:
        record = self.records[index]
        record.start = record.sent
        record.end = record.done = timeline.now()
        if result is not None:
            record.bytes_in = transport.wire_bytes(result)

    def replied(self, index: int, reply: Reply) -> None:
        record = self.records[index]
        record.start, record.end = reply.start, reply.end
        record.bytes_in = transport.wire_bytes(reply.value)


class _Schedule:
    """Which partition runs where, and when.

    Partitions wait in a queue per worker (a dynamic schedule has one shared queue, keyed "");
    at most ``bound`` are in flight on each remote worker, and each one that finishes frees a
    slot: from the RPC thread that saw it finish, so that the worker goes on while the caller
    computes partitions of its own. The caller's own partitions run on the calling thread.
    """

    def __init__(self, call: _Call, dynamic: bool, bound: int) -> None:
        self.call = call
        self.dynamic = dynamic
        self.bound = bound
        self.queues: dict[str, collections.deque[int]] = {}
        self.in_flight: dict[str, int] = {}
        self.lock = threading.RLock()  # RPC threads update the queues and in_flight too
        self.wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()

    def arrived(self, index: int) -> None:
        """Partition ``index`` finished (on an RPC thread, or here if it failed at once)."""
        with self.lock:
            self.in_flight[self.call.workers[index]] -= 1
            self.fill(self.call.workers[index])
        self.wakeups.put(None)

    def _next_for(self, worker: str) -> int | None:
        pending = self.queues.get("" if self.dynamic else worker)
        return pending.popleft() if pending else None

    def fill(self, worker: str) -> None:
        """Send ``worker`` its next partitions, up to ``bound`` in flight."""
        with self.lock:
            while self.in_flight.get(worker, 0) < self.bound:
                index = self._next_for(worker)
                if index is None:
                    return
                self.in_flight[worker] = self.in_flight.get(worker, 0) + 1
                self.call.send(index, worker)

    def drive(self, parts: list[str]) -> None:
        """Send and run every partition; return when none is left to start or in flight."""
        own = self.call.own
        for i, name in enumerate(parts):
            self.queues.setdefault("" if self.dynamic else name, collections.deque()).append(i)
        remote = [w for w in dict.fromkeys(parts) if w != own]
        for worker in remote:
            self.fill(worker)
        while True:
            if own in parts:
                with self.lock:
                    index = self._next_for(own)
                if index is not None:
                    self.call.run_here(index)
                    continue
            with self.lock:
                if not any(self.in_flight.values()):
                    return
            self._wait()

    def _wait(self) -> None:
        """Block until a partition in flight finishes; never forever unless asked to."""
        limit = self.call.timeout  # 0: timeout=None, the user asked to wait as long as it takes
        try:
            # torch reports a timed-out partition itself; the margin covers its timer.
            self.wakeups.get(timeout=None if limit == 0 else limit + 5.0)
        except queue.Empty:
            busy = sorted(w for w, n in self.in_flight.items() if n)
            raise TimeoutError(
                f"{self.call.func_name}(): partitions on {', '.join(map(repr, busy))} did not "
                f"finish within the timeout of {limit} s and RPC did not report them: every RPC "
                f"thread of those workers is probably blocked in a nested synchronous call. "
                f"Raise the thread pool (rpc_backend_options.num_worker_threads, 16 by "
                f"default), or make fewer nested calls at a time"
            ) from None


@dataclasses.dataclass(eq=False, repr=False)
class _Call:
    """The partitions of one remote call, and how to turn them into its result: those whose
    worker is the caller run in-process, on the calling thread (``local`` holds their outcomes),
    the others are RPC futures, their gradients linked by :class:`metadist.link.Link`."""

    func: Any
    func_name: str
    parts: list[tuple[str, tuple[Any, ...], dict[str, Any]]]
    own: str
    reducer: Reducer | None
    sizes: tuple[int, ...] | None
    compression: torch.dtype | None
    timeout: float

    def __post_init__(self) -> None:
        count = len(self.parts)
        self.workers = [name for name, _, _ in self.parts]  # where each ran (dynamic: decided late)
        self.futures: list[Future[Any] | None] = [None] * count
        self.local: dict[int, tuple[bool, Any]] = {}
        self.requests: dict[int, Request] = {}
        self.new_structures: list[tuple[str, ...]] = [()] * count
        # Set by _encode: only remote partitions need them (a call run here reduces here).
        self.state: CallerState | None = None
        self.in_context = False
        self.world_token: object = None
        self.link: link.Link | None = None
        self.bar: Any = None
        # Run as each sent partition finishes, with its index and future.
        self.callbacks: list[Callable[[int, Future[Any]], None]] = []
        self.lost: list[tuple[str, int]] = []  # partitions whose RPC failed: (worker, index)
        log = timeline.active()
        self.telemetry = _Telemetry(log, self.func_name) if log is not None else None
        if self.telemetry is not None:
            self.callbacks.append(self.telemetry.done)

    def send(self, index: int, worker: str) -> None:
        """Send partition ``index`` to ``worker`` (encoded already)."""
        self.workers[index] = worker
        request = self.requests.pop(index)
        request = request._replace(release=link.released(self.world_token, worker))
        if self.telemetry is not None:
            bytes_out = transport.wire_bytes([request.args, request.kwargs])
            self.telemetry.sent(index, worker, bytes_out)
        try:
            future = rpc.rpc_async(
                worker, remote_worker.run_partition, args=(request,), timeout=self.timeout
            )
        except Exception as error:
            future = Future()
            future.set_exception(error)
        self.futures[index] = future
        for done in self.callbacks:
            future.add_done_callback(functools.partial(done, index))

    def run_here(self, index: int) -> None:
        """Run partition ``index`` in-process, as its worker would (errors included)."""
        if self.link is not None and torch.is_grad_enabled():
            # After the first sends (the workers need not wait for it), before the caller's
            # own partitions: see metadist.link.
            self.link.start()
        self.workers[index] = self.own
        _, args, kwargs = self.parts[index]
        if self.telemetry is not None:
            self.telemetry.sent(index, self.own, 0)
        result = None
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
        if self.telemetry is not None:
            self.telemetry.ran_here(index, result)

    def _outcome(self, index: int) -> tuple[bool, Any]:
        """``(True, value)`` of one partition, or ``(False, exception to raise)``."""
        if index in self.local:
            return self.local[index]
        future = self.futures[index]
        assert future is not None
        worker = self.workers[index]
        try:
            reply = future.wait()
        except Exception as error:
            self.lost.append((worker, index))  # it may still finish, and keep its graph
            return False, _rpc_error(error, index, len(self.workers), worker, self.timeout)
        failed = isinstance(reply, RemoteFailure)
        if not failed or reply.stage != "decode":  # the worker cached the structures it got
            structure.mark_structure_confirmed(self.world_token, worker, self.new_structures[index])
        if failed:
            return False, reply.to_exception(index, len(self.workers), self.func_name)
        if self.telemetry is not None:
            self.telemetry.replied(index, reply)
        if self.link is not None:
            record = None if self.telemetry is None else self.telemetry.records[index]
            return True, self.link.receive(index, worker, reply, record)
        return True, link.result_of(reply)

    def collect(self) -> Any:
        """Wait for *every* partition (none is left pending), then reduce or raise."""
        world.wait_all([f for f in self.futures if f is not None])
        if self.bar is not None:
            self.bar.close()
        outcomes = [self._outcome(i) for i in range(len(self.workers))]
        gradients, self.link = self.link, None  # the call's graph is the result's, not the call's
        errors = [value for ok, value in outcomes if not ok]
        if errors:
            if gradients is not None:
                gradients.abandon(self.lost)
            first = errors[0]
            if len(errors) > 1:
                others = ", ".join(
                    f"partition {getattr(e, 'partition_index', '?')} ({type(e).__name__})"
                    for e in errors[1:]
                )
                first.add_note(f"[metadist] {len(errors) - 1} more partition(s) failed: {others}")
            del outcomes  # the raised error's traceback must not hold the results
            raise first
        values = [value for _, value in outcomes]
        if gradients is not None:
            try:
                values = gradients.finish(values)
            except BaseException:
                gradients.abandon(())
                raise
        if self.reducer is None:
            return values
        results = PartitionResults(values)
        results.sizes = self.sizes  # checked once, by _partitions
        if self.state is None or CallerState.here() == self.state:  # the caller's thread
            return self._reduce(results)
        with contextlib.ExitStack() as stack:  # an RPC thread, for an asynchronous call
            self.state.enter(stack)
            return self._reduce(results)

    def _reduce(self, results: PartitionResults) -> Any:
        """The reducer's value. The reduction stands for the function's own (its mean over the
        whole batch in one process): results it made differentiable under
        ``torch.enable_grad()`` stay so under the caller's ``torch.no_grad()``."""
        assert self.reducer is not None
        if torch.is_grad_enabled():
            return self.reducer(results)
        with torch.enable_grad():
            return self.reducer(results)


def _encode(call: _Call, remote: list[int], dynamic: bool, copy: bool) -> None:
    """Encode every partition that may travel before sending anything (bad input fails with no
    RPC sent), noting their arguments that require grad in the call's gradient link; ``copy``
    their tensors (an asynchronous call: see :func:`metadist.transport.snapshot`)."""
    call.world_token = world.world_token()
    call.state = state = CallerState.here()
    call.in_context = remote_worker.current_context_id() is not None
    leaves, _ = tree_flatten([call.parts[i][1:] for i in remote])
    holds_rref = any(isinstance(leaf, PyRRef) for leaf in leaves)  # what rpc.remote returns
    if holds_rref:  # torch's RRef bookkeeping ends with a process's first world
        world.check_rref_world(f"metadist's call of {call.func_name}")
    # Only a call that hands RRefs to a partition inside a context needs torch's engine.
    attached = call.in_context and holds_rref
    gradients = link.Link(
        call.world_token, call.compression, get_worker_id(call.own) << 40, call.timeout
    )
    memo = transport.CallMemo()
    copies: dict[Any, Any] = {}
    for i in remote:
        name, p_args, p_kwargs = call.parts[i]
        e_args, e_kwargs, decode, call.new_structures[i], sources = transport.encode(
            p_args,
            p_kwargs,
            world=call.world_token,
            worker="" if dynamic else name,  # unknown yet: structures travel along
            dtype=call.compression,
            memo=memo,
            attached=attached,
        )
        if copy and not attached:  # attached, distributed autograd must record the originals
            e_args = transport.snapshot(e_args, copies)
            e_kwargs = transport.snapshot(e_kwargs, copies)
        call.requests[i] = Request(
            func=call.func,
            args=e_args,
            kwargs=e_kwargs,
            decode=decode,
            compression=call.compression,
            state=state,
            graph=None if attached else gradients.add(i, sources),
            attached=attached,
            in_context=call.in_context,
            timed=call.telemetry is not None,
            release=(),
        )
    if gradients.sources:
        call.link = gradients


def _future(call: _Call) -> Future[Any]:
    """A future completed (by the last partition's callback) with ``call.collect()``."""
    result: Future[Any] = Future()

    def finish(_: Future[Any]) -> None:
        try:
            value = call.collect()
        except BaseException as error:
            result.set_exception(error)
        else:
            result.set_result(value)

    # collect_all completes once every future has, failed ones included (at once if none).
    torch.futures.collect_all([f for f in call.futures if f is not None]).add_done_callback(finish)
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
    api = "metadist.remote_sync_call" if sync else "metadist.remote_async_call"
    require_rpc(api)
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
    rpc_timeout = resolve_timeout(timeout, api)
    dtype = transport.resolve_compression(compression)
    parts, sizes, schedule = _partitions(partitioner, tuple(args), kwargs, get_worker_names())
    own = get_worker_name()
    name = getattr(func, "__qualname__", None) or type(func).__name__
    call = _Call(sendable, name, parts, own, reducer, sizes, dtype, rpc_timeout)
    if progress:
        bar = call.bar = _progress_bar(name, len(parts))
        call.callbacks.append(lambda _, __: bar.update())
    # A dynamic schedule decides the workers as they free up (synchronous calls only).
    dynamic = sync and schedule == "dynamic" and len(parts) > 1
    remote = [i for i, (name, _, _) in enumerate(parts) if dynamic or name != own]
    if remote:
        _encode(call, remote, dynamic, copy=not sync)
    for i, (_, p_args, p_kwargs) in enumerate(parts):
        if i not in call.requests:  # runs in-process: the same checks as if it were sent
            transport.check_sendable(p_args, p_kwargs)
    attached = any(r.attached for r in call.requests.values())
    if remote and sync and not attached:
        # A dynamic schedule hands slots out from the RPC thread the moment a partition
        # finishes, so a second one in flight hides no latency: it only commits a task to a
        # worker that may be busy with a long one (8,1,1,1,8,1,1,1 inner steps: 1.40x faster
        # than static with one in flight, 1.25x with two; bench_schedule.py --costs).
        plan = _Schedule(call, dynamic, 1 if dynamic else IN_FLIGHT_PER_WORKER)
        call.callbacks.append(lambda index, _: plan.arrived(index))
        plan.drive([n for n, _, _ in parts])
        call.callbacks.pop()  # no reference cycle: the call's graph must not wait for the GC
        return call
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
    return _future(call)


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
    check_timeout(timeout, "metadist.parallelize")
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
            return call.collect() if sync else _future(call)

        setattr(wrapper, _ORIGINAL, func)
        return wrapper

    return decorator


#: ``parallelize`` is :func:`parallelize_sync` (TorchOpt's name for it).
parallelize = parallelize_sync
