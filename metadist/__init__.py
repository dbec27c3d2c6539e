"""metadist: meta-learning and model-parallel PyTorch across processes with a few decorators.

A layer over ``torch.distributed.rpc`` and distributed autograd named after
``torchopt.distributed``. Data flows :mod:`~metadist.environment` → :mod:`~metadist.launch` →
:mod:`~metadist.world` → :mod:`~metadist.partition` → :mod:`~metadist.api`
(:mod:`~metadist.transport`, :mod:`~metadist.messages`, :mod:`~metadist.worker`) →
:mod:`~metadist.reduce` → :mod:`~metadist.link` → :mod:`~metadist.autograd` →
:mod:`~metadist.optim`.
"""

from __future__ import annotations

from metadist import autograd, optim, timeline
from metadist.api import (
    parallelize,
    parallelize_async,
    parallelize_sync,
    remote_async_call,
    remote_sync_call,
)
from metadist.environment import WorldInfo, default_worker_name_format
from metadist.errors import RemoteError
from metadist.launch import auto_init_rpc
from metadist.partition import DimPartitioner, Partitions, batch_partitioner, dim_partitioner
from metadist.reduce import PartitionResults, cat_reducer, mean_reducer, stack_reducer, sum_reducer
from metadist.transport import clear_module_cache, invalidate_module_cache
from metadist.world import (
    DEFAULT_TIMEOUT,
    barrier,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_worker_id,
    get_worker_name,
    get_worker_names,
    get_world_info,
    get_world_rank,
    get_world_size,
    not_on_rank,
    on_rank,
    rank_non_zero_only,
    rank_zero_only,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "DimPartitioner",
    "PartitionResults",
    "Partitions",
    "RemoteError",
    "WorldInfo",
    "auto_init_rpc",
    "autograd",
    "barrier",
    "batch_partitioner",
    "cat_reducer",
    "clear_module_cache",
    "default_worker_name_format",
    "dim_partitioner",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_worker_id",
    "get_worker_name",
    "get_worker_names",
    "get_world_info",
    "get_world_rank",
    "get_world_size",
    "invalidate_module_cache",
    "mean_reducer",
    "not_on_rank",
    "on_rank",
    "optim",
    "parallelize",
    "parallelize_async",
    "parallelize_sync",
    "rank_non_zero_only",
    "rank_zero_only",
    "remote_async_call",
    "remote_sync_call",
    "stack_reducer",
    "sum_reducer",
    "timeline",
]

# The rest of torchopt.distributed's namespace, so that `import metadist as todist` runs its
# programs: torch's rpc and distributed modules (for `todist.rpc.RRef(...)`), is_available and
# TensorDimensionPartitioner.
import torch.distributed as dist
import torch.distributed.rpc as rpc

from metadist.partition import TensorDimensionPartitioner


def is_available() -> bool:
    """Whether this torch has ``torch.distributed``, RPC and distributed autograd.

    Returns:
        ``True`` when all three are built in.

    Example:
        >>> import metadist
        >>> metadist.is_available()
        True
    """
    return bool(dist.is_available() and rpc.is_available() and autograd.is_available())


__all__ += ["TensorDimensionPartitioner", "is_available"]
