"""The bin-packing bound: the pruned walk finds exactly the maximal count vectors that a plain
enumeration keeps, in the same order, and gives up at the same limit; the covering check's
shortcuts answer as the CP-SAT model does."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner.dp.bounds import _covers, _maximal_patterns


def _every_maximal(w: list[int], cap: list[int], C: int) -> list[tuple[int, ...]]:
    """Every count vector within the caps and C to which no item fits, in the walk's order
    (each count from its largest down)."""
    out = []
    for a in itertools.product(*(range(c, -1, -1) for c in cap)):
        room = C - sum(x * y for x, y in zip(a, w))
        if room >= 0 and all(a[k] == cap[k] or w[k] > room for k in range(len(w))):
            out.append(a)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), min_size=1, max_size=5,
                unique_by=lambda x: x[0]),
       st.integers(0, 150), st.sampled_from([3, 40, 10_000]))
def test_maximal_patterns_match_the_plain_enumeration(types, C, limit):
    types = sorted(types, reverse=True)  # heaviest first, as the bound orders them
    w, cap = [x for x, _ in types], [c for _, c in types]
    every = _every_maximal(w, cap, C)
    got = _maximal_patterns(w, cap, C, limit)
    if len(every) > limit:
        assert got is None
    else:
        assert got == every



@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), min_size=1, max_size=4,
                unique_by=lambda x: x[0]),
       st.integers(0, 120), st.integers(1, 5))
def test_covering_shortcuts_answer_as_cp_sat(types, C, bins):
    """The LPT packing and the uncoverable type decide a capacity as the CP-SAT model does."""
    types = sorted(types, reverse=True)
    w, cap = [x for x, _ in types], [c for _, c in types]
    args = dict(max_patterns=10_000, time_limit_s=5.0)
    model = _covers(w, cap, C, bins, shortcuts=(), **args)
    for shortcuts in (("packing",), ("uncovered",), ("packing", "uncovered")):
        assert _covers(w, cap, C, bins, shortcuts=shortcuts, **args) == model, shortcuts
