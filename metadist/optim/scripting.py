"""Compile a functional optimizer instance into TorchScript, lazily and once per class.

A class compiled with ``torch.jit.script`` but instantiated from Python stays a Python object.
Holding the instance as an attribute of a scripted ``nn.Module`` moves it into TorchScript: its
``step`` then runs in the TorchScript interpreter, without the GIL. Compiling is not thread-safe in
torch, so it is serialized; torch caches the compiled type, so only the first instance of each
functional class pays for compilation.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from metadist._quiet import quiet_torch_warnings

__all__ = ["ScriptedFunctionalOptimizer", "script_functional_optimizer"]

_compile_lock = threading.Lock()


class ScriptedFunctionalOptimizer(torch.nn.Module):
    """A functional optimizer instance held in TorchScript (build it with
    :func:`script_functional_optimizer`).

    Args:
        optim: A functional optimizer instance (``step(gradients)``, ``state``, ``defaults``).

    Raises:
        TypeError: If ``optim`` is not a functional optimizer instance (a class, a
            ``torch.optim.Optimizer``, or an object without ``step``, ``state`` or ``defaults``).
        ValueError: If ``optim`` was built with ``foreach=True`` or ``fused=True``.

    Example:
        >>> import torch
        >>> from metadist.optim import FunctionalSGD
        >>> p = torch.ones(1)
        >>> scripted = script_functional_optimizer(FunctionalSGD([p], lr=0.5))
        >>> scripted.step([torch.ones(1)])
        >>> p
        tensor([0.5000])
    """

    def __init__(self, optim: Any) -> None:
        _check_functional_optimizer(optim, "optim")
        super().__init__()
        self.optim = optim

    @torch.jit.export
    def step(self, gradients: list[Tensor | None]) -> None:
        """Step the held optimizer; ``None`` skips a parameter.

        Args:
            gradients: One gradient (or ``None``) per parameter, in parameter order.

        Example:
            >>> import torch
            >>> from metadist.optim import FunctionalSGD
            >>> p = torch.ones(2)
            >>> opt = ScriptedFunctionalOptimizer(FunctionalSGD([p], lr=1.0))
            >>> opt.step([None])  # skipped
            >>> p
            tensor([1., 1.])
        """
        self.optim.step(gradients)

    @torch.jit.export
    def get_state(self) -> dict[Tensor, dict[str, Tensor]]:
        """Return the held optimizer's state (the live tensors).

        Returns:
            ``{parameter: {name: tensor}}``, as ``torch.optim`` keeps it.

        Example:
            >>> import torch
            >>> from metadist.optim import FunctionalSGD
            >>> ScriptedFunctionalOptimizer(FunctionalSGD([torch.ones(1)], lr=1.0)).get_state()
            {}
        """
        return self.optim.state

    @torch.jit.export
    def set_state(self, state: dict[Tensor, dict[str, Tensor]]) -> None:
        """Replace the held optimizer's state.

        Args:
            state: ``{parameter: {name: tensor}}``, e.g. from :meth:`get_state`.

        Example:
            >>> import torch
            >>> from metadist.optim import FunctionalSGD
            >>> opt = ScriptedFunctionalOptimizer(FunctionalSGD([torch.ones(1)], lr=1.0))
            >>> opt.set_state({})
        """
        self.optim.state = state

    @torch.jit.export
    def get_defaults(self) -> dict[str, float]:
        """Return the held optimizer's hyperparameters.

        Returns:
            ``{name: value}`` of the float hyperparameters.

        Example:
            >>> import torch
            >>> from metadist.optim import FunctionalSGD
            >>> opt = ScriptedFunctionalOptimizer(FunctionalSGD([torch.ones(1)], lr=0.5))
            >>> opt.get_defaults()["lr"]
            0.5
        """
        return self.optim.defaults

    @torch.jit.export
    def set_defaults(self, defaults: dict[str, float]) -> None:
        """Replace the held optimizer's hyperparameters.

        Args:
            defaults: ``{name: value}``; e.g. a new ``lr`` from a scheduler.

        Example:
            >>> import torch
            >>> from metadist.optim import FunctionalSGD
            >>> opt = ScriptedFunctionalOptimizer(FunctionalSGD([torch.ones(1)], lr=0.5))
            >>> opt.set_defaults({**opt.get_defaults(), "lr": 0.1})
        """
        self.optim.defaults = defaults


def script_functional_optimizer(optim: Any) -> Any:
    """Compile ``optim`` (a functional optimizer instance) into TorchScript.

    Args:
        optim: An instance of a TorchScript-compatible functional optimizer built with
            ``foreach=False`` and ``fused=False``.

    Returns:
        A scripted :class:`ScriptedFunctionalOptimizer` whose ``step``, ``get_state``,
        ``set_state``, ``get_defaults`` and ``set_defaults`` run in TorchScript.

    Raises:
        TypeError: If ``optim`` is not a functional optimizer instance (a class, a
            ``torch.optim.Optimizer``, or an object without ``step``, ``state`` or ``defaults``).
            Checked before anything is compiled.
        ValueError: If ``optim`` was built with ``foreach=True`` or ``fused=True`` (TorchScript
            runs neither).
        RuntimeError: If the class cannot be compiled (torch's message says where).

    Example:
        >>> import torch
        >>> from metadist.optim import FunctionalAdam
        >>> p = torch.zeros(1)
        >>> scripted = script_functional_optimizer(FunctionalAdam([p], lr=0.1))
        >>> scripted.step([torch.ones(1)])
        >>> p
        tensor([-0.1000])
    """
    _check_functional_optimizer(optim, "optim")
    with _compile_lock, quiet_torch_warnings():
        return torch.jit.script(ScriptedFunctionalOptimizer(optim))


def _check_functional_optimizer(optim: Any, name: str) -> None:
    """Raise a clear error unless ``optim`` is a scriptable functional optimizer instance.

    TorchScript would otherwise fail with a compile error about a missing attribute.
    """
    expected = (
        "a functional optimizer instance (with step(gradients), a state dict and a defaults "
        "dict), e.g. FunctionalAdam(params, lr=0.1)"
    )
    if isinstance(optim, type):
        raise TypeError(
            f"{name} must be {expected}, got the class {optim.__name__}; create an instance first"
        )
    if isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"{name} must be {expected}, got the torch.optim.Optimizer {type(optim).__name__}, "
            "which reads .grad; use its functional twin (see get_functional_optimizer)"
        )
    lacking = [
        what
        for what, ok in (
            ("step", callable(getattr(optim, "step", None))),
            ("state", isinstance(getattr(optim, "state", None), dict)),
            ("defaults", isinstance(getattr(optim, "defaults", None), dict)),
        )
        if not ok
    ]
    if lacking:
        raise TypeError(
            f"{name} must be {expected}, got {optim!r:.100} of type {type(optim).__name__}, "
            f"which has no {' / '.join(lacking)}"
        )
    for flag in ("foreach", "fused"):
        if getattr(optim, flag, False) is True:
            raise ValueError(
                f"{name} was built with {flag}=True, which TorchScript cannot run; build it with "
                f"{flag}=False (the default) to script it"
            )
