"""Where RPC listens and how workers rendezvous. RPC is unauthenticated and unpickles what it
receives, so TensorPipe and Gloo are pinned to the chosen interface (``*_SOCKET_IFNAME``), and a
loopback run's rendezvous store listens on ``127.0.0.1`` only (torch's binds every interface).

A loopback rendezvous never hangs on a port another program holds: rank 0 says the port is
taken, and the other ranks give up once the listener there fails to answer as a store (torch's
client would wait for its reply forever: its constructor's timeout bounds only connecting)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlparse

from torch.distributed import HashStore, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.rendezvous import register_rendezvous_handler, rendezvous

__all__ = [
    "ELASTIC_SCHEME",
    "LOCAL_SCHEME",
    "LOOPBACK_SCHEME",
    "STORE_ANSWER_S",
    "Binding",
    "choose_binding",
    "default_route_interface",
    "free_loopback_port",
    "install_rendezvous_handlers",
    "ipv4_of",
    "port_name",
    "socket_ifname_env",
    "user_binding",
]

LOCAL_SCHEME = "metadist-local"
LOOPBACK_SCHEME = "metadist-loopback"
ELASTIC_SCHEME = "metadist-elastic"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Binding:
    """Where this worker's RPC listens: an interface (``lo``, ``eth0``), its address, and
    whether the whole job runs on this host over loopback."""

    ifname: str
    address: str
    loopback: bool


def _resolve(host: str) -> str:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"MASTER_ADDR={host!r} does not resolve to an address: {error}") from None
    # Prefer IPv4, the common case for torchrun and for TensorPipe's uv transport.
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def ipv4_of(ifname: str) -> str | None:
    """The IPv4 address of interface ``ifname``, or ``None`` if it has none (or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            request = struct.pack("256s", ifname.encode()[:15])
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _interface_with_address(address: str) -> str | None:
    if ipaddress.ip_address(address).version == 4:
        return next((name for _, name in socket.if_nameindex() if ipv4_of(name) == address), None)
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for fields in map(str.split, table):
            if str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))) == address:
                return fields[-1]
    return None


def _route_source(address: str) -> str:
    """The local address the kernel would use to reach ``address`` (no packet is sent)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))  # UDP connect only selects a route
        return str(sock.getsockname()[0])


def default_route_interface() -> str | None:
    """The interface of the IPv4 default route (``/proc/net/route``), if there is one."""
    with contextlib.suppress(OSError), open("/proc/net/route") as table:
        for row in map(str.split, table.readlines()[1:]):
            if len(row) > 7 and row[1] == "00000000" and row[7] == "00000000":
                return row[0]
    return None


def choose_binding(master_addr: str, *, multi_node: bool = False) -> Binding:
    """Pick the interface to listen on for a job whose rank 0 is at ``master_addr``: loopback
    for a loopback master, else the one that routes there. A ``multi_node`` master whose name
    resolves to loopback (``127.0.1.1`` on Debian) uses the default route's interface instead,
    not to lock the other nodes out. ``ValueError`` when no interface fits."""
    resolved = _resolve(master_addr)
    loopback = ipaddress.ip_address(resolved).is_loopback
    if loopback and multi_node:
        ifname = default_route_interface()
        address = ipv4_of(ifname) if ifname is not None else None
        if ifname is None or address is None:
            raise ValueError(
                f"MASTER_ADDR={master_addr!r} resolves to the loopback address {resolved} on "
                f"this node, but the job spans several nodes and this node has no default "
                f"route to listen on instead; set MASTER_ADDR to an address the other nodes "
                f"can reach, or set TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME"
            )
        return Binding(ifname=ifname, address=address, loopback=False)
    source = "127.0.0.1" if loopback else _route_source(resolved)
    ifname = _interface_with_address(source)
    if ifname is None:
        raise ValueError(
            f"no network interface holds {source}, the address that routes to "
            f"MASTER_ADDR={master_addr!r}; set TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME"
        )
    return Binding(ifname=ifname, address=source, loopback=loopback)


def user_binding() -> Binding | None:
    """The interface the user set in ``TP_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` (``None``
    unless both are)."""
    tp = os.environ.get("TP_SOCKET_IFNAME")
    if not tp or not os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    address = ipv4_of(tp)
    loopback = address is not None and ipaddress.ip_address(address).is_loopback
    return Binding(ifname=tp, address=address or "unknown", loopback=loopback)


@contextlib.contextmanager
def socket_ifname_env(ifname: str) -> Iterator[None]:
    """Set ``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` to ``ifname`` where the user has not,
    while RPC starts: nothing else in the process (or its children) inherits the choice."""
    saved = {name: os.environ.get(name) for name in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    os.environ.update({name: ifname for name, value in saved.items() if not value})  # user's win
    try:
        yield
    finally:
        for name in saved:
            os.environ.pop(name, None)
        os.environ.update({name: value for name, value in saved.items() if value is not None})


def free_loopback_port() -> int:
    """Return a TCP port that is free on ``127.0.0.1`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _local_handler(url: str, **kwargs: object) -> Iterator[tuple[Store, int, int]]:
    # A world of 1 rendezvous with itself: an in-process store, no listening socket.
    yield HashStore(), 0, 1


#: Seconds the rendezvous store has, once its port accepts connections, to answer a rank that
#: joins it (rank 0's answers at once; a program that listens and never reads does not).
STORE_ANSWER_S = 5.0


def port_name(port: int, origin: str = "MASTER_PORT") -> str:
    """How a message names the rendezvous port: ``MASTER_PORT=29500``, or where it came from."""
    if origin == "MASTER_PORT":
        return f"MASTER_PORT={port}"
    return f"port {port} (derived from {origin}; set MASTER_PORT to choose another)"


def _loopback_handler(url: str, **kwargs: object) -> Iterator[tuple[Store, int, int]]:
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = float(query.get("timeout", "300"))
    port = int(parsed.port or 0)
    name = port_name(port, query.get("port_from", "MASTER_PORT"))
    open_store = _serve_store if rank == 0 else _join_store
    yield open_store(port, world_size, timeout, name), rank, world_size


# The ports this process's rendezvous stores listened on (a later world cannot listen there).
_SERVED_PORTS: set[int] = set()


def _serve_store(port: int, world_size: int, timeout: float, name: str) -> TCPStore:
    # Rank 0 hands the store its own listening socket (create_server sets SO_REUSEADDR).
    try:
        fd = socket.create_server(("127.0.0.1", port), backlog=128).detach()
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
        if port in _SERVED_PORTS:
            raise OSError(
                errno.EADDRINUSE,
                f"{name} served the rendezvous of an earlier RPC world in this process and is "
                f"still taken (torch keeps the first world's store open until the process "
                f"exits), so this later world cannot listen there. Run one RPC world per "
                f"process, or give each later world its own MASTER_PORT, the same on every rank",
            ) from None
        raise OSError(
            errno.EADDRINUSE,
            f"{name} is taken: another process already listens on port {port} of this machine "
            f"(an earlier job still running, or another program), so rank 0 cannot serve the "
            f"rendezvous there. Choose a free MASTER_PORT for every rank (`ss -ltnp | grep "
            f":{port}` shows who holds this one), or launch with `torchrun --standalone`, which "
            f"picks one",
        ) from None
    store = TCPStore(
        "127.0.0.1",
        port,
        world_size,
        True,
        datetime.timedelta(seconds=timeout),
        master_listen_fd=fd,
    )
    _SERVED_PORTS.add(port)
    return store


def _join_store(port: int, world_size: int, timeout: float, name: str) -> TCPStore:
    """Connect to rank 0's store on loopback within ``timeout`` seconds, whatever listens there."""
    deadline = time.monotonic() + timeout
    where = f"127.0.0.1:{port} ({name}; the job runs on one node, so its ranks meet over loopback)"
    _wait_for_listener(port, deadline, timeout, where)
    # torch's client (see the module's description) runs in a daemon thread, abandoned (blocked
    # in a socket read, holding no lock) if no reply comes, so the process can raise and exit.
    remaining = max(deadline - time.monotonic(), 0.001)
    outcome: list[TCPStore | BaseException] = []
    done = threading.Event()

    def connect() -> None:
        try:
            outcome.append(
                TCPStore(
                    "127.0.0.1", port, world_size, False, datetime.timedelta(seconds=remaining)
                )
            )
        except BaseException as error:  # handed to the waiting thread below
            outcome.append(error)
        finally:
            done.set()

    threading.Thread(target=connect, name="metadist-store-client", daemon=True).start()
    grace = min(STORE_ANSWER_S, remaining)
    advice = (
        "Another job or program holds that port (rank 0 then fails saying it is taken): "
        "choose a free MASTER_PORT for every rank, or launch with `torchrun --standalone`"
    )
    if not done.wait(grace):
        raise ConnectionError(
            f"the rendezvous at {where} accepted the connection but did not answer as rank 0's "
            f"store within {grace:g} s. {advice}"
        )
    if isinstance(outcome[0], BaseException):
        raise ConnectionError(
            f"the rendezvous at {where} failed: {outcome[0]}. If rank 0 is not the one "
            f"listening there: {advice}"
        ) from outcome[0]
    return outcome[0]


def _wait_for_listener(port: int, deadline: float, timeout: float, where: str) -> None:
    """Return once something listens on loopback ``port``; ``TimeoutError`` at ``deadline``."""
    pause = 0.05
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"nothing listens for the rendezvous at {where} after {timeout:g} s: rank 0 has "
                f"not started its store (check rank 0's log: it may have failed or not been "
                f"launched), or it was given another MASTER_PORT than this rank"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=min(left, 1.0)):
                return
        except OSError:  # refused: nothing listens yet
            time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(pause * 2, 0.5)


def _elastic_handler(url: str, **kwargs: Any) -> Iterator[tuple[Store, int, int]]:
    # torchrun's agent keeps one store across restarts, where a restarted worker would read the
    # dead one's address under the same key: a key prefix per attempt keeps them apart.
    store, rank, world_size = next(rendezvous("env://?" + urlparse(url).query, **kwargs))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    yield PrefixStore(f"metadist/attempt_{attempt}", store), rank, world_size


def install_rendezvous_handlers() -> None:
    """Register metadist's rendezvous schemes (idempotent)."""
    for scheme, handler in (
        (LOCAL_SCHEME, _local_handler),
        (LOOPBACK_SCHEME, _loopback_handler),
        (ELASTIC_SCHEME, _elastic_handler),
    ):
        with contextlib.suppress(RuntimeError):  # registered already
            register_rendezvous_handler(scheme, handler)
