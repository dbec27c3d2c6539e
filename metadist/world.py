"""The world: who this worker is, who the others are, and how to wait for them.

World information is read from the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``) each time it is asked for, never cached at import. Once
:func:`metadist.auto_init_rpc` has started RPC, the running world (ranks and the worker-name
table gathered from every worker) is the source of truth.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch.distributed.rpc as rpc
from torch.futures import Future

__all__ = [
    "WorldInfo",
    "barrier",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_worker_id",
    "get_worker_name",
    "get_worker_names",
    "get_world_info",
    "get_world_rank",
    "get_world_size",
    "not_on_rank",
    "on_rank",
    "rank_non_zero_only",
    "rank_zero_only",
    "require_rpc",
    "world_token",
]

P = ParamSpec("P")
R = TypeVar("R")

_NOT_INITIALIZED = (
    "{api} needs metadist's RPC world, which is not running in this process. Decorate the entry "
    "function with @metadist.auto_init_rpc() (it starts RPC from the torchrun environment, or a "
    "world of 1 under plain `python script.py`) and call {api} inside it."
)


@dataclass(frozen=True)
class WorldInfo:
    """Ranks and sizes of this worker.

    Attributes:
        world_rank: Global rank of this worker, in ``[0, world_size)``.
        world_size: Number of workers in the job.
        local_rank: Rank of this worker on its node, in ``[0, local_world_size)``.
        local_world_size: Number of workers on this node.

    Example:
        >>> info = WorldInfo(world_rank=1, world_size=4, local_rank=1, local_world_size=2)
        >>> info.rank, info.worker_name
        (1, 'worker1')
    """

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def rank(self) -> int:
        """Alias of :attr:`world_rank`."""
        return self.world_rank

    @property
    def worker_name(self) -> str:
        """The RPC name of this worker (the running world's, or the default format's)."""
        runtime = _RUNTIME
        if runtime is not None and runtime.info.world_rank == self.world_rank:
            return runtime.names[self.world_rank]
        return default_worker_name_format(
            world_rank=self.world_rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            local_world_size=self.local_world_size,
        )


def default_worker_name_format(
    world_rank: int, world_size: int, local_rank: int, local_world_size: int
) -> str:
    """Name workers ``worker0 … workerN-1``, zero-padded so name order equals rank order.

    Args:
        world_rank: Global rank of the worker.
        world_size: Number of workers.
        local_rank: Unused; part of the name-format signature.
        local_world_size: Unused; part of the name-format signature.

    Returns:
        The worker name, e.g. ``worker03`` for rank 3 of 12.

    Example:
        >>> default_worker_name_format(
        ...     world_rank=3, world_size=12, local_rank=0, local_world_size=1
        ... )
        'worker03'
    """
    del local_rank, local_world_size
    return f"worker{world_rank:0{len(str(world_size - 1))}d}"


# --------------------------------------------------------------------------------------------------
# Environment


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; torchrun sets it to one"
        ) from None


def _world_info_from_env() -> WorldInfo:
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    # A manual launch that sets only RANK/WORLD_SIZE is a single-node launch.
    local_world_size = _env_int(
        "LOCAL_WORLD_SIZE", world_size if "LOCAL_RANK" not in os.environ else 1
    )
    local_rank = _env_int("LOCAL_RANK", rank if local_world_size == world_size else 0)
    if world_size < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"environment variable RANK={rank} must be in [0, WORLD_SIZE={world_size})"
        )
    if local_world_size < 1:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE={local_world_size} must be >= 1")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"environment variable LOCAL_RANK={local_rank} must be in "
            f"[0, LOCAL_WORLD_SIZE={local_world_size})"
        )
    return WorldInfo(rank, world_size, local_rank, local_world_size)


# --------------------------------------------------------------------------------------------------
# The running world (set by metadist.launch while RPC is up)


class _Runtime:
    """What metadist knows about the running RPC world; lives from init to shutdown."""

    def __init__(self, info: WorldInfo, default_timeout: float) -> None:
        self.info = info
        self.default_timeout = default_timeout
        self.names: tuple[str, ...] = ()
        self.ids: dict[str, int] = {}
        self.lock = threading.Lock()
        self.generations: dict[tuple[str, ...], int] = {}


_RUNTIME: _Runtime | None = None


def _activate(info: WorldInfo, own_name: str, timeout: float) -> None:
    """Install the runtime and gather every worker's name (rank order). Called by launch."""
    global _RUNTIME
    runtime = _Runtime(info, timeout)
    _RUNTIME = runtime
    names = _rendezvous(
        ("<names>",), info.world_rank, own_name, timeout, expected=info.world_size, coordinator=0
    )
    ordered = tuple(str(names[rank]) for rank in range(info.world_size))
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"worker names must be unique, got {ordered}")
    runtime.names = ordered
    runtime.ids = {name: rank for rank, name in enumerate(ordered)}


def _deactivate() -> None:
    """Forget the runtime after shutdown. Called by launch."""
    global _RUNTIME
    _RUNTIME = None
    with _PENDING_LOCK:
        _PENDING.clear()


def _ping() -> bool:
    return True


def _wait_done(futures: Iterable[Future[Any]]) -> None:
    """Block until every future is done, in a wait that Ctrl-C can interrupt.

    torch's ``Future.wait`` blocks in C++, where the main thread never sees SIGINT, so a job
    stuck in a remote call would ignore Ctrl-C. ``SimpleQueue.get`` is interruptible, and its
    ``put`` is a C function that the future can call directly (cheaper than a Python callback).
    """
    pending = [future for future in futures if not future.done()]
    if not pending or threading.current_thread() is not threading.main_thread():
        # Only the main thread receives signals: elsewhere torch's own wait is cheaper. Errors
        # are for the caller to read from each future afterwards.
        for future in pending:
            with contextlib.suppress(Exception):
                future.wait()
        return
    arrivals: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for future in pending:
        future.add_done_callback(arrivals.put)
    for _ in pending:
        arrivals.get()


def _wait(future: Future[R]) -> R:
    """``future.wait()`` that Ctrl-C can interrupt (see :func:`_wait_done`)."""
    _wait_done((future,))
    return future.wait()


def _finish(poll: float = 2.0) -> list[str]:
    """Wait until every worker finished its job; return the names of workers found dead.

    torch's graceful shutdown waits forever for a worker that died. Here each worker announces
    that it is done to rank 0 and, while waiting for the others, pings the workers that have not
    finished: a peer whose connection is gone (killed, crashed) ends the wait. A peer that is
    alive but busy (a ping timing out) is waited for, since rank 0 may train for hours.
    """
    runtime = _runtime("metadist shutdown")
    info = runtime.info
    future = rpc.rpc_async(
        0, _arrive, args=(("<done>",), info.world_size, info.world_rank, None), timeout=0
    )
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    while not done.wait(poll):
        waiting_for = [
            rank
            for rank in range(info.world_size)
            if rank != info.world_rank and not (info.world_rank == 0 and _has_arrived(rank))
        ]
        dead = _unreachable(waiting_for, timeout=max(poll, 5.0))
        if dead:
            return dead
    future.wait()
    return []


def _unreachable(ranks: Iterable[int], timeout: float) -> list[str]:
    """Names of the workers among ``ranks`` whose connection is gone (a busy one is not)."""
    runtime = _runtime("metadist shutdown")
    gone = []
    for rank in ranks:
        try:
            rpc.rpc_sync(rank, _ping, timeout=timeout)
        except RuntimeError as error:
            if "timeout" not in str(error).lower():
                gone.append(runtime.names[rank])
    return gone


def _has_arrived(rank: int) -> bool:
    with _PENDING_LOCK:
        entry = _PENDING.get(("<done>",))
        return entry is not None and rank in entry[1]


def world_token() -> object:
    """An object that identifies the running world; a restarted world gets a new one.

    Caches whose entries must not outlive a world (e.g. which module structures a worker holds)
    key on it.

    Returns:
        The token.

    Raises:
        RuntimeError: RPC is not running.

    Example:
        >>> world_token()  # doctest: +SKIP
        <metadist.world._Runtime object at 0x...>
    """
    return _runtime("metadist.world.world_token")


def require_rpc(api_name: str) -> None:
    """Raise the standard error if metadist's RPC world is not running.

    Args:
        api_name: The public name the user called, for the message.

    Raises:
        RuntimeError: RPC was not started by :func:`metadist.auto_init_rpc`.

    Example:
        >>> require_rpc("metadist.barrier")  # doctest: +SKIP
    """
    _runtime(api_name)


def _runtime(api_name: str) -> _Runtime:
    runtime = _RUNTIME
    if runtime is None:
        raise RuntimeError(_NOT_INITIALIZED.format(api=api_name))
    return runtime


# --------------------------------------------------------------------------------------------------
# World information


def get_world_info() -> WorldInfo:
    """Return this worker's ranks and sizes.

    Inside :func:`metadist.auto_init_rpc` this is the running world; elsewhere it is read from the
    torchrun environment at call time (a plain process is rank 0 of a world of 1).

    Returns:
        A :class:`WorldInfo`.

    Raises:
        ValueError: A torchrun variable is malformed or out of range.

    Example:
        >>> info = get_world_info()
        >>> 0 <= info.world_rank < info.world_size
        True
    """
    runtime = _RUNTIME
    return runtime.info if runtime is not None else _world_info_from_env()


def get_world_rank() -> int:
    """Return the global rank of this worker (``get_rank`` is an alias).

    Returns:
        The rank, in ``[0, world_size)``; ``0`` outside torchrun.

    Example:
        >>> get_world_rank() >= 0
        True
    """
    return get_world_info().world_rank


get_rank = get_world_rank


def get_world_size() -> int:
    """Return the number of workers in the job.

    Returns:
        ``WORLD_SIZE`` of the running job; ``1`` outside torchrun.

    Example:
        >>> get_world_size() >= 1
        True
    """
    return get_world_info().world_size


def get_local_rank() -> int:
    """Return the rank of this worker on its node (e.g. to pick a GPU).

    Returns:
        The local rank, in ``[0, local_world_size)``.

    Example:
        >>> get_local_rank() >= 0
        True
    """
    return get_world_info().local_rank


def get_local_world_size() -> int:
    """Return the number of workers on this node.

    Returns:
        ``LOCAL_WORLD_SIZE`` of the running job; ``1`` outside torchrun.

    Example:
        >>> get_local_world_size() >= 1
        True
    """
    return get_world_info().local_world_size


def get_worker_names() -> tuple[str, ...]:
    """Return the names of all workers, indexed by rank.

    Returns:
        The worker names in rank order.

    Raises:
        RuntimeError: RPC is not running (see :func:`metadist.auto_init_rpc`).

    Example:
        >>> get_worker_names()  # doctest: +SKIP
        ('worker0', 'worker1')
    """
    return _runtime("metadist.get_worker_names").names


def get_worker_id(id: str | int | None = None) -> int:  # torchopt's signature
    """Return the rank of a worker given by rank, name, or ``None`` for this worker.

    Args:
        id: A rank (``int``), a worker name (``str``), or ``None`` for this worker.

    Returns:
        The worker's rank.

    Raises:
        ValueError: No such worker; the message lists the known workers.
        TypeError: ``id`` is neither ``int``, ``str`` nor ``None``.
        RuntimeError: A name was given but RPC is not running.

    Example:
        >>> get_worker_id()  # this worker
        0
        >>> get_worker_id("worker1")  # doctest: +SKIP
        1
    """
    if id is None:
        return get_world_rank()
    if isinstance(id, bool) or not isinstance(id, (int, str)):
        raise TypeError(
            f"worker id must be an int rank, a worker name (str) or None, got {id!r} "
            f"of type {type(id).__name__}"
        )
    if isinstance(id, int):
        world_size = get_world_size()
        if not 0 <= id < world_size:
            raise ValueError(f"unknown worker id {id}: {_known_workers(world_size)}")
        return id
    runtime = _runtime(f"metadist.get_worker_id({id!r})")
    try:
        return runtime.ids[id]
    except KeyError:
        raise ValueError(
            f"unknown worker name {id!r}: {_known_workers(len(runtime.names))}"
        ) from None


def get_worker_name(id: str | int | None = None) -> str:
    """Return the name of a worker given by rank, name, or ``None`` for this worker.

    Args:
        id: A rank, a worker name, or ``None`` for this worker.

    Returns:
        The worker's RPC name.

    Raises:
        ValueError: No such worker.
        RuntimeError: RPC is not running.

    Example:
        >>> get_worker_name(0)  # doctest: +SKIP
        'worker0'
    """
    rank = get_worker_id(id)
    return _runtime("metadist.get_worker_name").names[rank]


def _known_workers(world_size: int) -> str:
    runtime = _RUNTIME
    if runtime is not None and runtime.names:
        listed = ", ".join(f"{rank}={name!r}" for rank, name in enumerate(runtime.names))
        return f"known workers are {listed}"
    return f"known worker ranks are 0..{world_size - 1}"


# --------------------------------------------------------------------------------------------------
# Barrier: a rendezvous at a coordinator worker, over public RPC APIs only.
#
# Every member sends (key, member, value) to the coordinator; the coordinator's handler returns a
# future that completes once all expected members arrived, so no RPC thread blocks while waiting.

_PENDING: dict[tuple[Any, ...], tuple[int, dict[Any, Any], Future[dict[Any, Any]]]] = {}
_PENDING_LOCK = threading.Lock()


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _arrive(key: tuple[Any, ...], expected: int, member: Any, value: Any) -> Future[dict[Any, Any]]:
    with _PENDING_LOCK:
        entry = _PENDING.get(key)
        if entry is None:
            entry = (expected, {}, Future())
            _PENDING[key] = entry
        _, arrived, future = entry
        arrived[member] = value
        complete = len(arrived) >= expected
        if complete:
            del _PENDING[key]
    if complete:
        future.set_result(dict(arrived))
    return future


def _rendezvous(
    key: tuple[Any, ...],
    member: Any,
    value: Any,
    timeout: float,
    *,
    expected: int,
    coordinator: str | int,
) -> dict[Any, Any]:
    future = rpc.rpc_async(
        coordinator, _arrive, args=(key, expected, member, value), timeout=timeout
    )
    return _wait(future)


def barrier(
    worker_names: Iterable[str | int] | None = None, *, timeout: float | None = None
) -> None:
    """Block until every listed worker (default: all) has called ``barrier`` with the same list.

    Unlike TorchOpt's barrier, a failure (a worker that never arrives, a dead peer) raises
    instead of being swallowed.

    Args:
        worker_names: Names or ranks of the workers to wait for; this worker must be one of them.
            ``None`` means all workers.
        timeout: Seconds to wait; ``None`` uses the RPC default timeout of the running world
            (``rpc_backend_options.rpc_timeout``, 60 s unless configured). ``0`` waits forever.

    Raises:
        RuntimeError: RPC is not running, or a peer failed.
        TimeoutError: Not every worker arrived within ``timeout`` seconds.
        TypeError: ``worker_names`` is a single name or rank, or ``timeout`` is not a number.
        ValueError: Unknown workers, an empty list, this worker is not in the list, or a
            negative ``timeout``.

    Example:
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     metadist.barrier()  # every worker waits here for the others
        >>> main()
    """
    runtime = _runtime("metadist.barrier")
    if worker_names is None:
        group = runtime.names
    else:
        if isinstance(worker_names, (str, int)):
            raise TypeError(
                f"worker_names must be an iterable of worker names or ranks, got {worker_names!r}; "
                f"wrap a single worker in a list"
            )
        group = tuple(
            sorted(
                {get_worker_name(worker) for worker in worker_names}, key=runtime.ids.__getitem__
            )
        )
        if not group:
            raise ValueError("worker_names must name at least one worker, got an empty iterable")
    own = runtime.names[runtime.info.world_rank]
    if own not in group:
        raise ValueError(f"this worker ({own!r}) must be one of worker_names={list(group)}")
    if timeout is None:
        timeout = runtime.default_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (0 waits forever), got {timeout}")
    with runtime.lock:
        generation = runtime.generations.get(group, 0)
        runtime.generations[group] = generation + 1
    try:
        _rendezvous(
            (group, generation), own, None, timeout, expected=len(group), coordinator=group[0]
        )
    except RuntimeError as error:
        if "timeout" in str(error).lower() or "timed out" in str(error).lower():
            raise TimeoutError(
                f"barrier over {list(group)} timed out after {timeout} s on worker {own!r}: "
                f"some workers did not arrive"
            ) from error
        raise RuntimeError(
            f"barrier over {list(group)} failed on worker {own!r}: {error}"
        ) from error


# --------------------------------------------------------------------------------------------------
# Rank selectors


def _validate_ranks(api: str, ranks: tuple[int, ...]) -> frozenset[int]:
    if not ranks:
        raise ValueError(f"{api} needs at least one rank, got none")
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"{api}: ranks must be non-negative ints, got {rank!r}")
    return frozenset(ranks)


def _selector(
    api: str, ranks: frozenset[int], run_on_listed: bool
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    def decorator(func: Callable[P, R]) -> Callable[P, R | None]:
        if not callable(func):
            raise TypeError(f"{api}: expected a function to decorate, got {func!r}")

        @functools.wraps(func)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R | None:
            info = get_world_info()
            too_big = sorted(rank for rank in ranks if rank >= info.world_size)
            if too_big:
                raise ValueError(
                    f"{api}: ranks {too_big} do not exist in a world of size {info.world_size}"
                )
            if (info.world_rank in ranks) == run_on_listed:
                return func(*args, **kwargs)
            return None

        return wrapped

    return decorator


def on_rank(*ranks: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function to run only on the given ranks; elsewhere it returns ``None``.

    The rank is checked at call time, so the decorator can be applied at import.

    Args:
        *ranks: The ranks that run the function.

    Returns:
        A decorator.

    Raises:
        ValueError: No rank, a negative or non-int rank (at decoration), or a rank not in the
            world (at call time).
        TypeError: The decorated object is not callable.

    Example:
        >>> @on_rank(0)
        ... def log(msg):
        ...     return f"rank 0 says {msg}"
        >>> log("hi")  # on rank 0; other ranks get None
        'rank 0 says hi'
    """
    return _selector("on_rank", _validate_ranks("on_rank", ranks), run_on_listed=True)


def not_on_rank(*ranks: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function to run on every rank except the given ones (which get ``None``).

    Args:
        *ranks: The ranks that skip the function.

    Returns:
        A decorator.

    Raises:
        ValueError: No rank, a negative or non-int rank, or a rank not in the world.
        TypeError: The decorated object is not callable.

    Example:
        >>> @not_on_rank(1)
        ... def work():
        ...     return "done"
        >>> work()  # on rank 0 of a world of 2 (or more)  # doctest: +SKIP
        'done'
    """
    return _selector("not_on_rank", _validate_ranks("not_on_rank", ranks), run_on_listed=False)


def rank_zero_only(func: Callable[P, R]) -> Callable[P, R | None]:
    """Run ``func`` only on rank 0; other ranks get ``None``.

    Args:
        func: The function to guard (the rank is checked at call time).

    Returns:
        A wrapper returning ``func``'s result on rank 0 and ``None`` on other ranks.

    Raises:
        TypeError: ``func`` is not callable.

    Example:
        >>> @rank_zero_only
        ... def save(path):
        ...     return path
        >>> save("ckpt.pt")
        'ckpt.pt'
    """
    return _selector("rank_zero_only", frozenset({0}), run_on_listed=True)(func)


def rank_non_zero_only(func: Callable[P, R]) -> Callable[P, R | None]:
    """Run ``func`` on every rank but 0; rank 0 gets ``None``.

    Args:
        func: The function to guard (the rank is checked at call time).

    Returns:
        A wrapper returning ``func``'s result on ranks other than 0 and ``None`` on rank 0.

    Raises:
        TypeError: ``func`` is not callable.

    Example:
        >>> @rank_non_zero_only
        ... def serve():
        ...     return "serving"
        >>> serve() is None  # on rank 0
        True
    """
    return _selector("rank_non_zero_only", frozenset({0}), run_on_listed=False)(func)
