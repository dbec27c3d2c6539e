"""MAML building blocks shared by the examples and the benchmark.

The inner loop is written with ``torch.func``: ``functional_call`` runs the meta-model with
adapted parameters held in a dict, and ``grad`` computes the support-set gradient. Because
``torch.func.grad`` composes with ordinary autograd, the adapted parameters stay differentiable
with respect to the meta-parameters (second-order MAML) without ``create_graph`` bookkeeping;
``first_order=True`` cuts that path (FOMAML).
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

__all__ = [
    "LossFn",
    "adapt",
    "add_training_args",
    "configure_threads",
    "load_checkpoint",
    "meta_objective",
    "plot_learning_curve",
    "save_checkpoint",
    "task_objective",
    "training_summary",
]

LossFn = Callable[[Tensor, Tensor], Tensor]
Params = dict[str, Tensor]


def configure_threads() -> int:
    """Give this process its share of the CPU cores and return the thread count.

    ``torchrun`` starts ``LOCAL_WORLD_SIZE`` workers on one machine; if each used every core
    (torch's default) they would oversubscribe the CPU and run slower than one process. Each
    worker gets ``cores // LOCAL_WORLD_SIZE`` intra-op threads (at least 1); a lone process
    keeps all cores.

    Returns:
        The number of intra-op threads now in use.

    Example:
        >>> configure_threads() >= 1
        True
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = max(1, (cores or 1) // max(1, local_world))
    torch.set_num_threads(threads)
    return threads


def adapt(
    model: nn.Module,
    params: Params,
    x: Tensor,
    y: Tensor,
    loss_fn: LossFn,
    *,
    steps: int,
    lr: float,
    first_order: bool = False,
) -> Params:
    """Run ``steps`` SGD steps of ``loss_fn`` on one task's support set.

    Args:
        model: The network; only its structure is used, parameters come from ``params``.
        params: Parameter name to tensor, as from ``dict(model.named_parameters())``.
        x: Support inputs of one task.
        y: Support targets of one task.
        loss_fn: ``loss_fn(prediction, target) -> scalar``.
        steps: Number of inner gradient steps (0 returns ``params`` unchanged).
        lr: Inner learning rate (alpha).
        first_order: Treat the inner gradients as constants (FOMAML).

    Returns:
        The adapted parameters, differentiable w.r.t. ``params`` unless ``first_order``.

    Example:
        >>> from models import SineMLP
        >>> net = SineMLP()
        >>> p = adapt(net, dict(net.named_parameters()), torch.ones(5, 1), torch.ones(5, 1),
        ...           torch.nn.functional.mse_loss, steps=1, lr=0.01)
        >>> sorted(p) == sorted(dict(net.named_parameters()))
        True
    """

    def support_loss(p: Params) -> Tensor:
        return loss_fn(functional_call(model, p, (x,)), y)

    for _ in range(steps):
        grads = grad(support_loss)(params)
        params = {
            name: value - lr * (grads[name].detach() if first_order else grads[name])
            for name, value in params.items()
        }
    return params


def task_objective(  # noqa: PLR0917 - one positional per task tensor, like the paper
    model: nn.Module,
    params: Params,
    x_spt: Tensor,
    y_spt: Tensor,
    x_qry: Tensor,
    y_qry: Tensor,
    loss_fn: LossFn,
    *,
    steps: int,
    lr: float,
    first_order: bool = False,
    classify: bool = False,
) -> tuple[Tensor, Tensor]:
    """Adapt on one task's support set and score the query set.

    Args:
        model: The network (structure only).
        params: Meta-parameters to adapt from.
        x_spt: Support inputs.
        y_spt: Support targets.
        x_qry: Query inputs.
        y_qry: Query targets.
        loss_fn: ``loss_fn(prediction, target) -> scalar``.
        steps: Inner gradient steps.
        lr: Inner learning rate.
        first_order: FOMAML instead of second-order MAML.
        classify: Also compute the query accuracy (else the second value is 0).

    Returns:
        ``(query_loss, query_accuracy)``; the accuracy carries no gradient.

    Example:
        >>> from models import SineMLP
        >>> net = SineMLP()
        >>> x = torch.ones(5, 1)
        >>> loss, _ = task_objective(net, dict(net.named_parameters()), x, x, x, x,
        ...                          torch.nn.functional.mse_loss, steps=1, lr=0.01)
        >>> loss.ndim
        0
    """
    fast = adapt(model, params, x_spt, y_spt, loss_fn, steps=steps, lr=lr, first_order=first_order)
    out = functional_call(model, fast, (x_qry,))
    loss = loss_fn(out, y_qry)
    if classify:
        acc = (out.detach().argmax(dim=-1) == y_qry).to(out.dtype).mean()
    else:
        acc = torch.zeros((), dtype=out.dtype)
    return loss, acc


def meta_objective(  # noqa: PLR0917 - one positional per task tensor, like the paper
    model: nn.Module,
    x_spt: Tensor,
    y_spt: Tensor,
    x_qry: Tensor,
    y_qry: Tensor,
    loss_fn: LossFn,
    *,
    steps: int,
    lr: float,
    first_order: bool = False,
    classify: bool = False,
    vectorize: bool = True,
    params: Params | None = None,
) -> tuple[Tensor, Tensor]:
    """Mean query loss and accuracy over a batch of tasks (leading dimension = task).

    ``vectorize=True`` maps :func:`task_objective` over the tasks with ``torch.func.vmap``
    (one big kernel per layer: fastest for small MLPs); ``False`` loops over the tasks (on CPU
    a per-task loop is faster for conv nets, whose batched-conv rule folds tasks into groups).

    Args:
        model: The meta-model; its parameters are the meta-parameters unless ``params`` is given.
        x_spt: ``(T, K_s, ...)`` support inputs.
        y_spt: ``(T, K_s, ...)`` support targets.
        x_qry: ``(T, K_q, ...)`` query inputs.
        y_qry: ``(T, K_q, ...)`` query targets.
        loss_fn: ``loss_fn(prediction, target) -> scalar``.
        steps: Inner gradient steps.
        lr: Inner learning rate.
        first_order: FOMAML instead of second-order MAML.
        classify: Compute query accuracy too.
        vectorize: vmap over tasks instead of a Python loop.
        params: Parameters to start adaptation from (default: the model's own).

    Returns:
        ``(mean query loss, mean query accuracy)`` over the ``T`` tasks.

    Raises:
        ValueError: If the task batch is empty.

    Example:
        >>> from models import SineMLP
        >>> net = SineMLP()
        >>> x = torch.ones(4, 5, 1)
        >>> loss, _ = meta_objective(net, x, x, x, x, torch.nn.functional.mse_loss,
        ...                          steps=1, lr=0.01)
        >>> loss.ndim
        0
    """
    if x_spt.shape[0] == 0:
        raise ValueError(f"x_spt: expected at least one task, got shape {tuple(x_spt.shape)}")
    if params is None:
        params = dict(model.named_parameters())

    def one(xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> tuple[Tensor, Tensor]:
        return task_objective(
            model,
            params,
            xs,
            ys,
            xq,
            yq,
            loss_fn,
            steps=steps,
            lr=lr,
            first_order=first_order,
            classify=classify,
        )

    if vectorize:
        losses, accs = vmap(one)(x_spt, y_spt, x_qry, y_qry)
        return losses.mean(), accs.mean()
    pairs = [one(*task) for task in zip(x_spt, y_spt, x_qry, y_qry, strict=True)]
    return (
        torch.stack([p[0] for p in pairs]).mean(),
        torch.stack([p[1] for p in pairs]).mean(),
    )


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    rng: np.random.Generator,
    history: dict[str, list[float]],
    args: dict[str, Any],
) -> None:
    """Write everything needed to continue training exactly where it stopped.

    Besides the meta-model and the meta-optimizer state, the file holds the step, the task
    sampler's state and torch's and Python's RNG states, so a resumed run draws the same tasks
    a straight run would have drawn. The file is written next to ``path`` and renamed over it,
    so an interrupted save never leaves a truncated checkpoint.

    Args:
        path: Destination file.
        model: The meta-model.
        optimizer: The meta-optimizer.
        step: Number of meta-steps completed.
        rng: The task sampler.
        history: Learning-curve series (name -> one value per step).
        args: The run's command-line arguments, for the record.

    Example:
        >>> import tempfile
        >>> net = torch.nn.Linear(1, 1)
        >>> opt = torch.optim.Adam(net.parameters())
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_checkpoint(f"{d}/c.pt", model=net, optimizer=opt, step=3,
        ...                     rng=np.random.default_rng(0), history={}, args={})
    """
    path = Path(path)
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
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rng: np.random.Generator,
) -> tuple[int, dict[str, list[float]]]:
    """Restore a :func:`save_checkpoint` file in place; return ``(step, history)``.

    Args:
        path: Checkpoint file.
        model: Meta-model to load the weights into.
        optimizer: Meta-optimizer to load the state into.
        rng: Task sampler whose state is overwritten.

    Returns:
        The number of completed steps and the learning-curve history.

    Raises:
        FileNotFoundError: If ``path`` does not exist.

    Example:
        >>> import tempfile
        >>> net = torch.nn.Linear(1, 1)
        >>> opt = torch.optim.Adam(net.parameters())
        >>> rng = np.random.default_rng(0)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_checkpoint(f"{d}/c.pt", model=net, optimizer=opt, step=3, rng=rng,
        ...                     history={}, args={})
        ...     load_checkpoint(f"{d}/c.pt", model=net, optimizer=opt, rng=rng)
        (3, {})
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"resume: no checkpoint file at {str(path)!r}")
    # weights_only=False: the file also holds RNG states (tuples, numpy dicts) that the
    # weights-only unpickler rejects; only load checkpoints you wrote yourself.
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["numpy_rng"]
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"]), state["history"]


def plot_learning_curve(
    path: str | os.PathLike[str],
    series: dict[str, Sequence[float]],
    *,
    title: str,
    log_y: Sequence[str] = (),
    window: int = 25,
) -> None:
    """Save a PNG with one panel per series: raw values and a moving average.

    Args:
        path: Output PNG file.
        series: Panel name -> one value per meta-step.
        title: Figure title.
        log_y: Names of the series drawn on a log scale.
        window: Moving-average window in steps.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     plot_learning_curve(f"{d}/c.png", {"loss": [3.0, 2.0, 1.0]}, title="demo")
    """
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


def add_training_args(
    parser: argparse.ArgumentParser,
    *,
    steps: int,
    tasks: int,
    inner_lr: float,
    eval_tasks: int,
    out: str,
    eval_help: str,
) -> None:
    """Add the options every MAML example shares, with that example's defaults.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_training_args(p, steps=10, tasks=4, inner_lr=0.1, eval_tasks=5, out="o",
        ...                   eval_help="held-out tasks")
        >>> p.parse_args([]).steps
        10
    """
    p = parser
    p.add_argument("--steps", type=int, default=steps, help="meta-steps (total, also on resume)")
    p.add_argument("--tasks", type=int, default=tasks, help="tasks per meta-batch")
    p.add_argument("--inner-steps", type=int, default=1, help="adaptation steps in training")
    p.add_argument("--inner-lr", type=float, default=inner_lr, help="alpha, inner learning rate")
    p.add_argument("--meta-lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--first-order", action="store_true", help="FOMAML: drop second-order terms")
    p.add_argument("--eval-tasks", type=int, default=eval_tasks, help=eval_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(out), help="output directory")
    p.add_argument("--resume", type=Path, default=None, help="checkpoint to continue from")
    p.add_argument(
        "--save-every", type=int, default=0, help="also keep checkpoint-<step>.pt every N steps"
    )
    p.add_argument("--no-eval", action="store_true", help="skip the final evaluation")


def training_summary(
    curve: Sequence[float], *, steps: int, workers: int, seconds: float, name: str
) -> dict[str, object]:
    """Summarize a meta-training curve (mean of its first and last 20 steps) and print it.

    Example:
        >>> training_summary([2.0, 1.0], steps=2, workers=1, seconds=0.5, name="loss")["last_loss"]
        meta-train loss: first 2 steps 1.500, last 2 steps 1.500  (0.5 s)
        1.5
    """
    n = max(1, min(20, len(curve)))
    summary: dict[str, object] = {
        "steps": steps,
        "workers": workers,
        "seconds": seconds,
        "first_loss": float(np.mean(curve[:n])),
        "last_loss": float(np.mean(curve[-n:])),
    }
    print(
        f"meta-train {name}: first {n} steps {summary['first_loss']:.3f}, "
        f"last {n} steps {summary['last_loss']:.3f}  ({seconds:.1f} s)"
    )
    return summary
