"""Alike states computed once (``canzona.planner.alike``): over a sweep of sizes, what the two
searches that keep costs by state return — the joint DP × TP refinement's cuts, the TP pair
search's placement and busiest index — and the plans made are identical to those of the slow
path, which computes every state anew; and the sweep does reuse kept costs."""

from __future__ import annotations

import pytest

from canzona.planner import ParallelSizes, alike, solve
from canzona.planner.pipeline import plan
from canzona.planner.sharing import candidates

SWEEP = [("qwen3-0.6b", 8, 2), ("qwen3-1.7b", 8, 4), ("qwen3-1.7b", 32, 4)]


def _recorded(monkeypatch) -> list:
    """What every joint refinement and TP pair search of the plans made returns, in order."""
    seen: list = []
    joint, search = solve.joint_refine, candidates.TPPairSearch

    def refine(*args, **kw):
        got = joint(*args, **kw)
        seen.append(("joint", sorted(got.items())))
        return got

    class Search(search):
        def improve(self, *args, **kw):
            got = super().improve(*args, **kw)
            seen.append(("tp pairs", list(self.where), self.busiest()))
            return got

    monkeypatch.setattr(solve, "joint_refine", refine)
    monkeypatch.setattr(candidates, "TPPairSearch", Search)
    return seen


@pytest.mark.filterwarnings("ignore::canzona.planner.errors.CanzonaWarning")
def test_searches_with_alike_states_shared_equal_the_slow_path(monkeypatch):
    seen = _recorded(monkeypatch)
    alike.REUSED.clear()
    fast = [plan(m, ParallelSizes(dp, tp)).to_json() for m, dp, tp in SWEEP]
    fast_seen = list(seen)
    assert alike.REUSED.get("joint", 0) > 0 and alike.REUSED.get("tp pairs", 0) > 0
    assert {k for k, *_ in fast_seen} == {"joint", "tp pairs"}
    seen.clear()
    alike.REUSED.clear()
    with alike.each_anew():
        slow = [plan(m, ParallelSizes(dp, tp)).to_json() for m, dp, tp in SWEEP]
    assert not alike.REUSED  # nothing kept was read
    assert fast_seen == seen
    for (m, dp, tp), a, b in zip(SWEEP, fast, slow):
        assert a == b, f"{m} dp{dp} tp{tp}"
