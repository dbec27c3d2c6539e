"""Tests of the reducers (pure: no RPC)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metadist.partition import dim_partitioner
from metadist.reduce import (
    PartitionResults,
    cat_reducer,
    mean_reducer,
    stack_reducer,
    sum_reducer,
)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 6))
def test_mean_of_partition_means_equals_full_batch_mean(n: int, k: int):
    x = torch.randn(n, 3, dtype=torch.float64)
    parts = dim_partitioner(0).split((x,), {}, worker_ids=list(range(k)))
    results = PartitionResults([args[0].mean(0) for _, args, _ in parts], parts.sizes)
    torch.testing.assert_close(mean_reducer(results), x.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum_reducer(results * 1), sum(r for r in results))
    chunks = PartitionResults([args[0] for _, args, _ in parts], parts.sizes)
    assert torch.equal(cat_reducer(chunks), x)


def test_uneven_mean_is_weighted_and_plain_list_is_not():
    results = [torch.tensor(1.0), torch.tensor(4.0)]
    assert mean_reducer(PartitionResults(results, sizes=(3, 1))).item() == pytest.approx(1.75)
    assert mean_reducer(results).item() == pytest.approx(2.5)
    assert mean_reducer(PartitionResults([2.0, 5.0], sizes=(1, 2))) == pytest.approx(4.0)


def test_reducers_work_on_pytrees():
    results = PartitionResults(
        [
            (torch.tensor(1.0), {"acc": 0.5, "n": torch.tensor([1, 2])}),
            (torch.tensor(3.0), {"acc": 1.0, "n": torch.tensor([3, 4])}),
        ],
        sizes=(1, 3),
    )
    loss, extra = mean_reducer(results)
    assert loss.item() == pytest.approx(2.5)
    assert extra["acc"] == pytest.approx(0.875)
    assert extra["n"].dtype == torch.get_default_dtype()
    torch.testing.assert_close(extra["n"], torch.tensor([2.5, 3.5]))
    total = sum_reducer(results)
    assert total[0].item() == 4.0
    assert total[1]["acc"] == 1.5
    stacked = stack_reducer(results)
    assert stacked[0].tolist() == [1.0, 3.0]
    assert stacked[1]["acc"] == [0.5, 1.0]
    pairs = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    assert functools.partial(stack_reducer, dim=1)(pairs).tolist() == [[1, 3], [2, 4]]


def test_mean_reducer_is_differentiable():
    w = torch.ones(2, requires_grad=True)
    results = PartitionResults([(w * 2).sum(), (w * 4).sum()], sizes=(1, 3))
    mean_reducer(results).backward()
    torch.testing.assert_close(w.grad, torch.full((2,), (2 * 1 + 4 * 3) / 4))


def test_bad_results_are_reported():
    with pytest.raises(ValueError, match="no partition results"):
        mean_reducer([])
    with pytest.raises(ValueError, match="partition 1 returned a result of a different structure"):
        mean_reducer([(1.0, 2.0), (1.0,)])
    with pytest.raises(TypeError, match=r"result\[1\] must be all tensors or all numbers"):
        sum_reducer([(1.0, "a"), (1.0, "b")])
    with pytest.raises(ValueError, match="different shapes"):
        mean_reducer([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="cannot concatenate"):
        cat_reducer([torch.zeros(2, 2), torch.zeros(2, 3)], dim=0)
    with pytest.raises(TypeError, match="list of partition results"):
        mean_reducer(torch.zeros(2))  # type: ignore[arg-type]
