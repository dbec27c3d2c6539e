"""Remote == local: values and gradients of remote calls equal the same code run in one process.

One spawned world of 3 (rank 0 drives, its own partitions run in-process) runs every scenario;
each reports under its own test id. Scenarios cover the in-process partition, the backward
overlap, chained calls, partial use of results, RNN / normalised / sparse module arguments,
``requires_grad`` under ``no_grad`` and ``inference_mode``, containers pytree cannot open,
results holding parameters, and errors of local and timed-out partitions.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import Scenarios, run_scenarios
from torch import nn
from torch.utils._pytree import register_dataclass

import metadist as md
from metadist import autograd as mag

# ------------------------------------------------------------------------------------------
# Remote functions (module level: workers import them by name)


def weighted(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (w * x).sum()


def times_three_sum(w: torch.Tensor) -> torch.Tensor:
    return (w * 3.0).sum()


def square(m: torch.Tensor) -> torch.Tensor:
    return m * m


def fresh_leaf(w: torch.Tensor) -> torch.Tensor:
    return torch.ones(2, requires_grad=True) * 2.0  # ignores w


def loss_and_aux(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (w * x).sum(), w * 10.0


def run_module(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x)
    return (out[0] if isinstance(out, tuple) else out).pow(2).sum()


def adapt(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        return torch.autograd.grad((p["w"] * x).sum(), [p["w"]])[0]


def flags(x: Any) -> list[bool]:
    leaves, _ = torch.utils._pytree.tree_flatten(x)
    return [t.requires_grad for t in leaves if isinstance(t, torch.Tensor)]


def slow(x: torch.Tensor) -> torch.Tensor:
    time.sleep(3.0)
    return x


def fail_on_rank(x: torch.Tensor) -> torch.Tensor:
    raise ValueError(f"bad chunk of {len(x)} on {md.get_worker_name()}")


THREADS: list[int] = []


def record_thread(x: torch.Tensor) -> torch.Tensor:
    THREADS.append(threading.get_ident())
    return x + 1


STAMPS: list[tuple[str, float]] = []


def stamped_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model(x)
    h.register_hook(lambda g: STAMPS.append(("end", time.time())) or g)
    out = h
    eye = torch.eye(out.shape[-1])
    for _ in range(100):  # a backward long enough (tens of ms) to see whether another overlaps it
        out = torch.tanh(out @ eye)
    out.register_hook(lambda g: STAMPS.append(("start", time.time())) or g)
    return out.pow(2).mean()


def stamps() -> dict[str, float]:
    return dict(STAMPS)


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


Pair = collections.namedtuple("Pair", ["a", "b"])


class Holder:
    """An object pytree cannot open, holding a tensor as an attribute."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


class Slotted:
    __slots__ = ("w",)

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


def container_loss(tree: Any, x: torch.Tensor) -> torch.Tensor:
    """Sum of every tensor leaf (modules applied to x) of ``tree``, weighted by position."""
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    total = x.sum() * 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, nn.Module):
            out = leaf(x)
            total = total + (out[0] if isinstance(out, tuple) else out).pow(2).sum() * (i + 1)
        elif isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            total = total + (leaf * (i + 1)).pow(2).sum()
    return total


@dataclasses.dataclass
class Box:
    w: torch.Tensor


@dataclasses.dataclass
class OpenBox:
    w: torch.Tensor


register_dataclass(OpenBox, field_names=["w"])


def box_loss(b: Box | OpenBox, x: torch.Tensor) -> torch.Tensor:
    return (b.w * x).sum()


def returns_parameter(x: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(x.clone())


# ------------------------------------------------------------------------------------------
# Helpers


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a - b).norm() / b.norm().clamp_min(1e-12))
    assert err <= 1e-5, f"{what}: relative error {err:.2e}\nremote {a}\nlocal  {b}"


def grads_of(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]


def remote_vs_local(
    make: Callable[[], nn.Module], x: torch.Tensor, partitioner: Any, what: str
) -> None:
    torch.manual_seed(0)
    remote_model = make()
    local_model = make()
    local_model.load_state_dict(remote_model.state_dict())
    with mag.context() as ctx:
        losses = md.remote_sync_call(run_module, args=(remote_model, x), partitioner=partitioner)
        mag.backward(ctx, [sum(losses)])
    local = sum(run_module(local_model, c) for c in [x])
    local.backward()
    assert_close(sum(losses).detach(), local.detach(), f"{what} value")
    for a, b in zip(grads_of(remote_model), grads_of(local_model), strict=True):
        assert_close(a, b, f"{what} gradient")


# ------------------------------------------------------------------------------------------
# Scenarios (run on rank 0 of a world of 3)


def own_partition_runs_in_process(world_size: int) -> None:
    THREADS.clear()
    out = md.remote_sync_call(record_thread, args=(torch.zeros(2),), partitioner=0)
    assert [threading.get_ident()] == THREADS, "the caller's partition left this thread"
    assert torch.equal(out[0], torch.ones(2))


def mixed_partitions_equal_local(world_size: int) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(10, 4)
    for partitioner in (None, md.dim_partitioner(0, exclusive=True)):
        model.zero_grad()
        ref.zero_grad()
        with mag.context() as ctx:
            loss = md.remote_sync_call(
                run_module, args=(model, x), partitioner=partitioner, reducer=md.sum_reducer
            )
            mag.backward(ctx, [loss])
        expected = run_module(ref, x)
        expected.backward()
        assert_close(loss.detach(), expected.detach(), "value")
        for a, b in zip(grads_of(model), grads_of(ref), strict=True):
            assert_close(a, b, "gradient")


def remote_backward_overlaps_local_backward(world_size: int) -> None:
    torch.manual_seed(2)
    model = nn.Linear(256, 256)
    x = torch.randn(128, 256)
    overlapped = []
    for _ in range(5):
        md.remote_sync_call(stamps, partitioner=1)  # warm up
        STAMPS.clear()
        loss = md.remote_sync_call(
            stamped_loss,
            args=(model, x),
            partitioner=md.dim_partitioner(0, workers=[0, 1]),
            reducer=md.mean_reducer,
        )
        loss.backward()
        local = stamps()
        (remote,) = md.remote_sync_call(stamps, partitioner=1)
        # The node that sends worker 1 its gradients runs before the caller's own partition's
        # backward, so worker 1 starts before rank 0 is done
        overlapped.append((remote["start"] < local["end"], remote, local))
    assert sum(ok for ok, *_ in overlapped) >= 4, overlapped


def two_worker_gradients_are_reproducible(world_size: int) -> None:
    """The caller's partition and one remote one: bit-identical gradients on every repeat."""
    torch.manual_seed(6)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    x = torch.randn(64, 8)
    part = md.dim_partitioner(0, workers=[0, 1])
    first = None
    for _ in range(20):
        model.zero_grad()
        loss = md.remote_sync_call(
            run_module, args=(model, x), partitioner=part, reducer=md.sum_reducer
        )
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if first is None:
            first = grads
        for a, b in zip(grads, first, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()


def chained_calls_are_differentiable(world_size: int) -> None:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    with mag.context() as ctx:
        m = md.remote_sync_call(times_three_sum, args=(w,), partitioner=1, reducer=md.mean_reducer)
        (o,) = md.remote_sync_call(square, args=(m,), partitioner=2)
        (g,) = mag.grad(ctx, o, [w])
    assert g.tolist() == [54.0, 54.0]


def fresh_leaf_result_does_not_hang(world_size: int) -> None:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    with mag.context() as ctx:
        (a,) = md.remote_sync_call(weighted, args=(w, torch.tensor([3.0, 4.0])), partitioner=1)
        (b,) = md.remote_sync_call(fresh_leaf, args=(w,), partitioner=2)
        (g,) = mag.grad(ctx, a + b.sum(), [w])
    assert g.tolist() == [3.0, 4.0]  # the fresh leaf contributes nothing, as locally


def one_of_several_results_is_enough(world_size: int) -> None:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    with mag.context() as ctx:
        ((loss, aux),) = md.remote_sync_call(
            loss_and_aux, args=(w, torch.tensor([3.0, 4.0])), partitioner=1
        )
        (g,) = mag.grad(ctx, loss, [w])
    assert aux.requires_grad
    assert g.tolist() == [3.0, 4.0]


def rnn_modules_equal_local(world_size: int) -> None:
    x = torch.randn(4, 5, 3)
    for cls in (nn.LSTM, nn.GRU, nn.RNN):
        remote_vs_local(lambda cls=cls: cls(3, 4, batch_first=True), x, 1, cls.__name__)
        remote_vs_local(lambda cls=cls: cls(3, 4, batch_first=True), x, None, cls.__name__)


def normalised_modules_equal_local(world_size: int) -> None:
    x = torch.randn(6, 3)
    remote_vs_local(lambda: nn.utils.weight_norm(nn.Linear(3, 2)), x, 1, "weight_norm")
    # spectral_norm updates its power-iteration buffers in place in training mode, which a
    # remote copy cannot send back: compare in eval mode, where it only reads them
    remote_vs_local(lambda: nn.utils.spectral_norm(nn.Linear(3, 2)).eval(), x, 1, "spectral_norm")


def parametrized_module_is_refused_before_sending(world_size: int) -> None:
    from torch.nn.utils import parametrizations

    model = parametrizations.orthogonal(nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"args\[0\] \(ParametrizedLinear\) cannot be sent"):
        md.remote_sync_call(run_module, args=(model, torch.randn(2, 3)), partitioner=1)


def sparse_embedding_gradient_equals_local(world_size: int) -> None:
    torch.manual_seed(3)
    remote_vs_local(lambda: nn.Embedding(10, 3, sparse=True), torch.tensor([[1, 2, 4]]), 1, "emb")


def requires_grad_arrives_as_sent(world_size: int) -> None:
    x = torch.arange(3.0)
    for mode in (torch.no_grad, torch.enable_grad):  # inference mode forbids autograd.grad
        with mode():
            p = {"w": nn.Parameter(torch.ones(3))}
            (remote,) = md.remote_sync_call(adapt, args=(p, x), partitioner=1)
            assert remote.tolist() == adapt(p, x).tolist() == [0.0, 1.0, 2.0], mode
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        plain = torch.ones(2, requires_grad=True)
        param = nn.Parameter(torch.ones(2))
        with mode():
            args = ([plain, torch.ones(1), param, nn.Linear(2, 2)],)
            (got,) = md.remote_sync_call(flags, args=args, partitioner=1)
        assert got == [True, False, True], (mode, got)  # a module is not a tensor leaf
    with mag.context(), torch.no_grad():
        args = ([torch.ones(2, requires_grad=True)],)
        (got,) = md.remote_sync_call(flags, args=args, partitioner=2)
    assert got == [True]


def hidden_grad_tensor_is_refused(world_size: int) -> None:
    w = nn.Parameter(torch.ones(3))
    with mag.context(), pytest.raises(TypeError, match=r"args\[0\] \(Box\) holds a tensor") as info:
        md.remote_sync_call(box_loss, args=(Box(w), torch.arange(3.0)), partitioner=1)
    assert "register_dataclass" in str(info.value)
    # registered with pytree, the same container is carried differentiably
    with mag.context() as ctx:
        (loss,) = md.remote_sync_call(box_loss, args=(OpenBox(w), torch.arange(3.0)), partitioner=1)
        mag.backward(ctx, [loss])
    assert w.grad is not None
    assert w.grad.tolist() == [0.0, 1.0, 2.0]
    # a detached tensor in an opaque object is fine: there is no gradient to lose
    args = (Box(torch.ones(3)), torch.arange(3.0))
    (value,) = md.remote_sync_call(box_loss, args=args, partitioner=1)
    assert value.item() == 3.0


def result_holding_a_parameter_is_refused(world_size: int) -> None:
    for partitioner in (0, 1):  # in-process and remote alike
        with pytest.raises(TypeError, match=r"an nn.Parameter .*named_parameters") as info:
            md.remote_sync_call(returns_parameter, args=(torch.ones(2),), partitioner=partitioner)
        assert info.value.partition_index == 0  # type: ignore[attr-defined]


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


def _containers(w: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    return {
        "tuple": (w, v),
        "list": [w, [v, 3]],
        "dict": {"w": w, "v": {"deep": v}},
        "ordered dict": collections.OrderedDict(w=w, v=v),
        "namedtuple": Pair(w, v),
        "registered dataclass": OpenBox(w),
        "none and numbers": (None, 2.5, w, "tag", v),
    }


def _modules() -> dict[str, Callable[[], nn.Module]]:
    return {
        "linear": lambda: nn.Linear(4, 3),
        "sequential with eval batchnorm": lambda: nn.Sequential(
            nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2)
        ).eval(),
        "shared weights": _tied,
        "frozen first layer": _frozen,
        "gru": lambda: nn.GRU(4, 3, batch_first=True),
    }


def _tied() -> nn.Module:
    first = nn.Linear(4, 4)
    return nn.Sequential(first, nn.Tanh(), first)


def _frozen() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    return model


def split_x_only(tree: Any, x: torch.Tensor) -> list[tuple[int, tuple[Any, ...], dict[str, Any]]]:
    """A partitioner that replicates ``tree`` and splits ``x`` over the three workers."""
    return [(w, (tree, chunk), {}) for w, chunk in enumerate(torch.tensor_split(x, 3))]


def remote_equals_local_over_a_table(world_size: int) -> None:
    """Values and gradients equal the local run for every container, module and partitioner."""
    x = torch.randn(6, 4)
    cases = 0
    for partitioner in (0, 1, split_x_only):  # in-process, remote, split over all three
        for name, tree in _containers(
            nn.Parameter(torch.randn(3)), torch.randn(2, requires_grad=True)
        ).items():
            leaves = [
                t for t in torch.utils._pytree.tree_flatten(tree)[0] if isinstance(t, torch.Tensor)
            ]
            with mag.context() as ctx:
                out = md.remote_sync_call(container_loss, args=(tree, x), partitioner=partitioner)
                grads = mag.grad(ctx, sum(out), leaves)
            parts = [x] if partitioner != split_x_only else list(torch.tensor_split(x, 3))
            local = sum(container_loss(tree, c) for c in parts)
            expected = torch.autograd.grad(local, leaves)
            assert_close(sum(out).detach(), local.detach(), f"{name} value ({partitioner})")
            for g, e in zip(grads, expected, strict=True):
                assert_close(g, e, f"{name} gradient ({partitioner})")
            cases += 1
        for name, make in _modules().items():
            seq = x.unsqueeze(1) if name == "gru" else x
            torch.manual_seed(5)
            remote = make()
            local_model = make()
            local_model.load_state_dict(remote.state_dict())
            params = [p for p in remote.parameters() if p.requires_grad]
            with mag.context() as ctx:
                out = md.remote_sync_call(
                    container_loss, args=([remote], seq), partitioner=partitioner
                )
                grads = mag.grad(ctx, sum(out), params)
            parts = [seq] if partitioner != split_x_only else list(torch.tensor_split(seq, 3))
            local = sum(container_loss([local_model], c) for c in parts)
            expected = torch.autograd.grad(
                local, [p for p in local_model.parameters() if p.requires_grad]
            )
            assert_close(sum(out).detach(), local.detach(), f"{name} value ({partitioner})")
            for g, e in zip(grads, expected, strict=True):
                assert_close(g, e, f"{name} gradient ({partitioner})")
            cases += 1
    assert cases == 3 * (7 + 5)


def no_container_hides_a_gradient(world_size: int) -> None:
    """Every container either carries the gradient or is refused before sending: never lost."""
    x = torch.arange(3.0)
    kinds: dict[str, Callable[[torch.Tensor], Any]] = {
        "plain dataclass": Box,
        "object attribute": Holder,
        "slots object": Slotted,
        "set": lambda w: {w},
        "frozenset": lambda w: frozenset([w]),
        "tuple": lambda w: (w,),
        "dict": lambda w: {"w": w},
        "registered dataclass": OpenBox,
        "namedtuple": lambda w: Pair(w, w),
    }
    refused = []
    for name, wrap in kinds.items():
        w = nn.Parameter(torch.ones(3))
        try:
            with mag.context() as ctx:
                (loss,) = md.remote_sync_call(container_loss, args=(wrap(w), x), partitioner=1)
                mag.backward(ctx, [loss])
        except TypeError as error:
            refused.append((name, str(error)))
            continue
        assert w.grad is not None, f"{name}: the gradient was lost"
        assert w.grad.abs().sum() > 0, name
    for name, message in refused:
        assert "requires grad inside an object" in message, (name, message)
    assert sorted(name for name, _ in refused) == [
        "frozenset",
        "object attribute",
        "plain dataclass",
        "set",
        "slots object",
    ]


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
    results = {}
    for schedule in ("static", "dynamic"):
        model.zero_grad()
        part = md.dim_partitioner(0, exclusive=True, schedule=schedule)
        with mag.context() as ctx:
            loss = md.remote_sync_call(
                uneven_task, args=(model, x, steps), partitioner=part, reducer=md.mean_reducer
            )
            mag.backward(ctx, [loss])
        results[schedule] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    assert torch.equal(results["static"][0], results["dynamic"][0])  # reduced in task order
    for a, b in zip(results["static"][1], results["dynamic"][1], strict=True):
        assert_close(a, b, "gradient")  # summed in arrival order: equal up to rounding


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


SCENARIOS = [
    own_partition_runs_in_process,
    mixed_partitions_equal_local,
    remote_backward_overlaps_local_backward,
    two_worker_gradients_are_reproducible,
    chained_calls_are_differentiable,
    fresh_leaf_result_does_not_hang,
    one_of_several_results_is_enough,
    rnn_modules_equal_local,
    normalised_modules_equal_local,
    parametrized_module_is_refused_before_sending,
    sparse_embedding_gradient_equals_local,
    requires_grad_arrives_as_sent,
    hidden_grad_tensor_is_refused,
    result_holding_a_parameter_is_refused,
    local_and_remote_errors_look_alike,
    timeouts_name_their_partition,
    remote_equals_local_over_a_table,
    no_container_hides_a_gradient,
    nested_fan_out_ten_times_the_pool,
    dynamic_schedule_equals_static,
    dynamic_schedule_errors_name_task_and_worker,
    partitions_use_the_process_thread_count,
]


@pytest.fixture(scope="module")
def world() -> Scenarios:
    return run_scenarios(SCENARIOS, 3, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [s.__name__ for s in SCENARIOS])
def test_remote_equals_local(world: Scenarios, name: str) -> None:
    world.check(name)
