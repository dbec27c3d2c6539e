"""metadist.environment and metadist.launch: how a process joins a world, from the launcher's
environment to shutdown.

Launcher environments (torchrun, ``srun``, ``mpirun``, plain python), the master's address, the
interface and rendezvous a launch chooses, process tuning and the entry decorator's arguments.
No SLURM or MPI is needed: the tests start processes with the variables those launchers set.
Shutdown liveness (dead and hung peers) is in test_faults.py.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time

import pytest
from _dist import REPO, run_command, skip_or_fail
from hypothesis import given
from hypothesis import strategies as st

import metadist
from metadist import network
from metadist.environment import (
    SLURM_PORT_BASE,
    expand_hostlist,
    master_address,
    read_launch_environment,
    tasks_per_node,
)
from metadist.launch import _listener_and_rendezvous

SCRIPT = REPO / "tests" / "scripts" / "multinode_worker.py"
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "TP_SOCKET", "GLOO_SOCKET", "TORCHELASTIC_")
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _without_launchers(environ: dict[str, str]) -> dict[str, str]:
    return {
        name: value
        for name, value in environ.items()
        if name not in TORCHRUN_VARS and not name.startswith(LAUNCHER_PREFIXES)
    }


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in set(os.environ) - set(_without_launchers(dict(os.environ))):
        monkeypatch.delenv(name)
    return monkeypatch


# ---------------------------------------------------------------------------------------------
# SLURM's compressed host lists


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node[08-10]", ["node08", "node09", "node10"]),  # the padding of the lower bound
        ("node[9-11]", ["node9", "node10", "node11"]),
        ("login,gpu[1-2]", ["login", "gpu1", "gpu2"]),
        ("gpu[1-2],login", ["gpu1", "gpu2", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("gpu-[3,5].cluster.org", ["gpu-3.cluster.org", "gpu-5.cluster.org"]),
        ("a[0]", ["a0"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_hostlist_expands_like_slurm(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    "hostlist", ["", "node[1-", "node]1[", "node[3-1]", "node[a-b]", "a,,b", "node[]", "n[1-2-3]"]
)
def test_malformed_hostlist_is_quoted(hostlist: str) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"cannot read the SLURM host list {hostlist!r}")
    ):
        expand_hostlist(hostlist)


def _compress(numbers: list[int], width: int) -> str:
    """SLURM's bracket form of ``numbers`` (sorted, distinct), runs written as ranges."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ",".join(
        f"{run[0]:0{width}d}" + (f"-{run[-1]:0{width}d}" if len(run) > 1 else "") for run in runs
    )


host_groups = st.tuples(
    st.from_regex(r"[a-z][a-z0-9-]{0,6}", fullmatch=True),
    st.lists(st.integers(0, 999), min_size=1, max_size=12, unique=True).map(sorted),
    st.integers(1, 4),
    st.sampled_from(["", ".ib", "-gpu"]),
)


@given(st.lists(host_groups, min_size=1, max_size=4))
def test_hostlist_round_trips_compressed_groups(
    groups: list[tuple[str, list[int], int, str]],
) -> None:
    parts, expected = [], []
    for prefix, numbers, width, suffix in groups:
        parts.append(f"{prefix}[{_compress(numbers, width)}]{suffix}")
        expected += [f"{prefix}{number:0{width}d}{suffix}" for number in numbers]
    assert expand_hostlist(",".join(parts)) == expected


@given(st.lists(st.from_regex(r"[a-z][a-z0-9.-]{0,10}", fullmatch=True), min_size=1, max_size=6))
def test_plain_host_names_pass_through(hosts: list[str]) -> None:
    assert expand_hostlist(",".join(hosts)) == hosts


@pytest.mark.parametrize(
    ("spec", "counts"), [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])]
)
def test_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert tasks_per_node(spec) == counts


# ---------------------------------------------------------------------------------------------
# World information and the master's address from each launcher's variables


def test_srun_world_info(no_launcher: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x3),2",
    }.items():
        no_launcher.setenv(name, value)
    assert read_launch_environment().launcher == "srun"
    assert metadist.get_world_info() == metadist.WorldInfo(5, 8, 1, 2)
    rank, size, local_rank, local_size = metadist.get_world_info()  # unpacks, as TorchOpt's
    assert (rank, size, local_rank, local_size) == (5, 8, 1, 2)
    # --ntasks-per-node sets SLURM_NTASKS_PER_NODE; one node needs neither.
    no_launcher.delenv("SLURM_TASKS_PER_NODE")
    no_launcher.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert metadist.get_local_world_size() == 4
    no_launcher.delenv("SLURM_NTASKS_PER_NODE")
    no_launcher.setenv("SLURM_NNODES", "2")
    with pytest.raises(ValueError, match=r"neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE"):
        metadist.get_world_info()
    no_launcher.setenv("SLURM_NNODES", "1")
    assert metadist.get_world_info() == metadist.WorldInfo(5, 8, 1, 8)
    no_launcher.setenv("SLURM_PROCID", "8")
    with pytest.raises(ValueError, match=r"SLURM_PROCID=8 must be in \[0, SLURM_NTASKS=8\)"):
        metadist.get_world_info()
    no_launcher.setenv("SLURM_PROCID", "0")
    no_launcher.setenv("SLURM_TASKS_PER_NODE", "2(x")
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE='2\(x' is not in SLURM's syntax"):
        metadist.get_world_info()


def test_mpirun_world_info(no_launcher: pytest.MonkeyPatch) -> None:
    for name, value in {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }.items():
        no_launcher.setenv(name, value)
    assert read_launch_environment().launcher == "mpirun"
    assert metadist.get_world_info() == metadist.WorldInfo(3, 4, 1, 2)
    # mpirun inside a SLURM allocation: the allocation's SLURM_PROCID=0 is not this rank.
    no_launcher.setenv("SLURM_PROCID", "0")
    no_launcher.setenv("SLURM_NTASKS", "4")
    assert metadist.get_rank() == 3
    # torchrun's variables win over every other launcher's.
    no_launcher.setenv("WORLD_SIZE", "2")
    no_launcher.setenv("RANK", "1")
    assert read_launch_environment().launcher == "torchrun"
    assert metadist.get_world_info() == metadist.WorldInfo(1, 2, 1, 2)
    no_launcher.delenv("WORLD_SIZE")
    no_launcher.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_LOCAL_SIZE is not set, but mpirun"):
        metadist.get_world_info()


def test_master_address_rules(no_launcher: pytest.MonkeyPatch) -> None:
    no_launcher.setenv("SLURM_JOB_NODELIST", "gpu[07-08],cpu01")
    no_launcher.setenv("SLURM_JOB_ID", "123456")
    assert master_address("srun") == ("gpu07", SLURM_PORT_BASE + 123456 % 15000)
    # The step may run on part of the job's nodes: its own list comes first.
    no_launcher.setenv("SLURM_STEP_NODELIST", "cpu01")
    assert master_address("srun")[0] == "cpu01"
    # MASTER_ADDR and MASTER_PORT, when set, always win.
    no_launcher.setenv("MASTER_ADDR", "head")
    no_launcher.setenv("MASTER_PORT", "29400")
    assert master_address("srun") == ("head", 29400)
    no_launcher.delenv("MASTER_PORT")
    no_launcher.setenv("SLURM_JOB_ID", "")
    with pytest.raises(ValueError, match=r"SLURM_JOB_ID='' is not a job number.*set MASTER_PORT"):
        master_address("srun")
    no_launcher.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match=r"MASTER_ADDR and MASTER_PORT are not set, but mpirun"):
        master_address("mpirun")
    no_launcher.setenv("MASTER_ADDR", "head")
    with pytest.raises(ValueError, match=r"variable MASTER_PORT is not set, but torchrun"):
        master_address("torchrun")
    no_launcher.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match=r"MASTER_PORT='http' must be a TCP port"):
        master_address("mpirun")


def test_mpirun_without_master_fails_before_starting_rpc(no_launcher: pytest.MonkeyPatch) -> None:
    for name, value in {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }.items():
        no_launcher.setenv(name, value)
    with pytest.raises(ValueError, match=r"MASTER_ADDR and MASTER_PORT are not set.*mpirun -x"):
        metadist.auto_init_rpc()(metadist.get_world_size)()
    assert not metadist.world.in_rpc_world()


# ---------------------------------------------------------------------------------------------
# The entry decorator: what it refuses, and what it chooses before RPC starts


def test_listening_interface_and_rendezvous(no_launcher: pytest.MonkeyPatch) -> None:
    # Which interface a launch listens on, decided before RPC starts (no RPC needed).
    for name in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        no_launcher.delenv(name, raising=False)
    multi = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    for name, value in {**multi, "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "1"}.items():
        no_launcher.setenv(name, value)
    launch = read_launch_environment()
    with pytest.raises(ValueError, match=r"MASTER_ADDR='no-such-host.invalid' does not resolve"):
        _listener_and_rendezvous(launch, 60.0)
    # User-set interfaces always win: metadist neither second-guesses nor fails on them.
    no_launcher.setenv("TP_SOCKET_IFNAME", "lo")
    no_launcher.setenv("GLOO_SOCKET_IFNAME", "lo")
    binding, _ = _listener_and_rendezvous(launch, 60.0)
    assert (binding.ifname, binding.address) == ("lo", "127.0.0.1")
    # One node, whatever MASTER_ADDR names: loopback, served by metadist's loopback store.
    no_launcher.delenv("TP_SOCKET_IFNAME")
    no_launcher.delenv("GLOO_SOCKET_IFNAME")
    no_launcher.setenv("LOCAL_WORLD_SIZE", "4")
    binding, url = _listener_and_rendezvous(read_launch_environment(), 60.0)
    assert binding.loopback
    assert binding.ifname == "lo"
    assert url.startswith("metadist-loopback://127.0.0.1:1?")


def test_auto_init_rpc_rejects_non_callables() -> None:
    with pytest.raises(TypeError, match="worker_init_fn must be callable or None, got 3"):
        metadist.auto_init_rpc(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="worker_name_format must be callable"):
        metadist.auto_init_rpc(None, "worker{rank}")  # type: ignore[arg-type]


def test_malloc_tuning_variable_is_checked_before_rpc_starts(
    no_launcher: pytest.MonkeyPatch,
) -> None:
    no_launcher.setenv("METADIST_MALLOC_ARENA_MAX", "many")
    with pytest.raises(ValueError, match=r"METADIST_MALLOC_ARENA_MAX='many' must be an integer"):
        metadist.auto_init_rpc()(metadist.get_world_size)()
    assert not metadist.world.in_rpc_world()


# ---------------------------------------------------------------------------------------------
# Real processes started with only a launcher's variables


def _free_port_in_slurm_range() -> int:
    """A loopback port the SLURM rule can give (SLURM_PORT_BASE + job id % 15000), free now."""
    for _ in range(100):
        port = random.randrange(SLURM_PORT_BASE, SLURM_PORT_BASE + 15000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in the SLURM port range")


def _run_job(per_rank_env: list[dict[str, str]]) -> list[str]:
    base = _without_launchers(dict(os.environ))
    base.update(PYTHONPATH=f"{REPO / 'tests'}{os.pathsep}{REPO}", PYTHONUNBUFFERED="1")
    processes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in per_rank_env
    ]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=100))
    finally:
        for process in processes:
            process.kill()
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
        assert "listens for RPC on interface" not in stderr, stderr
    return [stdout for stdout, _ in outputs]


def _check_single_node_job(stdouts: list[str], size: int) -> None:
    for rank, stdout in enumerate(stdouts):
        assert (
            f"INFO rank={rank} size={size} local_rank={rank} local_size={size} name=worker{rank}"
            in stdout
        ), stdout
    # One node: every worker listens on loopback only, whatever the node is called.
    assert "ROUNDTRIP OK peer=worker1 peer_listens=['127.0.0.1']" in stdouts[0], stdouts[0]
    assert "SELF listens=['127.0.0.1']" in stdouts[0], stdouts[0]


@pytest.mark.timeout(150)
def test_three_processes_started_by_srun_variables_alone() -> None:
    port = _free_port_in_slurm_range()
    job = {
        "SLURM_JOB_ID": str(7 * 15000 + port - SLURM_PORT_BASE),
        "SLURM_JOB_NODELIST": socket.gethostname(),
        "SLURM_NTASKS": "3",
        "SLURM_NNODES": "1",
        "SLURM_TASKS_PER_NODE": "3",
        "SLURM_NODEID": "0",
    }
    ranks = [{**job, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(3)]
    _check_single_node_job(_run_job(ranks), 3)


@pytest.mark.timeout(150)
def test_two_processes_started_by_mpirun_variables() -> None:
    job = {
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": socket.gethostname(),
        "MASTER_PORT": str(_free_port_in_slurm_range()),
    }
    ranks = [
        {**job, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}
        for r in range(2)
    ]
    _check_single_node_job(_run_job(ranks), 2)


@pytest.mark.timeout(120)
def test_single_node_torchrun_listens_on_loopback_whatever_master_addr_is() -> None:
    # torchrun --standalone sets MASTER_ADDR to the host's FQDN, which on many machines resolves
    # to a LAN address; a single-node job must still keep RPC off the network.
    ifname = network.default_route_interface()
    lan = network.ipv4_of(ifname) if ifname is not None else None
    if lan is None:
        skip_or_fail("this machine has no non-loopback IPv4 address to use as MASTER_ADDR")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        f"--master_addr={lan}",
        f"--master_port={network.free_loopback_port()}",
        str(REPO / "tests" / "scripts" / "multinode_worker.py"),
    ]
    result = run_command(
        command, timeout=100, env={"PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{REPO}"}
    )
    assert result.returncode == 0, result.stderr
    assert "ROUNDTRIP OK peer=worker1" in result.stdout, result.stdout
    peer = result.stdout.split("peer_listens=")[1].splitlines()[0]
    mine = result.stdout.split("SELF listens=")[1].splitlines()[0]
    assert peer == mine == "['127.0.0.1']", result.stdout
    assert "listens for RPC on interface" not in result.stderr, result.stderr


@pytest.mark.timeout(120)
def test_a_taken_master_port_fails_every_rank_naming_it() -> None:
    # Another program listens on MASTER_PORT and never answers: rank 0 cannot bind it, and the
    # other ranks' connections land in that program's queue, where torch's client alone would
    # wait forever for the store's reply.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        base = _without_launchers(dict(os.environ))
        base.update(PYTHONPATH=f"{REPO / 'tests'}{os.pathsep}{REPO}", PYTHONUNBUFFERED="1")
        job = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        start = time.monotonic()
        processes = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT)],
                env={**base, **job, "RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            outputs = [process.communicate(timeout=60) for process in processes]
        finally:
            for process in processes:
                process.kill()
        elapsed = time.monotonic() - start
    (_, err0), (_, err1) = outputs
    assert processes[0].returncode != 0, err0
    assert f"OSError: [Errno 98] MASTER_PORT={port} is taken: another process" in err0, err0
    assert processes[1].returncode != 0, err1
    assert (
        f"ConnectionError: the rendezvous at 127.0.0.1:{port} (MASTER_PORT={port}; the job "
        f"runs on one node" in err1
    ), err1
    assert "did not answer as rank 0's store within 5 s" in err1, err1
    assert elapsed < 40, elapsed  # startup, then STORE_ANSWER_S: not the 60 s RPC timeout
