"""The engine: torch RPC's own round trips, and metadist's calls against hand-written RPC.

Spawns its own world of 3 over loopback (rank 0 drives; ``auto_init_rpc``'s TensorPipe over TCP
with tensors inside the connection) and prints, measured side by side in one run (rounds
alternate between the variants; medians over rounds):

0. torch RPC alone: an empty round trip (``rpc_sync`` of a no-op, no arguments) and 10 small
   tensors each way (an echo of ten 64-float tensors);

1. one call to one worker: ``remote_sync_call(f, partitioner=1)`` vs ``rpc.rpc_sync(1, f)``
   (target ratio <= 1.10);
2. a map/reduce over all workers: ``remote_sync_call(f, reducer=sum_reducer)`` with the default
   batch partitioner vs a hand-written ``tensor_split`` + ``rpc_async`` fan-out + sum
   (target ratio <= 1.10);
3. bytes put on the wire per call for a ~1M-parameter model argument: the module pickled whole
   (what plain RPC / TorchOpt send, and not differentiable), metadist's first call (structure +
   tensors), later calls (tensors only, structure cached), and later calls with bf16.

The bytes of (3) are computed with metadist's transport internals; where those changed, that
section says it is skipped.

``--channels`` measures TensorPipe's tensor channels instead: a world of 2 of plain
``torch.distributed.rpc`` over TCP per channel (torch's default choice, which picks the
cross-memory-attach ``cma`` between processes of one machine; ``basic``, tensors inside the TCP
connection, metadist's default; ``cma``), channels alternating, rank 0 echoing one float tensor
of each ``--sizes`` (in floats) through rank 1: the median round trip over ``--rounds`` worlds
and its min-max.

Usage: python benchmarks/bench_remote.py [--calls 200] [--rounds 15] [--quick] [--channels]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn

import metadist
from metadist import structure, transport
from metadist.api import remote_sync_call
from metadist.messages import CallerState, Request
from metadist.network import free_loopback_port
from metadist.reduce import sum_reducer
from metadist.worker import run_partition

WORLD_SIZE = 3


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def noop() -> None:
    return None


def echo_all(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return xs


def partial_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _compare(
    ours: Callable[[], Any], theirs: Callable[[], Any], calls: int, rounds: int
) -> tuple[float, float]:
    for _ in range(max(10, calls // 10)):  # warm up both paths
        ours()
        theirs()
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        if r % 2:  # alternate the order so that neither always runs first
            b.append(_per_call(theirs, calls))
            a.append(_per_call(ours, calls))
        else:
            a.append(_per_call(ours, calls))
            b.append(_per_call(theirs, calls))
    return statistics.median(a), statistics.median(b)


def _wire_bytes(obj: Any) -> int:
    """Bytes RPC puts on the wire for ``obj``: pickled payload plus tensor data."""
    # RPC's own pickler (internal, used here only to measure what RPC would send).
    from torch.distributed.rpc.internal import _internal_rpc_pickler

    payload, tensors = _internal_rpc_pickler.serialize(obj)
    return len(payload) + sum(t.untyped_storage().nbytes() for t in tensors)


def _model() -> nn.Module:
    # 1,002,010 parameters (+ BatchNorm buffers).
    return nn.Sequential(
        nn.Conv2d(3, 64, 3),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 6 * 6, 432),
        nn.ReLU(),
        nn.Linear(432, 10),
    )


def _driver(calls: int, rounds: int) -> None:
    print(f"world of {WORLD_SIZE} over loopback; {calls} calls x {rounds} rounds, medians")
    small = tuple(torch.randn(64) for _ in range(10))
    empty, tensors10 = _compare(
        lambda: rpc.rpc_sync(1, noop), lambda: rpc.rpc_sync(1, echo_all, args=small), calls, rounds
    )
    print(f"{'torch RPC: empty round trip':<34} {empty * 1e3:10.3f}ms")
    print(f"{'torch RPC: 10 small tensors each way':<34} {tensors10 * 1e3:10.3f}ms\n")
    print(f"{'case':<34} {'torch rpc':>12} {'metadist':>12} {'ratio':>7} {'target':>7}")

    x = torch.randn(256)
    ours, theirs = _compare(
        lambda: remote_sync_call(echo, args=(x,), partitioner=1),
        lambda: rpc.rpc_sync(1, echo, args=(x,)),
        calls,
        rounds,
    )
    print(
        f"{'one worker (1 KiB tensor)':<34} {theirs * 1e6:10.1f}us {ours * 1e6:10.1f}us "
        f"{ours / theirs:7.3f} {'<=1.10':>7}",
        flush=True,
    )

    batch = torch.randn(300, 64)
    names = metadist.get_worker_names()

    def fan_out() -> torch.Tensor:
        chunks = torch.tensor_split(batch, len(names))
        futures = [
            rpc.rpc_async(n, partial_sum, args=(c,)) for n, c in zip(names, chunks, strict=True)
        ]
        return torch.stack([f.wait() for f in futures]).sum(0)

    ours, theirs = _compare(
        lambda: remote_sync_call(partial_sum, args=(batch,), reducer=sum_reducer),
        fan_out,
        calls,
        rounds,
    )
    print(
        f"{f'map/reduce over {len(names)} workers':<34} {theirs * 1e6:10.1f}us "
        f"{ours * 1e6:10.1f}us {ours / theirs:7.3f} {'<=1.10':>7}",
        flush=True,
    )

    model = _model()
    try:
        _bytes(model)
    except (AttributeError, ImportError, TypeError) as exc:  # metadist's internals changed
        print(f"\nbytes per call: skipped ({type(exc).__name__}: {exc})")
    _module_latency(model, calls, rounds)


def _bytes(model: nn.Module) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    inputs = torch.randn(8, 3, 8, 8)
    whole = _wire_bytes((echo, (model, inputs), {}))
    memo = transport.CallMemo()
    token = object()
    first = transport.encode((model, inputs), {}, world=token, worker="w", dtype=None, memo=memo)
    structure.mark_structure_confirmed(token, "w", first[3])
    later = transport.encode((model, inputs), {}, world=token, worker="w", dtype=None, memo=memo)
    packed = transport.encode(
        (model, inputs),
        {},
        world=token,
        worker="w",
        dtype=torch.bfloat16,
        memo=transport.CallMemo(),
    )
    size = len(structure.plan_for(model, str)[0].structure)

    def sent(encoded: tuple[Any, ...]) -> int:
        request = Request(
            func=echo,
            args=encoded[0],
            kwargs=encoded[1],
            decode=True,
            compression=None,
            state=CallerState.here(),
            graph=1,
            attached=False,
            in_context=False,
            timed=False,
            release=(),
        )
        return _wire_bytes((run_partition, (request,), {}))

    print(f"\nbytes per call, model argument with {n_params:,} parameters (+ a 6 KiB input):")
    print(f"  module pickled whole (plain RPC)     {whole:>12,}  (parameters arrive detached)")
    print(f"  metadist, first call to a worker    {sent(first):>12,}  (structure {size:,} B)")
    print(f"  metadist, structure cached          {sent(later):>12,}")
    print(f"  metadist, cached + bf16             {sent(packed):>12,}")
    pickled = len(pickle.dumps(model))
    print(f"  (for scale: pickle.dumps(model) is  {pickled:>12,})")


def _module_latency(model: nn.Module, calls: int, rounds: int) -> None:
    # End-to-end latency of a module-argument call (structure cached after the first call).
    # End-to-end latency with a module argument vs raw RPC of the same tensors.
    tensors = [t.detach() for t in (*model.parameters(), *model.buffers())]
    ours, theirs = _compare(
        lambda: remote_sync_call(_touch, args=(model,), partitioner=1),
        lambda: rpc.rpc_sync(1, _count, args=(tensors,)),
        max(3, calls // 20),
        rounds,
    )
    print(
        f"\n{'module argument, 1 worker':<34} {theirs * 1e3:10.2f}ms {ours * 1e3:10.2f}ms "
        f"{ours / theirs:7.3f}   (raw: the same tensors as a list)"
    )


def _count(tensors: list[torch.Tensor]) -> int:
    return len(tensors)


def _touch(model: nn.Module) -> int:
    return len(model._parameters) + len(model._modules)


def _child(rank: int, port: int, calls: int, rounds: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)

    @metadist.auto_init_rpc()
    def main() -> None:
        if rank == 0:
            _driver(calls, rounds)

    main()


CHANNELS = ("default", "basic", "cma")


def _channel_child(rank: int, port: int, channel: str, sizes: list[int], out: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # shutdown's gloo notice
    chosen = {} if channel == "default" else {"_channels": [channel]}
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", _transports=["uv"], **chosen
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    try:
        if rank == 0:
            medians = {}
            for n in sizes:
                x = torch.randn(n)
                calls = 40 if n >= 1 << 20 else 200
                times = []
                for _ in range(calls + 10):
                    start = time.perf_counter()
                    rpc.rpc_sync("worker1", echo, args=(x,))
                    times.append(time.perf_counter() - start)
                medians[str(n)] = statistics.median(times[10:]) * 1e3
            Path(out).write_text(json.dumps(medians))
    finally:
        rpc.shutdown()


def channels(rounds: int, sizes: list[int]) -> None:
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CHANNELS}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        for _ in range(rounds):
            for channel in CHANNELS:
                port = free_loopback_port()
                mp.spawn(_channel_child, args=(port, channel, sizes, out), nprocs=2)
                runs[channel].append(json.loads(Path(out).read_text()))
    print(f"round trip, ms: median [min-max] over {rounds} worlds (torch {torch.__version__})")
    print(f"{'size':>12} " + " ".join(f"{c:>22}" for c in CHANNELS))
    for n in sizes:
        cells = []
        for channel in CHANNELS:
            values = [r[str(n)] for r in runs[channel]]
            cells.append(f"{statistics.median(values):8.3f} [{min(values):.3f}-{max(values):.3f}]")
        print(f"{f'{n * 4 / 1000:g} KB':>12} " + " ".join(f"{c:>22}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    parser.add_argument("--quick", action="store_true", help="few calls, for a smoke run")
    parser.add_argument("--channels", action="store_true", help="TensorPipe's channels instead")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 250_000, 4_000_000])
    args = parser.parse_args()
    if args.channels:
        channels(args.rounds, args.sizes)
        return
    calls, rounds = (20, 3) if args.quick else (args.calls, args.rounds)
    mp.start_processes(
        _child,
        args=(free_loopback_port(), calls, rounds),
        nprocs=WORLD_SIZE,
        join=True,
        start_method="spawn",
    )


if __name__ == "__main__":
    main()
