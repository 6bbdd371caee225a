"""Alike states computed once (``canzona.planner.alike``): over a sweep of sizes, the DP
partitions, what the two searches that keep costs by state return (the joint DP × TP
refinement's cuts, the TP pair search's placement and busiest index) and the plans made are
identical to those of the slow path, which computes every state anew; after each TP pair
search every index costs what it costs computed anew, and options its start skips as alike
an earlier one cost what that one does; the sweep does reuse kept costs and
per-bucket DP cuts; and a kept cut is reused for identical inputs only."""

from __future__ import annotations

import pytest

from canzona.planner import ParallelSizes, alike, solve
from canzona.planner.pipeline import plan
from canzona.planner.sharing import candidates

SWEEP = [("qwen3-0.6b", 8, 2), ("qwen3-1.7b", 8, 4), ("qwen3-1.7b", 32, 4)]


def _recorded(monkeypatch) -> list:
    """What every joint refinement and TP pair search of the plans made returns, in order."""
    seen: list = []
    joint, search, partition = solve.joint_refine, candidates.TPPairSearch, candidates.solve

    def partitioned(*args, **kw):
        got = partition(*args, **kw)
        seen.append(("partition", sorted(got.cuts.items())))
        return got

    def refine(*args, **kw):
        got = joint(*args, **kw)
        seen.append(("joint", sorted(got.items())))
        return got

    class Search(search):
        def _alike(self, place, i):
            # options alike cost alike: what each costs, kept by item and signature
            sig = super()._alike(place, i)
            got = self._costs({place[1]: self.whole[place[1]] + [i]}, {}, {place[1]}) \
                if place[0] == "w" else \
                self._costs({}, {place[1]: self.shared[place[1]] + [i]}, set(self.indices(place)))
            assert sorted(got.values()) == \
                self.__dict__.setdefault("alike", {}).setdefault((i, sig), sorted(got.values()))
            return sig

        def improve(self, *args, **kw):
            got = super().improve(*args, **kw)
            seen.append(("tp pairs", list(self.where), self.busiest()))
            # every index as placed costs what it costs computed anew (its kept key followed
            # the moves)
            kept = [self._costs({}, {}, {d})[d] for d in range(self.dp)]
            with alike.each_anew():
                assert kept == [self._costs({}, {}, {d})[d] for d in range(self.dp)]
            return got

    monkeypatch.setattr(solve, "joint_refine", refine)
    monkeypatch.setattr(candidates, "TPPairSearch", Search)
    monkeypatch.setattr(candidates, "solve", partitioned)
    return seen


@pytest.mark.filterwarnings("ignore::canzona.planner.errors.CanzonaWarning")
def test_searches_with_alike_states_shared_equal_the_slow_path(monkeypatch):
    seen = _recorded(monkeypatch)
    alike.REUSED.clear()
    fast = [plan(m, ParallelSizes(dp, tp)).to_json() for m, dp, tp in SWEEP]
    fast_seen = list(seen)
    assert all(alike.REUSED.get(k, 0) > 0 for k in ("joint", "tp pairs", "bucket dp"))
    assert {k for k, *_ in fast_seen} == {"joint", "tp pairs", "partition"}
    seen.clear()
    alike.REUSED.clear()
    with alike.each_anew():
        slow = [plan(m, ParallelSizes(dp, tp)).to_json() for m, dp, tp in SWEEP]
    assert not alike.REUSED  # nothing kept was read
    assert fast_seen == seen
    for (m, dp, tp), a, b in zip(SWEEP, fast, slow):
        assert a == b, f"{m} dp{dp} tp{tp}"


def test_a_bucket_cut_is_kept_by_every_input():
    """The per-bucket DP's kept cuts: a call that differs from a kept one in any input (the other
    buckets' loads, the slice cap, the phase, the slice costs, the start) is solved anew."""
    import importlib

    import numpy as np

    from canzona.planner.dp.units import Units

    polish = importlib.import_module("canzona.planner.dp.polish")  # (the package's polish is
    # the function)

    rng = np.random.default_rng(0)
    loads = rng.integers(1, 9, size=12).astype(float)
    u = Units(np.arange(0, 13 * 64, 64, dtype=np.int64), np.concatenate([[0.0], np.cumsum(loads)]),
              0.0)
    base = rng.random(4) * 10
    costs = rng.random((13, 13)) * 0.1
    start = [0, 3, 6, 9, 12]
    calls = [(base, None, "max", None, start), (base[::-1].copy(), None, "max", None, start),
             (base, 4 * 64, "max", None, start), (base, None, "p8", None, start),
             (base, None, "max", costs, start), (base, None, "max", None, [0, 1, 2, 3, 12])]
    polish._SOLVED.clear()
    for b, cap, phase, sc, st in calls + calls:  # the second round reads the kept cuts
        assert polish._bucket_dp(u, b, cap, phase, sc, None, st) == \
            polish._solve_bucket(u, b, cap, phase, sc, None, st)
    assert len(polish._SOLVED) == len(calls)
