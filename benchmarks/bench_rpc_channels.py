"""Round trip of one RPC between two processes of this machine, per TensorPipe channel.

Both processes start plain ``torch.distributed.rpc`` over the TCP transport (``uv``, what
``metadist.auto_init_rpc`` uses) with one channel for tensor data: torch's default choice (which
picks the cross-memory-attach channel, ``cma``, between processes of one machine), ``basic``
(tensors inside the TCP connection, metadist's default) or ``cma``. Rank 0 sends a float tensor
and gets it back. It prints, per channel and size, the median round trip over ``--rounds`` worlds
(each the median of its calls) and the spread over the worlds; the channels alternate.

Run: ``python benchmarks/bench_rpc_channels.py`` (``--rounds``, ``--sizes`` in floats).
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


def echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _child(rank: int, port: int, channel: str, sizes: list[int], out: str) -> None:
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
                medians[n] = statistics.median(times[10:]) * 1e3
            Path(out).write_text(json.dumps(medians))
    finally:
        rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 250_000, 4_000_000])
    opts = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in CHANNELS}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        for _ in range(opts.rounds):
            for channel in CHANNELS:
                port = free_loopback_port()
                mp.spawn(_child, args=(port, channel, opts.sizes, out), nprocs=2)
                runs[channel].append(json.loads(Path(out).read_text()))
    print(f"round trip, ms: median [min-max] over {opts.rounds} worlds (torch {torch.__version__})")
    print(f"{'size':>10} " + " ".join(f"{c:>22}" for c in CHANNELS))
    for n in opts.sizes:
        cells = []
        for channel in CHANNELS:
            values = [r[str(n)] for r in runs[channel]]
            cells.append(f"{statistics.median(values):8.3f} [{min(values):.3f}-{max(values):.3f}]")
        print(f"{n * 4 // 1000:>7} KB " + " ".join(f"{c:>22}" for c in cells))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
