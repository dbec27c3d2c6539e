"""Process-level faults: killed workers and signals end jobs fast, never hang, leave nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest
from _dist import REPO, run_command

from metadist.network import free_loopback_port

SCRIPT = REPO / "tests" / "scripts" / "fault_job.py"
TORCHRUN_2 = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], limit: float) -> float:
    start = time.monotonic()
    while any(_alive(pid) for pid in pids):
        if time.monotonic() - start > limit:
            break
        time.sleep(0.05)
    return time.monotonic() - start


def _torchrun(mode: str, out: IO[str]) -> subprocess.Popen[bytes]:
    """Start ``fault_job.py mode`` under torchrun with 2 workers, in its own session."""
    return subprocess.Popen(
        [*TORCHRUN_2, str(SCRIPT), mode],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


def _ready_pids(log: Path, count: int, limit: float = 60.0) -> list[int]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        pids = [int(pid) for pid in re.findall(r"READY rank=\d+ pid=(\d+)", log.read_text())]
        if len(pids) == count:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"workers did not start:\n{log.read_text()}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_signal_to_torchrun_stops_every_worker(sig: signal.Signals, tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    with log.open("w") as out:
        torchrun = _torchrun("hang", out)
        try:
            workers = _ready_pids(log, 2)
            time.sleep(1.0)  # rank 0 is now blocked in the remote call
            torchrun.send_signal(sig)
            # About 2 s here when idle; the bound is for a hang, not a speed (took 15 s once
            # beside a docs build).
            elapsed = _wait_gone([torchrun.pid, *workers], limit=45)
            assert elapsed <= 40, f"workers still alive {elapsed:.1f}s after {sig.name}"
            assert torchrun.wait(5) != 0
            assert not [pid for pid in workers if _alive(pid)]
        finally:
            if torchrun.poll() is None:
                os.killpg(torchrun.pid, signal.SIGKILL)


@pytest.mark.timeout(90)
def test_ctrl_c_interrupts_a_remote_call_in_a_world_of_one(tmp_path: Path) -> None:
    # torch's Future.wait blocks in C++, where Python never sees SIGINT; metadist's waits do not.
    log = tmp_path / "out.log"
    with log.open("w") as out:
        job = subprocess.Popen(
            [sys.executable, str(SCRIPT), "hang-self"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            _ready_pids(log, 1)
            time.sleep(1.0)  # now blocked in the remote call
            job.send_signal(signal.SIGINT)
            start = time.monotonic()
            try:
                # The bound is for a hang, not a speed (like the torchrun test above).
                job.wait(45)
            except subprocess.TimeoutExpired:
                job.send_signal(signal.SIGUSR1)  # fault_job.py then writes every thread's stack
                time.sleep(2.0)
            elapsed = time.monotonic() - start
        finally:
            job.kill()
    text = log.read_text()
    assert elapsed <= 40, f"still running {elapsed:.1f}s after Ctrl-C:\n{text}"
    assert "KeyboardInterrupt" in text, text
    # In a world of 1 the partition runs in-process: Ctrl-C lands in the function itself.
    assert "in sleep_forever" in text, text


def _run_ranks(
    mode: str, world_size: int, folder: Path, limit: float
) -> tuple[list[int], list[Path], list[subprocess.Popen[bytes]]]:
    """``fault_job.py mode`` as ``world_size`` ranks launched by hand (no supervisor to kill
    survivors), each logging to ``folder``: their exit codes, logs and processes."""
    port = free_loopback_port()
    logs = [folder / f"rank{rank}.log" for rank in range(world_size)]
    processes = []
    for rank, log in enumerate(logs):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
        }
        with log.open("w") as out:
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), mode],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    env=env,
                )
            )
    try:
        codes = [process.wait(limit) for process in processes]
    finally:
        for process in processes:
            process.kill()
    return codes, logs, processes


@pytest.mark.timeout(120)
def test_killed_worker_fails_the_call_naming_it_and_the_job_exits(tmp_path: Path) -> None:
    codes, logs, processes = _run_ranks("kill", 3, tmp_path, 60)
    out0 = logs[0].read_text()
    caught = [line for line in out0.splitlines() if line.startswith("CAUGHT")]
    assert caught, out0
    assert "worker1" in caught[0], caught[0]
    assert float(caught[0].split(" after ")[1].split("s:")[0]) <= 20 + 5
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0, (codes, out0)
    assert codes[2] != 0, (codes, logs[2].read_text())
    # worker1 may die before or after it announced the end of its job: both are reported.
    assert re.search(r"workers \[[^]]*'worker1'[^]]*\] died", out0), out0
    assert not [p.pid for p in processes if _alive(p.pid)]


@pytest.mark.timeout(120)
def test_call_in_flight_at_shutdown_fails_the_job_instead_of_hanging(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    start = time.monotonic()
    with log.open("w") as out:
        torchrun = _torchrun("inflight", out)
        try:
            code = torchrun.wait(90)
        finally:
            if torchrun.poll() is None:
                os.killpg(torchrun.pid, signal.SIGKILL)
    elapsed = time.monotonic() - start
    text = log.read_text()
    assert code != 0, text
    assert "remote calls were still running 3 s after every worker finished its job" in text
    assert elapsed < 60, f"took {elapsed:.0f} s"


# A process that starts a grandchild in a session of its own (as torchrun's agent may start its
# workers), prints the grandchild's pid and waits; the grandchild holds the pipes open.
_ESCAPING_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(60)
def test_a_timed_out_command_leaves_no_process_behind() -> None:
    # The tests' launcher must not let a hung job outlive its test (it would hold ports and CPU
    # for every later test): on timeout it kills descendants in other sessions too.
    start = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        run_command([sys.executable, "-c", _ESCAPING_CHILD], timeout=3)
    assert time.monotonic() - start < 40
    stdout = str(raised.value).split("stdout:\n", 1)[1]
    grandchild = int(stdout.split()[0])
    assert _wait_gone([grandchild], 10) < 10, f"process {grandchild} outlived the timeout"


# ---------------------------------------------------------------------------------------------
# Dead and finished workers met by calls and barriers: `fault_job.py dead`, one world of 4 for
# the tests below, each reading its step's line. torch says only "EOF: end of file" (or EPIPE)
# for a worker that is gone, and a barrier waits out its timeout (30 s here) for a worker that
# never arrives.


@pytest.fixture(scope="module")
def dead_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``{step: outcome}`` of the ``dead`` job; the outcome keeps its ``(seconds)`` suffix."""
    _, logs, _ = _run_ranks("dead", 4, tmp_path_factory.mktemp("dead"), 90)
    text = "\n".join(log.read_text() for log in logs)
    steps = dict(re.findall(r"^STEP (.+?) -> (.*)$", text, re.M))
    steps["<log>"] = text
    return steps


def _step(steps: dict[str, str], name: str) -> tuple[str, float]:
    assert name in steps, f"step {name!r} did not run:\n{steps['<log>']}"
    outcome, seconds = re.fullmatch(r"(.*) \((\d+\.\d+)s\)", steps[name]).groups()  # type: ignore[union-attr]
    return outcome, float(seconds)


_TORCH_SAYS = r"torch's RPC error: RuntimeError: (EOF: end of file|EPIPE|ECONNRESET|ECONNREFUSED)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("step", "worker"),
    [
        ("first call to a dead worker", "'worker2' (rank 2)"),
        ("call during which the worker dies", "'worker1' (rank 1)"),
        ("call after the worker died", "'worker1' (rank 1)"),
    ],
)
def test_a_call_to_a_dead_worker_says_it_is_gone(
    dead_job: dict[str, str], step: str, worker: str
) -> None:
    outcome, seconds = _step(dead_job, step)
    assert outcome.startswith("RemoteError: partition 0 of 1 failed: "), outcome
    assert f"worker {worker} closed its connection: the process exited or crashed" in outcome
    assert re.search(_TORCH_SAYS, outcome), outcome  # torch's own message is kept
    assert seconds < 5, outcome


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("step", "why"),
    [
        # rank 0 coordinates: it finds worker2 gone
        ("barrier with a dead worker", "worker 'worker2' (rank 2) closed its connection"),
        # worker3 waits; the coordinator (rank 0, arriving later) tells it
        ("member barrier with a dead worker", "worker 'worker2' (rank 2) closed its connection"),
        # worker1 returned from its job before the barrier
        ("barrier with a finished worker", "worker 'worker1' (rank 1) finished its job"),
    ],
)
def test_a_barrier_fails_promptly_naming_a_worker_that_never_arrives(
    dead_job: dict[str, str], step: str, why: str
) -> None:
    outcome, seconds = _step(dead_job, step)
    assert outcome.startswith("RuntimeError: barrier over ['worker0', "), outcome
    assert why in outcome, outcome
    assert "never arrives" in outcome, outcome
    # Its timeout is 30 s: the coordinator finds out within about 2 * BARRIER_CHECK_S (the
    # member's wait also holds the time until rank 0 joins the barrier).
    assert seconds < (20 if step.startswith("member") else 5), outcome
