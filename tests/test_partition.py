"""Property tests of the partitioners (pure: no RPC)."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from metadist.partition import DimPartitioner, Partitions, dim_partitioner, split_sizes


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, int, list[int]]:
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    workers = draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
    tensor = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    return tensor, dim, workers


@settings(max_examples=150, deadline=None)
@given(batches())
def test_chunks_cover_the_batch_once_and_are_balanced(case: tuple[torch.Tensor, int, list[int]]):
    tensor, dim, workers = case
    n = tensor.shape[dim]
    parts = dim_partitioner(dim).split((tensor, "meta"), {"y": tensor * 2}, worker_ids=workers)
    sizes = [args[0].shape[dim] for _, args, _ in parts]
    assert isinstance(parts, Partitions)
    assert parts.sizes == tuple(sizes)
    assert len(parts) == min(n, len(workers))
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == n
    assert [wid for wid, _, _ in parts] == workers[: len(parts)]
    assert torch.equal(torch.cat([args[0] for _, args, _ in parts], dim), tensor)
    assert torch.equal(torch.cat([kw["y"] for _, _, kw in parts], dim), tensor * 2)
    assert all(args[1] == "meta" for _, args, _ in parts)


@settings(max_examples=150, deadline=None)
@given(batches(), st.booleans())
def test_exclusive_gives_one_item_per_partition_round_robin(
    case: tuple[torch.Tensor, int, list[int]], keepdim: bool
):
    tensor, dim, workers = case
    n = tensor.shape[dim]
    parts = dim_partitioner(dim, exclusive=True, keepdim=keepdim).split(
        ([tensor],), {}, worker_ids=workers
    )
    assert len(parts) == n
    assert parts.sizes == (1,) * n
    assert [wid for wid, _, _ in parts] == [workers[j % len(workers)] for j in range(n)]
    pieces = [args[0][0] for _, args, _ in parts]
    if keepdim:
        assert all(p.dim() == tensor.dim() for p in pieces)
        assert torch.equal(torch.cat(pieces, dim), tensor)
    else:
        assert all(p.dim() == tensor.dim() - 1 for p in pieces)
        assert torch.equal(torch.stack(pieces, dim), tensor)


@settings(deadline=None)
@given(st.integers(1, 200), st.integers(1, 20))
def test_split_sizes(n: int, k: int):
    sizes = split_sizes(n, k)
    assert sum(sizes) == n
    assert len(sizes) == min(n, k)
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_uneven_split_is_balanced_not_dumped_on_the_last_worker():
    parts = dim_partitioner(0).split((torch.zeros(10, 2),), {}, worker_ids=[0, 1, 2, 3])
    assert parts.sizes == (3, 3, 2, 2)  # TorchOpt gives (2, 2, 2, 4)


def test_fewer_items_than_workers_gives_fewer_partitions():
    parts = dim_partitioner(0).split((torch.zeros(2),), {}, worker_ids=[0, 1, 2])
    assert [wid for wid, _, _ in parts] == [0, 1]


def test_non_tensor_leaves_modules_and_parameters_are_replicated():
    model = nn.Linear(2, 2)
    weight = model.weight
    parts = dim_partitioner(0).split(
        (model, {"x": torch.zeros(4, 2), "w": weight, "k": 3}), {"flag": True}, worker_ids=[0, 1]
    )
    for _, (m, tree), kwargs in parts:
        assert m is model
        assert tree["w"] is weight
        assert tree["k"] == 3
        assert tree["x"].shape == (2, 2)
        assert kwargs == {"flag": True}


def test_bad_input_names_the_argument():
    part = dim_partitioner(0)
    with pytest.raises(ValueError, match=r"kwargs\['y'\] has 3"):
        part.split((torch.zeros(4),), {"y": torch.zeros(3)}, worker_ids=[0])
    with pytest.raises(ValueError, match=r"empty batch: args\[0\]\[1\]"):
        part.split(((1, torch.zeros(0, 2)),), {}, worker_ids=[0])
    with pytest.raises(ValueError, match=r"args\[1\] has shape \(\)"):
        part.split((torch.zeros(2), torch.tensor(1.0)), {}, worker_ids=[0])
    with pytest.raises(ValueError, match=r"dim 2 is out of range"):
        dim_partitioner(2).split((torch.zeros(2, 2),), {}, worker_ids=[0])
    with pytest.raises(ValueError, match="no tensor"):
        part.split((1, "a"), {}, worker_ids=[0])
    with pytest.raises(ValueError, match="exclusive=True"):
        dim_partitioner(0, keepdim=False)
    with pytest.raises(TypeError, match="dim must be an int"):
        dim_partitioner("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wrap a single worker"):
        dim_partitioner(0, workers=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        dim_partitioner(0, workers=[])


def test_partitioners_pickle_round_trip():
    part = dim_partitioner(1, exclusive=True, keepdim=False, workers=["worker1", 0])
    clone = pickle.loads(pickle.dumps(part))
    assert isinstance(clone, DimPartitioner)
    assert clone == part
    assert repr(clone) == repr(part)
    x = torch.arange(6).reshape(2, 3)
    a = part.split((x,), {}, worker_ids=[1, 0])
    b = clone.split((x,), {}, worker_ids=[1, 0])
    assert [(w, args[0].tolist()) for w, args, _ in a] == [
        (w, args[0].tolist()) for w, args, _ in b
    ]
