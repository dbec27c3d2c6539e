"""The launcher's environment: which launcher started this process (torchrun, ``srun``,
``mpirun`` or none), the ranks it gave it, and where rank 0 listens. Read each time it is asked
for, never cached at import; ``ValueError`` names a variable that is malformed or missing."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "SLURM_PORT_BASE",
    "LaunchEnvironment",
    "WorldInfo",
    "default_worker_name_format",
    "expand_hostlist",
    "master_address",
    "read_launch_environment",
    "tasks_per_node",
]


class WorldInfo(NamedTuple):
    """Ranks and sizes of this worker; a named tuple, as in TorchOpt (it unpacks).

    Attributes:
        world_rank: Global rank of this worker, in ``[0, world_size)``.
        world_size: Number of workers in the job.
        local_rank: Rank of this worker on its node, in ``[0, local_world_size)``.
        local_world_size: Number of workers on this node.
    """

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def rank(self) -> int:
        """Alias of :attr:`world_rank`."""
        return self.world_rank

    @property
    def worker_name(self) -> str:
        """The default name of this worker (:func:`metadist.get_worker_name`: the world's)."""
        return default_worker_name_format(*self)


def default_worker_name_format(
    world_rank: int, world_size: int, local_rank: int, local_world_size: int
) -> str:
    """Name workers ``worker0 … workerN-1``, zero-padded as in TorchOpt (``worker03`` of 12).

    Args:
        world_rank: Global rank of the worker.
        world_size: Number of workers.
        local_rank: Unused (a name format is passed all four).
        local_world_size: Unused.

    Returns:
        The worker name.
    """
    del local_rank, local_world_size
    return f"worker{world_rank:0{len(str(world_size))}d}"


@dataclass(frozen=True)
class LaunchEnvironment:
    """Which launcher started this process (``"torchrun"``, also for a manual launch with its
    variables, ``"mpirun"``, ``"srun"`` or ``"python"``: none), and its ranks."""

    launcher: str
    info: WorldInfo


def _env_int(name: str, launcher: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {name} is not set, but {launcher} needs it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; {launcher} sets it to one"
        ) from None


def _checked(
    names: Sequence[str], rank: int, size: int, local_rank: int, local_size: int
) -> WorldInfo:
    """Build a WorldInfo, naming the launcher variable that is out of range."""
    for index, index_name, count, count_name in (
        (rank, names[0], size, names[1]),
        (local_rank, names[2], local_size, names[3]),
    ):
        if count < 1:
            raise ValueError(f"environment variable {count_name}={count} must be >= 1")
        if not 0 <= index < count:
            raise ValueError(
                f"environment variable {index_name}={index} must be in [0, {count_name}={count})"
            )
    return WorldInfo(rank, size, local_rank, local_size)


def _torchrun_info() -> WorldInfo:
    world_size = _env_int("WORLD_SIZE", "torchrun", 1)
    rank = _env_int("RANK", "torchrun", 0)
    # A manual launch that sets only RANK/WORLD_SIZE is a single-node launch.
    local_world_size = _env_int(
        "LOCAL_WORLD_SIZE", "torchrun", world_size if "LOCAL_RANK" not in os.environ else 1
    )
    local_rank = _env_int("LOCAL_RANK", "torchrun", rank if local_world_size == world_size else 0)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return _checked(names, rank, world_size, local_rank, local_world_size)


def tasks_per_node(spec: str) -> list[int]:
    """The tasks on each node from ``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` is 2, 2, 2, 1."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(
                f"environment variable SLURM_TASKS_PER_NODE={spec!r} is not in SLURM's syntax "
                f"(counts like '2(x3),1')"
            )
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _slurm_info() -> WorldInfo:
    rank = _env_int("SLURM_PROCID", "srun")
    size = _env_int("SLURM_NTASKS", "srun")
    local_rank = _env_int("SLURM_LOCALID", "srun", 0)
    spec = os.environ.get("SLURM_TASKS_PER_NODE")
    local_size_name = "SLURM_TASKS_PER_NODE"
    if spec:
        counts = tasks_per_node(spec)
        node = _env_int("SLURM_NODEID", "srun", 0)
        if not 0 <= node < len(counts):
            raise ValueError(
                f"environment variable SLURM_NODEID={node} must be in [0, {len(counts)}), the "
                f"nodes listed by SLURM_TASKS_PER_NODE={spec!r}"
            )
        local_size = counts[node]
    elif os.environ.get("SLURM_NTASKS_PER_NODE"):
        local_size_name = "SLURM_NTASKS_PER_NODE"
        local_size = _env_int(local_size_name, "srun")
    elif _env_int("SLURM_NNODES", "srun", 1) == 1:
        local_size = size  # one node holds every task
    else:
        raise ValueError(
            "srun set neither SLURM_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE for a job on "
            "several nodes; set one of them (or LOCAL_WORLD_SIZE with torchrun's variables)"
        )
    names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_size_name)
    return _checked(names, rank, size, local_rank, local_size)


def read_launch_environment() -> LaunchEnvironment:
    """Read the launcher's variables. First match wins: torchrun's ``WORLD_SIZE``, Open MPI's
    ``OMPI_COMM_WORLD_SIZE`` (over the SLURM allocation ``mpirun`` may run in), ``srun``'s
    ``SLURM_PROCID`` and ``SLURM_NTASKS``, else a world of 1."""
    if "WORLD_SIZE" in os.environ:
        return LaunchEnvironment("torchrun", _torchrun_info())
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        names = [f"OMPI_COMM_WORLD_{n}" for n in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")]
        values = [_env_int(name, "mpirun") for name in names]
        return LaunchEnvironment("mpirun", _checked(names, *values))
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return LaunchEnvironment("srun", _slurm_info())
    return LaunchEnvironment("python", _torchrun_info())


#: ``srun`` jobs without ``MASTER_PORT`` rendezvous on port ``SLURM_PORT_BASE + SLURM_JOB_ID %
#: 15000`` (15000-29999: below Linux's ephemeral range, so no outgoing connection holds it, and
#: every task of a job computes the same port without talking to the others).
SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 15000


def _expand_host(pattern: str) -> list[str]:
    head, bracket, rest = pattern.partition("[")
    if not bracket:
        return [pattern]
    group, closed, tail = rest.partition("]")
    if not closed:
        raise ValueError("'[' without ']'")
    items = []
    for piece in group.split(","):
        low, dash, high = piece.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"[{group}] holds {piece!r}, not a number or a range like 01-04")
        if dash and int(high) < int(low):
            raise ValueError(f"the range {piece!r} in [{group}] runs backwards")
        # SLURM keeps the zero padding of the lower bound: 08-10 is 08, 09, 10.
        items += [f"{n:0{len(low)}d}" for n in range(int(low), int(high or low) + 1)]
    return [head + item + end for item in items for end in _expand_host(tail)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed host list, e.g. ``node[01-04,07]``, in order (zero padding
    kept; several bracket groups expand to their product)."""
    try:
        parts = re.split(r",(?![^\[]*\])", hostlist.strip())  # the commas outside brackets
        hosts = [host for part in parts for host in _expand_host(part)]
        if any(not host or "[" in host or "]" in host for host in hosts):
            raise ValueError("an empty or unbalanced host name")
    except ValueError as error:
        raise ValueError(f"cannot read the SLURM host list {hostlist!r}: {error}") from None
    return hosts


def master_address(launcher: str) -> tuple[str, int]:
    """Where rank 0 of a ``launcher``'s job listens for the rendezvous: ``(host, port)``.

    ``MASTER_ADDR`` and ``MASTER_PORT`` win; torchrun and ``mpirun`` need them. ``srun`` uses
    the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) and the port
    :data:`SLURM_PORT_BASE` gives."""
    addr = os.environ.get("MASTER_ADDR", "")
    port = os.environ.get("MASTER_PORT", "")
    if launcher == "srun" and not addr:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ValueError(
                "srun set neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST; set MASTER_ADDR "
                "to the host of task 0"
            )
        addr = expand_hostlist(nodes)[0]
    if launcher == "srun" and not port:
        job = os.environ.get("SLURM_JOB_ID", "")
        if not job.isdigit():
            raise ValueError(
                f"environment variable SLURM_JOB_ID={job!r} is not a job number, so the "
                f"rendezvous port cannot be derived from it; set MASTER_PORT"
            )
        return addr, SLURM_PORT_BASE + int(job) % _SLURM_PORT_SPAN
    missing = [name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not value]
    if missing:
        how = (
            "for every process, e.g. `mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500"
            " ...` (Open MPI does not say which host holds rank 0)"
            if launcher == "mpirun"
            else "(torchrun sets them; a manual launch sets them with RANK and WORLD_SIZE)"
        )
        raise ValueError(
            f"environment variable{'s' if len(missing) > 1 else ''} {' and '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} not set, but {launcher} launched this "
            f"process: set MASTER_ADDR and MASTER_PORT {how}"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"environment variable MASTER_PORT={port!r} must be a TCP port in [1, 65535]"
        )
    return addr, int(port)
