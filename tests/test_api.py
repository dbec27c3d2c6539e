"""The remote-call API: remote_async_call / remote_sync_call / parallelize, over real worlds.

The bad-input table: every bad call (arguments, partitioners, reducers, autograd contexts) fails
before any request, naming the argument (see _bad_input). Then one world of 3 runs the calls
themselves: partitions balanced and in order, reducers, worker partitioners, futures and
decorators, remote errors keeping their type, worker and traceback, timeouts, the in-process
partition, nested fan-out wider than the RPC thread pool, the dynamic schedule and progress bars.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _bad_input import Row, double, table_test
from _dist import Scenarios, run_scenarios
from torch import nn

import metadist as md
import metadist.autograd as mag
from metadist import autograd as md_autograd
from metadist.api import parallelize, parallelize_async, remote_async_call, remote_sync_call
from metadist.errors import RemoteError
from metadist.partition import Partitions, dim_partitioner
from metadist.reduce import PartitionResults, cat_reducer, mean_reducer, sum_reducer
from metadist.world import get_worker_name


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
        "generator argument",
        lambda fx: _call(fx, args=((t for t in [fx.batch]),), partitioner=1),
        TypeError,
        r"args\[0\] \(generator\) cannot be sent.*list\(",
    ),
    Row(
        "generator argument in-process",
        lambda fx: _call(fx, args=((t for t in [fx.batch]),), partitioner=0),
        TypeError,
        r"args\[0\] \(generator\) cannot be sent",
    ),
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
    # torch holds whole milliseconds in 32 bits: less than one would mean no limit, more than
    # 24.8 days an expired one.
    Row("timeout under 1 ms", lambda fx: _call(fx, timeout=0.0004), ValueError, r"between 0.001"),
    Row("timeout past 32 bits", lambda fx: _call(fx, timeout=3e6), ValueError, r"got 3000000"),
    Row("timeout inf", lambda fx: _call(fx, timeout=math.inf), ValueError, r"got inf"),
    Row("timeout nan", lambda fx: _call(fx, timeout=math.nan), ValueError, r"got nan"),
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


# ---------------------------------------------------------------------------------------------
# Calls in a world of 3: partitions, reducers, decorators, futures, errors, timeouts, schedules


def describe(x: torch.Tensor, tag: str) -> tuple[str, list[int], str]:
    return get_worker_name(), x.tolist(), tag


def partition_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(0)


def loss_and_metrics(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    return x.sum(), {"count": float(x.numel()), "max": x.max()}


class TwoArgError(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


def fail_on_second(x: torch.Tensor) -> torch.Tensor:
    if get_worker_name() == "worker1":
        raise ValueError(f"bad batch of {x.numel()}")
    return x


def fail_custom(x: torch.Tensor) -> torch.Tensor:
    raise TwoArgError(1, 2)


def sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@parallelize(partitioner=dim_partitioner(0), reducer=mean_reducer)
def decorated_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(0)


@parallelize_async(partitioner="worker2")
def decorated_async(x: torch.Tensor) -> str:
    return f"{get_worker_name()}:{x.numel()}"


def partitions_are_balanced_and_in_order(world_size: int) -> None:
    x = torch.arange(10.0)
    # Uneven batch over 3 workers: balanced chunks, partition order, replicated non-tensors.
    results = remote_sync_call(describe, args=(x, "t"), partitioner=dim_partitioner(0))
    assert [r[0] for r in results] == ["worker0", "worker1", "worker2"]
    assert [r[1] for r in results] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(r[2] == "t" for r in results)
    # Default partitioner is the batch partitioner.
    assert [len(r[1]) for r in remote_sync_call(describe, args=(x, "t"))] == [4, 3, 3]


def reducers_exclusive_and_pytree_results(world_size: int) -> None:
    x = torch.arange(10.0)
    # The mean of partition means over an uneven split is the full-batch mean.
    data = torch.randn(10, 3)
    mean = remote_sync_call(partition_mean, args=(data,), reducer=mean_reducer)
    torch.testing.assert_close(mean, data.mean(0))
    # Exclusive, keepdim=False: one item per partition, round-robin, dim removed.
    grid = torch.arange(10.0).reshape(5, 2)
    results = remote_sync_call(
        describe,
        args=(grid,),
        kwargs={"tag": "e"},
        partitioner=dim_partitioner(0, exclusive=True, keepdim=False),
    )
    assert [r[0] for r in results] == ["worker0", "worker1", "worker2", "worker0", "worker1"]
    assert [r[1] for r in results] == grid.tolist()
    # Pytree results reduce leaf-wise.
    loss, metrics = remote_sync_call(loss_and_metrics, args=(x,), reducer=mean_reducer)
    torch.testing.assert_close(loss, (x[:4].sum() * 4 + x[4:7].sum() * 3 + x[7:].sum() * 3) / 10)
    assert metrics["count"] == pytest.approx((4 * 4 + 3 * 3 + 3 * 3) / 10)
    total = remote_sync_call(loss_and_metrics, args=(x,), reducer=sum_reducer)
    assert total[0].item() == 45.0


def worker_partitioners_futures_and_decorators(world_size: int) -> None:
    x = torch.arange(10.0)
    data = torch.randn(10, 3)
    # Worker id / name partitioners: one partition, a list of one result.
    assert remote_sync_call(describe, args=(x[:2], "a"), partitioner=2)[0][0] == "worker2"
    assert remote_sync_call(describe, args=(x[:2], "a"), partitioner="worker1")[0][0] == "worker1"

    # Futures: several calls in flight at once.
    futures = [remote_async_call(sleepy, args=(0.2,), partitioner=w) for w in (0, 1, 2, 1)]
    start = time.monotonic()
    assert [f.wait() for f in futures] == [[0.2]] * 4
    assert time.monotonic() - start < 5.0

    # Decorators.
    torch.testing.assert_close(decorated_mean(data), data.mean(0))
    assert decorated_async(x).wait() == ["worker2:10"]


def remote_exceptions_keep_type_worker_and_traceback(world_size: int) -> None:
    x = torch.arange(10.0)
    # A remote exception comes back with its type, the worker, the partition and the traceback.
    with pytest.raises(ValueError, match="bad batch of 3") as info:
        remote_sync_call(fail_on_second, args=(x,))
    message = str(info.value)
    assert "worker1" in message
    assert "partition 1 of 3" in message
    assert "Traceback" in message
    assert "fail_on_second" in message
    assert info.value.worker_name == "worker1"  # type: ignore[attr-defined]
    # A type that cannot be rebuilt from a message becomes RemoteError.
    with pytest.raises(RemoteError, match="TwoArgError") as remote:
        remote_sync_call(fail_custom, args=(x,), partitioner=1)
    assert remote.value.partition_index == 0
    assert "1/2" in str(remote.value)
    # Nothing is left pending: the next call works immediately.
    assert remote_sync_call(describe, args=(x[:1], "ok"), partitioner=1)[0][2] == "ok"


def exits(code: int) -> None:
    sys.exit(code)


def a_remote_exit_is_a_remote_failure(world_size: int) -> None:
    # sys.exit in the function is the function's failure: reported with the worker's name and
    # traceback, and the worker serves on (raised out of the handler, it killed the worker).
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"raised SystemExit\(3\)") as raised:
            remote_sync_call(exits, args=(3,), partitioner=2)
        assert "worker2" in str(raised.value)
        assert "sys.exit(code)" in str(raised.value)
    assert remote_sync_call(sleepy, args=(0.0,), partitioner=2) == [0.0]


def timeouts_name_the_worker(world_size: int) -> None:
    # Timeout: raised as TimeoutError naming the worker, well before the sleep ends.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="worker2"):
        remote_sync_call(sleepy, args=(5.0,), partitioner=2, timeout=0.5)
    assert time.monotonic() - start < 4.0
    assert remote_sync_call(sleepy, args=(0.0,), partitioner=2, timeout=None) == [0.0]


def bad_input_fails_before_sending(world_size: int) -> None:
    x = torch.arange(10.0)
    # Bad input fails before sending, naming the argument.
    with pytest.raises(TypeError, match=r"lambda.*module level"):
        remote_sync_call(lambda t: t, args=(x,), partitioner=0)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t

    with pytest.raises(TypeError, match="local function"):
        remote_sync_call(local, args=(x,), partitioner=0)
    with pytest.raises(TypeError, match="local function"):
        parallelize()(local)
    with pytest.raises(TypeError, match="reducer must be callable"):
        remote_sync_call(describe, args=(x, "t"), reducer=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown worker"):
        remote_sync_call(describe, args=(x, "t"), partitioner=7)
    with pytest.raises(ValueError, match="unknown worker name 'nobody'"):
        remote_sync_call(describe, args=(x, "t"), partitioner="nobody")
    with pytest.raises(TypeError, match="malformed partition 0"):
        remote_sync_call(describe, args=(x, "t"), partitioner=bad_partitioner)
    with pytest.raises(ValueError, match=r"kwargs\['tag'\]"):
        remote_sync_call(describe, args=(x,), kwargs={"tag": torch.zeros(3)})
    with pytest.raises(ValueError, match="compression"):
        remote_sync_call(describe, args=(x, "t"), compression="int8")
    with pytest.raises(ValueError, match="timeout"):
        remote_sync_call(describe, args=(x, "t"), timeout=-3)


def bad_partitioner(*args: Any, **kwargs: Any) -> list[Any]:
    return [(0, args)]


def slow(x: torch.Tensor) -> torch.Tensor:
    time.sleep(3.0)
    return x


def fail_on_rank(x: torch.Tensor) -> torch.Tensor:
    raise ValueError(f"bad chunk of {len(x)} on {md.get_worker_name()}")


THREADS: list[int] = []


def record_thread(x: torch.Tensor) -> torch.Tensor:
    THREADS.append(threading.get_ident())
    return x + 1


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def mid(x: torch.Tensor) -> torch.Tensor:
    return md.remote_sync_call(leaf, args=(x,), partitioner=3 - md.get_rank(), timeout=10)[0]


def uneven_task(model: nn.Module, x: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A task whose cost grows with ``steps`` (inner steps of different lengths)."""
    h = x
    for _ in range(int(steps.item())):
        h = torch.tanh(model(h))
    return h.pow(2).mean()


def fail_on_task_three(x: torch.Tensor) -> torch.Tensor:
    if int(x.item()) == 3:
        raise KeyError(f"task {int(x.item())} on {md.get_worker_name()}")
    return x


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a - b).norm() / b.norm().clamp_min(1e-12))
    assert err <= 1e-5, f"{what}: relative error {err:.2e}\nremote {a}\nlocal  {b}"


def own_partition_runs_in_process(world_size: int) -> None:
    THREADS.clear()
    out = md.remote_sync_call(record_thread, args=(torch.zeros(2),), partitioner=0)
    assert [threading.get_ident()] == THREADS, "the caller's partition left this thread"
    assert torch.equal(out[0], torch.ones(2))


def local_and_remote_errors_look_alike(world_size: int) -> None:
    with pytest.raises(ValueError, match=r"bad chunk of 2 on worker0") as info:
        md.remote_sync_call(fail_on_rank, args=(torch.ones(6),))
    error = info.value
    assert error.partition_index == 0  # type: ignore[attr-defined]
    assert error.worker_name == "worker0"  # type: ignore[attr-defined]
    assert "partition 0 of 3" in str(error)
    assert "Remote traceback" in str(error)
    notes = "".join(getattr(error, "__notes__", []))
    assert "partition 1 (ValueError), partition 2 (ValueError)" in notes, notes


def timeouts_name_their_partition(world_size: int) -> None:
    workers = md.dim_partitioner(0, workers=[1, 2])
    with pytest.raises(TimeoutError) as info:
        md.remote_sync_call(slow, args=(torch.ones(3),), partitioner=workers, timeout=0.5)
    assert info.value.partition_index == 0  # type: ignore[attr-defined]
    assert info.value.worker_name == "worker1"  # type: ignore[attr-defined]
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "partition 1 (TimeoutError)" in notes, notes


def nested_fan_out_ten_times_the_pool(world_size: int) -> None:
    x = torch.arange(160.0)  # 80 tasks per worker, 5x its 16 RPC threads, each nesting a call
    workers = md.dim_partitioner(0, exclusive=True, workers=[1, 2])
    out = md.remote_sync_call(
        mid, args=(x,), partitioner=workers, reducer=md.cat_reducer, timeout=60
    )
    assert torch.equal(out, x * 2)


def dynamic_schedule_equals_static(world_size: int) -> None:
    torch.manual_seed(4)
    model = nn.Linear(8, 8)
    x = torch.randn(12, 4, 8)
    steps = torch.tensor([1, 8, 1, 1, 8, 2, 1, 8, 1, 3, 1, 1])
    for in_context in (False, True):
        results = {}
        for schedule in ("static", "dynamic"):
            model.zero_grad()
            part = md.dim_partitioner(0, exclusive=True, schedule=schedule)
            with mag.context() if in_context else contextlib.nullcontext() as ctx:
                loss = md.remote_sync_call(
                    uneven_task, args=(model, x, steps), partitioner=part, reducer=md.mean_reducer
                )
                if ctx is None:
                    loss.backward()
                else:
                    mag.backward(ctx, [loss])
            results[schedule] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        # reduced in task order: the same bits
        assert torch.equal(results["static"][0], results["dynamic"][0]), in_context
        for a, b in zip(results["static"][1], results["dynamic"][1], strict=True):
            assert_close(a, b, "gradient")  # summed in another order: equal up to rounding


def dynamic_schedule_errors_name_task_and_worker(world_size: int) -> None:
    part = md.dim_partitioner(0, exclusive=True, schedule="dynamic")
    with pytest.raises(KeyError, match=r"task 3 on worker") as info:
        md.remote_sync_call(fail_on_task_three, args=(torch.arange(6.0),), partitioner=part)
    assert info.value.partition_index == 3  # type: ignore[attr-defined]
    assert info.value.worker_name in str(info.value)  # type: ignore[attr-defined]
    # timeouts name the item and its worker too
    slow_part = md.dim_partitioner(0, exclusive=True, workers=[1, 2], schedule="dynamic")
    with pytest.raises(TimeoutError) as late:
        md.remote_sync_call(slow, args=(torch.ones(2, 1),), partitioner=slow_part, timeout=0.5)
    assert late.value.partition_index in (0, 1)  # type: ignore[attr-defined]
    assert late.value.worker_name in ("worker1", "worker2")  # type: ignore[attr-defined]
    # nested calls inside dynamically scheduled items
    nested = md.dim_partitioner(0, exclusive=True, workers=[1, 2], schedule="dynamic")
    out = md.remote_sync_call(
        mid, args=(torch.arange(20.0),), partitioner=nested, reducer=md.cat_reducer
    )
    assert torch.equal(out, torch.arange(20.0) * 2)
    # asynchronous calls keep the static assignment (and work)
    fut = md.remote_async_call(
        leaf, args=(torch.arange(6.0),), partitioner=part, reducer=md.cat_reducer
    )
    assert torch.equal(fut.wait(), torch.arange(6.0) * 2)


def openmp_threads() -> int:
    """OpenMP's team size for parallel regions started on the calling thread."""
    gomp = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libgomp.so.1"))
    return int(gomp.omp_get_max_threads())


def openmp_threads_of_a_new_thread() -> int:
    found: list[int] = []
    thread = threading.Thread(target=lambda: found.append(openmp_threads()))
    thread.start()
    thread.join()
    return found[0]


def partitions_use_the_process_thread_count(world_size: int) -> None:
    # The world's processes run torch.set_num_threads(1) but start without OMP_NUM_THREADS, as
    # under srun or mp.spawn: a thread torch did not start gets OpenMP's default team (a thread
    # per core) ...
    (default,) = md.remote_sync_call(openmp_threads_of_a_new_thread, partitioner=1)
    assert default == (os.cpu_count() or 1), default
    # ... but a partition runs with the process's thread count, whichever handler thread
    # takes it.
    counts = [md.remote_sync_call(openmp_threads, partitioner=1)[0] for _ in range(40)]
    assert set(counts) == {torch.get_num_threads()} == {1}, counts


def leaf_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (w * x).tanh().sum(-1)


class _ByX:
    """Split ``x`` only (``w`` goes to every partition whole)."""

    def __init__(self, split: Any) -> None:
        self.split = split

    def __call__(self, w: torch.Tensor, x: torch.Tensor) -> list[tuple[Any, Any, Any]]:
        return [(worker, (w, *a), k) for worker, a, k in self.split(x)]


def parallelize_draws_progress(world_size: int) -> None:
    bar = io.StringIO()
    stdout, stderr = sys.stdout, sys.stderr
    tty = type("Tty", (io.StringIO,), {"isatty": lambda self: True})()
    sys.stdout, sys.stderr = tty, bar
    try:
        split = _ByX(md.dim_partitioner(0, exclusive=True))
        md.parallelize(split, reducer=md.cat_reducer, progress=True)(leaf_loss)(
            torch.ones(3), torch.ones(6, 3)
        )
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    assert "6/6" in bar.getvalue(), bar.getvalue()


SCENARIOS: list[Callable[[int], Any]] = [
    partitions_are_balanced_and_in_order,
    reducers_exclusive_and_pytree_results,
    worker_partitioners_futures_and_decorators,
    remote_exceptions_keep_type_worker_and_traceback,
    timeouts_name_the_worker,
    a_remote_exit_is_a_remote_failure,
    bad_input_fails_before_sending,
    own_partition_runs_in_process,
    local_and_remote_errors_look_alike,
    timeouts_name_their_partition,
    nested_fan_out_ten_times_the_pool,
    dynamic_schedule_equals_static,
    dynamic_schedule_errors_name_task_and_worker,
    partitions_use_the_process_thread_count,
    parallelize_draws_progress,
]


@pytest.fixture(scope="module")
def world() -> Scenarios:
    return run_scenarios(SCENARIOS, 3, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s.__name__ for s in SCENARIOS])
def test_remote_calls(world: Scenarios, name: str) -> None:
    world.check(name)
