"""metadist.network: which interface RPC listens on, and the rendezvous stores it serves.

In-process, no RPC: single-node runs must listen on loopback only, user-set interfaces win, and
metadist's rendezvous schemes bind where they say. The multi-node choice with a real second
"node" is in test_multinode.py.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from _dist import listening_addresses
from torch.distributed import HashStore, TCPStore  # type: ignore[attr-defined]
from torch.distributed.rendezvous import rendezvous

from metadist import network
from metadist.network import Binding

IFNAME_VARS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@pytest.fixture
def no_ifname(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in IFNAME_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_loopback_master_binds_loopback() -> None:
    for master in ("127.0.0.1", "localhost"):
        assert network.choose_binding(master) == Binding("lo", "127.0.0.1", loopback=True)
    with pytest.raises(ValueError, match=r"MASTER_ADDR='no-such-host.invalid' does not resolve"):
        network.choose_binding("no-such-host.invalid")


def test_multi_node_job_never_listens_on_a_loopback_master_address() -> None:
    # On the master node MASTER_ADDR may be its own name, resolving to 127.0.1.1 (Debian): the
    # other nodes could not reach it there, so the default route's interface is used instead.
    route = network.default_route_interface()
    address = network.ipv4_of(route) if route is not None else None
    if address is None:
        with pytest.raises(ValueError, match=r"spans several nodes.*no default route"):
            network.choose_binding("127.0.0.1", multi_node=True)
        return
    binding = network.choose_binding("127.0.0.1", multi_node=True)
    assert binding == Binding(route, address, loopback=False)  # type: ignore[arg-type]
    # A master elsewhere is reached through the interface that routes to it.
    assert network.choose_binding(address) == Binding(route, address, loopback=False)  # type: ignore[arg-type]


def test_interface_addresses() -> None:
    assert network.ipv4_of("lo") == "127.0.0.1"
    assert network.ipv4_of("no-such-if0") is None
    route = network.default_route_interface()
    assert route is None or route in {name for _, name in socket.if_nameindex()}


def test_user_interfaces_always_win(no_ifname: pytest.MonkeyPatch) -> None:
    assert network.user_binding() is None
    no_ifname.setenv("TP_SOCKET_IFNAME", "lo")
    assert network.user_binding() is None  # both or neither: Gloo listens too
    no_ifname.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert network.user_binding() == Binding("lo", "127.0.0.1", loopback=True)
    no_ifname.setenv("TP_SOCKET_IFNAME", "no-such-if0")
    assert network.user_binding() == Binding("no-such-if0", "unknown", loopback=False)


def test_interface_variables_are_set_only_while_rpc_starts(no_ifname: pytest.MonkeyPatch) -> None:
    with network.socket_ifname_env("lo"):
        assert [os.environ.get(name) for name in IFNAME_VARS] == ["lo", "lo"]
    assert not any(name in os.environ for name in IFNAME_VARS)
    no_ifname.setenv("TP_SOCKET_IFNAME", "eth7")  # the user's choice is kept and restored
    with network.socket_ifname_env("lo"):
        assert [os.environ.get(name) for name in IFNAME_VARS] == ["eth7", "lo"]
    assert os.environ["TP_SOCKET_IFNAME"] == "eth7"
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_free_loopback_port_is_free() -> None:
    port = network.free_loopback_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_world_of_one_rendezvous_opens_no_socket() -> None:
    network.install_rendezvous_handlers()
    network.install_rendezvous_handlers()  # again: a second auto_init_rpc in the same process
    before = listening_addresses()
    store, rank, size = next(rendezvous(f"{network.LOCAL_SCHEME}://"))
    assert (isinstance(store, HashStore), rank, size) == (True, 0, 1)
    assert listening_addresses() == before


def test_loopback_rendezvous_store_listens_on_loopback_only() -> None:
    # torch's own tcp:// store would listen on every interface.
    network.install_rendezvous_handlers()
    port = network.free_loopback_port()
    url = f"{network.LOOPBACK_SCHEME}://127.0.0.1:{port}?timeout=10"
    store, rank, size = next(rendezvous(url, rank=0, world_size=1))
    assert (rank, size) == (0, 1)
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert [address for address, p in listening_addresses() if p == port] == ["127.0.0.1"]


def test_elastic_rendezvous_keeps_restarts_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's agent keeps one store across restarts: each attempt gets its own key prefix.
    network.install_rendezvous_handlers()
    port = network.free_loopback_port()
    server = TCPStore("127.0.0.1", port, 1, True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    store, rank, size = next(rendezvous(f"{network.ELASTIC_SCHEME}://", rank=0, world_size=1))
    assert (rank, size) == (0, 1)
    store.set("address", "here")
    assert server.get("metadist/attempt_3/address") == b"here"


# A port another program holds (here a socket that listens and never accepts: the kernel still
# completes the handshake, so a client connects and then waits for a reply that never comes).


@pytest.fixture
def foreign_listener() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener.getsockname()[1]


def _loopback_url(port: int, timeout: float) -> str:
    return f"{network.LOOPBACK_SCHEME}://127.0.0.1:{port}?timeout={timeout}&port_from=MASTER_PORT"


def test_rank_0_on_a_taken_port_names_master_port(foreign_listener: int) -> None:
    network.install_rendezvous_handlers()
    port = foreign_listener
    with pytest.raises(OSError, match=rf"MASTER_PORT={port} is taken: another process") as info:
        next(rendezvous(_loopback_url(port, 10), rank=0, world_size=2))
    assert info.value.errno == errno.EADDRINUSE
    assert "Choose a free MASTER_PORT for every rank" in str(info.value)


@pytest.mark.timeout(30)
def test_other_ranks_give_up_on_a_listener_that_is_not_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's client alone waits here forever, whatever its timeout.
    network.install_rendezvous_handlers()
    monkeypatch.setattr(network, "STORE_ANSWER_S", 1.0)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ConnectionError) as info:
            next(rendezvous(_loopback_url(port, 3), rank=1, world_size=2))
        assert time.monotonic() - start < 2.5
    message = str(info.value)
    assert f"127.0.0.1:{port} (MASTER_PORT={port};" in message, message
    assert "did not answer as rank 0's store within 1 s" in message, message
    assert "choose a free MASTER_PORT for every rank" in message, message
    # The client thread left behind ends at its own timeout (3 s) now that the port is free.
    left = [t for t in threading.enumerate() if t.name == "metadist-store-client"]
    for thread in left:
        thread.join(15)
    assert not any(thread.is_alive() for thread in left)


@pytest.mark.timeout(30)
def test_other_ranks_without_rank_0_time_out_naming_the_port() -> None:
    network.install_rendezvous_handlers()
    port = network.free_loopback_port()
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        next(rendezvous(_loopback_url(port, 1), rank=1, world_size=2))
    assert time.monotonic() - start < 2.5
    message = str(info.value)
    assert f"nothing listens for the rendezvous at 127.0.0.1:{port} (MASTER_PORT={port};" in message
    assert "after 1 s: rank 0 has not started its store" in message, message


@pytest.mark.timeout(30)
def test_a_rank_that_starts_before_rank_0_waits_for_its_store() -> None:
    network.install_rendezvous_handlers()
    port = network.free_loopback_port()
    joined: list[object] = []

    def join() -> None:
        store, _, _ = next(rendezvous(_loopback_url(port, 20), rank=1, world_size=2))
        joined.append(store.get("from rank 0"))

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    time.sleep(0.5)  # rank 1 waits for a listener meanwhile
    store, _, _ = next(rendezvous(_loopback_url(port, 20), rank=0, world_size=2))
    store.set("from rank 0", "hello")
    thread.join(20)
    assert joined == [b"hello"]


def test_port_names_say_where_the_port_came_from() -> None:
    assert network.port_name(29500) == "MASTER_PORT=29500"
    assert network.port_name(15007, "SLURM_JOB_ID") == (
        "port 15007 (derived from SLURM_JOB_ID; set MASTER_PORT to choose another)"
    )
