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
    with _compile_lock, quiet_torch_warnings():
        return torch.jit.script(ScriptedFunctionalOptimizer(optim))
