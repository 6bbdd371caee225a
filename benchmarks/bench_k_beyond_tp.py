"""More ranks than the TP group (k > tp), and fewer: what sharing the heaviest matrix over
a TP group and a second DP index (``TPPair``, k = 2·tp), and the lighter ones over TP sub-groups
(``sharing.tp_sub_piece``), could give at scale, before the planner places them (torch-free,
modelled, layout-free).

    python benchmarks/bench_k_beyond_tp.py [--hardware h800] [--json]

Per configuration: each kind of shared piece's compute and collectives per orthogonalisation
(``planner.sharing``: over its TP group, k = tp, and for fc1 also k = 2·tp), the bound with
sharing (``sharing_bound``: work, and the longest critical path, a piece alone with its
collectives) with and without k = 2·tp, and a **layout-free placement**: every piece on some DP
index (no bucket order, no cuts: a floor on what the partition can reach), greedily, heaviest
first, each onto the index whose lockstep is then the shortest, then moves and swaps off the
busiest index; an index runs its pieces as the runtime does
(``tp.context.Lockstep``: in batches of 2 · C_max scratch, per iteration the longest of Σ compute,
Σ collectives + the least compute a piece does outside its own collectives, and each piece's own
chain). Printed: the busiest index's lockstep over the mean
useful work per GPU, and the mean of Σ collectives per index (a shared piece's Gram collectives
do not shrink with k, so they bound what any placement reaches). Then the exact layout-free
optimum with every matrix free to take any option: over its TP group or a TP pair; and TP
sub-groups too; and sub-groups without pairs. A few seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json

from canzona.planner.formulas import lockstep_bytes
from canzona.planner.hardware import load_hardware
from canzona.planner.inventory import build_inventory
from canzona.planner.layout import ParallelSizes
from canzona.planner.models import get_preset
from canzona.planner.options import MIB
from canzona.planner.planning import make_problem
from canzona.planner.settings import OptimizerSettings
from canzona.planner.sharing import kind_of, share_options, sharing_bound
from canzona.planner.tp.context import Lockstep

CONFIGS = [("llama3-70b", 256, 8), ("qwen3-32b", 128, 8)]
CMAX_MIB = 512  # TPOptions' default C_max; a lockstep batch holds 2 · C_max


def _pieces(problem, hw, pair: bool) -> list[tuple[str, float, float, int, float]]:
    """(kind, compute s, collectives s, scratch bytes, collectives s beside its own Gram
    products) of every shared piece: each matrix over
    its TP group with the polynomial split, fc1 (with ``pair``) as two pieces over k = 2·tp."""
    rate = hw.peak_flops.get("bf16", max(hw.peak_flops.values())) * hw.compute_efficiency
    out = []
    for t in problem.tasks:
        if t.optimizer != "matrix":
            continue
        kind = kind_of(t.name)
        m, n = max(t.shape), min(t.shape)
        group = "tp_pair" if pair and kind == "mlp.linear_fc1" else "tp"
        o = next((o for o in share_options(problem, t.id, hw) if o.group == group
                  and o.split_poly), None)
        if o is None:
            raise SystemExit(f"{t.name}: no {group} option")
        piece = (kind, o.compute_s(rate), o.comm_s,
                 lockstep_bytes(-(-m // o.k), n, o.k, True, 2), o.hidden_s)
        out += [piece] * (o.k // problem.sizes.tp)
    return out


def _place(pieces, dp: int, cap: int) -> list[Lockstep]:
    """Heaviest piece first, each onto the index whose lockstep is then the shortest (ties:
    the lowest index); then moves and swaps off the busiest index (:func:`_improve`)."""
    bins = [Lockstep(cap) for _ in range(dp)]
    order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i][1] + pieces[i][2]), i))
    for i in order:
        _, comp, comm, nbytes, hidden = pieces[i]
        item = (i, comp, comm, max(comp, comm), nbytes, hidden)
        best = None
        for d, b in enumerate(bins):
            key = (b.loads_with([[item]])[1], d)
            if best is None or key < best[0]:
                best = (key, d)
        bins[best[1]].add(item)
    return _improve(bins, cap)


def _lock(items, cap: int) -> Lockstep:
    out = Lockstep(cap)
    for x in items:
        out.add(x)
    return out


def _improve(bins: list[Lockstep], cap: int, rounds: int = 2000) -> list[Lockstep]:
    """Moves and swaps off the busiest index while they lower it and the index they touch
    stays under it (pieces alike by their (compute, collectives, hidden, bytes) are tried
    once per index)."""
    loads = [b.load() for b in bins]
    for _ in range(rounds):
        top = max(range(len(bins)), key=lambda d: (loads[d], -d))
        best = None
        for x in {y[1:]: y for y in bins[top].items}.values():
            rest = _lock([y for y in bins[top].items if y is not x], cap)
            seen = set()
            for d, b in enumerate(bins):
                if d == top:
                    continue
                alike = (tuple(sorted(y[1:] for y in b.items)),)
                if alike in seen:
                    continue
                seen.add(alike)
                here = _lock(b.items + [x], cap).load()  # a move
                new = max(rest.load(), here)
                if new < loads[top] - 1e-12 and (best is None or new < best[0]):
                    best = (new, d, x, None)
                for z in {y[1:]: y for y in b.items}.values():  # a swap
                    if z[1:] == x[1:]:
                        continue
                    there = _lock([y for y in b.items if y is not z] + [x], cap).load()
                    mine = _lock(rest.items + [z], cap).load()
                    new = max(there, mine)
                    if new < loads[top] - 1e-12 and (best is None or new < best[0]):
                        best = (new, d, x, z)
        if best is None:
            break
        _, d, x, z = best
        mine = [y for y in bins[top].items if y is not x] + ([z] if z is not None else [])
        theirs = [y for y in bins[d].items if y is not z] + [x]
        bins[top], bins[d] = _lock(mine, cap), _lock(theirs, cap)
        loads[top], loads[d] = bins[top].load(), bins[d].load()
    return bins


def _optimum(pieces, dp: int, cap: int, hi: float) -> float:
    """The least busiest index over every placement of the pieces on ``dp`` indices (at most
    4 pieces on one): :func:`_patterns` with each distinct piece its own kind."""
    kinds: dict = {}
    for x in pieces:
        kinds[x[1:]] = kinds.get(x[1:], 0) + 1
    types = [(k, "", 1, k, 1) for k in sorted(kinds)]
    return _patterns(types, kinds, dp, cap, hi)[0]


def _free_optimum(problem, hw, cap: int, hi: float,
                  groups: tuple = ("tp", "tp_pair")) -> tuple[float, dict]:
    """As :func:`_optimum`, with each matrix free to take any of its sharing options over
    ``groups`` (its TP group, with a partner DP index, a TP sub-group: ``sharing.share_options``;
    the polynomial split or not): per kind of matrix, how many take each option is a variable
    too; a matrix's halves over k = 2·tp lie on partner indices (``_patterns``' ``partners``).
    Returns the least busiest index and the options used ("kind option" → matrices)."""
    rate = hw.peak_flops.get("bf16", max(hw.peak_flops.values())) * hw.compute_efficiency
    tp = problem.sizes.tp
    count: dict = {}
    opts: dict = {}
    for t in problem.tasks:
        if t.optimizer != "matrix":
            continue
        kind = kind_of(t.name)
        count[kind] = count.get(kind, 0) + 1
        if kind not in opts:
            m, n = max(t.shape), min(t.shape)
            # pieces per matrix over k ≥ tp ranks; a sub-group's piece is tp/k matrices side
            # by side (one per sub-group), as one lockstep piece on every rank of the index
            opts[kind] = [(f"{o.group}{o.k if o.group == 'tp_sub' else ''}"
                           f"{'-split' if o.split_poly else ''}",
                           max(1, o.k // tp), max(1, tp // o.k),
                           (o.compute_s(rate), o.comm_s,
                            lockstep_bytes(-(-m // o.k), n, o.k, o.split_poly, 2), o.hidden_s))
                          for o in share_options(problem, t.id, hw, groups=groups)]
    types = [(kind, name, per, piece, mats) for kind in sorted(opts)
             for name, per, mats, piece in opts[kind]]
    return _patterns(types, count, problem.dp, cap, hi, partners=True)


def _patterns(types: list, count: dict, dp: int, cap: int, hi: float,
              most: int = 4, partners: bool = False) -> tuple[float, dict]:
    """A pattern model: an index's multiset of at most ``most`` pieces (``types``: (kind,
    option, pieces per matrix, (compute, collectives, bytes, hidden), matrices per piece)) and
    its lockstep
    (:class:`Lockstep`, alike pieces in type order) within a ceiling, how many indices take
    each, how many matrices of each kind (``count``) take each option; CP-SAT (one worker)
    decides each ceiling, bisected over the patterns' loads up to ``hi`` (a placement's).
    With ``partners``, the halves of a matrix shared by two DP indices (types of two pieces per
    matrix) lie on partners, the indices paired once: the indices holding the same multiset of
    halves come in even numbers (two such indices can be partners, each holding one half of
    the same matrices). Returns the least ceiling and the options taken."""
    from ortools.sat.python import cp_model

    pats = []
    for size in range(1, most + 1):
        for combo in itertools.combinations_with_replacement(range(len(types)), size):
            cnt = tuple(combo.count(j) for j in range(len(types)))
            if any(c * ty[4] > ty[2] * count[ty[0]] for c, ty in zip(cnt, types)):
                continue  # more pieces of a kind than its matrices make
            lock = _lock([(j, *types[j][3][:2], 0.0, *types[j][3][2:])
                          for j, c in enumerate(cnt) for _ in range(c)], cap)
            if lock.load() <= hi + 1e-12:
                pats.append((cnt, lock.load()))

    def solve(ceiling: float) -> dict | None:
        m = cp_model.CpModel()
        use = [(p, m.NewIntVar(0, dp, "")) for p in pats if p[1] <= ceiling + 1e-12]
        m.Add(sum(v for _, v in use) <= dp)
        took = [m.NewIntVar(0, count[ty[0]], "") for ty in types]
        for kind in count:
            m.Add(sum(y for y, ty in zip(took, types) if ty[0] == kind) == count[kind])
        for j, (_, _, per, _, mats) in enumerate(types):
            m.Add(sum(v * p[0][j] for p, v in use) * mats == per * took[j])
        if partners:
            halves = [j for j, ty in enumerate(types) if ty[2] == 2]
            sigs: dict = {}
            for p, v in use:
                sig = tuple(p[0][j] for j in halves)
                if any(sig):
                    sigs.setdefault(sig, []).append(v)
            for vs in sigs.values():
                m.Add(sum(vs) == 2 * m.NewIntVar(0, dp // 2, ""))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = 60
        status = solver.Solve(m)
        if status == cp_model.UNKNOWN:
            raise SystemExit("CP-SAT decided nothing within 60 s: "
                             "no figure rather than a wrong one")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return {f"{ty[0]} {ty[1]}": solver.Value(y) for ty, y in zip(types, took)
                if solver.Value(y)}

    loads = sorted({load for _, load in pats})
    lo, up, best = 0, len(loads) - 1, None
    while lo < up:  # the optimum is one pattern's load
        mid = (lo + up) // 2
        got = solve(loads[mid])
        if got is not None:
            up, best = mid, got
        else:
            lo = mid + 1
    if best is None:
        best = solve(loads[lo])
        if best is None:  # even the top ceiling (the placement's) failed: more pieces per index
            raise SystemExit(f"no placement with at most {most} pieces per index reaches the "
                             f"heuristic's busiest index: raise `most`")
    return loads[lo], best


def run(model: str, dp: int, tp: int, hardware: str) -> dict:
    hw = load_hardware(hardware)
    pr = make_problem(build_inventory(get_preset(model)), ParallelSizes(dp=dp, tp=tp),
                      OptimizerSettings(name="muon"), cost="flops")
    rate = hw.peak_flops.get("bf16", max(hw.peak_flops.values())) * hw.compute_efficiency
    flops_total = sum(c.flops for c in pr.costs)
    out: dict = {"config": f"{model} dp{dp} tp{tp}"}
    free: tuple | None = None
    ceiling: dict = {}  # per label, the busiest index placed and at best: a ceiling that holds
    for label, groups in (("k = tp", ("tp", "dp")), ("k = 2·tp", ("tp", "tp_pair", "dp"))):
        r = sharing_bound(pr, hardware=hw, groups=groups)
        mean_s = r.mean * flops_total / sum(pr.loads) / rate  # useful work per GPU, seconds
        pieces = _pieces(pr, hw, pair=label != "k = tp")
        bins = _place(pieces, dp, 2 * CMAX_MIB * MIB)
        best = _optimum(pieces, dp, 2 * CMAX_MIB * MIB, max(b.load() for b in bins))
        ceiling[label] = max(b.load() for b in bins)  # the placement: never below the optimum
        kinds = {}
        for kind, comp, comm, _, hidden in pieces:
            kinds.setdefault(kind, (round(comp * 1e3, 2), round(comm * 1e3, 2),
                                    round(hidden * 1e3, 2)))
        out[label] = {
            "bound_work": round(r.shared_ratio, 3),
            "bound_longest_path": round(r.longest_path / r.mean, 3),
            "placed_max_over_mean": round(max(b.load() for b in bins) / mean_s, 3),
            "optimum_max_over_mean": round(best / mean_s, 3),
            "mean_collectives_over_mean": round(sum(b.comm for b in bins) / dp / mean_s, 3),
            "pieces_ms": kinds, "mean_useful_ms": round(mean_s * 1e3, 2)}
        if label == "k = 2·tp":
            free = _free_optimum(pr, hw, 2 * CMAX_MIB * MIB,
                                 max(max(b.load() for b in bins), best))
            out["free_options"] = {"optimum_max_over_mean": round(free[0] / mean_s, 3),
                                   "options": free[1]}
            for key, groups, hi in (
                    ("free_with_sub_groups", ("tp", "tp_pair", "tp_sub"), ceiling[label]),
                    ("sub_groups_without_pairs", ("tp", "tp_sub"), ceiling["k = tp"])):
                got = _free_optimum(pr, hw, 2 * CMAX_MIB * MIB, hi, groups)
                out[key] = {"optimum_max_over_mean": round(got[0] / mean_s, 3),
                            "options": got[1]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run(m, dp, tp, args.hardware) for m, dp, tp in CONFIGS]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"hardware {args.hardware}; per GPU over the mean useful work; pieces: compute / "
          "collectives ms per orthogonalisation (of those, beside the piece's own Gram "
          "products)")
    for row in rows:
        print(f"\n{row['config']} (mean useful work {row['k = tp']['mean_useful_ms']} ms per GPU)")
        for label in ("k = tp", "k = 2·tp"):
            x = row[label]
            print(f"  fc1 over {label:9s} bound {x['bound_work']:.3f}, longest path "
                  f"{x['bound_longest_path']:.3f} | layout-free: busiest "
                  f"{x['placed_max_over_mean']:.3f} placed, {x['optimum_max_over_mean']:.3f} "
                  f"at best; mean Σ collectives {x['mean_collectives_over_mean']:.3f}")
        pieces = [(kind, "tp", x) for kind, x in row["k = tp"]["pieces_ms"].items()]
        pieces.append(("mlp.linear_fc1", "2·tp", row["k = 2·tp"]["pieces_ms"]["mlp.linear_fc1"]))
        for kind, k, (comp, comm, hidden) in pieces:
            print(f"    {kind:28s} k = {k:4s} {comp:6.2f} / {comm:5.2f} ms "
                  f"({hidden:4.2f} beside its own Gram)")
        for key, what in (("free_options", "every matrix free to take any option"),
                          ("free_with_sub_groups", "and TP sub-groups too"),
                          ("sub_groups_without_pairs", "TP sub-groups without k = 2·tp")):
            f = row[key]
            print(f"  {what}: busiest {f['optimum_max_over_mean']:.3f} at best, with "
                  + ", ".join(f"{n} {k}" for k, n in f["options"].items()))


if __name__ == "__main__":
    main()
