"""One worker of a two-"node" job; tests/test_multinode.py runs it in two network namespaces."""

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
    if metadist.get_rank() == 0:
        doubled = rpc.rpc_sync("worker1", torch.mul, args=(torch.arange(3.0), 2))
        assert doubled.tolist() == [0.0, 2.0, 4.0], doubled
        name, addresses = rpc.rpc_sync("worker1", where)
        print(f"ROUNDTRIP OK peer={name} peer_listens={addresses}", flush=True)
        print(f"SELF listens={where()[1]}", flush=True)
    metadist.barrier()


if __name__ == "__main__":
    main()
