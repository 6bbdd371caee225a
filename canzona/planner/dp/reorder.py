"""The ``reorder`` option: parameters may change places inside their bucket.

A bucket is reduce-scattered and all-gathered as one unit, so the order of the parameters inside
it does not change when its communication can start; it only changes which parameters can share a
rank. With reordering, any subset of a bucket's matrices can go to any rank, and the partition
becomes bin packing under bucket membership. The new order is recorded in the plan (the slots of
each bucket, with their new offsets); canzona's runtime lays its buffers out from the plan, so it
costs nothing there, but a trainer whose gradient buffers follow Megatron's own order cannot use
such a plan.

Steps: assign whole parameters to DP indices (LPT, then move/swap local search), sort each
bucket's matrices by their rank and put its AdamW parameters where the matrices leave the widest
range of ranks free (so cuts can spread them, as ZeRO-1 does), rebuild the offsets with
Megatron's alignment rules, and hand the reordered problem back to the usual cut optimisation.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

from ..alike import Kept
from ..layout import PARAM_ALIGN, Bucket, PhysicalLayout, Slot
from ..planning import BucketProblem, DPProblem, Item


def _pad(x: int, d: int) -> int:
    return -(-x // d) * d


def assign_free(problem: DPProblem, *, max_moves: int = 20_000,
                spread_heavy: bool = False) -> dict[tuple[int, int], list[int]]:
    """Rank (in the bucket's group) of every item when order does not matter: LPT on loads,
    then a move/swap search on the busiest index. Returns per bucket the rank of each item.
    ``spread_heavy``: the matrices of buckets holding a state-heavy AdamW tensor go to the DP
    indices at the ends, so that tensor can be shared by the ranks between (equal-load items
    change places; no index's load changes).

    Items of equal load that may go to the same DP indices (dense, or experts of one EP rank)
    are interchangeable, so the search works on per-index counts of such *classes*: a move or
    swap costs O(classes), not O(items), which keeps 24k-parameter MoE models fast.

    The last few results are kept by what they read (candidates that differ in what they share
    have the same buckets); each caller gets its own lists.
    """
    facts = (problem.buckets, problem.layout, problem.sizes)
    key = (problem.dp, max_moves, spread_heavy)
    got = _KEPT.get(facts, key)
    if got is None:
        got = _KEPT.put(facts, key, _assign_free(problem, max_moves, spread_heavy))
    return {k: list(v) for k, v in got.items()}  # type: ignore[union-attr]


#: :func:`assign_free`'s ranks by the buckets, layout and sizes they read.
_KEPT = Kept(8)


def _assign_free(problem: DPProblem, max_moves: int, spread_heavy: bool
                 ) -> dict[tuple[int, int], list[int]]:
    dp = problem.dp
    ep = problem.sizes.ep
    buffers = problem.layout.buffers

    def ep_class(b: BucketProblem) -> int:
        buf = buffers[b.buffer]
        return -1 if not buf.expert else buf.ep_rank  # type: ignore[return-value]

    def allowed(cls_ep: int, d: int) -> bool:
        return cls_ep < 0 or d % ep == cls_ep

    heavy = state_heavy(problem) if spread_heavy else []
    # A state-heavy AdamW tensor is cut evenly over its bucket's ranks (spread_cuts shares it
    # so when its bucket's matrices sit at the ends): its load is every such index's base,
    # not an item one index takes whole (with its optimizer state).
    fluid = {(b.buffer, b.bucket, k) for b in heavy for k, it in enumerate(b.items)
             if not it.atomic}
    load = [0] * dp
    for b in heavy:
        for k, it in enumerate(b.items):
            if (b.buffer, b.bucket, k) in fluid:
                for r in range(b.ranks):
                    load[problem.dp_index(b, r)] += it.load // b.ranks
    # Classes: (load, ep class) → the items of that class, in a fixed order.
    members: dict[tuple[int, int], list[tuple[tuple[int, int], int]]] = {}
    for b in problem.buckets:
        for k, it in enumerate(b.items):
            if (b.buffer, b.bucket, k) not in fluid:
                members.setdefault((it.load, ep_class(b)), []).append(((b.buffer, b.bucket), k))
    classes = sorted(members, key=lambda c: (-c[0], c[1]))
    count = [[0] * len(classes) for _ in range(dp)]  # count[d][c]
    # LPT: heaviest class first; each item onto the least-loaded allowed DP index.
    for ci, (w, cls_ep) in enumerate(classes):
        cands = [d for d in range(dp) if allowed(cls_ep, d)]
        heap = [(load[d], d) for d in cands]
        heapq.heapify(heap)
        for _ in members[(w, cls_ep)]:
            ld, d = heapq.heappop(heap)
            count[d][ci] += 1
            load[d] = ld + w
            heapq.heappush(heap, (load[d], d))
    # Local search on the busiest index: move one item, or swap it for a lighter one.
    weights = [w for w, _ in classes]
    eps = [e for _, e in classes]
    for _ in range(max_moves):
        top = max(range(dp), key=lambda d: (load[d], -d))
        L = load[top]
        best = None
        for c1, n1 in enumerate(count[top]):
            if not n1:
                continue
            w1 = weights[c1]
            for d2 in range(dp):
                if d2 == top or not allowed(eps[c1], d2):
                    continue
                if load[d2] + w1 < L and (best is None or load[d2] + w1 < best[0]):
                    best = (load[d2] + w1, c1, d2, None)
                for c2, n2 in enumerate(count[d2]):
                    if not n2 or weights[c2] >= w1 or not allowed(eps[c2], top):
                        continue
                    worst = max(L - w1 + weights[c2], load[d2] - weights[c2] + w1)
                    if worst < L and (best is None or worst < best[0]):
                        best = (worst, c1, d2, c2)
        if best is None:
            break
        _, c1, d2, c2 = best
        count[top][c1] -= 1
        count[d2][c1] += 1
        load[top] -= weights[c1]
        load[d2] += weights[c1]
        if c2 is not None:
            count[d2][c2] -= 1
            count[top][c2] += 1
            load[d2] -= weights[c2]
            load[top] += weights[c2]
    # Materialise: hand each class's items to DP indices by their counts, in a fixed order —
    # first the matrices of buckets that hold a state-heavy AdamW tensor, onto the DP indices at
    # the ends (0, R-1, 1, R-2, …), so they leave the widest range of ranks to share it.
    by_key = {(b.buffer, b.bucket): b for b in problem.buckets}
    rank: dict[tuple[int, int], list[int]] = {k: [0] * len(b.items) for k, b in by_key.items()}
    class_of = {(w, e): ci for ci, (w, e) in enumerate(classes)}
    left = [row[:] for row in count]
    done: set[tuple[tuple[int, int], int]] = set()
    ends = [d for pair in zip(range(dp), range(dp - 1, -1, -1)) for d in pair][:dp]
    for b in heavy:
        key = (b.buffer, b.bucket)
        for k, it in enumerate(b.items):
            if not it.atomic:
                continue
            ci = class_of[(it.load, ep_class(b))]
            d = next(d for d in ends if left[d][ci])
            left[d][ci] -= 1
            rank[key][k] = d
            done.add((key, k))
    for ci, cls in enumerate(classes):
        items = (m for m in members[cls] if m not in done)
        for d in range(dp):
            for _ in range(left[d][ci]):
                key, k = next(items)
                buf = buffers[key[0]]
                rank[key][k] = d if not buf.expert else (d - buf.ep_rank) // ep
    return rank


#: A divisible item is state-heavy above this share of the mean state per DP index.
HEAVY_STATE = 1 / 16


def state_heavy(problem: DPProblem) -> list[BucketProblem]:
    """Dense buckets holding an AdamW tensor with more than HEAVY_STATE of the mean optimizer
    state per DP index (a tied embedding, an output layer), heaviest first."""
    total = sum(it.state_bytes for b in problem.buckets for it in b.items)
    grain = HEAVY_STATE * total / problem.dp

    def heavy(b: BucketProblem) -> int:
        return max((it.state_bytes for it in b.items if not it.atomic), default=0)

    out = [b for b in problem.buckets
           if not problem.layout.buffers[b.buffer].expert and heavy(b) > grain]
    return sorted(out, key=lambda b: (-heavy(b), b.buffer, b.bucket))


def reorder_problem(problem: DPProblem, rank: dict[tuple[int, int], list[int]], *,
                    last: dict[tuple[int, int], set[int]] | None = None
                    ) -> tuple[DPProblem, dict[tuple[int, int], list[int]]]:
    """The problem with every bucket's parameters sorted by rank (stable; the items of
    ``last[bucket]`` after the others of their rank), offsets rebuilt with Megatron's rules
    (64-element starts, bucket ends padded to lcm(group size, 128)); and per bucket the ranks
    of its matrices in the new order."""
    owners: dict[tuple[int, int], list[int]] = {}
    new_buffers = []
    new_buckets: list[BucketProblem] = []
    by_key = {(b.buffer, b.bucket): b for b in problem.buckets}
    for bi, buf in enumerate(problem.layout.buffers):
        divisor = math.lcm(buf.dp_size, 128)
        start = 0
        buckets = []
        for bk in buf.buckets:
            bp = by_key[(bi, bk.index)]
            ranks = rank[(bi, bk.index)]
            after = (last or {}).get((bi, bk.index), set())
            atomic = sorted((k for k, it in enumerate(bp.items) if it.atomic),
                            key=lambda k: (ranks[k], k in after, k))
            divisible = [k for k, it in enumerate(bp.items) if not it.atomic]
            own = [ranks[k] for k in atomic]
            # AdamW parameters go where the matrices' ranks leave the widest free range, so the
            # cuts can spread them (and their optimizer state) over many ranks (an item of
            # ``after``, a DP pair's shared matrix, reaches the next rank with its second piece).
            lefts = [0, *(d + (k in after) for k, d in zip(atomic, own))]
            rights = [*own, bp.ranks - 1]
            gap = max(range(len(own) + 1), key=lambda g: (rights[g] - lefts[g], -g))
            order = atomic[:gap] + divisible + atomic[gap:]
            owners[(bi, bk.index)] = own
            pos = start
            starts = []
            for k in order:
                pos = _pad(pos, PARAM_ALIGN)
                starts.append(pos)
                pos += bk.slots[k].end - bk.slots[k].start
            end = _pad(pos, divisor)
            if start == bk.start == bp.start and end == bk.end == bp.end and \
                    pos - start == bk.numel_unpadded and order == list(range(len(order))) and \
                    all(x == s.start == it.start and s.end == it.end and it.slot == k
                        for k, (x, s, it) in enumerate(zip(starts, bk.slots, bp.items))):
                buckets.append(bk)  # nothing moves: the bucket as it is
                new_buckets.append(bp)
                start = end
                continue
            slots, items = [], []
            for k, x in zip(order, starts):
                s, it = bk.slots[k], bp.items[k]
                n = s.end - s.start
                slots.append(Slot(s.name, x, x + n, s.local_shape, s.optimizer))
                items.append(Item(len(items), x, x + n, it.load, it.flops,
                                  it.state_bytes, it.atomic, it.tasks))
            buckets.append(Bucket(bk.index, start, end, pos - start, tuple(slots)))
            new_buckets.append(BucketProblem(bi, bk.index, start, end, bp.ranks, tuple(items)))
            start = end
        new_buffers.append(dataclasses.replace(buf, buckets=tuple(buckets)))
    layout = PhysicalLayout(problem.layout.model, problem.layout.sizes, problem.layout.bucket_size,
                            tuple(new_buffers))
    return dataclasses.replace(problem, layout=layout, buckets=tuple(new_buckets)), owners


__all__ = ["assign_free", "reorder_problem", "state_heavy"]
