"""Reducers: ``reducer(results) -> value`` over the partition results in partition order (a
:class:`PartitionResults`). These reduce pytrees (a tuple, a dict) leaf by leaf, and raise
``ValueError`` for no results or results of different structures or shapes."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from metadist._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

__all__ = ["PartitionResults", "cat_reducer", "mean_reducer", "stack_reducer", "sum_reducer"]


class PartitionResults(list[Any]):
    """The per-partition results handed to a reducer, with the partition sizes if known.

    Args:
        items: The per-partition results, in partition order.

    Attributes:
        sizes: Batch items per partition, or ``None`` when unknown; checked (``TypeError``,
            ``ValueError``): wrong sizes would silently skew a weighted mean.
    """

    def __init__(self, items: Sequence[Any] = (), sizes: Sequence[int] | None = None) -> None:
        super().__init__(items)
        self.sizes = (
            None if sizes is None else check_sizes(sizes, len(self), "PartitionResults: sizes")
        )


def check_sizes(sizes: Any, count: int, name: str, noun: str = "result") -> tuple[int, ...]:
    """``sizes`` as ``count`` positive ints, else an error naming ``name``."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints or None, got {sizes!r}")
    try:  # numpy and 0-dim tensor integers are fine, floats and bools are not
        checked = tuple(_as_size(s) for s in sizes)
    except TypeError:
        raise TypeError(f"{name} must hold ints, got {sizes!r}") from None
    if len(checked) != count:
        raise ValueError(f"{name}={checked!r} must give one size per {noun} ({count} {noun}s)")
    if any(s < 1 for s in checked):
        raise ValueError(f"{name}={checked!r} must all be >= 1")
    return checked


def _leafwise(
    results: Sequence[Any], name: str, combine: Callable[[list[Any], Callable[[], str]], Any]
) -> Any:
    if not isinstance(results, Sequence) or isinstance(results, (str, bytes)):
        raise TypeError(f"{name}: results must be a list of partition results, got {results!r}")
    if len(results) == 0:
        raise ValueError(f"{name}: got no partition results to reduce")
    if all(isinstance(r, torch.Tensor) for r in results):  # fast path: one tensor per partition
        return combine(list(results), lambda: "result")
    flat = [tree_flatten(result) for result in results]
    spec = flat[0][1]
    for index, (_, other) in enumerate(flat):
        if other != spec:
            raise ValueError(
                f"{name}: partition {index} returned a result of a different structure than "
                f"partition 0: {other} vs {spec}"
            )
    columns = [list(column) for column in zip(*(leaves for leaves, _ in flat), strict=True)]

    def where(i: int) -> Callable[[], str]:
        # Named only on errors: computing key paths costs more than reducing small results.
        return lambda: "result" + keystr(tree_flatten_with_path(results[0])[0][i][0])

    reduced = [combine(column, where(i)) for i, column in enumerate(columns)]
    return tree_unflatten(reduced, spec)


def _as_size(size: Any) -> int:
    if isinstance(size, bool):
        raise TypeError("a bool is not a size")
    return operator.index(size)


def _stacked(values: list[Any], where: Callable[[], str], name: str) -> torch.Tensor | None:
    """The tensors of one leaf stacked, or ``None`` when the leaf holds numbers."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    if not all(isinstance(v, torch.Tensor) for v in values):
        types = sorted({type(v).__name__ for v in values})
        raise TypeError(f"{name}: {where()} must be all tensors or all numbers, got types {types}")
    try:
        return torch.stack(values)
    except RuntimeError as error:
        shapes = [tuple(v.shape) for v in values]
        raise ValueError(
            f"{name}: {where()} has different shapes across partitions: {shapes}"
        ) from error


def mean_reducer(results: Sequence[Any]) -> Any:
    """Average partition results leaf by leaf, weighted by partition size when known, so the mean
    of per-partition means over an uneven split is the full-batch mean (TorchOpt's is
    unweighted). Integer tensors are averaged in the default float dtype.

    Args:
        results: Partition results (all with the same pytree structure).

    Returns:
        The mean, with the structure of one result.

    Raises:
        TypeError: A leaf mixes tensors and numbers, or is neither (so for :func:`sum_reducer`).
    """
    sizes = getattr(results, "sizes", None)
    weights = None  # equal sizes: the unweighted mean
    if sizes is not None and len(sizes) == len(results) and len(set(sizes)) > 1:
        weights = tuple(sizes)
    total = sum(weights) if weights is not None else len(results)

    def combine(values: list[Any], where: Callable[[], str]) -> Any:
        one = values[0]
        if len(values) == 1 and isinstance(one, torch.Tensor) and one.is_floating_point():
            return one  # the mean of one partition is its result, exactly (a world of 1)
        stacked = _stacked(values, where, "mean_reducer")
        if stacked is None:
            return sum(values if weights is None else map(operator.mul, weights, values)) / total
        if not (stacked.is_floating_point() or stacked.is_complex()):
            stacked = stacked.to(torch.get_default_dtype())
        if weights is None:
            return stacked.mean(0)
        shape = (len(weights),) + (1,) * (stacked.dim() - 1)
        w = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device).reshape(shape)
        return (stacked * w).sum(0) / total

    return _leafwise(results, "mean_reducer", combine)


def sum_reducer(results: Sequence[Any]) -> Any:
    """Sum partition results leaf by leaf.

    Args:
        results: Partition results (all with the same pytree structure).

    Returns:
        The sum, with the structure of one result.
    """

    def combine(values: list[Any], where: Callable[[], str]) -> Any:
        stacked = _stacked(values, where, "sum_reducer")
        return sum(values) if stacked is None else stacked.sum(0)

    return _leafwise(results, "sum_reducer", combine)


def cat_reducer(results: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate partition results leaf by leaf along ``dim`` (undoes a chunked batch split);
    non-tensor leaves become lists. Pass ``functools.partial(cat_reducer, dim=1)`` for dim 1.

    Args:
        results: Partition results (all with the same pytree structure).
        dim: The dimension to concatenate along.

    Returns:
        The concatenation, with the structure of one result.
    """
    return _join(results, "cat_reducer", "concatenate", torch.cat, dim)


def stack_reducer(results: Sequence[Any], dim: int = 0) -> Any:
    """Stack partition results leaf by leaf along a new dimension ``dim``; non-tensor leaves
    become lists in partition order.

    Args:
        results: Partition results (all with the same pytree structure).
        dim: Where to insert the new dimension.

    Returns:
        The stacked results, with the structure of one result.
    """
    return _join(results, "stack_reducer", "stack", torch.stack, dim)


def _join(
    results: Sequence[Any],
    name: str,
    verb: str,
    op: Callable[[list[torch.Tensor], int], torch.Tensor],
    dim: int,
) -> Any:
    """Join tensor leaves across partitions with ``op``; collect other leaves into lists."""

    def combine(values: list[Any], where: Callable[[], str]) -> Any:
        if not all(isinstance(v, torch.Tensor) for v in values):
            return list(values)
        try:
            return op(values, dim)
        except (RuntimeError, IndexError) as error:
            shapes = [tuple(v.shape) for v in values]
            raise ValueError(
                f"{name}: cannot {verb} {where()} along dim {dim}: shapes {shapes}"
            ) from error

    return _leafwise(results, name, combine)
