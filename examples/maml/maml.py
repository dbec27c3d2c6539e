"""MAML (Finn et al. 2017) in a page, with ``torch.func``.

``adapt`` is the inner loop: plain SGD on one task's support set, the parameters held in a
dict and the network run with ``functional_call``. ``torch.func.grad`` composes with ordinary
autograd, so the adapted parameters stay differentiable with respect to the meta-parameters
and the query loss carries the second-order meta-gradient (``first_order=True`` cuts that path:
FOMAML). ``task_objective`` scores one task; ``meta_objective`` averages a batch of tasks, with
``vmap`` or a loop. Everything else (data, command line, checkpoints, distribution) lives
elsewhere: the examples hand ``meta_objective`` to ``metadist.parallelize`` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

__all__ = ["LossFn", "Params", "adapt", "meta_objective", "task_objective"]

LossFn = Callable[[Tensor, Tensor], Tensor]  # loss_fn(prediction, target) -> scalar
Params = dict[str, Tensor]


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
    """``steps`` SGD steps of ``loss_fn`` on one task's support set ``(x, y)``, from ``params``."""

    def support_loss(p: Params) -> Tensor:
        return loss_fn(functional_call(model, p, (x,)), y)

    for _ in range(steps):
        grads = grad(support_loss)(params)
        params = {
            name: p - lr * (grads[name].detach() if first_order else grads[name])
            for name, p in params.items()
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
    """Adapt on one task's support set; return its query loss and accuracy (0 unless classify).

    The accuracy is a detached statistic: only the loss carries the meta-gradient.
    """
    fast = adapt(model, params, x_spt, y_spt, loss_fn, steps=steps, lr=lr, first_order=first_order)
    out = functional_call(model, fast, (x_qry,))
    if classify:
        acc = (out.detach().argmax(dim=-1) == y_qry).to(out.dtype).mean()
    else:
        acc = torch.zeros((), dtype=out.dtype)
    return loss_fn(out, y_qry), acc


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
) -> tuple[Tensor, Tensor]:
    """Mean query loss and accuracy over a batch of tasks (the leading dimension of each tensor).

    ``vectorize=True`` runs the tasks as one batch with ``vmap`` (fastest for small MLPs);
    ``False`` loops over them (faster on CPU for conv nets, whose batched convolution folds the
    tasks into channel groups).
    """
    if x_spt.shape[0] == 0:
        raise ValueError(f"x_spt: expected at least one task, got shape {tuple(x_spt.shape)}")
    params = dict(model.named_parameters())

    def one(xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> tuple[Tensor, Tensor]:
        return task_objective(
            model, params, xs, ys, xq, yq, loss_fn,
            steps=steps, lr=lr, first_order=first_order, classify=classify,
        )  # fmt: skip

    if vectorize:
        losses, accs = vmap(one)(x_spt, y_spt, x_qry, y_qry)
    else:
        pairs = [one(*task) for task in zip(x_spt, y_spt, x_qry, y_qry, strict=True)]
        losses, accs = (torch.stack(column) for column in zip(*pairs, strict=True))
    return losses.mean(), accs.mean()
