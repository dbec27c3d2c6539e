"""Remote calls: map a function over workers, reduce the results, differentiably.

``remote_async_call(func, args=..., partitioner=..., reducer=...)`` splits the arguments with the
partitioner, runs ``func`` on each partition's worker over RPC, and reduces the per-partition
results on the caller. Inside :func:`metadist.autograd.context` the whole computation is
differentiable, including ``nn.Module`` arguments (see :mod:`metadist.transport`).
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from metadist import transport, world
from metadist.errors import RemoteError
from metadist.partition import batch_partitioner
from metadist.reduce import PartitionResults
from metadist.world import get_worker_id, get_worker_names, require_rpc

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

#: ``timeout`` default: the running world's RPC timeout (``rpc_backend_options.rpc_timeout``,
#: 60 s unless configured), per partition.
DEFAULT_TIMEOUT: float = -1.0

#: A worker rank, a worker name, or ``partitioner(*args, **kwargs) -> [(worker, args, kwargs)]``.
Partitioner = int | str | Callable[..., Sequence[tuple[int | str, Sequence[Any], dict[str, Any]]]]
#: ``reducer(results) -> value`` over the per-partition results in partition order.
Reducer = Callable[[list[Any]], Any]

_ORIGINAL = "__metadist_original__"

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
        module = sys.modules.get(func.__module__)
        found: Any = module
        for part in func.__qualname__.split("."):
            found = getattr(found, part, None)
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
# Worker side


class _RemoteFailure:
    """An exception raised on a worker, in a form that always unpickles on the caller."""

    __slots__ = ("message", "stage", "trace", "type_module", "type_qualname", "worker")

    def __init__(  # noqa: PLR0917 - rebuilt positionally by __reduce__
        self,
        type_module: str,
        type_qualname: str,
        message: str,
        trace: str,
        worker: str,
        stage: str,
    ) -> None:
        self.type_module = type_module
        self.type_qualname = type_qualname
        self.message = message
        self.trace = trace
        self.worker = worker
        self.stage = stage

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _RemoteFailure,
            (
                self.type_module,
                self.type_qualname,
                self.message,
                self.trace,
                self.worker,
                self.stage,
            ),
        )

    def to_exception(self, index: int, count: int, func_name: str) -> BaseException:
        type_name = f"{self.type_module}.{self.type_qualname}"
        message = (
            f"{self.message}\n\n[metadist] {func_name}() raised {type_name} on worker "
            f"{self.worker!r} (partition {index} of {count}). Remote traceback:\n{self.trace}"
        )
        exc: BaseException | None = None
        exc_type: Any = sys.modules.get(self.type_module)
        for part in self.type_qualname.split("."):
            exc_type = getattr(exc_type, part, None)
        if isinstance(exc_type, type) and issubclass(exc_type, Exception):
            try:
                exc = exc_type(message)
            except Exception:
                exc = None
        if exc is None:
            exc = RemoteError(message)
        exc.worker_name = self.worker  # type: ignore[attr-defined]
        exc.partition_index = index  # type: ignore[attr-defined]
        exc.remote_type = type_name  # type: ignore[attr-defined]
        exc.remote_traceback = self.trace  # type: ignore[attr-defined]
        return exc


def _failure(error: Exception, stage: str) -> _RemoteFailure:
    try:
        worker = rpc.get_worker_info().name
    except Exception:
        worker = "?"
    return _RemoteFailure(
        type(error).__module__,
        type(error).__qualname__,
        str(error),
        "".join(traceback.format_exception(error)),
        worker,
        stage,
    )


def _run_partition(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    needs_decode: bool,
    compression: torch.dtype | None,
) -> Any:
    """Run one partition on this worker (the RPC target of every remote call)."""
    try:
        if needs_decode:
            args, kwargs = transport.decode(args, kwargs)
    except Exception as error:
        return _failure(error, "decode")
    try:
        result = getattr(func, _ORIGINAL, func)(*args, **kwargs)
        if compression is not None:
            result = transport.compress_tree(result, compression)
    except Exception as error:
        return _failure(error, "call")
    return result


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
) -> tuple[list[tuple[str, tuple[Any, ...], dict[str, Any]]], tuple[int, ...] | None]:
    _check_partitioner(partitioner)
    if partitioner is None:
        partitioner = batch_partitioner
    if not callable(partitioner):
        try:
            worker_id = get_worker_id(partitioner)
        except (TypeError, ValueError) as error:
            raise type(error)(f"partitioner={partitioner!r}: {error}") from None
        return [(names[worker_id], args, kwargs)], None
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
    if sizes is not None:
        # Wrong sizes would silently skew a weighted mean: refuse them before sending.
        try:
            sizes = PartitionResults([None] * len(parts), sizes).sizes
        except (TypeError, ValueError) as error:
            message = str(error).replace("PartitionResults: sizes", "Partitions.sizes")
            raise type(error)(
                f"partitioner {name} returned {len(parts)} partitions: {message}"
            ) from None
    return parts, sizes


def _rpc_error(
    error: BaseException, index: int, count: int, worker: str, timeout: float
) -> BaseException:
    text = str(error)
    if "timed out" in text.lower() or "timeout" in text.lower():
        if timeout == rpc.constants.UNSET_RPC_TIMEOUT:
            timeout = rpc.get_rpc_timeout()  # type: ignore[attr-defined]
        return TimeoutError(
            f"partition {index} of {count} on worker {worker!r} did not finish within the "
            f"timeout of {timeout} s: {text}"
        )
    return RemoteError(
        f"partition {index} of {count} on worker {worker!r} failed in RPC: "
        f"{type(error).__name__}: {text}",
        worker_name=worker,
        partition_index=index,
        remote_type=f"{type(error).__module__}.{type(error).__qualname__}",
    )


class _Call:
    """The partitions of one remote call in flight, and how to turn them into its result."""

    __slots__ = (
        "carried",
        "compression",
        "context_id",
        "differentiable",
        "func_name",
        "futures",
        "grad_enabled",
        "reducer",
        "sizes",
        "timeout",
        "workers",
        "world_token",
    )

    def __init__(  # noqa: PLR0917 - internal, called once per remote call
        self,
        futures: list[Future[Any]],
        workers: list[str],
        carried: list[tuple[str, ...]],
        sizes: tuple[int, ...] | None,
        reducer: Callable[[Any], Any] | None,
        compression: torch.dtype | None,
        func_name: str,
        timeout: float,
        world_token: object,
        differentiable: list[bool],
    ) -> None:
        self.futures = futures
        self.workers = workers
        self.carried = carried
        self.sizes = sizes
        self.reducer = reducer
        self.compression = compression
        self.func_name = func_name
        self.timeout = timeout
        self.world_token = world_token
        self.differentiable = differentiable
        self.context_id = transport.current_context()
        self.grad_enabled = torch.is_grad_enabled()

    def collect(self) -> Any:
        """Wait for *every* partition (none is left pending), then reduce or raise."""
        values: list[Any] = []
        errors: list[BaseException] = []
        nodes: list[Any] = []
        dangling: list[str] = []
        count = len(self.futures)
        world._wait_done(self.futures)
        for index, future in enumerate(self.futures):
            worker = self.workers[index]
            try:
                value = future.wait()
            except Exception as error:
                errors.append(_rpc_error(error, index, count, worker, self.timeout))
                continue
            if isinstance(value, _RemoteFailure):
                if value.stage != "decode":
                    transport.mark_structure_confirmed(
                        self.world_token, worker, self.carried[index]
                    )
                errors.append(value.to_exception(index, count, self.func_name))
                continue
            if self.carried[index]:
                transport.mark_structure_confirmed(self.world_token, worker, self.carried[index])
            if self.context_id is not None:
                found = list(transport._grad_nodes(value))
                if (
                    not found
                    and self.differentiable[index]
                    and transport._surely_not_differentiable(value)
                ):
                    dangling.append(f"{self.func_name} (partition {index} on {worker!r})")
                nodes.extend(found)
            values.append(value)
        if self.context_id is not None:
            transport._record_received(self.context_id, nodes, dangling)
        if errors:
            first = errors[0]
            if len(errors) > 1:
                others = ", ".join(
                    f"partition {getattr(e, 'partition_index', '?')} ({type(e).__name__})"
                    for e in errors[1:]
                )
                first.add_note(f"[metadist] {len(errors) - 1} more partition(s) failed: {others}")
            raise first
        if self.compression is not None:
            values = [transport.decompress_tree(v) for v in values]
        if self.reducer is None:
            return values
        with torch.set_grad_enabled(self.grad_enabled):
            return self.reducer(PartitionResults(values, self.sizes))

    def future(self) -> Future[Any]:
        """A future completed (by the last partition's callback) with :meth:`collect`."""
        result: Future[Any] = Future()
        remaining = [len(self.futures)]
        lock = threading.Lock()

        def on_done(_: Future[Any]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                try:
                    value = self.collect()
                except BaseException as error:
                    result.set_exception(error)
                else:
                    result.set_result(value)

        for future in self.futures:
            future.add_done_callback(on_done)
        return result


def _start(  # noqa: PLR0917 - internal; mirrors the public signature
    func: Callable[..., Any],
    args: Sequence[Any] | None,
    kwargs: dict[str, Any] | None,
    partitioner: Partitioner | None,
    reducer: Reducer | None,
    timeout: float | None,
    compression: str | None,
    api: str = "metadist.remote_async_call",
) -> _Call:
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
    rpc_timeout = _resolve_timeout(timeout)
    dtype = transport.resolve_compression(compression)
    names = get_worker_names()
    parts, sizes = _partitions(partitioner, tuple(args), kwargs, names)

    # Encode every partition before sending anything, so that bad input fails with no RPC sent.
    world_token = world.world_token()
    # RPC attaches these partitions to the distributed autograd context: their results must
    # come back differentiable, or no backward pass in the context can finish (checked there).
    in_context = transport.current_context() is not None
    differentiable = [in_context and transport.sends_grad(a, k) for _, a, k in parts]
    memo = transport.CallMemo()
    encoded = [
        transport.encode(p_args, p_kwargs, world=world_token, worker=name, dtype=dtype, memo=memo)
        for name, p_args, p_kwargs in parts
    ]
    futures: list[Future[Any]] = []
    for (name, _, _), (e_args, e_kwargs, needs_decode, _) in zip(parts, encoded, strict=True):
        try:
            future = rpc.rpc_async(
                name,
                _run_partition,
                args=(sendable, e_args, e_kwargs, needs_decode, dtype),
                timeout=rpc_timeout,
            )
        except Exception as error:
            future = Future()
            future.set_exception(error)
        futures.append(future)
    return _Call(
        futures,
        [name for name, _, _ in parts],
        [carried for *_, carried in encoded],
        sizes,
        reducer,
        dtype,
        getattr(func, "__qualname__", None) or type(func).__name__,
        rpc_timeout,
        world_token,
        differentiable,
    )


def remote_async_call(
    func: Callable[..., Any],
    *,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
) -> Future[Any]:
    """Run ``func`` on workers over RPC, map/reduce style, and return a future of the result.

    The partitioner splits ``args``/``kwargs`` into ``(worker, args, kwargs)`` partitions, each
    partition runs ``func(*args, **kwargs)`` on its worker, and ``reducer`` combines the results
    in partition order. ``nn.Module`` and ``nn.Parameter`` arguments stay differentiable inside
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
    return _start(func, args, kwargs, partitioner, reducer, timeout, compression).future()


def remote_sync_call(
    func: Callable[..., Any],
    *,
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
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
    return _start(
        func, args, kwargs, partitioner, reducer, timeout, compression, "metadist.remote_sync_call"
    ).collect()


def parallelize_async(
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
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
    return _parallelizer(partitioner, reducer, timeout, compression, sync=False)


def parallelize_sync(
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """Decorate a module-level function so that calling it runs a :func:`remote_sync_call`.

    Args:
        partitioner: As for :func:`remote_async_call`.
        reducer: As for :func:`remote_async_call`.
        timeout: As for :func:`remote_async_call`.
        compression: As for :func:`remote_async_call`.

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
    return _parallelizer(partitioner, reducer, timeout, compression, sync=True)


def _parallelizer(
    partitioner: Partitioner | None,
    reducer: Reducer | None,
    timeout: float | None,
    compression: str | None,
    *,
    sync: bool,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    # Check everything at decoration time, so that a bad decorator fails at import.
    _check_partitioner(partitioner)
    _check_reducer(reducer)
    _resolve_timeout(timeout)
    transport.resolve_compression(compression)

    def decorator(func: Callable[P, Any]) -> Callable[P, Any]:
        if not callable(func):
            raise TypeError(f"parallelize decorates a function, got {func!r}")
        _check_definition(func)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            # The wrapper is what pickles by name; workers run _ORIGINAL (see _run_partition).
            call = _start(wrapper, args, kwargs, partitioner, reducer, timeout, compression)
            return call.collect() if sync else call.future()

        setattr(wrapper, _ORIGINAL, func)
        return wrapper

    return decorator


def parallelize(
    partitioner: Partitioner | None = None,
    reducer: Reducer | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    compression: str | None = None,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """Alias of :func:`parallelize_sync` (as in TorchOpt).

    Args:
        partitioner: As for :func:`remote_async_call`.
        reducer: As for :func:`remote_async_call`.
        timeout: As for :func:`remote_async_call`.
        compression: As for :func:`remote_async_call`.

    Returns:
        A decorator; the decorated function returns the (reduced) result.

    Example:
        >>> import metadist
        >>> @parallelize(partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer)
        ... def loss(x):  # in a real job: at module level, so workers can import it
        ...     return x.mean()
    """
    return parallelize_sync(partitioner, reducer, timeout, compression)
