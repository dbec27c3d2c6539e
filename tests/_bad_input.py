"""Tables of bad calls, each row run in a real spawned world of 3 and reported under its own id.

Every row is a call, the exception type it must raise and a regex that must find the offending
argument's name in the message. Unless a row says otherwise, the call must also send nothing over
RPC: the check happens before the first request. ``SendCounter`` counts requests this process
hands to the RPC agent; each world first shows it counting real ``rpc_sync``/``rpc_async``/
``remote`` calls and a real ``DistributedOptimizer.step``, so a zero is meaningful.

A test module defines ``ROWS`` and assigns ``table_test(__name__, ROWS)`` to a ``test_*`` name:
each row is then a test id that fails with that row's problem.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
from _dist import Scenarios, run_world

from metadist import autograd as md_autograd
from metadist.api import remote_sync_call
from metadist.optim import DistributedGradScaler, DistributedOptimizer
from metadist.reduce import cat_reducer

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


@dataclass(frozen=True)
class Row:
    """One bad call: ``call(fx)`` must raise ``error`` with a message matching ``match``."""

    name: str
    call: Callable[[SimpleNamespace], object]
    error: type[BaseException]
    match: str
    sends: bool = False  # True where requests legitimately go out first (a reducer that raises)


# Not a row: after every row, a good call must still work in the same world.
WORLD_STILL_WORKS = "a good call still works after the table"


def make_param(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_(True)


def square_sum(rref: rpc.RRef[torch.Tensor]) -> torch.Tensor:
    return rref.local_value().pow(2).sum()


def double(x: Any) -> Any:
    return x * 2


def _fixtures() -> SimpleNamespace:
    rrefs = [
        rpc.remote("worker1", make_param, args=(torch.ones(3),)),
        rpc.remote("worker2", make_param, args=(torch.ones(2),)),
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
    rpc.rpc_async("worker2", square_sum, args=(fx.rrefs[1],)).wait()
    assert counter.count == before + 2
    rpc.remote("worker1", torch.ones, args=((2,),)).to_here()
    assert counter.count == before + 3
    with dist_autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", square_sum, args=(fx.rrefs[0],))
        dist_autograd.backward(cid, [loss])
        mark = counter.count
        fx.opt.step(cid)
        assert counter.count == mark + 2  # one request per owner
    mark = counter.count
    remote_sync_call(double, args=(fx.batch,))
    assert counter.count == mark + 2  # one request per remote partition (rank 0 runs its own)


def _run_row(row: Row, fx: SimpleNamespace, counter: SendCounter) -> str | None:
    """What is wrong with how ``row`` failed, or ``None``."""
    before = counter.count
    try:
        row.call(fx)
    except BaseException as exc:
        sent = counter.count - before
        if not isinstance(exc, row.error):
            return f"raised {type(exc).__name__}: {exc} (want {row.error.__name__})"
        if not re.search(row.match, str(exc), re.DOTALL):
            return f"message {str(exc)!r} does not match {row.match!r}"
        if sent and not row.sends:
            return f"{sent} RPC request(s) sent before the error"
        return None
    return f"did not raise (want {row.error.__name__})"


def _table_world(rank: int, world_size: int, module: str, out: str) -> None:
    if rank != 0:
        return  # serve rank 0's calls
    rows: list[Row] = importlib.import_module(module).ROWS
    counter = SendCounter()
    fx = _fixtures()
    _check_counter(counter, fx)
    with md_autograd.context() as cid:
        fx.cid = cid
        results = {row.name: _run_row(row, fx, counter) for row in rows}
    got = remote_sync_call(double, args=(fx.batch,), reducer=cat_reducer)
    results[WORLD_STILL_WORKS] = None if torch.equal(got, fx.batch * 2) else f"got {got}"
    Path(out).write_text(json.dumps(results))


def run_table(module: str, timeout: float = 80.0) -> Scenarios:
    """Run the ``ROWS`` of test module ``module`` on rank 0 of a spawned world of 3."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "results.json")
        error = None
        try:
            run_world(_table_world, 3, module, out, timeout=timeout)
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
        results = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    return Scenarios(results, error)


def table_test(module: str, rows: list[Row]) -> Callable[[str], None]:
    """The test of a module's table: one test id per row (the table runs in one world, once).

    Assign it to a ``test_*`` name in the module, whose ``ROWS`` it runs.
    """
    names = [row.name for row in rows]
    assert len(set(names)) == len(names), "two rows share a name"
    ran: list[Scenarios] = []

    @pytest.mark.timeout(90)
    @pytest.mark.parametrize("name", [*names, WORLD_STILL_WORKS])
    def test_bad_call_fails_fast_naming_the_argument_and_sends_nothing(name: str) -> None:
        if not ran:
            ran.append(run_table(module))
        ran[0].check(name)

    return test_bad_call_fails_fast_naming_the_argument_and_sends_nothing
