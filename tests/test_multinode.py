"""Two "nodes" in two network namespaces joined by a veth pair: RPC picks the right interface.

The addresses are from TEST-NET-2 (198.51.100.0/24, reserved for documentation) and exist only
inside the namespaces this test creates; no traffic leaves them. ``ip netns exec`` mounts
``/etc/netns/<name>/hosts`` over ``/etc/hosts``, which gives each "node" its own host names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _dist import REPO, skip_or_fail

SCRIPT = REPO / "tests" / "scripts" / "multinode_worker.py"
MASTER, PEER = "198.51.100.1", "198.51.100.2"
MASTER_NAME = "mdmaster"
# srun's variables name the nodes in SLURM's compressed form; the first is the master.
SLURM_NODELIST, SLURM_MASTER_NODE = "mdnode[01-02]", "mdnode01"
PORT = 29511


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _setup(*args: str) -> None:
    """One step of building the namespaces; a machine that forbids it skips (CI: fails)."""
    try:
        _ip(*args)
    except (subprocess.CalledProcessError, OSError) as error:
        why = getattr(error, "stderr", None) or error
        skip_or_fail(f"cannot build network namespaces here: `ip {' '.join(args)}`: {why}")


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    if shutil.which("ip") is None:
        skip_or_fail("iproute2's `ip` is not installed: cannot build network namespaces")
    tag = uuid.uuid4().hex[:6]
    hosts = (f"md{tag}a", f"md{tag}b")
    links = (f"md{tag}x", f"md{tag}y")
    # skip_or_fail inside the try still runs the cleanup in finally.
    try:
        for host in hosts:
            _setup("netns", "add", host)
        _setup("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, link, address in zip(hosts, links, (MASTER, PEER), strict=True):
            _setup("link", "set", link, "netns", host)
            _setup("-n", host, "addr", "add", f"{address}/24", "dev", link)
            _setup("-n", host, "link", "set", link, "up")
            _setup("-n", host, "link", "set", "lo", "up")
            _setup("-n", host, "route", "add", "default", "dev", link)
        # As on Debian, the master's own host name resolves to 127.0.1.1 on the master.
        for host, master in zip(hosts, ("127.0.1.1", MASTER), strict=True):
            etc = Path("/etc/netns") / host
            try:
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(
                    f"127.0.0.1 localhost\n{master} {MASTER_NAME} {SLURM_MASTER_NODE}\n"
                )
            except OSError as error:
                skip_or_fail(f"cannot give the namespaces their own /etc/hosts: {error}")
        # `ip netns exec` mounts sysfs and the hosts file: rootless runners may refuse.
        _setup("netns", "exec", hosts[0], "true")
        yield hosts
    finally:
        for host in hosts:
            subprocess.run(
                ["ip", "netns", "del", host], check=False, capture_output=True, timeout=10
            )
            shutil.rmtree(Path("/etc/netns") / host, ignore_errors=True)


def _torchrun_env(master_addr: str, rank: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(PORT),
    }


def _srun_env(rank: int) -> dict[str, str]:
    # No MASTER_*: the master is the first node of the list, the port comes from the job id.
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(rank),
        "SLURM_NNODES": "2",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_JOB_NODELIST": SLURM_NODELIST,
        "SLURM_JOB_ID": str(3 * 15000 + PORT - 15000),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "launch",
    ["address", "hostname", "srun"],
    ids=["address", "hostname-that-is-loopback-on-the-master", "srun-variables-only"],
)
def test_rpc_round_trip_across_namespaces_picks_routing_interface(
    two_hosts: tuple[str, str], launch: str
) -> None:
    keep = ("_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.endswith(keep)}
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "OMPI_", "LOCAL_"))}
    env.update(PYTHONPATH=f"{REPO / 'tests'}{os.pathsep}{REPO}", PYTHONUNBUFFERED="1")

    def launcher_env(rank: int) -> dict[str, str]:
        if launch == "srun":
            return _srun_env(rank)
        return _torchrun_env(MASTER if launch == "address" else MASTER_NAME, rank)

    processes = [
        subprocess.Popen(
            ["ip", "netns", "exec", host, sys.executable, str(SCRIPT)],
            env={**env, **launcher_env(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, host in enumerate(two_hosts)
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=90))
    finally:
        for process in processes:
            process.kill()
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    master_out = outputs[0][0]
    assert "ROUNDTRIP OK peer=worker1" in master_out, master_out
    # Each worker listens on its veth address, which routes to MASTER_ADDR, and says so once.
    assert f"'{PEER}'" in master_out.split("peer_listens=")[1], master_out
    assert MASTER in master_out.split("SELF listens=")[1], master_out
    for _, stderr in outputs:
        assert stderr.count("listens for RPC on interface md") == 1, stderr
