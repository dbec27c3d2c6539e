"""The remote-call API: remote_async_call / remote_sync_call / parallelize arguments,
partitioners, reducers and distributed autograd.

So far the bad-input table (moved from test_bad_input.py): every bad call fails before any request,
naming the argument (see _bad_input).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from _bad_input import Row, double, table_test

from metadist import autograd as md_autograd
from metadist.api import parallelize, parallelize_async, remote_async_call, remote_sync_call
from metadist.partition import Partitions, dim_partitioner
from metadist.reduce import PartitionResults, cat_reducer, mean_reducer, sum_reducer


def _make_closure() -> Callable[[torch.Tensor], torch.Tensor]:
    scale = 3.0

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    return scaled


class _Unpicklable:
    """Holds a lock, so neither it nor its bound methods can be pickled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _exploding_reducer(results: list[Any]) -> Any:
    raise ZeroDivisionError(f"reducer exploded on {len(results)} results")


def _part_not_list(*args: Any, **kwargs: Any) -> Any:
    return (0, args, kwargs)  # one triple, not a list of triples


def _part_empty(*args: Any, **kwargs: Any) -> Any:
    return []


def _part_pair(*args: Any, **kwargs: Any) -> Any:
    return [(0, args)]


def _part_unknown_worker(*args: Any, **kwargs: Any) -> Any:
    return [(0, args, kwargs), ("ghost", args, kwargs)]


def _part_bad_args(*args: Any, **kwargs: Any) -> Any:
    return [(1, "x", kwargs)]


def _part_bad_kwargs(*args: Any, **kwargs: Any) -> Any:
    return [(1, args, [("k", 1)])]


def _part_bad_sizes(*args: Any, **kwargs: Any) -> Any:
    return Partitions([(1, args, kwargs), (2, args, kwargs)], sizes=(3,))


def _call(fx: SimpleNamespace, func: Any = double, **kwargs: Any) -> object:
    kwargs.setdefault("args", (fx.batch,))
    return remote_sync_call(func, **kwargs)


ROWS = [
    Row("func not callable", lambda fx: _call(fx, 42), TypeError, r"func must be callable"),
    Row("func lambda", lambda fx: _call(fx, lambda x: x), TypeError, r"<lambda>.*is a lambda"),
    Row(
        "func closure",
        lambda fx: _call(fx, _make_closure()),
        TypeError,
        r"scaled.*local function or closure",
    ),
    Row(
        "func bound method of unpicklable object",
        lambda fx: _call(fx, _Unpicklable().run),
        TypeError,
        r"run.*cannot be sent.*pickl",
    ),
    Row(
        "async func lambda",
        lambda fx: remote_async_call(lambda x: x, args=(fx.batch,)),
        TypeError,
        r"lambda",
    ),
    Row("args int", lambda fx: _call(fx, args=5), TypeError, r"args must be a tuple or list"),
    Row("kwargs list", lambda fx: _call(fx, kwargs=[1]), TypeError, r"kwargs must be a dict"),
    Row(
        "partitioner rank",
        lambda fx: _call(fx, partitioner=99),
        ValueError,
        r"partitioner=99: unknown worker id 99",
    ),
    Row(
        "partitioner -1",
        lambda fx: _call(fx, partitioner=-1),
        ValueError,
        r"partitioner=-1: .*worker id -1",
    ),
    Row(
        "partitioner name",
        lambda fx: _call(fx, partitioner="ghost"),
        ValueError,
        r"partitioner='ghost': .*worker name 'ghost'",
    ),
    Row("partitioner float", lambda fx: _call(fx, partitioner=1.5), TypeError, r"partitioner"),
    Row("partitioner bool", lambda fx: _call(fx, partitioner=True), TypeError, r"partitioner"),
    Row("reducer not callable", lambda fx: _call(fx, reducer="mean"), TypeError, r"reducer"),
    Row("timeout negative", lambda fx: _call(fx, timeout=-5), ValueError, r"timeout"),
    Row("timeout zero", lambda fx: _call(fx, timeout=0), ValueError, r"timeout"),
    Row("timeout str", lambda fx: _call(fx, timeout="10"), TypeError, r"timeout"),
    Row("compression", lambda fx: _call(fx, compression="int8"), ValueError, r"compression"),
    Row(
        "dim out of range",
        lambda fx: _call(fx, partitioner=dim_partitioner(2)),
        ValueError,
        r"dim_partitioner\(dim=2\).*args\[0\].*out of range",
    ),
    Row(
        "dim negative out of range",
        lambda fx: _call(fx, partitioner=dim_partitioner(-3)),
        ValueError,
        r"dim -3 is out of range",
    ),
    Row(
        "mismatched batch sizes",
        lambda fx: _call(fx, args=(fx.batch,), kwargs={"y": torch.ones(5, 2)}),
        ValueError,
        r"args\[0\] has 6 .*kwargs\['y'\] has 5",
    ),
    Row(
        "empty batch",
        lambda fx: _call(fx, args=(torch.ones(0, 2),)),
        ValueError,
        r"empty batch.*args\[0\]",
    ),
    Row(
        "empty batch along dim 1",
        lambda fx: _call(fx, args=(torch.ones(2, 0),), partitioner=dim_partitioner(1)),
        ValueError,
        r"empty batch",
    ),
    Row("no tensor to split", lambda fx: _call(fx, args=(3,)), ValueError, r"no tensor"),
    Row("dim_partitioner dim", lambda fx: dim_partitioner("0"), TypeError, r"dim must be an int"),
    Row(
        "dim_partitioner keepdim",
        lambda fx: dim_partitioner(0, keepdim=False),
        ValueError,
        r"keepdim=False",
    ),
    Row("dim_partitioner workers", lambda fx: dim_partitioner(workers=[]), ValueError, r"workers"),
    Row(
        "dim_partitioner workers str",
        lambda fx: dim_partitioner(workers="worker1"),
        TypeError,
        r"workers must be a sequence",
    ),
    Row(
        "dim_partitioner unknown worker",
        lambda fx: _call(fx, partitioner=dim_partitioner(workers=[1, "ghost"])),
        ValueError,
        r"worker name 'ghost'",
    ),
    Row(
        "partitioner returns a triple",
        lambda fx: _call(fx, partitioner=_part_not_list),
        TypeError,
        r"partitioner _part_not_list.*(list|triple)",
    ),
    Row(
        "partitioner returns nothing",
        lambda fx: _call(fx, partitioner=_part_empty),
        ValueError,
        r"partitioner _part_empty returned no partitions",
    ),
    Row(
        "partitioner returns a pair",
        lambda fx: _call(fx, partitioner=_part_pair),
        TypeError,
        r"partitioner _part_pair.*malformed partition 0.*triple",
    ),
    Row(
        "partitioner unknown worker",
        lambda fx: _call(fx, partitioner=_part_unknown_worker),
        ValueError,
        r"partitioner _part_unknown_worker, partition 1.*'ghost'",
    ),
    Row(
        "partitioner args str",
        lambda fx: _call(fx, partitioner=_part_bad_args),
        TypeError,
        r"partitioner _part_bad_args.*partition 0.*args must be a tuple",
    ),
    Row(
        "partitioner kwargs list",
        lambda fx: _call(fx, partitioner=_part_bad_kwargs),
        TypeError,
        r"partitioner _part_bad_kwargs.*partition 0.*kwargs a dict",
    ),
    Row(
        "partitioner sizes",
        lambda fx: _call(fx, partitioner=_part_bad_sizes),
        ValueError,
        r"_part_bad_sizes returned 2 partitions: Partitions.sizes=\(3,\) must give one size",
    ),
    # A reducer runs on the caller once every partition is back: requests did go out.
    Row(
        "reducer raises",
        lambda fx: _call(fx, reducer=_exploding_reducer),
        ZeroDivisionError,
        r"reducer exploded on 3 results",
        sends=True,
    ),
    Row(
        "async reducer raises",
        lambda fx: remote_async_call(double, args=(fx.batch,), reducer=_exploding_reducer).wait(),
        ZeroDivisionError,
        r"reducer exploded on 3 results",
        sends=True,
    ),
    Row(
        "parallelize lambda",
        lambda fx: parallelize()(lambda x: x),
        TypeError,
        r"lambda",
    ),
    Row("parallelize closure", lambda fx: parallelize()(_make_closure()), TypeError, r"closure"),
    Row(
        "parallelize_async partitioner",
        lambda fx: parallelize_async(partitioner=2.5),
        TypeError,
        r"partitioner",
    ),
    Row("parallelize reducer", lambda fx: parallelize(reducer=1), TypeError, r"reducer"),
    Row("parallelize timeout", lambda fx: parallelize(timeout=-2.5), ValueError, r"timeout"),
    Row(
        "parallelize compression",
        lambda fx: parallelize(compression="zip"),
        ValueError,
        r"compression",
    ),
    Row("mean_reducer empty", lambda fx: mean_reducer([]), ValueError, r"no partition results"),
    Row(
        "PartitionResults sizes count",
        lambda fx: PartitionResults([1.0, 3.0], sizes=(1,)),
        ValueError,
        r"sizes=\(1,\) must give one size per result \(2 results\)",
    ),
    Row(
        "PartitionResults sizes negative",
        lambda fx: PartitionResults([1.0, 3.0], sizes=(1, -5)),
        ValueError,
        r"sizes=\(1, -5\) must all be >= 1",
    ),
    Row(
        "PartitionResults sizes float",
        lambda fx: PartitionResults([1.0, 3.0], sizes=(1.0, 2.0)),
        TypeError,
        r"sizes must hold ints",
    ),
    Row("sum_reducer not list", lambda fx: sum_reducer(3), TypeError, r"results must be a list"),
    Row(
        "cat_reducer shapes",
        lambda fx: cat_reducer([torch.ones(2, 3), torch.ones(2, 4)]),
        ValueError,
        r"cat_reducer",
    ),
    Row(
        "mean_reducer kinds",
        lambda fx: mean_reducer([torch.ones(1), "x"]),
        TypeError,
        r"mean_reducer",
    ),
    # -- distributed autograd
    Row(
        "backward non-scalar",
        lambda fx: md_autograd.backward(fx.cid, fx.leaf * 2),
        ValueError,
        r"tensors\[0\] has shape \(3,\)",
    ),
    Row("backward empty", lambda fx: md_autograd.backward(fx.cid, []), ValueError, r"tensors"),
    Row(
        "backward not a tensor",
        lambda fx: md_autograd.backward(fx.cid, [1.0]),
        TypeError,
        r"tensors\[0\] must be a tensor",
    ),
    Row(
        "backward no grad",
        lambda fx: md_autograd.backward(fx.cid, torch.ones(())),
        RuntimeError,
        r"tensors\[0\] does not require grad",
    ),
    Row(
        "backward inputs non-leaf",
        lambda fx: md_autograd.backward(fx.cid, fx.leaf.sum(), inputs=[fx.leaf * 2]),
        ValueError,
        r"inputs\[0\] must be a leaf",
    ),
    Row(
        "grad outputs non-scalar",
        lambda fx: md_autograd.grad(fx.cid, fx.leaf * 2, fx.leaf),
        ValueError,
        r"outputs\[0\]",
    ),
    Row(
        "grad inputs not tensors",
        lambda fx: md_autograd.grad(fx.cid, fx.leaf.sum(), ["w"]),
        TypeError,
        r"inputs\[0\] must be a tensor",
    ),
    Row(
        "backward unknown context",
        lambda fx: md_autograd.backward(987654321, fx.leaf.sum()),
        ValueError,
        r"context.*987654321",
    ),
    Row(
        "grad unknown context",
        lambda fx: md_autograd.grad(987654321, fx.leaf.sum(), fx.leaf),
        ValueError,
        r"context.*987654321",
    ),
    Row(
        "get_gradients unknown context",
        lambda fx: md_autograd.get_gradients(987654321),
        ValueError,
        r"context.*987654321",
    ),
]


test_bad_call_fails_fast_and_names_the_argument = table_test(__name__, ROWS)
