"""Compile a functional optimizer instance with TorchScript, while torch still has it.

Held by a scripted ``nn.Module``, the optimizer's ``step`` runs in the TorchScript interpreter,
without the GIL. torch deprecates TorchScript (since 2.10) and is set to make
``torch.jit.script`` raise: :func:`torchscript_status` says which (``docs/optim.md``).
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import torch
from torch import Tensor

from metadist._quiet import quiet_torch_warnings
from metadist.optim.functional import FunctionalOptimizer

__all__ = ["ScriptedFunctionalOptimizer", "script_functional_optimizer", "torchscript_status"]

# torch's compiler is not thread-safe; torch caches compiled classes, so only the first
# instance of each functional class pays for compilation.
_compile_lock = threading.Lock()


def _probe(x: Tensor) -> Tensor:
    return x + 1


@functools.cache
def torchscript_status() -> tuple[bool, str | None]:
    """``(works, problem)``: whether ``torch.jit.script`` compiles a probe here (once per process),
    and why ``"auto"`` should not pick it (deprecated, say), or ``None``."""
    version = torch.__version__
    script = getattr(torch.jit, "script", None)
    if script is None:
        return False, f"torch {version} has no torch.jit.script"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            script(_probe)
        except Exception as exc:
            return False, f"torch.jit.script fails in torch {version} ({type(exc).__name__}: {exc})"
    if any(issubclass(w.category, DeprecationWarning) for w in caught):
        return True, f"torch {version} deprecates TorchScript"
    return True, None


class ScriptedFunctionalOptimizer(torch.nn.Module):
    """A functional optimizer instance held in TorchScript (build it, and see what it raises, with
    :func:`script_functional_optimizer`).

    Args:
        optim: A functional optimizer instance (``step(gradients)``, ``state``, ``defaults``).
    """

    def __init__(self, optim: Any) -> None:
        _check_functional_optimizer(optim)
        super().__init__()
        # metadist's own classes share one step through inheritance, which TorchScript cannot
        # compile: they are scripted as the one class holding the same containers.
        self.optim = optim.scriptable() if isinstance(optim, FunctionalOptimizer) else optim

    @torch.jit.export
    def step(self, gradients: list[Tensor | None]) -> None:
        """Step the held optimizer.

        Args:
            gradients: One gradient per parameter, in parameter order; ``None`` skips it.
        """
        self.optim.step(gradients)

    @torch.jit.export
    def get_state(self) -> dict[Tensor, dict[str, Tensor]]:
        """Return the held optimizer's state (the live tensors).

        Returns:
            ``{parameter: {name: tensor}}``, as ``torch.optim`` keeps it.
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
            defaults: ``{name: value}``, e.g. with a new ``lr`` from a scheduler.
        """
        self.optim.defaults = defaults


def script_functional_optimizer(optim: Any) -> Any:
    """Compile ``optim`` (a functional optimizer instance) with ``torch.jit.script``.

    Args:
        optim: An instance of a TorchScript-compatible functional optimizer built with
            ``foreach=False`` and ``fused=False``.

    Returns:
        A scripted :class:`ScriptedFunctionalOptimizer`.

    Raises:
        TypeError: If ``optim`` is not a functional optimizer instance (checked before compiling).
        ValueError: If ``optim`` was built with ``foreach=True`` or ``fused=True``.
        RuntimeError: If this torch cannot script at all, or cannot compile this class.
    """
    _check_functional_optimizer(optim)
    works, problem = torchscript_status()
    if not works:
        raise RuntimeError(
            f"cannot script {type(optim).__name__}: {problem}. Step it eagerly instead "
            "(call its step() directly, or DistributedOptimizer(..., mode='eager' or 'auto'))"
        )
    with _compile_lock, quiet_torch_warnings():
        return torch.jit.script(ScriptedFunctionalOptimizer(optim))


def _check_functional_optimizer(optim: Any) -> None:
    """Raise a clear error unless ``optim`` is a scriptable functional optimizer instance
    (TorchScript would fail with a compile error about a missing attribute)."""
    expected = (
        "a functional optimizer instance (with step(gradients), a state dict and a defaults "
        "dict), e.g. FunctionalAdam(params, lr=0.1)"
    )
    if isinstance(optim, type):
        raise TypeError(
            f"optim must be {expected}, got the class {optim.__name__}; create an instance first"
        )
    if isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"optim must be {expected}, got the torch.optim.Optimizer {type(optim).__name__}, "
            "which reads .grad; use its functional twin (see get_functional_optimizer)"
        )
    has = {
        "step": callable(getattr(optim, "step", None)),
        "state": isinstance(getattr(optim, "state", None), dict),
        "defaults": isinstance(getattr(optim, "defaults", None), dict),
    }
    lacking = [name for name, ok in has.items() if not ok]
    if lacking:
        raise TypeError(
            f"optim must be {expected}, got {optim!r:.100} of type {type(optim).__name__}, "
            f"which has no {' / '.join(lacking)}"
        )
    for flag in ("foreach", "fused"):
        if getattr(optim, flag, False) is True:
            raise ValueError(
                f"optim was built with {flag}=True, which TorchScript cannot run; build it with "
                f"{flag}=False (the default) to script it"
            )
