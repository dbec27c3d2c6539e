"""World info, worker names, rank selectors, barrier and auto_init_rpc."""

from __future__ import annotations

import ast
import graphlib
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed.rpc as rpc
from _bad_input import Row, double, table_test
from _dist import REPO, non_loopback_listeners, run_command, run_torchrun, run_world

import metadist
from metadist import launch
from metadist.environment import default_worker_name_format
from metadist.network import free_loopback_port

TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # Tests run inside a SLURM job or under mpirun must not see their launcher either.
    launchers = [name for name in os.environ if name.startswith(("SLURM_", "OMPI_COMM_WORLD_"))]
    for name in (*TORCHRUN_ENV, *launchers):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---------------------------------------------------------------------------------------------
# In-process: no RPC needed


def import_graph() -> dict[str, set[str]]:
    """Which metadist modules each one imports, anywhere in it (functions too), from the source;
    ``optim`` (a package) is one node, ``__init__`` none: it names the package's public API."""
    package = REPO / "metadist"
    files = {path.stem: [path] for path in package.glob("*.py") if path.stem != "__init__"}
    files["optim"] = sorted((package / "optim").glob("*.py"))
    graph: dict[str, set[str]] = {}
    for module, paths in files.items():
        targets = set()
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from metadist import world` names a module; `from metadist.world import x`
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    names = []  # metadist uses no relative imports
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "metadist" and len(parts) > 1 and parts[1] in files:
                        targets.add(parts[1])
        graph[module] = targets - {module}
    return graph


def test_metadist_imports_form_no_circle() -> None:
    graph = import_graph()
    # A circle makes import order matter and hides which module owns what (issue 40).
    order = list(graphlib.TopologicalSorter(graph).static_order())  # CycleError names it
    assert set(order) >= {"environment", "world", "launch", "worker", "api"}
    # The launcher's variables are read in one module, below the world that answers with them.
    assert graph["environment"] == set()
    assert "launch" not in graph["world"]
    assert {"environment", "world"} <= graph["launch"]
    # The job-done protocol's key and process threads are world's alone, not re-exported.
    holders = [p.name for p in (REPO / "metadist").rglob("*.py") if '"<done>"' in p.read_text()]
    assert holders == ["world.py"]
    assert not hasattr(launch, "use_process_threads")
    assert not hasattr(metadist.world, "JOB_DONE")


def test_world_info_read_from_environment_at_call_time(clean_env: pytest.MonkeyPatch) -> None:
    assert metadist.get_world_info() == metadist.WorldInfo(0, 1, 0, 1)
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    info = metadist.get_world_info()
    assert (info.world_rank, info.world_size, info.local_rank, info.local_world_size) == (
        3,
        4,
        1,
        2,
    )
    assert info.rank == 3
    assert info.worker_name == "worker3"
    assert metadist.get_rank() == metadist.get_world_rank() == 3
    assert metadist.get_world_size() == 4
    assert metadist.get_local_rank() == 1
    assert metadist.get_local_world_size() == 2
    # A manual single-node launch sets only RANK and WORLD_SIZE.
    clean_env.delenv("LOCAL_RANK")
    clean_env.delenv("LOCAL_WORLD_SIZE")
    assert metadist.get_world_info() == metadist.WorldInfo(3, 4, 3, 4)


@pytest.mark.parametrize(
    ("name", "value", "pattern"),
    [
        ("RANK", "x", r"RANK='x' is not an integer"),
        ("RANK", "7", r"RANK=7 must be in \[0, WORLD_SIZE=4\)"),
        ("WORLD_SIZE", "0", r"WORLD_SIZE=0 must be >= 1"),
        ("LOCAL_RANK", "5", r"LOCAL_RANK=5 must be in \[0, LOCAL_WORLD_SIZE=2\)"),
    ],
)
def test_malformed_environment_is_named(
    clean_env: pytest.MonkeyPatch, name: str, value: str, pattern: str
) -> None:
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=pattern):
        metadist.get_world_info()


def test_default_worker_names_sort_like_ranks() -> None:
    names = [
        default_worker_name_format(world_rank=r, world_size=12, local_rank=0, local_world_size=1)
        for r in range(12)
    ]
    assert names[0] == "worker00"
    assert names[11] == "worker11"
    assert sorted(names) == names
    assert default_worker_name_format(
        world_rank=0, world_size=1, local_rank=0, local_world_size=1
    ) == ("worker0")
    # TorchOpt's width: that of the world size.
    assert default_worker_name_format(
        world_rank=9, world_size=10, local_rank=0, local_world_size=1
    ) == ("worker09")
    assert default_worker_name_format(
        world_rank=8, world_size=9, local_rank=0, local_world_size=1
    ) == ("worker8")


def test_worker_id_without_rpc(clean_env: pytest.MonkeyPatch) -> None:
    assert metadist.get_worker_id() == 0
    assert metadist.get_worker_id(0) == 0
    with pytest.raises(ValueError, match=r"unknown worker id 1: known worker ranks are 0\.\.0"):
        metadist.get_worker_id(1)
    with pytest.raises(TypeError, match=r"worker id must be an int rank, a worker name"):
        metadist.get_worker_id(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got True of type bool"):
        metadist.get_worker_id(True)
    with pytest.raises(
        RuntimeError, match=r"Decorate the entry function with @metadist\.auto_init_rpc"
    ):
        metadist.get_worker_id("worker0")


def test_rpc_apis_before_init_say_how_to_fix() -> None:
    message = r"metadist\.barrier needs metadist's RPC world.*@metadist\.auto_init_rpc\(\)"
    with pytest.raises(RuntimeError, match=message):
        metadist.barrier()
    with pytest.raises(RuntimeError, match=r"metadist\.get_worker_names needs"):
        metadist.get_worker_names()


def test_rank_selectors_in_world_of_one(clean_env: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    @metadist.rank_zero_only
    def zero(x: int) -> int:
        calls.append("zero")
        return x + 1

    @metadist.rank_non_zero_only
    def non_zero() -> str:
        calls.append("non_zero")
        return "nz"

    @metadist.on_rank(0)
    def on0() -> str:
        return "on0"

    @metadist.not_on_rank(0)
    def not0() -> str:
        return "not0"

    assert zero(1) == 2
    assert zero.__name__ == "zero"  # functools.wraps keeps the identity
    assert non_zero() is None
    assert on0() == "on0"
    assert not0() is None
    assert calls == ["zero"]

    # A rank beyond the world never matches: the script of a larger world runs alone.
    @metadist.on_rank(1)
    def on1() -> str:
        return "on1"

    @metadist.not_on_rank(1)
    def not1() -> str:
        return "not1"

    @metadist.on_rank(0, 3)
    def on03() -> str:
        return "on03"

    assert on1() is None
    assert not1() == "not1"
    assert on03() == "on03"
    # The rank is read at call time, not at decoration.
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert zero(1) is None
    assert non_zero() == "nz"


def _decorated() -> None:
    pass


@pytest.mark.parametrize(
    ("factory", "ranks", "error", "pattern"),
    [
        (
            metadist.on_rank,
            (),
            ValueError,
            r"on_rank\(\) needs at least one rank, as in @on_rank\(0\)",
        ),
        (
            metadist.on_rank,
            (-1,),
            ValueError,
            r"on_rank\(\.\.\.\): ranks must be non-negative ints, .*got -1 of type int",
        ),
        (
            metadist.not_on_rank,
            ("0",),
            ValueError,
            r"not_on_rank\(\.\.\.\): ranks must be non-negative ints, .*got '0' of type str",
        ),
        (metadist.on_rank, (True,), ValueError, r"got True of type bool"),
        # `@on_rank` without brackets: the function arrives as the only rank.
        (
            metadist.on_rank,
            (_decorated,),
            TypeError,
            r"on_rank\(\.\.\.\) takes the ranks, as in @on_rank\(0\); it was applied to the "
            r"function _decorated directly",
        ),
        (metadist.not_on_rank, (_decorated,), TypeError, r"@not_on_rank\(0\).*_decorated directly"),
    ],
    ids=[
        "none",
        "negative",
        "str",
        "bool",
        "on_rank without brackets",
        "not_on_rank without brackets",
    ],
)
def test_rank_selectors_reject_bad_ranks(
    factory: object, ranks: tuple[object, ...], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        factory(*ranks)  # type: ignore[operator]


def test_rank_zero_only_given_a_rank_says_it_takes_none() -> None:
    with pytest.raises(
        TypeError, match=r"got 0 of type int \(rank_zero_only takes no ranks: write"
    ):
        metadist.rank_zero_only(0)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# A world of 1 in this process (what `python script.py` gives)


def test_world_of_one_in_process(clean_env: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def init() -> None:
        seen["init_names"] = metadist.get_worker_names()

    @metadist.auto_init_rpc()
    def nested() -> tuple[str, ...]:
        return metadist.get_worker_names()

    @metadist.auto_init_rpc(init)
    def main(x: int) -> int:
        seen["names"] = metadist.get_worker_names()
        seen["id"] = metadist.get_worker_id("worker0")
        seen["name"] = metadist.get_worker_name()
        seen["listeners"] = non_loopback_listeners()
        metadist.barrier()
        metadist.barrier(["worker0"])
        metadist.barrier([0], timeout=5)
        with pytest.raises(
            ValueError, match=r"unknown worker name 'nobody': known workers are 0='worker0'"
        ):
            metadist.get_worker_id("nobody")
        with pytest.raises(TypeError, match="wrap a single worker in a list"):
            metadist.barrier("worker0")
        with pytest.raises(ValueError, match="at least one worker"):
            metadist.barrier([])
        for bad in (-2, 0, 0.0004, 3e6, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=r"timeout must be between 0\.001 and"):
                metadist.barrier(timeout=bad)
        assert nested() == ("worker0",)  # a nested decorated call runs inside the same world
        return x + 1

    assert main(41) == 42
    assert seen["init_names"] == ("worker0",)
    assert seen["names"] == ("worker0",)
    assert seen["id"] == 0
    assert seen["name"] == "worker0"
    assert seen["listeners"] == set(), "a world of 1 must listen on loopback only"

    # An exception in the job propagates and the world shuts down cleanly: a new one can start.
    @metadist.auto_init_rpc()
    def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        fails()
    with pytest.raises(RuntimeError, match="needs metadist's RPC world"):
        metadist.get_worker_names()
    assert main(1) == 2
    # The Gloo deprecation filter is local to metadist's calls.
    assert not any("ProcessGroupGloo" in str(f) for f in __import__("warnings").filters)


# ---------------------------------------------------------------------------------------------
# A spawned world of 3


def _custom_name(
    *, world_rank: int, world_size: int, local_rank: int, local_world_size: int
) -> str:
    return f"trainer-{world_rank}-of-{world_size}-local{local_rank}"


_INIT_CALLED = False


def _mark_init() -> None:
    global _INIT_CALLED
    _INIT_CALLED = True


def _worker_state() -> tuple[bool, metadist.WorldInfo, str, set[tuple[str, int]]]:
    info = metadist.get_world_info()
    return _INIT_CALLED, info, metadist.get_worker_name(), non_loopback_listeners()


_ENTERED_BARRIER = 0.0
_TIMED_OUT = threading.Event()  # set on rank 2 once ranks 0 and 1 saw their barrier time out


def _timed_out() -> None:
    _TIMED_OUT.set()


def _entered_barrier() -> float:
    return _ENTERED_BARRIER


def run_world_checks(rank: int, world_size: int) -> None:
    names = metadist.get_worker_names()
    assert names == tuple(
        _custom_name(world_rank=r, world_size=3, local_rank=r, local_world_size=3) for r in range(3)
    )
    info = metadist.get_world_info()
    assert info == metadist.WorldInfo(rank, world_size, rank, world_size)
    # A value type reads nothing global: its name is the default format's, the world's is custom.
    assert info.worker_name == default_worker_name_format(*info)
    assert metadist.get_worker_name() == names[rank] != info.worker_name
    assert metadist.get_worker_id(names[2]) == 2
    assert metadist.get_worker_id(1) == 1
    with pytest.raises(ValueError, match=r"unknown worker id 3: known workers are 0='trainer-0"):
        metadist.get_worker_id(3)

    @metadist.on_rank(1, 2)
    def on12() -> int:
        return rank

    @metadist.not_on_rank(1)
    def not1() -> int:
        return rank

    assert on12() == (rank if rank in (1, 2) else None)
    assert not1() == (None if rank == 1 else rank)
    assert metadist.rank_zero_only(lambda: "r0")() == ("r0" if rank == 0 else None)

    # Full barrier: everyone leaves after the slowest arrives. CLOCK_MONOTONIC is system-wide on
    # Linux, so rank 0 can compare its leaving time with the moment rank 2 (the last) arrived.
    global _ENTERED_BARRIER
    time.sleep(0.3 * rank)
    _ENTERED_BARRIER = time.monotonic()
    metadist.barrier()
    left = time.monotonic()
    if rank == 0:
        assert left >= rpc.rpc_sync(names[2], _entered_barrier) > 0
    # Subset barrier between ranks 0 and 2; rank 1 is not involved.
    if rank in (0, 2):
        metadist.barrier([names[0], 2])
    # A barrier a worker never joins times out with a clear error instead of hanging or passing.
    # That worker stays in its job meanwhile: one that finished fails the barrier at once.
    if rank in (0, 1):
        with pytest.raises(TimeoutError, match=r"barrier over .* timed out after 1\.0 s"):
            metadist.barrier(timeout=1.0)
    if rank == 0:
        rpc.rpc_sync(names[2], _timed_out)
    if rank == 2:
        assert _TIMED_OUT.wait(60)
    if rank == 1:
        with pytest.raises(
            ValueError, match=r"this worker \('trainer-1-of-3-local1'\) must be one of"
        ):
            metadist.barrier([0, 2])
    if rank == 0:
        # Every worker ran worker_init_fn before the job, and listens on loopback only.
        for other in range(world_size):
            init_called, other_info, name, listeners = rpc.rpc_sync(names[other], _worker_state)
            assert init_called, f"worker_init_fn did not run on {name}"
            assert other_info.world_rank == other
            assert name == names[other]
            assert listeners == set(), f"{name} listens on non-loopback {listeners}"
        assert non_loopback_listeners() == set()


@pytest.mark.timeout(120)
def test_spawned_world_of_three() -> None:
    run_world(
        run_world_checks,
        3,
        timeout=100,
        init_kwargs={"worker_init_fn": _mark_init, "worker_name_format": _custom_name},
    )


# ---------------------------------------------------------------------------------------------
# torchrun: the README quickstart runs as written


def _readme_quickstart() -> str:
    readme = (REPO / "README.md").read_text()
    match = re.search(r"<!-- quickstart -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "README.md must contain the quickstart python block after <!-- quickstart -->"
    return match.group(1)


@pytest.mark.timeout(120)
def test_readme_quickstart_under_torchrun(tmp_path: os.PathLike[str]) -> None:
    script = os.path.join(tmp_path, "quickstart.py")
    with open(script, "w") as f:
        f.write(_readme_quickstart())
    result = run_torchrun(script, 2, timeout=100)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("mean loss")]
    assert len(lines) == 1, result.stdout  # printed by rank 0 only
    assert lines[0].endswith(" on 2 workers"), lines
    assert "Warning" not in result.stderr, result.stderr
    # Alone, under plain python: one worker, in the singular.
    alone = run_command([sys.executable, script], timeout=100)
    assert alone.returncode == 0, alone.stderr
    assert re.search(r"^mean loss \S+ on 1 worker$", alone.stdout, re.M), alone.stdout


# ---------------------------------------------------------------------------------------------
# Later worlds in one process: each process of a job of 2 starts several worlds in turn
# (tests/scripts/second_world.py). torch's RRef bookkeeping ends with the first world's
# shutdown, so a later world refuses RRefs by name or, for the program's own rpc.remote, its
# shutdown names that cause.

SECOND_WORLD = REPO / "tests" / "scripts" / "second_world.py"


def _run_worlds(mode: str) -> list[str]:
    """``second_world.py mode`` on 2 ranks launched by hand: each rank's output."""
    ports: set[int] = set()
    while len(ports) < 3:  # one port per world: rank 0's store keeps its world's
        ports.add(free_loopback_port())
    processes = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "PORTS": ",".join(map(str, sorted(ports))),
            "PYTHONUNBUFFERED": "1",
        }
        command = [sys.executable, str(SECOND_WORLD), mode]
        processes.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
        )
    try:
        return [process.communicate(timeout=100)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait(5)


def _line(output: str, prefix: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"one line {prefix!r} expected in:\n{output}"
    return lines[0]


@pytest.fixture(scope="module")
def user_worlds() -> list[str]:
    return _run_worlds("user")


@pytest.mark.timeout(150)
def test_first_world_uses_rrefs(user_worlds: list[str]) -> None:
    assert _line(user_worlds[0], "CHECK world1_rrefs_work") == "CHECK world1_rrefs_work ok"
    for output in user_worlds:
        assert _line(output, "WORLD 1 ").startswith("WORLD 1 ok"), output


@pytest.mark.timeout(150)
def test_later_world_without_rrefs_runs(user_worlds: list[str]) -> None:
    assert _line(user_worlds[0], "CHECK world2_plain") == "CHECK world2_plain_calls_work ok"
    for output in user_worlds:
        assert _line(output, "WORLD 2 ").startswith("WORLD 2 ok"), output


@pytest.mark.timeout(150)
def test_later_world_refuses_rrefs_naming_the_cause(user_worlds: list[str]) -> None:
    assert _line(user_worlds[0], "CHECK world2_check") == "CHECK world2_check_refuses ok"


@pytest.mark.timeout(150)
def test_later_world_on_an_earlier_worlds_port_says_so(user_worlds: list[str]) -> None:
    assert _line(user_worlds[0], "CHECK reused_port") == "CHECK reused_port ok"


@pytest.mark.timeout(150)
def test_later_world_rpc_remote_shutdown_names_the_cause(user_worlds: list[str]) -> None:
    # The program's own rpc.remote, which metadist cannot see: the RRef works, and shutdown,
    # bounded by shutdown_timeout (5 s), then names the cause rather than a hung call.
    assert _line(user_worlds[0], "CHECK world3_user_rref") == "CHECK world3_user_rref ok"
    for rank, output in enumerate(user_worlds):
        line = _line(output, "WORLD 3 ")
        assert line.startswith(f"WORLD 3 FAIL RuntimeError: RPC shutdown on worker 'worker{rank}'")
        assert "shutdown still waited 5 s after every worker finished its job" in line
        assert "this is RPC world 3 in this process" in line
        assert "(RRefContext) is process-wide" in line
        assert "timeout=None" not in line
        took = re.fullmatch(r".*\((\S+) s\)", line)
        assert took is not None, line
        assert float(took[1]) < 15, line


@pytest.mark.timeout(150)
def test_later_world_refuses_a_metadist_call_with_an_rref() -> None:
    outputs = _run_worlds("metadist")
    refused = _line(outputs[0], "CHECK world2_metadist")
    assert refused == "CHECK world2_metadist_rref_call_refused ok", outputs[0]
    for output in outputs:  # refused before it was sent: nothing for shutdown to wait for
        assert _line(output, "WORLD 2 ").startswith("WORLD 2 ok"), output


# ---------------------------------------------------------------------------------------------
# Bad input, in a spawned world of 3: it fails before any request, naming the argument


ROWS = [
    Row("get_worker_id float", lambda fx: metadist.get_worker_id(1.5), TypeError, r"worker id"),  # type: ignore[arg-type]
    Row("get_worker_id bool", lambda fx: metadist.get_worker_id(True), TypeError, r"worker id"),
    Row("get_worker_id rank", lambda fx: metadist.get_worker_id(3), ValueError, r"worker id 3"),
    Row("get_worker_id -1", lambda fx: metadist.get_worker_id(-1), ValueError, r"worker id -1"),
    Row(
        "get_worker_name name",
        lambda fx: metadist.get_worker_name("ghost"),
        ValueError,
        r"worker name 'ghost'.*known workers",
    ),
    Row("barrier str", lambda fx: metadist.barrier("worker0"), TypeError, r"worker_names.*list"),
    Row("barrier empty", lambda fx: metadist.barrier([]), ValueError, r"worker_names"),
    Row("barrier unknown", lambda fx: metadist.barrier([0, 7]), ValueError, r"worker id 7"),
    Row("barrier not self", lambda fx: metadist.barrier([1, 2]), ValueError, r"worker_names"),
    Row("barrier timeout", lambda fx: metadist.barrier(timeout=-2), ValueError, r"timeout"),
    Row(
        "barrier timeout str",
        lambda fx: metadist.barrier(timeout="x"),  # type: ignore[arg-type]
        TypeError,
        r"timeout.*'x'",
    ),
    Row(
        "on_rank not callable",
        lambda fx: metadist.on_rank(0)(3),  # type: ignore[arg-type]
        TypeError,
        r"on_rank: expected a function to decorate, got 3",
    ),
    Row(
        "rank_zero_only not callable",
        lambda fx: metadist.rank_zero_only("save"),  # type: ignore[arg-type]
        TypeError,
        r"rank_zero_only: expected a function.*'save'",
    ),
    Row("on_rank none", lambda fx: metadist.on_rank(), ValueError, r"on_rank.*rank"),
    Row("on_rank negative", lambda fx: metadist.on_rank(-1), ValueError, r"ranks.*-1"),
    Row(
        "on_rank without brackets",
        lambda fx: metadist.on_rank(double),  # type: ignore[arg-type]
        TypeError,
        r"on_rank\(\.\.\.\) takes the ranks, as in @on_rank\(0\).*function double directly",
    ),
    Row(
        "not_on_rank float",
        lambda fx: metadist.not_on_rank(1.0),  # type: ignore[arg-type]
        ValueError,
        r"not_on_rank\(\.\.\.\): ranks must be non-negative ints.*got 1\.0 of type float",
    ),
]


test_bad_call_fails_fast_and_names_the_argument = table_test(__name__, ROWS)
