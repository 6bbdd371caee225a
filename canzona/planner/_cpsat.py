"""CP-SAT model of the DP partition (read like ``ortools/sat/samples/bin_packing_sat.py``).

data:      per bucket b, units u (atomic matrices whole, AdamW items in pieces) in buffer order,
           with integer loads w_u (scaled) and element counts n_u; R_b ranks per bucket.
variables: x[b, u, r] = 1 if unit u of bucket b lies in rank r's slice.
           M = the maximum load over DP indices.
constraints:
  * every unit lies in exactly one slice;
  * slices are contiguous and in rank order: owner(u) ≤ owner(u+1);
  * (optional) every slice holds at most comm_limit · S_b / R_b elements;
  * M ≥ Σ w_u x[b, u, r] over every (b, u, r) that belongs to DP index d, for every d.
objective: minimise M.
The search is warm-started with a hint, limited in deterministic time with a fixed worker count
(so the same inputs give the same plan) and every status is checked.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from .errors import CanzonaError
from .planning import DPProblem

#: Loads are scaled so that the mean rank load is this many integer units (1e-6 resolution).
SCALE_UNITS = 1_000_000


def solve_cpsat(problem: DPProblem, hint: dict, *, time_limit_s: float, seed: int,
                workers: int = 1, comm_limit: float | None = None):
    """Minimise the maximum DP load. Returns (cuts, status, certified lower bound)."""
    from .partition import _grain, _units, evaluate  # circular at import time only

    mean = problem.total_load() / problem.dp
    unit_load = mean / SCALE_UNITS if mean > 0 else 1.0
    model = cp_model.CpModel()
    loads: list[list] = [[] for _ in range(problem.dp)]
    owner_vars: dict = {}
    units_by_key = {}
    max_piece = 0.0
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u = _units(b, 4 * b.ranks, _grain(problem))
        units_by_key[key] = u
        max_piece = max(max_piece, u.piece_load)
        m = len(u.bounds) - 1
        R = b.ranks
        owners = []
        x = {}
        for k in range(m):
            w = int((u.prefix[k + 1] - u.prefix[k]) / unit_load)  # floor: keeps the bound valid
            # x[b, k, r] = 1 if unit k is in rank r's slice
            lits = [model.new_bool_var(f"x_{b.buffer}_{b.bucket}_{k}_{r}") for r in range(R)]
            # Each unit lies in exactly one slice.
            model.add_exactly_one(lits)
            own = model.new_int_var(0, R - 1, f"o_{b.buffer}_{b.bucket}_{k}")
            model.add(own == sum(r * lit for r, lit in enumerate(lits)))
            owners.append(own)
            for r, lit in enumerate(lits):
                x[k, r] = lit
                if w:
                    loads[problem.dp_index(b, r)].append(w * lit)
        # Slices are contiguous and in rank order.
        for a, c in zip(owners, owners[1:]):
            model.add(a <= c)
        if comm_limit is not None:
            cap = int(comm_limit * (u.bounds[-1] - u.bounds[0]) / R)
            for r in range(R):
                # A slice holds at most comm_limit × the even slice of elements.
                model.add(sum(int(u.bounds[k + 1] - u.bounds[k]) * x[k, r] for k in range(m))
                          <= cap)
        owner_vars[key] = owners
        # Hint: the warm start's owners.
        idx = [int(i) for i in _indices(u, hint[key])]
        for r in range(R):
            for k in range(idx[r], idx[r + 1]):
                model.add_hint(owners[k], r)
    top = sum(int(x) for x in [SCALE_UNITS * problem.dp])  # total scaled load bound
    M = model.new_int_var(0, top, "max_load")
    for d in range(problem.dp):
        # M is at least every DP index's load.
        model.add(M >= sum(loads[d]))
    model.minimize(M)

    solver = cp_model.CpSolver()
    # Deterministic time keeps plans reproducible; the wall-clock cap (2x) only guards slow hosts.
    solver.parameters.max_deterministic_time = float(time_limit_s)
    solver.parameters.max_time_in_seconds = 2.0 * float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise CanzonaError("comm_limit is too tight: no cut points satisfy it; raise --comm-limit.")
        # UNKNOWN: no solution in time; keep the warm start.
        return hint, "cpsat-unknown", 0
    cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u = units_by_key[key]
        owners = [solver.value(o) for o in owner_vars[key]]
        c = [int(u.bounds[0])]
        for r in range(b.ranks - 1):
            # cut r+1 sits after the last unit owned by a rank ≤ r
            k = sum(1 for o in owners if o <= r)
            c.append(int(u.bounds[k]))
        c.append(int(u.bounds[-1]))
        cuts[key] = tuple(c)
    # Keep the better of the warm start and CP-SAT's answer, judged on the exact loads.
    if max(evaluate(problem, cuts).load) > max(evaluate(problem, hint).load):
        cuts = hint
    bound = int(solver.best_objective_bound * unit_load - 2 * max_piece)
    name = "optimal" if status == cp_model.OPTIMAL else "feasible"
    return cuts, f"cpsat-{name}", max(0, bound)


def _indices(u, cuts):
    import numpy as np

    return [int(np.searchsorted(u.bounds, c)) for c in cuts]




def _maximal_patterns(w: list[int], cap: list[int], C: int, limit: int) -> list[tuple[int, ...]] | None:
    """Count vectors a (a_t ≤ cap_t) with Σ a_t w_t ≤ C to which no further item fits.

    Returns None when there are more than ``limit`` (the caller then gives up on this bound).
    """
    T = len(w)
    out: list[tuple[int, ...]] = []
    a = [0] * T
    lightest = min(w) if w else 0

    def rec(t: int, room: int) -> bool:
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
            if not rec(t + 1, room - c * w[t]):
                return False
        a[t] = 0
        return True

    ok = rec(0, C)
    del lightest
    return out if ok else None


def packing_bound(problem: DPProblem, upper: int, *, time_limit_s: float = 0.2,
                  max_patterns: int = 20_000) -> int:
    """A certified lower bound on the max DP load: bin packing of the matrices, grouped by load.

    A relaxation of the partition problem — bucket geometry, parameter order and expert placement
    are dropped, AdamW load may go anywhere — so no plan can beat its optimum. Loads are scaled
    down (floor), which keeps the bound valid. For a capacity C the question is the covering
    problem over maximal *patterns* p (how many matrices of each type one rank can take):

    data:      types t (matrices of equal load w_t, N_t of them), patterns p with a[p, t] ≤ N_t
               and load_p = Σ_t a[p, t] w_t ≤ C; divisible (AdamW) load D; R ranks.
    variables: y[p] = number of ranks that use pattern p.
    constraints:
      * at most R ranks: Σ_p y[p] ≤ R;
      * every matrix is covered: Σ_p a[p, t] y[p] ≥ N_t (patterns are closed under removal);
      * the AdamW load fits in the room left: R·C − Σ_p load_p y[p] ≥ D.
    A binary search finds the smallest C that is not proven infeasible; an undecided check counts
    as feasible, so the bound stays valid.
    """
    from collections import Counter

    R = problem.dp
    mean = problem.total_load() / R
    if mean <= 0:
        return 0
    unit = mean / SCALE_UNITS
    counts = Counter(it.load for b in problem.buckets for it in b.items if it.atomic)
    types = sorted(counts.items(), reverse=True)
    w = [int(x / unit) for x, _ in types]
    cap = [c for _, c in types]
    # Flooring C loses up to one unit per rank of room: give the AdamW volume that slack back.
    D = max(0, int(sum(it.load for b in problem.buckets for it in b.items if not it.atomic) / unit) - R)

    def feasible(C: int) -> bool:
        pats = _maximal_patterns(w, cap, C, max_patterns)
        if pats is None:
            return True  # too many patterns to decide: assume feasible (keeps the bound valid)
        if not pats:
            return False
        model = cp_model.CpModel()
        y = [model.new_int_var(0, R, f"y_{i}") for i in range(len(pats))]
        # At most R ranks.
        model.add(sum(y) <= R)
        for t in range(len(w)):
            # Every matrix of type t is covered.
            model.add(sum(p[t] * yi for p, yi in zip(pats, y) if p[t]) >= cap[t])
        # The AdamW load fits into the room the patterns leave.
        model.add(R * C - sum(sum(a * b for a, b in zip(p, w)) * yi for p, yi in zip(pats, y)) >= D)
        solver = cp_model.CpSolver()
        solver.parameters.max_deterministic_time = time_limit_s
        solver.parameters.num_workers = 1
        status = solver.solve(model)
        return status != cp_model.INFEASIBLE

    # Integer shares of an AdamW item differ from the real-valued ones by < 1 per item and rank:
    # take that off so the bound never exceeds a plan's (integer) reported load.
    n_div = sum(1 for b in problem.buckets for it in b.items if not it.atomic)
    lo = max(0, int(problem.lower_bound() / unit) - 1)  # may be feasible or not
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
