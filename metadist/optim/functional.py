"""Functional optimizers: ``torch.optim``'s algorithms stepped with explicit gradients, one
per parameter (``None`` leaves a parameter and its state alone), never through ``.grad``.

Each class takes ``(params, <its torch.optim class's hyperparameters>)``, checked by that class's
constructor, and steps torch's functional optimizer for it (``torch.distributed.optim``'s; QHM's
is :class:`QHMTwin`): ``state`` as in ``torch.optim``, float hyperparameters in ``defaults``
(tuples split: ``betas`` -> ``beta1``/``beta2``, see :data:`TUPLE_KEYS`).

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
import warnings
from typing import Any, ClassVar

import torch
from torch import Tensor

from metadist._quiet import quiet_torch_warnings
from metadist.optim.qhm import QHM, QHMTwin

__all__ = ["FunctionalAdadelta", "FunctionalAdagrad", "FunctionalAdam", "FunctionalAdamW"]
__all__ += ["FunctionalAdamax", "FunctionalOptimizer", "FunctionalQHM", "FunctionalRMSprop"]
__all__ += ["FunctionalRprop", "FunctionalSGD", "TUPLE_KEYS", "flat_hparams"]
__all__ += ["get_functional_optimizer", "register_functional_optimizer"]

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


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalOptimizer:
    """What the functional optimizers share. Each one is a dataclass of its constructor's
    arguments (which keep the constructor's values), stepping ``optim``: torch's functional
    optimizer for ``torch_class`` (TorchScript-compatible; :class:`QHMTwin` for QHM)."""

    torch_class: ClassVar[type]  # whose constructor checks the hyperparameters
    params: list[Tensor]

    def __post_init__(self) -> None:
        hyper = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[1:]}  # not params
        self.torch_class([torch.zeros(1, requires_grad=True)], **hyper)  # torch.optim's checks
        # Imported on first use: torch then scripts its twins (about a second), quietly.
        with quiet_torch_warnings():
            from torch.distributed.optim.utils import functional_optim_map

        twins = {**functional_optim_map, QHM: QHMTwin}
        twin = twins[torch.optim.AdamW if hyper.get("decoupled_weight_decay") else self.torch_class]
        accepted = inspect.signature(twin).parameters
        given = {**hyper, "_allow_empty_param_list": True}
        kwargs = {k: False if v is None else v for k, v in given.items() if k in accepted}
        # The twins warn at construction that TorchScript is deprecated, under "always": only
        # recording the warning drops it.
        with warnings.catch_warnings(record=True):
            self.optim = twin(self.params, **kwargs)
        # Floats only (an int lr too): TorchScript types the dict by its values.
        self.optim.defaults = {k: float(v) for k, v in self.optim.defaults.items()}

    @property
    def state(self) -> dict[Tensor, dict[str, Tensor]]:
        """``{parameter: {name: tensor}}``, as ``torch.optim`` keeps it; assign to replace it."""
        return self.optim.state

    @state.setter
    def state(self, value: dict[Tensor, dict[str, Tensor]]) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, float]:
        """The float hyperparameters ``step`` uses, by name; assign to replace them."""
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, float]) -> None:
        self.optim.defaults = value

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``, in place.

        Args:
            gradients: One per parameter, in order; ``None`` leaves a parameter and its state alone.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.
        """
        if (n := len(gradients)) != len(self.params):
            raise ValueError(f"gradients has {n} entries, one per parameter: {len(self.params)}")
        # torch's Adagrad twin hands its kernel every parameter, with a gradient or not: every
        # twin gets only the parameters that have one.
        kept = [i for i, g in enumerate(gradients) if g is not None]
        self.optim.param_group["params"] = [self.params[i] for i in kept]
        try:
            self.optim.step([gradients[i] for i in kept])
        finally:
            self.optim.param_group["params"] = self.params


def _functional(torch_class: type) -> Any:
    """A functional optimizer class for ``torch_class``: a dataclass of ``params`` and the
    hyperparameters of its constructor (same names, defaults, keyword-only ones; without
    ``capturable`` and ``differentiable``, which stepping outside autograd and graphs excludes)."""
    fields: list[Any] = []
    for p in list(inspect.signature(torch_class).parameters.values())[1:]:
        if p.name not in ("capturable", "differentiable"):
            default = {} if p.default is p.empty else {"default": p.default}
            kw_only = p.kind is p.KEYWORD_ONLY
            fields.append((p.name, Any, dataclasses.field(kw_only=kw_only, **default)))
    name = torch_class.__name__
    torch_name = "torch" if torch_class.__module__.startswith("torch.") else "metadist"
    torch_name += f".optim.{name}"
    doc = [f"{name} on explicit gradients; matches ``{torch_name}``, whose hyperparameters it"]
    doc += ["takes (same names and defaults).", "", "Args:", "    params: Parameters to update."]
    doc += [f"    {f[0]}: As in ``{torch_name}``." for f in fields]
    namespace = {"torch_class": torch_class, "__doc__": "\n".join(doc)}
    cls = dataclasses.make_dataclass(
        "Functional" + name,
        fields,
        bases=(FunctionalOptimizer,),
        namespace=namespace,
        eq=False,
        repr=False,
    )
    cls.__module__ = __name__
    # The fields are documented under Args; autodoc finds no source to document a field without
    # a default (QHM's lr) as an attribute, and would warn.
    cls.__annotations__ = {}
    return cls


FunctionalSGD = _functional(torch.optim.SGD)
FunctionalAdam = _functional(torch.optim.Adam)
FunctionalAdamW = _functional(torch.optim.AdamW)
FunctionalAdagrad = _functional(torch.optim.Adagrad)
FunctionalRMSprop = _functional(torch.optim.RMSprop)
FunctionalAdamax = _functional(torch.optim.Adamax)
FunctionalAdadelta = _functional(torch.optim.Adadelta)
FunctionalRprop = _functional(torch.optim.Rprop)
FunctionalQHM = _functional(QHM)


# -- which functional optimizer stands in for which torch.optim class --------------------------

# Each of metadist's functional classes names the class it stands in for. Entries are set and read
# whole, and values() copied before the search: no lock is needed.
_REGISTRY: dict[type, type] = {c.torch_class: c for c in FunctionalOptimizer.__subclasses__()}


def _check_class(value: Any, name: str = "optimizer_class") -> None:
    if not isinstance(value, type):
        raise TypeError(f"{name} must be a class, got {value!r}")


def register_functional_optimizer(
    optimizer_class: type, functional_class: type | None = None
) -> Any:
    """Register ``functional_class`` as the functional twin that ``DistributedOptimizer`` steps
    owners with for ``optimizer_class`` (latest wins; per process: register in a module every
    worker imports). What a twin provides: ``docs/optim.md``, the QHM section.

    Args:
        optimizer_class: The class users pass to ``DistributedOptimizer``.
        functional_class: Its functional twin. Leave out to use this as a class decorator.

    Returns:
        ``functional_class`` (or a decorator that registers and returns its argument).

    Raises:
        TypeError: If either is not a class, or ``functional_class`` has no ``step`` method or
            is a ``torch.optim.Optimizer`` (which reads ``.grad``).
    """
    _check_class(optimizer_class)

    def register(cls: Any) -> Any:
        _check_class(cls, "functional_class")
        # Caught here, not on the owners at the first step, where the error would be obscure.
        if issubclass(cls, torch.optim.Optimizer):
            raise TypeError(
                f"functional_class must be a functional optimizer class (step(gradients), no "
                f".grad), got the torch.optim.Optimizer {cls.__name__}; leave "
                f"{optimizer_class.__name__} unregistered to run it as itself"
            )
        if not callable(getattr(cls, "step", None)):
            raise TypeError(
                f"functional_class must define step(gradients); {cls.__name__} does not"
            )
        _REGISTRY[optimizer_class] = cls
        return cls

    return register if functional_class is None else register(functional_class)


def get_functional_optimizer(optimizer_class: type) -> type | None:
    """Find the functional twin registered for ``optimizer_class``.

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` subclass or a functional class.

    Returns:
        The registered twin, ``optimizer_class`` itself if it is one, or ``None``.

    Raises:
        TypeError: If ``optimizer_class`` is not a class.
    """
    _check_class(optimizer_class)
    found = _REGISTRY.get(optimizer_class)
    return optimizer_class if found is None and optimizer_class in [*_REGISTRY.values()] else found
