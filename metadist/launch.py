"""The entry point: start RPC from the torchrun environment, run the job, shut down cleanly."""

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
from typing import ParamSpec, Protocol, TypeVar, cast

import torch.distributed.rpc as rpc
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.rpc import RpcBackendOptions  # type: ignore[attr-defined]

from metadist import network, world
from metadist._quiet import quiet_torch_warnings
from metadist.world import WorldInfo, default_worker_name_format

__all__ = ["WorkerNameFormat", "auto_init_rpc", "default_worker_name_format"]

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("metadist")


class WorkerNameFormat(Protocol):
    """A callable naming a worker from its ranks (called with keyword arguments)."""

    def __call__(
        self, *, world_rank: int, world_size: int, local_rank: int, local_world_size: int
    ) -> str: ...


def auto_init_rpc(
    worker_init_fn: Callable[[], object] | None = None,
    worker_name_format: WorkerNameFormat | Callable[..., str] = default_worker_name_format,
    *,
    backend: rpc.BackendType | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
    shutdown_timeout: float = 30.0,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate the entry function of a job so that it runs inside an RPC world.

    On every call the decorated function: reads the torchrun environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) —
    with none of it, as under plain ``python script.py``, the job is a world of 1 —, starts RPC,
    waits for every worker, runs ``worker_init_fn()``, waits again, runs the function, and shuts
    RPC down gracefully in ``finally``: workers whose function returned keep serving requests
    until every worker is done. Every rank runs the function; use :func:`metadist.rank_zero_only`
    for the driver's part. Errors are recorded for torchelastic so that ``torchrun`` reports them.

    Single-node jobs listen on loopback only: no torchrun, a loopback ``MASTER_ADDR``, or
    ``LOCAL_WORLD_SIZE == WORLD_SIZE`` (as torchrun sets it on one node), whatever
    ``MASTER_ADDR`` resolves to. Otherwise RPC listens on the interface that routes to
    ``MASTER_ADDR``. ``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` you set always win; each
    worker logs once the interface and address when they are not loopback.

    Args:
        worker_init_fn: Called on every worker after RPC starts and before the function (seed,
            set the device, load data).
        worker_name_format: Names a worker from keyword arguments ``world_rank``,
            ``world_size``, ``local_rank``, ``local_world_size``. The default gives
            ``worker0 … workerN-1`` zero-padded so that name order equals rank order.
        backend: RPC backend; ``None`` means TensorPipe.
        rpc_backend_options: Options for the backend (timeouts, device maps). Its
            ``init_method`` is replaced by metadist's loopback-only rendezvous for single-node
            jobs when left at the default ``env://``. ``None`` means TensorPipe options with
            only the TCP transport: TensorPipe's shared-memory transport busy-polls a core per
            worker, which starves CPU-bound jobs; pass your own options to use it.
        shutdown_timeout: Seconds that calls still in flight may run once every worker has
            finished the function (torch's graceful shutdown would wait for them forever).
            Past it, shutdown raises ``RuntimeError`` on every worker instead of hanging.
            Ctrl-C (``KeyboardInterrupt``, which torchrun forwards to every worker) does not
            wait: RPC is torn down locally and the interrupt propagates.

    Returns:
        A decorator for the entry function.

    Raises:
        TypeError: ``worker_init_fn`` or ``worker_name_format`` is not callable.

    Example:
        >>> import metadist
        >>> @metadist.auto_init_rpc()
        ... def main():
        ...     return metadist.get_world_size()
        >>> main()  # plain python: a world of 1
        1
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
            if world._RUNTIME is not None:  # already inside a world: just run
                return func(*args, **kwargs)
            return _run_in_world(
                functools.partial(func, *args, **kwargs),
                worker_init_fn=worker_init_fn,
                worker_name_format=worker_name_format,
                backend=backend,
                options=rpc_backend_options,
                shutdown_timeout=float(shutdown_timeout),
            )

        # record() writes the error file torchrun reports; it keeps the signature.
        return cast("Callable[P, R]", record(entry))

    return decorator


_M_ARENA_MAX = -8  # glibc's mallopt parameter number
ABORT_GRACE = 2.0  # seconds a Ctrl-C'd worker gives its local RPC teardown


def _limit_malloc_arenas() -> None:
    """Make RPC's handler threads allocate from glibc's main arena.

    RPC runs remote calls on a pool of threads, and glibc gives each new thread its own malloc
    arena. Those arenas hand freed memory back to the kernel and fault it in again on the next
    call: measured on the MAML benchmark, a 4-task forward took ~800 ms on an RPC thread (600 ms
    of it in the kernel) against 175 ms with one arena. ``mallopt(M_ARENA_MAX, 1)`` before the
    pool starts fixes it. A user-set ``MALLOC_ARENA_MAX`` wins, and
    ``METADIST_MALLOC_ARENA_MAX`` (``0`` = leave glibc alone) overrides the count.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    raw = os.environ.get("METADIST_MALLOC_ARENA_MAX", "1")
    try:
        arenas = int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable METADIST_MALLOC_ARENA_MAX={raw!r} must be an integer "
            f"(0 leaves glibc's default)"
        ) from None
    if arenas <= 0:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return
    mallopt(_M_ARENA_MAX, arenas)


def _env_required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ValueError(
            f"environment variable {name} is not set, but WORLD_SIZE is: launch with torchrun, "
            f"or set MASTER_ADDR and MASTER_PORT with RANK and WORLD_SIZE"
        )
    return value


def _plan(info: WorldInfo, timeout: float) -> tuple[network.Binding, str]:
    """Choose the interface to listen on and the rendezvous URL for this launch."""
    if "WORLD_SIZE" not in os.environ:
        binding = network.choose_binding("127.0.0.1")
        return binding, f"{network.LOCAL_SCHEME}://"
    master_addr = _env_required("MASTER_ADDR")
    master_port = _env_required("MASTER_PORT")
    if "LOCAL_WORLD_SIZE" in os.environ and info.local_world_size == info.world_size:
        # Every worker is on this node (torchrun sets LOCAL_WORLD_SIZE), so loopback reaches
        # them all, whatever MASTER_ADDR is: `--standalone` sets it to the host's FQDN, which
        # often resolves to a LAN address, and RPC must not listen there.
        binding = network.choose_binding("127.0.0.1")
    else:
        try:
            binding = network.choose_binding(
                master_addr, multi_node=info.local_world_size < info.world_size
            )
        except ValueError:
            # Interfaces the user chose are used as given: no need for metadist's own choice.
            user = network.user_binding()
            if user is None:
                raise
            binding = user
    _log_interface(info, binding, master_addr)
    if binding.loopback and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # torch's rendezvous adds rank and world_size to the query itself.
        return binding, f"{network.LOOPBACK_SCHEME}://127.0.0.1:{master_port}?timeout={timeout}"
    return binding, "env://"


def _log_interface(info: WorldInfo, binding: network.Binding, master_addr: str) -> None:
    """Say once when RPC will listen beyond loopback, naming the interface really used."""
    # A user-set TP_SOCKET_IFNAME wins over metadist's choice (see network.socket_ifname_env).
    ifname = os.environ.get("TP_SOCKET_IFNAME") or binding.ifname
    address = binding.address if ifname == binding.ifname else network._ipv4_of(ifname)
    try:
        if address is not None and ipaddress.ip_address(address).is_loopback:
            return
    except ValueError:  # an interface without an IPv4 address
        address = None
    why = (
        "set by TP_SOCKET_IFNAME"
        if os.environ.get("TP_SOCKET_IFNAME")
        else f"chosen to reach MASTER_ADDR={master_addr}"
    )
    logger.warning(
        "metadist: worker %d listens for RPC on interface %s (%s), %s; RPC is "
        "unauthenticated: run only on trusted networks",
        info.world_rank,
        ifname,
        address or "no IPv4 address",
        why,
    )


def _run_in_world(
    job: Callable[[], R],
    *,
    worker_init_fn: Callable[[], object] | None,
    worker_name_format: Callable[..., str],
    backend: rpc.BackendType | None,
    options: RpcBackendOptions | None,
    shutdown_timeout: float,
) -> R:
    info = world._world_info_from_env()
    name = worker_name_format(
        world_rank=info.world_rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        local_world_size=info.local_world_size,
    )
    if not isinstance(name, str) or not name:
        raise TypeError(f"worker_name_format must return a non-empty str, got {name!r}")
    if options is None:
        # TensorPipe's shared-memory transport busy-polls: each idle worker burns a whole core
        # (measured: 2.6 s of CPU per 3 s idle), which halves a CPU job with one worker per core.
        # The TCP transport ("uv", over loopback on one node) waits in epoll instead.
        options = rpc.TensorPipeRpcBackendOptions(_transports=["uv"])
    timeout = float(options.rpc_timeout)
    binding, url = _plan(info, timeout)
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
        world._activate(info, name, timeout)
        if worker_init_fn is not None:
            worker_init_fn()
        world.barrier()
        result = job()
    except KeyboardInterrupt:
        _abort()
        raise
    except BaseException:
        # Ctrl-C while shutting down after a failure (waiting for the other workers).
        try:
            _shutdown(name, shutdown_timeout, raise_errors=False)
        except KeyboardInterrupt:
            _abort()
        raise
    try:
        _shutdown(name, shutdown_timeout, raise_errors=True)
    except KeyboardInterrupt:  # Ctrl-C while waiting for the other workers to finish
        _abort()
        raise
    return result


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
    """Ctrl-C (torchrun forwards SIGINT to every worker): the user wants the job gone now.

    Tear RPC down locally instead of waiting for the other workers or for calls in flight;
    peers still waiting on this worker see it as dead and stop too. A shutdown already running
    (Ctrl-C during the graceful one) is given the time instead of starting a second one.
    """
    world._deactivate()
    deadline = time.monotonic() + ABORT_GRACE
    running = [t for t in _SHUTDOWN_THREAD if t.is_alive()]
    if not running:
        with contextlib.suppress(Exception, KeyboardInterrupt):
            _bounded_shutdown(ABORT_GRACE, graceful=False)
        running = [t for t in _SHUTDOWN_THREAD if t.is_alive()]
    # A second Ctrl-C (the terminal's and torchrun's) must not cut the teardown short.
    while running and (left := deadline - time.monotonic()) > 0:
        try:
            running[0].join(left)
        except KeyboardInterrupt:
            continue
        running = [t for t in running if t.is_alive()]


def _shutdown(name: str, grace: float, *, raise_errors: bool) -> None:
    problem = None
    try:
        dead = world._finish()
        if dead:
            problem = f"workers {dead} died before the job finished"
            # The graceful all-gather cannot complete without them. Tear down locally.
            with contextlib.suppress(Exception):
                rpc.shutdown(graceful=False)
        elif not _bounded_shutdown(grace, graceful=True):
            others = [rank for rank in range(world.get_world_size()) if rank != world.get_rank()]
            gone = world._unreachable(others, timeout=5.0)
            problem = (
                f"workers {gone} died after finishing their job; shutdown cannot complete"
                if gone
                else f"remote calls were still running {grace:g} s after every worker "
                f"finished its job (a call with timeout=None that never returns?); "
                f"exiting without waiting for them"
            )
    except Exception as error:
        problem = f"shutdown failed: {error}"
        with contextlib.suppress(Exception):
            rpc.shutdown(graceful=False)
    finally:
        world._deactivate()
    if problem is not None:
        message = f"RPC shutdown on worker {name!r}: {problem}"
        if raise_errors:
            raise RuntimeError(message)
        logger.warning("metadist: %s", message)
