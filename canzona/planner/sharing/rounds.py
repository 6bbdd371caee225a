"""Rounds of TP sub-groups (tp > 1, Muon): tp/k alike matrices of one DP index, each shared by
a sub-group of k strided TP ranks (``pieces.tp_sub_piece``), run as one piece of the index's
lockstep (``planning.SubRound``). Over the whole TP group a matrix's piece carries its Gram's
collectives for 1/tp of its work per GPU; a sub-group spends about the same collectives on 1/k
of it, so where the collectives decide an index's lockstep, fewer ranks per matrix are
shorter.

* :func:`sub_round` — one round priced: a sub-group's piece, the split of the polynomial
  that makes it shortest alone, in the plan's cost units;
* :func:`with_rounds` — a problem whose rounds' members are shared so (each member in
  ``DPProblem.shared`` with 1/s of its round's load, ``DPProblem.rounds``);
* :func:`classes` — the matrices the TP group shares, by what makes them alike in a round;
* :func:`every_round` — what ``--share sub-groups`` asks for: every class in full rounds of
  the smallest k (``--share auto`` lets the pattern model choose, ``tp_start``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ..hardware import HardwareProfile
from ..planning import DPProblem, SubRound
from .pieces import profile_rate, share_options
from .prices import seconds_to_load


def sub_round(problem: DPProblem, tasks: Sequence[int], k: int, hw: HardwareProfile
              ) -> SubRound | None:
    """``tasks`` (tp/k alike matrices, in slot order) shared by TP sub-groups of ``k``: the
    option (with or without the polynomial split) shortest alone, its load one piece's seconds
    alone in cost units; None where the tasks cannot be (not Muon, not split along their long
    dimension, a count other than tp/k)."""
    tp = problem.sizes.tp
    if k < 2 or tp % k or len(tasks) != tp // k:
        return None
    opts = [o for o in share_options(problem, tasks[0], hw, groups=("tp_sub",)) if o.k == k]
    if not opts:
        return None
    rate = profile_rate(hw)
    o = min(opts, key=lambda x: (x.alone_s(rate), x.split_poly))
    load = math.ceil(seconds_to_load(problem, tasks[0], o.alone_s(rate), rate))
    return SubRound(k, tuple(sorted(tasks)), o.split_poly, float(load), o.compute_s(rate),
                    o.comm_s, o.hidden_s)


def with_rounds(problem: DPProblem, rounds: Sequence[SubRound]) -> DPProblem:
    """``problem`` with ``rounds``' tasks shared by TP sub-groups: each member in ``shared``
    with 1/s of its round's load (so an index's TP ranks carry the round's load once), and
    ``rounds`` mapping every member to its round."""
    shared = dict(problem.shared)
    by_task = {}
    for r in rounds:
        s = r.slots
        for i in r.tasks:
            shared[i] = (r.load / s, r.split_poly, r.compute_s / s, r.comm_s / s, r.hidden_s / s)
            by_task[i] = r
    return dataclasses.replace(problem, shared=shared, rounds=by_task)


def classes(problem: DPProblem) -> dict[tuple, list[int]]:
    """The matrices the TP group shares, by what makes them alike in a round (shape, the
    dimension TP splits), in task order; a task shared with a partner index is left out."""
    out: dict[tuple, list[int]] = {}
    for i in sorted(problem.shared):
        if i in problem.pairs or i in problem.rounds:
            continue
        t = problem.tasks[i]
        p = problem.spec[t.param]
        out.setdefault((t.shape, p.tp_dim), []).append(i)
    return out


def rounds_of(problem: DPProblem, tasks: Sequence[int], k: int, hw: HardwareProfile
              ) -> list[SubRound]:
    """``tasks`` (alike, in task order) in full rounds of tp/k, the rest left out."""
    s = problem.sizes.tp // k
    out = []
    for j in range(0, len(tasks) - s + 1, s):
        r = sub_round(problem, tasks[j:j + s], k, hw)
        if r is None:
            return []
        out.append(r)
    return out


def every_round(problem: DPProblem, hw: HardwareProfile) -> list[SubRound]:
    """``sub-groups`` (``TPOptions.share``): every class of alike matrices the TP group shares
    (``problem.shared``) in full rounds of the smallest sub-group size (2 ≤ k < tp dividing tp),
    what does not fill a round left to its TP group. Empty where nothing applies (not Muon,
    tp < 4, no class with tp/k alike matrices)."""
    tp = problem.sizes.tp
    k = next((k for k in range(2, tp) if tp % k == 0), None)
    if not problem.settings.spec.gram_shared or k is None:  # tp < 4, or a prime tp
        return []
    return [r for ids in classes(problem).values() for r in rounds_of(problem, ids, k, hw)]
