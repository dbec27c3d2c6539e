"""Which functional optimizer stands in for which ``torch.optim`` class.

:class:`metadist.optim.DistributedOptimizer` steps the owners with the functional twin it finds
here; an unregistered class runs as itself, with ``.grad`` set from the context.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from metadist.optim.functional import FunctionalOptimizer

__all__ = ["get_functional_optimizer", "register_functional_optimizer"]

_lock = threading.Lock()
# Each of metadist's functional classes names the class it stands in for.
_REGISTRY: dict[type, type] = {c.torch_class: c for c in FunctionalOptimizer.__subclasses__()}


def _check_class(optimizer_class: Any) -> None:
    if not isinstance(optimizer_class, type):
        raise TypeError(f"optimizer_class must be a class, got {optimizer_class!r}")


def register_functional_optimizer(
    optimizer_class: type, functional_class: type | None = None
) -> Any:
    """Register ``functional_class`` as the functional twin of ``optimizer_class``.

    ``DistributedOptimizer(optimizer_class, ...)`` then steps the owners with it (the latest
    registration wins). Registration is per process: register in a module every worker imports.
    What a functional class must provide: ``docs/optim.md`` (the QHM section).

    Args:
        optimizer_class: The class users pass to ``DistributedOptimizer``.
        functional_class: Its functional twin. Leave out to use this as a class decorator.

    Returns:
        ``functional_class`` (or a decorator that registers and returns its argument).

    Raises:
        TypeError: If either argument is not a class, or ``functional_class`` has no ``step``
            method or is a ``torch.optim.Optimizer`` (which reads ``.grad``).
    """
    _check_class(optimizer_class)

    def register(cls: Any) -> Any:
        if not isinstance(cls, type):
            raise TypeError(f"functional_class must be a class, got {cls!r}")
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
        with _lock:
            _REGISTRY[optimizer_class] = cls
        return cls

    return register if functional_class is None else register(functional_class)


def get_functional_optimizer(optimizer_class: type) -> type | None:
    """Return the functional twin registered for ``optimizer_class`` (a functional class maps to
    itself), or ``None``.

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` subclass or a functional class.

    Returns:
        The registered functional class, ``optimizer_class`` itself, or ``None``.

    Raises:
        TypeError: If ``optimizer_class`` is not a class.
    """
    _check_class(optimizer_class)
    with _lock:
        found = _REGISTRY.get(optimizer_class)
        return optimizer_class if found is None and optimizer_class in _REGISTRY.values() else found
