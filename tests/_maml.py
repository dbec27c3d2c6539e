"""A small conv MAML shared by the call-path tests: model, task batches, the one-process
meta-gradient. ``maml_loss`` is sent to workers by reference (``_maml.maml_loss``)."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.functional import cross_entropy, relu


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(relu(self.bn(self.conv(x))).flatten(1))


def maml_loss(
    model: nn.Module,
    x_spt: torch.Tensor,
    y_spt: torch.Tensor,
    x_qry: torch.Tensor,
    y_qry: torch.Tensor,
) -> torch.Tensor:
    """Mean query loss over this partition's tasks after 2 inner SGD steps (torch.func)."""
    params = dict(model.named_parameters())
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    # BatchNorm updates its running statistics in place: inside torch.func.grad they must be
    # an input of the transformed function, not captured.
    def inner(
        p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        return cross_entropy(functional_call(model, (p, b), (x,)), y)

    losses = []
    for t in range(x_spt.shape[0]):
        fast = params
        for _ in range(2):
            grads = torch.func.grad(inner)(fast, buffers, x_spt[t], y_spt[t])
            fast = {k: fast[k] - 0.4 * grads[k] for k in fast}
        losses.append(inner(fast, buffers, x_qry[t], y_qry[t]))
    return torch.stack(losses).mean()


def tasks(seed: int, n_tasks: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_tasks, 5, 1, 6, 6, generator=g),
        torch.randint(0, 3, (n_tasks, 5), generator=g),
        torch.randn(n_tasks, 5, 1, 6, 6, generator=g),
        torch.randint(0, 3, (n_tasks, 5), generator=g),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@functools.cache
def maml_setup() -> tuple[
    ConvNet, tuple[torch.Tensor, ...], list[nn.Parameter], tuple[torch.Tensor, ...]
]:
    """The model, 7 tasks (3, 2, 2 over 3 workers) and the single-process meta-gradient."""
    torch.manual_seed(0)
    model = ConvNet()
    batch = tasks(1, 7)
    params = list(model.parameters())
    ref_grads = torch.autograd.grad(maml_loss(model, *batch), params)
    return model, batch, params, ref_grads
