"""Optimizers for metadist: functional ones (:class:`FunctionalSGD`, ..., :class:`FunctionalQHM`)
and :class:`DistributedOptimizer`, which steps parameters on their owners, with
:class:`DistributedGradScaler` and :func:`clip_grad_norm_` (``docs/optim.md``)."""

from __future__ import annotations

from metadist.optim.distributed import DistributedGradScaler, DistributedOptimizer, clip_grad_norm_
from metadist.optim.functional import (
    FunctionalAdadelta,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalAdamax,
    FunctionalAdamW,
    FunctionalQHM,
    FunctionalRMSprop,
    FunctionalRprop,
    FunctionalSGD,
    get_functional_optimizer,
    register_functional_optimizer,
)
from metadist.optim.qhm import QHM, qhm

__all__ = ["DistributedGradScaler", "DistributedOptimizer", "FunctionalAdadelta"]
__all__ += ["FunctionalAdagrad", "FunctionalAdam", "FunctionalAdamW", "FunctionalAdamax"]
__all__ += ["FunctionalQHM", "FunctionalRMSprop", "FunctionalRprop", "FunctionalSGD", "QHM"]
__all__ += ["clip_grad_norm_", "get_functional_optimizer", "qhm", "register_functional_optimizer"]
