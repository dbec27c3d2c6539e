"""torch's own ``DistOptimizerTest`` cases, run against metadist's DistributedOptimizer.

torch's test module is imported as it ships (``torch.testing._internal``), its
``DistributedOptimizer`` swapped for metadist's, and each case's undecorated body run on rank 0 of
a real world of 3 (torch's fixture would start RPC itself).
"""

from __future__ import annotations

import sys
import types
import unittest

import pytest
from _dist import run_world

CASES = (
    "test_dist_optim",
    "test_dist_optim_none_grads",
    "test_dist_optim_exception",
    "test_dist_optim_exception_on_constructor",
)


def _torch_cases(rank: int, world_size: int) -> None:
    # torch's test utilities import expecttest, which only their own tests need: a stand-in.
    stub = types.ModuleType("expecttest")
    stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    sys.modules.setdefault("expecttest", stub)
    import torch.testing._internal.distributed.rpc.dist_optimizer_test as cases
    from torch.testing._internal.common_utils import TestCase

    if rank != 0:
        return  # serve rank 0's calls (every rank imports the module their calls name)
    import metadist.optim

    cases.DistributedOptimizer = metadist.optim.DistributedOptimizer  # type: ignore[misc]

    class Runner(TestCase):  # type: ignore[misc]
        rank, world_size = 0, 3
        _test_dist_optim_base = cases.DistOptimizerTest._test_dist_optim_base
        _test_dist_optim_none_grads = cases.DistOptimizerTest._test_dist_optim_none_grads

        def runTest(self) -> None:  # noqa: N802 (unittest's name)
            pass

    runner = Runner()
    for name in CASES:
        getattr(cases.DistOptimizerTest, name).__wrapped__(runner)  # without torch's dist_init


@pytest.mark.timeout(300)
def test_torch_dist_optimizer_test_cases() -> None:
    run_world(_torch_cases, 3, timeout=240)
