"""A problem whose matrices DP pairs share, and its cuts: each shared task's item cut into its two
pieces (:func:`with_pairs`), pieces moved apart where a cut can move (:func:`pieces_apart`),
pairs moved into one node (:func:`pairs_in_nodes`), and each DP index's load with the waits
between partners as the runtime meets them (:func:`pair_waits`, :func:`pair_timeline`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..hardware import HardwareProfile
from ..planning import (Cuts, DPProblem, Item, PairShare, evaluate, owner_of, pair_items,
                        pair_owners, pair_phases)
from ..tp.context import Run, lockstep_seconds
from .prices import pair_link, price_pair


def with_pairs(problem: DPProblem, pairs: Mapping[int, PairShare]) -> DPProblem:
    """``problem`` with ``pairs``: each task's item (a whole-parameter matrix; at tp > 1 its TP
    shard) becomes two atomic items, rows [0, row) and [row, m) of what it stores, each carrying
    one piece's load and FLOPs and its rows' share of the state. The DP solvers then place the
    pieces like any matrix; a plan keeps a pair only where the pieces land on adjacent DP
    indices (``pair_owners``)."""
    if not pairs:
        return dataclasses.replace(problem, pairs={})
    buckets = []
    total = problem.total
    for b in problem.buckets:
        items: list[Item] = []
        for it in b.items:
            x = pairs.get(it.tasks[0]) if len(it.tasks) == 1 else None
            if x is None:
                items.append(dataclasses.replace(it, slot=len(items)))
                continue
            shape = problem.tasks[it.tasks[0]].shape
            rows = (it.end - it.start) // shape[1]  # the stored rows: a TP shard's at tp > 1
            items.extend(pair_items(it, shape, x.row, x.loads, x.flops,
                                    x.state_bytes(it.state_bytes, rows), len(items)))
            total += sum(x.loads) - it.load
        buckets.append(dataclasses.replace(b, items=tuple(items)))
    return dataclasses.replace(problem, buckets=tuple(buckets), total=total, pairs=dict(pairs))


def pieces_apart(problem: DPProblem, cuts: Cuts, *, slack: float = 0.05) -> Cuts:
    """``share="all"``: tasks of ``problem.pairs`` whose two pieces the cuts left on one DP
    index, split between two where a cut can move: the cut after the owner moves to the row
    boundary (the next index takes the second piece and what followed it in the owner's range),
    or the cut before it (the previous index takes what preceded). A move is kept only if no
    pair already apart comes together and the busiest DP index stays within ``slack`` of where it
    was."""
    out = {k: tuple(c) for k, c in cuts.items()}
    ceiling = max(evaluate(problem, out).load) * (1 + slack)
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        for first, second in zip(b.items, b.items[1:]):
            if first.tasks != second.tasks or first.tasks[0] not in problem.pairs:
                continue
            c = out[key]
            d = owner_of(c, first.start)
            if owner_of(c, second.start) != d:
                continue
            apart = {i for i, (x, y) in pair_owners(problem, out).items() if x != y}
            for k in (d + 1, d):  # the cut after the owner, else the one before
                if not 0 < k < b.ranks:
                    continue
                moved = list(c)
                moved[k] = second.start
                if any(a > z for a, z in zip(moved, moved[1:])):
                    continue
                trial = {**out, key: tuple(moved)}
                now = pair_owners(problem, trial)
                if any(now[i][0] == now[i][1] for i in apart) or now[first.tasks[0]][0] == \
                        now[first.tasks[0]][1] or max(evaluate(problem, trial).load) > ceiling:
                    continue
                out = trial
                break
    return out


def pairs_in_nodes(base: DPProblem, pairs: dict[int, PairShare], cuts: dict,
                   hw: HardwareProfile) -> dict:
    """Cuts whose Muon pairs span two nodes less often: where the ranks of a bucket between a
    pair's two pieces hold nothing, one piece's rank range moves to an empty rank in the other
    piece's node (its whole range in that bucket, so nothing else changes owner but that
    index). A move is kept if the busiest DP index gets no heavier, nor the largest optimizer
    state, and the summed load falls (the pair exchanges over NVLink instead of the network;
    ``priced_for``'s pricing)."""
    if not base.settings.spec.gram_shared or not pairs:
        return cuts
    problem = with_pairs(base, pairs)  # NVLink-priced pieces; a pair on two nodes adds `extra`
    extra = {i: price_pair(base, i, x.split_poly, hw, hw.inter_node).loads[0] - x.loads[0]
             for i, x in pairs.items()}
    tp = base.sizes.tp
    # A trial moves one bucket's cuts: its loads and states are the totals with that bucket's
    # share swapped (integers, so exactly what evaluating the whole problem gives).
    alone = {(b.buffer, b.bucket): dataclasses.replace(problem, buckets=(b,))
             for b in problem.buckets}

    def part(key: tuple[int, int], c: tuple[int, ...]) -> tuple[list[int], list[int]]:
        ev = evaluate(alone[key], {key: c})
        return list(ev.load), list(ev.state_bytes)

    def score(c: dict, load: list[int], state: list[int]) -> tuple[float, float, int]:
        load = list(load)
        for i, (a, b) in pair_owners(problem, c).items():
            if a != b and pair_link(hw, (a, b), tp) is not hw.intra_node:
                load[a] += extra[i]
                load[b] += extra[i]
        return max(load), sum(load), max(state)

    def node(d: int) -> int:
        return d * tp // hw.gpus_per_node

    out = {k: tuple(c) for k, c in cuts.items()}
    ev = evaluate(problem, out)
    tot_load, tot_state = list(ev.load), list(ev.state_bytes)
    best = score(out, tot_load, tot_state)
    for bk in base.buckets:
        key = (bk.buffer, bk.bucket)
        items = next(b for b in problem.buckets if (b.buffer, b.bucket) == key).items
        for first, second in zip(items, items[1:]):
            if first.tasks != second.tasks or first.tasks[0] not in pairs:
                continue
            c = out[key]
            ra, rb = owner_of(c, first.start), owner_of(c, second.start)
            da, db = problem.dp_index(bk, ra), problem.dp_index(bk, rb)
            if rb <= ra + 1 or node(da) == node(db) or c[ra + 1] != c[rb]:
                continue  # adjacent, one node already, or ranks between them hold something
            trials = []
            for r in range(ra + 1, rb):  # rb's range to an empty rank r in a's node, or ra's
                moved = list(c)
                if node(problem.dp_index(bk, r)) == node(da):
                    moved[r + 1:rb + 1] = [c[rb + 1]] * (rb - r)
                    trials.append(moved)
                if node(problem.dp_index(bk, r)) == node(db):
                    moved = list(c)
                    moved[ra + 1:r + 1] = [c[ra]] * (r - ra)
                    trials.append(moved)
            old = part(key, out[key])
            for moved in trials:
                trial = {**out, key: tuple(moved)}
                new = part(key, trial[key])
                load = [t - o + n for t, o, n in zip(tot_load, old[0], new[0])]
                state = [t - o + n for t, o, n in zip(tot_state, old[1], new[1])]
                sc = score(trial, load, state)
                if sc[0] <= best[0] and sc[2] <= best[2] and sc[1] < best[1]:
                    out, best, tot_load, tot_state, old = trial, sc, load, state, new
    return out


def pair_waits(problem: DPProblem, cuts: dict) -> list[float]:
    """Per DP index of a plan with Muon pairs (``problem.pairs``, priced as the plan records
    them), its load counting the waits between partners as the runtime meets them (and the
    simulator models them): pairs run first, phase by phase, each pair's matrices in lockstep,
    and a pair starts when both partners are free — waits chain along the pairs of later
    phases. The rest of an index's load follows its pairs."""
    load = list(evaluate(problem, cuts).load)
    if not problem.settings.spec.gram_shared or not problem.pairs:
        return [float(x) for x in load]
    owners = {i: o for i, o in pair_owners(problem, cuts).items() if o[0] != o[1]}
    phases = pair_phases(owners)
    runs: dict[tuple[int, tuple[int, int]], list[Run]] = {}
    for i, o in owners.items():
        x = problem.pairs[i]
        runs.setdefault((phases[o], o), []).append(x.run_piece())
        for d, piece in zip(o, x.loads):
            load[d] -= piece  # counted below, with its waits
    free = pair_timeline(runs, problem.settings.ns_steps, problem.dp)
    return [x + f for x, f in zip(load, free)]


def pair_timeline(runs: dict[tuple[int, tuple[int, int]], list[Run]],
                  steps: int, ranks: int) -> list[float]:
    """When each of ``ranks`` is done with its DP pairs: ``runs`` maps (phase, (a, b)) to the
    pair's matrices' (compute, collectives, hidden) (:data:`Run`); pairs run in phase order,
    each in lockstep (:func:`lockstep_seconds`), and a pair starts when both partners are
    free."""
    free = [0.0] * ranks
    for (_, (a, b)), pieces in sorted(runs.items()):
        free[a] = free[b] = max(free[a], free[b]) + lockstep_seconds(pieces, steps)
    return free
