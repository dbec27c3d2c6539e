"""The one place metadist imports torch's pytree (no public API in torch 2.13): the one
``torch.func`` uses, so containers registered for ``torch.func`` work in metadist too."""

from __future__ import annotations

from collections.abc import Callable
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
    "flatten_arguments",
    "keystr",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_unflatten",
]


def argument_path(path: tuple[Any, ...]) -> str:
    """Name a leaf of the pair ``(args, kwargs)`` by its path, e.g. ``args[1]['x']``."""
    return ("args" if getattr(path[0], "idx", 0) == 0 else "kwargs") + keystr(path[1:])


Rebuild = Callable[[list[Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def flatten_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Rebuild]:
    """The leaves of ``(args, kwargs)`` in ``tree_flatten``'s order, and how to rebuild the
    pair from new leaves, without pytree's walk when no argument is a container (the common
    case). Containers are what ``tree_is_leaf`` says: a test on registered types would miss
    namedtuples, which pytree matches by shape."""
    if all(tree_is_leaf(a) for a in args) and all(tree_is_leaf(v) for v in kwargs.values()):
        count, keys = len(args), list(kwargs)

        def rebuild(leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return tuple(leaves[:count]), dict(zip(keys, leaves[count:], strict=True))

        return [*args, *kwargs.values()], rebuild
    leaves, spec = tree_flatten((args, kwargs))
    return leaves, lambda new: tree_unflatten(new, spec)
