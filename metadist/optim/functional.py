# _step, _collect and Scriptable are compiled by TorchScript: no zip(strict=), no `not in {...}`.
# ruff: noqa: B905, PLR0917, PLR1714
"""Functional optimizers: one dataclass of hyperparameters per algorithm, one ``step`` for all.

Each class takes ``(params, <its torch.optim class's hyperparameters>)``, checked by that class's
own constructor. Float hyperparameters live in ``self.defaults`` (tuples split: ``betas`` ->
``beta1``/``beta2``, see :data:`TUPLE_KEYS`), boolean ones in ``self.flags``, and the state in
``self.state``, laid out as ``torch.optim`` lays it out. ``step(gradients)`` takes one gradient
per parameter (``None`` leaves that parameter and its state alone) and runs torch's own functional
kernel (``torch.optim.adam.adam`` and friends), so results match ``torch.optim``. Nothing touches
``.grad``: several threads can step the same parameters with different gradients.

Example:
    >>> import torch
    >>> p, q = torch.ones(2), torch.ones(2)
    >>> FunctionalSGD([p, q], lr=0.5).step([torch.ones(2), None])
    >>> p, q  # q had no gradient: left alone
    (tensor([0.5000, 0.5000]), tensor([1., 1.]))
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar

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

from metadist.optim.qhm import QHM, qhm

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
    "TUPLE_KEYS",
    "flat_hparams",
]

# Tuple-valued torch hyperparameters and the float names functional optimizers keep them under.
TUPLE_KEYS = {
    "betas": ("beta1", "beta2"),
    "etas": ("etaminus", "etaplus"),
    "step_sizes": ("step_size_min", "step_size_max"),
}


def flat_hparams(hparams: dict[str, Any]) -> dict[str, float]:
    """The float hyperparameters of ``hparams`` (torch param-group names) under ``defaults``
    names: tuples split by :data:`TUPLE_KEYS`; flags, strings and ``None`` left out."""
    out: dict[str, float] = {}
    for key, value in hparams.items():
        if key in TUPLE_KEYS:
            out[TUPLE_KEYS[key][0]], out[TUPLE_KEYS[key][1]] = float(value[0]), float(value[1])
        elif not isinstance(value, bool | str | type(None)):
            out[key] = float(value)
    return out


def _check_count(num_params: int, num_gradients: int) -> None:
    if num_params != num_gradients:
        raise ValueError(
            f"gradients has {num_gradients} entries, expected one per parameter ({num_params})"
        )


def _collect(
    params: list[Tensor],
    gradients: list[Tensor | None],
    state: dict[Tensor, dict[str, Tensor]],
    names: list[str],
    fills: list[float],
    fused: bool,
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]]]:
    """Parameters that have a gradient, their gradients, and one list per state name; state is
    created at a parameter's first step as torch.optim creates it (``"step"``: a scalar, float32 on
    the parameter's device for fused kernels, else on the CPU; others: ``fills[i]`` like ``p``).
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
                    entry = torch.jit.annotate(dict[str, Tensor], {})
                    for i, name in enumerate(names):
                        if name != "step":
                            entry[name] = torch.full_like(p, fills[i])
                        elif fused:
                            entry[name] = torch.zeros((), dtype=torch.float32, device=p.device)
                        else:
                            entry[name] = torch.tensor(0.0)
                    state[p] = entry
                for i in range(len(names)):
                    lists[i].append(state[p][names[i]])
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
    foreach, maximize, lr, wd = f["foreach"], f["maximize"], d["lr"], d.get("weight_decay", 0.0)
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
                weight_decay=wd,
                momentum=d["momentum"],
                lr=lr,
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
                lr=lr,
                weight_decay=wd,
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
                lr=lr,
                weight_decay=wd,
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
                lr=lr,
                alpha=d["alpha"],
                eps=d["eps"],
                weight_decay=wd,
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
                lr=lr,
                weight_decay=wd,
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
                lr=lr,
                rho=d["rho"],
                eps=d["eps"],
                weight_decay=wd,
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
            wd_type = "direct" if f["direct_weight_decay"] else "grad"
            qhm(kept, g, s[0], lr, d["momentum"], d["nu"], wd, wd_type, maximize, foreach)


class Scriptable:
    """A functional optimizer as the one class TorchScript compiles (it has no inheritance): the
    containers of a :class:`FunctionalOptimizer` and its ``kind`` (``"sgd"``, ``"adam"``, ...)."""

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
        sizes = [p.numel() for p in params]
        first = params[0]
        self.param = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        self.grad = torch.empty_like(self.param)
        self.param_views = [v.view_as(p) for v, p in zip(self.param.split(sizes), params)]
        self.grad_views = [v.view_as(p) for v, p in zip(self.grad.split(sizes), params)]
        entry: dict[str, Tensor] = {}
        for name in state[first]:
            if name == "step":
                entry[name] = state[first][name].clone()
                for p in params:
                    state[p][name] = entry[name]
                continue
            entry[name] = torch.cat([state[p][name].reshape(-1) for p in params])
            for p, view in zip(params, entry[name].split(sizes)):
                state[p][name] = view.view_as(p)
        self.state = {self.param: entry}

    @staticmethod
    def adoptable(params: list[Tensor], state: dict[Tensor, dict[str, Tensor]]) -> bool:
        """Whether every parameter has state of the same names (Adam's) and the same step count."""
        names = set(state.get(params[0], ()))
        if not names or any(p not in state or set(state[p]) != names for p in params):
            return False
        steps = torch.stack([state[p]["step"] for p in params])
        return bool((steps == steps[0]).all())

    @staticmethod
    def release(state: dict[Tensor, dict[str, Tensor]]) -> None:
        """Give every parameter its own step counter back (per-tensor kernels advance each)."""
        for entry in state.values():
            if "step" in entry:
                entry["step"] = entry["step"].clone()


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalOptimizer:
    """What the functional optimizers share. Each one is a dataclass of its constructor's
    arguments (which keep the constructor's values; ``defaults`` holds the ones ``step`` uses)."""

    kind: ClassVar[str] = ""
    torch_class: ClassVar[type]  # whose constructor checks the hyperparameters
    params: list[Tensor]

    def __post_init__(self) -> None:
        hyper = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del hyper["params"]
        # torch.optim's own checks (and messages), on a one-element probe.
        self.torch_class([torch.zeros(1, requires_grad=True)], **hyper)
        self.defaults = flat_hparams(hyper)
        self.flags = {k: bool(v) for k, v in hyper.items() if isinstance(v, bool) or v is None}
        self.state = {}
        # Flat stepping pays off for fused Adam/AdamW over many small real tensors of one kind
        # (SGD's update is too cheap to win back the copies).
        self._flattens = (
            self.kind in ("adam", "adamw")
            and self.flags.get("fused", False)
            and len(self.params) > 1
            and sum(p.numel() for p in self.params) <= FLAT_MAX_MEAN_NUMEL * len(self.params)
            and {(p.dtype, p.device, p.layout) for p in self.params}
            == {(self.params[0].dtype, self.params[0].device, torch.strided)}
            and not any(torch.is_complex(p) for p in self.params)
        )

    @property
    def state(self) -> dict[Tensor, dict[str, Tensor]]:
        """``{parameter: {name: tensor}}``, as ``torch.optim`` keeps it; assign to replace it."""
        return self._state

    @state.setter
    def state(self, value: dict[Tensor, dict[str, Tensor]]) -> None:
        self._state = value
        self._flat: _Flat | None = None

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``, in place.

        Args:
            gradients: One per parameter, in order; ``None`` leaves a parameter and its state alone.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.
        """
        _check_count(len(self.params), len(gradients))
        if self._flattens and all(g is not None for g in gradients):
            if self._flat is None and _Flat.adoptable(self.params, self.state):
                self._flat = _Flat(self.params, self.state)
            if (flat := self._flat) is not None:
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
            _Flat.release(self.state)
            self._flat = None
        _step(self.kind, self.params, gradients, self.state, self.defaults, self.flags)

    def scriptable(self) -> Scriptable:
        """Return this optimizer as a :class:`Scriptable` sharing its containers."""
        return Scriptable(self.kind, self.params, self.state, self.defaults, self.flags)


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalSGD(FunctionalOptimizer):
    """SGD; matches ``torch.optim.SGD``."""

    kind, torch_class = "sgd", torch.optim.SGD
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    maximize: bool = False
    foreach: bool = False
    fused: bool = False


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalAdam(FunctionalOptimizer):
    """Adam; matches ``torch.optim.Adam``."""

    kind, torch_class = "adam", torch.optim.Adam
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    maximize: bool = False
    foreach: bool = False
    fused: bool = False
    decoupled_weight_decay: bool = False


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalAdamW(FunctionalOptimizer):
    """AdamW; matches ``torch.optim.AdamW``."""

    kind, torch_class = "adamw", torch.optim.AdamW
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    amsgrad: bool = False
    maximize: bool = False
    foreach: bool = False
    fused: bool = False


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalAdagrad(FunctionalOptimizer):
    """Adagrad; matches ``torch.optim.Adagrad`` (whose state exists from construction on)."""

    kind, torch_class = "adagrad", torch.optim.Adagrad
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    maximize: bool = False
    foreach: bool = False
    fused: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        fills = [0.0, self.initial_accumulator_value]
        _collect(self.params, list(self.params), self.state, ["step", "sum"], fills, self.fused)


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalRMSprop(FunctionalOptimizer):
    """RMSprop; matches ``torch.optim.RMSprop``."""

    kind, torch_class = "rmsprop", torch.optim.RMSprop
    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False
    maximize: bool = False
    foreach: bool = False


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalAdamax(FunctionalOptimizer):
    """Adamax; matches ``torch.optim.Adamax``."""

    kind, torch_class = "adamax", torch.optim.Adamax
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    maximize: bool = False
    foreach: bool = False


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalAdadelta(FunctionalOptimizer):
    """Adadelta; matches ``torch.optim.Adadelta``."""

    kind, torch_class = "adadelta", torch.optim.Adadelta
    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0
    maximize: bool = False
    foreach: bool = False


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalRprop(FunctionalOptimizer):
    """Rprop; matches ``torch.optim.Rprop``."""

    kind, torch_class = "rprop", torch.optim.Rprop
    lr: float = 1e-2
    etas: tuple[float, float] = (0.5, 1.2)
    step_sizes: tuple[float, float] = (1e-6, 50.0)
    maximize: bool = False
    foreach: bool = False


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalQHM(FunctionalOptimizer):
    """Quasi-hyperbolic momentum, the functional twin of :class:`metadist.optim.QHM`."""

    kind, torch_class = "qhm", QHM
    lr: float
    momentum: float
    nu: float
    weight_decay: float = 0.0
    weight_decay_type: str = "grad"
    maximize: bool = False
    foreach: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.flags["direct_weight_decay"] = self.weight_decay_type == "direct"


# Each argument described once for every class that takes it (the Args of their docstrings).
_ARGS = {
    "params": "Parameters to update in place.",
    "lr": "Learning rate (Adadelta: scales the delta; Rprop: the initial step size).",
    "momentum": "Momentum factor (QHM: in ``[0, 1)``).",
    "dampening": "Dampening for momentum.",
    "weight_decay": "Weight decay: L2, or decoupled (AdamW, ``decoupled_weight_decay``, QHM's "
    '``"direct"``).',
    "nesterov": "Nesterov momentum.",
    "betas": "Coefficients of the running averages (Adamax: of the gradient and its inf-norm).",
    "eps": "Term added to the denominator.",
    "amsgrad": "Use the AMSGrad variant.",
    "lr_decay": "Learning-rate decay.",
    "initial_accumulator_value": "Starting value of the sum of squares.",
    "alpha": "Smoothing constant.",
    "centered": "Normalize by an estimate of the gradient's variance.",
    "rho": "Coefficient of the running averages.",
    "etas": "Multiplicative decrease and increase factors.",
    "step_sizes": "Minimal and maximal step sizes.",
    "nu": "Immediate discount factor.",
    "weight_decay_type": '``"grad"`` or ``"direct"`` (see :func:`metadist.optim.qhm`).',
    "maximize": "Ascend instead of descend.",
    "foreach": "Multi-tensor kernels (eager only).",
    "fused": "Fused kernels (eager only).",
    "decoupled_weight_decay": "AdamW-style weight decay.",
}
for _cls in FunctionalOptimizer.__subclasses__():
    _cls.__doc__ = "\n".join(
        [inspect.cleandoc(_cls.__doc__ or ""), "", "Args:"]
        + [f"    {f.name}: {_ARGS[f.name]}" for f in dataclasses.fields(_cls)]
    )
