# _step and _collect are compiled by TorchScript: no zip(strict=), no `not in {...}`; the
# constructor signatures mirror torch.optim positionally.
# ruff: noqa: B905, PLR0917, PLR1714
"""Functional optimizers: one class per algorithm, one shape for all of them.

Each class checks its hyperparameters in ``__init__(params, <torch.optim's hyperparameters>)`` and
keeps the float ones in ``self.defaults`` (a ``dict[str, float]``; tuples are split: ``betas`` ->
``beta1``/``beta2``, ``etas`` -> ``etaminus``/``etaplus``, ``step_sizes`` ->
``step_size_min``/``step_size_max``), the flags in ``self.flags`` (also readable as attributes,
``opt.foreach``), and the state in ``self.state: dict[Tensor, dict[str, Tensor]]``, laid out like
the matching ``torch.optim`` class. All of them share one ``step(gradients)``: one gradient per
parameter, ``None`` to leave that parameter and its state alone, handed to torch's own functional
kernel (``torch.optim.adam.adam`` and friends), so results match ``torch.optim``. Nothing reads or
writes ``.grad``: several threads can step the same parameters with different gradients.

Eagerly they can use torch's ``foreach`` (multi-tensor) or ``fused`` kernels; compiled with
:func:`metadist.optim.script_functional_optimizer` they run the per-tensor loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Imported by name: TorchScript resolves free functions, not ``torch.optim.x.x`` attribute chains.
from torch.optim.adadelta import adadelta as _adadelta
from torch.optim.adagrad import adagrad as _adagrad
from torch.optim.adam import adam as _adam
from torch.optim.adamax import adamax as _adamax
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
    "FunctionalOptimizer",
    "FunctionalQHM",
    "FunctionalRMSprop",
    "FunctionalRprop",
    "FunctionalSGD",
    "Scriptable",
]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_count(num_params: int, num_gradients: int) -> None:
    _check(
        num_params == num_gradients,
        f"gradients has {num_gradients} entries, expected one per parameter ({num_params})",
    )


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
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]]]:
    """Parameters that have a gradient, their gradients, and one list per state name.

    A parameter's state is created at its first step, as torch.optim creates it: ``"step"`` a
    scalar tensor (float32 on the parameter's device for fused kernels, a CPU tensor otherwise),
    every other name a tensor like the parameter filled with ``fills[i]``.
    """
    _check_count(len(params), len(gradients))
    kept: list[Tensor] = []
    grads: list[Tensor] = []
    lists: list[list[Tensor]] = []
    for _ in names:
        lists.append(torch.jit.annotate(list[Tensor], []))
    for p, g in zip(params, gradients):
        if g is not None:
            kept.append(p)
            grads.append(g)
            if len(names) > 0:  # (SGD keeps its optional buffers itself)
                if p not in state:
                    state[p] = _new_state(p, names, fills, fused)
                entry = state[p]
                for i in range(len(names)):
                    lists[i].append(entry[names[i]])
    return kept, grads, lists


def _state_names(kind: str, d: dict[str, float], f: dict[str, bool]) -> list[str]:
    if kind == "adam" or kind == "adamw":
        names = ["step", "exp_avg", "exp_avg_sq"]
        if f["amsgrad"]:
            names.append("max_exp_avg_sq")
        return names
    if kind == "rmsprop":
        names = ["step", "square_avg"]
        if d["momentum"] > 0.0:
            names.append("momentum_buffer")
        if f["centered"]:
            names.append("grad_avg")
        return names
    if kind == "adagrad":
        return ["step", "sum"]
    if kind == "adamax":
        return ["step", "exp_avg", "exp_inf"]
    if kind == "adadelta":
        return ["step", "square_avg", "acc_delta"]
    if kind == "rprop":
        return ["step", "prev", "step_size"]
    if kind == "qhm":
        return ["momentum_buffer"]
    return torch.jit.annotate(list[str], [])  # sgd: torch's kernel creates its buffers


def _step(
    kind: str,
    params: list[Tensor],
    gradients: list[Tensor | None],
    state: dict[Tensor, dict[str, Tensor]],
    d: dict[str, float],
    f: dict[str, bool],
) -> None:
    """The step of every optimizer here: collect the lists, then run torch's kernel for ``kind``."""
    names = _state_names(kind, d, f)
    # Rprop's step size starts at lr, all other state at zero (Adagrad's is made up front).
    fills = [0.0, 0.0, d["lr"] if kind == "rprop" else 0.0, 0.0]
    fused = f.get("fused", False)
    kept, g, s = _collect(params, gradients, state, names, fills, fused)
    cplx = False
    if kind != "sgd" and kind != "qhm":  # the kernels that take has_complex
        for p in kept:
            cplx = cplx or torch.is_complex(p)
    foreach, maximize = f["foreach"], f["maximize"]
    with torch.no_grad():
        if kind == "sgd":
            bufs: list[Tensor | None] = []
            for p in kept:  # plain SGD keeps no buffers: skip the lookups
                has = d["momentum"] != 0.0 and p in state
                bufs.append(state[p]["momentum_buffer"] if has else None)
            _sgd(
                kept,
                g,
                bufs,
                foreach=foreach,
                fused=fused,
                weight_decay=d["weight_decay"],
                momentum=d["momentum"],
                lr=d["lr"],
                dampening=d["dampening"],
                nesterov=f["nesterov"],
                maximize=maximize,
            )
            if d["momentum"] != 0.0:  # keep the buffers torch's sgd created
                for p, buf in zip(kept, bufs):
                    if buf is not None:
                        state[p] = {"momentum_buffer": buf}
        elif kind == "adam" or kind == "adamw":
            _adam(
                kept,
                g,
                s[1],
                s[2],
                s[3] if f["amsgrad"] else [],
                s[0],
                foreach=foreach,
                fused=fused,
                has_complex=cplx,
                decoupled_weight_decay=kind == "adamw" or f.get("decoupled_weight_decay", False),
                amsgrad=f["amsgrad"],
                beta1=d["beta1"],
                beta2=d["beta2"],
                lr=d["lr"],
                weight_decay=d["weight_decay"],
                eps=d["eps"],
                maximize=maximize,
            )
        elif kind == "adagrad":
            sparse = False
            for grad in g:
                sparse = sparse or grad.is_sparse
            _adagrad(
                kept,
                g,
                s[1],
                s[0],
                fused=fused,
                has_sparse_grad=sparse,
                foreach=foreach,
                has_complex=cplx,
                lr=d["lr"],
                weight_decay=d["weight_decay"],
                lr_decay=d["lr_decay"],
                eps=d["eps"],
                maximize=maximize,
            )
        elif kind == "rmsprop":
            _rmsprop(
                kept,
                g,
                s[1],
                s[-1] if f["centered"] else [],
                s[2] if d["momentum"] > 0.0 else [],
                s[0],
                foreach=foreach,
                maximize=maximize,
                has_complex=cplx,
                lr=d["lr"],
                alpha=d["alpha"],
                eps=d["eps"],
                weight_decay=d["weight_decay"],
                momentum=d["momentum"],
                centered=f["centered"],
            )
        elif kind == "adamax":
            _adamax(
                kept,
                g,
                s[1],
                s[2],
                s[0],
                foreach=foreach,
                maximize=maximize,
                has_complex=cplx,
                eps=d["eps"],
                beta1=d["beta1"],
                beta2=d["beta2"],
                lr=d["lr"],
                weight_decay=d["weight_decay"],
            )
        elif kind == "adadelta":
            _adadelta(
                kept,
                g,
                s[1],
                s[2],
                s[0],
                foreach=foreach,
                has_complex=cplx,
                lr=d["lr"],
                rho=d["rho"],
                eps=d["eps"],
                weight_decay=d["weight_decay"],
                maximize=maximize,
            )
        elif kind == "rprop":
            _rprop(
                kept,
                g,
                s[1],
                s[2],
                s[0],
                foreach=foreach,
                maximize=maximize,
                has_complex=cplx,
                step_size_min=d["step_size_min"],
                step_size_max=d["step_size_max"],
                etaminus=d["etaminus"],
                etaplus=d["etaplus"],
            )
        else:
            qhm(
                kept,
                g,
                s[0],
                lr=d["lr"],
                momentum=d["momentum"],
                nu=d["nu"],
                weight_decay=d["weight_decay"],
                weight_decay_type="direct" if f["direct_weight_decay"] else "grad",
                maximize=maximize,
                foreach=foreach,
            )


class Scriptable:
    """A metadist functional optimizer in the one class TorchScript compiles (it has no
    inheritance): what :func:`metadist.optim.script_functional_optimizer` scripts.

    Args:
        kind: The algorithm (``"sgd"``, ``"adam"``, ...).
        params: Parameters to update in place.
        state: Per-parameter state.
        defaults: Float hyperparameters.
        flags: Boolean options.
    """

    def __init__(
        self,
        kind: str,
        params: list[Tensor],
        state: dict[Tensor, dict[str, Tensor]],
        defaults: dict[str, float],
        flags: dict[str, bool],
    ) -> None:
        self.kind = kind
        self.params = params
        self.state = state
        self.defaults = defaults
        self.flags = flags

    def step(self, gradients: list[Tensor | None]) -> None:
        """See :meth:`FunctionalOptimizer.step`."""
        _step(self.kind, self.params, gradients, self.state, self.defaults, self.flags)


# Below this mean element count per parameter, one fused Adam call over flat buffers beats
# torch's fused kernel called once per tensor (about 3 us each on CPU), copies included.
FLAT_MAX_MEAN_NUMEL = 4096


class _Flat:
    """The state of many small parameters in one buffer per name (the parameters' state entries
    become views of it), with buffers the parameters and gradients are copied into: a step is
    one kernel call. The parameters' "step" counters share one tensor while this is in use."""

    def __init__(self, params: list[Tensor], state: dict[Tensor, dict[str, Tensor]]) -> None:
        self.sizes = [p.numel() for p in params]
        first = params[0]
        self.param = torch.empty(sum(self.sizes), dtype=first.dtype, device=first.device)
        self.grad = torch.empty_like(self.param)
        self.param_views = [v.view_as(p) for v, p in zip(self.param.split(self.sizes), params)]
        self.grad_views = [v.view_as(p) for v, p in zip(self.grad.split(self.sizes), params)]
        self.state: dict[Tensor, dict[str, Tensor]] = {}
        entry: dict[str, Tensor] = {}
        for name in state[first]:
            if name == "step":
                entry[name] = state[first][name].clone()
                for p in params:
                    state[p][name] = entry[name]
                continue
            entry[name] = torch.cat([state[p][name].reshape(-1) for p in params])
            for p, view in zip(params, entry[name].split(self.sizes)):
                state[p][name] = view.view_as(p)
        self.state[self.param] = entry

    @staticmethod
    def adoptable(params: list[Tensor], state: dict[Tensor, dict[str, Tensor]]) -> bool:
        """Whether every parameter has state of the same names (Adam's) and the same step count."""
        names = set(state.get(params[0], ()))
        if not names or any(p not in state or set(state[p]) != names for p in params):
            return False
        steps = torch.stack([state[p]["step"] for p in params])
        return bool((steps == steps[0]).all())

    def release(self, state: dict[Tensor, dict[str, Tensor]]) -> None:
        """Give every parameter its own step counter back (per-tensor kernels advance each)."""
        for entry in state.values():
            if "step" in entry:
                entry["step"] = entry["step"].clone()


class FunctionalOptimizer:
    """What the functional optimizers share: their state, their flags and their one ``step``."""

    kind = ""

    def __init__(self, params: list[Tensor], defaults: dict[str, float], **flags: bool) -> None:
        self.params = params
        self.defaults = defaults
        self.flags = flags
        self.state = {}
        first = params[0] if params else None
        # Flat stepping pays off for fused Adam/AdamW over many small real tensors of one kind
        # (SGD's update is too cheap to win back the copies).
        self._flattens = (
            type(self).kind in ("adam", "adamw")
            and bool(flags.get("fused"))
            and first is not None
            and len(params) > 1
            and sum(p.numel() for p in params) <= FLAT_MAX_MEAN_NUMEL * len(params)
            and all(
                p.dtype == first.dtype
                and p.device == first.device
                and p.layout == torch.strided
                and not torch.is_complex(p)
                for p in params
            )
        )

    @property
    def state(self) -> dict[Tensor, dict[str, Tensor]]:
        """``{parameter: {name: tensor}}``, as the matching ``torch.optim`` class keeps it.

        Assign a new dict to replace it (as ``load_state_dict`` does).
        """
        return self._state

    @state.setter
    def state(self, value: dict[Tensor, dict[str, Tensor]]) -> None:
        self._state = value
        self._flat: _Flat | None = None

    def __getattr__(self, name: str) -> Any:
        flags = self.__dict__.get("flags", {})
        if name in flags:  # opt.foreach, opt.fused, opt.amsgrad, ...
            return flags[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``, in place.

        Args:
            gradients: One entry per parameter, in parameter order; ``None`` leaves that
                parameter and its state alone.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.

        Example:
            >>> import torch
            >>> opt = FunctionalAdam([torch.zeros(1)])
            >>> opt.step([None])
            >>> opt.state  # no gradient yet: no state either
            {}
        """
        _check_count(len(self.params), len(gradients))
        if self._flattens and all(g is not None for g in gradients):
            if self._flat is None and _Flat.adoptable(self.params, self.state):
                self._flat = _Flat(self.params, self.state)
            if self._flat is not None:
                flat = self._flat
                # Copied in every step: the parameters may have changed since the last one.
                with torch.no_grad():
                    torch._foreach_copy_(flat.param_views, self.params)
                    torch._foreach_copy_(flat.grad_views, gradients)  # type: ignore[arg-type]
                    _step(
                        self.kind, [flat.param], [flat.grad], flat.state, self.defaults, self.flags
                    )
                    torch._foreach_copy_(self.params, flat.param_views)
                return
        if self._flat is not None:
            self._flat.release(self.state)
            self._flat = None
        _step(self.kind, self.params, gradients, self.state, self.defaults, self.flags)

    def scriptable(self) -> Scriptable:
        """The same optimizer (same parameters, state and hyperparameters) as a
        :class:`Scriptable`, the class ``torch.jit.script`` compiles.

        Returns:
            A :class:`Scriptable` sharing this optimizer's containers.
        """
        return Scriptable(self.kind, self.params, self.state, self.defaults, self.flags)


def _check_adam(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    _check(lr >= 0.0, f"Invalid learning rate: {lr}")
    _check(eps >= 0.0, f"Invalid epsilon value: {eps}")
    _check(0.0 <= betas[0] < 1.0, f"Invalid beta parameter at index 0: {betas[0]}")
    _check(0.0 <= betas[1] < 1.0, f"Invalid beta parameter at index 1: {betas[1]}")
    _check(weight_decay >= 0.0, f"Invalid weight_decay value: {weight_decay}")


class FunctionalSGD(FunctionalOptimizer):
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

    kind = "sgd"

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
        hyper = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
        }
        flags = {"nesterov": nesterov, "maximize": maximize, "foreach": foreach, "fused": fused}
        super().__init__(params, hyper, **flags)


class FunctionalAdam(FunctionalOptimizer):
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

    kind = "adam"

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
        hyper = {
            "lr": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": eps,
            "weight_decay": weight_decay,
        }
        flags = {"amsgrad": amsgrad, "maximize": maximize, "foreach": foreach, "fused": fused}
        super().__init__(params, hyper, decoupled_weight_decay=decoupled_weight_decay, **flags)


class FunctionalAdamW(FunctionalOptimizer):
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

    kind = "adamw"

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
        hyper = {
            "lr": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": eps,
            "weight_decay": weight_decay,
        }
        flags = {"amsgrad": amsgrad, "maximize": maximize, "foreach": foreach, "fused": fused}
        super().__init__(params, hyper, **flags)


class FunctionalAdagrad(FunctionalOptimizer):
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

    kind = "adagrad"

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
        hyper = {
            "lr": lr,
            "lr_decay": lr_decay,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
        }
        super().__init__(params, hyper, maximize=maximize, foreach=foreach, fused=fused)
        # torch.optim.Adagrad creates its state at construction; so do we, for equal state_dicts.
        fills = [0.0, initial_accumulator_value]
        _collect(self.params, list(self.params), self.state, ["step", "sum"], fills, fused)


class FunctionalRMSprop(FunctionalOptimizer):
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

    kind = "rmsprop"

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
        hyper = {
            "lr": lr,
            "alpha": alpha,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
        }
        super().__init__(params, hyper, centered=centered, maximize=maximize, foreach=foreach)


class FunctionalAdamax(FunctionalOptimizer):
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

    kind = "adamax"

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
        hyper = {
            "lr": lr,
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, hyper, maximize=maximize, foreach=foreach)


class FunctionalAdadelta(FunctionalOptimizer):
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

    kind = "adadelta"

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
        hyper = {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, hyper, maximize=maximize, foreach=foreach)


class FunctionalRprop(FunctionalOptimizer):
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

    kind = "rprop"

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
        hyper = {
            "lr": lr,
            "etaminus": etas[0],
            "etaplus": etas[1],
            "step_size_min": step_sizes[0],
            "step_size_max": step_sizes[1],
        }
        super().__init__(params, hyper, maximize=maximize, foreach=foreach)


class FunctionalQHM(FunctionalOptimizer):
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

    kind = "qhm"

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
            weight_decay_type in ("grad", "direct"),
            f"Invalid weight_decay_type value: {weight_decay_type}",
        )
        hyper = {"lr": lr, "momentum": momentum, "nu": nu, "weight_decay": weight_decay}
        direct = weight_decay_type == "direct"
        super().__init__(
            params, hyper, direct_weight_decay=direct, maximize=maximize, foreach=foreach
        )
        self.weight_decay_type = weight_decay_type
