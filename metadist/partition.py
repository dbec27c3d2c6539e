"""Partitioners: called like the remote function, they return one ``(worker_id, args, kwargs)``
per partition; here a :class:`Partitions`, with each partition's batch size for the reducer."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from metadist._pytree import argument_path, flatten_arguments, tree_flatten_with_path
from metadist.world import get_worker_id, get_world_size

__all__ = [
    "DimPartitioner",
    "Partition",
    "Partitions",
    "TensorDimensionPartitioner",
    "batch_partitioner",
    "dim_partitioner",
    "split_sizes",
]

#: One partition: the worker that runs it and the arguments it gets.
Partition = tuple[int, tuple[Any, ...], dict[str, Any]]


class Partitions(list[Partition]):
    """A list of ``(worker_id, args, kwargs)`` triples plus the batch size of each partition.

    Args:
        items: The ``(worker_id, args, kwargs)`` triples, in partition order.

    Attributes:
        sizes: Batch items per partition, or ``None``; :func:`metadist.mean_reducer` weights by it.
        schedule: ``"static"``: each partition runs on its worker; ``"dynamic"``: a synchronous
            call hands each to whichever listed worker frees up first.
    """

    def __init__(
        self,
        items: Sequence[Partition] = (),
        sizes: Sequence[int] | None = None,
        schedule: str = "static",
    ) -> None:
        super().__init__(items)
        self.sizes: tuple[int, ...] | None = None if sizes is None else tuple(sizes)
        self.schedule = _check_schedule(schedule, "Partitions")


def _check_schedule(schedule: Any, owner: str) -> str:
    if schedule not in ("static", "dynamic"):
        raise ValueError(f"{owner}: schedule must be 'static' or 'dynamic', got {schedule!r}")
    return str(schedule)


def split_sizes(n: int, k: int) -> list[int]:
    """Split ``n`` items into ``min(n, k)`` chunk sizes differing by at most 1, larger first
    (TorchOpt puts the whole remainder on the last worker); ``ValueError`` if ``n`` or ``k`` < 1."""
    if n < 1 or k < 1:
        raise ValueError(f"split_sizes needs n >= 1 and k >= 1, got n={n}, k={k}")
    m = min(n, k)
    base, extra = divmod(n, m)
    return [base + 1] * extra + [base] * (m - extra)


@dataclasses.dataclass(repr=False, unsafe_hash=True, slots=True)
class DimPartitioner:  # noqa: PLW1641 (unsafe_hash=True writes __hash__)
    """What :func:`dim_partitioner` makes, with its arguments and errors; picklable, so it can
    be sent to another worker (nested remote calls).

    Args:
        dim: The dimension to split every tensor leaf along.
        exclusive: One item per partition (round-robin) instead of one chunk per worker.
        keepdim: ``False`` removes the split dimension (needs ``exclusive=True``).
        workers: Worker ranks or names to use, in order (default: all workers).
        schedule: ``"static"`` or ``"dynamic"`` (needs ``exclusive=True``).
    """

    dim: int = 0
    _: dataclasses.KW_ONLY
    exclusive: bool = False
    keepdim: bool = True
    workers: Sequence[int | str] | None = None
    schedule: str = "static"

    def __post_init__(self) -> None:
        """Refuse bad fields, naming them; make ``workers`` a tuple."""
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim_partitioner: dim must be an int, got {self.dim!r}")
        if not isinstance(self.exclusive, bool):
            raise TypeError(f"dim_partitioner: exclusive must be a bool, got {self.exclusive!r}")
        if not isinstance(self.keepdim, bool):
            raise TypeError(f"dim_partitioner: keepdim must be a bool, got {self.keepdim!r}")
        if not self.keepdim and not self.exclusive:
            raise ValueError(
                "dim_partitioner: keepdim=False removes the split dimension, which only makes "
                "sense with exclusive=True (one item per partition); got exclusive=False"
            )
        if self.workers is not None:
            if isinstance(self.workers, (str, int)) or not isinstance(self.workers, Sequence):
                raise TypeError(
                    f"dim_partitioner: workers must be a sequence of worker ids or names, got "
                    f"{self.workers!r}; wrap a single worker in a list"
                )
            self.workers = tuple(self.workers)
            if not self.workers:
                raise ValueError("dim_partitioner: workers must not be empty")
            for worker in self.workers:
                if isinstance(worker, bool) or not isinstance(worker, (int, str)):
                    raise TypeError(
                        f"dim_partitioner: workers must hold int ranks or str names, got "
                        f"{worker!r} in {self.workers!r}"
                    )
        self.schedule = _check_schedule(self.schedule, "dim_partitioner")
        if self.schedule == "dynamic" and not self.exclusive:
            raise ValueError(
                "dim_partitioner: schedule='dynamic' hands out one item at a time, which needs "
                "exclusive=True (one item per partition); got exclusive=False"
            )

    def __repr__(self) -> str:
        return (
            f"dim_partitioner(dim={self.dim}, exclusive={self.exclusive}, "
            f"keepdim={self.keepdim}, workers={self.workers!r}, schedule={self.schedule!r})"
        )

    def __eq__(self, other: object) -> bool:
        # Equal to any DimPartitioner with the same fields, a TensorDimensionPartitioner too.
        if not isinstance(other, DimPartitioner):
            return NotImplemented
        fields = ("dim", "exclusive", "keepdim", "workers", "schedule")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def __call__(self, *args: Any, **kwargs: Any) -> Partitions:
        """Partition ``args``/``kwargs`` over the configured workers."""
        if self.workers is None:
            worker_ids: list[int] = list(range(get_world_size()))
        else:
            worker_ids = [self._worker_id(i, worker) for i, worker in enumerate(self.workers)]
        return self.split(args, kwargs, worker_ids=worker_ids)

    def _worker_id(self, index: int, worker: int | str) -> int:
        try:
            return get_worker_id(worker)
        except ValueError as err:
            # Name the entry here, keeping get_worker_id's message (the known workers) whole.
            raise ValueError(f"dim_partitioner: workers[{index}]={worker!r}: {err}") from None

    def split(
        self, args: Sequence[Any], kwargs: dict[str, Any], *, worker_ids: Sequence[int]
    ) -> Partitions:
        """Partition the arguments over explicit worker ids (no RPC needed).

        Args:
            args: Positional arguments of the remote function.
            kwargs: Keyword arguments of the remote function.
            worker_ids: Ranks to assign partitions to, in order.

        Returns:
            The partitions, with :attr:`Partitions.sizes`.

        Raises:
            ValueError: No tensor argument, an empty batch, ``dim`` out of range, or tensors
                whose sizes along ``dim`` differ (the message names the arguments).
        """
        if not worker_ids:
            raise ValueError("dim_partitioner: there must be at least one worker")
        args = tuple(args)

        def name(i: int) -> str:  # of leaf i, for messages only: key paths cost a flattening
            return argument_path(tree_flatten_with_path((args, dict(kwargs)))[0][i][0])

        leaves, rebuild = flatten_arguments(args, dict(kwargs))
        dims, batch = _batch_dims(leaves, self.dim, name)
        sizes = [1] * batch if self.exclusive else split_sizes(batch, len(worker_ids))
        if len(sizes) == 1 and not self.exclusive:
            # One partition gets the batch itself (a world of 1 runs on the caller's tensors).
            return Partitions([(worker_ids[0], args, dict(kwargs))], sizes, self.schedule)
        parts = Partitions(sizes=sizes, schedule=self.schedule)
        columns = [
            [leaf] * len(sizes) if dim is None else self._pieces(leaf, dim, sizes)
            for leaf, dim in zip(leaves, dims, strict=True)
        ]
        for i in range(len(sizes)):
            parts.append((worker_ids[i % len(worker_ids)], *rebuild([c[i] for c in columns])))
        return parts

    def _pieces(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> Sequence[torch.Tensor]:
        # Pieces stay views of a tensor that requires grad under the caller's no_grad too, as
        # the tensor is to a function that enables grad inside (an inner loop). One view op per
        # piece, not split's one for all: torch refuses in-place changes of views that one op
        # returned together, and the caller's own piece takes them as the whole tensor does.
        with torch.enable_grad():
            if self.exclusive and not self.keepdim:
                return [tensor.select(dim, i) for i in range(tensor.shape[dim])]
            starts = itertools.accumulate(sizes[:-1], initial=0)
            return [tensor.narrow(dim, i, k) for i, k in zip(starts, sizes, strict=True)]


def _batch_dims(
    leaves: list[Any], dim: int, name: Callable[[int], str]
) -> tuple[list[int | None], int]:
    """Each leaf's split dimension (``None``: replicated) and the batch size they agree on."""
    dims: list[int | None] = []
    batch, first = 0, -1  # the batch size, and the leaf that set it
    for index, leaf in enumerate(leaves):
        # Parameters are model state, not batch data: replicated like modules.
        if not isinstance(leaf, torch.Tensor) or isinstance(leaf, nn.Parameter):
            dims.append(None)
            continue
        ndim = leaf.dim()
        axis = dim + ndim if dim < 0 else dim
        if not 0 <= axis < ndim:
            raise ValueError(
                f"dim_partitioner(dim={dim}): argument {name(index)} has shape "
                f"{tuple(leaf.shape)}; dim {dim} is out of range for {ndim} dimension(s)"
            )
        if first < 0:
            batch, first = leaf.shape[axis], index
        elif leaf.shape[axis] != batch:
            raise ValueError(
                f"dim_partitioner(dim={dim}): tensor arguments disagree on the batch "
                f"size: {name(first)} has {batch} along dim {dim} but {name(index)} has "
                f"{leaf.shape[axis]} (shape {tuple(leaf.shape)})"
            )
        dims.append(axis)
    if first < 0:
        raise ValueError(
            "dim_partitioner: the arguments hold no tensor to split (nn.Parameter leaves are "
            "replicated, not split); pass a worker id as partitioner to run on one worker"
        )
    if batch == 0:
        raise ValueError(
            f"dim_partitioner(dim={dim}): empty batch: {name(first)} has size 0 along dim {dim}"
        )
    return dims, batch


def dim_partitioner(
    dim: int = 0,
    *,
    exclusive: bool = False,
    keepdim: bool = True,
    workers: Sequence[int | str] | None = None,
    schedule: str = "static",
) -> DimPartitioner:
    """Make a partitioner that splits every tensor leaf of the arguments along ``dim`` into one
    contiguous chunk per worker, sizes differing by at most 1, larger first (fewer items than
    workers give fewer partitions, never an empty one); other leaves (numbers, modules,
    ``nn.Parameter``) go to every partition whole.

    Args:
        dim: The dimension to split (negative counts from the end).
        exclusive: One item per partition, round-robin over the workers, instead of chunks.
        keepdim: ``False`` removes the split dimension (needs ``exclusive=True``).
        workers: Worker ranks or names to use, in order; ``None`` means all workers.
        schedule: ``"static"`` (default) or ``"dynamic"`` (needs ``exclusive=True``): a
            synchronous call hands each item to the next worker that frees up, for items of
            uneven cost. Results keep item order.

    Returns:
        A :class:`DimPartitioner`.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``keepdim=False`` or ``schedule="dynamic"`` without ``exclusive=True``, or
            empty ``workers``.
    """
    return DimPartitioner(
        dim, exclusive=exclusive, keepdim=keepdim, workers=workers, schedule=schedule
    )


_BATCH = DimPartitioner(0)


def batch_partitioner(*args: Any, **kwargs: Any) -> Partitions:
    """The default partitioner: ``dim_partitioner(0)`` (a function, as in TorchOpt).

    Args:
        *args: Positional arguments of the remote function.
        **kwargs: Keyword arguments of the remote function.

    Returns:
        One balanced contiguous chunk per worker.
    """
    return _BATCH(*args, **kwargs)


class TensorDimensionPartitioner(DimPartitioner):
    """:class:`DimPartitioner` under TorchOpt's name and defaults: ``dim`` is required and
    ``keepdim`` defaults to ``False`` (a non-exclusive one must pass ``keepdim=True``).

    Args:
        dim: The dimension to split every tensor leaf along.
        exclusive: One item per partition instead of one chunk per worker.
        keepdim: Keep the split dimension; ``False`` needs ``exclusive=True``.
        workers: Worker ranks or names to use, in order (default: all workers).

    Example:
        >>> import torch
        >>> part = TensorDimensionPartitioner(0, exclusive=True)  # keepdim=False
        >>> [args[0].shape for _, args, _ in part.split((torch.zeros(2, 3),), {}, worker_ids=[0])]
        [torch.Size([3]), torch.Size([3])]
    """

    __slots__ = ()

    def __init__(
        self,
        dim: int,
        *,
        exclusive: bool = False,
        keepdim: bool = False,
        workers: Sequence[int | str] | None = None,
    ) -> None:
        super().__init__(dim, exclusive=exclusive, keepdim=keepdim, workers=workers)
