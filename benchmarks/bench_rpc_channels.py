"""Round trip of one RPC between two processes of this machine, per TensorPipe channel.

Both processes start plain ``torch.distributed.rpc`` over the TCP transport (``uv``, what
``metadist.auto_init_rpc`` uses) with one channel for tensor data: torch's default choice (which
picks the cross-memory-attach channel, ``cma``, between processes of one machine), ``basic``
(tensors inside the TCP connection, metadist's default) or ``cma``. Rank 0 sends float tensors
and gets them back: each size as one tensor, or (``--pieces``) as that many tensors of the same
total, which shows what each tensor of a message costs. It prints, per channel, size and pieces,
the median round trip over ``--rounds`` worlds (each the median of its calls) and the spread
over the worlds; the channels alternate.

Run: ``python benchmarks/bench_rpc_channels.py`` (``--rounds``, ``--sizes`` in floats,
``--pieces``, ``--channels``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from metadist.network import free_loopback_port

CHANNELS = ("default", "basic", "cma")


def echo(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return xs


def _child(
    rank: int, port: int, channel: str, shapes: tuple[list[int], list[int]], out: str
) -> None:
    sizes, pieces = shapes
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
                for k in pieces:
                    # separate tensors: views of one storage would each carry all of it
                    xs = tuple(torch.randn(len(c)) for c in torch.arange(n).tensor_split(k))
                    calls = 40 if n >= 1 << 20 else 200
                    times = []
                    for _ in range(calls + 10):
                        start = time.perf_counter()
                        rpc.rpc_sync("worker1", echo, args=xs)
                        times.append(time.perf_counter() - start)
                    medians[f"{n}/{k}"] = statistics.median(times[10:]) * 1e3
            Path(out).write_text(json.dumps(medians))
    finally:
        rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 250_000, 4_000_000])
    parser.add_argument("--pieces", type=int, nargs="+", default=[1], help="tensors per size")
    parser.add_argument("--channels", nargs="+", choices=CHANNELS, default=list(CHANNELS))
    opts = parser.parse_args()
    channels = opts.channels
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in channels}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        for _ in range(opts.rounds):
            for channel in channels:
                port = free_loopback_port()
                mp.spawn(_child, args=(port, channel, (opts.sizes, opts.pieces), out), nprocs=2)
                runs[channel].append(json.loads(Path(out).read_text()))
    print(f"round trip, ms: median [min-max] over {opts.rounds} worlds (torch {torch.__version__})")
    print(f"{'size':>20} " + " ".join(f"{c:>22}" for c in channels))
    for n in opts.sizes:
        for k in opts.pieces:
            cells = []
            for channel in channels:
                values = [r[f"{n}/{k}"] for r in runs[channel]]
                med = statistics.median(values)
                cells.append(f"{med:8.3f} [{min(values):.3f}-{max(values):.3f}]")
            label = f"{n * 4 / 1000:g} KB in {k}"
            print(f"{label:>20} " + " ".join(f"{c:>22}" for c in cells))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
