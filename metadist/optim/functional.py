# TorchScript compiles these classes: no zip(strict=), no inheritance, no `not in {...}`;
# constructor signatures mirror torch.optim positionally.
# ruff: noqa: B905, PLR0917
"""Functional optimizers: one TorchScript-compatible class per algorithm, all of one shape.

``__init__(params, <torch.optim's hyperparameters>)`` checks the hyperparameters and keeps the
float ones in ``self.defaults`` (a ``dict[str, float]``; tuples are split: ``betas`` ->
``beta1``/``beta2``, ``etas`` -> ``etaminus``/``etaplus``, ``step_sizes`` ->
``step_size_min``/``step_size_max``), the flags as attributes, and the state in
``self.state: dict[Tensor, dict[str, Tensor]]``, laid out exactly like the matching
``torch.optim`` class. ``step(gradients)`` takes one gradient per parameter, ``None`` to leave
that parameter and its state alone, and hands the lists to torch's own functional kernel
(``torch.optim.adam.adam`` and friends), so results match ``torch.optim``. Nothing reads or
writes ``.grad``: several threads can step the same parameters with different gradients.

Eagerly they can use torch's ``foreach`` (multi-tensor) or ``fused`` kernels; compiled with
:func:`metadist.optim.script_functional_optimizer` they run the per-tensor loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Imported by name: TorchScript resolves free functions, not ``torch.optim.x.x`` attribute chains.
from torch.optim.adadelta import adadelta as _adadelta
from torch.optim.adagrad import adagrad as _adagrad
from torch.optim.adam import adam as _adam
from torch.optim.adamax import adamax as _adamax
from torch.optim.adamw import adamw as _adamw
from torch.optim.rmsprop import rmsprop as _rmsprop
from torch.optim.rprop import rprop as _rprop
from torch.optim.sgd import sgd as _sgd

from metadist.optim.qhm import qhm

__all__ = [
    "FunctionalAdadelta",
    "FunctionalAdagrad",
    "FunctionalAdam",
    "FunctionalAdamW",
    "FunctionalAdamax",
    "FunctionalQHM",
    "FunctionalRMSprop",
    "FunctionalRprop",
    "FunctionalSGD",
]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _new_state(p: Tensor, names: list[str], fills: list[float], fused: bool) -> dict[str, Tensor]:
    state = torch.jit.annotate(dict[str, Tensor], {})
    for i, name in enumerate(names):
        if name == "step":
            state[name] = (
                torch.zeros((), dtype=torch.float32, device=p.device)
                if fused
                else torch.tensor(0.0)
            )
        else:
            state[name] = torch.full_like(p, fills[i], memory_format=torch.preserve_format)
    return state


def _collect(
    params: list[Tensor],
    gradients: list[Tensor | None],
    state: dict[Tensor, dict[str, Tensor]],
    names: list[str],
    fills: list[float],
    fused: bool,
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], bool]:
    """Parameters that have a gradient, their gradients, one list per state name, any complex.

    A parameter's state is created at its first step, as torch.optim creates it: ``"step"`` a
    scalar tensor (float32 on the parameter's device for fused kernels, a CPU tensor otherwise),
    every other name a tensor like the parameter filled with ``fills[i]``.
    """
    _check(
        len(params) == len(gradients),
        f"gradients has {len(gradients)} entries, expected one per parameter ({len(params)})",
    )
    kept: list[Tensor] = []
    grads: list[Tensor] = []
    lists: list[list[Tensor]] = []
    for _ in names:
        lists.append(torch.jit.annotate(list[Tensor], []))
    has_complex = False
    for p, g in zip(params, gradients):
        if g is not None:
            if len(names) > 0 and p not in state:  # SGD keeps its optional buffers itself
                state[p] = _new_state(p, names, fills, fused)
            for i, name in enumerate(names):
                lists[i].append(state[p][name])
            kept.append(p)
            grads.append(g)
            has_complex = has_complex or torch.is_complex(p)
    return kept, grads, lists, has_complex


def _check_adam(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    _check(lr >= 0.0, f"Invalid learning rate: {lr}")
    _check(eps >= 0.0, f"Invalid epsilon value: {eps}")
    _check(0.0 <= betas[0] < 1.0, f"Invalid beta parameter at index 0: {betas[0]}")
    _check(0.0 <= betas[1] < 1.0, f"Invalid beta parameter at index 1: {betas[1]}")
    _check(weight_decay >= 0.0, f"Invalid weight_decay value: {weight_decay}")


class FunctionalSGD:
    """SGD; matches ``torch.optim.SGD``.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        momentum: Momentum factor.
        dampening: Dampening for momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).
        fused: Fused kernels (eager only).

    Example:
        >>> import torch
        >>> p, q = torch.ones(2), torch.ones(2)
        >>> FunctionalSGD([p, q], lr=0.5).step([torch.ones(2), None])
        >>> p, q  # q had no gradient: left alone
        (tensor([0.5000, 0.5000]), tensor([1., 1.]))
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
    ) -> None:
        _check(lr >= 0.0, f"Invalid learning rate: {lr}")
        _check(momentum >= 0.0, f"Invalid momentum value: {momentum}")
        _check(weight_decay >= 0.0, f"Invalid weight_decay value: {weight_decay}")
        _check(
            not nesterov or (momentum > 0.0 and dampening == 0.0),
            "Nesterov momentum requires a momentum and zero dampening",
        )
        self.defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
        }
        self.nesterov, self.maximize, self.foreach, self.fused = nesterov, maximize, foreach, fused
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        params, grads, _, _ = _collect(self.params, gradients, self.state, [], [], False)
        d = self.defaults
        # torch's sgd creates missing momentum buffers in this list; they are kept below.
        bufs: list[Tensor | None] = []
        for p in params:
            bufs.append(self.state[p]["momentum_buffer"] if p in self.state else None)
        with torch.no_grad():
            _sgd(
                params,
                grads,
                bufs,
                foreach=self.foreach,
                fused=self.fused,
                weight_decay=d["weight_decay"],
                momentum=d["momentum"],
                lr=d["lr"],
                dampening=d["dampening"],
                nesterov=self.nesterov,
                maximize=self.maximize,
            )
        if d["momentum"] != 0.0:
            for p, buf in zip(params, bufs):
                if buf is not None:
                    self.state[p] = {"momentum_buffer": buf}


class FunctionalAdam:
    """Adam; matches ``torch.optim.Adam``.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Term added to the denominator.
        weight_decay: L2 penalty (decoupled if ``decoupled_weight_decay``).
        amsgrad: Use the AMSGrad variant.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).
        fused: Fused kernels (eager only).
        decoupled_weight_decay: AdamW-style weight decay.

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalAdam([p], lr=0.1).step([torch.ones(1)])
        >>> p
        tensor([-0.1000])
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
        decoupled_weight_decay: bool = False,
    ) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        self.defaults = {
            "lr": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": eps,
            "weight_decay": weight_decay,
        }
        self.amsgrad, self.maximize, self.foreach, self.fused = amsgrad, maximize, foreach, fused
        self.decoupled_weight_decay = decoupled_weight_decay
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        names = ["step", "exp_avg", "exp_avg_sq"]
        if self.amsgrad:
            names.append("max_exp_avg_sq")
        params, grads, s, has_complex = _collect(
            self.params, gradients, self.state, names, [0.0, 0.0, 0.0, 0.0], self.fused
        )
        d = self.defaults
        with torch.no_grad():
            _adam(
                params,
                grads,
                s[1],
                s[2],
                s[3] if self.amsgrad else [],
                s[0],
                foreach=self.foreach,
                fused=self.fused,
                has_complex=has_complex,
                decoupled_weight_decay=self.decoupled_weight_decay,
                amsgrad=self.amsgrad,
                beta1=d["beta1"],
                beta2=d["beta2"],
                lr=d["lr"],
                weight_decay=d["weight_decay"],
                eps=d["eps"],
                maximize=self.maximize,
            )


class FunctionalAdamW:
    """AdamW; matches ``torch.optim.AdamW``.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Term added to the denominator.
        weight_decay: Decoupled weight-decay coefficient.
        amsgrad: Use the AMSGrad variant.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).
        fused: Fused kernels (eager only).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalAdamW([p], lr=0.1).step([torch.ones(1)])
        >>> p
        tensor([-0.1000])
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
    ) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        self.defaults = {
            "lr": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": eps,
            "weight_decay": weight_decay,
        }
        self.amsgrad, self.maximize, self.foreach, self.fused = amsgrad, maximize, foreach, fused
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        names = ["step", "exp_avg", "exp_avg_sq"]
        if self.amsgrad:
            names.append("max_exp_avg_sq")
        params, grads, s, has_complex = _collect(
            self.params, gradients, self.state, names, [0.0, 0.0, 0.0, 0.0], self.fused
        )
        d = self.defaults
        with torch.no_grad():
            _adamw(
                params,
                grads,
                s[1],
                s[2],
                s[3] if self.amsgrad else [],
                s[0],
                foreach=self.foreach,
                fused=self.fused,
                has_complex=has_complex,
                amsgrad=self.amsgrad,
                beta1=d["beta1"],
                beta2=d["beta2"],
                lr=d["lr"],
                weight_decay=d["weight_decay"],
                eps=d["eps"],
                maximize=self.maximize,
            )


class FunctionalAdagrad:
    """Adagrad; matches ``torch.optim.Adagrad`` (whose state exists from construction on).

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        lr_decay: Learning-rate decay.
        weight_decay: L2 penalty.
        initial_accumulator_value: Starting value of the sum of squares.
        eps: Term added to the denominator.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).
        fused: Fused kernels (eager only).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalAdagrad([p], lr=0.1).step([torch.ones(1)])
        >>> p
        tensor([-0.1000])
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
    ) -> None:
        _check(lr >= 0.0, f"Invalid learning rate: {lr}")
        _check(lr_decay >= 0.0, f"Invalid lr_decay value: {lr_decay}")
        _check(weight_decay >= 0.0, f"Invalid weight_decay value: {weight_decay}")
        _check(
            initial_accumulator_value >= 0.0,
            f"Invalid initial_accumulator_value value: {initial_accumulator_value}",
        )
        _check(eps >= 0.0, f"Invalid epsilon value: {eps}")
        self.defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
        }
        self.maximize, self.foreach, self.fused = maximize, foreach, fused
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})
        everything: list[Tensor | None] = []
        for p in params:
            everything.append(p)
        _collect(
            params, everything, self.state, ["step", "sum"], [0.0, initial_accumulator_value], fused
        )

    def step(self, gradients: list[Tensor | None]) -> None:
        # Every parameter's state exists already: the fills are never used.
        params, grads, s, has_complex = _collect(
            self.params, gradients, self.state, ["step", "sum"], [0.0, 0.0], self.fused
        )
        has_sparse_grad = False
        for g in grads:
            has_sparse_grad = has_sparse_grad or g.is_sparse
        d = self.defaults
        with torch.no_grad():
            _adagrad(
                params,
                grads,
                s[1],
                s[0],
                fused=self.fused,
                has_sparse_grad=has_sparse_grad,
                foreach=self.foreach,
                has_complex=has_complex,
                lr=d["lr"],
                weight_decay=d["weight_decay"],
                lr_decay=d["lr_decay"],
                eps=d["eps"],
                maximize=self.maximize,
            )


class FunctionalRMSprop:
    """RMSprop; matches ``torch.optim.RMSprop``.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        alpha: Smoothing constant.
        eps: Term added to the denominator.
        weight_decay: L2 penalty.
        momentum: Momentum factor.
        centered: Normalize by an estimate of the gradient's variance.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalRMSprop([p], lr=0.01).step([torch.ones(1)])
        >>> p
        tensor([-0.1000])
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        maximize: bool = False,
        foreach: bool = False,
    ) -> None:
        _check(lr >= 0.0, f"Invalid learning rate: {lr}")
        _check(eps >= 0.0, f"Invalid epsilon value: {eps}")
        _check(momentum >= 0.0, f"Invalid momentum value: {momentum}")
        _check(weight_decay >= 0.0, f"Invalid weight_decay value: {weight_decay}")
        _check(alpha >= 0.0, f"Invalid alpha value: {alpha}")
        self.defaults = {
            "lr": lr,
            "alpha": alpha,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
        }
        self.centered, self.maximize, self.foreach = centered, maximize, foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        d = self.defaults
        names = ["step", "square_avg"]
        if d["momentum"] > 0.0:
            names.append("momentum_buffer")
        if self.centered:
            names.append("grad_avg")
        params, grads, s, has_complex = _collect(
            self.params, gradients, self.state, names, [0.0, 0.0, 0.0, 0.0], False
        )
        with torch.no_grad():
            _rmsprop(
                params,
                grads,
                s[1],
                s[-1] if self.centered else [],
                s[2] if d["momentum"] > 0.0 else [],
                s[0],
                foreach=self.foreach,
                maximize=self.maximize,
                has_complex=has_complex,
                lr=d["lr"],
                alpha=d["alpha"],
                eps=d["eps"],
                weight_decay=d["weight_decay"],
                momentum=d["momentum"],
                centered=self.centered,
            )


class FunctionalAdamax:
    """Adamax; matches ``torch.optim.Adamax``.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        betas: Coefficients of the running average and the infinity norm.
        eps: Term added to the denominator.
        weight_decay: L2 penalty.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalAdamax([p], lr=0.1).step([torch.ones(1)])
        >>> p
        tensor([-0.1000])
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        maximize: bool = False,
        foreach: bool = False,
    ) -> None:
        _check_adam(lr, betas, eps, weight_decay)
        self.defaults = {
            "lr": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": eps,
            "weight_decay": weight_decay,
        }
        self.maximize, self.foreach = maximize, foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        params, grads, s, has_complex = _collect(
            self.params,
            gradients,
            self.state,
            ["step", "exp_avg", "exp_inf"],
            [0.0, 0.0, 0.0],
            False,
        )
        d = self.defaults
        with torch.no_grad():
            _adamax(
                params,
                grads,
                s[1],
                s[2],
                s[0],
                foreach=self.foreach,
                maximize=self.maximize,
                has_complex=has_complex,
                eps=d["eps"],
                beta1=d["beta1"],
                beta2=d["beta2"],
                lr=d["lr"],
                weight_decay=d["weight_decay"],
            )


class FunctionalAdadelta:
    """Adadelta; matches ``torch.optim.Adadelta``.

    Args:
        params: Parameters to update in place.
        lr: Coefficient that scales the delta.
        rho: Coefficient of the running averages.
        eps: Term added to the denominator.
        weight_decay: L2 penalty.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalAdadelta([p], lr=1.0).step([torch.ones(1)])
        >>> bool(p < 0)
        True
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        maximize: bool = False,
        foreach: bool = False,
    ) -> None:
        _check(lr >= 0.0, f"Invalid learning rate: {lr}")
        _check(0.0 <= rho <= 1.0, f"Invalid rho value: {rho}")
        _check(eps >= 0.0, f"Invalid epsilon value: {eps}")
        _check(weight_decay >= 0.0, f"Invalid weight_decay value: {weight_decay}")
        self.defaults = {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay}
        self.maximize, self.foreach = maximize, foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        params, grads, s, has_complex = _collect(
            self.params,
            gradients,
            self.state,
            ["step", "square_avg", "acc_delta"],
            [0.0, 0.0, 0.0],
            False,
        )
        d = self.defaults
        with torch.no_grad():
            _adadelta(
                params,
                grads,
                s[1],
                s[2],
                s[0],
                foreach=self.foreach,
                has_complex=has_complex,
                lr=d["lr"],
                rho=d["rho"],
                eps=d["eps"],
                weight_decay=d["weight_decay"],
                maximize=self.maximize,
            )


class FunctionalRprop:
    """Rprop; matches ``torch.optim.Rprop``.

    Args:
        params: Parameters to update in place.
        lr: Initial step size (read when a parameter's state is created).
        etas: Multiplicative decrease and increase factors.
        step_sizes: Minimal and maximal step sizes.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalRprop([p], lr=0.1).step([torch.ones(1)])
        >>> p
        tensor([-0.1000])
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float = 1e-2,
        etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50.0),
        maximize: bool = False,
        foreach: bool = False,
    ) -> None:
        _check(lr >= 0.0, f"Invalid learning rate: {lr}")
        _check(0.0 < etas[0] < 1.0 < etas[1], f"Invalid eta values: {etas[0]}, {etas[1]}")
        self.defaults = {
            "lr": lr,
            "etaminus": etas[0],
            "etaplus": etas[1],
            "step_size_min": step_sizes[0],
            "step_size_max": step_sizes[1],
        }
        self.maximize, self.foreach = maximize, foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        d = self.defaults
        params, grads, s, has_complex = _collect(
            self.params,
            gradients,
            self.state,
            ["step", "prev", "step_size"],
            [0.0, 0.0, d["lr"]],
            False,
        )
        with torch.no_grad():
            _rprop(
                params,
                grads,
                s[1],
                s[2],
                s[0],
                foreach=self.foreach,
                maximize=self.maximize,
                has_complex=has_complex,
                step_size_min=d["step_size_min"],
                step_size_max=d["step_size_max"],
                etaminus=d["etaminus"],
                etaplus=d["etaplus"],
            )


class FunctionalQHM:
    """Quasi-hyperbolic momentum, the functional twin of :class:`metadist.optim.QHM`.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        momentum: Momentum factor in ``[0, 1)``.
        nu: Immediate discount factor.
        weight_decay: Weight-decay factor.
        weight_decay_type: ``"grad"`` or ``"direct"`` (see :func:`metadist.optim.qhm.qhm`).
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalQHM([p], lr=1.0, momentum=0.5, nu=1.0).step([torch.ones(1)])
        >>> p  # the dampened buffer: 0.5 * 0 + 0.5 * 1
        tensor([-0.5000])
    """

    def __init__(
        self,
        params: list[Tensor],
        lr: float,
        momentum: float,
        nu: float,
        weight_decay: float = 0.0,
        weight_decay_type: str = "grad",
        maximize: bool = False,
        foreach: bool = False,
    ) -> None:
        _check(lr >= 0.0, f"Invalid learning rate: {lr}")
        _check(0.0 <= momentum < 1.0, f"Invalid momentum value: {momentum}")
        _check(weight_decay >= 0.0, f"Invalid weight_decay value: {weight_decay}")
        _check(
            weight_decay_type == "grad" or weight_decay_type == "direct",  # noqa: PLR1714
            "Invalid weight_decay_type value: " + weight_decay_type,
        )
        self.defaults = {"lr": lr, "momentum": momentum, "nu": nu, "weight_decay": weight_decay}
        self.weight_decay_type, self.maximize, self.foreach = weight_decay_type, maximize, foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        # The buffer is created once, at a parameter's first step, and persists.
        params, grads, s, _ = _collect(
            self.params, gradients, self.state, ["momentum_buffer"], [0.0], False
        )
        d = self.defaults
        with torch.no_grad():
            qhm(
                params,
                grads,
                s[0],
                lr=d["lr"],
                momentum=d["momentum"],
                nu=d["nu"],
                weight_decay=d["weight_decay"],
                weight_decay_type=self.weight_decay_type,
                maximize=self.maximize,
                foreach=self.foreach,
            )


_STEP_DOC = """Update every parameter whose gradient is not ``None``, in place.

        Args:
            gradients: One entry per parameter, in parameter order; ``None`` leaves that
                parameter and its state alone.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            ``opt.step([g0, None])`` updates the first parameter and skips the second.
        """

for _cls in (
    FunctionalSGD,
    FunctionalAdam,
    FunctionalAdamW,
    FunctionalAdagrad,
    FunctionalRMSprop,
    FunctionalAdamax,
    FunctionalAdadelta,
    FunctionalRprop,
    FunctionalQHM,
):
    _cls.step.__doc__ = _STEP_DOC  # one shape, one description
