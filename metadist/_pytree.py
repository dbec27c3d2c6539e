"""The one place metadist imports torch's pytree implementation.

torch 2.13 has no public pytree API; ``torch.utils._pytree`` is what ``torch.func`` itself uses,
so containers a user registers for ``torch.func`` (``register_pytree_node``,
``register_dataclass``) are split, sent and reduced by metadist too. If torch moves or renames
it, this module is the only one to mend.
"""

from __future__ import annotations

from torch.utils._pytree import (
    SUPPORTED_NODES,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_is_leaf,
    tree_unflatten,
)

__all__ = [
    "SUPPORTED_NODES",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_is_leaf",
    "tree_unflatten",
]
