"""Optimizers for metadist: functional ones (:class:`FunctionalSGD`, ..., :class:`FunctionalQHM`),
eager or scripted, and :class:`DistributedOptimizer`, which steps parameters on their owners, with
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
from metadist.optim.scripting import ScriptedFunctionalOptimizer, script_functional_optimizer

__all__ = ["DistributedGradScaler", "DistributedOptimizer", "FunctionalAdadelta"]
__all__ += ["FunctionalAdagrad", "FunctionalAdam", "FunctionalAdamW", "FunctionalAdamax"]
__all__ += ["FunctionalQHM", "FunctionalRMSprop", "FunctionalRprop", "FunctionalSGD", "QHM"]
__all__ += ["ScriptedFunctionalOptimizer", "clip_grad_norm_", "get_functional_optimizer", "qhm"]
__all__ += ["register_functional_optimizer", "script_functional_optimizer"]
