"""Who this worker is, who the others are, and how to wait for them: the running RPC world's
answers (metadist's or the program's own ``rpc.init_rpc``), else the launcher's environment."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from metadist.environment import WorldInfo, read_launch_environment
from metadist.errors import is_connection_lost, is_timeout, worker_gone

__all__ = [
    "announce_job_done",
    "barrier",
    "DEFAULT_TIMEOUT",
    "check_rref_world",
    "check_timeout",
    "finished_ranks",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_worker_id",
    "get_worker_name",
    "get_worker_names",
    "get_world_info",
    "get_world_rank",
    "get_world_size",
    "in_rpc_world",
    "join_world",
    "later_world_problem",
    "leave_world",
    "not_on_rank",
    "on_rank",
    "rank_non_zero_only",
    "rank_of",
    "rank_zero_only",
    "require_rpc",
    "resolve_timeout",
    "use_process_threads",
    "wait_all",
    "world_token",
]

P = ParamSpec("P")
R = TypeVar("R")

_NOT_INITIALIZED = (
    "{api} needs metadist's RPC world, which is not running in this process. Decorate the entry "
    "function with @metadist.auto_init_rpc() (it starts RPC from the torchrun, srun or mpirun "
    "environment, or a world of 1 under plain `python script.py`) and call {api} inside it, or "
    "start RPC yourself with torch.distributed.rpc.init_rpc first."
)


# Counts the RPC worlds of this process as metadist meets them (its own, or one the program
# started): torch's RRef bookkeeping serves only the first (check_rref_world).
_WORLD_COUNT = itertools.count(1)


class _Runtime:
    """What metadist knows about one running RPC world; a new world gets a new one (its token)."""

    def __init__(self, info: WorldInfo, default_timeout: float, names: tuple[str, ...]) -> None:
        self.ordinal = next(_WORLD_COUNT)  # 1: the first world of this process
        self.info = info
        self.default_timeout = default_timeout
        self.names = names  # in rank order; empty until join_world has gathered them
        self.lock = threading.Lock()
        self.generations: dict[tuple[str, ...], int] = {}


# The world auto_init_rpc started (join_world / leave_world), if any.
_RUNTIME: _Runtime | None = None
# A world the program started with rpc.init_rpc, described on first use: (agent, its runtime).
_ADOPTED: tuple[object, _Runtime] | None = None
_ADOPT_LOCK = threading.Lock()


def _running_rpc_agent() -> Any | None:
    """torch's RPC agent, or ``None`` (private API: nothing public lists a world's workers;
    tests/test_interop.py fails loudly if torch renames it)."""
    from torch.distributed.rpc import api

    if not api._is_current_rpc_agent_set():  # type: ignore[attr-defined]
        return None
    return api._get_current_rpc_agent()  # type: ignore[attr-defined]


def _adopted_runtime() -> _Runtime | None:
    """Describe an RPC world started outside metadist (``rpc.init_rpc``), once per world."""
    global _ADOPTED
    agent = _running_rpc_agent()
    if agent is None:
        return None
    with _ADOPT_LOCK:
        if _ADOPTED is not None and _ADOPTED[0] is agent:
            return _ADOPTED[1]
        workers = sorted(agent.get_worker_infos(), key=lambda worker: worker.id)
        ids = [worker.id for worker in workers]
        if ids != list(range(len(workers))):
            raise RuntimeError(f"the running RPC world has worker ids {ids}; metadist needs 0..N-1")
        rank, size = rpc.get_worker_info().id, len(workers)
        # torch does not know which workers share a node; torchrun's variables do, when set and
        # consistent with this world. Else every worker counts as local (one node).
        info = WorldInfo(rank, size, rank, size)
        with contextlib.suppress(ValueError):
            env = read_launch_environment()
            if "LOCAL_RANK" in os.environ and env.info[:2] == (rank, size):
                info = env.info
        timeout = float(rpc.get_rpc_timeout())  # type: ignore[attr-defined]
        runtime = _Runtime(info, timeout, tuple(worker.name for worker in workers))
        with _PENDING_LOCK:
            _PENDING.clear()  # rendezvous of a world that is gone
            _FAILED.clear()
        _ADOPTED = (agent, runtime)
        return runtime


def _current_runtime() -> _Runtime | None:
    return _RUNTIME or _adopted_runtime()


def _runtime(api_name: str) -> _Runtime:
    runtime = _current_runtime()
    if runtime is None:
        raise RuntimeError(_NOT_INITIALIZED.format(api=api_name))
    return runtime


def in_rpc_world() -> bool:
    """Whether an RPC world (metadist's, or the program's own ``rpc.init_rpc``) is running."""
    return _current_runtime() is not None


class _DefaultTimeout(float):
    """:data:`DEFAULT_TIMEOUT`'s type, which shows it by name in signatures."""

    def __repr__(self) -> str:
        return "DEFAULT_TIMEOUT"


#: The ``timeout`` default of every metadist wait: the running world's RPC timeout (see the API
#: reference, "Timeouts"). Equal to torch's ``UNSET_RPC_TIMEOUT`` (-1.0), so code written for
#: torchopt that passes that constant keeps working.
DEFAULT_TIMEOUT: float = _DefaultTimeout(-1.0)

#: The longest wait torch's RPC can hold (whole milliseconds in a signed 32-bit number), and
#: the shortest (less is no milliseconds, which torch reads as no limit), in seconds.
MAX_TIMEOUT_S, MIN_TIMEOUT_S = (2**31 - 1) / 1000, 0.001


def check_timeout(timeout: float | None, api: str) -> None:
    """Refuse a ``timeout`` that is not ``None``, :data:`DEFAULT_TIMEOUT` or a number of seconds
    torch's RPC holds as given (``TypeError`` / ``ValueError`` naming ``api``)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"{api}: timeout must be a number of seconds, DEFAULT_TIMEOUT or None, got {timeout!r}"
        )
    if timeout != DEFAULT_TIMEOUT and not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:  # NaN too
        raise ValueError(
            f"{api}: timeout must be between {MIN_TIMEOUT_S} and {MAX_TIMEOUT_S} seconds "
            f"(DEFAULT_TIMEOUT: the world's RPC timeout; None: no limit), got {timeout}"
        )


def resolve_timeout(timeout: float | None, api: str) -> float:
    """``timeout`` checked (:func:`check_timeout`) and in seconds, as torch's RPC takes it: the
    world's own for :data:`DEFAULT_TIMEOUT`, ``0.0`` (no limit) for ``None``."""
    check_timeout(timeout, api)
    if timeout is None:
        return 0.0
    if timeout == DEFAULT_TIMEOUT:
        return _runtime(api).default_timeout
    return float(timeout)


def join_world(info: WorldInfo, own_name: str, timeout: float) -> None:
    """Gather every worker's name at rank 0 once after init, so that lookups need no call
    (``timeout`` is also :func:`barrier`'s default); ``ValueError`` on duplicate names."""
    global _RUNTIME
    runtime = _RUNTIME = _Runtime(info, timeout, ())
    future = arrive_async(
        ("<names>",), info.world_rank, value=own_name, expected=info.world_size, timeout=timeout
    )
    names = _wait(future)
    ordered = tuple(str(names[rank]) for rank in range(info.world_size))
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"worker names must be unique, got {ordered}")
    runtime.names = ordered


def leave_world() -> None:
    """Forget the world after RPC shut down (or failed to start)."""
    global _RUNTIME
    _RUNTIME = None
    with _PENDING_LOCK:
        _PENDING.clear()
        _FAILED.clear()


def world_token() -> object:
    """An object that identifies the running world, for caches that must not outlive it."""
    return _runtime("metadist.world.world_token")


def require_rpc(api_name: str) -> None:
    """Raise the standard ``RuntimeError``, naming ``api_name``, if no RPC world is running."""
    _runtime(api_name)


def later_world_problem() -> str | None:
    """Why RRefs fail in the running world, if it is not this process's first; else ``None``."""
    runtime = _current_runtime()
    if runtime is None or runtime.ordinal == 1:
        return None
    return (
        f"this is RPC world {runtime.ordinal} in this process, and torch's RRef bookkeeping "
        f"(RRefContext) is process-wide and ended with the first world's shutdown: an RRef "
        f"used in a later world (torch.distributed.rpc.remote, or an RRef sent in a call) is "
        f"never released, and shutdown waits for it in vain. Run one RPC world per process: "
        f"run the job once per process, or launch a new process for each run"
    )


def check_rref_world(api: str) -> None:
    """Raise ``RuntimeError`` naming ``api`` in a later RPC world (:func:`later_world_problem`)."""
    problem = later_world_problem()
    if problem is not None:
        raise RuntimeError(f"{api} cannot send an RRef: {problem}")


def get_world_info() -> WorldInfo:
    """Return this worker's ranks and sizes: the running world's, else the launcher's.

    Returns:
        A :class:`WorldInfo`; outside any launcher, rank 0 of a world of 1.
    """
    runtime = _current_runtime()
    if runtime is not None:
        return runtime.info
    return read_launch_environment().info


def get_world_rank() -> int:
    """Return the global rank of this worker (``get_rank`` is an alias).

    Returns:
        The rank, in ``[0, world_size)``.
    """
    return get_world_info().world_rank


get_rank = get_world_rank


def get_world_size() -> int:
    """Return the number of workers in the job.

    Returns:
        The size of the running world or of the launch.
    """
    return get_world_info().world_size


def get_local_rank() -> int:
    """Return the rank of this worker on its node (e.g. to pick a GPU).

    Returns:
        The local rank, in ``[0, local_world_size)``.
    """
    return get_world_info().local_rank


def get_local_world_size() -> int:
    """Return the number of workers on this node.

    Returns:
        The number of workers on this node.
    """
    return get_world_info().local_world_size


def get_worker_names() -> tuple[str, ...]:
    """Return the names of all workers; unlike the ranks and sizes, they need RPC running.

    Returns:
        The worker names, in rank order.
    """
    return _runtime("metadist.get_worker_names").names


def get_worker_id(id: str | int | None = None) -> int:  # torchopt's signature
    """Return the rank of a worker.

    Args:
        id: A rank (``int``), a worker name (``str``), or ``None`` for this worker.

    Returns:
        The worker's rank.

    Raises:
        ValueError: No such worker; the message lists the known workers.
        TypeError: ``id`` is neither ``int``, ``str`` nor ``None``.
        RuntimeError: A name was given, or :func:`get_worker_name` called, without RPC running.
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
    names = _runtime(f"metadist.get_worker_id({id!r})").names
    if id not in names:
        raise ValueError(f"unknown worker name {id!r}: {_known_workers(len(names))}")
    return names.index(id)


def get_worker_name(id: str | int | None = None) -> str:
    """Return the name of a worker; errors as :func:`get_worker_id`.

    Args:
        id: A rank, a worker name, or ``None`` for this worker.

    Returns:
        The worker's RPC name.
    """
    rank = get_worker_id(id)
    return _runtime("metadist.get_worker_name").names[rank]


def rank_of(worker: str) -> int | None:
    """The rank of the worker named ``worker`` in the running world; ``None`` if it has none."""
    runtime = _current_runtime()
    if runtime is None or worker not in runtime.names:
        return None
    return runtime.names.index(worker)


def _known_workers(world_size: int) -> str:
    runtime = _current_runtime()
    if runtime is not None and runtime.names:
        listed = ", ".join(f"{rank}={name!r}" for rank, name in enumerate(runtime.names))
        return f"known workers are {listed}"
    return f"known worker ranks are 0..{world_size - 1}"


# Rendezvous: the coordinator's handler returns a future, so no RPC thread blocks while waiting.

_PENDING: dict[tuple[Any, ...], tuple[dict[Any, Any], Future[dict[Any, Any]]]] = {}
_PENDING_LOCK = threading.Lock()
# Rendezvous the coordinator gave up on (fail_rendezvous), with why, for members still to come.
_FAILED: dict[tuple[Any, ...], str] = {}
#: The key under which a failed rendezvous' result holds the reason (no member is a tuple).
FAILURE = ("<failed>",)


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def _arrive(key: tuple[Any, ...], expected: int, member: Any, value: Any) -> Future[dict[Any, Any]]:
    with _PENDING_LOCK:
        failed = _FAILED.get(key)
        if failed is None:
            arrived, future = _PENDING.setdefault(key, ({}, Future()))
            arrived[member] = value
            complete = len(arrived) >= expected
            if complete:
                del _PENDING[key]
    if failed is not None:
        future = Future()
        future.set_result({FAILURE: failed})
    elif complete:
        future.set_result(dict(arrived))
    return future


def fail_rendezvous(key: tuple[Any, ...], reason: str) -> bool:
    """End the incomplete rendezvous ``key`` this worker coordinates: every member, waiting or
    still to come, gets ``{FAILURE: reason}``. ``False`` if none is pending under ``key``."""
    with _PENDING_LOCK:
        entry = _PENDING.pop(key, None)
        if entry is None:
            return False
        _FAILED[key] = reason
    entry[1].set_result({FAILURE: reason})
    return True


def arrive_async(
    key: tuple[Any, ...],
    member: Any,
    *,
    expected: int,
    timeout: float,
    value: Any = None,
    coordinator: str | int = 0,
) -> Future[dict[Any, Any]]:
    """Announce ``member`` (with ``value``) at the rendezvous ``key`` held by ``coordinator``: a
    future of ``{member: value}`` once ``expected`` members arrived (``timeout=0``: no limit)."""
    return rpc.rpc_async(coordinator, _arrive, args=(key, expected, member, value), timeout=timeout)


def arrived_members(key: tuple[Any, ...]) -> frozenset[Any]:
    """The members that arrived so far at an incomplete rendezvous this worker coordinates."""
    with _PENDING_LOCK:
        entry = _PENDING.get(key)
        return frozenset(entry[0]) if entry is not None else frozenset()


def barrier(
    worker_names: Iterable[str | int] | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
) -> None:
    """Block until every listed worker has called ``barrier`` with the same list; unlike
    TorchOpt's, a failure (a worker that never arrives, a dead peer) raises.

    The first listed worker coordinates: while it waits, it fails the barrier for every member,
    within about two :data:`BARRIER_CHECK_S`, naming a worker whose process is gone or that
    finished its job (returned or raised out of the function decorated with
    :func:`metadist.auto_init_rpc`).

    Args:
        worker_names: Names or ranks to wait for, this worker among them; ``None``: all.
        timeout: See the API reference, "Timeouts".

    Raises:
        RuntimeError: RPC is not running, or a listed worker will never arrive.
        TimeoutError: Not every worker arrived within ``timeout`` seconds.
        TypeError: ``worker_names`` is a single name or rank, or ``timeout`` is not a number.
        ValueError: Unknown, no or missing own worker in the list, or a ``timeout`` out of range.
    """
    runtime = _runtime("metadist.barrier")
    seconds = resolve_timeout(timeout, "metadist.barrier")
    group = runtime.names
    if worker_names is not None:
        if isinstance(worker_names, (str, int)):
            raise TypeError(
                f"worker_names must be an iterable of worker names or ranks, got {worker_names!r}; "
                f"wrap a single worker in a list"
            )
        group = tuple(sorted({get_worker_name(w) for w in worker_names}, key=group.index))
        if not group:
            raise ValueError("worker_names must name at least one worker, got an empty iterable")
    own = runtime.names[runtime.info.world_rank]
    if own not in group:
        raise ValueError(f"this worker ({own!r}) must be one of worker_names={list(group)}")
    with runtime.lock:
        generation = runtime.generations.get(group, 0)
        runtime.generations[group] = generation + 1
    key = (group, generation)
    future = arrive_async(key, own, expected=len(group), timeout=seconds, coordinator=group[0])
    try:
        if own == group[0]:
            _watch_barrier(runtime, key, group, future)
        arrived = _wait(future)
    except RuntimeError as error:
        if is_timeout(error):
            raise TimeoutError(
                f"barrier over {list(group)} timed out after {seconds} s on worker {own!r}: "
                f"some workers did not arrive"
            ) from error
        if is_connection_lost(error):  # only the coordinator's connection is used here
            gone = worker_gone(group[0], runtime.names.index(group[0]))
            raise RuntimeError(
                f"barrier over {list(group)} failed on {own!r}: {gone} (it coordinates the "
                f"barrier). torch's RPC error: {error}"
            ) from error
        raise RuntimeError(f"barrier over {list(group)} failed on {own!r}: {error}") from error
    if FAILURE in arrived:
        raise RuntimeError(f"barrier over {list(group)} failed on {own!r}: {arrived[FAILURE]}")


#: How often a barrier's coordinator checks the members not arrived yet (seconds), and how long a
#: ping may take: a busy worker answers late, which is no failure.
BARRIER_CHECK_S = 0.5
_PING_S = 5.0


def _watch_barrier(
    runtime: _Runtime, key: tuple[Any, ...], group: tuple[str, ...], future: Future[Any]
) -> None:
    """Fail the barrier this worker coordinates (:func:`barrier`) once a member never arrives:
    torch would wait out its timeout."""
    arrivals: queue.SimpleQueue[Any] = queue.SimpleQueue()
    future.add_done_callback(arrivals.put)
    pings: dict[str, Future[Any]] = {}
    done_query: Future[frozenset[int]] | None = None
    while True:
        with contextlib.suppress(queue.Empty):
            arrivals.get(timeout=BARRIER_CHECK_S)  # interruptible by Ctrl-C, as _wait
            return
        arrived = arrived_members(key)
        missing = [name for name in group if name not in arrived]
        reasons: dict[str, str] = {}
        for name in missing:
            ping = pings.get(name)
            if ping is None:
                pings[name] = rpc.rpc_async(name, os.getpid, timeout=_PING_S)
            elif ping.done():
                del pings[name]  # answered, or timed out (busy): ping again next time
                try:
                    ping.wait()
                except Exception as error:
                    if is_connection_lost(error):
                        gone = worker_gone(name, runtime.names.index(name))
                        reasons[name] = f"{gone}, so it never arrives ({error})"
        if done_query is None:
            done_query = _finished_ranks_async()
        elif done_query.done():
            with contextlib.suppress(Exception):  # rank 0 gone: its own connection says so
                finished = {runtime.names[rank] for rank in done_query.wait()}
                for name in set(missing) & finished - set(reasons):
                    reasons[name] = (
                        f"worker {name!r} (rank {runtime.names.index(name)}) finished its job "
                        f"(the function decorated with auto_init_rpc returned or raised) without "
                        f"calling this barrier, so it never arrives"
                    )
            done_query = None
        if reasons and fail_rendezvous(key, "; ".join(reasons[n] for n in group if n in reasons)):
            return


# The job-done rendezvous at rank 0: auto_init_rpc's shutdown waits on it, and a barrier's
# coordinator asks it who finished. Only these functions touch its key.
_JOB_DONE = ("<done>",)


def announce_job_done() -> Future[dict[Any, Any]]:
    """Announce at rank 0 that this worker's job is done: a future done once every worker's is."""
    info = _runtime("metadist.world.announce_job_done").info
    return arrive_async(_JOB_DONE, info.world_rank, expected=info.world_size, timeout=0)


def finished_ranks() -> frozenset[int]:
    """On rank 0: the ranks that announced their job done, while some have not (then empty)."""
    return arrived_members(_JOB_DONE)


def _finished_ranks_async() -> Future[frozenset[int]]:
    """:func:`finished_ranks`, asked of rank 0 from any rank."""
    if get_world_rank() == 0:
        done: Future[frozenset[int]] = Future()
        done.set_result(finished_ranks())
        return done
    return rpc.rpc_async(0, finished_ranks, timeout=_PING_S)


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Block until every future is done, interruptibly by Ctrl-C (errors stay in the futures)."""
    # torch's Future.wait blocks in C++, where SIGINT is never seen; SimpleQueue.get is not.
    pending = [future for future in futures if not future.done()]
    if not pending or threading.current_thread() is not threading.main_thread():
        # Only the main thread receives signals: elsewhere torch's own wait is cheaper.
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
    """``future.wait()`` that Ctrl-C can interrupt (see :func:`wait_all`)."""
    wait_all((future,))
    return future.wait()


# OpenMP keeps its team size per thread: RPC handler threads get one per core unless
# OMP_NUM_THREADS was set at start (only torchrun sets it). On 2 cores, one thread per process: a
# 12-task MAML step took 2.0-2.3 ms on a handler thread, 1.5 ms on the main thread, 1.55 aligned.
_OPENMP = torch.backends.openmp.is_available()


def use_process_threads() -> None:
    """Give the calling thread (an RPC handler) the process's intra-op thread count (< 1 us)."""
    if _OPENMP:
        torch.set_num_threads(torch.get_num_threads())


# Rank selectors check the rank at call time, so they can decorate at import.
def _selector(
    api: str, ranks: tuple[int, ...], run_on_listed: bool, *, fixed: bool = False
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    if len(ranks) == 1 and callable(ranks[0]):
        # `@on_rank` without brackets hands the decorated function over as the only rank.
        name = getattr(ranks[0], "__qualname__", repr(ranks[0]))
        raise TypeError(
            f"{api}(...) takes the ranks, as in @{api}(0); it was applied to the function "
            f"{name} directly"
        )
    if not ranks:
        raise ValueError(f"{api}() needs at least one rank, as in @{api}(0); got none")
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(
                f"{api}(...): ranks must be non-negative ints, as in @{api}(0); got {rank!r} "
                f"of type {type(rank).__name__}"
            )

    def decorator(func: Callable[P, R]) -> Callable[P, R | None]:
        if not callable(func):
            # One statement: mypy takes func for callable, and lets only the raise be unreachable.
            raise TypeError(
                f"{api}: expected a function to decorate, got {func!r} of type "
                f"{type(func).__name__}"
                + (f" ({api} takes no ranks: write @{api}, without brackets)" if fixed else "")
            )

        @functools.wraps(func)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return func(*args, **kwargs) if (get_world_rank() in ranks) == run_on_listed else None

        return wrapped

    return decorator


def on_rank(*ranks: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function to run only on the given ranks; elsewhere it returns ``None``.

    A rank beyond the world never matches, so a script written for N workers runs unchanged in
    a world of 1.

    Args:
        *ranks: The ranks that run the function.

    Returns:
        A decorator.

    Raises:
        ValueError: No rank is given, or one is not a non-negative int.
        TypeError: The decorator was applied to a function directly, without the ranks.
    """
    return _selector("on_rank", ranks, run_on_listed=True)


def not_on_rank(*ranks: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """:func:`on_rank`'s opposite: the given ranks get ``None``, every other runs the function.

    Args:
        *ranks: The ranks that skip the function.

    Returns:
        A decorator.
    """
    return _selector("not_on_rank", ranks, run_on_listed=False)


def rank_zero_only(func: Callable[P, R]) -> Callable[P, R | None]:
    """Run ``func`` only on rank 0: ``@on_rank(0)`` without the brackets.

    Args:
        func: The function to guard.

    Returns:
        The wrapper.
    """
    return _selector("rank_zero_only", (0,), run_on_listed=True, fixed=True)(func)


def rank_non_zero_only(func: Callable[P, R]) -> Callable[P, R | None]:
    """Run ``func`` on every rank but 0: ``@not_on_rank(0)`` without the brackets.

    Args:
        func: The function to guard.

    Returns:
        The wrapper.
    """
    return _selector("rank_non_zero_only", (0,), run_on_listed=False, fixed=True)(func)
