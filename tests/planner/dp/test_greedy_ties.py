"""The greedy's snapping breaks ties towards the earlier boundary (ties are broken by
index). A cut target exactly halfway between two allowed boundaries must go to the earlier one;
no other test puts a target on such a tie."""

from __future__ import annotations

import numpy as np
import pytest

from canzona.planner.dp.greedy import _snap, greedy
from canzona.planner.dp.units import Units
from canzona.planner.layout import ParallelSizes
from canzona.planner.planning import make_problem


def test_snap_takes_the_earlier_of_two_equally_near_boundaries():
    u = Units(np.array([0, 256, 512, 768], dtype=np.int64), np.array([0.0, 1.0, 2.0, 3.0]), 0.0)
    assert _snap(u, 384.0, 0) == 1  # 128 from 256 and from 512
    assert _snap(u, 383.0, 0) == 1 and _snap(u, 385.0, 0) == 2  # off the tie: the nearer one
    assert _snap(u, 384.0, 2) == 2  # not before lo


def test_greedy_cuts_a_tie_at_the_earlier_matrix_boundary():
    """Three equal matrices in one bucket, dp = 2: the half-load target falls in the middle of
    the second matrix, as near its start as its end; the cut goes to its start."""
    torch = pytest.importorskip("torch")
    from canzona.runtime.introspect import inventory

    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16, bias=False) for _ in range(3)))
    problem = make_problem(inventory(model), ParallelSizes(2, 1), bucket_size=None)
    (b,) = problem.buckets
    bounds = [it.start for it in b.items] + [b.items[-1].end]
    assert bounds == [0, 256, 512, 768]
    assert greedy(problem)[(b.buffer, b.bucket)] == (0, 256, 768)
