# qhm() stays TorchScript-compatible (no `not in {...}`: a user's twin may script it); it mirrors
# qhoptim.
# ruff: noqa: PLR1714, PLR0917
"""Quasi-hyperbolic momentum (QHM, Ma & Yarats 2019, as facebookresearch/qhoptim), averaging a
plain SGD step and a momentum step, and a ``torch.optim.Optimizer`` for it::

    g   = grad (+ weight_decay * p when weight_decay_type == "grad")
    p   = p * (1 - lr * weight_decay)             when weight_decay_type == "direct"
    buf = momentum * buf + (1 - momentum) * g     (dampened buffer, kept across steps)
    p   = p - lr * (nu * buf + (1 - nu) * g)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["QHM", "qhm"]


def qhm(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    lr: float,
    momentum: float,
    nu: float,
    weight_decay: float,
    weight_decay_type: str,
    maximize: bool = False,
    foreach: bool = False,
) -> None:
    """Apply one QHM step to ``params`` in place (TorchScript-compatible).

    Args:
        params: Parameters to update in place.
        grads: Their gradients (never modified).
        momentum_buffers: Their momentum buffers (start at zero), updated in place.
        lr: As in :class:`QHM`.
        momentum: As in :class:`QHM`.
        nu: As in :class:`QHM`.
        weight_decay: As in :class:`QHM`.
        weight_decay_type: As in :class:`QHM`.
        maximize: As in :class:`QHM`.
        foreach: Use torch's multi-tensor kernels.

    Raises:
        ValueError: If ``weight_decay_type`` is neither ``"grad"`` nor ``"direct"``.
    """
    if weight_decay_type != "grad" and weight_decay_type != "direct":
        raise ValueError(
            "weight_decay_type must be 'grad' or 'direct', got '" + weight_decay_type + "'"
        )
    if len(params) == 0:
        return
    # With foreach, one multi-tensor call per operation; else the same calls tensor by tensor.
    chunks = [(params, grads, momentum_buffers)]
    if not foreach:
        chunks = [([params[i]], [grads[i]], [momentum_buffers[i]]) for i in range(len(params))]
    for ps, raw, bufs in chunks:
        gs = torch._foreach_neg(raw) if maximize else raw
        if weight_decay != 0.0:
            if weight_decay_type == "grad":
                gs = torch._foreach_add(gs, ps, alpha=weight_decay)
            else:
                torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, gs, alpha=1.0 - momentum)
        torch._foreach_add_(ps, bufs, alpha=-lr * nu)
        torch._foreach_add_(ps, gs, alpha=-lr * (1.0 - nu))


class QHM(torch.optim.Optimizer):
    """Quasi-hyperbolic momentum as a ``torch.optim.Optimizer`` (its functional twin:
    :class:`metadist.optim.FunctionalQHM`).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (``>= 0``).
        momentum: Momentum factor ``beta`` in ``[0, 1)``.
        nu: Immediate discount factor ``nu`` (``0.7`` is the paper's default).
        weight_decay: Weight-decay factor (``>= 0``).
        weight_decay_type: ``"grad"`` (L2 added to the gradient) or ``"direct"`` (decoupled).
        maximize: Ascend instead of descend.
        foreach: Use multi-tensor kernels (default: off).

    Raises:
        ValueError: On a negative ``lr`` or ``weight_decay``, ``momentum`` outside ``[0, 1)`` or
            an unknown ``weight_decay_type``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float,
        nu: float,
        weight_decay: float = 0.0,
        weight_decay_type: str = "grad",
        *,
        maximize: bool = False,
        foreach: bool = False,
    ) -> None:
        wdt = weight_decay_type
        for name, value, ok, expected in (
            ("lr", lr, lr >= 0.0, ">= 0"),
            ("momentum", momentum, 0.0 <= momentum < 1.0, "in [0, 1)"),
            ("nu", nu, isinstance(nu, int | float), "a float"),
            ("weight_decay", weight_decay, weight_decay >= 0.0, ">= 0"),
            ("weight_decay_type", wdt, wdt in ("grad", "direct"), "'grad' or 'direct'"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {value!r}")
        hyper = {"lr": lr, "momentum": momentum, "nu": nu, "weight_decay": weight_decay}
        flags = {"weight_decay_type": wdt, "maximize": maximize, "foreach": foreach}
        super().__init__(params, {**hyper, **flags})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step every parameter that has a ``.grad``.

        Args:
            closure: Optional closure that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: If a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError("QHM does not support sparse gradients")
            for p in params:
                if "momentum_buffer" not in self.state[p]:  # created once: the buffer persists
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            lr, momentum, nu, decay = (
                float(group[k]) for k in ("lr", "momentum", "nu", "weight_decay")
            )
            flags = str(group["weight_decay_type"]), bool(group["maximize"]), bool(group["foreach"])
            qhm(params, grads, bufs, lr, momentum, nu, decay, *flags)
        return loss
