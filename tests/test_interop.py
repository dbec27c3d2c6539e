"""metadist inside an RPC world the program started itself with ``rpc.init_rpc``.

The workers here never call :func:`metadist.auto_init_rpc`: they start RPC as torch's
``DistributedOptimizer`` tutorial does, under names of their own (``trainer``, ``ps_a``,
``ps_b``), and metadist must take the world as it finds it. One world runs every scenario; each
reports under its own test id.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from _dist import REPO, Scenarios, run_torchrun, skip_or_fail
from torch import nn

import metadist
from metadist import network, world

NAMES = ("trainer", "ps_a", "ps_b")


# ---------------------------------------------------------------------------------------------
# The tutorial's model: each parameter server owns one linear layer; the trainer drives.


def _make_layer(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


def _layer_params(layer_rref: rpc.RRef[nn.Linear]) -> list[rpc.RRef[torch.Tensor]]:
    return [rpc.RRef(p) for p in layer_rref.local_value().parameters()]


def _layer_forward(layer_rref: rpc.RRef[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer_rref.local_value()(x))


def _layer_state(layer_rref: rpc.RRef[nn.Linear]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in layer_rref.local_value().parameters()]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator))] * 3


def _rpc_forward(layer: rpc.RRef[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync(layer.owner(), _layer_forward, args=(layer, x))


def _metadist_forward(layer: rpc.RRef[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    # An RRef among the arguments: the call travels attached to the context.
    return metadist.remote_sync_call(
        _layer_forward, args=(layer, x), partitioner=layer.owner().name
    )[0]


def _train_remote(
    optimizer_module: Any,
    optimizer_class: type,
    forward: Callable[..., torch.Tensor] = _rpc_forward,
    **hparams: Any,
) -> list[Any]:
    """The tutorial's training loop; only ``optimizer_module`` and ``forward`` change."""
    layers = [rpc.remote(owner, _make_layer, args=(seed,)) for seed, owner in enumerate(NAMES[1:])]
    params = [p for layer in layers for p in rpc.rpc_sync(layer.owner(), _layer_params, (layer,))]
    opt = optimizer_module.DistributedOptimizer(optimizer_class, params, **hparams)
    for x, y in _batches():
        with dist_autograd.context() as context_id:
            out = forward(layers[1], forward(layers[0], x))
            loss = ((out - y) ** 2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
    final = [rpc.rpc_sync(layer.owner(), _layer_state, (layer,)) for layer in layers]
    return [opt, final]


def _train_local(optimizer_class: type, **hparams: Any) -> tuple[torch.optim.Optimizer, Any]:
    layers = [_make_layer(seed) for seed in range(2)]
    opt = optimizer_class([p for layer in layers for p in layer.parameters()], **hparams)
    for x, y in _batches():
        opt.zero_grad()
        loss = ((torch.tanh(layers[1](torch.tanh(layers[0](x)))) - y) ** 2).mean()
        loss.backward()
        opt.step()
    return opt, [[p.detach() for p in layer.parameters()] for layer in layers]


def _assert_same(got: Any, want: Any, what: str) -> None:
    for i, (g_layer, w_layer) in enumerate(zip(got, want, strict=True)):
        for j, (g, w) in enumerate(zip(g_layer, w_layer, strict=True)):
            torch.testing.assert_close(g, w, msg=lambda m, i=i, j=j: f"{what} [{i}][{j}]: {m}")


# ---------------------------------------------------------------------------------------------
# Scenarios: run on the trainer while the parameter servers serve


def world_info_is_the_users(world_size: int) -> None:
    assert metadist.get_worker_names() == NAMES
    assert metadist.get_world_info() == metadist.WorldInfo(0, world_size, 0, world_size)
    # WorldInfo is a value: its worker_name is the default name of its rank, as in TorchOpt;
    # the running world's own name comes from get_worker_name().
    assert metadist.get_world_info().worker_name == "worker0"
    assert metadist.get_worker_id("ps_b") == 2
    assert metadist.get_worker_name(1) == "ps_a"
    assert metadist.get_worker_name() == "trainer"
    assert metadist.on_rank(0)(lambda: "trainer")() == "trainer"
    with pytest.raises(ValueError, match=r"unknown worker name 'worker1': known workers are"):
        metadist.get_worker_id("worker1")
    metadist.barrier(["trainer", "ps_b"])  # ps_b joins it from its serving loop
    # A function decorated with auto_init_rpc runs in the world that is already there.
    assert metadist.auto_init_rpc()(metadist.get_worker_names)() == NAMES


def distributed_optimizer_equals_torch_and_local(world_size: int) -> None:
    import torch.distributed.optim as torch_optim

    import metadist.optim as metadist_optim

    _, theirs = _train_remote(torch_optim, torch.optim.SGD, lr=0.1, momentum=0.9)
    _, ours = _train_remote(metadist_optim, torch.optim.SGD, lr=0.1, momentum=0.9)
    _, local = _train_local(torch.optim.SGD, lr=0.1, momentum=0.9)
    _assert_same(ours, theirs, "metadist vs torch DistributedOptimizer")
    _assert_same(ours, local, "metadist vs local torch.optim")


def optimizer_state_dict_and_clipping(world_size: int) -> None:
    import metadist.optim as metadist_optim

    opt, ours = _train_remote(metadist_optim, torch.optim.Adam, lr=0.01)
    local_opt, local = _train_local(torch.optim.Adam, lr=0.01)
    _assert_same(ours, local, "Adam")
    state, local_state = opt.state_dict()["state"], local_opt.state_dict()["state"]
    assert state.keys() == local_state.keys()
    for index in state:
        torch.testing.assert_close(state[index]["exp_avg_sq"], local_state[index]["exp_avg_sq"])
    # Clipping reaches the gradients held by both owners.
    x = torch.ones(2, 4)
    layer = rpc.remote("ps_a", _make_layer, args=(7,))
    params = rpc.rpc_sync("ps_a", _layer_params, (layer,))
    clipped = metadist_optim.DistributedOptimizer(torch.optim.SGD, params, lr=1.0)
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("ps_a", _layer_forward, args=(layer, x))
        dist_autograd.backward(context_id, [out.sum() * 100])
        total = clipped.clip_grad_norm_(context_id, max_norm=1.0)
    assert total.item() > 1.0


def _square_sum(x: torch.Tensor) -> torch.Tensor:
    return (x**2).sum()


def remote_calls_and_autograd(world_size: int) -> None:
    x = torch.arange(6.0, requires_grad=True)
    with metadist.autograd.context() as context_id:
        parts = metadist.remote_sync_call(
            _square_sum, args=(x,), partitioner=metadist.batch_partitioner
        )
        assert len(parts) == world_size  # one partition per worker, by the user's names
        loss = metadist.sum_reducer(parts)
        metadist.autograd.backward(context_id, [loss])
    assert loss.item() == (torch.arange(6.0) ** 2).sum().item()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 2 * torch.arange(6.0))
    on_b = metadist.remote_sync_call(_square_sum, args=(torch.ones(3),), partitioner="ps_b")
    assert [t.item() for t in on_b] == [3.0]


def _own_rpc(x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("ps_b", _square_sum, args=(x,))


def rref_calls_attached_and_hidden_rpc_refused(world_size: int) -> None:
    import metadist.optim as metadist_optim

    _, theirs = _train_remote(metadist_optim, torch.optim.SGD, lr=0.1)
    _, ours = _train_remote(metadist_optim, torch.optim.SGD, _metadist_forward, lr=0.1)
    _assert_same(ours, theirs, "metadist calls with RRef arguments vs torch's rpc_sync")
    # A partition's own RPC with tensors that require grad, in a call that travels detached:
    # its gradients would be lost, so the call is refused, naming the fix.
    x = torch.ones(3, requires_grad=True)
    with metadist.autograd.context(), pytest.raises(RuntimeError, match="Pass the RRef"):
        metadist.remote_sync_call(_own_rpc, args=(x,), partitioner="ps_a")
    # Outside a context torch records nothing either: the same as its own RPC there (the
    # result is a leaf that requires grad, linked to nothing).
    (y,) = metadist.remote_sync_call(_own_rpc, args=(x,), partitioner="ps_a")
    theirs = rpc.rpc_sync("ps_a", _own_rpc, args=(x,))
    assert y.item() == theirs.item() == 3.0
    assert y.requires_grad == theirs.requires_grad
    assert torch.autograd.grad(y, x, allow_unused=True) == (None,)


SCENARIOS: list[Callable[[int], Any]] = [
    world_info_is_the_users,
    rref_calls_attached_and_hidden_rpc_refused,
    distributed_optimizer_equals_torch_and_local,
    optimizer_state_dict_and_clipping,
    remote_calls_and_autograd,
]


# ---------------------------------------------------------------------------------------------
# The world: started with rpc.init_rpc, as the tutorial does


def _user_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    # The tutorial rendezvous with env://, whose store listens on every interface; a test keeps
    # to loopback with metadist's loopback store. Nothing else of metadist runs before init_rpc.
    network.install_rendezvous_handlers()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"{network.LOOPBACK_SCHEME}://127.0.0.1:{port}", _transports=["uv"]
    )
    rpc.init_rpc(NAMES[rank], rank=rank, world_size=len(NAMES), rpc_backend_options=options)
    try:
        if rank == 2:
            metadist.barrier(["trainer", "ps_b"], timeout=60)
        if rank == 0:
            results: dict[str, str | None] = {}
            for scenario in SCENARIOS:
                try:
                    scenario(len(NAMES))
                except Exception:
                    results[scenario.__name__] = traceback.format_exc()
                else:
                    results[scenario.__name__] = None
            Path(out).write_text(json.dumps(results))
    finally:
        rpc.shutdown()  # the program's own shutdown: waits for every worker


@pytest.fixture(scope="module")
def user_world() -> Scenarios:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "results.json")
        context = mp.start_processes(
            _user_worker,
            args=(network.free_loopback_port(), out),
            nprocs=len(NAMES),
            join=False,
            start_method="spawn",
        )
        error = None
        deadline = time.monotonic() + 150
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError("the world started with rpc.init_rpc exceeded 150 s")
        except Exception as failure:
            error = f"{type(failure).__name__}: {failure}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
        results = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    return Scenarios(results, error)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_in_a_world_started_with_init_rpc(user_world: Scenarios, scenario: str) -> None:
    user_world.check(scenario)


def test_torch_still_lets_metadist_list_the_workers() -> None:
    # metadist.world reads the worker list from torch's private agent accessor (torch has no
    # public one); if torch renames it, this says so before any user world breaks.
    from torch.distributed.rpc import api

    for name in ("_is_current_rpc_agent_set", "_get_current_rpc_agent"):
        assert callable(getattr(api, name, None)), (
            f"torch.distributed.rpc.api.{name} is gone: update metadist.world._running_rpc_agent"
        )
    assert world._running_rpc_agent() is None  # no RPC in this process
    assert not world.in_rpc_world()


# ---------------------------------------------------------------------------------------------
# A torchopt.distributed program, with only its import changed

TORCHOPT_DIR = REPO / ".bench-deps" / "torchopt"
FEWSHOT = REPO / "tests" / "scripts" / "torchopt_fewshot.py"
TORCHOPT_IMPORT = "import torchopt.distributed as todist\n"


def _numbers(stdout: str) -> list[float]:
    lines = [line for line in stdout.splitlines() if line.startswith(("STEP", "FINAL"))]
    assert len(lines) == 4, stdout
    return [float(value) for line in lines for value in re.findall(r"=?(-?\d+\.\d+)", line)]


@pytest.mark.timeout(240)
def test_torchopt_fewshot_program_runs_with_only_the_import_changed(tmp_path: Path) -> None:
    if not (TORCHOPT_DIR / "torchopt" / "__init__.py").is_file():
        skip_or_fail(
            "torchopt 0.7.3 is not in .bench-deps/torchopt (metadist does not depend on it); "
            "`make bench-deps` installs it there"
        )
    source = FEWSHOT.read_text()
    assert source.count(TORCHOPT_IMPORT) == 1
    switched = tmp_path / "fewshot_metadist.py"
    switched.write_text(source.replace(TORCHOPT_IMPORT, "import metadist as todist\n"))
    # TorchOpt leaves TensorPipe's interface to torch; keep both runs on loopback.
    env = {
        "PYTHONPATH": f"{REPO}{os.pathsep}{TORCHOPT_DIR}",
        "TP_SOCKET_IFNAME": "lo",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    runs = {}
    for name, script in (("torchopt", FEWSHOT), ("metadist", switched)):
        result = run_torchrun(script, 2, timeout=200, env=env, cwd=tmp_path)
        assert result.returncode == 0, f"{name}:\n{result.stdout}\n{result.stderr}"
        runs[name] = _numbers(result.stdout)
    # Same losses, accuracies, meta-gradient norms and final weights; the last digits may
    # differ with the order in which the workers' gradients are summed.
    assert runs["metadist"] == pytest.approx(runs["torchopt"], rel=1e-6, abs=1e-7)
    assert all(abs(value) > 0 for value in runs["metadist"][2::3][:3]), "no meta-gradient"


# torch's own rpc.shutdown warns about its Gloo group; metadist is not involved there.
@pytest.mark.filterwarnings("ignore:You are using a Backend:UserWarning")
def test_a_restarted_user_world_is_a_new_world(monkeypatch: pytest.MonkeyPatch) -> None:
    # Caches keyed on the world (which module structures a worker holds) must not survive
    # rpc.shutdown() and a new rpc.init_rpc, even under the same names.
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    network.install_rendezvous_handlers()
    tokens = []
    for _ in range(2):
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"{network.LOCAL_SCHEME}://", _transports=["uv"]
        )
        rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options)
        try:
            assert metadist.get_worker_names() == ("solo",)
            assert world.world_token() is world.world_token()
            tokens.append(world.world_token())
            metadist.barrier()
            metadist.barrier()  # a second barrier is a new rendezvous, not the first one again
        finally:
            rpc.shutdown()
        assert not world.in_rpc_world()
    assert tokens[0] is not tokens[1]
