"""What the MAML examples share besides the algorithm: options, the loop's bookkeeping, checkpoints.

The examples hold the program (model, tasks, meta-loss, ``meta_step``); ``meta_train`` runs their
step on rank 0 (the other workers serve its ``meta_loss`` calls), or with ``--plain`` in one
process without metadist, the baseline a parallel run has to beat. Checkpoints are written
atomically and hold everything a bit-exact continuation needs, so that a job restarted by
``torchrun --max-restarts=N`` picks up from the newest one (``--resume auto``, the default).
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import io
import json
import math
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

import metadist

__all__ = [
    "HelpFormatter",
    "add_training_args",
    "configure_threads",
    "latest_checkpoint",
    "launch",
    "load_checkpoint",
    "meta_train",
    "plot_learning_curve",
    "resume_point",
    "save_checkpoint",
    "training_summary",
    "write_summary",
]

# Options that do not change what is computed: a run resumed with other values of these
# continues the same training. Any other difference means --out holds a different run.
BOOKKEEPING = {
    "steps", "out", "resume", "save_every", "keep", "no_eval", "eval_tasks", "threads", "plain",
    "test_inner_steps", "workers", "compare_plain",
}  # fmt: skip
# Keys of summary.json that describe how fast the training ran: a run that trains nothing (its
# checkpoint is already at --steps) keeps those of the run that trained rather than writing none.
TIMING_KEYS = ("workers", "mode", "trained_steps", "seconds", "ms_per_step", "ms_per_step_p10_p90",
               "versus_plain")  # fmt: skip
NUMBERED = re.compile(r"checkpoint-(\d+)\.pt")
WARMUP_STEPS = 10  # left out of the per-step median: first calls build caches and pools


# ----------------------------------------------------------------------------- options


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, except for on/off flags (off by default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.nargs == 0 else super()._get_help_string(action)


def add_training_args(
    parser: argparse.ArgumentParser,
    *,
    steps: int,
    tasks: int,
    hidden: int,
    inner_lr: float,
    meta_lr: float,
    eval_tasks: int,
    save_every: int,
    out: str,
    hidden_help: str,
    compare_plain: int,
) -> None:
    """Add the options every MAML example shares, with that example's defaults."""
    p = parser
    p.add_argument("--steps", type=int, default=steps, help="meta-steps (total, also on resume)")
    p.add_argument("--tasks", type=int, default=tasks, help="tasks per meta-batch")
    p.add_argument("--hidden", type=int, default=hidden, help=hidden_help)
    p.add_argument("--inner-steps", type=int, default=1, help="adaptation steps in training")
    p.add_argument("--inner-lr", type=float, default=inner_lr, help="alpha, inner learning rate")
    p.add_argument("--meta-lr", type=float, default=meta_lr, help="Adam (outer) learning rate")
    p.add_argument("--first-order", action="store_true", help="FOMAML: drop second-order terms")
    p.add_argument("--eval-tasks", type=int, default=eval_tasks, help="held-out evaluation tasks")
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the task sampler")
    p.add_argument("--out", type=Path, default=Path(out), help="output directory")
    p.add_argument(
        "--resume",
        default="auto",
        help="'auto': continue from the newest complete checkpoint in --out, if any; "
        "'none': start over; or a checkpoint file",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=save_every,
        help="write checkpoint-<step>.pt every N steps (0: only at the end)",
    )
    p.add_argument("--keep", type=int, default=3, help="numbered checkpoints to keep (0: all)")
    p.add_argument(
        "--threads", type=int, default=0, help="intra-op threads per process (0: cores / workers)"
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="run the same meta-step in this one process with plain torch, no metadist "
        "(the baseline for the time per step)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="start this many local workers, as `torchrun --standalone --nproc_per_node=N` "
        "does, after checking --resume here (0: run in this process, or as the worker a "
        "launcher started)",
    )
    p.add_argument(
        "--compare-plain",
        type=int,
        default=compare_plain,
        help="every N-th step, also time the same step (same batch) in plain torch in this "
        "process, on a copy of the model, with 1 thread and with all cores, and print the "
        "medians and the speed-up (0: never)",
    )


def configure_threads(threads: int = 0) -> int:
    """Set this process's intra-op threads (0: its share of the cores) and return the count.

    ``torchrun`` starts ``LOCAL_WORLD_SIZE`` workers on one machine; if each used every core
    (torch's default) their thread pools would fight over the cores and the job would run
    slower than one process.
    """
    if threads <= 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, (cores or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.set_num_threads(threads)
    return threads


def launch(
    train: Callable[[argparse.Namespace], object],
    args: argparse.Namespace,
    argv: Sequence[str] | None = None,
) -> None:
    """Run ``train(args)``: on rank 0 of an RPC world (every worker calls this; the others serve
    remote calls until rank 0 is done), here alone with ``--plain``, or, with ``--workers N``
    outside a launcher, start N local workers that do so (each runs the file that defines
    ``train`` with ``argv``, by default this process's command line).

    Every process checks ``--resume`` before any worker or RPC starts, so that a refused resume
    ends the job at once with one message and exit status 2.
    """
    rank = int(os.environ.get("RANK", "0"))
    launched = "WORLD_SIZE" in os.environ  # by torchrun (or by --workers, below)
    try:
        resume_point(args)
    except ResumeRefusedError as refusal:
        if rank != 0:
            # Let rank 0 print the message before the launcher stops the job on our exit.
            time.sleep(1.0)
            raise SystemExit(2) from None
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if args.plain:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 or args.workers > 1:
            raise SystemExit("--plain runs in one process: start it with python, not torchrun")
        configure_threads(args.threads)
        train(args)
        return
    if args.workers > 1 and not launched:
        script = inspect.getfile(train)
        _start_workers(args.workers, script, sys.argv[1:] if argv is None else list(argv))
        return
    init = functools.partial(configure_threads, args.threads)
    metadist.auto_init_rpc(init)(metadist.rank_zero_only(train))(args)


def _start_workers(n: int, script: str, argv: list[str]) -> None:
    """Run ``script argv`` on ``n`` local workers exactly as ``torchrun --standalone`` would; a
    worker that fails ends the job with its exit status, its own message and one line from here
    instead of the launcher's ChildFailedError traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    options = parse_args(["--standalone", f"--nproc-per-node={n}", script, *argv])
    # Each worker sets its own thread count (configure_threads); torchrun's notice that it
    # would otherwise set one is noise here.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(options)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1
        print(
            f"{Path(script).name}: worker {rank} exited with status {failure.exitcode} "
            "(its output is above)",
            file=sys.stderr,
        )
        raise SystemExit(code) from None
    except SignalException as stopped:  # Ctrl-C or a kill: the workers are stopped by now
        print(f"{Path(script).name}: stopped by signal {stopped.sigval}", file=sys.stderr)
        raise SystemExit(128 + int(stopped.sigval)) from None


# ----------------------------------------------------------------------------- checkpoints


def _write_atomically(path: Path, data: bytes) -> None:
    # Write, flush to disk, then rename over the target: a reader (or a restarted job) sees the
    # old file or the new one, never a torn one, even if this process is killed mid-write.
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    rng: np.random.Generator,
    history: dict[str, list[float]],
    args: dict[str, Any],
    also: Sequence[str | os.PathLike[str]] = (),
) -> None:
    """Write everything a bit-exact continuation needs to ``path`` (and each of ``also``).

    Besides the model and the meta-optimizer, the task sampler's, torch's and Python's RNG
    states, so a resumed run draws the tasks an uninterrupted one would have drawn.
    """
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "numpy_rng": rng.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "history": history,
        "args": args,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    for target in (path, *also):
        _write_atomically(Path(target), buffer.getvalue())


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    # weights_only=False: the file also holds RNG states (tuples, numpy dicts) that the
    # weights-only unpickler rejects; only load checkpoints you wrote yourself.
    return torch.load(path, map_location="cpu", weights_only=False)  # type: ignore[no-any-return]


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rng: np.random.Generator,
) -> tuple[int, dict[str, list[float]]]:
    """Restore a :func:`save_checkpoint` file in place; return ``(step, history)``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"resume: no checkpoint file at {str(path)!r}")
    state = _read(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["numpy_rng"]
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"]), state["history"]


def _numbered(out: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the ``checkpoint-<step>.pt`` files in ``out``, newest first."""
    found = [
        (int(m[1]), p) for p in out.glob("checkpoint-*.pt") if (m := NUMBERED.fullmatch(p.name))
    ]
    return sorted(found, reverse=True)


def latest_checkpoint(out: Path) -> Path | None:
    """The newest ``checkpoint-<step>.pt`` in ``out`` that loads (None if there is none).

    Our own writes are atomic, but a file truncated by something else (a full disk, a copy
    cut short) is skipped with a warning rather than ending the job.
    """
    for step, path in _numbered(out):
        try:
            if int(_read(path)["step"]) == step:
                return path
        except Exception as error:  # any unreadable file is skipped alike
            print(f"warning: skipping unreadable checkpoint {path}: {error!r}")
    return None


class ResumeRefusedError(Exception):
    """``--resume`` names no checkpoint, or ``auto`` found one of a run with other options."""


def resume_point(args: argparse.Namespace) -> Path | None:
    """The checkpoint this run continues from (None: it starts anew).

    Raises:
        ResumeRefusedError: If ``--resume auto`` finds a checkpoint of a run with other options,
            or the checkpoint file named by ``--resume`` does not exist.
    """
    if args.resume == "none":
        return None
    if args.resume != "auto":
        if not Path(args.resume).is_file():
            raise ResumeRefusedError(f"--resume {args.resume}: no such checkpoint file")
        return Path(args.resume)
    path = latest_checkpoint(args.out)
    if path is not None:
        _check_same_run(path, args)
    return path


def _check_same_run(path: Path, args: argparse.Namespace) -> None:
    saved = _read(path)["args"]
    differ = {
        name: (saved[name], str(value))
        for name, value in vars(args).items()
        if name not in BOOKKEEPING and name in saved and saved[name] != str(value)
    }
    if differ:
        details = ", ".join(f"--{k.replace('_', '-')} {a} vs {b}" for k, (a, b) in differ.items())
        raise ResumeRefusedError(
            f"{path} comes from a run with other options ({details}); "
            "pass --resume none to start over, or another --out"
        )


# ----------------------------------------------------------------------------- training


def meta_train(
    args: argparse.Namespace,
    build_model: Callable[[], nn.Module],
    meta_step: Callable[[nn.Module, torch.optim.Optimizer, Any, argparse.Namespace], list[float]],
    sample: Callable[[np.random.Generator], Any],
    *,
    series: Sequence[str],
    title: str,
    log_y: Sequence[str] = (),
) -> tuple[nn.Module, dict[str, Any]]:
    """Meta-train with Adam; return the model and a summary (printed; the caller adds its
    evaluation and saves it with :func:`write_summary`).

    Each step is the example's ``meta_step(model, optimizer, sample(rng), args)``; the values it
    returns are recorded under the matching names of ``series``. Around it: seeding, resuming,
    checkpoints, the progress bar, timing (and with ``--compare-plain``, the same steps' time in
    plain torch) and the learning curve. A run whose checkpoint is already at ``--steps`` trains
    and writes nothing, and its summary keeps the timing of the run that trained.
    """
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = build_model()
    meta_opt = torch.optim.Adam(model.parameters(), lr=args.meta_lr)
    start, history = 0, {name: [] for name in series}
    resume = resume_point(args)
    if resume is not None:
        start, history = load_checkpoint(resume, model=model, optimizer=meta_opt, rng=rng)
        print(f"resuming from {resume} at step {start}")
    record = {k: str(v) for k, v in vars(args).items()}

    def checkpoint(step: int) -> None:
        save_checkpoint(
            args.out / f"checkpoint-{step:06d}.pt", also=[args.out / "checkpoint.pt"],
            model=model, optimizer=meta_opt, step=step, rng=rng, history=history, args=record,
        )  # fmt: skip
        if args.keep:
            for _, old in _numbered(args.out)[args.keep :]:
                old.unlink()

    workers = 1 if args.plain else metadist.get_world_size()
    mode = "plain torch" if args.plain else f"metadist x{workers}"
    if start >= args.steps:
        print(
            f"nothing to train: {resume} is already at step {start} (--steps {args.steps}); "
            "wrote no checkpoint and no learning curve (--steps M trains on to step M, "
            "--resume none starts over)"
        )
        summary = training_summary(history[series[0]], [], workers=workers, seconds=0.0,
                                   name=series[0])  # fmt: skip
        kept = _previous_timing(args.out)
        summary.update(kept)
        if kept.get("ms_per_step") is not None:
            print(
                "summary.json keeps the timing of the run that trained: "
                f"{kept.get('trained_steps', '?')} steps, {kept['ms_per_step']:.2f} ms per step "
                f"({kept.get('mode')})" + _speedup_words(kept.get("versus_plain"))
            )
        return model, summary

    comparing = args.compare_plain > 0 and not args.plain
    versus = _PlainTimer(model, meta_opt, meta_step, args) if comparing else None
    step_seconds = []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc=f"MAML, {mode}")
    began = time.perf_counter()
    for step in bar:
        batch = sample(rng)
        tick = time.perf_counter()
        values = meta_step(model, meta_opt, batch, args)
        step_seconds.append(time.perf_counter() - tick)
        if versus is not None and (step - start) >= WARMUP_STEPS and step % args.compare_plain == 0:
            versus.time(batch, step_seconds[-1])
        for name, value in zip(series, values, strict=True):
            history[name].append(value)
        if step % 10 == 0:
            shown = {n: f"{np.mean(history[n][-50:]):.3g}" for n in series}
            bar.set_postfix(ms=f"{1e3 * statistics.median(step_seconds[-50:]):.1f}", **shown)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            checkpoint(step + 1)
    bar.close()
    elapsed = time.perf_counter() - began
    checkpoint(args.steps)
    curve = args.out / "learning_curve.png"
    plot_learning_curve(curve, history, title=f"{title}, {mode}", log_y=log_y)
    summary = training_summary(
        history[series[0]], step_seconds, workers=workers, seconds=elapsed, name=series[0]
    )
    summary["mode"] = mode
    if versus is not None:
        summary["versus_plain"] = versus.report(mode)
    print(f"wrote {args.out / 'checkpoint.pt'} (step {args.steps}) and {curve}")
    return model, summary


class _PlainTimer:
    """Times the step of a parallel run in plain torch in this process, on the same batches.

    The plain step runs on a copy of the model and of the optimizer (the parallel run's training
    is untouched), once with one intra-op thread and once with one per core, as one process on
    its own would run; meanwhile the other workers are idle. The plain steps follow the parallel
    step on the same batch, so all see the machine in the same state: the comparison holds on a
    machine shared with other jobs, where timings taken minutes apart do not. A thread count
    clearly slower than the other over the first ``TRIAL`` comparisons is left out afterwards
    (on a busy machine, two threads can take ten times as long as one).
    """

    TRIAL = 5

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        meta_step: Callable[..., list[float]],
        args: argparse.Namespace,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.meta_step = meta_step
        self.args = argparse.Namespace(**{**vars(args), "plain": True})
        self.copy: tuple[nn.Module, torch.optim.Optimizer] | None = None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.threads = sorted({1, cores or 1})
        self.timing = list(self.threads)  # the counts still timed
        # Seconds of each compared batch: the parallel step's, then the plain step's per count
        # (NaN for a count no longer timed).
        self.rows: list[list[float]] = []
        self.warm = False  # the first comparison builds caches and thread pools: not kept

    def time(self, batch: Any, parallel_seconds: float) -> None:
        """Run ``batch``'s step in plain torch and record its time beside the parallel one."""
        own_threads = torch.get_num_threads()
        row = [parallel_seconds] + [math.nan] * len(self.threads)
        try:
            if self.copy is None:
                model = copy.deepcopy(self.model)
                optimizer = type(self.optimizer)(model.parameters(), **self.optimizer.defaults)
                # A deep copy: load_state_dict keeps the tensors it is given, and the plain
                # steps must not move the Adam moments of the run being trained.
                optimizer.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))
                self.copy = model, optimizer
            for threads in self.timing:
                torch.set_num_threads(threads)
                tick = time.perf_counter()
                self.meta_step(*self.copy, batch, self.args)
                row[1 + self.threads.index(threads)] = time.perf_counter() - tick
        finally:
            torch.set_num_threads(own_threads)
        if self.warm:
            self.rows.append(row)
        self.warm = True
        if len(self.rows) == self.TRIAL and len(self.timing) > 1:
            medians = self._plain_medians()
            fastest = min(medians.values())
            self.timing = [t for t in self.timing if medians[t] <= 1.5 * fastest]

    def _plain_medians(self) -> dict[int, float]:
        ms = np.asarray(self.rows) * 1e3
        return {t: float(np.nanmedian(ms[:, i])) for i, t in enumerate(self.threads, start=1)}

    def report(self, mode: str) -> dict[str, Any] | None:
        """Print and return the medians and the speed-up over the fastest plain run (None if
        no step was compared)."""
        if not self.rows:
            return None
        ms = np.asarray(self.rows) * 1e3
        plain = self._plain_medians()
        best = min(plain, key=plain.__getitem__)
        column = 1 + self.threads.index(best)
        paired = ms[~np.isnan(ms[:, column])]  # the steps timed both ways
        parallel = float(np.median(paired[:, 0]))
        ratios = paired[:, column] / paired[:, 0]
        low, high = (float(np.percentile(ratios, q)) for q in (10, 90))
        speedup = float(np.median(paired[:, column])) / parallel
        counted = {t: int(np.count_nonzero(~np.isnan(ms[:, i]))) for i, t in
                   enumerate(self.threads, start=1)}  # fmt: skip
        each = ", ".join(
            f"{plain[t]:.1f} ms on {t} thread{'s' * (t > 1)}"
            + ("" if counted[t] == len(ms) else f" (first {counted[t]} steps, then left out)")
            for t in self.threads
        )
        if speedup >= 1:
            verdict = f"{mode} is {speedup:.2f}x faster than plain torch at its fastest here"
        else:
            verdict = (
                f"{mode} is {1 / speedup:.2f}x slower than plain torch at its fastest here: a "
                "step is too little work for the fixed cost of distributing it (docs/maml.md)"
            )
        print(
            f"speed on the same {len(paired)} steps, each run both ways (medians): {mode} "
            f"{parallel:.1f} ms per step; plain torch in one process {each}.\n"
            f"{verdict} (per-step ratio 10-90%: {low:.2f}-{high:.2f})"
        )
        return {
            "steps": len(paired),
            "ms_per_step": parallel,
            "plain_ms_per_step": {str(t): v for t, v in plain.items()},
            "plain_steps": {str(t): n for t, n in counted.items()},
            "speedup": speedup,
            "speedup_p10_p90": [low, high],
            "versus_threads": best,
        }


def _speedup_words(versus: dict[str, Any] | None) -> str:
    if not versus or "speedup" not in versus:
        return ""
    x = versus["speedup"]
    words = f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"
    return f", {words} than plain torch"


def _previous_timing(out: Path) -> dict[str, Any]:
    """The timing keys of ``out``'s summary.json (empty if it has none or is not JSON)."""
    try:
        previous = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: previous[k] for k in TIMING_KEYS if k in previous}


def write_summary(path: str | os.PathLike[str], summary: dict[str, Any]) -> None:
    """Write ``summary`` as strict JSON (a value that is not a finite number is an error)."""
    Path(path).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    print(f"wrote {path}")


def training_summary(
    curve: Sequence[float],
    step_seconds: Sequence[float],
    *,
    workers: int,
    seconds: float,
    name: str,
) -> dict[str, Any]:
    """Loss at the start and end of the curve (means of 20 steps) and the time per step.

    Values that do not exist (the time per step of a run that trained nothing) are None.
    """
    n = max(1, min(20, len(curve)))
    timed = list(step_seconds[WARMUP_STEPS:]) or list(step_seconds)
    ms = [1e3 * s for s in timed]
    summary: dict[str, Any] = {
        "steps": len(curve),
        "workers": workers,
        "trained_steps": len(step_seconds),
        "seconds": seconds if step_seconds else None,
        "first_loss": float(np.mean(curve[:n])) if curve else None,
        "last_loss": float(np.mean(curve[-n:])) if curve else None,
        "ms_per_step": statistics.median(ms) if ms else None,
        "ms_per_step_p10_p90": (
            [float(np.percentile(ms, 10)), float(np.percentile(ms, 90))] if ms else None
        ),
    }
    if ms:
        timing = (
            f"{len(step_seconds)} steps in {seconds:.1f} s, {summary['ms_per_step']:.2f} ms per "
            f"step (median; 10-90%: {summary['ms_per_step_p10_p90'][0]:.2f}-"
            f"{summary['ms_per_step_p10_p90'][1]:.2f})"
        )
    else:
        timing = "no steps run in this process (the checkpoint was already complete)"
    if curve:
        first, last = summary["first_loss"], summary["last_loss"]
        print(f"meta-train {name}: first {n} steps {first:.3f}, last {n} {last:.3f}; {timing}")
    else:
        print(f"meta-train {name}: {timing}")
    return summary


def plot_learning_curve(
    path: str | os.PathLike[str],
    series: dict[str, Sequence[float]],
    *,
    title: str,
    log_y: Sequence[str] = (),
    window: int = 25,
) -> None:
    """Save a PNG with one panel per series: the raw values and a moving average."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on workers or CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.6), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items(), strict=True):
        v = np.asarray(values, dtype=np.float64)
        steps = np.arange(1, len(v) + 1)
        ax.plot(steps, v, color="tab:blue", alpha=0.3, linewidth=0.8, label="per step")
        w = max(1, min(window, len(v)))
        if len(v) >= w:
            smooth = np.convolve(v, np.ones(w) / w, mode="valid")
            ax.plot(steps[w - 1 :], smooth, color="tab:blue", label=f"mean of {w}")
        ax.set_xlabel("meta-step")
        ax.set_ylabel(name)
        if name in log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
