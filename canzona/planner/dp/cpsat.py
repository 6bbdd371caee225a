"""CP-SAT model of the DP partition (read like ``ortools/sat/samples/bin_packing_sat.py``).

data:      per bucket b, units u (atomic matrices whole, AdamW items in pieces) in buffer order,
           with integer loads w_u (scaled) and element counts n_u; R_b ranks per bucket.
variables: x[b, u, r] = 1 if unit u of bucket b lies in rank r's slice.
           M = the maximum load over DP indices.
constraints:
  * every unit lies in exactly one slice;
  * slices are contiguous and in rank order: owner(u) ≤ owner(u+1);
  * (optional) every slice holds at most comm_limit · S_b / R_b elements;
  * M ≥ Σ w_u x[b, u, r] over every (b, u, r) that belongs to DP index d, for every d
    (the objective's F, ``Objective.cpsat_index_term``).
objective: minimise M (+ the objective's per-slice terms h_b(Σ_u n_u x[b, u, r]) when it has
them, ``Objective.cpsat_slice_term``); then, M held, the busiest DP index's optimizer state
plus its slice elements (the secondary balances), from the first answer.
The search is warm-started with a hint, limited in deterministic time with a fixed worker count
(so the same inputs give the same plan) and every status is checked.
"""

from __future__ import annotations

import numpy as np

from ..errors import OptionError
from ..objective import MAX_LOAD, Objective
from ..planning import DPProblem
from .bounds import SCALE_UNITS
from .units import bucket_units, piece_grain


def solve_cpsat(problem: DPProblem, hint: dict, *, time_limit_s: float, seed: int,
                workers: int = 1, comm_limit: float | None = None,
                objective: Objective = MAX_LOAD):
    """Minimise the objective (today: the maximum DP load). Returns (cuts, status, certified
    lower bound on the maximum load; 0 when the objective has per-slice terms)."""
    from ortools.sat.python import cp_model  # OR-Tools costs ~0.6 s to import: only when needed

    mean = problem.total_load() / problem.dp
    unit_load = mean / SCALE_UNITS if mean > 0 else 1.0
    model = cp_model.CpModel()
    loads: list[list] = [[] for _ in range(problem.dp)]
    states: list[list] = [[] for _ in range(problem.dp)]  # scaled optimizer state per index
    elems: list[list] = [[] for _ in range(problem.dp)]  # scaled slice elements per index
    total_state = sum(it.state_bytes for b in problem.buckets for it in b.items)
    total_elems = sum(b.end - b.start for b in problem.buckets)
    unit_state = max(1.0, total_state / problem.dp / SCALE_UNITS)
    unit_elems = max(1.0, total_elems / problem.dp / SCALE_UNITS)
    owner_vars: dict = {}
    slice_terms: list = []
    units_by_key = {}
    max_piece = 0.0
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u = bucket_units(b, 4 * b.ranks, piece_grain(problem))
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
            st = int((u.state[k + 1] - u.state[k]) / unit_state) if u.state is not None else 0
            ne = int((u.bounds[k + 1] - u.bounds[k]) / unit_elems)
            for r, lit in enumerate(lits):
                x[k, r] = lit
                d = problem.dp_index(b, r)
                if w:
                    loads[d].append(w * lit)
                if st:
                    states[d].append(st * lit)
                if ne:
                    elems[d].append(ne * lit)
        # Slices are contiguous and in rank order.
        for a, c in zip(owners, owners[1:]):
            model.add(a <= c)
        if comm_limit is not None or objective.has_bucket_term:
            cap = int(comm_limit * (u.bounds[-1] - u.bounds[0]) / R) if comm_limit else None
            for r in range(R):
                size = sum(int(u.bounds[k + 1] - u.bounds[k]) * x[k, r] for k in range(m))
                if cap is not None:
                    # A slice holds at most comm_limit × the even slice of elements.
                    model.add(size <= cap)
                term = objective.cpsat_slice_term(model, problem, b, size, unit_load)
                if term is not None:
                    slice_terms.append(term)
        owner_vars[key] = owners
        # Hint: the warm start's owners.
        idx = [int(i) for i in _indices(u, hint[key])]
        for r in range(R):
            for k in range(idx[r], idx[r + 1]):
                model.add_hint(owners[k], r)
    top = SCALE_UNITS * problem.dp  # total scaled load bound
    M = objective.cpsat_index_term(model, [sum(x) for x in loads], top)
    model.minimize(M + sum(slice_terms) if slice_terms else M)

    solver = cp_model.CpSolver()
    # Deterministic time keeps plans reproducible; the wall-clock cap (2x) only guards slow hosts.
    solver.parameters.max_deterministic_time = float(time_limit_s)
    solver.parameters.max_time_in_seconds = 2.0 * float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise OptionError("{DPOptions.comm_limit} is too tight: no cut points satisfy it; "
                              "raise it.", fields=("DPOptions.comm_limit",))
        # UNKNOWN: no solution in time; keep the warm start.
        return hint, "cpsat-unknown", 0
    phase1 = status
    bound = int(solver.best_objective_bound * unit_load - 2 * max_piece)
    # The first phase's owners: kept if the second phase finds nothing in its time (a slow or
    # busy host reaches the wall-clock cap before re-finding the hint).
    chosen = {key: [solver.value(o) for o in owners] for key, owners in owner_vars.items()}
    if not slice_terms:
        # Second phase: the busiest load held, balance the optimizer state and the slices'
        # elements (what ``auto``'s smooth phases do), from the first phase's answer.
        model.clear_hints()
        for key, owners in owner_vars.items():
            for o in owners:
                model.add_hint(o, solver.value(o))
        model.add(M <= solver.value(M))
        ms = model.new_int_var(0, SCALE_UNITS * problem.dp, "max_state")
        me = model.new_int_var(0, SCALE_UNITS * problem.dp, "max_elems")
        for d in range(problem.dp):
            model.add(ms >= sum(states[d]))  # the busiest state
            model.add(me >= sum(elems[d]))  # the largest slices
        model.minimize(ms + me)
        # (the same deterministic budget as the first phase)
        second = solver.solve(model)
        if second in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            chosen = {key: [solver.value(o) for o in owners] for key, owners in owner_vars.items()}
    cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u = units_by_key[key]
        owners = chosen[key]
        c = [int(u.bounds[0])]
        for r in range(b.ranks - 1):
            # cut r+1 sits after the last unit owned by a rank ≤ r
            k = sum(1 for o in owners if o <= r)
            c.append(int(u.bounds[k]))
        c.append(int(u.bounds[-1]))
        cuts[key] = tuple(c)
    # Keep the better of the warm start and CP-SAT's answer, judged on the exact loads.
    if objective.score(problem, cuts) > objective.score(problem, hint):
        cuts = hint
    name = "optimal" if phase1 == cp_model.OPTIMAL else "feasible"
    if slice_terms:
        return cuts, f"cpsat-{name}", 0
    return cuts, f"cpsat-{name}", max(0, bound)


def _indices(u, cuts):
    return [int(np.searchsorted(u.bounds, c)) for c in cuts]
