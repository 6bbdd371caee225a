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
range of ranks free (so cuts can spread them, as ZeRO-1 does), rebuild the offsets with Megatron's alignment rules,
and hand the reordered problem back to the usual cut optimisation.
"""

from __future__ import annotations

import dataclasses
import math

from .layout import PARAM_ALIGN, Bucket, Buffer, PhysicalLayout, Slot
from .planning import BucketProblem, DPProblem


def _pad(x: int, d: int) -> int:
    return -(-x // d) * d


def assign_free(problem: DPProblem) -> dict[tuple[int, int], list[int]]:
    """Rank (in the bucket's group) of every item when order does not matter: LPT on loads,
    then a move/swap search on the busiest index. Returns per bucket the rank of each item."""
    dp = problem.dp
    load = [0] * dp
    items = []  # (load, bucket key, item index)
    for b in problem.buckets:
        for k, it in enumerate(b.items):
            items.append((it.load, (b.buffer, b.bucket), k))
    by_key = {(b.buffer, b.bucket): b for b in problem.buckets}
    rank: dict[tuple[int, int], list[int]] = {k: [0] * len(b.items) for k, b in by_key.items()}
    # LPT: heaviest item first, onto the least-loaded DP index allowed for its bucket.
    for w, key, k in sorted(items, key=lambda x: (-x[0], x[1], x[2])):
        b = by_key[key]
        r = min(range(b.ranks), key=lambda r: (load[problem.dp_index(b, r)], r))
        rank[key][k] = r
        load[problem.dp_index(b, r)] += w
    # Local search: move or swap an item of the busiest index.
    held: dict[int, set] = {d: set() for d in range(dp)}
    for key, rs in rank.items():
        for k, r in enumerate(rs):
            held[problem.dp_index(by_key[key], r)].add((key, k))

    def rank_of(b: BucketProblem, d: int) -> int | None:
        buf = problem.layout.buffers[b.buffer]
        if not buf.expert:
            return d
        ep = problem.sizes.ep
        return (d - buf.ep_rank) // ep if d % ep == buf.ep_rank else None

    for _ in range(20_000):
        top = max(range(dp), key=lambda d: (load[d], -d))
        L = load[top]
        best = None
        for key, k in sorted(held[top]):
            b = by_key[key]
            w = b.items[k].load
            for r in range(b.ranks):
                d2 = problem.dp_index(b, r)
                if d2 == top:
                    continue
                if load[d2] + w < L and (best is None or load[d2] + w < best[0]):
                    best = (load[d2] + w, key, k, r, d2, None)
                for key2, k2 in held[d2]:
                    w2 = by_key[key2].items[k2].load
                    if w2 >= w:
                        continue
                    r_top = rank_of(by_key[key2], top)
                    if r_top is None:
                        continue
                    worst = max(L - w + w2, load[d2] - w2 + w)
                    if worst < L and (best is None or worst < best[0]):
                        best = (worst, key, k, r, d2, (key2, k2, r_top))
        if best is None:
            break
        _, key, k, r, d2, swap = best
        w = by_key[key].items[k].load
        rank[key][k] = r
        held[top].discard((key, k))
        held[d2].add((key, k))
        load[top] -= w
        load[d2] += w
        if swap is not None:
            key2, k2, r_top = swap
            w2 = by_key[key2].items[k2].load
            rank[key2][k2] = r_top
            held[d2].discard((key2, k2))
            held[top].add((key2, k2))
            load[d2] -= w2
            load[top] += w2
    return rank


def reorder_problem(problem: DPProblem, rank: dict[tuple[int, int], list[int]]
                    ) -> tuple[DPProblem, dict[tuple[int, int], list[int]]]:
    """The problem with every bucket's parameters sorted by rank (stable), offsets rebuilt with
    Megatron's rules (64-element starts, bucket ends padded to lcm(group size, 128)); and per
    bucket the ranks of its matrices in the new order."""
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
            atomic = sorted((k for k, it in enumerate(bp.items) if it.atomic),
                            key=lambda k: (ranks[k], k))
            divisible = [k for k, it in enumerate(bp.items) if not it.atomic]
            own = [ranks[k] for k in atomic]
            # AdamW parameters go where the matrices' ranks leave the widest free range, so the
            # cuts can spread them (and their optimizer state) over many ranks.
            edges = [0, *own, bp.ranks - 1]
            gap = max(range(len(own) + 1), key=lambda g: (edges[g + 1] - edges[g], -g))
            order = atomic[:gap] + divisible + atomic[gap:]
            owners[(bi, bk.index)] = own
            pos = start
            slots, items = [], []
            for k in order:
                s, it = bk.slots[k], bp.items[k]
                pos = _pad(pos, PARAM_ALIGN)
                n = s.end - s.start
                slots.append(Slot(s.name, pos, pos + n, s.local_shape, s.optimizer))
                items.append(dataclasses.replace(it, slot=len(items), start=pos, end=pos + n))
                pos += n
            end = _pad(pos, divisor)
            buckets.append(Bucket(bk.index, start, end, pos - start, tuple(slots)))
            new_buckets.append(BucketProblem(bi, bk.index, start, end, bp.ranks, tuple(items)))
            start = end
        new_buffers.append(dataclasses.replace(buf, buckets=tuple(buckets)))
    layout = PhysicalLayout(problem.layout.model, problem.layout.sizes, problem.layout.bucket_size,
                            tuple(new_buffers))
    return dataclasses.replace(problem, layout=layout, buckets=tuple(new_buckets)), owners


__all__ = ["assign_free", "reorder_problem"]
