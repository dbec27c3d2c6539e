# TorchScript: no zip(strict=), no `not in {...}`; signatures mirror torch.optim positionally.
# ruff: noqa: B905, PLR1714, PLR0917
"""Functional optimizers: one TorchScript-compatible class per algorithm.

Each class takes its parameters once, ``__init__(params, lr, ...)``, and is stepped with an
explicit list of gradients, ``step(gradients)``, where ``None`` skips that parameter (it is not
touched and its state is not advanced). Nothing here reads or writes ``.grad``, so several
threads can hand different gradients to the same parameters without racing on ``.grad``.

The classes are plain Python at import time; :func:`metadist.optim.script_functional_optimizer`
compiles an instance with ``torch.jit.script`` on first use (torch caches the compiled class).
Uncompiled, they run eagerly and
can use torch's multi-tensor (``foreach=True``) or fused (``fused=True``) kernels; compiled, they
use the single-tensor path (TorchScript supports neither of the others).

Every update is delegated to torch's own functional kernels (``torch.optim.adam.adam`` and
friends), and state is laid out exactly like the matching ``torch.optim`` class, so results and
``state_dict`` entries agree with ``torch.optim``. Hyperparameters live in ``self.defaults`` (a
``dict[str, float]``, tuples split: ``betas`` -> ``beta1``/``beta2``, ``etas`` ->
``etaminus``/``etaplus``, ``step_sizes`` -> ``step_size_min``/``step_size_max``); assign a new dict
to change them between steps.
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


def _check_gradients(num_params: int, num_gradients: int) -> None:
    # A free function: TorchScript compiles it with each class that calls it.
    if num_params != num_gradients:
        raise ValueError(
            f"gradients has {num_gradients} entries, expected one per parameter ({num_params})"
        )


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


class FunctionalSGD:
    """SGD (momentum, dampening, Nesterov, weight decay, maximize); matches ``torch.optim.SGD``.

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

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

    Example:
        >>> import torch
        >>> p = torch.ones(2)
        >>> FunctionalSGD([p], lr=0.5).step([torch.ones(2)])
        >>> p
        tensor([0.5000, 0.5000])
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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay},
        )
        self.nesterov = nesterov
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalSGD([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        bufs: list[Tensor | None] = []
        momentum = self.defaults["momentum"]
        for p, g in zip(self.params, gradients):
            if g is not None:
                params.append(p)
                grads.append(g)
                if momentum != 0.0:
                    if p not in self.state:
                        self.state[p] = torch.jit.annotate(dict[str, Tensor], {})
                    state = self.state[p]
                    if "momentum_buffer" in state:
                        bufs.append(state["momentum_buffer"])
                    else:
                        bufs.append(None)
                else:
                    bufs.append(None)
        if len(params) == 0:
            return
        with torch.no_grad():
            _sgd(
                params,
                grads,
                bufs,
                foreach=self.foreach,
                fused=self.fused,
                weight_decay=self.defaults["weight_decay"],
                momentum=momentum,
                lr=self.defaults["lr"],
                dampening=self.defaults["dampening"],
                nesterov=self.nesterov,
                maximize=self.maximize,
            )
        if momentum != 0.0:
            for i in range(len(params)):
                buf = bufs[i]
                if buf is not None:
                    self.state[params[i]]["momentum_buffer"] = buf


class FunctionalAdam:
    """Adam (optionally AMSGrad, decoupled weight decay); matches ``torch.optim.Adam``.

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

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {
                "lr": lr,
                "beta1": betas[0],
                "beta2": betas[1],
                "eps": eps,
                "weight_decay": weight_decay,
            },
        )
        self.amsgrad = amsgrad
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused
        self.decoupled_weight_decay = decoupled_weight_decay
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalAdam([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        max_exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p, g in zip(self.params, gradients):
            if g is not None:
                has_complex = has_complex or torch.is_complex(p)
                params.append(p)
                grads.append(g)
                if p not in self.state:
                    state = torch.jit.annotate(dict[str, Tensor], {})
                    if self.fused:
                        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    else:
                        state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if self.amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format
                        )
                    self.state[p] = state
                state = self.state[p]
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if self.amsgrad:
                    max_exp_avg_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
        if len(params) == 0:
            return
        with torch.no_grad():
            _adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                foreach=self.foreach,
                fused=self.fused,
                has_complex=has_complex,
                decoupled_weight_decay=self.decoupled_weight_decay,
                amsgrad=self.amsgrad,
                beta1=self.defaults["beta1"],
                beta2=self.defaults["beta2"],
                lr=self.defaults["lr"],
                weight_decay=self.defaults["weight_decay"],
                eps=self.defaults["eps"],
                maximize=self.maximize,
            )


class FunctionalAdamW:
    """AdamW (decoupled weight decay, optionally AMSGrad); matches ``torch.optim.AdamW``.

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

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {
                "lr": lr,
                "beta1": betas[0],
                "beta2": betas[1],
                "eps": eps,
                "weight_decay": weight_decay,
            },
        )
        self.amsgrad = amsgrad
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalAdamW([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        max_exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p, g in zip(self.params, gradients):
            if g is not None:
                has_complex = has_complex or torch.is_complex(p)
                params.append(p)
                grads.append(g)
                if p not in self.state:
                    state = torch.jit.annotate(dict[str, Tensor], {})
                    if self.fused:
                        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    else:
                        state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if self.amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format
                        )
                    self.state[p] = state
                state = self.state[p]
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if self.amsgrad:
                    max_exp_avg_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
        if len(params) == 0:
            return
        with torch.no_grad():
            _adamw(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                foreach=self.foreach,
                fused=self.fused,
                has_complex=has_complex,
                amsgrad=self.amsgrad,
                beta1=self.defaults["beta1"],
                beta2=self.defaults["beta2"],
                lr=self.defaults["lr"],
                weight_decay=self.defaults["weight_decay"],
                eps=self.defaults["eps"],
                maximize=self.maximize,
            )


class FunctionalAdagrad:
    """Adagrad; matches ``torch.optim.Adagrad`` (state is created for every parameter up front).

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

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if lr_decay < 0.0:
            raise ValueError(f"Invalid lr_decay value: {lr_decay}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if initial_accumulator_value < 0.0:
            raise ValueError(
                f"Invalid initial_accumulator_value value: {initial_accumulator_value}"
            )
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {
                "lr": lr,
                "lr_decay": lr_decay,
                "eps": eps,
                "weight_decay": weight_decay,
                "initial_accumulator_value": initial_accumulator_value,
            },
        )
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})
        # torch.optim.Adagrad creates its state at construction; so do we, for equal state_dicts.
        for p in self.params:
            state = torch.jit.annotate(dict[str, Tensor], {})
            if fused:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            else:
                state["step"] = torch.tensor(0.0)
            state["sum"] = torch.full_like(
                p, initial_accumulator_value, memory_format=torch.preserve_format
            )
            self.state[p] = state

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalAdagrad([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        sums: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        has_sparse_grad = False
        for p, g in zip(self.params, gradients):
            if g is not None:
                has_complex = has_complex or torch.is_complex(p)
                has_sparse_grad = has_sparse_grad or g.is_sparse
                params.append(p)
                grads.append(g)
                state = self.state[p]
                sums.append(state["sum"])
                steps.append(state["step"])
        if len(params) == 0:
            return
        with torch.no_grad():
            _adagrad(
                params,
                grads,
                sums,
                steps,
                fused=self.fused,
                has_sparse_grad=has_sparse_grad,
                foreach=self.foreach,
                has_complex=has_complex,
                lr=self.defaults["lr"],
                weight_decay=self.defaults["weight_decay"],
                lr_decay=self.defaults["lr_decay"],
                eps=self.defaults["eps"],
                maximize=self.maximize,
            )


class FunctionalRMSprop:
    """RMSprop (optionally centered, with momentum); matches ``torch.optim.RMSprop``.

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

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if alpha < 0.0:
            raise ValueError(f"Invalid alpha value: {alpha}")
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {
                "lr": lr,
                "alpha": alpha,
                "eps": eps,
                "weight_decay": weight_decay,
                "momentum": momentum,
            },
        )
        self.centered = centered
        self.maximize = maximize
        self.foreach = foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalRMSprop([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        square_avgs: list[Tensor] = []
        grad_avgs: list[Tensor] = []
        momentum_bufs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        momentum = self.defaults["momentum"]
        for p, g in zip(self.params, gradients):
            if g is not None:
                has_complex = has_complex or torch.is_complex(p)
                params.append(p)
                grads.append(g)
                if p not in self.state:
                    state = torch.jit.annotate(dict[str, Tensor], {})
                    state["step"] = torch.tensor(0.0)
                    state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if momentum > 0.0:
                        state["momentum_buffer"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format
                        )
                    if self.centered:
                        state["grad_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self.state[p] = state
                state = self.state[p]
                square_avgs.append(state["square_avg"])
                steps.append(state["step"])
                if momentum > 0.0:
                    momentum_bufs.append(state["momentum_buffer"])
                if self.centered:
                    grad_avgs.append(state["grad_avg"])
        if len(params) == 0:
            return
        with torch.no_grad():
            _rmsprop(
                params,
                grads,
                square_avgs,
                grad_avgs,
                momentum_bufs,
                steps,
                foreach=self.foreach,
                maximize=self.maximize,
                has_complex=has_complex,
                lr=self.defaults["lr"],
                alpha=self.defaults["alpha"],
                eps=self.defaults["eps"],
                weight_decay=self.defaults["weight_decay"],
                momentum=momentum,
                centered=self.centered,
            )


class FunctionalAdamax:
    """Adamax (Adam with the infinity norm); matches ``torch.optim.Adamax``.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        betas: Coefficients of the running average and the infinity norm.
        eps: Term added to the denominator.
        weight_decay: L2 penalty.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {
                "lr": lr,
                "beta1": betas[0],
                "beta2": betas[1],
                "eps": eps,
                "weight_decay": weight_decay,
            },
        )
        self.maximize = maximize
        self.foreach = foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalAdamax([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_infs: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p, g in zip(self.params, gradients):
            if g is not None:
                has_complex = has_complex or torch.is_complex(p)
                params.append(p)
                grads.append(g)
                if p not in self.state:
                    state = torch.jit.annotate(dict[str, Tensor], {})
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_inf"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self.state[p] = state
                state = self.state[p]
                exp_avgs.append(state["exp_avg"])
                exp_infs.append(state["exp_inf"])
                steps.append(state["step"])
        if len(params) == 0:
            return
        with torch.no_grad():
            _adamax(
                params,
                grads,
                exp_avgs,
                exp_infs,
                steps,
                foreach=self.foreach,
                maximize=self.maximize,
                has_complex=has_complex,
                eps=self.defaults["eps"],
                beta1=self.defaults["beta1"],
                beta2=self.defaults["beta2"],
                lr=self.defaults["lr"],
                weight_decay=self.defaults["weight_decay"],
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

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self.defaults = torch.jit.annotate(
            dict[str, float], {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay}
        )
        self.maximize = maximize
        self.foreach = foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalAdadelta([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        square_avgs: list[Tensor] = []
        acc_deltas: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p, g in zip(self.params, gradients):
            if g is not None:
                has_complex = has_complex or torch.is_complex(p)
                params.append(p)
                grads.append(g)
                if p not in self.state:
                    state = torch.jit.annotate(dict[str, Tensor], {})
                    state["step"] = torch.tensor(0.0)
                    state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["acc_delta"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    self.state[p] = state
                state = self.state[p]
                square_avgs.append(state["square_avg"])
                acc_deltas.append(state["acc_delta"])
                steps.append(state["step"])
        if len(params) == 0:
            return
        with torch.no_grad():
            _adadelta(
                params,
                grads,
                square_avgs,
                acc_deltas,
                steps,
                foreach=self.foreach,
                has_complex=has_complex,
                lr=self.defaults["lr"],
                rho=self.defaults["rho"],
                eps=self.defaults["eps"],
                weight_decay=self.defaults["weight_decay"],
                maximize=self.maximize,
            )


class FunctionalRprop:
    """Rprop (resilient backpropagation); matches ``torch.optim.Rprop``.

    Args:
        params: Parameters to update in place.
        lr: Initial step size (read when a parameter's state is created).
        etas: Multiplicative decrease and increase factors.
        step_sizes: Minimal and maximal step sizes.
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 < etas[0] < 1.0 < etas[1]:
            raise ValueError(f"Invalid eta values: {etas[0]}, {etas[1]}")
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {
                "lr": lr,
                "etaminus": etas[0],
                "etaplus": etas[1],
                "step_size_min": step_sizes[0],
                "step_size_max": step_sizes[1],
            },
        )
        self.maximize = maximize
        self.foreach = foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalRprop([p, q]).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        prevs: list[Tensor] = []
        step_sizes: list[Tensor] = []
        steps: list[Tensor] = []
        has_complex = False
        for p, g in zip(self.params, gradients):
            if g is not None:
                has_complex = has_complex or torch.is_complex(p)
                params.append(p)
                grads.append(g)
                if p not in self.state:
                    state = torch.jit.annotate(dict[str, Tensor], {})
                    state["step"] = torch.tensor(0.0)
                    state["prev"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["step_size"] = torch.full_like(g, self.defaults["lr"])
                    self.state[p] = state
                state = self.state[p]
                prevs.append(state["prev"])
                step_sizes.append(state["step_size"])
                steps.append(state["step"])
        if len(params) == 0:
            return
        with torch.no_grad():
            _rprop(
                params,
                grads,
                prevs,
                step_sizes,
                steps,
                foreach=self.foreach,
                maximize=self.maximize,
                has_complex=has_complex,
                step_size_min=self.defaults["step_size_min"],
                step_size_max=self.defaults["step_size_max"],
                etaminus=self.defaults["etaminus"],
                etaplus=self.defaults["etaplus"],
            )


class FunctionalQHM:
    """Quasi-hyperbolic momentum, the functional twin of :class:`metadist.optim.QHM`.

    The dampened momentum buffer is created once, at a parameter's first step, and persists:
    ``buf = momentum * buf + (1 - momentum) * g`` and ``p -= lr * (nu * buf + (1 - nu) * g)``.

    Args:
        params: Parameters to update in place.
        lr: Learning rate.
        momentum: Momentum factor in ``[0, 1)``.
        nu: Immediate discount factor.
        weight_decay: Weight-decay factor.
        weight_decay_type: ``"grad"`` or ``"direct"`` (see :func:`metadist.optim.qhm.qhm`).
        maximize: Ascend instead of descend.
        foreach: Multi-tensor kernels (eager only).

    Raises:
        ValueError: On invalid hyperparameters or a gradient list of the wrong length.

    Example:
        >>> import torch
        >>> p = torch.zeros(1)
        >>> FunctionalQHM([p], lr=1.0, momentum=0.5, nu=1.0).step([torch.ones(1)])
        >>> p
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
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if weight_decay_type != "grad" and weight_decay_type != "direct":
            raise ValueError("Invalid weight_decay_type value: " + weight_decay_type)
        self.defaults = torch.jit.annotate(
            dict[str, float],
            {"lr": lr, "momentum": momentum, "nu": nu, "weight_decay": weight_decay},
        )
        self.weight_decay_type = weight_decay_type
        self.maximize = maximize
        self.foreach = foreach
        self.params = params
        self.state = torch.jit.annotate(dict[Tensor, dict[str, Tensor]], {})

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``.

        Args:
            gradients: One entry per parameter, ``None`` to skip it.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> p, q = torch.ones(2), torch.ones(2)
            >>> FunctionalQHM([p, q], lr=0.1, momentum=0.9, nu=0.7).step([torch.ones(2), None])
            >>> q  # no gradient: left as it was
            tensor([1., 1.])
        """
        _check_gradients(len(self.params), len(gradients))
        params: list[Tensor] = []
        grads: list[Tensor] = []
        bufs: list[Tensor] = []
        for p, g in zip(self.params, gradients):
            if g is not None:
                params.append(p)
                grads.append(g)
                # Create the buffer once; it must survive across steps (the recipe's bug).
                if p not in self.state:
                    state = torch.jit.annotate(dict[str, Tensor], {})
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                    self.state[p] = state
                bufs.append(self.state[p]["momentum_buffer"])
        if len(params) == 0:
            return
        with torch.no_grad():
            qhm(
                params,
                grads,
                bufs,
                lr=self.defaults["lr"],
                momentum=self.defaults["momentum"],
                nu=self.defaults["nu"],
                weight_decay=self.defaults["weight_decay"],
                weight_decay_type=self.weight_decay_type,
                maximize=self.maximize,
                foreach=self.foreach,
            )
