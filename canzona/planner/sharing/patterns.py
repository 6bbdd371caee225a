"""The layout-free pattern model of the shared pieces at tp > 1 (Muon): which multiset of pieces
each DP index runs in its lockstep (a *pattern*), and how many indices take each, with every
class of alike matrices free to take any of its options (over its TP group, halves with a
partner index, rounds of TP sub-groups, hosted whole). No bucket order and no cuts: every plan
is one of these placements, so the least busiest index the model reaches is a floor for the
plans, and its patterns are a start for the TP search (``tp_start``).

CP-SAT decides, for a ceiling, whether the patterns under it can hold every class's matrices
on ``dp`` indices; the least ceiling is found by bisection over the patterns' loads (the
optimum is one pattern's load), each ceiling below it proven unreachable. One worker, a fixed
seed and a deterministic time budget: the same answer on every machine with the same OR-Tools
(a wall-clock limit only guards against a pathological case).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..tp.context import Lockstep, Piece
from .pieces import profile_rate, share_options
from .prices import seconds_to_load

#: CP-SAT's deterministic time per ceiling tried (its own work units).
PATTERN_DETERMINISTIC_S = 2.0
#: Patterns enumerated at most; more count as undecided (no start, no bound).
PATTERN_LIMIT = 20_000
#: Ceilings the floor (:func:`pattern_bound`) decides at most: each CP-SAT call is bounded by
#: its deterministic time, so ``canzona inspect`` stays within seconds; the floor stays valid,
#: ``tight`` False where the bisection stopped early or a ceiling went undecided.
BOUND_SOLVES = 8


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of piece: ``per`` pieces per matrix of class ``cls`` taking ``option`` (2 for a
    matrix two partner indices share, ``half``), ``mats`` matrices per piece (tp/k for a round
    of TP sub-groups); ``piece`` as the lockstep meets it, or (``hosted``) a load beside the
    lockstep (a hosted matrix's, 1/tp of it per TP rank)."""

    cls: int
    option: str
    per: int
    mats: int
    piece: Piece | None
    half: bool = False
    hosted: float = 0.0


def lockstep_load(kinds: Sequence[Kind], cap: int) -> Callable[[tuple[int, ...]], float]:
    """A pattern's load as the TP schedule models it: its pieces in one
    :class:`~canzona.planner.tp.context.Lockstep` (batches of ``cap`` scratch bytes, in kind
    order), its hosted loads beside."""
    def load(cnt: tuple[int, ...]) -> float:
        lock = Lockstep(cap)
        hosted = 0.0
        for j, c in enumerate(cnt):
            k = kinds[j]
            for _ in range(c):
                if k.piece is None:
                    hosted += k.hosted
                else:
                    lock.add((j, *k.piece[1:]))
        return lock.load() + hosted
    return load


def relaxed_load(kinds: Sequence[Kind]) -> Callable[[tuple[int, ...]], float]:
    """A pattern's load, at most the lockstep's and never lower when a piece joins: the longest
    of Σ compute, Σ collectives and any piece's own chain (compute and what its Gram products
    do not hide), whatever batches it is cut in, plus its hosted loads — a bound needs a load
    that only grows with the pattern, so that the patterns under a ceiling are all found."""
    def load(cnt: tuple[int, ...]) -> float:
        comp = comm = chain = hosted = 0.0
        for j, c in enumerate(cnt):
            if not c:
                continue
            k = kinds[j]
            if k.piece is None:
                hosted += c * k.hosted
                continue
            _, pc, pa, _, _, ph = k.piece
            comp += c * pc
            comm += c * pa
            chain = max(chain, pc + pa - ph)
        return max(comp, comm, chain) + hosted
    return load


def enumerate_patterns(kinds: Sequence[Kind], counts: Sequence[int], ceiling: float,
                       load: Callable[[tuple[int, ...]], float], most: int | None,
                       prune: bool = False) -> list[tuple[tuple[int, ...], float]] | None:
    """Every multiset of pieces (at most ``most`` pieces; None: any number, ``load`` then
    growing with the multiset) whose ``load`` is within ``ceiling`` and whose pieces the
    classes' matrices (``counts``) can make; None past :data:`PATTERN_LIMIT`. ``prune`` (and
    ``most`` None): a multiset over the ceiling is not grown further — all of them where the
    load grows with the multiset, most of them for a start's lockstep load."""
    n = len(kinds)
    top = [counts[k.cls] * k.per // max(1, k.mats) if k.mats == 1 else
           -(-counts[k.cls] // k.mats) for k in kinds]
    out: list[tuple[tuple[int, ...], float]] = []
    cur = [0] * n

    def rec(j: int, size: int) -> bool:
        if len(out) > PATTERN_LIMIT:
            return False
        if j == n:
            if size:
                t = tuple(cur)
                out.append((t, load(t)))
            return True
        if not rec(j + 1, size):
            return False
        while cur[j] < top[j] and (most is None or size < most):
            cur[j] += 1
            size += 1
            if (prune or most is None) and load(tuple(cur)) > ceiling + 1e-9:
                break  # (growing) nothing with more of this kind fits either
            if not rec(j + 1, size):
                cur[j] = 0
                return False
        cur[j] = 0
        return True

    if not rec(0, 0):
        return None
    return [(p, x) for p, x in out if x <= ceiling + 1e-9]


def _model(kinds: Sequence[Kind], counts: Sequence[int], dp: int,
           pats: Sequence[tuple[tuple[int, ...], float]], exact: bool, partners: bool
           ) -> tuple[Any, list]:
    """The CP-SAT model of ``pats`` (see :func:`least_ceiling`) and each pattern's use."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    use = [m.NewIntVar(0, dp, "") for _ in pats]
    m.Add(cp_model.LinearExpr.Sum(use) <= dp)
    took = [m.NewIntVar(0, counts[k.cls], "") for k in kinds]
    for c in range(len(counts)):
        m.Add(cp_model.LinearExpr.Sum([y for y, k in zip(took, kinds) if k.cls == c])
              == counts[c])
    for j, k in enumerate(kinds):
        having = [(u, cnt[j]) for (cnt, _), u in zip(pats, use) if cnt[j]]
        pieces = cp_model.LinearExpr.WeightedSum([u for u, _ in having],
                                                 [c * k.mats for _, c in having])
        if exact:
            m.Add(pieces == k.per * took[j])
        else:
            m.Add(pieces >= k.per * took[j])
    if partners:
        halves = [j for j, k in enumerate(kinds) if k.half]
        sigs: dict[tuple, list] = {}
        for (cnt, _), u in zip(pats, use):
            sig = tuple(cnt[j] for j in halves)
            if any(sig):
                sigs.setdefault(sig, []).append(u)
        for us in sigs.values():
            m.Add(cp_model.LinearExpr.Sum(us) == 2 * m.NewIntVar(0, dp // 2, ""))
    return m, use


def _within(kinds: Sequence[Kind], counts: Sequence[int], dp: int,
            pats: Sequence[tuple[tuple[int, ...], float]], ceiling: float, exact: bool,
            partners: bool) -> dict[int, int] | None | bool:
    """Whether the patterns within ``ceiling`` hold every matrix: pattern index → indices
    taking it; None where CP-SAT proves they cannot; False where it decides nothing in its
    budget. The model holds only the patterns within the ceiling."""
    from ortools.sat.python import cp_model

    under = [p for p, (_, x) in enumerate(pats) if x <= ceiling + 1e-9]
    m, use = _model(kinds, counts, dp, [pats[p] for p in under], exact, partners)
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = PATTERN_DETERMINISTIC_S
    solver.parameters.max_time_in_seconds = 20.0
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(m)
    if status == cp_model.INFEASIBLE:
        return None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False
    return {p: solver.Value(u) for p, u in zip(under, use) if solver.Value(u)}


def least_ceiling(kinds: Sequence[Kind], counts: Sequence[int], dp: int,
                  pats: Sequence[tuple[tuple[int, ...], float]], *, exact: bool,
                  partners: bool, certify: bool = False, max_solves: int | None = None
                  ) -> tuple[float, dict[int, int] | None, bool] | None:
    """The least pattern load at which the patterns hold every class's matrices on ``dp``
    indices (bisection over the loads: the optimum is one pattern's load), the patterns taken
    there and whether every lower load was proven unreachable. ``exact``: every piece a whole
    matrix's (pieces · matrices per piece = pieces per matrix · matrices, as a plan lays them
    out); otherwise a round may be partial (a relaxation, for a floor). ``partners``: the
    indices holding the same multiset of halves come in even numbers (partners 2s, 2s + 1
    hold the halves of the same matrices). None where none holds them. ``certify``: a load
    CP-SAT does not decide counts as reachable (the result is then a floor; no patterns are
    returned), and the bisection stops after ``max_solves`` (the floor then lower than it
    could be); otherwise a load not decided counts as unreachable (the result is then a
    placement)."""
    loads = sorted({x for _, x in pats})
    if not loads:
        return None
    lo, up = 0, len(loads) - 1
    # a floor needs no placement at the top: only the ceilings below it are decided
    best = False if certify else _within(kinds, counts, dp, pats, loads[up], exact, partners)
    if best is None or (best is False and not certify):
        return None
    proven = certify or best is not False  # (a floor never needs the top decided)
    solves = 0
    while lo < up:
        if solves == max_solves:  # the floor stands (every load below lo is unreachable)
            proven = False
            break
        solves += 1
        mid = (lo + up) // 2
        got = _within(kinds, counts, dp, pats, loads[mid], exact, partners)
        if got is None or (got is False and not certify):
            lo = mid + 1
            proven = proven and got is None
        else:
            up = mid
            best = got
            proven = proven and got is not False
    if certify:
        return loads[lo], None, proven
    assert isinstance(best, dict)
    return loads[lo], best, proven


def undominated(kinds: Sequence[Kind]) -> list[Kind]:
    """``kinds`` less those another kind of the same class, pieces per matrix and matrices per
    piece beats in compute, collectives and own chain alike (the first of equals kept): a
    piece so replaced never raises :func:`relaxed_load`, so the floor stays a floor."""
    def terms(k: Kind) -> tuple[float, float, float]:
        if k.piece is None:
            return (k.hosted, 0.0, 0.0)
        _, c, a, _, _, h = k.piece
        return (c, a, c + a - h)

    out = []
    for j, k in enumerate(kinds):
        tj = terms(k)
        beaten = False
        for i, o in enumerate(kinds):
            if i == j or (o.cls, o.per, o.mats, o.half, o.piece is None) != \
                    (k.cls, k.per, k.mats, k.half, k.piece is None):
                continue
            ti = terms(o)
            if all(a <= b for a, b in zip(ti, tj)) and (ti != tj or i < j):
                beaten = True
                break
        if not beaten:
            out.append(k)
    return out


@dataclass(frozen=True, slots=True)
class PatternBound:
    """A floor for the busiest GPU when any sharing option may be used (:func:`pattern_bound`),
    in the plan's cost units, with what it took: ``patterns`` enumerated, ``kinds`` of piece,
    ``tight``: the model's optimum (every ceiling decided; False: the bisection stopped at
    :data:`BOUND_SOLVES` or a ceiling went undecided, and the floor, still proven, may lie
    lower than the optimum)."""

    bound: float
    patterns: int
    kinds: int
    tight: bool = True

    def to_dict(self) -> dict:
        return {"bound": self.bound, "patterns": self.patterns, "kinds": self.kinds,
                "tight": self.tight}


def pattern_bound(problem, hw, ceiling: float) -> PatternBound | None:  # noqa: ANN001
    """The least busiest GPU any placement can reach when every Muon matrix its TP group
    splits along its long dimension may take any sharing option (over its TP group, halves
    with a partner index, a round of TP sub-groups of any size; the polynomial split or not)
    or be hosted whole: the layout-free pattern model (no buckets, no cuts, no partner
    constraint, a round may be partial, a hosted matrix's load spread over its index's TP
    ranks, AdamW and the other matrices left out — each a relaxation), each index's load the
    longest of its pieces' Σ compute, Σ collectives and any piece's own chain plus its hosted
    share (at most the lockstep's, :func:`relaxed_load`), solved by CP-SAT within its budget
    below ``ceiling`` (a plan's busiest GPU). None at tp = 1, for an optimizer without shared
    Newton–Schulz, or where the patterns are too many."""
    tp = problem.sizes.tp
    if tp == 1 or not problem.settings.spec.gram_shared:
        return None
    rate = profile_rate(hw)
    classes: dict[tuple, list[int]] = {}
    for t in problem.tasks:
        if t.optimizer == "matrix" and share_options(problem, t.id, hw,
                                                     groups=("tp", "tp_pair", "tp_sub")):
            p = problem.spec[t.param]
            classes.setdefault((t.shape, p.tp_dim, p.is_expert), []).append(t.id)
    kinds: list[Kind] = []
    for c, ids in enumerate(classes.values()):
        i = ids[0]

        def units(x: float) -> float:
            return seconds_to_load(problem, i, x, rate)

        for o in share_options(problem, i, hw, groups=("tp", "tp_pair", "tp_sub")):
            comp = o.compute_s(rate)
            piece = (0, units(comp), units(o.comm_s), units(max(comp, o.comm_s)), 0,
                     units(o.hidden_s))
            if o.group == "tp_pair":
                kinds.append(Kind(c, f"tp_pair{'-split' * o.split_poly}", 2, 1, piece, True))
            elif o.group == "tp_sub":
                kinds.append(Kind(c, f"sub{o.k}{'-split' * o.split_poly}", 1, tp // o.k, piece))
            else:
                kinds.append(Kind(c, f"tp{'-split' * o.split_poly}", 1, 1, piece))
        kinds.append(Kind(c, "host", 1, 1, None, hosted=problem.loads[i] / tp))
    if not classes:
        return None
    kinds = undominated(kinds)
    counts = [len(ids) for ids in classes.values()]
    pats = enumerate_patterns(kinds, counts, ceiling, relaxed_load(kinds), None)
    if pats is None:
        return None
    if not pats:  # nothing fits under the plan's own figure: the model's floor is above it
        return PatternBound(ceiling, 0, len(kinds))
    got = least_ceiling(kinds, counts, problem.dp, pats, exact=False, partners=False,
                        certify=True, max_solves=BOUND_SOLVES)
    if got is None:  # no placement under the ceiling: the floor is the ceiling itself
        return PatternBound(ceiling, len(pats), len(kinds))
    return PatternBound(got[0], len(pats), len(kinds), got[2])
