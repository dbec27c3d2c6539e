"""MAML sinusoid regression (Finn et al. 2017, section 5.1), parallel over tasks with metadist.

The whole program, top to bottom: model, tasks, inner loop, the meta-loss metadist splits over
the workers, the training step, and the result. The loop's bookkeeping (options, checkpoints and
``--resume``, the learning curve, timing) is in ``training.py``::

    python examples/maml/sinusoid.py --workers 2       # = make maml: two local workers
    torchrun --standalone --nproc_per_node=2 examples/maml/sinusoid.py   # the same, by hand
    python examples/maml/sinusoid.py --plain           # the same step in plain torch
    torchrun --standalone --max-restarts=3 --nproc_per_node=2 examples/maml/sinusoid.py

The last survives a dead worker (rank 0 resumes from the newest checkpoint). The defaults are
the paper's: 25 tasks of K = 10 points per meta-batch, alpha = 0.01, Adam at 1e-3; 8000
meta-steps (the paper's code runs 70,000) reach the held-out error of docs/maml.md. At 25 tasks
a step is too little work to split: two workers are slower than one plain process, as the run
prints at its end (--compare-plain); fewshot.py is the example where distributing pays.
"""

from __future__ import annotations

import argparse
import inspect
import math
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from training import HelpFormatter, add_training_args, launch, meta_train, write_summary

import metadist

Params = dict[str, Tensor]


# -- The model: Finn et al.'s 1-40-40-1 ReLU regressor (``--hidden`` sets the width).
class SineMLP(nn.Module):
    def __init__(self, hidden: int = 40) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 1),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # type: ignore[no-any-return]


# -- The tasks: y = A sin(x - phi), A ~ U[0.1, 5], phi ~ U[0, pi], x ~ U[-5, 5]; K support and
# Q query points each. The leading dimension of every tensor is the task.
def sample_tasks(
    rng: np.random.Generator, n_tasks: int, k_support: int = 10, k_query: int = 10
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    amplitude = rng.uniform(0.1, 5.0, size=(n_tasks, 1, 1))
    phase = rng.uniform(0.0, np.pi, size=(n_tasks, 1, 1))
    x = rng.uniform(-5.0, 5.0, size=(n_tasks, k_support + k_query, 1))
    xs, ys = (torch.from_numpy(a.astype(np.float32)) for a in (x, amplitude * np.sin(x - phase)))
    return xs[:, :k_support], ys[:, :k_support], xs[:, k_support:], ys[:, k_support:]


# -- The inner loop: SGD on one task's support set. The parameters are a dict, run with
# functional_call; torch.func.grad composes with autograd, so the adapted parameters stay
# differentiable in the initial ones (second-order MAML; first_order=True cuts that path).
def adapt(
    model: nn.Module, params: Params, x: Tensor, y: Tensor, *, steps: int, lr: float,
    first_order: bool = False,
) -> Params:  # fmt: skip
    def support_loss(p: Params) -> Tensor:
        return F.mse_loss(functional_call(model, p, (x,)), y)

    for _ in range(steps):
        grads = grad(support_loss)(params)
        if first_order:
            grads = {k: g.detach() for k, g in grads.items()}
        params = {k: p - lr * grads[k] for k, p in params.items()}
    return params


def task_loss(  # noqa: PLR0917 - one positional per task tensor, for vmap
    model: nn.Module, params: Params, xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor, *,
    steps: int, lr: float, first_order: bool = False,
) -> Tensor:  # fmt: skip
    """One task's query MSE after adapting on its support set."""
    fast = adapt(model, params, xs, ys, steps=steps, lr=lr, first_order=first_order)
    return F.mse_loss(functional_call(model, fast, (xq,)), yq)


# -- The meta-loss, parallel over tasks: metadist splits the task dimension over the workers; each
# adapts its chunk in one vectorised call and the mean comes back to rank 0 with its graph.
@metadist.parallelize(partitioner=metadist.dim_partitioner(0), reducer=metadist.mean_reducer)
def meta_loss(
    model: nn.Module, x_spt: Tensor, y_spt: Tensor, x_qry: Tensor, y_qry: Tensor, *,
    inner_lr: float, inner_steps: int, first_order: bool,
) -> Tensor:  # fmt: skip
    """Mean post-adaptation query MSE of this worker's chunk of tasks."""
    one = partial(task_loss, model, dict(model.named_parameters()),
                  steps=inner_steps, lr=inner_lr, first_order=first_order)  # fmt: skip
    return vmap(one)(x_spt, y_spt, x_qry, y_qry).mean()  # vmap: ~7x a loop on 1 thread


# -- The training step, as in one process: metadist's call is differentiable, so loss.backward()
# returns the meta-gradient from the workers into model's .grad (--plain skips metadist).
def meta_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, ...],
    args: argparse.Namespace,
) -> list[float]:  # fmt: skip
    hyper = {k: getattr(args, k) for k in ("inner_lr", "inner_steps", "first_order")}
    optimizer.zero_grad()
    # --plain: the same function, unsplit, in this process; the step is otherwise the same.
    loss = (inspect.unwrap(meta_loss) if args.plain else meta_loss)(model, *batch, **hyper)
    loss.backward()
    optimizer.step()
    return [loss.item()]


# -- The result: query MSE on held-out tasks after K-shot adaptation with 0, 1 and 10 steps, for
# MAML and for the same net trained on all tasks jointly (plain regression), fine-tuned alike.
def pretrain_baseline(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed + 1)
    rng = np.random.default_rng([args.seed, 1])
    net = SineMLP(args.hidden)
    opt = torch.optim.Adam(net.parameters(), lr=args.meta_lr)
    for _ in range(args.steps):
        x, y, _, _ = sample_tasks(rng, args.tasks, args.shots, args.shots)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return net


def evaluate(net: nn.Module, args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """Query MSE (mean, 95% half-width) per number of adaptation steps, on seeded tasks."""
    rng = np.random.default_rng([args.seed, 2])  # the same held-out tasks for both nets
    x_spt, y_spt, x_qry, y_qry = sample_tasks(rng, args.eval_tasks, args.shots, 100)
    params = {k: v.detach() for k, v in net.named_parameters()}
    results = {}
    for n in (0, 1, 10):
        one = partial(task_loss, net, params, steps=n, lr=args.inner_lr)
        mse = vmap(one)(x_spt, y_spt, x_qry, y_qry).detach()
        results[n] = (mse.mean().item(), 1.96 * mse.std().item() / math.sqrt(len(mse)))
    return results


def train(args: argparse.Namespace) -> None:
    """Meta-train on rank 0 (the other workers serve its calls), then evaluate."""
    model, summary = meta_train(
        args, lambda: SineMLP(args.hidden), meta_step,
        lambda rng: sample_tasks(rng, args.tasks, args.shots, args.shots),
        series=("query MSE",), log_y=("query MSE",),
        title=f"MAML sinusoid, {args.tasks} tasks/step, width {args.hidden}",
    )  # fmt: skip
    if not args.no_eval:
        maml, base = evaluate(model, args), evaluate(pretrain_baseline(args), args)
        print(f"held-out query MSE over {args.eval_tasks} tasks, K={args.shots} (mean ± 95% CI):")
        print(f"{'adaptation steps':>18} {'MAML':>16} {'pretrained':>16}")
        for n, (m, m_ci) in maml.items():
            print(f"{n:>18} {m:>9.3f} ± {m_ci:.3f} {base[n][0]:>9.3f} ± {base[n][1]:.3f}")
        summary["eval"] = {"maml": maml, "pretrained": base}
    write_summary(args.out / "summary.json", summary)


def build_parser() -> argparse.ArgumentParser:
    """Command-line options (``--help`` lists them with their defaults: Finn et al.'s)."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Defaults are Finn et al.'s settings: 25 tasks per meta-batch, K = 10, "
        "alpha = 0.01, Adam at 1e-3; 8000 meta-steps (the paper's code: 70,000) reach the "
        "held-out error of docs/maml.md.",
        formatter_class=HelpFormatter,
    )
    add_training_args(
        p, steps=8000, tasks=25, hidden=40, inner_lr=0.01, meta_lr=1e-3, eval_tasks=500,
        save_every=1000, out="runs/sinusoid", hidden_help="hidden units per layer",
        compare_plain=20,
    )  # fmt: skip
    p.add_argument("--shots", type=int, default=10, help="K: support (and query) points per task")
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point on every worker: rank 0 trains, the others serve remote calls."""
    launch(train, build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    main()
