"""The one place metadist imports torch's pytree (no public API in torch 2.13): the one
``torch.func`` uses, so containers registered for ``torch.func`` work in metadist too."""

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
    """Name a leaf of the pair ``(args, kwargs)`` by its path, e.g. ``args[1]['x']``."""
    return ("args" if getattr(path[0], "idx", 0) == 0 else "kwargs") + keystr(path[1:])
