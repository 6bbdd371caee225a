"""The layout of a pair search's placement (:func:`lay_out`): each bucket's parameters sorted by
DP index with ``dp.reorder`` (a shared matrix last among its first partner's, so its second
piece opens the second partner's range), and the AdamW elements where the bucket collectives
take least time under the optimizer state's target (:func:`_cheaper_cuts`). A trainer whose
buffers keep Megatron's order cannot use it (``DPOptions.reorder`` off skips the pair
searches)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .. import comm
from ..dp.reorder import reorder_problem, state_heavy
from ..solve import state_target
from ..dp.units import spread_cuts
from ..hardware import HardwareProfile
from ..planning import (BucketProblem, Cuts, DPProblem, PairShare, evaluate, owner_of,
                        pair_owners)
from .pairs import with_pairs
from .search import Search


def lay_out(problem: DPProblem, pairs: Mapping[int, PairShare], search: Search,
            hw: HardwareProfile) -> tuple[DPProblem, Cuts] | None:
    """A search's placement laid out: each bucket's parameters by DP index, a shared one last
    among its first partner's (its second piece then opens the second partner's range); None
    where it shares nothing."""
    rank = {(b.buffer, b.bucket): [0] * len(b.items) for b in problem.buckets}
    last: dict[tuple[int, int], set[int]] = {}
    used: dict[int, PairShare] = {}
    for i, (key, k) in enumerate(search.ref):
        kind, at = search.where[i]
        rank[key][k] = at if kind == "w" else 2 * at
        if kind == "s":
            last.setdefault(key, set()).add(k)
            used[search.task[i]] = pairs[search.task[i]]
    if not used and not problem.rounds:
        return None
    rp, owners = reorder_problem(problem, rank, last=last)
    paired = with_pairs(rp, used)
    expanded: dict[tuple[int, int], list[int]] = {}
    for b, pb in zip(rp.buckets, paired.buckets):
        key = (b.buffer, b.bucket)
        ranks = iter(owners[key])
        out: list[int] = []
        for it in b.items:
            if not it.atomic:
                continue
            d = next(ranks)
            out += [d, d + 1] if len(it.tasks) == 1 and it.tasks[0] in used else [d]
        expanded[key] = out
    # the optimizer state's target of the plan without pairs (``solve.state_target``: its
    # largest whole matrix, not a piece, or 1.1 × the mean)
    cuts = _cheaper_cuts(paired, expanded, hw, state_target(problem))
    got = pair_owners(paired, cuts)
    for i, (kind, at) in enumerate(search.where):
        if kind == "s" and got[search.task[i]] != (2 * at, 2 * at + 1):
            raise RuntimeError(f"planner bug: task {search.task[i]}'s pieces are on DP indices "
                               f"{got[search.task[i]]}, not its partners {(2 * at, 2 * at + 1)}")
    if problem.rounds:
        _check_rounds(paired, cuts)
    return paired, cuts


def _check_rounds(problem: DPProblem, cuts: Cuts) -> None:
    """Every round of TP sub-groups on one DP index (the search moves them together)."""
    where: dict[int, int] = {}
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        for it in b.items:
            if it.atomic and len(it.tasks) == 1 and it.tasks[0] in problem.rounds:
                where[it.tasks[0]] = problem.dp_index(b, owner_of(c, it.start))
    for r in set(problem.rounds.values()):
        ds = {where[i] for i in r.tasks}
        if len(ds) != 1:
            raise RuntimeError(f"planner bug: the round of tasks {list(r.tasks)} lies on DP "
                               f"indices {sorted(ds)}, not one")


def _compact_cuts(b: BucketProblem, owners: list[int]) -> tuple[int, ...]:
    """Cut points of bucket ``b`` given its matrices' ranks, the AdamW elements after a matrix
    on its rank (those before the first matrix on the first one's): the fewest non-empty
    slices, so the fewest per-root calls."""
    atomic = [it for it in b.items if it.atomic]
    cuts = [b.start]
    for r in range(1, b.ranks):
        if r <= owners[0]:
            cuts.append(b.start)
        else:
            cuts.append(next((it.start for it, d in zip(atomic, owners) if d >= r), b.end))
    return tuple(cuts) + (b.end,)


def _spread_over(b: BucketProblem, owners: list[int], width: int) -> tuple[int, ...]:
    """:func:`~canzona.planner.dp.units.spread_cuts` with the AdamW elements between two
    matrices (or a bucket end) shared by at most ``width`` ranks, the first of the range."""
    atomic = [it for it in b.items if it.atomic]
    cuts = [b.start] + [0] * (b.ranks - 1) + [b.end]
    prev_end, prev = b.start, 0
    for k in range(len(atomic) + 1):
        lo, hi = prev_end, atomic[k].start if k < len(atomic) else b.end
        nxt = owners[k] if k < len(atomic) else b.ranks - 1
        share = min(nxt - prev + 1, width)
        for r in range(prev + 1, nxt + 1):
            cuts[r] = lo + (hi - lo) * (r - prev) // share if r - prev < share else hi
        if k < len(atomic):
            prev_end, prev = atomic[k].end, nxt
    return tuple(cuts)


def _cheaper_cuts(problem: DPProblem, owners: dict[tuple[int, int], list[int]],
                  hw: HardwareProfile, cap: float) -> Cuts:
    """Per bucket, where its AdamW elements go given its matrices' owners, whichever the
    bucket's collectives take least time with (``comm.choose`` on the plan's DP link): spread
    over the ranks between their neighbours (as ZeRO-1 shares them: ``dp.units.spread_cuts``)
    or kept with a neighbouring matrix (fewest non-empty slices, so fewest per-root calls). A
    bucket holding a state-heavy AdamW tensor (an embedding) shares it among the first w ranks
    its neighbours leave (w a power of two, or all of them), the w whose collectives are
    shortest among those keeping every index's optimizer state under max(``cap``, what
    spreading it over all gives); such buckets in bucket order. The matrices' owners are the
    same either way. The choice is by the collectives alone: AdamW's compute is tiny beside
    the matrices' (the search does not count it either)."""
    _, link = comm.plan_link(hw, problem.sizes.dp, problem.sizes.tp)
    heavy = {(b.buffer, b.bucket) for b in state_heavy(problem)}

    def seconds(b: BucketProblem, c: tuple[int, ...]) -> float:
        buf = problem.layout.buffers[b.buffer]
        return comm.choose([y - x for x, y in zip(c, c[1:])],
                           grad_bytes=comm.ELEMENT_BYTES[buf.grad_dtype],
                           param_bytes=comm.ELEMENT_BYTES[buf.dtype], link=link).seconds

    out: Cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        spread = spread_cuts(b, owners[key])
        if not owners[key] or key in heavy:
            out[key] = spread  # heavy ones are narrowed below, given the others' state
            continue
        compact = _compact_cuts(b, owners[key])
        out[key] = compact if seconds(b, compact) < seconds(b, spread) else spread
    if not heavy:
        return out
    state = list(evaluate(problem, out).state_bytes)
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        if key not in heavy:
            continue
        alone = dataclasses.replace(problem, buckets=(b,))
        mine = evaluate(alone, {key: out[key]}).state_bytes
        rest = [x - y for x, y in zip(state, mine)]
        ceiling = max(cap, max(x + y for x, y in zip(rest, mine)))
        best = (seconds(b, out[key]), out[key], mine)
        width = 1
        while width < b.ranks:
            c = _spread_over(b, owners[key], width) if owners[key] else \
                tuple(min(b.start + (b.end - b.start) * r // width, b.end)
                      for r in range(b.ranks)) + (b.end,)
            got = evaluate(alone, {key: c}).state_bytes
            if max(x + y for x, y in zip(rest, got)) <= ceiling and seconds(b, c) < best[0]:
                best = (seconds(b, c), c, got)
            width *= 2
        out[key] = best[1]
        state = [x + y for x, y in zip(rest, best[2])]
    return out
