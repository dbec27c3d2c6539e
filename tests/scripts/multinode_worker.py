"""One worker of a job started by a test as a launcher would (torchrun, srun or mpirun).

tests/test_multinode.py runs it in two network namespaces; tests/test_launch.py runs it
with only SLURM's or Open MPI's variables. Every worker prints what metadist made of them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.rpc as rpc

import metadist


def where() -> tuple[str, list[str]]:
    from _dist import listening_addresses

    addresses = sorted({address for address, _ in listening_addresses()})
    return metadist.get_worker_name(), addresses


@metadist.auto_init_rpc()
def main() -> None:
    assert "TP_SOCKET_IFNAME" not in os.environ, "metadist must not leak its interface choice"
    info = metadist.get_world_info()
    print(
        f"INFO rank={info.world_rank} size={info.world_size} local_rank={info.local_rank} "
        f"local_size={info.local_world_size} name={metadist.get_worker_name()}",
        flush=True,
    )
    if metadist.get_rank() == 0:
        doubled = rpc.rpc_sync("worker1", torch.mul, args=(torch.arange(3.0), 2))
        assert doubled.tolist() == [0.0, 2.0, 4.0], doubled
        name, addresses = rpc.rpc_sync("worker1", where)
        print(f"ROUNDTRIP OK peer={name} peer_listens={addresses}", flush=True)
        print(f"SELF listens={where()[1]}", flush=True)
    metadist.barrier()


if __name__ == "__main__":
    main()
