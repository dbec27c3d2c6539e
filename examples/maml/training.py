"""What the MAML examples share besides the algorithm: options, the loop's bookkeeping, checkpoints.

The examples hold the program (model, tasks, meta-loss, ``meta_step``); ``meta_train`` runs their
step on rank 0 (the other workers serve its ``meta_loss`` calls), or with ``--plain`` in one
process without metadist, the baseline a parallel run has to beat. Checkpoints are written
atomically and hold everything a bit-exact continuation needs, so that a job restarted by
``torchrun --max-restarts=N`` picks up from the newest one (``--resume auto``, the default).
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import random
import re
import statistics
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
    "save_checkpoint",
    "training_summary",
]

# Options that do not change what is computed: a run resumed with other values of these
# continues the same training. Any other difference means --out holds a different run.
BOOKKEEPING = {
    "steps", "out", "resume", "save_every", "keep", "no_eval", "eval_tasks", "threads", "plain",
    "test_inner_steps",
}  # fmt: skip
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


def launch(train: Callable[[argparse.Namespace], object], args: argparse.Namespace) -> None:
    """Run ``train(args)``: on rank 0 of an RPC world (every torchrun worker calls this; the
    others serve remote calls until rank 0 is done), or here alone with ``--plain``."""
    if args.plain:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--plain runs in one process: start it with python, not torchrun")
        configure_threads(args.threads)
        train(args)
        return
    init = functools.partial(configure_threads, args.threads)
    metadist.auto_init_rpc(init)(metadist.rank_zero_only(train))(args)


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


def _check_same_run(path: Path, args: argparse.Namespace) -> None:
    saved = _read(path)["args"]
    differ = {
        name: (saved[name], str(value))
        for name, value in vars(args).items()
        if name not in BOOKKEEPING and name in saved and saved[name] != str(value)
    }
    if differ:
        details = ", ".join(f"--{k.replace('_', '-')} {a} vs {b}" for k, (a, b) in differ.items())
        raise SystemExit(
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
    """Meta-train with Adam; return the model and a summary (printed, and saved by the caller).

    Each step is the example's ``meta_step(model, optimizer, sample(rng), args)``; the values it
    returns are recorded under the matching names of ``series``. Around it: seeding, resuming,
    checkpoints, the progress bar, timing and the learning curve.
    """
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = build_model()
    meta_opt = torch.optim.Adam(model.parameters(), lr=args.meta_lr)
    start, history = 0, {name: [] for name in series}
    resume = None if args.resume == "none" else args.resume
    if resume == "auto":
        resume = latest_checkpoint(args.out)
        if resume is not None:
            _check_same_run(resume, args)
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
    step_seconds = []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc=f"MAML, {mode}")
    began = time.perf_counter()
    for step in bar:
        tick = time.perf_counter()
        values = meta_step(model, meta_opt, sample(rng), args)
        step_seconds.append(time.perf_counter() - tick)
        for name, value in zip(series, values, strict=True):
            history[name].append(value)
        if step % 10 == 0:
            shown = {n: f"{np.mean(history[n][-50:]):.3g}" for n in series}
            bar.set_postfix(ms=f"{1e3 * statistics.median(step_seconds[-50:]):.1f}", **shown)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            checkpoint(step + 1)
    bar.close()
    elapsed = time.perf_counter() - began
    if start < args.steps:
        checkpoint(args.steps)
    else:
        print(f"{resume} is already at step {args.steps}: nothing to train (--resume none: anew)")
    curve = args.out / "learning_curve.png"
    plot_learning_curve(curve, history, title=f"{title}, {mode}", log_y=log_y)
    summary = training_summary(
        history[series[0]], step_seconds, workers=workers, seconds=elapsed, name=series[0]
    )
    summary["mode"] = mode
    print(f"wrote {args.out / 'checkpoint.pt'} and {curve}")
    return model, summary


def training_summary(
    curve: Sequence[float],
    step_seconds: Sequence[float],
    *,
    workers: int,
    seconds: float,
    name: str,
) -> dict[str, Any]:
    """Loss at the start and end of the curve (means of 20 steps) and the time per step."""
    n = max(1, min(20, len(curve)))
    timed = list(step_seconds[WARMUP_STEPS:]) or list(step_seconds) or [float("nan")]
    ms = [1e3 * s for s in timed]
    summary: dict[str, Any] = {
        "steps": len(curve),
        "workers": workers,
        "seconds": seconds,
        "first_loss": float(np.mean(curve[:n])) if curve else float("nan"),
        "last_loss": float(np.mean(curve[-n:])) if curve else float("nan"),
        "ms_per_step": statistics.median(ms),
        "ms_per_step_p10_p90": [float(np.percentile(ms, 10)), float(np.percentile(ms, 90))],
    }
    timing = (
        f"{len(step_seconds)} steps in {seconds:.1f} s, {summary['ms_per_step']:.2f} ms per step "
        f"(median; 10-90%: {summary['ms_per_step_p10_p90'][0]:.2f}-"
        f"{summary['ms_per_step_p10_p90'][1]:.2f})"
        if step_seconds
        else "no steps run in this process (the checkpoint was already complete)"
    )
    print(
        f"meta-train {name}: first {n} steps {summary['first_loss']:.3f}, "
        f"last {n} steps {summary['last_loss']:.3f}; {timing}"
    )
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
