"""metadist: meta-learning and model-parallel PyTorch across processes with a few decorators.

A layer over ``torch.distributed.rpc`` and distributed autograd whose names follow
``torchopt.distributed``, so switching is a change of import.
"""

from __future__ import annotations

from metadist import optim
from metadist.launch import auto_init_rpc, default_worker_name_format
from metadist.world import (
    WorldInfo,
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
    "WorldInfo",
    "auto_init_rpc",
    "barrier",
    "default_worker_name_format",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_worker_id",
    "get_worker_name",
    "get_worker_names",
    "get_world_info",
    "get_world_rank",
    "get_world_size",
    "not_on_rank",
    "on_rank",
    "optim",
    "rank_non_zero_only",
    "rank_zero_only",
]
