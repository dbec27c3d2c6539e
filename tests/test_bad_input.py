"""Bad input to the public API: one table, run in one spawned world of 3 so remote rows are real.

Every row is a call, the exception type it must raise and a regex that must find the offending
argument's name in the message. Unless a row says otherwise, the call must also send nothing over
RPC: the check happens before the first request. ``SendCounter`` counts requests this process
hands to the RPC agent; it is first shown to count real ``rpc_sync``/``rpc_async``/``remote``
calls and a real ``DistributedOptimizer.step``, so a zero is meaningful.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
from _dist import run_world

import metadist
from metadist import autograd as md_autograd
from metadist.api import parallelize, parallelize_async, remote_async_call, remote_sync_call
from metadist.optim import (
    QHM,
    DistributedGradScaler,
    DistributedOptimizer,
    clip_grad_norm_,
    register_functional_optimizer,
)
from metadist.partition import Partitions, dim_partitioner
from metadist.reduce import PartitionResults, cat_reducer, mean_reducer, sum_reducer

# -- a counter of requests sent by this process -----------------------------------------------
#
# torch has no public per-process counter of sent RPC requests: the agent's get_metrics() only
# has gauges (agent.client_active_calls, ...), which are back to 0 once a call completes. Every
# rpc_sync / rpc_async / remote goes through one of these private module-level functions of
# torch.distributed.rpc.api (looked up at call time), so wrapping them counts every request no
# matter how the caller imported rpc. Private API: acceptable here, in a test only.
_ENTRY_POINTS = (
    "_invoke_rpc_builtin",
    "_invoke_rpc_python_udf",
    "_invoke_rpc_torchscript",
    "_invoke_remote_builtin",
    "_invoke_remote_python_udf",
    "_invoke_remote_torchscript",
)


class SendCounter:
    """Counts RPC requests (rpc_sync, rpc_async, remote) issued by this process."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        for name in _ENTRY_POINTS:
            setattr(rpc_api, name, self._wrap(getattr(rpc_api, name)))

    def _wrap(self, func: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.count += 1
            return func(*args, **kwargs)

        return counted


# -- module-level helpers the rows use ---------------------------------------------------------


def _make_param(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_(True)


def _square_sum(rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return rref.local_value().pow(2).sum()


def _double(x: Any) -> Any:
    return x * 2


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


# -- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One bad call: ``call(fx)`` must raise ``error`` with a message matching ``match``."""

    name: str
    call: Callable[[SimpleNamespace], object]
    error: type[BaseException]
    match: str
    sends: bool = False  # True where requests legitimately go out first (a reducer that raises)


WORLD_ROWS = [
    Row("get_worker_id float", lambda fx: metadist.get_worker_id(1.5), TypeError, r"worker id"),  # type: ignore[arg-type]
    Row("get_worker_id bool", lambda fx: metadist.get_worker_id(True), TypeError, r"worker id"),
    Row("get_worker_id rank", lambda fx: metadist.get_worker_id(3), ValueError, r"worker id 3"),
    Row("get_worker_id -1", lambda fx: metadist.get_worker_id(-1), ValueError, r"worker id -1"),
    Row(
        "get_worker_name name",
        lambda fx: metadist.get_worker_name("ghost"),
        ValueError,
        r"worker name 'ghost'.*known workers",
    ),
    Row("barrier str", lambda fx: metadist.barrier("worker0"), TypeError, r"worker_names.*list"),
    Row("barrier empty", lambda fx: metadist.barrier([]), ValueError, r"worker_names"),
    Row("barrier unknown", lambda fx: metadist.barrier([0, 7]), ValueError, r"worker id 7"),
    Row("barrier not self", lambda fx: metadist.barrier([1, 2]), ValueError, r"worker_names"),
    Row("barrier timeout", lambda fx: metadist.barrier(timeout=-1), ValueError, r"timeout"),
    Row(
        "barrier timeout str",
        lambda fx: metadist.barrier(timeout="x"),  # type: ignore[arg-type]
        TypeError,
        r"timeout.*'x'",
    ),
    Row(
        "on_rank not callable",
        lambda fx: metadist.on_rank(0)(3),  # type: ignore[arg-type]
        TypeError,
        r"on_rank: expected a function to decorate, got 3",
    ),
    Row(
        "rank_zero_only not callable",
        lambda fx: metadist.rank_zero_only("save"),  # type: ignore[arg-type]
        TypeError,
        r"rank_zero_only: expected a function.*'save'",
    ),
    Row("on_rank none", lambda fx: metadist.on_rank(), ValueError, r"on_rank.*rank"),
    Row("on_rank negative", lambda fx: metadist.on_rank(-1), ValueError, r"ranks.*-1"),
    Row(
        "auto_init_rpc init",
        lambda fx: metadist.auto_init_rpc(worker_init_fn=3),  # type: ignore[arg-type]
        TypeError,
        r"worker_init_fn",
    ),
    Row(
        "auto_init_rpc names",
        lambda fx: metadist.auto_init_rpc(worker_name_format="w{}"),  # type: ignore[arg-type]
        TypeError,
        r"worker_name_format",
    ),
]


def _opt(fx: SimpleNamespace, *args: Any, cls: type = torch.optim.SGD, **kwargs: Any) -> object:
    kwargs.setdefault("lr", 0.1)
    return DistributedOptimizer(cls, *args, **kwargs)


OPTIM_ROWS = [
    Row(
        "optimizer_class str",
        lambda fx: _opt(fx, fx.rrefs, cls="SGD"),
        TypeError,
        r"optimizer_class",
    ),  # type: ignore[arg-type]
    Row("params_rref one RRef", lambda fx: _opt(fx, fx.rrefs[0]), TypeError, r"params_rref"),
    Row("params_rref tensor", lambda fx: _opt(fx, torch.zeros(3)), TypeError, r"params_rref"),
    Row("params_rref empty", lambda fx: _opt(fx, []), ValueError, r"params_rref is empty"),
    # Parameter lists mixing owners incorrectly: a local tensor among RRefs, a nested list, the
    # same RRef twice, an RRef whose owner is another list entry's duplicate.
    Row(
        "params_rref local among remote",
        lambda fx: _opt(fx, [fx.rrefs[0], fx.local, fx.rrefs[1]]),
        TypeError,
        r"params_rref\[1\] must be an RRef",
    ),
    Row(
        "params_rref nested",
        lambda fx: _opt(fx, [fx.rrefs[:1], fx.rrefs[1]]),
        TypeError,
        r"params_rref\[0\] must be an RRef",
    ),
    Row(
        "params_rref duplicate",
        lambda fx: _opt(fx, [fx.rrefs[0], fx.rrefs[1], fx.rrefs[0]]),
        ValueError,
        r"params_rref\[2\] is listed twice",
    ),
    Row("lr negative", lambda fx: _opt(fx, fx.rrefs, lr=-1.0), ValueError, r"learning rate|lr"),
    Row("lr str", lambda fx: _opt(fx, fx.rrefs, lr="big"), ValueError, r"lr"),
    Row("unknown kwarg", lambda fx: _opt(fx, fx.rrefs, lrr=0.1), ValueError, r"lrr"),
    Row(
        "QHM nu",
        lambda fx: _opt(fx, fx.rrefs, cls=QHM, momentum=0.9, nu="x"),
        ValueError,
        r"nu",
    ),
    Row(
        "capturable",
        lambda fx: _opt(fx, fx.rrefs, cls=torch.optim.Adam, capturable=True),
        ValueError,
        r"capturable",
    ),
    Row("mode unknown", lambda fx: _opt(fx, fx.rrefs, mode="fast"), ValueError, r"mode.*'fast'"),
    Row("mode type", lambda fx: _opt(fx, fx.rrefs, mode=3), ValueError, r"mode"),
    Row(
        "mode value",
        lambda fx: _opt(fx, fx.rrefs, mode={"worker1": "turbo"}),
        ValueError,
        r"mode\['worker1'\].*'turbo'",
    ),
    Row(
        "mode unknown worker",
        lambda fx: _opt(fx, fx.rrefs, mode={"ghost": "eager"}),
        ValueError,
        r"mode.*'ghost'",
    ),
    Row(
        "backward_passes_per_step 0",
        lambda fx: _opt(fx, fx.rrefs, backward_passes_per_step=0),
        ValueError,
        r"backward_passes_per_step",
    ),
    Row(
        "backward_passes_per_step str",
        lambda fx: _opt(fx, fx.rrefs, backward_passes_per_step="2"),
        ValueError,
        r"backward_passes_per_step",
    ),
    Row("timeout 0", lambda fx: _opt(fx, fx.rrefs, timeout=0), ValueError, r"timeout"),
    Row("timeout inf", lambda fx: _opt(fx, fx.rrefs, timeout=float("inf")), ValueError, r"timeout"),
    Row(
        "step unknown context",
        lambda fx: fx.opt.step(987654321),
        ValueError,
        r"context_id 987654321",
    ),
    Row("step context str", lambda fx: fx.opt.step("1"), ValueError, r"context_id"),
    Row("step context None", lambda fx: fx.opt.step(None), ValueError, r"context_id"),
    Row("skip unknown context", lambda fx: fx.opt.skip(987654321), ValueError, r"context_id"),
    Row(
        "load_state_dict list",
        lambda fx: fx.opt.load_state_dict([]),
        ValueError,
        r"state_dict must be a dict",
    ),
    Row(
        "load_state_dict keys",
        lambda fx: fx.opt.load_state_dict({"state": {}}),
        ValueError,
        r"state_dict.*param_groups",
    ),
    Row(
        "load_state_dict size",
        lambda fx: fx.opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]}),
        ValueError,
        r"state_dict must have 1 param group over 2 parameters",
    ),
    Row(
        "load_state_dict index",
        lambda fx: fx.opt.load_state_dict({"state": {7: {}}, "param_groups": [{"params": [0, 1]}]}),
        ValueError,
        r"state_dict\['state'\].*7",
    ),
    Row(
        "add_param_group",
        lambda fx: fx.opt.add_param_group({"params": []}),
        NotImplementedError,
        r"param group",
    ),
    Row(
        "clip optimizer",
        lambda fx: clip_grad_norm_(torch.optim.SGD([fx.local], lr=0.1), fx.cid, 1.0),  # type: ignore[arg-type]
        TypeError,
        r"optimizer must be a metadist DistributedOptimizer",
    ),
    Row("clip max_norm", lambda fx: clip_grad_norm_(fx.opt, fx.cid, -1.0), ValueError, r"max_norm"),
    Row(
        "clip max_norm str",
        lambda fx: clip_grad_norm_(fx.opt, fx.cid, "1"),
        ValueError,
        r"max_norm",
    ),
    Row(
        "clip norm_type",
        lambda fx: clip_grad_norm_(fx.opt, fx.cid, 1.0, norm_type=0),
        ValueError,
        r"norm_type",
    ),
    Row(
        "clip unknown context",
        lambda fx: clip_grad_norm_(fx.opt, 987654321, 1.0),
        ValueError,
        r"context_id 987654321",
    ),
    Row(
        "scaler init_scale",
        lambda fx: DistributedGradScaler(init_scale=-1.0),
        ValueError,
        r"init_scale",
    ),
    Row(
        "scaler init_scale str",
        lambda fx: DistributedGradScaler(init_scale="big"),
        ValueError,
        r"init_scale",
    ),
    Row(
        "scaler growth_factor",
        lambda fx: DistributedGradScaler(growth_factor=1.0),
        ValueError,
        r"growth_factor",
    ),
    Row(
        "scaler backoff_factor",
        lambda fx: DistributedGradScaler(backoff_factor=2.0),
        ValueError,
        r"backoff_factor",
    ),
    Row(
        "scaler growth_interval",
        lambda fx: DistributedGradScaler(growth_interval=0),
        ValueError,
        r"growth_interval",
    ),
    Row("scaler scale", lambda fx: fx.scaler.scale("loss"), TypeError, r"outputs"),
    Row(
        "scaler step optimizer",
        lambda fx: fx.scaler.step(torch.optim.SGD([fx.local], lr=0.1), fx.cid),
        TypeError,
        r"optimizer",
    ),
    Row(
        "scaler step context",
        lambda fx: fx.scaler.step(fx.opt, 987654321),
        ValueError,
        r"context_id 987654321",
    ),
    Row(
        "scaler unscale_ context",
        lambda fx: fx.scaler.unscale_(fx.opt, 987654321),
        ValueError,
        r"context_id 987654321",
    ),
    Row("scaler update", lambda fx: fx.scaler.update(-2.0), ValueError, r"new_scale"),
    Row(
        "register class",
        lambda fx: register_functional_optimizer("SGD", object),
        TypeError,
        r"optimizer_class",
    ),
    Row(
        "register functional",
        lambda fx: register_functional_optimizer(torch.optim.SGD, "F"),
        TypeError,
        r"functional_class",
    ),
]


def _call(fx: SimpleNamespace, func: Any = _double, **kwargs: Any) -> object:
    kwargs.setdefault("args", (fx.batch,))
    return remote_sync_call(func, **kwargs)


REMOTE_ROWS = [
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
        lambda fx: remote_async_call(_double, args=(fx.batch,), reducer=_exploding_reducer).wait(),
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
]


AUTOGRAD_ROWS = [
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


def _fixtures() -> SimpleNamespace:
    rrefs = [
        rpc.remote("worker1", _make_param, args=(torch.ones(3),)),
        rpc.remote("worker2", _make_param, args=(torch.ones(2),)),
    ]
    fx = SimpleNamespace(rrefs=rrefs, local=torch.nn.Parameter(torch.ones(3)))
    fx.batch = torch.arange(12.0).reshape(6, 2)
    fx.leaf = torch.ones(3, requires_grad=True)
    fx.opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)
    fx.scaler = DistributedGradScaler(init_scale=4.0)
    return fx


def _check_counter(counter: SendCounter, fx: SimpleNamespace) -> None:
    """The counter sees every kind of request, so a zero below means nothing was sent."""
    before = counter.count
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
    assert counter.count == before + 1
    rpc.rpc_async("worker2", _square_sum, args=(fx.rrefs[1],)).wait()
    assert counter.count == before + 2
    rpc.remote("worker1", torch.ones, args=((2,),)).to_here()
    assert counter.count == before + 3
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", _square_sum, args=(fx.rrefs[0],))
        dist_autograd.backward(cid, [loss])
        mark = counter.count
        fx.opt.step(cid)
        assert counter.count == mark + 2  # one request per owner
    mark = counter.count
    remote_sync_call(_double, args=(fx.batch,))
    assert counter.count == mark + 2  # one request per remote partition (rank 0 runs its own)


def run_rows(rows: list[Row], fx: SimpleNamespace, counter: SendCounter) -> list[str]:
    """Run every row; return one line per failure (all rows run, so one report lists them all)."""
    failures = []
    for row in rows:
        before = counter.count
        try:
            row.call(fx)
        except BaseException as exc:
            sent = counter.count - before
            if not isinstance(exc, row.error):
                failures.append(
                    f"{row.name}: raised {type(exc).__name__}: {exc} (want {row.error.__name__})"
                )
            elif not re.search(row.match, str(exc), re.DOTALL):
                failures.append(f"{row.name}: message {str(exc)!r} does not match {row.match!r}")
            elif sent and not row.sends:
                failures.append(f"{row.name}: {sent} RPC request(s) sent before the error")
        else:
            failures.append(f"{row.name}: did not raise (want {row.error.__name__})")
    return failures


def _world(rank: int, world_size: int) -> None:
    if rank != 0:
        return
    counter = SendCounter()
    fx = _fixtures()
    _check_counter(counter, fx)
    with md_autograd.context() as cid:
        fx.cid = cid
        failures = run_rows(WORLD_ROWS + OPTIM_ROWS + REMOTE_ROWS + AUTOGRAD_ROWS, fx, counter)
    # The table's calls did not break the world: a good call still works.
    got = remote_sync_call(_double, args=(fx.batch,), reducer=cat_reducer)
    assert torch.equal(got, fx.batch * 2)
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(90)
def test_bad_input_fails_fast_naming_the_argument_and_sends_nothing() -> None:
    run_world(_world, 3, timeout=80)
