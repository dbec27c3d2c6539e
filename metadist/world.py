"""The world: who this worker is, who the others are, and how to wait for them.

Where the answers come from, first match wins:

1. a running RPC world: the one :func:`metadist.auto_init_rpc` started, or one the program
   started itself with ``torch.distributed.rpc.init_rpc`` (ranks and names as it chose them);
2. the launcher's environment, read each time it is asked for (never cached at import):
   torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, then Open MPI's
   ``OMPI_COMM_WORLD_*``, then SLURM's ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ...;
3. none of them: rank 0 of a world of 1.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, ParamSpec, TypeVar

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

__all__ = [
    "LaunchEnvironment",
    "WorldInfo",
    "arrive_async",
    "arrived_members",
    "barrier",
    "default_worker_name_format",
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
    "leave_world",
    "not_on_rank",
    "on_rank",
    "rank_non_zero_only",
    "rank_zero_only",
    "read_launch_environment",
    "require_rpc",
    "tasks_per_node",
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


class WorldInfo(NamedTuple):
    """Ranks and sizes of this worker; a named tuple, as in TorchOpt (it unpacks).

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
        runtime = _current_runtime()
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

    The width is that of ``world_size``, as in TorchOpt, so both name the workers of a world
    of 10 ``worker00 … worker09``.

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
    return f"worker{world_rank:0{len(str(world_size))}d}"


# --------------------------------------------------------------------------------------------------
# The launcher's environment


@dataclass(frozen=True)
class LaunchEnvironment:
    """Which launcher started this process, and the ranks it gave it.

    Attributes:
        launcher: ``"torchrun"`` (torchrun, or a manual launch setting ``WORLD_SIZE``),
            ``"mpirun"`` (Open MPI), ``"srun"`` (SLURM) or ``"python"`` (none: a world of 1).
        info: The ranks and sizes read from that launcher's variables.
    """

    launcher: str
    info: WorldInfo


def _env_int(name: str, launcher: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set, but {launcher} needs it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; {launcher} sets it to one"
        ) from None


def _checked(
    names: tuple[str, str, str, str], rank: int, size: int, local_rank: int, local_size: int
) -> WorldInfo:
    """Build a WorldInfo, naming the launcher variable that is out of range."""
    rank_name, size_name, local_rank_name, local_size_name = names
    if size < 1:
        raise ValueError(f"environment variable {size_name}={size} must be >= 1")
    if not 0 <= rank < size:
        raise ValueError(
            f"environment variable {rank_name}={rank} must be in [0, {size_name}={size})"
        )
    if local_size < 1:
        raise ValueError(f"environment variable {local_size_name}={local_size} must be >= 1")
    if not 0 <= local_rank < local_size:
        raise ValueError(
            f"environment variable {local_rank_name}={local_rank} must be in "
            f"[0, {local_size_name}={local_size})"
        )
    return WorldInfo(rank, size, local_rank, local_size)


def _torchrun_info() -> WorldInfo:
    world_size = _env_int("WORLD_SIZE", "torchrun", 1)
    rank = _env_int("RANK", "torchrun", 0)
    # A manual launch that sets only RANK/WORLD_SIZE is a single-node launch.
    local_world_size = _env_int(
        "LOCAL_WORLD_SIZE", "torchrun", world_size if "LOCAL_RANK" not in os.environ else 1
    )
    local_rank = _env_int("LOCAL_RANK", "torchrun", rank if local_world_size == world_size else 0)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return _checked(names, rank, world_size, local_rank, local_world_size)


def _open_mpi_info() -> WorldInfo:
    prefix = "OMPI_COMM_WORLD_"
    names = (f"{prefix}RANK", f"{prefix}SIZE", f"{prefix}LOCAL_RANK", f"{prefix}LOCAL_SIZE")
    values = [_env_int(name, "mpirun") for name in names]
    return _checked(names, *values)


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's ``SLURM_TASKS_PER_NODE`` syntax: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    Args:
        spec: The variable's value.

    Returns:
        The number of tasks on each node of the step, in node order.

    Raises:
        ValueError: ``spec`` is not in SLURM's syntax.

    Example:
        >>> tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(
                f"environment variable SLURM_TASKS_PER_NODE={spec!r} is not in SLURM's syntax "
                f"(counts like '2(x3),1')"
            )
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _slurm_info() -> WorldInfo:
    rank = _env_int("SLURM_PROCID", "srun")
    size = _env_int("SLURM_NTASKS", "srun")
    local_rank = _env_int("SLURM_LOCALID", "srun", 0)
    spec = os.environ.get("SLURM_TASKS_PER_NODE")
    local_size_name = "SLURM_TASKS_PER_NODE"
    if spec:
        counts = tasks_per_node(spec)
        node = _env_int("SLURM_NODEID", "srun", 0)
        if not 0 <= node < len(counts):
            raise ValueError(
                f"environment variable SLURM_NODEID={node} must be in [0, {len(counts)}), the "
                f"nodes listed by SLURM_TASKS_PER_NODE={spec!r}"
            )
        local_size = counts[node]
    elif os.environ.get("SLURM_NTASKS_PER_NODE"):
        local_size_name = "SLURM_NTASKS_PER_NODE"
        local_size = _env_int(local_size_name, "srun")
    elif _env_int("SLURM_NNODES", "srun", 1) == 1:
        local_size = size  # one node holds every task
    else:
        raise ValueError(
            "srun set neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE for a job on "
            "several nodes; set one of them (or LOCAL_WORLD_SIZE with torchrun's variables)"
        )
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_size_name)
    return _checked(names, rank, size, local_rank, local_size)


def read_launch_environment() -> LaunchEnvironment:
    """Read the launcher's variables now (no RPC needed).

    Precedence, first match wins: torchrun's ``WORLD_SIZE`` (with ``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``), Open MPI's ``OMPI_COMM_WORLD_SIZE`` (``mpirun`` sets them only for
    the processes it starts, so it wins over the SLURM allocation it may run in), SLURM's
    ``SLURM_PROCID`` with ``SLURM_NTASKS`` (set by ``srun``), else a world of 1.

    Returns:
        The launcher and the ranks it gave this process.

    Raises:
        ValueError: A variable is malformed or out of range (the message names it).

    Example:
        >>> env = read_launch_environment()
        >>> env.launcher in ("torchrun", "mpirun", "srun", "python")
        True
    """
    if "WORLD_SIZE" in os.environ:
        return LaunchEnvironment("torchrun", _torchrun_info())
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return LaunchEnvironment("mpirun", _open_mpi_info())
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return LaunchEnvironment("srun", _slurm_info())
    return LaunchEnvironment("python", _torchrun_info())


# --------------------------------------------------------------------------------------------------
# The running world


class _Runtime:
    """What metadist knows about one running RPC world; a new world gets a new one."""

    def __init__(
        self, info: WorldInfo, default_timeout: float, names: tuple[str, ...] = ()
    ) -> None:
        self.info = info
        self.default_timeout = default_timeout
        self.names = names
        self.ids = {name: rank for rank, name in enumerate(names)}
        self.lock = threading.Lock()
        self.generations: dict[tuple[str, ...], int] = {}

    def __repr__(self) -> str:
        return f"<metadist world of {self.info.world_size} at {id(self):#x}>"


# The world auto_init_rpc started (join_world / leave_world), if any.
_RUNTIME: _Runtime | None = None
# A world the program started with rpc.init_rpc, described on first use: (agent, its runtime).
_ADOPTED: tuple[object, _Runtime] | None = None
_ADOPT_LOCK = threading.Lock()


def _running_rpc_agent() -> Any | None:
    """torch's RPC agent of this process, or ``None`` when RPC is not running.

    The one private torch call of metadist's world: torch has no public way to list every
    worker of a running world (``rpc.get_worker_info`` answers one name at a time), and the
    agent's identity tells a restarted world from the old one. tests/test_interop.py fails
    loudly if torch renames it.
    """
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
    adopted = _ADOPTED
    if adopted is not None and adopted[0] is agent:
        return adopted[1]
    with _ADOPT_LOCK:
        if _ADOPTED is not None and _ADOPTED[0] is agent:
            return _ADOPTED[1]
        workers = sorted(agent.get_worker_infos(), key=lambda worker: worker.id)
        if [worker.id for worker in workers] != list(range(len(workers))):
            raise RuntimeError(
                f"the running RPC world has worker ids {[w.id for w in workers]}; metadist "
                f"needs ranks 0..N-1"
            )
        rank = rpc.get_worker_info().id
        size = len(workers)
        # torch does not know which workers share a node; torchrun's variables do, when set
        # and consistent with this world. Else every worker counts as local (one node).
        local_rank, local_size = rank, size
        with contextlib.suppress(ValueError):
            env = _torchrun_info()
            if "LOCAL_RANK" in os.environ and env.world_size == size and env.world_rank == rank:
                local_rank, local_size = env.local_rank, env.local_world_size
        runtime = _Runtime(
            WorldInfo(rank, size, local_rank, local_size),
            float(rpc.get_rpc_timeout()),  # type: ignore[attr-defined]
            tuple(worker.name for worker in workers),
        )
        with _PENDING_LOCK:
            _PENDING.clear()  # rendezvous of a world that is gone
        _ADOPTED = (agent, runtime)
        return runtime


def _current_runtime() -> _Runtime | None:
    runtime = _RUNTIME
    return runtime if runtime is not None else _adopted_runtime()


def in_rpc_world() -> bool:
    """Whether an RPC world is running in this process (metadist's or the program's own).

    Returns:
        ``True`` inside :func:`metadist.auto_init_rpc` or after ``rpc.init_rpc``.

    Example:
        >>> in_rpc_world()
        False
    """
    return _current_runtime() is not None


def join_world(info: WorldInfo, own_name: str, timeout: float) -> None:
    """Describe the world RPC was just started in; every worker calls it once, after init.

    Gathers every worker's name at rank 0 (rank order), so that names are known without a
    call per lookup.

    Args:
        info: This worker's ranks.
        own_name: This worker's RPC name.
        timeout: Seconds to wait for the other workers, and the default of :func:`barrier`.

    Raises:
        ValueError: Two workers have the same name.
    """
    global _RUNTIME
    runtime = _Runtime(info, timeout)
    _RUNTIME = runtime
    future = arrive_async(
        ("<names>",), info.world_rank, value=own_name, expected=info.world_size, timeout=timeout
    )
    names = _wait(future)
    ordered = tuple(str(names[rank]) for rank in range(info.world_size))
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"worker names must be unique, got {ordered}")
    runtime.names = ordered
    runtime.ids = {name: rank for rank, name in enumerate(ordered)}


def leave_world() -> None:
    """Forget the world after RPC shut down (or failed to start)."""
    global _RUNTIME
    _RUNTIME = None
    with _PENDING_LOCK:
        _PENDING.clear()


def world_token() -> object:
    """An object that identifies the running world; a restarted world gets a new one.

    Caches whose entries must not outlive a world (e.g. which module structures a worker holds)
    key on it.

    Returns:
        The token.

    Raises:
        RuntimeError: RPC is not running.
    """
    return _runtime("metadist.world.world_token")


def require_rpc(api_name: str) -> None:
    """Raise the standard error if no RPC world is running in this process.

    Args:
        api_name: The public name the user called, for the message.

    Raises:
        RuntimeError: RPC is not running (neither :func:`metadist.auto_init_rpc` nor
            ``rpc.init_rpc`` started it).
    """
    _runtime(api_name)


def _runtime(api_name: str) -> _Runtime:
    runtime = _current_runtime()
    if runtime is None:
        raise RuntimeError(_NOT_INITIALIZED.format(api=api_name))
    return runtime


# --------------------------------------------------------------------------------------------------
# Threads that torch did not start

# OpenMP keeps its team size per thread. torch applies torch.set_num_threads() to the threads it
# starts, but RPC handler threads (TensorPipe's pool) keep OpenMP's default, one thread per core,
# unless OMP_NUM_THREADS was set before the process started (torchrun sets it; srun, mpirun and
# multiprocessing do not). Their parallel ops then spread over every core and contend with the
# other processes of the node. Measured on 2 cores, one thread per process: a 12-task MAML
# forward and backward took 2.0-2.3 ms on a handler thread against 1.5 ms on the main thread,
# and 1.55 ms on the handler thread once aligned.
_OPENMP = torch.backends.openmp.is_available()


def use_process_threads() -> None:
    """Give the calling thread the process's intra-op thread count (``torch.get_num_threads()``).

    metadist calls it where it runs user work on a thread torch did not start (a remote call's
    partition, an owner's optimizer step). It costs well under a microsecond.
    """
    if _OPENMP:
        torch.set_num_threads(torch.get_num_threads())


# --------------------------------------------------------------------------------------------------
# Waiting for futures


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Block until every future is done, in a wait that Ctrl-C can interrupt.

    Errors are not raised here: read them from each future afterwards.

    Args:
        futures: The futures to wait for.

    Example:
        >>> from torch.futures import Future
        >>> done = Future()
        >>> done.set_result(1)
        >>> wait_all([done])
        >>> done.wait()
        1
    """
    # torch's Future.wait blocks in C++, where the main thread never sees SIGINT, so a job
    # stuck in a remote call would ignore Ctrl-C. SimpleQueue.get is interruptible, and its put
    # is a C function the future can call directly (cheaper than a Python callback).
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


# --------------------------------------------------------------------------------------------------
# World information


def get_world_info() -> WorldInfo:
    """Return this worker's ranks and sizes.

    Inside a running RPC world (:func:`metadist.auto_init_rpc`'s, or one started with
    ``rpc.init_rpc``) this is that world; elsewhere it is read from the launcher's environment
    at call time (see :func:`read_launch_environment`; a plain process is rank 0 of a world
    of 1).

    Returns:
        A :class:`WorldInfo`.

    Raises:
        ValueError: A launcher variable is malformed or out of range.

    Example:
        >>> info = get_world_info()
        >>> 0 <= info.world_rank < info.world_size
        True
    """
    runtime = _current_runtime()
    return runtime.info if runtime is not None else read_launch_environment().info


def get_world_rank() -> int:
    """Return the global rank of this worker (``get_rank`` is an alias).

    Returns:
        The rank, in ``[0, world_size)``; ``0`` outside any launcher.

    Example:
        >>> get_world_rank() >= 0
        True
    """
    return get_world_info().world_rank


get_rank = get_world_rank


def get_world_size() -> int:
    """Return the number of workers in the job.

    Returns:
        The size of the running world or of the launch; ``1`` outside any launcher.

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
        The number of workers on this node; ``1`` outside any launcher.

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
        >>> import metadist
        >>> metadist.auto_init_rpc()(get_worker_names)()  # a world of 1
        ('worker0',)
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
        >>> get_worker_id()  # this worker, outside a launcher
        0
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
        >>> import metadist
        >>> metadist.auto_init_rpc()(get_worker_name)(0)  # a world of 1
        'worker0'
    """
    rank = get_worker_id(id)
    return _runtime("metadist.get_worker_name").names[rank]


def _known_workers(world_size: int) -> str:
    runtime = _current_runtime()
    if runtime is not None and runtime.names:
        listed = ", ".join(f"{rank}={name!r}" for rank, name in enumerate(runtime.names))
        return f"known workers are {listed}"
    return f"known worker ranks are 0..{world_size - 1}"


# --------------------------------------------------------------------------------------------------
# Rendezvous at a coordinator worker, over public RPC APIs only.
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


def arrive_async(
    key: tuple[Any, ...],
    member: Any,
    *,
    expected: int,
    timeout: float,
    value: Any = None,
    coordinator: str | int = 0,
) -> Future[dict[Any, Any]]:
    """Announce ``member`` at the rendezvous ``key`` held by ``coordinator``.

    The building block of :func:`barrier` and of the shutdown handshake.

    Args:
        key: Names the rendezvous; every member uses the same key.
        member: Who arrives (a rank or a name), unique among the members.
        expected: How many members complete the rendezvous.
        timeout: Seconds to wait for the others; ``0`` waits forever.
        value: Sent along; the result maps each member to its value.
        coordinator: The worker (rank or name) that holds the rendezvous.

    Returns:
        A future of ``{member: value}`` that completes once ``expected`` members arrived.
    """
    return rpc.rpc_async(coordinator, _arrive, args=(key, expected, member, value), timeout=timeout)


def arrived_members(key: tuple[Any, ...]) -> frozenset[Any]:
    """The members that arrived so far at a rendezvous this worker coordinates.

    Args:
        key: The rendezvous, as given to :func:`arrive_async`.

    Returns:
        The members, empty once the rendezvous completed (or if it never started here).
    """
    with _PENDING_LOCK:
        entry = _PENDING.get(key)
        return frozenset(entry[1]) if entry is not None else frozenset()


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
        _wait(
            arrive_async(
                (group, generation),
                own,
                expected=len(group),
                timeout=timeout,
                coordinator=group[0],
            )
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
            # A rank beyond the world never matches: a script written for N workers runs
            # unchanged in a world of 1 (e.g. under plain python while debugging).
            if (get_world_rank() in ranks) == run_on_listed:
                return func(*args, **kwargs)
            return None

        return wrapped

    return decorator


def on_rank(*ranks: int) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a function to run only on the given ranks; elsewhere it returns ``None``.

    The rank is checked at call time, so the decorator can be applied at import. A rank beyond
    the world size never matches.

    Args:
        *ranks: The ranks that run the function.

    Returns:
        A decorator.

    Raises:
        ValueError: No rank, or a negative or non-int rank (at decoration).
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
        ValueError: No rank, or a negative or non-int rank (at decoration).
        TypeError: The decorated object is not callable.

    Example:
        >>> @not_on_rank(1)
        ... def work():
        ...     return "done"
        >>> work()  # rank 0 (also in a world of 1, where rank 1 does not exist)
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
