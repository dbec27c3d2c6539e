"""metadist.network: which interface RPC listens on, and the rendezvous stores it serves.

In-process, no RPC: single-node runs must listen on loopback only, user-set interfaces win, and
metadist's rendezvous schemes bind where they say. The multi-node choice with a real second
"node" is in test_multinode.py.
"""

from __future__ import annotations

import os
import socket

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
