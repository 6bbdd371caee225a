"""α-balanced static partitioning for data parallelism (Canzona, arXiv 2602.06079, §DP).

Inside every ZeRO-1 bucket, DP rank r still owns the r-th slice [s_r, s_{r+1}) — so one
(variable-size) reduce-scatter and all-gather per bucket remain — but the cut points s_1..s_{R-1}
move to boundaries of matrix-optimizer parameters, so every matrix is whole on one rank. AdamW
parameters are elementwise and may be cut anywhere, as plain ZeRO-1 does.

Solvers (one signature, :func:`solve`):

* ``greedy`` — the paper's α-balanced LPT: buckets visited by load, largest first; each bucket's
  target split blends the even element split (α = 0, ZeRO-1's geometry) with filling every rank's
  deficit to the mean load (α = 1), then snaps each cut to the nearest allowed boundary.
* ``auto`` (default) — greedy, then exact per-bucket re-optimisation by dynamic programming
  (block coordinate descent: each bucket's cuts are re-chosen optimally given the other buckets,
  first for the sum of squared loads, then for the maximum), until no bucket improves.
* ``cpsat`` — an OR-Tools CP-SAT model minimising the maximum load, warm-started from ``auto``,
  limited in deterministic time with a fixed worker count (reproducible), returning its proven
  bound.

An optional ``comm_limit`` bounds every slice to ``comm_limit × S/R`` elements: with the padded
collectives, a bucket moves R·max-slice bytes, so this caps the communication overhead α trades
against. ``reorder`` (on by default) lets parameters move inside a bucket: a bucket is reduced
as a unit, so the order inside it changes neither when its reduce-scatter can start nor what it
moves, only which parameters can share a rank; the plan records the new order, and canzona's
runtime lays its buffers out from the plan. ``reorder=False`` keeps Megatron's order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import CanzonaError
from .plan import Plan, SolverOptions
from .planning import BucketProblem, DPProblem, build_plan, equal_cuts, evaluate, owner_of

SOLVERS = ("auto", "greedy", "cpsat")
#: The bin-packing bound (a CP-SAT covering model) is computed when the plan is more than this
#: far above the simple bounds: below it the simple bound already certifies the plan.
PACKING_BOUND_ABOVE = 0.02
#: Under TP, the paper's greedy cuts replace ours only if they lower the busiest GPU by more
#: than this (relative).
JOINT_TP_MARGIN = 0.005
Cuts = dict[tuple[int, int], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Units:
    """A bucket cut into units: atomic items whole, divisible items in pieces.

    ``bounds[k]`` is the element offset of the k-th allowed cut position (``bounds[0]`` = bucket
    start, ``bounds[-1]`` = bucket end) and ``prefix[k]`` the load before it.
    """

    bounds: np.ndarray  # int64, len m+1
    prefix: np.ndarray  # float64, len m+1 (load)
    piece_load: float   # largest load of a divisible piece (0 if none)


def _units(b: BucketProblem, pieces: int, grain: float) -> Units:
    """``pieces``: most pieces per divisible item; ``grain``: target load of one piece (items
    lighter than that, such as norms under the FLOPs cost, stay one unit)."""
    bounds = [b.start]
    loads: list[float] = []
    max_piece = 0.0
    items = b.items
    for k, it in enumerate(items):
        end = items[k + 1].start if k + 1 < len(items) else b.end
        if it.atomic or it.end - it.start <= 1:
            bounds.append(end)
            loads.append(float(it.load))
            continue
        n = it.end - it.start
        k = max(1, min(pieces, math.ceil(it.load / grain) if grain > 0 else pieces))
        step = max(1, -(-n // k))
        pos = it.start
        while pos < it.end:
            nxt = min(it.end, pos + step)
            load = it.load * (nxt - pos) / n
            max_piece = max(max_piece, load)
            pos = nxt
            bounds.append(end if pos >= it.end else pos)
            loads.append(load)
    prefix = np.concatenate([[0.0], np.cumsum(loads)]) if loads else np.zeros(1)
    return Units(np.asarray(bounds, dtype=np.int64), prefix, max_piece)


def _grain(problem: DPProblem) -> float:
    """Target load of a divisible piece: 1/64 of the mean rank load."""
    return problem.total_load() / problem.dp / 64


def _cuts_from_indices(u: Units, idx: list[int]) -> tuple[int, ...]:
    return tuple(int(u.bounds[i]) for i in idx)


# --- the paper's greedy ----------------------------------------------------------------------


def _snap(u: Units, target_pos: float, lo: int) -> int:
    """Index of the allowed boundary nearest ``target_pos``, not before index ``lo``."""
    k = int(np.searchsorted(u.bounds, target_pos))
    cands = [c for c in (k - 1, k) if lo <= c < len(u.bounds)]
    if not cands:
        return max(lo, min(k, len(u.bounds) - 1))
    return min(cands, key=lambda c: (abs(float(u.bounds[c]) - target_pos), c))


def _pos_at_load(u: Units, load: float) -> float:
    """Element position where the bucket's cumulative load reaches ``load`` (interpolated)."""
    p = u.prefix
    k = int(np.searchsorted(p, load, side="left"))
    if k <= 0:
        return float(u.bounds[0])
    if k >= len(p):
        return float(u.bounds[-1])
    span = p[k] - p[k - 1]
    frac = 0.0 if span <= 0 else (load - p[k - 1]) / span
    return float(u.bounds[k - 1] + frac * (u.bounds[k] - u.bounds[k - 1]))


def _load_at(u: Units, pos: float) -> float:
    """Cumulative load of the bucket up to element ``pos`` (linear inside a unit)."""
    k = int(np.searchsorted(u.bounds, pos, side="right"))
    if k <= 0:
        return 0.0
    if k >= len(u.bounds):
        return float(u.prefix[-1])
    lo, hi = u.bounds[k - 1], u.bounds[k]
    frac = (pos - lo) / (hi - lo) if hi > lo else 0.0
    return float(u.prefix[k - 1] + frac * (u.prefix[k] - u.prefix[k - 1]))


def greedy(problem: DPProblem, *, alpha: float = 1.0, pieces: int | None = None) -> Cuts:
    """The paper's α-balanced LPT over buckets (largest bucket first).

    Each cut goes to (1-α)·(even cut) + α·(position where the deficit shares are filled), then
    to the nearest allowed position: anywhere inside an AdamW item, else the nearest boundary of
    a matrix-optimizer parameter.
    """
    dp = problem.dp
    mean = problem.total_load() / dp
    load = [0.0] * dp
    cuts: Cuts = {}
    order = sorted(problem.buckets, key=lambda b: (-b.load, b.buffer, b.bucket))
    for b in order:
        u = _units(b, pieces or 4 * b.ranks, _grain(problem))
        divisible = [(it.start, it.end) for it in b.items if not it.atomic]
        R = b.ranks
        ds = [problem.dp_index(b, r) for r in range(R)]
        total = float(u.prefix[-1])
        deficit = [max(0.0, mean - load[d]) for d in ds]
        dsum = sum(deficit)
        share = [total * x / dsum for x in deficit] if dsum > 0 else [total / R] * R
        S = float(u.bounds[-1] - u.bounds[0])
        pos = [int(u.bounds[0])]
        cum_share = 0.0
        for r in range(1, R):
            cum_share += share[r - 1]
            even_pos = float(u.bounds[0]) + S * r / R
            target = (1 - alpha) * even_pos + alpha * _pos_at_load(u, cum_share)
            exact = int(round(target))
            if any(lo < exact < hi for lo, hi in divisible):
                cut = exact  # AdamW items may be cut anywhere, as plain ZeRO-1 does
            else:
                cut = int(u.bounds[_snap(u, target, 0)])
            pos.append(max(cut, pos[-1]))
        pos.append(int(u.bounds[-1]))
        for r in range(R):
            load[ds[r]] += _load_at(u, pos[r + 1]) - _load_at(u, pos[r])
        cuts[(b.buffer, b.bucket)] = tuple(pos)
    return cuts


# --- exact per-bucket re-optimisation (linear-partition DP) -----------------------------------


#: Smooth objectives of the coordinate descent, ever closer to the maximum.
_POWERS = {"ssq": 2, "p8": 8}


def _bucket_dp(u: Units, base: np.ndarray, cap: float | None, objective: str) -> list[int]:
    """Optimal cut indices for one bucket given the other buckets' loads ``base`` per rank.

    Rank r receives units [c_r, c_{r+1}); minimise Σ (base_r + x_r)² or max (base_r + x_r).
    ``cap`` bounds each slice's elements (communication limit).
    """
    R = len(base)
    m = len(u.bounds) - 1
    if m <= 3:
        return _bucket_dp_small(u, base, cap, objective)
    P = u.prefix
    blk = P[None, :] - P[:, None]  # blk[j, i] = load of units j..i-1
    valid = np.triu(np.ones((m + 1, m + 1), dtype=bool))
    if cap is not None:
        span = u.bounds[None, :] - u.bounds[:, None]
        valid &= span <= cap
    inf = np.inf
    choice = np.zeros((R, m + 1), dtype=np.int64)
    g = np.full(m + 1, inf)
    g[0] = 0.0
    for r in range(R):
        rank_cost = base[r] + blk
        if objective == "max":
            tot = np.maximum(g[:, None], rank_cost)
        else:
            tot = g[:, None] + rank_cost ** _POWERS[objective]
        tot = np.where(valid, tot, inf)
        choice[r] = np.argmin(tot, axis=0)  # first (smallest j) on ties: deterministic
        g = tot[choice[r], np.arange(m + 1)]
    if not np.isfinite(g[m]):
        raise CanzonaError("comm_limit is too tight: some bucket cannot be cut into slices that "
                           "small at parameter boundaries; raise --comm-limit.")
    idx = [m]
    for r in range(R - 1, -1, -1):
        idx.append(int(choice[r][idx[-1]]))
    return idx[::-1]


def _bucket_dp_small(u: Units, base: np.ndarray, cap: float | None, objective: str) -> list[int]:
    """The same DP in plain Python, faster than numpy for buckets of at most three units."""
    R, m = len(base), len(u.bounds) - 1
    P = [float(x) for x in u.prefix]
    B = [int(x) for x in u.bounds]
    power = _POWERS.get(objective)
    inf = float("inf")
    g = [0.0] + [inf] * m
    choice = []
    for r in range(R):
        br = float(base[r])
        ng, ch = [inf] * (m + 1), [0] * (m + 1)
        for i in range(m + 1):
            for j in range(i + 1):
                if g[j] == inf or (cap is not None and B[i] - B[j] > cap):
                    continue
                x = br + P[i] - P[j]
                v = max(g[j], x) if power is None else g[j] + x ** power
                if v < ng[i]:
                    ng[i], ch[i] = v, j
        g = ng
        choice.append(ch)
    if g[m] == inf:
        raise CanzonaError("comm_limit is too tight: some bucket cannot be cut into slices that "
                           "small at parameter boundaries; raise --comm-limit.")
    idx = [m]
    for r in range(R - 1, -1, -1):
        idx.append(choice[r][idx[-1]])
    return idx[::-1]


def _loads_by_bucket(problem: DPProblem, units: dict, cuts_idx: dict) -> np.ndarray:
    load = np.zeros(problem.dp)
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u, idx = units[key], cuts_idx[key]
        for r in range(b.ranks):
            load[problem.dp_index(b, r)] += u.prefix[idx[r + 1]] - u.prefix[idx[r]]
    return load


def polish(problem: DPProblem, cuts: Cuts, *, comm_limit: float | None = None,
           max_rounds: int = 30, pieces: int | None = None) -> Cuts:
    """Block coordinate descent: re-cut one bucket at a time, optimally given the others."""
    units = {(b.buffer, b.bucket): _units(b, pieces or 4 * b.ranks, _grain(problem))
             for b in problem.buckets}
    idx: dict[tuple[int, int], list[int]] = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u = units[key]
        idx[key] = [int(np.searchsorted(u.bounds, c)) for c in cuts[key]]  # start: next boundary
    load = _loads_by_bucket(problem, units, idx)
    scale = max(1.0, float(load.max()))
    order = sorted(problem.buckets, key=lambda b: (-b.load, b.buffer, b.bucket))
    for objective in (*_POWERS, "max"):
        power = _POWERS.get(objective, 2)
        for _ in range(max_rounds):
            before = (float(load.max()), float(((load / scale) ** power).sum()))
            for b in order:
                key = (b.buffer, b.bucket)
                u = units[key]
                ds = [problem.dp_index(b, r) for r in range(b.ranks)]
                mine = np.array([u.prefix[idx[key][r + 1]] - u.prefix[idx[key][r]]
                                 for r in range(b.ranks)])
                base = load[ds] - mine
                cap = None
                if comm_limit is not None:
                    cap = comm_limit * (u.bounds[-1] - u.bounds[0]) / b.ranks
                new = _bucket_dp(_scaled(u, scale), base / scale, cap, objective)
                new_mine = np.array([u.prefix[new[r + 1]] - u.prefix[new[r]]
                                     for r in range(b.ranks)])
                if objective == "max" and (base + new_mine).max() > (base + mine).max():
                    continue  # keep the old cut on ties broken the wrong way
                idx[key] = new
                load[ds] = base + new_mine
            after = (float(load.max()), float(((load / scale) ** power).sum()))
            if after >= before if objective == "max" else after[1] >= before[1] * (1 - 1e-12):
                break
    return {k: _cuts_from_indices(units[k], v) for k, v in idx.items()}


def _scaled(u: Units, scale: float) -> Units:
    return Units(u.bounds, u.prefix / scale, u.piece_load / scale)


def rebalance_divisible(problem: DPProblem, cuts: Cuts, *, comm_limit: float | None = None,
                        tolerance: float = 1e-3, ceiling: float | None = None) -> Cuts:
    """Re-place every cut that sits between matrices so the AdamW elements between two matrices
    are shared evenly by the ranks that may take them (:func:`spread_cuts`).

    Such a cut can slide without changing who owns any matrix; spreading keeps optimizer state
    and reduce-scatter slices balanced around huge AdamW tensors (embeddings, output layer),
    which cost almost nothing in FLOPs. Kept only if the max load grows by at most
    ``tolerance`` (relative) and stays within ``ceiling`` (the greedy plan's max, so the result
    is never worse than the paper's algorithm).
    """
    out: Cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        c = cuts[key]
        owners = [owner_of(c, it.start) for it in b.items if it.atomic]
        new = spread_cuts(b, owners)
        if comm_limit is not None:
            cap = comm_limit * (b.end - b.start) / b.ranks
            if max(v - u for u, v in zip(new, new[1:])) > cap:
                new = c
        out[key] = new
    before = max(evaluate(problem, cuts).load)
    after = max(evaluate(problem, out).load)
    limit = before * (1 + tolerance) if ceiling is None else min(before * (1 + tolerance),
                                                                 max(before, ceiling))
    return out if after <= limit else cuts


def _rank_in(problem: DPProblem, b: BucketProblem, d: int) -> int | None:
    """Rank of DP index ``d`` in ``b``'s sharding group (None if d does not hold this bucket)."""
    buf = problem.layout.buffers[b.buffer]
    if not buf.expert:
        return d
    ep = problem.sizes.ep
    return (d - buf.ep_rank) // ep if d % ep == buf.ep_rank else None


def spread_cuts(b: BucketProblem, owners: list[int]) -> tuple[int, ...]:
    """Cut points of bucket ``b`` given the ranks of its matrices (in bucket order).

    Between two consecutive matrices owned by ranks a ≤ c (or the bucket's ends), the AdamW
    elements there are shared evenly by ranks a … c, as ZeRO-1 would share them, so huge AdamW
    tensors (embeddings, output layer) and their optimizer state spread over every rank that
    can take a piece.
    """
    atomic = [it for it in b.items if it.atomic]
    cuts = [b.start] + [0] * (b.ranks - 1) + [b.end]
    prev_end, prev_owner = b.start, 0
    for k in range(len(atomic) + 1):
        lo = prev_end
        hi = atomic[k].start if k < len(atomic) else b.end
        nxt = owners[k] if k < len(atomic) else b.ranks - 1
        # ranks prev_owner … nxt share [lo, hi); cut r (start of rank r) for r in prev_owner+1 … nxt
        share = nxt - prev_owner + 1
        for r in range(prev_owner + 1, nxt + 1):
            cuts[r] = lo + (hi - lo) * (r - prev_owner) // share
        if k < len(atomic):
            prev_end, prev_owner = atomic[k].end, nxt
    return tuple(cuts)


def owners_to_cuts(problem: DPProblem, owners: dict[tuple[int, int], list[int]]) -> Cuts:
    """Cut points from the owners (ranks) of every bucket's matrices (see :func:`spread_cuts`)."""
    return {(b.buffer, b.bucket): spread_cuts(b, owners[(b.buffer, b.bucket)])
            for b in problem.buckets}


def swap_search(problem: DPProblem, cuts: Cuts, *, max_moves: int = 5000) -> tuple[Cuts, int]:
    """Local search on whole matrices: move one matrix off the busiest DP index, or swap it
    with a lighter matrix of another index, wherever both buckets' rank order allows.

    This is what the per-bucket DP cannot do (it changes two buckets at once); it matters most
    where buckets hold one or two matrices, i.e. where the problem is plain bin packing.
    Returns the new cuts and the number of moves made.
    """
    owners: dict[tuple[int, int], list[int]] = {}
    atomic: dict[tuple[int, int], list] = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        c = cuts[key]
        atomic[key] = [it for it in b.items if it.atomic]
        owners[key] = [owner_of(c, it.start) for it in atomic[key]]
    by_key = {(b.buffer, b.bucket): b for b in problem.buckets}
    load = list(evaluate(problem, cuts).load)
    held: dict[int, set] = {d: set() for d in range(problem.dp)}
    for key, own in owners.items():
        for k, r in enumerate(own):
            held[problem.dp_index(by_key[key], r)].add((key, k))

    def window(key, k):
        own = owners[key]
        lo = own[k - 1] if k > 0 else 0
        hi = own[k + 1] if k + 1 < len(own) else by_key[key].ranks - 1
        return lo, hi

    moves = 0
    for _ in range(max_moves):
        top = max(range(problem.dp), key=lambda d: (load[d], -d))
        L = load[top]
        best = None  # (new pair max, kind, ...)
        for key, k in sorted(held[top]):
            b = by_key[key]
            w = atomic[key][k].load
            lo, hi = window(key, k)
            for r in range(lo, hi + 1):
                d2 = problem.dp_index(b, r)
                if d2 == top:
                    continue
                if load[d2] + w < L and (best is None or load[d2] + w < best[0]):
                    best = (load[d2] + w, "move", key, k, r, d2)
                for key2, k2 in held[d2]:
                    if key2 == key:
                        continue
                    w2 = atomic[key2][k2].load
                    if w2 >= w:
                        continue
                    r_top = _rank_in(problem, by_key[key2], top)
                    if r_top is None:
                        continue
                    lo2, hi2 = window(key2, k2)
                    if not lo2 <= r_top <= hi2:
                        continue
                    worst = max(L - w + w2, load[d2] - w2 + w)
                    if worst < L and (best is None or worst < best[0]):
                        best = (worst, "swap", key, k, r, d2, key2, k2, r_top)
        if best is None:
            break
        moves += 1
        _, kind, key, k, r, d2, *rest = best
        w = atomic[key][k].load
        owners[key][k] = r
        held[top].discard((key, k))
        held[d2].add((key, k))
        load[top] -= w
        load[d2] += w
        if kind == "swap":
            key2, k2, r_top = rest
            w2 = atomic[key2][k2].load
            owners[key2][k2] = r_top
            held[d2].discard((key2, k2))
            held[top].add((key2, k2))
            load[d2] -= w2
            load[top] += w2
    return owners_to_cuts(problem, owners), moves


# --- bounds -------------------------------------------------------------------------------------


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


# --- entry point --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Solution:
    cuts: Cuts
    status: str
    bound: int  # certified lower bound on the max load
    problem: DPProblem  # the problem the cuts refer to (reordered, when reordering was used)


def _improve(problem: DPProblem, cuts: Cuts, comm_limit: float | None,
             max_rounds: int = 30) -> Cuts:
    """Per-bucket DP polish alternating with whole-matrix moves/swaps across buckets."""
    best = polish(problem, cuts, comm_limit=comm_limit, max_rounds=max_rounds)
    best_max = max(evaluate(problem, best).load)
    for _ in range(4):
        cand, moves = swap_search(problem, best)
        if not moves:
            break
        cand = polish(problem, cand, comm_limit=comm_limit, max_rounds=max_rounds)
        cand_max = max(evaluate(problem, cand).load)
        if cand_max >= best_max:
            break
        best, best_max = cand, cand_max
    return best


def _joint_tp(original: DPProblem, used: DPProblem, cuts: Cuts, greedy_cuts: Cuts | None,
              say: Callable[[str], None]) -> tuple[DPProblem, Cuts]:
    """Under TP, judge by the busiest GPU (DP index × TP rank), not the busiest DP index: refine
    the cuts on the per-GPU objective (``tp.joint_refine``) when they are more than 1% above
    LB_gpu, and fall back to the paper's greedy cuts if those pack better per GPU."""
    from .tp import TPContext, index_gpu_max, joint_refine, lb_gpu

    ctx = TPContext.build(used)
    gpu_max = max(index_gpu_max(used, cuts, ctx))
    if gpu_max > 1.01 * lb_gpu(used, ctx=ctx):
        say("joint DP×TP refinement")
        refined = joint_refine(used, cuts, ctx=ctx)
        refined_max = max(index_gpu_max(used, refined, ctx))
        if refined_max < gpu_max:
            cuts, gpu_max = refined, refined_max
    if greedy_cuts is not None:
        # Only for a real gain: per-GPU maxima are often flat (the largest matrix), and a tie
        # broken by a sliver of AdamW work must not bring back a badly balanced DP partition.
        gctx = ctx if used is original else TPContext.build(original)
        if max(index_gpu_max(original, greedy_cuts, gctx)) < gpu_max * (1 - JOINT_TP_MARGIN):
            return original, greedy_cuts
    return used, cuts


def solve(problem: DPProblem, *, solver: str = "auto", alpha: float = 1.0,
          time_limit_s: float = 10.0, seed: int = 0, comm_limit: float | None = None,
          workers: int = 1, reorder: bool = True,
          progress: Callable[[str], None] | None = None) -> Solution:
    """Choose every bucket's cut points.

    Args:
        solver: ``auto`` (greedy + exact per-bucket polish), ``greedy`` (the paper) or ``cpsat``.
        alpha: the paper's α ∈ [0, 1] for the greedy start (0: even split, 1: fill deficits).
        time_limit_s: CP-SAT's deterministic time limit.
        seed: CP-SAT's random seed (recorded in the plan).
        comm_limit: bound on each slice, in multiples of the even slice S/R (None: unbounded).
        workers: CP-SAT worker count (fixed, so plans are reproducible).
        reorder: allow parameters to change places inside their bucket (see ``_reorder``); the
            result keeps Megatron's order when that is at least as good. Never worse than the
            paper's greedy; within PACKING_BOUND_ABOVE of the bound, the Megatron-order search
            is skipped.
    """
    if solver not in SOLVERS:
        raise CanzonaError(f"unknown solver '{solver}'; choose one of: {', '.join(SOLVERS)}.")
    if not 0.0 <= alpha <= 1.0:
        raise CanzonaError(f"--alpha must be in [0, 1], got {alpha}.")
    if time_limit_s <= 0:
        raise CanzonaError(f"--time-limit must be positive seconds, got {time_limit_s}.")
    if comm_limit is not None and comm_limit < 1.0:
        raise CanzonaError(f"--comm-limit must be ≥ 1 (a multiple of the even slice), got {comm_limit}.")
    bound = pigeonhole_bound(problem)
    say = progress or (lambda _msg: None)
    say("greedy")
    cuts = greedy(problem, alpha=alpha)
    greedy_max = max(evaluate(problem, cuts).load)
    used = problem
    done = solver == "greedy" and comm_limit is None
    if reorder and not done:
        from ._reorder import assign_free, reorder_problem

        say("reordering")
        rp, owners = reorder_problem(problem, assign_free(problem))
        rcuts = owners_to_cuts(rp, owners)
        if comm_limit is not None or max(evaluate(rp, rcuts).load) > bound * 1.001:
            # The free assignment is nearly balanced: a few polish rounds finish it.
            rcuts = _improve(rp, rcuts, comm_limit, max_rounds=2)
        rcuts = rebalance_divisible(rp, rcuts, comm_limit=comm_limit, ceiling=greedy_max)
        rmax = max(evaluate(rp, rcuts).load)
        if rmax <= greedy_max:
            used, cuts = rp, rcuts
            # Near the bound already: skip the Megatron-order search (it can only tie or lose
            # by < PACKING_BOUND_ABOVE).
            done = rmax <= bound * (1 + PACKING_BOUND_ABOVE)
    if not done:
        say("polishing")
        best = _improve(problem, greedy(problem, alpha=alpha), comm_limit)
        best = rebalance_divisible(problem, best, comm_limit=comm_limit, ceiling=greedy_max)
        best_max = max(evaluate(problem, best).load)
        # Polishing works on a discretisation of the AdamW items: keep the greedy cuts if they are
        # better (unless they break the comm limit, which greedy does not know).
        if used is problem:
            if comm_limit is not None or best_max <= greedy_max:
                cuts = best
        elif best_max <= max(evaluate(used, cuts).load):
            used, cuts = problem, best  # reordering did not help: keep Megatron's order
    elif used is problem:
        cuts = rebalance_divisible(problem, cuts, comm_limit=comm_limit, ceiling=greedy_max)
    if problem.sizes.tp > 1 and not done:
        used, cuts = _joint_tp(problem, used, cuts,
                               greedy(problem, alpha=alpha) if comm_limit is None else None, say)
    elif problem.sizes.tp > 1 and solver != "greedy":
        used, cuts = _joint_tp(problem, used, cuts, None, say)
    problem = used
    status = "heuristic"
    if solver == "cpsat":
        from ._cpsat import solve_cpsat

        say("cp-sat")
        cuts, status, cp_bound = solve_cpsat(problem, cuts, time_limit_s=time_limit_s, seed=seed,
                                             workers=workers, comm_limit=comm_limit)
        bound = max(bound, cp_bound)
    ev = evaluate(problem, cuts)
    if max(ev.load) > bound * (1 + PACKING_BOUND_ABOVE):
        from ._cpsat import packing_bound  # OR-Tools costs ~0.6 s to import: only when needed

        say("bounding")
        bound = max(bound, packing_bound(problem, max(ev.load)))
    if max(ev.load) <= bound:
        status = "optimal"
    return Solution(cuts, status, bound, used)


def plan_dp(problem: DPProblem, *, solver: str = "auto", alpha: float = 1.0,
            time_limit_s: float = 10.0, seed: int = 0, comm_limit: float | None = None,
            workers: int = 1, model_source: str = "preset", reorder: bool = True,
            progress: Callable[[str], None] | None = None) -> Plan:
    """Solve the DP partition and return the plan (strategy ``canzona``, or ``canzona-greedy``)."""
    sol = solve(problem, solver=solver, alpha=alpha, time_limit_s=time_limit_s, seed=seed,
                comm_limit=comm_limit, workers=workers, reorder=reorder, progress=progress)
    opts = SolverOptions(strategy="canzona-greedy" if solver == "greedy" else "canzona",
                         solver=solver, alpha=alpha,
                         time_limit_s=time_limit_s if solver == "cpsat" else None,
                         seed=seed, workers=workers, reorder=sol.problem is not problem)
    return build_plan(sol.problem, sol.cuts, solver=opts, model_source=model_source,
                      certified_bound=sol.bound, status=sol.status)


