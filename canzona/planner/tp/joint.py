"""Joint DP × TP refinement: move whole matrices between DP indices to lower the busiest GPU."""

from __future__ import annotations

import heapq
import math

from .. import alike
from ..objective import MAX_LOAD, Objective
from ..planning import Cuts, DPProblem, owner_of
from .context import (Lockstep, Piece, TPContext, has_pinned, index_gpu_max, index_work,
                      lb_gpu, lockstep_piece, lpt_bins, lpt_makespan, shared_by_index)


def joint_refine(problem: DPProblem, cuts: Cuts, *, ctx: TPContext | None = None,
                 rounds: int = 6, tolerance: float = 0.005, max_evals: int = 400_000,
                 objective: Objective = MAX_LOAD) -> Cuts:
    """Re-place whole matrices among DP indices to lower the busiest GPU (the joint objective).

    Block coordinate descent over buckets, like the DP polish but on the per-GPU objective: a
    bucket's matrices are taken out, and its contiguous, rank-ordered split is re-chosen exactly
    (dynamic programming over (rank, matrices so far)) given every other bucket, where giving
    matrices j..i−1 to rank r costs the busiest GPU of r's DP index after LPT packing of its
    TP-split tasks (its AdamW share and replicated matrices included). Objectives: the squared
    overload of every GPU above LB_gpu·(1 + tolerance) (graded where the maximum is flat), then
    Σ v⁸, then max v. Stops
    when the worst index is within ``tolerance`` of LB_gpu, after ``rounds`` sweeps, or after
    ``max_evals`` candidate evaluations (deterministic: no wall clock).

    The cuts are then rebuilt: each is clamped into the gap its matrices allow, as close to the
    original cut as possible, so AdamW slices change little (``dp.polish.rebalance_divisible``
    may slide them further; it keeps every matrix owner). The result replaces the input only if
    the objective's per-GPU score (``Objective.gpu_score``: F on the busiest GPUs, plus g)
    is no worse.
    """
    ctx = ctx or TPContext.build(problem)
    tp = problem.sizes.tp
    loads = problem.loads
    if has_pinned(problem):  # loads pinned to one TP rank move with their item: not modelled
        return cuts
    base, owned, _ = index_work(problem, cuts, ctx)
    bag = [[loads[i] for i in ids] for ids in owned]
    shared = problem.shared
    # an index's shared pieces run in lockstep: kept apart from the rest of its base
    pieces: list[list[Piece]] = [[] for _ in range(problem.dp)]
    for d, ids in enumerate(shared_by_index(problem, cuts)):
        for i in ids:
            pieces[d].append(lockstep_piece(problem, i))
            base[d] -= shared[i][0]
    cap = problem.lockstep_cap
    lock = [_lockstep(x, cap) for x in pieces]
    bound = lb_gpu(problem, ctx=ctx)
    scale = float(bound or 1)

    atoms, rank = {}, {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        atoms[key] = [it for it in b.items if it.atomic]
        rank[key] = [owner_of(cuts[key], it.start) for it in atoms[key]]

    def split_of(it) -> tuple[list[int], float, list[Piece]]:
        """(loads to host, load on every TP rank, shared pieces): a shared task is its piece on
        every rank, in the index's lockstep phase."""
        return (sorted((loads[i] for i in it.tasks if ctx.split[i] and i not in shared),
                       reverse=True),  # heaviest first, as LPT inserts them
                float(sum(ctx.each_rank(i, loads[i]) for i in it.tasks
                          if i not in shared and not ctx.split[i])),
                [lockstep_piece(problem, i) for i in it.tasks if i in shared])

    def value(d: int) -> float:
        return base[d] + lock[d].load() + lpt_makespan(bag[d], tp)

    cache: dict[int, list[int]] = {}  # index → LPT bins of its bag (a heap), while unchanged

    def take(d: int, sp: list[int], rep: float, sh: list, sign: int) -> None:
        cache.pop(d, None)
        if sign > 0:
            bag[d].extend(sp)
            pieces[d].extend(sh)
        else:
            for y in sp:
                bag[d].remove(y)
            for y in sh:
                pieces[d].remove(y)
        if sh:
            lock[d] = _lockstep(pieces[d], cap)
        base[d] += sign * rep

    evals = 0  # work budget (deterministic, unlike a wall-clock limit)
    split: dict[tuple[int, int], list] = {}  # a bucket's matrices as split_of gives them
    seen: dict[tuple, list] = {}  # a DP index's state → its columns (:func:`_column`)
    order = sorted((b for b in problem.buckets if len(atoms[(b.buffer, b.bucket)]) > 0),
                   key=lambda b: (-b.load, b.buffer, b.bucket))
    target = 1 + tolerance
    for phase in ("excess", "p8", "max"):
        for _ in range(rounds):
            if max(value(d) for d in range(problem.dp)) <= bound * (1 + tolerance):
                break
            changed = False
            for b in order:
                if evals > max_evals:
                    break
                key = (b.buffer, b.bucket)
                its = split.get(key)
                if its is None:
                    its = split[key] = [split_of(it) for it in atoms[key]]
                m, R = len(its), b.ranks
                ds = [problem.dp_index(b, r) for r in range(R)]
                # A rank takes at most ``span`` matrices of the bucket (twice its share, or as
                # many as it has now): keeps the DP near-linear in the bucket's matrices.
                have = max((rank[key].count(r) for r in set(rank[key])), default=0)
                span = max(have, 2 * -(-m // R) + 1)
                for k, (sp, rep, sh) in enumerate(its):
                    take(ds[rank[key][k]], sp, rep, sh, -1)
                INF = float("inf")
                g = [0.0] + [INF] * m  # g[i]: best objective with matrices < i placed on ranks ≤ r
                choice = []
                for r in range(R):
                    d = ds[r]
                    if d not in cache:
                        cache[d] = lpt_bins(bag[d], tp)
                    b0 = cache[d]
                    # what matrices j..i-1 cost on d depends on d's state alone: alike states
                    # (another rank's, a later round's or phase's) reuse it
                    sig = (key, span, base[d], tuple(b0), tuple(lock[d].items))
                    cols = seen.get(sig) if alike.SHARED else None
                    if cols is None:
                        if len(seen) > 50_000:
                            seen.clear()
                        cols = seen[sig] = [None] * (m + 1)
                    else:
                        alike.reused("joint")
                    ng = [INF] * (m + 1)
                    ch = [0] * (m + 1)
                    for j in range(m + 1):
                        gj = g[j]
                        if gj == INF:
                            continue
                        col = cols[j]
                        if col is None:
                            col = cols[j] = _column(its, j, min(m, j + span), b0, lock[d],
                                                    base[d], scale, target, phase == "excess")
                        evals += len(col[0])
                        if phase == "max":
                            for i, v in enumerate(col[0], start=j):
                                tot = v if v > gj else gj  # (max(gj, v))
                                if tot < ng[i] - 1e-12:
                                    ng[i], ch[i] = tot, j
                            continue
                        if phase == "excess":  # the overload, 0 where the GPU is under target
                            terms = col[1]  # (phases run in order: a column of a later one
                            # never meets this one)
                        else:
                            terms = col[2]
                            if terms is None:
                                terms = col[2] = [v ** 8 for v in col[0]]
                        for i, x in enumerate(terms, start=j):
                            tot = gj + x
                            if tot < ng[i] - 1e-12:
                                ng[i], ch[i] = tot, j
                    g = ng
                    choice.append(ch)
                # Walk back the choices: matrices choice[r][i]..i-1 go to rank r.
                new = [0] * m
                i = m
                for r in range(R - 1, -1, -1):
                    j = choice[r][i]
                    for k in range(j, i):
                        new[k] = r
                    i = j
                if new != rank[key]:
                    changed = True
                rank[key] = new
                for k, (sp, rep, sh) in enumerate(its):
                    take(ds[new[k]], sp, rep, sh, +1)
            if not changed:
                break

    out: Cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        c = list(cuts[key])
        ats, rs = atoms[key], rank[key]
        new_c = [b.start]
        for r in range(1, b.ranks):
            # Cut r lies after every matrix of a rank < r and before every matrix of a rank ≥ r.
            lo = max((a.end for a, x in zip(ats, rs) if x < r), default=b.start)
            hi = min((a.start for a, x in zip(ats, rs) if x >= r), default=b.end)
            new_c.append(max(new_c[-1], min(max(c[r], lo), hi)))
        new_c.append(b.end)
        out[key] = tuple(new_c)
    # Never worse than the input on the per-GPU objective.
    before = objective.gpu_score(index_gpu_max(problem, cuts, ctx), problem, cuts)
    after = objective.gpu_score(index_gpu_max(problem, out, ctx), problem, out)
    return out if after <= before else cuts


def _column(its: list, j: int, last: int, b0: list[float], lock: Lockstep, base: float,
            scale: float, target: float, over_too: bool = True) -> list:
    """For i = j … last, what matrices j..i-1 of a bucket cost on a DP index whose LPT bins are
    ``b0`` (a heap), lockstep ``lock`` and base load ``base``: [their busiest GPU / ``scale``
    each, the squared overload of the GPUs above ``target`` each (0 where the busiest is not
    over it; None unless ``over_too``: the phase that reads it comes first), None (the busiest
    GPU's 8th powers, filled when first asked for)]. The matrices join the least-loaded bins
    (LPT insertion), their pieces the lockstep."""
    bins = list(b0)
    top = max(bins)  # bins only grow: the busiest is the larger of it and the bin just grown
    rep_sum = 0.0
    phases = lock.loads_with([its[i][2] for i in range(j, last)])  # as the pieces join
    vs, over = [], []
    for i in range(j, last + 1):
        if i > j:
            sp, rep, _ = its[i - 1]
            for x in sp:  # (heaviest first)
                grown = bins[0] + x
                heapq.heapreplace(bins, grown)
                if grown > top:
                    top = grown
            rep_sum += rep
        held = base + (rep_sum + phases[i - j])
        v = (held + top) / scale
        vs.append(v)
        # overload of every GPU above the target, squared: graded even when an index's maximum
        # sits on a plateau (none where even the busiest bin is under it)
        if not over_too:
            continue
        if v - target <= 0.0:
            over.append(0.0)
        else:
            over.append(sum([e ** 2 for x in bins if (e := (held + x) / scale - target) > 0.0]))
    return [vs, over if over_too else None, None]


def _lockstep(pieces: list[Piece], cap: int) -> Lockstep:
    out = Lockstep(cap)
    for x in pieces:
        out.add(x)
    return out



def lockstep_assign(problem: DPProblem, cuts: Cuts, *, ctx: TPContext | None = None,
                    max_moves: int = 20_000) -> dict[tuple[int, int], list[int]] | None:
    """Whole matrices re-placed among DP indices when parameters may change places inside their
    bucket (``DPOptions.reorder``): per bucket, the rank of each item (as ``dp.reorder``'s
    ``assign_free`` gives them), or None when no move lowers the busiest GPU. The search runs
    from the partition's cuts and from a fresh placement (:func:`_fresh_counts`); the lower end
    is kept.

    :func:`joint_refine` keeps every bucket's order, so it cannot bring two matrices of one
    bucket together past a third; with few matrices per DP index and tasks the TP group shares,
    which pieces share an index decides its lockstep phase (a compute-heavy piece hides the
    collectives of a light one; three light ones are collective-bound), and that needs any
    subset. A move/swap search on the busiest index, on the per-GPU objective of
    :func:`index_gpu_max` (its shared pieces in lockstep, the pieces it hosts LPT-packed over
    its TP ranks), the AdamW shares held where they are. Matrices alike (same loads, lockstep
    terms and allowed DP indices) form one class, so a step costs O(classes), not O(matrices).
    """
    ctx = ctx or TPContext.build(problem)
    tp = problem.sizes.tp
    loads, shared = problem.loads, problem.shared
    dp = problem.dp
    if has_pinned(problem):  # loads pinned to one TP rank move with their item: not modelled
        return None
    base, _, _ = index_work(problem, cuts, ctx)
    # classes of alike matrices: (hosted loads, load on every TP rank, shared pieces, allowed)
    classes: dict[tuple, int] = {}
    sig: list[tuple] = []
    members: list[list[tuple[tuple[int, int], int]]] = []
    where: dict[tuple[tuple[int, int], int], int] = {}
    first: list[int] = []  # per class, its lowest task id: where its pieces run in a batch
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        c = cuts[key]
        allowed = tuple(problem.dp_index(b, r) for r in range(b.ranks))
        for k, it in enumerate(b.items):
            if not it.atomic:
                continue
            d = problem.dp_index(b, owner_of(c, it.start))
            sp = tuple(sorted((loads[i] for i in it.tasks if ctx.split[i] and i not in shared),
                              reverse=True))
            rep = float(sum(ctx.each_rank(i, loads[i]) for i in it.tasks
                            if i not in shared and not ctx.split[i]))
            # a piece's task id only orders the lockstep's batches: alike matrices are one class
            sh = tuple(lockstep_piece(problem, i)[1:] for i in it.tasks if i in shared)
            base[d] -= rep + sum(x[2] for x in sh)  # index_work counted them: the item moves
            s = (sp, rep, sh, allowed)
            ci = classes.setdefault(s, len(sig))
            if ci == len(sig):
                sig.append(s)
                members.append([])
            if ci == len(first):
                first.append(min(it.tasks))
            members[ci].append((key, k))
            first[ci] = min(first[ci], *it.tasks)
            where[(key, k)] = d
    nc = len(sig)
    if not any(s[2] for s in sig):
        return None
    count = [[0] * nc for _ in range(dp)]
    for ci, ms in enumerate(members):
        for m in ms:
            count[where[m]][ci] += 1
    allowed_of = [set(s[3]) for s in sig]

    held: dict[tuple[int, ...], float] = {}  # an index's work from its class counts alone

    def value(d: int, row: list[int]) -> float:
        return base[d] + work(tuple(row))

    # an index's LPT bins and lightest hosted load by its class counts (tp > 1): one more
    # matrix no heavier than any it holds is one more LPT insertion into its bins
    packed: dict[tuple[int, ...], tuple[list[int], float]] = {}

    def work(key: tuple[int, ...], parent: tuple[int, ...] | None = None, ci: int = -1
             ) -> float:
        """An index's work from its class counts ``key``; ``parent``: the counts it has with
        one matrix of class ``ci`` fewer, where known."""
        got = held.get(key)
        if got is None:
            lock = Lockstep(problem.lockstep_cap)
            rep = 0.0
            for c, n in enumerate(key):
                if n:
                    _, r, sh, _ = sig[c]
                    rep += n * r
                    for y in sh:
                        for _ in range(n):
                            lock.add((first[c], *y))
            was = packed.get(parent) if parent is not None else None  # type: ignore[arg-type]
            sp = sig[ci][0] if was is not None else ()
            if was is not None and (not sp or sp[0] <= was[1]):  # (sp: heaviest first)
                bins = list(was[0])
                for x in sp:
                    heapq.heapreplace(bins, bins[0] + x)
                least = min(was[1], sp[-1]) if sp else was[1]
            else:
                bag = [x for c, n in enumerate(key) if n for x in sig[c][0] * n]
                if tp <= 1:
                    got = held[key] = rep + lock.load() + lpt_makespan(bag, tp)
                    return got
                bins = lpt_bins(bag, tp)
                least = min(bag, default=math.inf)
            packed[key] = (bins, least)
            got = held[key] = rep + lock.load() + max(bins)
        return got

    start = [row[:] for row in count]
    count, vals, moved = _search(count, value, sig, allowed_of, nc, dp, max_moves)
    # Also from a fresh placement (each matrix, heaviest on a GPU first, where the busiest GPU
    # of its index is then lightest): the search moves one or two matrices at a time, and where
    # a hosted matrix and pieces on every TP rank mix (Shampoo's QKV hosted beside blocks shard
    # by shard), it stops far from a packing the fresh one finds.
    fresh = _fresh_counts(sig, members, allowed_of, work, base, nc, dp)
    if fresh is not None:
        f_count, f_vals, _ = _search(fresh, value, sig, allowed_of, nc, dp, max_moves)
        if max(f_vals) < max(vals) * (1 - 1e-9):
            count, vals, moved = f_count, f_vals, True
    if count == start:
        moved = False
    if not moved:
        return None
    return _materialise(problem, cuts, count, members, where, nc)


def _fresh_counts(sig, members, allowed_of, work, base, nc: int, dp: int):  # noqa: ANN001
    """Per DP index, how many matrices of each class: placed one by one, the heaviest on a
    single GPU first (a hosted matrix's load, or a piece's on every TP rank), each on the allowed
    index whose value (``base`` plus the ``work`` of its class counts) is then lowest (ties: the
    lowest index). Indices holding alike counts cost alike work: it is looked up once per
    placement and state."""
    def weight(ci: int) -> float:
        sp, rep, sh, _ = sig[ci]
        return max([*sp, rep, *(y[2] for y in sh)], default=0.0)

    count = [[0] * nc for _ in range(dp)]
    state: dict[tuple[int, ...], int] = {(0,) * nc: 0}  # class counts → a small id
    rows = [(0,) * nc]
    at = [0] * dp  # each index's state id
    for ci in sorted(range(nc), key=lambda c: (-weight(c), c)):
        allowed = sorted(allowed_of[ci])
        for _ in members[ci]:
            best = None
            got: dict[int, float] = {}  # state id → its work with one more of class ci
            for d in allowed:
                w = got.get(at[d])
                if w is None:
                    row = list(rows[at[d]])
                    row[ci] += 1
                    w = got[at[d]] = work(tuple(row), rows[at[d]], ci)
                v = base[d] + w
                if best is None or v < best[0]:
                    best = (v, d)
            if best is None:
                return None
            d = best[1]
            count[d][ci] += 1
            key = tuple(count[d])
            at[d] = state.setdefault(key, len(rows))
            if at[d] == len(rows):
                rows.append(key)
    return count


def _search(count, value, sig, allowed_of, nc: int, dp: int, max_moves: int):  # noqa: ANN001
    """The move/swap search of :func:`lockstep_assign` on the busiest index, from ``count``:
    (counts, per-index values, whether anything moved)."""
    count = [row[:] for row in count]
    vals = [value(d, count[d]) for d in range(dp)]
    moved = False
    for _ in range(max_moves):
        top = max(range(dp), key=lambda d: (vals[d], -d))
        L = vals[top]
        best = None  # (worst of the two, top's new value, c1, d2, c2, new vals)
        for c1 in range(nc):
            if not count[top][c1]:
                continue
            row = count[top][:]
            row[c1] -= 1
            v_top = value(top, row)
            # (a lockstep phase may grow when a piece leaves, so swaps are tried regardless)
            for d2 in sig[c1][3]:
                if d2 == top:
                    continue
                row2 = count[d2][:]
                row2[c1] += 1
                if v_top < L:
                    v2 = value(d2, row2)
                    cand = (max(v_top, v2), v_top + v2)
                    if cand[0] < L and (best is None or cand < best[0]):
                        best = (cand, c1, d2, None, v_top, v2)
                for c2 in range(nc):
                    if not count[d2][c2] or c2 == c1 or top not in allowed_of[c2]:
                        continue
                    row_t = row[:]
                    row_t[c2] += 1
                    row_2 = row2[:]
                    row_2[c2] -= 1
                    a, b2 = value(top, row_t), value(d2, row_2)
                    cand = (max(a, b2), a + b2)
                    if cand[0] < L and (best is None or cand < best[0]):
                        best = (cand, c1, d2, c2, a, b2)
        if best is None:
            break
        _, c1, d2, c2, a, b2 = best
        count[top][c1] -= 1
        count[d2][c1] += 1
        if c2 is not None:
            count[d2][c2] -= 1
            count[top][c2] += 1
        vals[top], vals[d2] = a, b2
        moved = True
    return count, vals, moved


def _materialise(problem: DPProblem, cuts: Cuts, count, members, where, nc: int  # noqa: ANN001
                 ) -> dict[tuple[int, int], list[int]]:
    """Per bucket, the rank of each item for the per-index class counts ``count``."""
    dp = problem.dp
    # Materialise: an item stays on its index while the index keeps one of its class.
    left = [row[:] for row in count]
    rank: dict[tuple[int, int], list[int]] = {(b.buffer, b.bucket): [0] * len(b.items)
                                              for b in problem.buckets}
    spill: list[list[tuple[tuple[int, int], int]]] = [[] for _ in range(nc)]
    for ci, ms in enumerate(members):
        for m in ms:
            d = where[m]
            if left[d][ci]:
                left[d][ci] -= 1
                rank[m[0]][m[1]] = d
            else:
                spill[ci].append(m)
    for ci, ms in enumerate(spill):
        it = iter(ms)
        for d in range(dp):
            for _ in range(left[d][ci]):
                key, k = next(it)
                rank[key][k] = d
    # DP index → rank in the bucket's group; AdamW items keep the rank of their first element
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        buf = problem.layout.buffers[b.buffer]
        for k, it in enumerate(b.items):
            if it.atomic:
                if buf.expert:
                    rank[key][k] = (rank[key][k] - buf.ep_rank) // problem.sizes.ep
            else:
                rank[key][k] = owner_of(cuts[key], it.start)
    return rank
