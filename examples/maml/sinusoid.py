"""MAML sinusoid regression (Finn et al. 2017, section 5.1), parallel over tasks with metadist.

Each meta-step samples 25 tasks ``y = A sin(x - phi)`` with 10 support and 10 query points,
adapts the 1-40-40-1 ReLU net with one SGD step (alpha = 0.01) per task and updates the
initialisation with Adam (1e-3) on the post-adaptation query loss. ``meta_loss`` is split
over the workers by task: each worker adapts its contiguous chunk of tasks in one call,
vectorised with ``torch.func.vmap``, and distributed autograd carries the second-order
meta-gradient back to the model on rank 0.

Run on 2 workers, or alone (a world of 1)::

    torchrun --standalone --nproc_per_node=2 examples/maml/sinusoid.py
    python examples/maml/sinusoid.py --steps 500

At the end rank 0 evaluates on held-out tasks: MSE after K-shot adaptation with 1 and 10 SGD
steps, for MAML and for a baseline pretrained on all tasks jointly and fine-tuned the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from data import sample_sinusoid
from metalearn import (
    adapt,
    add_training_args,
    configure_threads,
    load_checkpoint,
    meta_objective,
    plot_learning_curve,
    save_checkpoint,
    training_summary,
)
from models import SineMLP
from torch import Tensor, nn
from tqdm import tqdm

import metadist

__all__ = ["evaluate", "main", "meta_loss", "parse_args", "pretrain_baseline", "train"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: Finn et al.'s setup with a short schedule)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_args(
        p,
        steps=8000,
        tasks=25,
        inner_lr=0.01,
        eval_tasks=500,
        out="runs/sinusoid",
        eval_help="held-out tasks for evaluation",
    )
    p.add_argument("--shots", type=int, default=10, help="K: support (and query) points per task")
    return p.parse_args(argv)


@metadist.parallelize(partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer)
def meta_loss(
    model: nn.Module,
    x_spt: Tensor,
    y_spt: Tensor,
    x_qry: Tensor,
    y_qry: Tensor,
    *,
    inner_lr: float,
    inner_steps: int,
    first_order: bool,
) -> Tensor:
    """Mean post-adaptation query MSE of this worker's chunk of tasks (leading dim = task)."""
    loss, _ = meta_objective(
        model,
        x_spt,
        y_spt,
        x_qry,
        y_qry,
        F.mse_loss,
        steps=inner_steps,
        lr=inner_lr,
        first_order=first_order,
        vectorize=True,  # 25 tasks, 1 thread: ~11 ms with vmap vs ~75 ms looping
    )
    return loss


def pretrain_baseline(args: argparse.Namespace) -> nn.Module:
    """Train the same net on all tasks jointly (plain regression, no adaptation in the loop)."""
    torch.manual_seed(args.seed + 1)
    rng = np.random.default_rng([args.seed, 1])
    net = SineMLP()
    opt = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    for _ in range(args.steps):
        b = sample_sinusoid(rng, args.tasks, args.shots, args.shots)
        loss = F.mse_loss(net(b.x_spt), b.y_spt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


def evaluate(
    net: nn.Module, args: argparse.Namespace, steps: tuple[int, ...] = (0, 1, 10)
) -> dict[int, tuple[float, float]]:
    """Query MSE (mean, 95% half-width) after K-shot adaptation with each number of steps.

    The held-out tasks come from their own seed, so MAML and the baseline see the same tasks.
    Adaptation uses the meta-training rule: plain SGD with ``--inner-lr`` on the K points.
    """
    rng = np.random.default_rng([args.seed, 2])
    b = sample_sinusoid(rng, args.eval_tasks, args.shots, 100)
    params = {k: v.detach() for k, v in net.named_parameters()}
    results = {}
    for n in steps:

        def task_mse(xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor, n: int = n) -> Tensor:
            fast = adapt(net, params, xs, ys, F.mse_loss, steps=n, lr=args.inner_lr)
            return F.mse_loss(torch.func.functional_call(net, fast, (xq,)), yq)

        mse = torch.func.vmap(task_mse)(b.x_spt, b.y_spt, b.x_qry, b.y_qry).detach()
        results[n] = (mse.mean().item(), 1.96 * mse.std().item() / math.sqrt(len(mse)))
    return results


@metadist.rank_zero_only
def train(args: argparse.Namespace) -> None:
    """Meta-train on rank 0 (the other workers serve ``meta_loss`` calls), then evaluate."""
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = SineMLP()
    meta_opt = torch.optim.Adam(model.parameters(), lr=args.meta_lr)
    start, history = 0, {"query MSE": []}
    if args.resume is not None:
        start, history = load_checkpoint(args.resume, model=model, optimizer=meta_opt, rng=rng)
    ckpt = args.out / "checkpoint.pt"
    world = metadist.get_world_size()

    def checkpoint(step: int, path: Path = ckpt) -> None:
        save_checkpoint(
            path,
            model=model,
            optimizer=meta_opt,
            step=step,
            rng=rng,
            history=history,
            args={k: str(v) for k, v in vars(args).items()},
        )

    began = time.perf_counter()
    bar = tqdm(
        range(start, args.steps), initial=start, total=args.steps, desc=f"MAML x{world} workers"
    )
    for step in bar:
        b = sample_sinusoid(rng, args.tasks, args.shots, args.shots)
        meta_opt.zero_grad()
        with metadist.autograd.context() as ctx:
            loss = meta_loss(
                model,
                b.x_spt,
                b.y_spt,
                b.x_qry,
                b.y_qry,
                inner_lr=args.inner_lr,
                inner_steps=args.inner_steps,
                first_order=args.first_order,
            )
            metadist.autograd.backward(ctx, [loss])
        meta_opt.step()
        history["query MSE"].append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(history['query MSE'][-50:]):.3f}")
        if args.save_every and (step + 1) % args.save_every == 0:
            checkpoint(step + 1, args.out / f"checkpoint-{step + 1:06d}.pt")
    bar.close()
    elapsed = time.perf_counter() - began
    checkpoint(args.steps)
    plot_learning_curve(
        args.out / "learning_curve.png",
        history,
        title=f"MAML sinusoid, {args.tasks} tasks/step, {world} worker(s)",
        log_y=("query MSE",),
    )
    summary = training_summary(
        history["query MSE"], steps=args.steps, workers=world, seconds=elapsed, name="query MSE"
    )
    print(f"wrote {ckpt} and {args.out / 'learning_curve.png'}")
    if not args.no_eval:
        maml = evaluate(model, args)
        base = evaluate(pretrain_baseline(args), args)
        print(f"held-out query MSE over {args.eval_tasks} tasks, K={args.shots} (mean ± 95% CI):")
        print(f"{'adaptation steps':>18} {'MAML':>16} {'pretrained':>16}")
        for n in maml:
            print(
                f"{n:>18} {maml[n][0]:>9.3f} ± {maml[n][1]:.3f}"
                f" {base[n][0]:>9.3f} ± {base[n][1]:.3f}"
            )
        summary["eval"] = {"maml": maml, "pretrained": base}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))


@metadist.auto_init_rpc(configure_threads)
def main() -> None:
    """Entry point on every worker: rank 0 trains, the others serve remote calls."""
    train(parse_args())


if __name__ == "__main__":
    main()
