"""Compile a functional optimizer instance with TorchScript (its ``step`` then runs without the
GIL), where this torch can: :func:`torchscript_status` says (``docs/optim.md``)."""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from typing import Any

import torch
from torch import Tensor

from metadist._quiet import quiet_torch_warnings
from metadist.optim.functional import FunctionalOptimizer, FunctionalQHM, FunctionalSGD
from metadist.optim.qhm import QHM, QHMTwin

__all__ = ["ScriptedFunctionalOptimizer", "script_functional_optimizer", "torchscript_status"]

# torch's compiler is not thread-safe.
_compile_lock = threading.Lock()
# Classes torch failed to compile, and why: it cannot compile a class again after a failure.
_failed: dict[type, str] = {}


@functools.cache
def torchscript_status(functional_class: Any = FunctionalSGD) -> tuple[bool, str | None]:
    """Whether :func:`script_functional_optimizer` compiles instances of ``functional_class`` here
    (tried once per process and class on a one-element instance).

    Args:
        functional_class: One of metadist's functional classes. For any other class this says
            whether TorchScript works here at all (on :class:`FunctionalSGD`); whether the class
            itself compiles shows when an instance is scripted.

    Returns:
        ``(works, problem)``: ``problem`` is ``None`` or why not, naming the torch version.
    """
    if not issubclass(functional_class, FunctionalOptimizer):
        functional_class = FunctionalSGD
    needed = {"lr": 0.1, "momentum": 0.5, "nu": 0.5} if functional_class is FunctionalQHM else {}
    try:
        script_functional_optimizer(functional_class([torch.zeros(1)], **needed))
    except RuntimeError as exc:
        return False, str(exc)
    return True, None


def forget() -> None:
    """Forget what :func:`torchscript_status` found (for tests that change ``torch.jit``)."""
    torchscript_status.cache_clear()
    _failed.clear()


class ScriptedFunctionalOptimizer(torch.nn.Module):
    """A functional optimizer instance held in TorchScript (build it, and see what it raises, with
    :func:`script_functional_optimizer`).

    Args:
        optim: A TorchScript-compatible functional optimizer instance (``step(gradients)``,
            ``state``, ``defaults``), compiled as a TorchScript class with the module.
    """

    def __init__(self, optim: Any) -> None:
        super().__init__()
        self.optim = optim
        group = getattr(optim, "param_group", {"params": []})  # torch's twins' (and QHMTwin's)
        self.params: Any = torch.jit.Attribute(list(group["params"]), list[Tensor])

    # hasattr(self.optim, "param_group") is decided at compile time: one branch compiles.
    @torch.jit.export
    def step(self, gradients: list[Tensor | None]) -> None:
        """Step the held optimizer.

        Args:
            gradients: One per parameter, in order; ``None`` skips it.
        """
        if hasattr(self.optim, "param_group"):  # as FunctionalOptimizer.step does
            params: list[Tensor] = []
            grads: list[Tensor | None] = []
            for p, g in zip(self.params, gradients):  # noqa: B905 (TorchScript has no strict=)
                if g is not None:
                    params.append(p)
                    grads.append(g)
            self.optim.param_group["params"] = params
            self.optim.step(grads)
            self.optim.param_group["params"] = self.params
        else:
            self.optim.step(gradients)

    @torch.jit.export
    def get_state(self) -> dict[Tensor, dict[str, Tensor]]:
        """Return the held optimizer's state.

        Returns:
            ``{parameter: {name: tensor}}`` (the live tensors).
        """
        return self.optim.state

    @torch.jit.export
    def set_state(self, state: dict[Tensor, dict[str, Tensor]]) -> None:
        """Replace the held optimizer's state.

        Args:
            state: ``{parameter: {name: tensor}}``; ``{}`` starts every parameter afresh.
        """
        self.optim.state = state

    @torch.jit.export
    def get_defaults(self) -> dict[str, float]:
        """Return the held optimizer's float hyperparameters.

        Returns:
            ``{name: value}``.
        """
        return self.optim.defaults

    @torch.jit.export
    def set_defaults(self, defaults: dict[str, float]) -> None:
        """Replace the held optimizer's float hyperparameters.

        Args:
            defaults: ``{name: value}`` (a scheduler's new ``lr``, ...).
        """
        self.optim.defaults = defaults


def _twin(optim: FunctionalOptimizer) -> Any:
    """The TorchScript-compatible twin of one of metadist's functional optimizers, holding its
    parameters, state and hyperparameters: ``torch.distributed.optim``'s, whose import scripts
    classes and brings FSDP and DTensor in (about a second), hence here and not in eager steps;
    :class:`QHMTwin` for QHM."""
    with quiet_torch_warnings():
        from torch.distributed.optim.utils import functional_optim_map

    hyper = optim.hyperparameters()
    twins = {**functional_optim_map, QHM: QHMTwin}
    twin = twins[torch.optim.AdamW if hyper.get("decoupled_weight_decay") else optim.torch_class]
    accepted = inspect.signature(twin).parameters
    given = {**hyper, "_allow_empty_param_list": True}
    kwargs = {k: False if v is None else v for k, v in given.items() if k in accepted}
    # The twins warn at construction that TorchScript is deprecated, under "always": only
    # recording the warning drops it.
    with warnings.catch_warnings(record=True):
        held = twin(optim.params, **kwargs)
    # Floats only (an int lr too): TorchScript types the dict by its values.
    held.defaults = {k: float(optim.defaults.get(k, v)) for k, v in held.defaults.items()}
    held.state = optim.state
    return held


def script_functional_optimizer(optim: Any) -> Any:
    """Compile ``optim`` (a functional optimizer instance) with TorchScript.

    Args:
        optim: An instance of a TorchScript-compatible functional optimizer built with
            ``foreach=False`` and ``fused=False``.

    Returns:
        A scripted :class:`ScriptedFunctionalOptimizer`.

    Raises:
        TypeError: If ``optim`` is not a functional optimizer instance (checked before compiling).
        ValueError: If ``optim`` was built with ``foreach=True`` or ``fused=True``.
        RuntimeError: If this torch cannot compile its class (naming the version and the fix).
    """
    expected = "a functional optimizer instance (step(gradients), state and defaults dicts)"
    if isinstance(optim, type):
        raise TypeError(f"optim must be {expected}, got the class {optim.__name__}; create one")
    if isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"optim must be {expected}, got the torch.optim.Optimizer {type(optim).__name__}, "
            "which reads .grad; use its functional twin (see get_functional_optimizer)"
        )
    has = {"step": callable(getattr(optim, "step", None))}
    has.update({k: isinstance(getattr(optim, k, None), dict) for k in ("state", "defaults")})
    if lacking := [name for name, ok in has.items() if not ok]:
        raise TypeError(
            f"optim must be {expected}, got {optim!r:.100} of type {type(optim).__name__}, "
            f"which has no {' / '.join(lacking)}"
        )
    for flag in ("foreach", "fused"):
        if getattr(optim, flag, False) is True:
            raise ValueError(
                f"optim was built with {flag}=True, which TorchScript cannot run; build it with "
                f"{flag}=False to script it"
            )
    cls: Any = type(optim)
    held = _twin(optim) if isinstance(optim, FunctionalOptimizer) else optim
    problem = _failed.get(cls)
    if problem is None and not callable(getattr(torch.jit, "script", None)):
        problem = f"torch {torch.__version__} has no torch.jit.script"
    if problem is None:
        # One module class per held class: a failed compile leaves the others alone.
        module = type(f"Scripted{type(held).__name__}", (ScriptedFunctionalOptimizer,), {})
        try:
            with _compile_lock, quiet_torch_warnings():
                return torch.jit.script(module(held))
        except Exception as exc:
            # TorchScript's first line says what failed; a later one names the function.
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["?"]
            where = next((line for line in lines if "is being compiled" in line), "")
            problem = _failed[cls] = (
                f"TorchScript in torch {torch.__version__} cannot compile {cls.__name__} "
                f"({type(exc).__name__}: {lines[0]}{' ' + where if where else ''})"
            )
    raise RuntimeError(
        f"cannot script {cls.__name__}: {problem}. Step it eagerly instead (its step(), or "
        "DistributedOptimizer(..., mode='eager' or 'auto'))"
    )
