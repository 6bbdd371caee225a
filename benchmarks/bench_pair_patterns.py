"""How low DP pairs can take a tp-1 plan's busiest index: a restricted pattern ILP.

A check of the DP pair search (``planner.sharing``) against an optimum, layout aside (no bucket
order, no cuts): the DP indices are bins and the matrices of each kind (one transformer layer's
QKV, proj, fc1, fc2, each repeated per layer) are placed whole, or shared by two indices with
the polynomial split, priced as the planner prices them (H800 profile, NVLink between partners).
Two models of a shared matrix:

* ``pieces``: each piece costs its compute plus its exchanges, wherever it goes (what the
  partition's pair stage assumed: partners rarely share a second matrix);
* ``bundles``: indices paired (2s, 2s + 1); a pair's shared matrices run in one lockstep,
  max(Σ compute, Σ exchanges + the shortest compute) per iteration
  (``tp.context.lockstep_seconds``), each partner then also holding whole matrices; a pair's
  lockstep scratch within 2 · C_max (``--cmax``, MiB, as the planner's ``TPOptions.cmax_mib``).

For each, CP-SAT decides over patterns (which matrices a bin, or a pair of bins, holds) whether
every index can stay under a ceiling, and a bisection finds the lowest ceiling (max/mean, the
mean being the useful work per index). Restricted: at most 3 matrices of a kind per bundle
(which can only raise it), the layers' matrices only, no AdamW, no bucket order and not the rule
that a pair shares one matrix per bucket (which can lower it) — a reference for the search, not
a bound. It is the same formulation as the planner's second start
(``sharing.cpsat_start.pattern_start``), written apart over the layers' kinds by name: a check
of what the materialisation and the search then reach, not an independent optimum. Then the
planner's bundle stage on the real layout. Torch-free; about 2 s.

    python benchmarks/bench_pair_patterns.py [--model qwen3-8b] [--dp 64] [--cmax 512]
"""

from __future__ import annotations

import argparse
import itertools
import time

from ortools.sat.python import cp_model

from canzona.planner.formulas import LOCKSTEP_CMAX, lockstep_bytes
from canzona.planner.hardware import load_hardware
from canzona.planner.layout import ParallelSizes
from canzona.planner.pipeline import inventory_of
from canzona.planner.planning import make_problem
from canzona.planner.sharing import bundle_pairs, pair_decision, pair_waits, price_pair
from canzona.planner.tp.context import lockstep_seconds


def _kinds(problem, hw):  # noqa: ANN001, ANN202
    """Per matrix kind of layer 0: (count, whole load, piece compute, piece exchanges, of
    those beside the piece's own Gram products), in units of the mean useful work per index."""
    mean = problem.total / problem.dp
    out = {}
    for t in problem.tasks:
        if ".layers.0." not in t.name or t.optimizer != "matrix" or len(t.shape) != 2:
            continue
        x = price_pair(problem, t.id, True, hw, hw.intra_node)
        per = x.loads[0] / x.alone_s / mean
        count = sum(1 for u in problem.tasks if u.name.split(".")[-2:] == t.name.split(".")[-2:]
                    and u.shape == t.shape)
        out[t.name.split(".")[-2]] = (count, problem.loads[t.id] / mean, x.compute_s * per,
                                      x.comm_s * per, x.hidden_s * per)
    return out


def _solve(model: cp_model.CpModel) -> bool:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 60
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status == cp_model.UNKNOWN:
        raise SystemExit("CP-SAT decided nothing within 60 s: no figure rather than a wrong one")
    return status in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def _multisets(weights: list[float], cap: float) -> list[tuple[tuple[int, ...], float]]:
    out = []

    def rec(i: int, cur: list[int], load: float) -> None:
        if i == len(weights):
            out.append((tuple(cur), load))
            return
        n = 0
        while load + n * weights[i] <= cap + 1e-12:
            rec(i + 1, cur + [n], load + n * weights[i])
            n += 1

    rec(0, [], 0.0)
    return out


def pieces_feasible(kinds: dict, dp: int, cap: float) -> bool:
    """Every matrix whole or as two pieces (compute + unhidden exchanges each), in dp bins
    ≤ cap."""
    names = list(kinds)
    weights = [kinds[k][1] for k in names] + [kinds[k][2] + kinds[k][3] - kinds[k][4]
                                              for k in names]
    pats = [p for p, _ in _multisets(weights, cap) if any(p)]
    m = cp_model.CpModel()
    x = [m.NewIntVar(0, dp, "") for _ in pats]
    m.Add(sum(x) <= dp)
    for i, k in enumerate(names):
        pairs = m.NewIntVar(0, kinds[k][0], "")
        m.Add(sum(v * p[i] for v, p in zip(x, pats)) + pairs == kinds[k][0])
        m.Add(sum(v * p[len(names) + i] for v, p in zip(x, pats)) == 2 * pairs)
    return _solve(m)


def bundles_feasible(kinds: dict, dp: int, cap: float, steps: int, scratch: dict[str, int],
                     scratch_cap: float, most: int = 3) -> bool:
    """Indices paired; per pair a bundle of shared matrices (≤ ``most`` of a kind, their
    ``scratch`` within ``scratch_cap`` bytes) in lockstep, per index whole matrices beside it,
    every index ≤ cap."""
    names = list(kinds)
    bundles = []
    for cnt in itertools.product(range(most + 1), repeat=len(names)):
        if sum(scratch[k] * c for k, c in zip(names, cnt)) > scratch_cap:
            continue
        pieces = [kinds[k][2:5] for k, c in zip(names, cnt) for _ in range(c)]
        lock = lockstep_seconds(pieces, steps) if pieces else 0.0
        if lock <= cap:
            bundles.append((cnt, lock))
    sides = _multisets([kinds[k][1] for k in names], cap)
    m = cp_model.CpModel()
    n = {(b, s): m.NewIntVar(0, dp, "") for b, (_, lock) in enumerate(bundles)
         for s, (_, w) in enumerate(sides) if lock + w <= cap}
    per_bundle = [m.NewIntVar(0, dp // 2, "") for _ in bundles]
    for b, (cnt, _) in enumerate(bundles):
        tot = sum(v for (bb, _), v in n.items() if bb == b)
        if any(cnt):
            m.Add(tot == 2 * per_bundle[b])
        else:
            m.Add(per_bundle[b] == 0)
    m.Add(sum(n.values()) == dp)
    for i, k in enumerate(names):
        m.Add(sum(v * sides[s][0][i] for (_, s), v in n.items())
              + sum(c * bundles[b][0][i] for b, c in enumerate(per_bundle)) == kinds[k][0])
    return _solve(m)


def lowest(feasible, lo: float, hi: float, rounds: int = 12) -> float:  # noqa: ANN001
    """The lowest feasible ceiling in [lo, hi] (hi feasible), to (hi − lo)/2^rounds."""
    for _ in range(rounds):
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--cmax", type=float, default=512.0, help="C_max, MiB (the planner's default)")
    args = ap.parse_args()
    hw = load_hardware(args.hardware)
    spec, _ = inventory_of(args.model)
    problem = make_problem(spec, ParallelSizes(dp=args.dp, tp=1))
    kinds = _kinds(problem, hw)
    mean = problem.total / problem.dp
    whole_top = max(k[1] for k in kinds.values())
    print(f"{args.model} dp{args.dp} tp1, {hw.name}: per kind (count, whole, piece compute, "
          "piece exchanges, of those hidden by its own Gram) / mean useful work per index")
    for k, (c, w, comp, ex, hid) in kinds.items():
        print(f"  {k:12} {c:4d}  {w:.4f}  {comp:.4f}  {ex:.4f}  {hid:.4f}")
    t0 = time.perf_counter()
    hi = max(2 * whole_top, 2.0)
    p = lowest(lambda c: pieces_feasible(kinds, args.dp, c), 0.5, hi)
    scratch = {}
    for t in problem.tasks:
        if ".layers.0." in t.name and t.name.split(".")[-2] in kinds:
            m, n = max(t.shape), min(t.shape)
            scratch[t.name.split(".")[-2]] = lockstep_bytes(-(-m // 2), n, 2, True, 2)
    cap = LOCKSTEP_CMAX * args.cmax * 2**20
    b = lowest(lambda c: bundles_feasible(kinds, args.dp, c, problem.settings.ns_steps, scratch,
                                          cap), 0.5, hi)
    print(f"restricted ILP, pieces priced alone: {p:.4f}; bundles of fixed pairs (lockstep "
          f"scratch ≤ {cap / 2**30:.2f} GiB): {b:.4f} ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    got = bundle_pairs(problem, pair_decision(problem, hw, "all-split"), hw,
                       scratch_cap=int(cap))
    if got is None:
        print("sharing.bundle_pairs: not applicable here")
        return
    used, cuts = got
    print(f"sharing.bundle_pairs on the layout: {max(pair_waits(used, cuts)) / mean:.4f} "
          f"({len(used.pairs)} matrices shared, {time.perf_counter() - t0:.2f} s)")


if __name__ == "__main__":
    main()
