"""Helpers to run real multi-process RPC worlds from tests (no mocks of RPC).

``run_world(fn, world_size, *args)`` spawns ``world_size`` processes over loopback; each runs
``fn(rank, world_size, *args)`` inside :func:`metadist.auto_init_rpc`. A child's exception fails
the test with the child's traceback; a world that outlives ``timeout`` is killed.

``skip_or_fail(reason)`` is how a test says it cannot run here: a skip on a developer's machine,
a failure under CI (``CI=true``), where a skip would read as a pass.

``run_scenarios(scenarios, world_size)`` starts one world for many checks: rank 0 runs every
scenario in turn (the other ranks serve its calls) and records each one's traceback, so that a
module-scoped fixture can report every scenario under its own test id (:class:`Scenarios`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch.multiprocessing as mp

import metadist
from metadist.network import free_loopback_port

REPO = Path(__file__).resolve().parents[1]


def in_ci() -> bool:
    """Whether the tests run in CI (``CI=true``, as CI services and .ci/run set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test, saying why; under CI fail instead: there, everything must run."""
    __tracebackhide__ = True  # report the test that cannot run, not this helper
    if in_ci():
        pytest.fail(f"CI=true, and this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _child(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: Mapping[str, str],
    init_kwargs: Mapping[str, Any],
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    metadist.auto_init_rpc(**init_kwargs)(fn)(rank, world_size, *args)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    init_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned RPC workers.

    ``fn`` must be a module-level function of an importable module (it is pickled by reference).
    """
    port = free_loopback_port()
    context = mp.start_processes(
        _child,
        args=(fn, world_size, port, args, dict(env or {}), dict(init_kwargs or {})),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"world of {world_size} running {fn.__name__} exceeded {timeout} s"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def _run_scenarios(
    rank: int, world_size: int, scenarios: Sequence[Callable[[int], Any]], out: str
) -> None:
    if rank != 0:
        return  # serve rank 0's calls until it is done
    results: dict[str, str | None] = {}
    for scenario in scenarios:
        try:
            scenario(world_size)
        except Exception:
            results[scenario.__name__] = traceback.format_exc()
        else:
            results[scenario.__name__] = None
    Path(out).write_text(json.dumps(results))


class Scenarios:
    """Outcome of :func:`run_scenarios`: ``check(name)`` fails with that scenario's traceback."""

    def __init__(self, results: Mapping[str, str | None], error: str | None) -> None:
        self.results = dict(results)
        self.error = error

    def check(self, name: str) -> None:
        if name not in self.results:
            raise AssertionError(f"scenario {name} did not run: {self.error or 'not recorded'}")
        failure = self.results[name]
        if failure is not None:
            raise AssertionError(f"scenario {name} failed on rank 0:\n{failure}")


def run_scenarios(
    scenarios: Sequence[Callable[[int], Any]],
    world_size: int,
    *,
    timeout: float = 200.0,
    env: Mapping[str, str] | None = None,
    init_kwargs: Mapping[str, Any] | None = None,
) -> Scenarios:
    """Run each ``scenario(world_size)`` on rank 0 of one spawned world; never raises.

    Scenarios are module-level functions; they run in order, and a failing one does not stop the
    others. If the world itself fails (a crash, a hang past ``timeout``), the scenarios that did
    not record a result fail with that error.
    """
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "results.json")
        error = None
        try:
            run_world(
                _run_scenarios,
                world_size,
                list(scenarios),
                out,
                timeout=timeout,
                env=env,
                init_kwargs=init_kwargs,
            )
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
        results = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    return Scenarios(results, error)


def run_torchrun(
    script: str | os.PathLike[str],
    nproc: int,
    *script_args: str,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc_per_node=nproc script *script_args``; capture output.

    The whole process group is killed if it outlives ``timeout`` (then ``TimeoutError``).
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *script_args,
    ]
    return run_command(command, timeout=timeout, env=env, cwd=cwd)


def run_command(
    command: Sequence[str],
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in its own process group, killing the whole group on timeout."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd or REPO,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun's agent may start its workers in sessions of their own: kill every
            # descendant too, or they outlive the test holding the pipes open.
            doomed = _descendants(process.pid)
            os.killpg(process.pid, signal.SIGKILL)
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = process.communicate(timeout=30)
            raise TimeoutError(
                f"{' '.join(command)} exceeded {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr}"
            ) from None
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def _descendants(pid: int) -> list[int]:
    """Process ids of every live descendant of ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _decode_address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc prints IPv6 as four little-endian 32-bit words.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening_addresses(pid: int | None = None) -> set[tuple[str, int]]:
    """The (address, port) pairs on which process ``pid`` (default: self) listens for TCP."""
    pid = os.getpid() if pid is None else pid
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = LISTEN
                address, port = local.split(":")
                found.add((_decode_address(address), int(port, 16)))
    return found


def non_loopback_listeners(pid: int | None = None) -> set[tuple[str, int]]:
    """Listening sockets of ``pid`` bound to anything but a loopback address."""
    import ipaddress

    return {
        (address, port)
        for address, port in listening_addresses(pid)
        if not ipaddress.ip_address(address).is_loopback
    }
