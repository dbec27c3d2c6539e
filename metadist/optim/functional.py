"""Functional optimizers: ``torch.optim``'s algorithms stepped with explicit gradients, one
per parameter (``None`` leaves a parameter and its state alone), never through ``.grad``.

Each class takes ``(params, <its torch.optim class's hyperparameters>)``, checked by that class's
constructor, and steps with torch's own functional kernel (``torch.optim.adam.adam`` and
friends; :func:`metadist.optim.qhm.qhm` for QHM), so results match ``torch.optim``: ``state`` as
``torch.optim`` keeps it, float hyperparameters in ``defaults`` (tuples split: ``betas`` ->
``beta1``/``beta2``, see :data:`TUPLE_KEYS`), boolean ones in ``flags``.

Example:
    >>> import torch
    >>> p, q = torch.ones(2), torch.ones(2)
    >>> FunctionalSGD([p, q], lr=0.5).step([torch.ones(2), None])
    >>> p, q  # q had no gradient: left alone
    (tensor([0.5000, 0.5000]), tensor([1., 1.]))
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim.adadelta import adadelta
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.adamax import adamax
from torch.optim.adamw import adamw
from torch.optim.rmsprop import rmsprop
from torch.optim.rprop import rprop
from torch.optim.sgd import sgd

from metadist.optim.qhm import QHM, qhm

__all__ = ["FunctionalAdadelta", "FunctionalAdagrad", "FunctionalAdam", "FunctionalAdamW"]
__all__ += ["FunctionalAdamax", "FunctionalOptimizer", "FunctionalQHM", "FunctionalRMSprop"]
__all__ += ["FunctionalRprop", "FunctionalSGD", "TUPLE_KEYS", "checked_group", "flat_hparams"]
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
            out[TUPLE_KEYS[key][0]] = float(value[0])
            out[TUPLE_KEYS[key][1]] = float(value[1])
        elif not isinstance(value, bool | str | type(None)):
            out[key] = float(value)
    return out


def checked_group(cls: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Build the ``torch.optim.Optimizer`` subclass ``cls`` over a probe tensor, so that its
    constructor checks the hyperparameters as torch.optim does, and return its param group
    without ``params``.

    torch's ``Optimizer.add_param_group``, which every constructor calls, imports
    ``torch._dynamo`` on its first call, only to leave it out (0.8-1.9 s of CPU, paid by every
    process that makes an optimizer): the probe calls the function it wraps instead."""
    probe = cls.__new__(cls)
    base = torch.optim.Optimizer.add_param_group
    if getattr(cls, "add_param_group", None) is base:  # (a class's own is left alone)
        add = getattr(base, "__wrapped__", base)
        probe.add_param_group = types.MethodType(add, probe)
    probe.__init__([torch.zeros(1, requires_grad=True)], *args, **kwargs)
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


@functools.cache
def plan(kernel: Callable[..., None]) -> tuple[list[str], str, list[str]]:
    """How to call ``kernel``, read from its signature: after ``params`` and ``grads`` come its
    state lists, named here after the state torch.optim keeps (``exp_avg_sqs``: ``exp_avg_sq``,
    ``state_steps``: ``step``, ``momentum_buffer_list``: ``momentum_buffer``), then its other
    arguments. Returns the state names in order, the one the kernel fills in itself (or ``""``),
    and the names of the other arguments."""
    names: list[str] = []
    lazy_name = ""
    keywords: list[str] = []
    for param in list(inspect.signature(kernel).parameters.values())[2:]:
        annotation = str(param.annotation)
        if not annotation.startswith(("list[", "List[")):
            keywords.append(param.name)
            continue
        name = param.name.removeprefix("state_")
        names.append(name.removesuffix("_list") if name.endswith("_list") else name[:-1])
        if "None" in annotation or "Optional" in annotation:
            lazy_name = names[-1]
    return names, lazy_name, keywords


class _Shared:
    """Fused Adam/AdamW state whose parameters' "step" counters are one tensor: torch's fused
    kernel reads each parameter's count, and torch first adds 1 to each (one dispatch per
    parameter, more than the kernel costs on small ones), here to the one tensor."""

    def __init__(self, params: list[Tensor], state: dict[Tensor, dict[str, Tensor]]) -> None:
        self.step = state[params[0]]["step"].clone()
        for p in params:
            state[p]["step"] = self.step
        self.steps = [self.step] * len(params)
        # (max_exp_avg_sq: kept only with amsgrad, then by every parameter, as adoptable checks)
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs = (
            [state[p][n] for p in params if n in state[p]]
            for n in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        )
        self.lists = (exp_avgs, exp_avg_sqs, max_exp_avg_sqs)

    @staticmethod
    def adoptable(params: list[Tensor], state: dict[Tensor, dict[str, Tensor]]) -> bool:
        """Whether every parameter has state of the same names (Adam's) and the same step count."""
        names = set(state.get(params[0], ()))
        if not names or any(p not in state or set(state[p]) != names for p in params):
            return False
        steps = torch.stack([state[p]["step"] for p in params])
        return bool((steps == steps[0]).all())


@dataclasses.dataclass(eq=False, repr=False)
class FunctionalOptimizer:
    """What the functional optimizers share. Each one is a dataclass of its constructor's
    arguments (which keep the constructor's values; ``defaults`` holds the ones ``step`` uses)."""

    torch_class: ClassVar[type]  # whose constructor checks the hyperparameters
    _kernel: ClassVar[Callable[..., None]]  # torch's functional kernel for it
    # State kept only while a flag or hyperparameter is set, and state that starts at a
    # hyperparameter's value rather than at zero.
    switches: ClassVar[dict[str, str]] = {}
    fills: ClassVar[dict[str, str]] = {}
    upfront: ClassVar[bool] = False  # state made at construction (Adagrad's), not at first step
    params: list[Tensor]

    def __post_init__(self) -> None:
        hyper = self._hyper()
        checked_group(self.torch_class, **hyper)  # torch.optim's own checks and messages
        self.defaults = flat_hparams(hyper)
        self.flags = {k: bool(v) for k, v in hyper.items() if isinstance(v, bool) or v is None}
        self._strings = {k: v for k, v in hyper.items() if isinstance(v, str)}  # QHM's
        self._shared: _Shared | None = None
        self.state = {}
        if self.upfront:
            self._lists(self.params, self.state)
        # Fused Adam/AdamW over real tensors of one kind steps with torch's kernel called here,
        # its "step" counters shared (see _Shared).
        kinds = {(p.dtype, p.device, p.layout) for p in self.params}
        self._shares = (
            self._kernel in (adam, adamw)
            and self.flags.get("fused", False)
            and len(kinds) == 1
            and self.params[0].layout == torch.strided
            and not torch.is_complex(self.params[0])
        )

    def _hyper(self) -> dict[str, Any]:  # the constructor's arguments but params, by name
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[1:]}

    @property
    def state(self) -> dict[Tensor, dict[str, Tensor]]:
        """``{parameter: {name: tensor}}``, as ``torch.optim`` keeps it; assign to replace it."""
        if self._shared is not None:  # each parameter's own step counter back
            for entry in self._state.values():
                entry["step"] = entry["step"].clone()
            self._shared = None
        return self._state

    @state.setter
    def state(self, value: dict[Tensor, dict[str, Tensor]]) -> None:
        self._state = value
        self._shared = None

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter whose gradient is not ``None``, in place.

        Args:
            gradients: One per parameter, in order; ``None`` leaves a parameter and its state alone.

        Raises:
            ValueError: If ``len(gradients) != len(params)``.
        """
        full = len(gradients) == len(self.params) and all(g is not None for g in gradients)
        if self._shares and full:  # (not `None in gradients`: == on 100 tensors costs 1 ms)
            if self._shared is None and _Shared.adoptable(self.params, self._state):
                self._shared = _Shared(self.params, self._state)
            if (shared := self._shared) is not None:
                self._fused_adam(shared, gradients)  # type: ignore[arg-type]
                return
        self._run(self.params, gradients, self.state)

    def _fused_adam(self, shared: _Shared, grads: list[Tensor]) -> None:
        """What ``torch.optim.adam.adam`` runs for fused tensors of one kind (its ``_fused_adam``),
        the step counters added to once. torch's kernels are private ops: the tests compare
        every step with ``torch.optim``'s, bit for bit, on each torch CI runs."""
        decoupled = self._kernel is adamw or self.flags.get("decoupled_weight_decay", False)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        hyper = self.defaults
        with torch.no_grad():
            shared.step.add_(1)
            kernel(
                self.params,
                grads,
                *shared.lists,
                shared.steps,
                amsgrad=self.flags["amsgrad"],
                lr=hyper["lr"],
                beta1=hyper["beta1"],
                beta2=hyper["beta2"],
                weight_decay=hyper["weight_decay"],
                eps=hyper["eps"],
                maximize=self.flags["maximize"],
            )

    def _keeps(self, name: str) -> bool:
        """Whether the state ``name`` is in use: it has no switch, or its switch (a flag or a
        hyperparameter: ``amsgrad``, ``momentum``) is set."""
        switch = self.switches.get(name, "")
        return switch == "" or self.flags.get(switch, False) or self.defaults.get(switch, 0.0) != 0

    def _lists(self, kept: list[Tensor], state: Any) -> dict[str, list[Any]]:
        """One list per state name of the kernel (empty where not kept), the state made at a
        parameter's first step as torch.optim makes it."""
        names, lazy_name, _ = plan(self._kernel)
        made = [n for n in names if n != lazy_name and self._keeps(n)]
        fused = self.flags.get("fused", False)
        lists: dict[str, list[Any]] = {n: [] for n in names}
        for p in kept:
            entry = state.setdefault(p, {})
            for name in made:
                if name not in entry and name == "step" and fused:  # (float32, on p's device)
                    entry[name] = torch.zeros((), dtype=torch.float32, device=p.device)
                elif name not in entry and name == "step":  # (the default dtype, on the CPU)
                    entry[name] = torch.tensor(0.0)
                elif name not in entry:
                    fill = self.defaults[self.fills[name]] if name in self.fills else 0.0
                    entry[name] = torch.full_like(p, fill)
                lists[name].append(entry[name])
            if lazy_name:  # the list the kernel fills in itself (SGD's momentum buffers)
                lists[lazy_name].append(entry.get(lazy_name))
            if not entry:  # (SGD without momentum keeps nothing)
                del state[p]
        return lists

    def _run(self, params: list[Tensor], gradients: list[Tensor | None], state: Any) -> None:
        """torch's kernel over the parameters that have a gradient, with their state and every
        other argument the kernel takes that is known here."""
        if len(gradients) != len(params):
            raise ValueError(
                f"gradients has {len(gradients)} entries, one per parameter: {len(params)}"
            )
        _, lazy_name, keywords = plan(self._kernel)
        kept = [p for p, g in zip(params, gradients, strict=True) if g is not None]
        grads = [g for g in gradients if g is not None]
        lists = self._lists(kept, state)
        values: dict[str, Any] = {**self._strings, **self.defaults, **self.flags}
        values["has_complex"] = any(torch.is_complex(p) for p in kept)
        values["has_sparse_grad"] = any(g.is_sparse for g in grads)
        with torch.no_grad():
            self._kernel(
                kept, grads, *lists.values(), **{k: values[k] for k in keywords if k in values}
            )
        if lazy_name and self._keeps(lazy_name):
            for p, buf in zip(kept, lists[lazy_name], strict=True):
                if buf is not None:
                    state[p] = {lazy_name: buf}


def _functional(torch_class: type, kernel: Callable[..., None], **class_vars: Any) -> Any:
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
    namespace = {
        "torch_class": torch_class,
        "_kernel": staticmethod(kernel),
        "__doc__": "\n".join(doc),
    }
    cls = dataclasses.make_dataclass(
        "Functional" + name,
        fields,
        bases=(FunctionalOptimizer,),
        namespace={**namespace, **class_vars},
        eq=False,
        repr=False,
    )
    cls.__module__ = __name__
    # The fields are documented under Args; autodoc finds no source to document a field without
    # a default (QHM's lr) as an attribute, and would warn.
    cls.__annotations__ = {}
    return cls


FunctionalSGD = _functional(torch.optim.SGD, sgd, switches={"momentum_buffer": "momentum"})
FunctionalAdam = _functional(torch.optim.Adam, adam, switches={"max_exp_avg_sq": "amsgrad"})
FunctionalAdamW = _functional(torch.optim.AdamW, adamw, switches={"max_exp_avg_sq": "amsgrad"})
# Adagrad's state exists from construction on, starting at initial_accumulator_value.
FunctionalAdagrad = _functional(
    torch.optim.Adagrad, adagrad, fills={"sum": "initial_accumulator_value"}, upfront=True
)
FunctionalRMSprop = _functional(
    torch.optim.RMSprop, rmsprop, switches={"grad_avg": "centered", "momentum_buffer": "momentum"}
)
FunctionalAdamax = _functional(torch.optim.Adamax, adamax)
FunctionalAdadelta = _functional(torch.optim.Adadelta, adadelta)
FunctionalRprop = _functional(torch.optim.Rprop, rprop, fills={"step_size": "lr"})
FunctionalQHM = _functional(QHM, qhm)


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
            raise TypeError(f"functional_class must define step(gradients); {cls.__name__} doesn't")
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
