"""Certified lower bounds on the busiest DP index: pigeonhole on the matrices, and bin packing
of the matrices (a CP-SAT covering model; OR-Tools is imported only when a packing does not
already decide it)."""

from __future__ import annotations

import heapq
from collections import Counter

from ..planning import DPProblem

#: Loads are scaled so that the mean rank load is this many integer units (1e-6 resolution).
SCALE_UNITS = 1_000_000


def pigeonhole_bound(problem: DPProblem) -> int:
    """A certified lower bound on the max load from the atomic items alone.

    With R ranks, some rank gets at least k+1 of the kR+1 largest atomic items, so its load is at
    least the sum of the k+1 smallest of them. The mean and the largest item are the other bounds.
    """
    a = sorted((it.load for b in problem.buckets for it in b.items if it.atomic), reverse=True)
    R = problem.dp
    best = problem.lower_bound()
    k = 1
    while k * R + 1 <= len(a):
        top = a[: k * R + 1]
        best = max(best, sum(top[-(k + 1):]))
        k += 1
    return best


def _maximal_patterns(w: list[int], cap: list[int], C: int,
                      limit: int) -> list[tuple[int, ...]] | None:
    """Count vectors a (a_t ≤ cap_t) with Σ a_t w_t ≤ C to which no further item fits.

    Returns None when there are more than ``limit`` (the caller then gives up on this bound).
    """
    T = len(w)
    out: list[tuple[int, ...]] = []
    a = [0] * T
    # what the types from t on can fill at most: a branch whose room stays at or above the
    # lightest type left short of its cap can end in no maximal pattern, and is not walked
    suffix = [0] * (T + 1)
    for t in range(T - 1, -1, -1):
        suffix[t] = suffix[t + 1] + cap[t] * w[t]

    def rec(t: int, room: int, need: float) -> bool:
        if t == T:
            # maximal: no type with spare count fits into the remaining room
            if all(a[k] == cap[k] or w[k] > room for k in range(T)):
                out.append(tuple(a))
                if len(out) > limit:
                    return False
            return True
        top = min(cap[t], room // w[t]) if w[t] else cap[t]
        for c in range(top, -1, -1):
            a[t] = c
            short = need if c == cap[t] or w[t] == 0 else min(need, w[t])
            if room - c * w[t] - suffix[t + 1] >= short:
                break  # a type short of its cap fits whatever the rest takes (fewer: too)
            if not rec(t + 1, room - c * w[t], short):
                return False
        a[t] = 0
        return True

    ok = rec(0, C, float("inf"))
    return out if ok else None


def _lpt_fits(w: list[int], cap: list[int], C: int, bins: int) -> bool:
    """Whether the items (``cap[t]`` of weight ``w[t]``, heaviest type first) fit ``bins`` bins of
    capacity ``C`` when each goes to the least-loaded bin (LPT). A fit proves the covering model
    of :func:`bin_packing_bound` feasible (each bin's items lie under a maximal pattern); no fit
    proves nothing."""
    heap = [0] * bins
    for x, n in zip(w, cap):
        if x > C:
            return False
        for _ in range(n):
            least = heap[0]
            if least + x > C:
                return False
            heapq.heapreplace(heap, least + x)
    return True


def _covers(w: list[int], cap: list[int], C: int, bins: int, *, max_patterns: int,
            time_limit_s: float, shortcuts: tuple[str, ...] = ("packing", "uncovered")
            ) -> bool:
    """Whether ``bins`` bins of capacity ``C`` may cover the items (``cap[t]`` of weight
    ``w[t]``, heaviest type first), the covering model of :func:`bin_packing_bound`; True where
    undecided (too many patterns, or CP-SAT out of time). ``shortcuts`` answer before the model
    is built, as CP-SAT would (left out only to check that): ``packing``, an LPT packing decides
    it feasible; ``uncovered``, a type that fits no pattern decides it infeasible."""
    if "packing" in shortcuts and _lpt_fits(w, cap, C, bins):
        return True  # a packing: the covering model is feasible, CP-SAT need not run
    pats = _maximal_patterns(w, cap, C, max_patterns)
    if pats is None:
        return True  # too many patterns to decide: assume feasible (keeps the bound valid)
    if not pats:
        return False
    if "uncovered" in shortcuts and any(c and not any(p[t] for p in pats)
                                        for t, c in enumerate(cap)):
        return False  # a type no pattern holds cannot be covered
    from ortools.sat.python import cp_model  # ~0.3 s to import: only when undecided

    model = cp_model.CpModel()
    y = [model.new_int_var(0, bins, f"y_{i}") for i in range(len(pats))]
    # At most R bins.
    model.add(sum(y) <= bins)
    for t in range(len(w)):
        # Every item of type t is covered.
        model.add(sum(p[t] * yi for p, yi in zip(pats, y) if p[t]) >= cap[t])
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.num_workers = 1
    return solver.solve(model) != cp_model.INFEASIBLE


def packing_bound(problem: DPProblem, upper: int, *, time_limit_s: float = 0.2,
                  max_patterns: int = 20_000) -> int:
    """A certified lower bound on the max DP load: bin packing of the matrices, grouped by load.

    A relaxation of the partition problem — bucket geometry, parameter order and expert placement
    are dropped, AdamW load may go anywhere — so no plan can beat its optimum
    (:func:`bin_packing_bound` over the DP indices)."""
    atomic = [it.load for b in problem.buckets for it in b.items if it.atomic]
    rest = [it.load for b in problem.buckets for it in b.items if not it.atomic]
    return bin_packing_bound(atomic, sum(rest), problem.dp, problem.lower_bound(), upper,
                             divisible_items=len(rest), total=problem.total_load(),
                             time_limit_s=time_limit_s, max_patterns=max_patterns)


def bin_packing_bound(atomic: list[int], divisible: float, bins: int, lower: float,
                      upper: float, *, divisible_items: int = 0, total: float | None = None,
                      time_limit_s: float = 0.2, max_patterns: int = 20_000) -> int:
    """A certified lower bound on the busiest of ``bins`` bins holding the ``atomic`` loads
    whole and ``divisible`` load split anywhere (``lower``: a bound already known; ``upper``: a
    load some placement reaches). Loads are scaled down (floor), which keeps the bound valid.
    For a capacity C the question is the covering problem over maximal *patterns* p (how many
    items of each load one bin can take):

    data:      types t (items of equal load w_t, N_t of them), patterns p with a[p, t] ≤ N_t
               and load_p = Σ_t a[p, t] w_t ≤ C; divisible load D; R bins.
    variables: y[p] = number of bins that use pattern p.
    constraints:
      * at most R bins: Σ_p y[p] ≤ R;
      * every item is covered: Σ_p a[p, t] y[p] ≥ N_t (patterns are closed under removal);
      * the divisible load fits in the room the items leave: R·C − Σ_t N_t w_t ≥ D (the
        items, not the patterns: a pattern covering more than is left holds fewer items).
    A binary search finds the smallest C that is not proven infeasible; an undecided check counts
    as feasible, so the bound stays valid. Where the items fit C by LPT (:func:`_lpt_fits`), C
    is feasible without the model; where a type fits no pattern, it is not.
    ``divisible_items``: how many items the divisible load comes in (each integer share may
    round by one unit per bin: taken off the bound);
    ``total``: the load the scale is taken from (default: the atomic and divisible loads).
    """
    R = bins
    mean = (total if total is not None else sum(atomic) + divisible) / R
    if mean <= 0:
        return 0
    unit = mean / SCALE_UNITS
    counts = Counter(atomic)
    types = sorted(counts.items(), reverse=True)
    w = [int(x / unit) for x, _ in types]
    cap = [c for _, c in types]
    # Flooring C loses up to one unit per bin of room: give the divisible volume that slack back.
    D = max(0, int(divisible / unit) - R)

    items = sum(c * x for c, x in zip(cap, w))

    def feasible(C: int) -> bool:
        if R * C - items < D:
            return False  # the divisible load does not fit beside the items
        return _covers(w, cap, C, R, max_patterns=max_patterns, time_limit_s=time_limit_s)

    # Integer shares of a divisible item differ from the real-valued ones by < 1 per item and
    # bin: take that off so the bound never exceeds a plan's (integer) reported load.
    n_div = divisible_items
    lo = max(0, int(lower / unit) - 1)  # may be feasible or not
    hi = int(upper / unit) + 1  # the heuristic's max: feasible
    if feasible(lo):
        return max(0, int(lo * unit * (1 - 1e-9)) - n_div)  # 1e-9: float rounding
    while hi - lo > 1:  # invariant: lo infeasible, hi feasible (or undecided)
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return max(0, int(hi * unit * (1 - 1e-9)) - n_div)
