"""The DP pair search's second start (:func:`pattern_start`): the patterns of a class-level
CP-SAT model (how many pairs share which alike matrices, which whole ones sit beside each
partner) given real matrices."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from ..planning import DPProblem, PairShare
from ..tp.context import lockstep_seconds
from .dp_search import PairSearch


#: The class-level ILP start runs for at most this many classes of alike matrices (bundles of
#: up to PATTERN_MOST of a class are enumerated: (PATTERN_MOST + 1) ** classes of them).
PATTERN_CLASSES = 6


PATTERN_MOST = 3


#: CP-SAT's deterministic time per ceiling tried (its own work units; 0.1–2 s of wall time
#: each here).
PATTERN_DETERMINISTIC_S = 2.0


#: A ceiling whose multisets of whole matrices per index outnumber this, or whose model would
#: have more (bundle, side) variables than PATTERN_VARIABLES, counts as undecided.
PATTERN_SIDES = 5_000


PATTERN_VARIABLES = 200_000


def pattern_start(problem: DPProblem, pairs: Mapping[int, PairShare],
                   scratch_cap: int, ceiling: float | None = None) -> PairSearch | None:
    """A start from the patterns of a class-level ILP (alike matrices are one class): CP-SAT
    decides, for a ceiling, how many pairs hold each bundle (≤ PATTERN_MOST of a class, its
    scratch within the cap) and each partner which whole matrices beside it, every index under
    the ceiling (matrices only: AdamW, bucket order and the one-matrix-per-bucket rule aside); a
    bisection lowers the ceiling from ``ceiling`` (the other start's busiest index: only a lower
    one can win; None: twice the mean or the heaviest matrix). The patterns are then given real
    matrices, each bundle's from distinct buckets; what does not fit goes where
    ``PairSearch.place`` puts it. None where the classes are too many, dp is odd, or CP-SAT
    finds no pattern within its budget (a ceiling it does not decide in time counts as
    infeasible)."""
    from ortools.sat.python import cp_model

    search = PairSearch(problem, pairs, scratch_cap)
    if problem.dp % 2:
        return None
    classes: dict[tuple, list[int]] = {}
    for i in range(len(search.load)):
        classes.setdefault((search.load[i], search.piece[i], search.scratch[i]), []).append(i)
    keys = sorted(classes, key=lambda c: (-c[0], str(c[1:])))
    if len(keys) > PATTERN_CLASSES:
        return None
    count = [len(classes[k]) for k in keys]
    weight = [float(k[0]) for k in keys]
    shareable = [k[1] is not None for k in keys]
    bundles: list[tuple[tuple[int, ...], float]] = []
    for cnt in itertools.product(*(range(min(PATTERN_MOST, n) + 1) if sh else (0,)
                                   for n, sh in zip(count, shareable))):
        if scratch_cap and sum(c * k[2] for c, k in zip(cnt, keys)) > scratch_cap:
            continue
        pieces = [k[1] for c, k in zip(cnt, keys) for _ in range(c)]
        bundles.append((cnt, lockstep_seconds(pieces, search.steps) if pieces else 0.0))

    def sides(cap: float) -> list[tuple[tuple[int, ...], float]] | None:
        """Every multiset of whole matrices within ``cap`` (None: more than PATTERN_SIDES)."""
        out: list[tuple[tuple[int, ...], float]] = []

        def rec(j: int, cur: tuple[int, ...], load: float) -> None:
            if len(out) > PATTERN_SIDES:
                return
            if j == len(keys):
                out.append((cur, load))
                return
            n = 0
            while n <= count[j] and load + n * weight[j] <= cap:
                rec(j + 1, cur + (n,), load + n * weight[j])
                n += 1

        rec(0, (), 0.0)
        return out if len(out) <= PATTERN_SIDES else None

    def solve(cap: float) -> dict[tuple[int, int], int] | None:
        sd = sides(cap)
        if sd is None or len(sd) * len(bundles) > PATTERN_VARIABLES:
            return None
        m = cp_model.CpModel()
        n = {(b, x): m.NewIntVar(0, problem.dp, "") for b, (_, lock) in enumerate(bundles)
             for x, (_, w) in enumerate(sd) if lock + w <= cap}
        per = [m.NewIntVar(0, problem.dp // 2, "") for _ in bundles]
        of_bundle: list[list] = [[] for _ in bundles]
        for (b, _), v in n.items():
            of_bundle[b].append(v)
        for b in range(len(bundles)):
            m.Add(sum(of_bundle[b]) == 2 * per[b])
        m.Add(sum(n.values()) == problem.dp)
        for j in range(len(keys)):
            m.Add(sum(v * sd[x][0][j] for (_, x), v in n.items())
                  + sum(c * bundles[b][0][j] for b, c in enumerate(per)) == count[j])
        solver = cp_model.CpSolver()
        # one worker, a fixed seed and a deterministic time budget: the same plan on any
        # machine with the same OR-Tools (the wall-clock limit only guards against a
        # pathological case)
        solver.parameters.max_deterministic_time = PATTERN_DETERMINISTIC_S
        solver.parameters.max_time_in_seconds = 10.0
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        if solver.Solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return {(b, x): solver.Value(v) for (b, x), v in n.items() if solver.Value(v)}

    mean = problem.total / problem.dp
    lo = mean * 0.5
    hi = ceiling if ceiling is not None else max(mean * 2.0, 2.0 * max(weight, default=0.0))
    best = solve(hi)
    if best is None:
        return None
    for _ in range(10):
        mid = (lo + hi) / 2
        got = solve(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    # Materialise: each pair a bundle and two sides; the classes' matrices handed out in order.
    left = {k: list(classes[k]) for k in keys}
    slots: list[tuple[int, tuple[int, ...]]] = []  # (bundle, side) per index, pairs adjacent
    for (b, x), v in sorted(best.items()):
        slots += [(b, x)] * v
    by_bundle: dict[int, list[int]] = {}
    for b, x in slots:
        by_bundle.setdefault(b, []).append(x)
    sd = sides(hi)  # the sides ``best`` was solved with (best and hi change together)
    if sd is None:
        return None
    pair = 0
    for b in sorted(by_bundle):
        xs = by_bundle[b]
        for a in range(0, len(xs), 2):
            s_ = pair
            pair += 1
            for j, c in enumerate(bundles[b][0]):  # the bundle: matrices of distinct buckets
                for _ in range(c):
                    pick = next((i for i in left[keys[j]]
                                 if search.fits(search.shared[s_] + [i])), None)
                    if pick is None:
                        continue
                    left[keys[j]].remove(pick)
                    search.put(pick, ("s", s_))
            for d, x in ((2 * s_, xs[a]), (2 * s_ + 1, xs[a + 1])):
                for j, c in enumerate(sd[x][0]):
                    for _ in range(c):
                        if left[keys[j]]:
                            search.put(left[keys[j]].pop(0), ("w", d))
    rest = sorted((i for k in keys for i in left[k]), key=lambda i: (-search.load[i], i))
    for i in rest:
        search.place(i)
    return search
