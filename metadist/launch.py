"""How a process joins a world: the interface and rendezvous its launcher's environment
(:mod:`metadist.environment`) calls for, RPC start, and a shutdown handshake that tells a
finished worker from a dead one (torch's graceful shutdown cannot)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch.distributed.rpc as rpc
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.rpc import RpcBackendOptions  # type: ignore[attr-defined]

from metadist import network, world
from metadist._quiet import quiet_torch_warnings
from metadist.environment import (
    LaunchEnvironment,
    WorldInfo,
    default_worker_name_format,
    master_address,
    read_launch_environment,
)
from metadist.errors import is_timeout

__all__ = ["auto_init_rpc"]

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("metadist")


def auto_init_rpc(
    worker_init_fn: Callable[[], object] | None = None,
    worker_name_format: Callable[..., str] = default_worker_name_format,
    *,
    backend: rpc.BackendType | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
    shutdown_timeout: float = 30.0,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a job's entry function so that it runs inside an RPC world.

    Each call reads the launcher's environment (torchrun, ``srun``, ``mpirun``; none: a world
    of 1), starts RPC, runs ``worker_init_fn()`` then the function on every rank, and shuts RPC
    down once every worker is done (errors are recorded for ``torchrun``). Inside a running
    world the function just runs. Single-node jobs listen on loopback only, others on the
    interface that routes to the master; ``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` win.

    Args:
        worker_init_fn: Called on every worker after RPC starts, before the function.
        worker_name_format: Names a worker from :class:`metadist.WorldInfo`'s fields, by keyword.
        backend: RPC backend; ``None`` means TensorPipe.
        rpc_backend_options: Backend options; an ``init_method`` of ``env://`` is replaced by
            metadist's rendezvous. ``None``: TensorPipe over TCP, ``_channels=["basic"]`` (CPU).
        shutdown_timeout: Seconds calls in flight may run once every worker has finished; past
            it, shutdown raises ``RuntimeError``. Ctrl-C does not wait.

    Returns:
        A decorator for the entry function.

    Raises:
        TypeError: An argument (or the decorated object) is not callable or not a number.
        ValueError: ``shutdown_timeout`` is not positive.
    """
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn must be callable or None, got {worker_init_fn!r}")
    if not callable(worker_name_format):
        raise TypeError(f"worker_name_format must be callable, got {worker_name_format!r}")
    if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float)):
        raise TypeError(f"shutdown_timeout must be a number of seconds, got {shutdown_timeout!r}")
    if shutdown_timeout <= 0:
        raise ValueError(f"shutdown_timeout must be > 0 seconds, got {shutdown_timeout}")

    def decorator(func: Callable[P, R]) -> Callable[P, R]:
        if not callable(func):
            raise TypeError(f"auto_init_rpc decorates a function, got {func!r}")

        @functools.wraps(func)
        def entry(*args: P.args, **kwargs: P.kwargs) -> R:
            if world.in_rpc_world():
                return func(*args, **kwargs)
            return _run_in_world(
                functools.partial(func, *args, **kwargs),
                worker_init_fn=worker_init_fn,
                worker_name_format=worker_name_format,
                backend=backend,
                options=rpc_backend_options,
                shutdown_timeout=float(shutdown_timeout),
            )

        return cast("Callable[P, R]", record(entry))

    return decorator


def _listener_and_rendezvous(
    launch: LaunchEnvironment, timeout: float
) -> tuple[network.Binding, str]:
    """The interface to listen on and the rendezvous URL for this launch."""
    info = launch.info
    if launch.launcher == "python":
        return network.choose_binding("127.0.0.1"), f"{network.LOCAL_SCHEME}://"
    master_addr, master_port = master_address(launch.launcher)
    # For torchrun only its own LOCAL_WORLD_SIZE says the job is on one node: a manual launch
    # that sets RANK and WORLD_SIZE alone may span nodes.
    single_node = info.local_world_size == info.world_size and (
        launch.launcher != "torchrun" or "LOCAL_WORLD_SIZE" in os.environ
    )
    if single_node:
        # Loopback reaches every worker, whatever MASTER_ADDR is (`torchrun --standalone` sets
        # the FQDN, often a LAN address; SLURM names the node): RPC must not listen there.
        binding = network.choose_binding("127.0.0.1")
    else:
        try:
            binding = network.choose_binding(
                master_addr, multi_node=info.local_world_size < info.world_size
            )
        except ValueError:
            if (user := network.user_binding()) is None:
                raise
            binding = user
    _log_interface(info, binding, master_addr)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if binding.loopback and not agent_store:
        # torch's rendezvous adds rank and world_size to the query itself. port_from: what the
        # store's errors name (srun derives the port from the job id where MASTER_PORT is unset).
        port_from = "MASTER_PORT" if os.environ.get("MASTER_PORT") else "SLURM_JOB_ID"
        return binding, (
            f"{network.LOOPBACK_SCHEME}://127.0.0.1:{master_port}?timeout={timeout}"
            f"&port_from={port_from}"
        )
    if launch.launcher == "torchrun":
        return binding, f"{network.ELASTIC_SCHEME}://" if agent_store else "env://"
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return binding, f"tcp://{host}:{master_port}"


def _log_interface(info: WorldInfo, binding: network.Binding, master_addr: str) -> None:
    """Say once when RPC will listen beyond loopback, naming the interface really used."""
    user = os.environ.get("TP_SOCKET_IFNAME")
    ifname = user or binding.ifname
    address = network.ipv4_of(ifname) if user else binding.address
    if address is not None and ipaddress.ip_address(address).is_loopback:
        return
    why = "set by TP_SOCKET_IFNAME" if user else f"chosen to reach MASTER_ADDR={master_addr}"
    message = (
        f"worker {info.world_rank} listens for RPC on interface {ifname} "
        f"({address or 'no IPv4 address'}), {why}; RPC is unauthenticated: run only on trusted "
        "networks"
    )
    logger.warning("metadist: %s", message)


_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def _limit_malloc_arenas() -> None:
    """Use one glibc malloc arena: a thread's own arena returns memory to the kernel and faults
    it back in on each call (4-task MAML forward on an RPC thread: ~800 ms against 175 ms).
    ``MALLOC_ARENA_MAX`` wins; ``METADIST_MALLOC_ARENA_MAX`` sets the count (``0``: glibc's)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    raw = os.environ.get("METADIST_MALLOC_ARENA_MAX", "1")
    if not raw.strip().lstrip("-").isdigit():
        raise ValueError(
            f"environment variable METADIST_MALLOC_ARENA_MAX={raw!r} must be an integer "
            f"(0 leaves glibc's default)"
        )
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        if int(raw) > 0:
            ctypes.CDLL(None).mallopt(_M_ARENA_MAX, int(raw))


def _run_in_world(
    job: Callable[[], R],
    *,
    worker_init_fn: Callable[[], object] | None,
    worker_name_format: Callable[..., str],
    backend: rpc.BackendType | None,
    options: RpcBackendOptions | None,
    shutdown_timeout: float,
) -> R:
    launch = read_launch_environment()
    info = launch.info
    name = worker_name_format(**info._asdict())
    if not isinstance(name, str) or not name:
        raise TypeError(f"worker_name_format must return a non-empty str, got {name!r}")
    if options is None:
        # TensorPipe's shared-memory transport busy-polls a core per idle worker (2.6 s of CPU
        # per 3 s idle); TCP ("uv") waits in epoll. Tensors travel in that connection ("basic"):
        # torch's default channels were slower at every size on one node (round trip 0.78 vs
        # 0.86 ms at 4 KB, 8.4 vs 13.9 ms at 16 MB; benchmarks/bench_remote.py --channels).
        options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    timeout = float(options.rpc_timeout)
    binding, url = _listener_and_rendezvous(launch, timeout)
    if options.init_method == "env://":
        options.init_method = url
    network.install_rendezvous_handlers()
    _limit_malloc_arenas()  # before init_rpc starts the handler threads
    with network.socket_ifname_env(binding.ifname), quiet_torch_warnings():
        rpc.init_rpc(
            name,
            backend=backend,
            rank=info.world_rank,
            world_size=info.world_size,
            rpc_backend_options=options,
        )
    try:
        world.join_world(info, name, timeout)
        if worker_init_fn is not None:
            worker_init_fn()
        world.barrier()
        result = job()
    except KeyboardInterrupt:
        _abort()
        raise
    except BaseException:
        # Ctrl-C while shutting down after a failure aborts; the failure is what is raised.
        with contextlib.suppress(KeyboardInterrupt):
            _shutdown(name, shutdown_timeout, raise_errors=False)
        raise
    _shutdown(name, shutdown_timeout, raise_errors=True)
    return result


ABORT_GRACE = 2.0  # seconds a Ctrl-C'd worker gives its local RPC teardown

# Set on a worker when rank 0 ends the shutdown handshake without the dead workers.
_RELEASED = threading.Event()
_RELEASED_DEAD: list[str] = []


def _release(dead: list[str]) -> None:
    _RELEASED_DEAD[:] = dead
    _RELEASED.set()


def _finish(info: WorldInfo, poll: float = 2.0) -> list[str]:
    """Wait until every live worker finished its job; return the names of workers found dead.

    Rank 0 holds the handshake and pings unfinished workers: a lost connection is dead, a ping
    timing out is busy (waited for). Survivors serve until every live worker is done, then rank
    0 releases them. Others ping rank 0 alone, so pings grow with the world, not its square.
    """
    _RELEASED.clear()
    future = world.announce_job_done()
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    dead: set[str] = set()
    names = world.get_worker_names()
    while not done.wait(poll):  # RPC's threads serve the others' calls meanwhile
        if info.world_rank != 0:
            if _RELEASED.is_set():
                return list(_RELEASED_DEAD)
            gone = _unreachable([0], timeout=max(poll, 5.0))
            if gone and not _RELEASED.is_set():
                return gone
            continue
        finished = world.finished_ranks()
        waiting_for = [
            r for r in range(1, info.world_size) if not (r in finished or names[r] in dead)
        ]
        dead.update(_unreachable(waiting_for, timeout=max(poll, 5.0)))
        live_waiting = [rank for rank in waiting_for if names[rank] not in dead]
        if dead and not live_waiting:
            survivors = [r for r in finished if r != 0 and names[r] not in dead]
            world.wait_all([rpc.rpc_async(r, _release, args=(sorted(dead),)) for r in survivors])
            return sorted(dead)
    future.wait()
    return []


def _unreachable(ranks: list[int], timeout: float) -> list[str]:
    """Names of the workers among ``ranks`` whose connection is gone (a busy one is not)."""
    names = world.get_worker_names()
    gone = []
    for rank in ranks:
        try:
            rpc.rpc_sync(rank, os.getpid, timeout=timeout)  # any answer will do
        except RuntimeError as error:
            if not is_timeout(error):
                gone.append(names[rank])
    return gone


# The shutdown thread started last: torch's shutdown must never run twice at once.
_SHUTDOWN_THREAD: list[threading.Thread] = []


def _bounded_shutdown(grace: float, *, graceful: bool) -> bool:
    """torch's shutdown, bounded: it waits forever for a call that never returns."""
    finished = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with quiet_torch_warnings():
                rpc.shutdown(graceful=graceful)
        except BaseException as error:  # handed to the caller below
            errors.append(error)
        finally:
            finished.set()

    thread = threading.Thread(target=run, name="metadist-shutdown", daemon=True)
    _SHUTDOWN_THREAD[:] = [thread]
    thread.start()
    if not finished.wait(grace):
        return False
    if errors:
        raise errors[0]
    return True


def _abort() -> None:
    """Ctrl-C: tear RPC down locally, now (peers see this worker as dead)."""
    world.leave_world()
    deadline = time.monotonic() + ABORT_GRACE
    if not any(thread.is_alive() for thread in _SHUTDOWN_THREAD):
        with contextlib.suppress(Exception, KeyboardInterrupt):
            _bounded_shutdown(ABORT_GRACE, graceful=False)
    # A second Ctrl-C (the terminal's and torchrun's) must not cut the teardown short.
    for thread in _SHUTDOWN_THREAD:
        while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(KeyboardInterrupt):
                thread.join(left)


def _stalled(gone: list[str], grace: float) -> str:
    """Why torch's graceful shutdown did not end within ``grace`` seconds."""
    stalled = f"torch's shutdown still waited {grace:g} s after every worker finished its job"
    later = world.later_world_problem()
    if later is not None:  # every worker's shutdown stalls: one that gave up first is not dead
        return f"{stalled}: {later}"
    if gone:
        return f"workers {gone} died after finishing their job; shutdown cannot complete"
    return (
        f"remote calls were still running {grace:g} s after every worker finished its job (a "
        f"call with timeout=None that never returns?); exiting without waiting for them"
    )


def _shutdown(name: str, grace: float, *, raise_errors: bool) -> None:
    """Finish the shutdown handshake and RPC; Ctrl-C while waiting for the others aborts."""
    problem = None
    info = world.get_world_info()
    try:
        dead = _finish(info)
        if dead:
            problem = f"workers {dead} died before the job finished"
            # The graceful all-gather cannot complete without them.
            with contextlib.suppress(Exception):
                rpc.shutdown(graceful=False)
        elif not _bounded_shutdown(grace, graceful=True):
            others = [rank for rank in range(info.world_size) if rank != info.world_rank]
            gone = _unreachable(others, timeout=5.0)
            problem = _stalled(gone, grace)
    except Exception as error:
        problem = f"shutdown failed: {error}"
        with contextlib.suppress(Exception):
            rpc.shutdown(graceful=False)
    except KeyboardInterrupt:
        _abort()
        raise
    finally:
        world.leave_world()
    if problem is not None:
        message = f"RPC shutdown on worker {name!r}: {problem}"
        if raise_errors:
            raise RuntimeError(message)
        logger.warning("metadist: %s", message)
