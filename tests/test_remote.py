"""Remote calls over real spawned RPC worlds (few, fat tests)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _dist import Scenarios, run_scenarios
from torch import nn
from torch.func import functional_call
from torch.nn.functional import cross_entropy, relu

import metadist.autograd as mag
from metadist import transport
from metadist.api import (
    parallelize,
    parallelize_async,
    remote_async_call,
    remote_sync_call,
)
from metadist.errors import RemoteError
from metadist.partition import dim_partitioner
from metadist.reduce import mean_reducer, sum_reducer
from metadist.world import get_worker_name

# --------------------------------------------------------------------------------------------------
# Remote functions (module level: workers import them by name)


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


def weighted(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (w * x).sum()


def count_elements(x: torch.Tensor) -> int:
    return int(x.numel())  # nothing differentiable comes back


@dataclass
class Doubled:
    """A result class pytree cannot look into."""

    total: torch.Tensor


def doubled(x: torch.Tensor) -> Doubled:
    return Doubled((x * 2).sum())


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 1.001


def structures_cached() -> int:
    return len(transport._STRUCTURES)


def model_info(model: nn.Module, x: torch.Tensor) -> tuple[int, bool, torch.Tensor, str]:
    out = model(x)
    return len(list(model.modules())), model.training, out, type(model).__name__


class Shifted(nn.Module):
    """Adds every buffer it holds: the result shows which buffer slots the worker sees."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.buffers():
            x = x + b
        return x


def buffer_names(model: nn.Module, x: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    return [name for name, _ in model.named_buffers()], model(x)


@parallelize(partitioner=dim_partitioner(0), reducer=mean_reducer)
def decorated_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(0)


@parallelize_async(partitioner="worker2")
def decorated_async(x: torch.Tensor) -> str:
    return f"{get_worker_name()}:{x.numel()}"


# --------------------------------------------------------------------------------------------------
# World 1: partition/reduce correctness, futures, errors, timeouts, bad input, caching


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


def compression_is_close_but_not_exact(world_size: int) -> None:
    # Compression: results close to, but not equal to, the uncompressed ones.
    values = torch.randn(300)
    exact = remote_sync_call(scale, args=(values,), reducer=torch.cat)
    for mode in ("bf16", "fp16"):
        packed = remote_sync_call(scale, args=(values,), reducer=torch.cat, compression=mode)
        assert packed.dtype == torch.float32
        error = (packed - exact).abs().max().item()
        assert 0 < error < 0.05, (mode, error)


def module_structures_are_cached_per_worker(world_size: int) -> None:
    x = torch.arange(10.0)
    # Module structure cache: sent once per worker, resent only after a structural change.
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    before = remote_sync_call(structures_cached, partitioner=1)[0]
    inputs = torch.randn(6, 3)
    n_modules, training, out, _ = remote_sync_call(model_info, args=(model, inputs), partitioner=1)[
        0
    ]
    assert (n_modules, training) == (4, True)
    torch.testing.assert_close(out, model(inputs))
    world = next(iter(transport._CONFIRMED))
    assert len(transport._CONFIRMED[world]["worker1"]) == 1
    model.eval()
    n_modules, training, out, _ = remote_sync_call(model_info, args=(model, inputs), partitioner=1)[
        0
    ]
    assert training is False
    torch.testing.assert_close(out, model(inputs))  # eval-mode BatchNorm uses running stats
    assert remote_sync_call(structures_cached, partitioner=1)[0] == before + 1
    # Same structure, another instance: the cache is keyed by structure, nothing new is sent.
    twin = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    _, _, out, _ = remote_sync_call(model_info, args=(twin, inputs), partitioner=1)[0]
    torch.testing.assert_close(out, twin(inputs))
    assert remote_sync_call(structures_cached, partitioner=1)[0] == before + 1
    # A structural change is detected and the new structure is sent.
    model.add_module("head", nn.Linear(2, 1))
    n_modules, _, out, _ = remote_sync_call(model_info, args=(model, inputs), partitioner=1)[0]
    assert n_modules == 5
    assert out.shape == (6, 1)
    assert remote_sync_call(structures_cached, partitioner=1)[0] == before + 2
    # Buffer slots: one set after a first call, then renamed (same count), reach the worker.
    shifted = Shifted()
    assert remote_sync_call(buffer_names, args=(shifted, x), partitioner=1)[0][0] == []
    shifted.shift = torch.tensor(5.0)
    names, out = remote_sync_call(buffer_names, args=(shifted, x), partitioner=1)[0]
    assert names == ["shift"]
    torch.testing.assert_close(out, x + 5)
    shifted._buffers["offset"] = shifted._buffers.pop("shift")
    assert remote_sync_call(buffer_names, args=(shifted, x), partitioner=1)[0][0] == ["offset"]
    with pytest.raises(TypeError, match=r"module must be an nn\.Module, got None"):
        transport.invalidate_module_cache(None)  # type: ignore[arg-type]
    # An unpicklable module fails before sending, naming the argument.
    with pytest.raises(TypeError, match=r"module argument args\[0\]"):
        remote_sync_call(model_info, args=(LocalModule(), inputs), partitioner=1)


API_SCENARIOS = [
    partitions_are_balanced_and_in_order,
    reducers_exclusive_and_pytree_results,
    worker_partitioners_futures_and_decorators,
    remote_exceptions_keep_type_worker_and_traceback,
    timeouts_name_the_worker,
    bad_input_fails_before_sending,
    compression_is_close_but_not_exact,
    module_structures_are_cached_per_worker,
]


def bad_partitioner(*args: Any, **kwargs: Any) -> list[Any]:
    return [(0, args)]


class LocalModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fn = lambda t: t  # not picklable


@pytest.fixture(scope="module")
def api_world() -> Scenarios:
    return run_scenarios(API_SCENARIOS, 3, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [f.__name__ for f in API_SCENARIOS])
def test_remote_calls(api_world: Scenarios, name: str) -> None:
    api_world.check(name)


# --------------------------------------------------------------------------------------------------
# World 2: gradients through module arguments (MAML), grad twice, accumulation, compression


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(relu(self.bn(self.conv(x))).flatten(1))


def maml_loss(
    model: nn.Module,
    x_spt: torch.Tensor,
    y_spt: torch.Tensor,
    x_qry: torch.Tensor,
    y_qry: torch.Tensor,
) -> torch.Tensor:
    """Mean query loss over this partition's tasks after 2 inner SGD steps (torch.func)."""
    params = dict(model.named_parameters())
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    # BatchNorm updates its running statistics in place: inside torch.func.grad they must be
    # an input of the transformed function, not captured.
    def inner(
        p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        return cross_entropy(functional_call(model, (p, b), (x,)), y)

    losses = []
    for t in range(x_spt.shape[0]):
        fast = params
        for _ in range(2):
            grads = torch.func.grad(inner)(fast, buffers, x_spt[t], y_spt[t])
            fast = {k: fast[k] - 0.4 * grads[k] for k in fast}
        losses.append(inner(fast, buffers, x_qry[t], y_qry[t]))
    return torch.stack(losses).mean()


def _tasks(seed: int, n_tasks: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_tasks, 5, 1, 6, 6, generator=g),
        torch.randint(0, 3, (n_tasks, 5), generator=g),
        torch.randn(n_tasks, 5, 1, 6, 6, generator=g),
        torch.randint(0, 3, (n_tasks, 5), generator=g),
    )


def _bounded(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread: a regression that hangs fails here, not at the world's timeout."""
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as error:  # re-raised on the calling thread
            outcome.append((False, error))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s: it hangs"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@functools.cache
def _maml_setup() -> tuple[
    ConvNet, tuple[torch.Tensor, ...], list[nn.Parameter], tuple[torch.Tensor, ...]
]:
    """The model, 7 tasks (3, 2, 2 over 3 workers) and the single-process meta-gradient."""
    torch.manual_seed(0)
    model = ConvNet()
    tasks = _tasks(1, 7)
    params = list(model.parameters())
    ref_grads = torch.autograd.grad(maml_loss(model, *tasks), params)
    return model, tasks, params, ref_grads


def meta_gradients_match_single_process(world_size: int) -> None:
    model, tasks, params, ref_grads = _maml_setup()
    running_mean = model.bn.running_mean.clone()
    model.zero_grad(set_to_none=True)
    # Distributed meta-gradients, as the MAML example writes them.
    with mag.context() as ctx:
        loss = remote_sync_call(
            maml_loss,
            args=(model, *tasks),
            partitioner=dim_partitioner(0),
            reducer=mean_reducer,
        )
        mag.backward(ctx, [loss])
    dist_grads = [p.grad.clone() for p in params]
    assert torch.equal(model.bn.running_mean, running_mean)  # remote buffer updates stay remote

    # Single-process reference.
    model.zero_grad(set_to_none=True)
    ref_loss = maml_loss(model, *tasks)
    ref_grads = torch.autograd.grad(ref_loss, params)
    assert _rel_err(loss.detach(), ref_loss.detach()) <= 1e-5
    for (name, _), d, r in zip(model.named_parameters(), dist_grads, ref_grads, strict=True):
        assert r.abs().sum() > 0, name
        assert _rel_err(d, r) <= 1e-5, (name, _rel_err(d, r))


def grad_returns_new_tensors_and_never_double_counts(world_size: int) -> None:
    model, tasks, params, ref_grads = _maml_setup()
    # grad(): new tensors, .grad untouched, a second call neither double-counts nor mutates.
    model.zero_grad(set_to_none=True)
    with mag.context() as ctx:
        loss = remote_sync_call(
            maml_loss, args=(model, *tasks), partitioner=dim_partitioner(0), reducer=mean_reducer
        )
        first = mag.grad(ctx, loss, params, retain_graph=True)
        kept = [g.clone() for g in first]
        second = mag.grad(ctx, [loss], params)
        gradient_map = mag.get_gradients(ctx)
    assert all(p.grad is None for p in params)
    for f, k, s, r in zip(first, kept, second, ref_grads, strict=True):
        assert torch.equal(f, k)
        assert _rel_err(f, r) <= 1e-5
        assert _rel_err(s, r) <= 1e-5
    for p, r in zip(params, ref_grads, strict=True):  # the raw map holds both passes
        assert _rel_err(gradient_map[p], 2 * r) <= 1e-5


def backward_accumulates_like_torch_autograd(world_size: int) -> None:
    model, tasks, params, ref_grads = _maml_setup()
    # backward() accumulates into existing .grad like torch.autograd.backward; the decorated
    # form used by the MAML example works the same.
    for p in params:
        p.grad = torch.ones_like(p)
    with mag.context() as ctx:
        loss = decorated_maml_loss(model, *tasks)
        mag.backward(ctx, loss)
    for p, r in zip(params, ref_grads, strict=True):
        torch.testing.assert_close(p.grad, 1 + r, rtol=1e-5, atol=1e-6)


def compressed_meta_gradient_is_close(world_size: int) -> None:
    model, tasks, params, ref_grads = _maml_setup()
    # Compression: close to, but not exactly, the uncompressed meta-gradient. The error is
    # that of the wire dtype compounded through two inner steps; the conv bias feeds BatchNorm
    # (true gradient ~0), so compare the whole gradient vector.
    flat_ref = torch.cat([r.flatten() for r in ref_grads])
    errors = {}
    for mode in ("bf16", "fp16"):
        with mag.context() as ctx:
            loss = remote_sync_call(
                maml_loss,
                args=(model, *tasks),
                partitioner=dim_partitioner(0),
                reducer=mean_reducer,
                compression=mode,
            )
            packed = mag.grad(ctx, loss, params)
        errors[mode] = _rel_err(torch.cat([g.flatten() for g in packed]), flat_ref)
    assert 0 < errors["fp16"] < errors["bf16"] < 0.15, errors
    assert errors["fp16"] < 0.02, errors


def parameter_leaves_are_differentiable(world_size: int) -> None:
    # nn.Parameter leaves are differentiable too (they arrive detached with raw RPC).
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    with mag.context() as ctx:
        (out,) = remote_sync_call(weighted, args=(w, torch.tensor([3.0, 5.0])), partitioner=1)
        (gw,) = mag.grad(ctx, out, w)
    assert gw.tolist() == [3.0, 5.0]


def unreachable_result_raises_instead_of_hanging(world_size: int) -> None:
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    # A received result that the backward pass cannot reach raises instead of hanging.
    with mag.context() as ctx:
        (a,) = remote_sync_call(weighted, args=(w, torch.ones(2)), partitioner=1)
        (b,) = remote_sync_call(weighted, args=(w, torch.ones(2)), partitioner=2)
        with pytest.raises(RuntimeError, match="not reachable"):
            mag.backward(ctx, [b])
        mag.backward(ctx, [a + b])
    assert w.grad is not None
    assert w.grad.tolist() == [2.0, 2.0]
    with mag.context() as ctx:
        (c,) = remote_sync_call(scale, args=(w,), partitioner=1)
        with pytest.raises(ValueError, match="scalars only"):
            mag.backward(ctx, [c])


def later_pass_must_reach_earlier_results(world_size: int) -> None:
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    # A later pass in the same context must reach the results received before an earlier pass
    # too (torch waits for them): it raises within seconds instead of hanging.
    v = nn.Parameter(torch.tensor([4.0, 6.0]))
    x2 = torch.tensor([3.0, 5.0])
    with mag.context() as ctx:
        (y,) = remote_sync_call(weighted, args=(w, x2), partitioner=1)
        assert _bounded(30, lambda: mag.grad(ctx, y, w))[0].tolist() == [3.0, 5.0]
        (z,) = remote_sync_call(weighted, args=(v, x2), partitioner=2)
        with pytest.raises(RuntimeError, match=r"not reachable.*new metadist\.autograd\.context"):
            _bounded(30, lambda: mag.grad(ctx, z, [v]))
        # Reaching it as well: the first pass freed its graph (torch would fail on the worker).
        with pytest.raises(RuntimeError, match=r"freed their graph.*retain_graph=True"):
            _bounded(30, lambda: mag.grad(ctx, y + z, [v]))
    # With retain_graph=True on the earlier pass, a later pass that reaches both works.
    with mag.context() as ctx:
        (y,) = remote_sync_call(weighted, args=(w, x2), partitioner=1)
        _bounded(30, lambda: mag.grad(ctx, y, w, retain_graph=True))
        (z,) = remote_sync_call(weighted, args=(v, x2), partitioner=2)
        gw, gv = _bounded(30, lambda: mag.grad(ctx, y + 2 * z, [w, v]))
    assert (gw.tolist(), gv.tolist()) == ([3.0, 5.0], [6.0, 10.0])


def dangling_call_is_named(world_size: int) -> None:
    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    x2 = torch.tensor([3.0, 5.0])
    # A call sent tensors that require grad but returning nothing differentiable (a metric):
    # torch would wait for its gradients forever; metadist names it. Under no_grad it is fine.
    with mag.context() as ctx:
        (y,) = remote_sync_call(weighted, args=(w, x2), partitioner=1)
        assert remote_sync_call(count_elements, args=(w,), partitioner=2) == [2]
        with pytest.raises(RuntimeError, match=r"count_elements \(partition 0 on 'worker2'\)"):
            _bounded(30, lambda: mag.grad(ctx, y, w))
    with mag.context() as ctx:
        (y,) = remote_sync_call(weighted, args=(w, x2), partitioner=1)
        with torch.no_grad():
            assert remote_sync_call(count_elements, args=(w,), partitioner=2) == [2]
        assert _bounded(30, lambda: mag.grad(ctx, y, w))[0].tolist() == [3.0, 5.0]
    # A differentiable tensor inside a result class is not mistaken for a dangling call.
    with mag.context() as ctx:
        (d,) = remote_sync_call(doubled, args=(w,), partitioner=2)
        assert _bounded(30, lambda: mag.grad(ctx, d.total, w))[0].tolist() == [2.0, 2.0]
    assert mag._open_contexts() == 0  # released when each context closed


def bias_added_after_a_call_gets_its_gradient(world_size: int) -> None:
    # A bias added after a first call is used remotely and gets its gradient (stale cache).
    lin = nn.Linear(2, 1, bias=False)
    xb = torch.randn(4, 2)
    remote_sync_call(model_info, args=(lin, xb), partitioner=1)
    lin.bias = nn.Parameter(torch.tensor([100.0]))
    with mag.context() as ctx:
        out = remote_sync_call(model_info, args=(lin, xb), partitioner=1)[0][2]
        lin_grads = mag.grad(ctx, (out * out).sum(), [lin.weight, lin.bias])
    ref = lin(xb)
    torch.testing.assert_close(out, ref)
    lin_ref = torch.autograd.grad((ref * ref).sum(), [lin.weight, lin.bias])
    for d, r in zip(lin_grads, lin_ref, strict=True):
        torch.testing.assert_close(d, r)


GRAD_SCENARIOS = [
    meta_gradients_match_single_process,
    grad_returns_new_tensors_and_never_double_counts,
    backward_accumulates_like_torch_autograd,
    compressed_meta_gradient_is_close,
    parameter_leaves_are_differentiable,
    unreachable_result_raises_instead_of_hanging,
    later_pass_must_reach_earlier_results,
    dangling_call_is_named,
    bias_added_after_a_call_gets_its_gradient,
]


@parallelize(partitioner=dim_partitioner(0), reducer=mean_reducer)
def decorated_maml_loss(
    model: nn.Module,
    x_spt: torch.Tensor,
    y_spt: torch.Tensor,
    x_qry: torch.Tensor,
    y_qry: torch.Tensor,
) -> torch.Tensor:
    return maml_loss(model, x_spt, y_spt, x_qry, y_qry)


@pytest.fixture(scope="module")
def grad_world() -> Scenarios:
    return run_scenarios(GRAD_SCENARIOS, 3, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", [f.__name__ for f in GRAD_SCENARIOS])
def test_meta_gradients_through_module_arguments(grad_world: Scenarios, name: str) -> None:
    grad_world.check(name)
