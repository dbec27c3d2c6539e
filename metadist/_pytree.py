"""The one place metadist imports torch's pytree implementation.

torch 2.13 has no public pytree API; ``torch.utils._pytree`` is what ``torch.func`` itself uses,
so containers a user registers for ``torch.func`` (``register_pytree_node``,
``register_dataclass``) are split, sent and reduced by metadist too. If torch moves or renames
it, this module is the only one to mend.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import (
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_is_leaf,
    tree_unflatten,
)

__all__ = [
    "argument_path",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_is_leaf",
    "tree_unflatten",
]


def argument_path(path: tuple[Any, ...]) -> str:
    """Name a leaf of the pair ``(args, kwargs)`` by its path, as a user would write it.

    Example:
        >>> pairs, _ = tree_flatten_with_path(((1, {"x": 2}), {"lr": 3}))
        >>> [argument_path(path) for path, _ in pairs]
        ['args[0]', "args[1]['x']", "kwargs['lr']"]
    """
    # The first key says which half of the pair the leaf is in.
    return ("args" if getattr(path[0], "idx", 0) == 0 else "kwargs") + keystr(path[1:])
