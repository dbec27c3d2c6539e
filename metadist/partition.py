"""Partitioners: called like the remote function, they return one ``(worker_id, args, kwargs)``
per partition; here a :class:`Partitions`, with each partition's batch size for the reducer."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
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
            call hands each to whichever listed worker frees up first; ``"balanced"``: static,
            with chunk sizes the partitioner chose from earlier calls' timings.
        observe: Called once the call has every result, with each partition's seconds from the
            call's start to its result, in partition order (``None``: nobody asks).
    """

    def __init__(
        self,
        items: Sequence[Partition] = (),
        sizes: Sequence[int] | None = None,
        schedule: str = "static",
        observe: Callable[[list[float]], None] | None = None,
    ) -> None:
        super().__init__(items)
        self.sizes: tuple[int, ...] | None = None if sizes is None else tuple(sizes)
        self.schedule = _check_schedule(schedule, "Partitions")
        self.observe = observe


SCHEDULES = ("static", "dynamic", "balanced")


def _check_schedule(schedule: Any, owner: str) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(
            f"{owner}: schedule must be 'static', 'dynamic' or 'balanced', got {schedule!r}"
        )
    return str(schedule)


#: How far one call's timing moves a worker's speed estimate: enough to follow a change within
#: a few calls, little enough that one descheduled call does not swing the split.
SMOOTHING = 0.3

#: Calls a worker sits out once it was found to cost more than it saves; then it gets its share
#: again, and keeps it if it now pays. Each trial that confirms the last doubles the wait before
#: the next, up to ``16 * REST`` calls, so that a settled split is rarely disturbed.
REST = 50

#: Calls each side of a trial (the workers as they are, then one worker fewer) that the median
#: time between calls compares; resting must be this much faster to win.
TRIAL, MARGIN = 5, 0.03


@dataclasses.dataclass
class Balance:
    """Each worker's measured speed, in items per second, and the chunk sizes that follow it.

    A chunk finishes at ``start + fixed cost + items / speed``; sizes proportional to the
    measured ``items / seconds`` make every chunk finish together, which is where the estimate
    stops moving: a worker that also pays messages gets fewer items than the caller. Only the
    time until each result is there is seen, not what the call costs afterwards (a backward
    request, say); so every ``REST`` calls the slowest worker sits out ``TRIAL`` calls, and
    it rests for ``REST`` calls if the time between calls drops by ``MARGIN`` without it. A
    worker whose single item still finishes last rests at once.
    """

    workers: tuple[int, ...] = ()
    speeds: tuple[float, ...] = ()
    resting: tuple[int, ...] = ()  # calls each worker still sits out
    periods: tuple[float, ...] = ()  # the last TRIAL times between calls, in the current setup
    last: float = 0.0  # when the previous call started
    since: int = 0  # calls since a worker last started or stopped resting
    trying: int = -1  # the worker sitting out a trial
    baseline: float = 0.0  # the median time between calls before that trial
    rest_for: int = REST  # calls the next rest lasts
    trial_every: int = REST  # calls between trials while every worker pays

    def sizes(self, n: int, workers: Sequence[int]) -> list[int]:
        """``n`` items in one chunk per worker (0 for one that rests), proportional to their
        speeds, at least one each otherwise (even sizes until every worker has been timed).
        Called once per call: it also counts the call, for rests and trials."""
        m = min(n, len(workers))
        if tuple(workers) != self.workers or m < len(workers):
            return split_sizes(n, m)
        self._tick()
        active = [i for i in range(m) if not self.resting[i]]
        self.resting = tuple(max(0, r - 1) for r in self.resting)
        total = sum(self.speeds[i] for i in active)
        ideal = [n * self.speeds[i] / total if i in active else 0.0 for i in range(m)]
        sizes = [max(1, round(x)) if i in active else 0 for i, x in enumerate(ideal)]
        # Rounding may leave the sum off by a few: move items where it errs most.
        while sum(sizes) > n:
            over = [i for i in active if sizes[i] > 1]
            sizes[max(over, key=lambda i: sizes[i] - ideal[i])] -= 1
        while sum(sizes) < n:
            sizes[min(active, key=lambda i: sizes[i] - ideal[i])] += 1
        return sizes

    def _tick(self) -> None:
        """A call starts: note the time since the last one, and start or end a trial."""
        now = time.perf_counter()
        if self.last:
            self.periods = (*self.periods, now - self.last)[-TRIAL:]
        self.last = now
        self.since += 1
        resting = list(self.resting)
        if self.trying >= 0:
            resting[self.trying] = 1  # this call too
            if self.since > TRIAL:  # TRIAL calls without it have been timed
                if statistics.median(self.periods) < self.baseline * (1.0 - MARGIN):
                    resting[self.trying] = self.rest_for
                    self.rest_for, self.trial_every = min(2 * self.rest_for, 16 * REST), REST
                else:
                    resting[self.trying] = 0
                    self.trial_every, self.rest_for = min(2 * self.trial_every, 16 * REST), REST
                self.trying, self.since, self.periods = -1, 0, ()
        else:
            active = [i for i, r in enumerate(resting) if not r]
            if self.since > self.trial_every and len(active) > 1 and len(self.periods) == TRIAL:
                self.baseline = statistics.median(self.periods)
                # The slowest; of equals the last (the caller is usually first, and has no
                # messages to save).
                self.trying = min(reversed(active), key=lambda i: self.speeds[i])
                resting[self.trying] = 1
                self.since, self.periods = 0, ()
            elif any(r == 1 for r in resting):
                # A rest ends with this call: try again once TRIAL calls with it are timed.
                self.since, self.periods = self.trial_every - TRIAL - 1, ()
        self.resting = tuple(resting)

    def observe(
        self, workers: tuple[int, ...], sizes: tuple[int, ...], seconds: list[float]
    ) -> None:
        """Fold one call's timings in: ``sizes[i]`` items on ``workers[i]`` took ``seconds[i]``
        (one entry per non-empty chunk, in order)."""
        ran = [i for i, k in enumerate(sizes) if k]
        if min(seconds) <= 0.0:
            return
        if workers != self.workers:  # a new set of workers: start from this call
            speeds = [1.0] * len(workers)
            for i, t in zip(ran, seconds, strict=True):
                speeds[i] = sizes[i] / t
            fresh = Balance(workers, tuple(speeds), (0,) * len(workers))
            for field in dataclasses.fields(self):
                setattr(self, field.name, getattr(fresh, field.name))
            return
        speeds, resting = list(self.speeds), list(self.resting)
        for j, (i, t) in enumerate(zip(ran, seconds, strict=True)):
            speeds[i] += SMOOTHING * (sizes[i] / t - speeds[i])
            others = seconds[:j] + seconds[j + 1 :]
            if sizes[i] == 1 and others and t > max(others) and i != self.trying:
                resting[i] = REST
                self.since, self.periods = 0, ()
        self.speeds, self.resting = tuple(speeds), tuple(resting)


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
    """Split every tensor leaf of the arguments along one dimension (see :func:`dim_partitioner`);
    picklable, so it can be sent to another worker (nested remote calls).

    Args:
        dim: The dimension to split every tensor leaf along.
        exclusive: One item per partition (round-robin) instead of one chunk per worker.
        keepdim: With ``exclusive=True``, ``False`` removes the split dimension.
        workers: Worker ranks or names to use, in order (default: all workers).
        schedule: ``"static"``, ``"dynamic"`` (needs ``exclusive=True``) or ``"balanced"``
            (needs ``exclusive=False``).

    Attributes:
        balance: What a balanced schedule has measured (:class:`Balance`); pickled along.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``keepdim=False`` or ``schedule="dynamic"`` without ``exclusive=True``,
            ``schedule="balanced"`` with it, or an empty ``workers``.
    """

    dim: int = 0
    _: dataclasses.KW_ONLY
    exclusive: bool = False
    keepdim: bool = True
    workers: Sequence[int | str] | None = None
    schedule: str = "static"
    balance: Balance = dataclasses.field(
        default_factory=Balance, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        dim, exclusive, keepdim, workers = self.dim, self.exclusive, self.keepdim, self.workers
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim_partitioner: dim must be an int, got {dim!r}")
        if not isinstance(exclusive, bool):
            raise TypeError(f"dim_partitioner: exclusive must be a bool, got {exclusive!r}")
        if not isinstance(keepdim, bool):
            raise TypeError(f"dim_partitioner: keepdim must be a bool, got {keepdim!r}")
        if not keepdim and not exclusive:
            raise ValueError(
                "dim_partitioner: keepdim=False removes the split dimension, which only makes "
                "sense with exclusive=True (one item per partition); got exclusive=False"
            )
        if workers is not None:
            if isinstance(workers, (str, int)) or not isinstance(workers, Sequence):
                raise TypeError(
                    f"dim_partitioner: workers must be a sequence of worker ids or names, got "
                    f"{workers!r}; wrap a single worker in a list"
                )
            self.workers = workers = tuple(workers)
            if not workers:
                raise ValueError("dim_partitioner: workers must not be empty")
            for worker in workers:
                if isinstance(worker, bool) or not isinstance(worker, (int, str)):
                    raise TypeError(
                        f"dim_partitioner: workers must hold int ranks or str names, got "
                        f"{worker!r} in {workers!r}"
                    )
        self.schedule = _check_schedule(self.schedule, "dim_partitioner")
        if self.schedule == "dynamic" and not exclusive:
            raise ValueError(
                "dim_partitioner: schedule='dynamic' hands out one item at a time, which needs "
                "exclusive=True (one item per partition); got exclusive=False"
            )
        if self.schedule == "balanced" and exclusive:
            raise ValueError(
                "dim_partitioner: schedule='balanced' sizes one chunk per worker, which needs "
                "exclusive=False; got exclusive=True (schedule='dynamic' balances single items)"
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
        """Partition ``args``/``kwargs`` over the configured workers (all workers by default)."""
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
        columns, sizes = self._columns(leaves, name, list(worker_ids))
        # A balanced split may leave a worker out (size 0): it gets no partition.
        ran = [i for i, k in enumerate(sizes) if k]
        parts = Partitions(sizes=[sizes[i] for i in ran], schedule=self.schedule)
        for j, i in enumerate(ran):
            parts.append((worker_ids[i % len(worker_ids)], *rebuild([c[j] for c in columns])))
        if self.schedule == "balanced" and len(sizes) == len(worker_ids) > 1:
            parts.observe = functools.partial(self.balance.observe, tuple(worker_ids), tuple(sizes))
        return parts

    def _columns(
        self, leaves: list[Any], name: Callable[[int], str], worker_ids: list[int]
    ) -> tuple[list[Sequence[Any]], list[int]]:
        """Each leaf's value in every partition (pieces, or replicated), and the partition sizes."""
        dims: list[int | None] = []
        batch, first = 0, -1  # the batch size, and the leaf that set it
        for index, leaf in enumerate(leaves):
            # Parameters are model state, not batch data: replicated like modules.
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, nn.Parameter):
                dims.append(None)
                continue
            ndim = leaf.dim()
            dim = self.dim + ndim if self.dim < 0 else self.dim
            if not 0 <= dim < ndim:
                raise ValueError(
                    f"dim_partitioner(dim={self.dim}): argument {name(index)} has shape "
                    f"{tuple(leaf.shape)}; dim {self.dim} is out of range for {ndim} dimension(s)"
                )
            if first < 0:
                batch, first = leaf.shape[dim], index
            elif leaf.shape[dim] != batch:
                raise ValueError(
                    f"dim_partitioner(dim={self.dim}): tensor arguments disagree on the batch "
                    f"size: {name(first)} has {batch} along dim {self.dim} but {name(index)} has "
                    f"{leaf.shape[dim]} (shape {tuple(leaf.shape)})"
                )
            dims.append(dim)
        if first < 0:
            raise ValueError(
                "dim_partitioner: the arguments hold no tensor to split (nn.Parameter leaves are "
                "replicated, not split); pass a worker id as partitioner to run on one worker"
            )
        if batch == 0:
            raise ValueError(
                f"dim_partitioner(dim={self.dim}): empty batch: {name(first)} has size 0 along "
                f"dim {self.dim}"
            )
        if self.exclusive:
            sizes = [1] * batch
        elif self.schedule == "balanced":
            sizes = self.balance.sizes(batch, worker_ids)
        else:
            sizes = split_sizes(batch, len(worker_ids))
        chunks = [k for k in sizes if k]
        columns = [
            [leaf] * len(chunks) if dim is None else self._pieces(leaf, dim, chunks)
            for leaf, dim in zip(leaves, dims, strict=True)
        ]
        return columns, sizes

    def _pieces(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> Sequence[torch.Tensor]:
        if not self.exclusive and len(sizes) == 1:
            # One worker gets the batch itself (a world of 1 then runs on the caller's tensors).
            return [tensor]
        # Pieces of a tensor that requires grad stay its views under the caller's no_grad too,
        # as the tensor itself is to a function that enables grad inside (an inner loop).
        # One view op per piece, not split's or unbind's one for all: torch refuses in-place
        # changes of views that one op returned together, and the caller's own piece takes
        # them as the whole tensor does.
        with torch.enable_grad():
            if self.exclusive and not self.keepdim:
                return [tensor.select(dim, i) for i in range(tensor.shape[dim])]
            starts = itertools.accumulate(sizes[:-1], initial=0)
            return [tensor.narrow(dim, i, k) for i, k in zip(starts, sizes, strict=True)]


def dim_partitioner(
    dim: int = 0,
    *,
    exclusive: bool = False,
    keepdim: bool = True,
    workers: Sequence[int | str] | None = None,
    schedule: str = "static",
) -> DimPartitioner:
    """Make a partitioner that splits every tensor leaf of the arguments along ``dim``; other
    leaves (numbers, modules, ``nn.Parameter``) are replicated to every partition.

    * ``exclusive=False``: one contiguous chunk per worker, sizes differing by at most 1, larger
      first; fewer items than workers give fewer partitions, never an empty one.
    * ``exclusive=True``: one item per partition, round-robin; ``keepdim=False`` removes the
      split dimension.
    * ``schedule="dynamic"`` (with ``exclusive=True``): a synchronous call hands each item to
      the next worker that frees up, for items of uneven cost. Results keep item order.
    * ``schedule="balanced"`` (with ``exclusive=False``): chunk sizes follow each worker's speed
      measured over earlier calls of the same partitioner (keep one per call site), so that the
      chunks finish together; a worker whose single item still finishes last sits out for a
      while. The split, and with it the rounding of a reduction, varies from call to call.

    Args:
        dim: The dimension to split (negative counts from the end).
        exclusive: One item per partition instead of one chunk per worker.
        keepdim: Keep the split dimension (size 1) in exclusive mode.
        workers: Worker ranks or names to use, in order; ``None`` means all workers.
        schedule: ``"static"`` (default), ``"dynamic"`` or ``"balanced"``.

    Returns:
        A picklable :class:`DimPartitioner`.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``keepdim=False`` or ``schedule="dynamic"`` without ``exclusive=True``,
            ``schedule="balanced"`` with it, or empty ``workers``.
    """
    return DimPartitioner(
        dim, exclusive=exclusive, keepdim=keepdim, workers=workers, schedule=schedule
    )


_BATCH = DimPartitioner(0)


def batch_partitioner(*args: Any, **kwargs: Any) -> Partitions:
    """Split every tensor argument along dim 0 over all workers: the default partitioner.

    Args:
        *args: Positional arguments of the remote function.
        **kwargs: Keyword arguments of the remote function.

    Returns:
        One balanced contiguous chunk per worker.

    Raises:
        ValueError: See :meth:`DimPartitioner.split`.
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

    Raises:
        ValueError: ``keepdim=False`` without ``exclusive=True`` (TorchOpt raises it too).

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
