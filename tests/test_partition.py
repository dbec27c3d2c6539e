"""Property tests of the partitioners (pure: no RPC)."""

from __future__ import annotations

import pickle
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_flatten, tree_structure

from metadist.partition import (
    DimPartitioner,
    Partitions,
    dim_partitioner,
    split_sizes,
)

# Both kinds of namedtuple: torch's pytree recognises them by shape, not by a registered type.
Pair = namedtuple("Pair", ["x", "y"])


class Batch(NamedTuple):
    inputs: Any
    labels: Any


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


def _check_split(
    args: tuple[Any, ...], kwargs: dict[str, Any], parts: Partitions, dim: int, workers: list[int]
) -> None:
    """Each partition has the original structure, holds exactly its slice of every tensor leaf
    (in order, so the slices reassemble to the original) and shares every other leaf."""
    leaves, spec = tree_flatten((args, kwargs))
    assert parts.sizes is not None
    assert [wid for wid, _, _ in parts] == workers[: len(parts)]
    offset = 0
    for (_, p_args, p_kwargs), size in zip(parts, parts.sizes, strict=True):
        p_leaves, p_spec = tree_flatten((p_args, p_kwargs))
        assert p_spec == spec  # same containers, namedtuple classes included
        for leaf, piece in zip(leaves, p_leaves, strict=True):
            if isinstance(leaf, torch.Tensor):
                assert torch.equal(piece, leaf.narrow(dim, offset, size))
            else:
                assert piece is leaf
        offset += size
    assert offset == next(t for t in leaves if isinstance(t, torch.Tensor)).shape[dim]


def test_top_level_namedtuples_are_split_not_copied_whole():
    x, y, t = torch.arange(8).reshape(4, 2), torch.arange(4) * 10, torch.arange(4) + 100
    part = dim_partitioner(0)
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((Pair(x, y),), {}),  # the only argument: used to raise "no tensor to split"
        ((t, Pair(x, y)), {}),  # next to a tensor: used to give every worker the whole x and y
        ((t,), {"batch": Batch(x, y)}),
        ((), {"batch": Batch(x, "labels"), "t": t}),
        ((Batch(Pair(x, [y, 3]), {"t": t}),), {}),  # nested namedtuples
        (([Pair(x, y)],), {"d": {"p": Batch(t, y)}}),  # namedtuples below plain containers
        ((OrderedDict(x=x, y=y), defaultdict(list, t=[t])), {}),
        ((torch.max(x, 1),), {}),  # a structseq return type: a pytree node too
    ]
    for args, kwargs in cases:
        parts = part.split(args, kwargs, worker_ids=[0, 1, 2])
        assert parts.sizes == (2, 1, 1)
        _check_split(args, kwargs, parts, 0, [0, 1, 2])
    _, (_, pair), _ = part.split((t, Pair(x, y)), {}, worker_ids=[0, 1])[0]
    assert type(pair) is Pair
    assert pair.x.tolist() == [[0, 1], [2, 3]]
    assert pair.y.tolist() == [0, 10]


def test_namedtuple_errors_name_the_field():
    with pytest.raises(ValueError, match=r"args\[0\]\.x has 4 .* args\[0\]\.y has 3"):
        dim_partitioner(0).split((Pair(torch.zeros(4), torch.zeros(3)),), {}, worker_ids=[0])
    with pytest.raises(ValueError, match=r"kwargs\['b'\]\.labels has shape \(\)"):
        dim_partitioner(0).split(
            (), {"b": Batch(torch.zeros(2), torch.tensor(1.0))}, worker_ids=[0]
        )


def _leaf(tensor: st.SearchStrategy[torch.Tensor]) -> st.SearchStrategy[Any]:
    return st.one_of(tensor, tensor, st.integers(), st.text(max_size=2), st.none())


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text("abc", min_size=1, max_size=2)
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.builds(Pair, children, children),
        st.builds(Batch, children, children),
        st.dictionaries(keys, children, max_size=3).map(OrderedDict),
        st.dictionaries(keys, children, max_size=3).map(lambda d: defaultdict(list, d)),
    )


@st.composite
def nested_batches(
    draw: st.DrawFn,
) -> tuple[tuple[Any, ...], dict[str, Any], int, list[int]]:
    n = draw(st.integers(1, 6))
    dim = draw(st.sampled_from([0, 1, -1]))
    counter = iter(range(1 << 30))

    def tensor(width: int) -> torch.Tensor:
        # Distinct values everywhere, so a piece taken from the wrong place cannot pass.
        base = next(counter) * 1000
        t = torch.arange(base, base + n * width).reshape(n, width)
        return t if dim == 0 else t.T.contiguous()

    tensors = st.integers(1, 3).map(tensor)
    tree = st.recursive(_leaf(tensors), _containers, max_leaves=8)
    # The top level is where the bug was: make namedtuples common there, args and kwargs alike.
    top = st.one_of(st.builds(Pair, tree, tree), st.builds(Batch, tree, tree), tree)
    args = tuple(draw(st.lists(top, max_size=3)))
    kwargs = draw(st.dictionaries(st.sampled_from(["a", "b", "c"]), top, max_size=2))
    anchor = tensor(1)  # at least one tensor, somewhere in a namedtuple
    if draw(st.booleans()):
        args = (Pair(anchor, draw(tree)), *args)
    else:
        kwargs["anchor"] = Batch(draw(tree), anchor)
    workers = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4))
    return args, kwargs, dim, workers


@settings(max_examples=150, deadline=None)
@given(nested_batches())
def test_every_tensor_leaf_of_nested_containers_is_split(
    case: tuple[tuple[Any, ...], dict[str, Any], int, list[int]],
):
    args, kwargs, dim, workers = case
    parts = dim_partitioner(dim).split(args, kwargs, worker_ids=workers)
    _check_split(args, kwargs, parts, dim % 2, workers)
    # The same structure, split one item per partition, agrees with the chunked split.
    exclusive = dim_partitioner(dim, exclusive=True).split(args, kwargs, worker_ids=workers)
    assert tree_structure(exclusive[0][1:]) == tree_structure((args, kwargs))
    _check_split(args, kwargs, exclusive, dim % 2, workers * len(exclusive))


def test_unknown_worker_error_names_the_workers_entry():
    part = dim_partitioner(0, workers=[0, 10**6])
    with pytest.raises(
        ValueError, match=r"dim_partitioner: workers\[1\]=1000000: unknown worker id 1000000: known"
    ):
        part(torch.zeros(4))


def test_argument_paths_name_leaves_as_the_user_wrote_them() -> None:
    from metadist._pytree import argument_path, tree_flatten_with_path

    pairs, _ = tree_flatten_with_path(((torch.ones(1), {"x": [1, 2]}), {"lr": 0.1}))
    assert [argument_path(path) for path, _ in pairs] == [
        "args[0]",
        "args[1]['x'][0]",
        "args[1]['x'][1]",
        "kwargs['lr']",
    ]


def test_schedule_is_static_or_dynamic():
    with pytest.raises(ValueError, match="schedule must be 'static' or 'dynamic', got 'balanced'"):
        dim_partitioner(0, schedule="balanced")
    with pytest.raises(ValueError, match="needs exclusive=True"):
        dim_partitioner(0, schedule="dynamic")
    assert dim_partitioner(0, exclusive=True, schedule="dynamic").schedule == "dynamic"
