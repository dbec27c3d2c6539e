"""Loss scaling for mixed precision over parameters on several owners: all step or all skip."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch
from torch import Tensor

from metadist.optim.distributed import DistributedOptimizer, check_optimizer, is_number

__all__ = ["DistributedGradScaler"]

T = TypeVar("T")
# state_dict key (torch.amp.GradScaler's) -> attribute and type.
_STATE: dict[str, tuple[str, type]] = {
    "scale": ("_scale", float),
    "growth_factor": ("growth_factor", float),
    "backoff_factor": ("backoff_factor", float),
    "growth_interval": ("growth_interval", int),
    "_growth_tracker": ("_growth_tracker", int),
}


class DistributedGradScaler:
    """``torch.amp.GradScaler`` for a :class:`DistributedOptimizer`: ``scale(loss)``, backward,
    ``unscale_`` and :func:`clip_grad_norm_` if clipping, ``step(opt, cid)``, ``update()`` (after
    the applying pass of a window). A complete run: ``docs/optim.md``.

    Args:
        init_scale: Initial scale factor.
        growth_factor: Factor the scale grows by after ``growth_interval`` clean steps.
        backoff_factor: Factor the scale shrinks by after a step with inf/NaN.
        growth_interval: Clean steps between growths.
        enabled: If ``False``, every method is a pass-through (``step`` just steps).

    Raises:
        ValueError: On a non-positive ``init_scale``, ``growth_factor <= 1``,
            ``backoff_factor`` outside ``(0, 1)`` or ``growth_interval < 1``.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not (is_number(init_scale) and init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not (is_number(growth_factor) and growth_factor > 1.0):
            raise ValueError(f"growth_factor must be a number > 1, got {growth_factor!r}")
        if not (is_number(backoff_factor) and 0 < backoff_factor < 1.0):
            raise ValueError(f"backoff_factor must be a number in (0, 1), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self._scale, self._enabled = float(init_scale), enabled
        self.growth_interval = growth_interval
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_tracker, self._found_inf_since_update = 0, False
        self._unscaled: dict[tuple[int, int], bool] = {}

    def is_enabled(self) -> bool:
        """Whether scaling is on.

        Returns:
            The ``enabled`` flag.
        """
        return self._enabled

    def get_scale(self) -> float:
        """The current scale factor.

        Returns:
            The scale factor (``1.0`` when disabled).
        """
        return self._scale if self._enabled else 1.0

    def scale(self, outputs: T) -> T:
        """Multiply a loss (or a list/tuple of them) by the scale factor.

        Args:
            outputs: A tensor or a list/tuple of tensors.

        Returns:
            The scaled tensor(s), same structure.

        Raises:
            TypeError: If ``outputs`` holds something other than tensors.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return outputs * torch.tensor(self._scale, dtype=torch.float32, device=outputs.device)  # type: ignore[return-value]
        if isinstance(outputs, list | tuple):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs must be a tensor or a list/tuple of tensors, got {outputs!r}")

    def unscale_(self, optimizer: DistributedOptimizer, context_id: int) -> bool:
        """Unscale on every owner the gradients ``optimizer.step(context_id)`` applies (before
        :func:`clip_grad_norm_`; once per step).

        Args:
            optimizer: The distributed optimizer.
            context_id: A distributed-autograd context id created in this process.

        Returns:
            Whether any owner found an inf/NaN.

        Raises:
            TypeError: If ``optimizer`` is not a :class:`DistributedOptimizer`.
            RuntimeError: If called twice for the same step.
        """
        check_optimizer(optimizer)
        key = (id(optimizer), context_id)
        if key in self._unscaled:
            raise RuntimeError(
                f"unscale_ was already called for context {context_id} since the last step"
            )
        found = self._enabled and any(
            f for f, _ in optimizer.stage_gradients(context_id, inv_scale=1.0 / self._scale)
        )
        self._unscaled[key] = found
        return found

    def step(self, optimizer: DistributedOptimizer, context_id: int) -> bool:
        """Step ``optimizer`` unless an owner found an inf/NaN, then all skip (a pass that only
        accumulates just steps: the gradients that get applied are checked).

        Args:
            optimizer: The distributed optimizer.
            context_id: A distributed-autograd context id created in this process.

        Returns:
            Whether the owners updated their parameters.

        Raises:
            TypeError: If ``optimizer`` is not a :class:`DistributedOptimizer`.
        """
        check_optimizer(optimizer)
        key = (id(optimizer), context_id)
        if not self._enabled or (not optimizer.next_step_applies and key not in self._unscaled):
            self._unscaled.pop(key, None)
            optimizer.step(context_id)
            return not self._enabled
        if key not in self._unscaled:
            self.unscale_(optimizer, context_id)
        if self._unscaled.pop(key):
            self._found_inf_since_update = True
            optimizer.skip(context_id)
            return False
        optimizer.step(context_id)
        return True

    def update(self, new_scale: float | None = None) -> None:
        """Back the scale off after an inf/NaN, or grow it after ``growth_interval`` clean steps.

        Args:
            new_scale: Set this scale instead (resets the growth tracker).

        Raises:
            ValueError: If ``new_scale`` is not a positive finite number.
        """
        if not self._enabled:
            return
        self._unscaled.clear()
        if new_scale is not None:
            if not (is_number(new_scale) and new_scale > 0 and math.isfinite(new_scale)):
                raise ValueError(f"new_scale must be a positive finite number, got {new_scale!r}")
            self._scale, self._growth_tracker = float(new_scale), 0
        elif self._found_inf_since_update:
            self._scale, self._growth_tracker = self._scale * self.backoff_factor, 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale, self._growth_tracker = self._scale * self.growth_factor, 0
        self._found_inf_since_update = False

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state.

        Returns:
            Its values under ``torch.amp.GradScaler``'s keys.
        """
        return {key: getattr(self, attr) for key, (attr, _) in _STATE.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Args:
            state_dict: A dict from :meth:`state_dict`.

        Raises:
            ValueError: If a key is missing.
        """
        if missing := set(_STATE) - set(state_dict):
            raise ValueError(f"state_dict is missing {sorted(missing)}")
        for key, (attr, kind) in _STATE.items():
            setattr(self, attr, kind(state_dict[key]))
