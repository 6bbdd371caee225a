"""The two pieces of a matrix two DP indices share, priced (``planning.PairShare``): a DP
pair's Muon matrix on the link between its owners (:func:`price_pair`, :func:`pair_link`,
:func:`priced_for`) and a TP pair's half per TP rank (:func:`price_tp_pair`).
A piece's load is its compute plus the exchanges its own Gram products do not hide, at the
profile's achieved rate, in the plan's cost units."""

from __future__ import annotations

import math

from ..hardware import HardwareProfile, LinkProfile
from ..planning import DPProblem, PairShare
from .pieces import profile_rate, shared_piece, tp_pair_piece


def pair_link(hw: HardwareProfile, owners: tuple[int, int], tp: int = 1) -> LinkProfile:
    """The link between two DP indices (their global ranks d·tp): NVLink within a node."""
    a, b = (d * tp // hw.gpus_per_node for d in owners)
    return hw.intra_node if a == b else hw.inter_node


def seconds_to_load(problem: DPProblem, task: int, seconds: float, rate: float) -> float:
    """A piece of ``task`` that takes ``seconds``, in the plan's cost units: seconds over the
    problem's seconds per load when its loads are seconds (``roofline``), else the FLOPs
    ``rate`` does in that time at the task's load per FLOP."""
    if problem.seconds_per_load is not None:
        return seconds / problem.seconds_per_load
    flops = problem.costs[task].flops
    return seconds * rate * (problem.loads[task] / flops if flops else 0.0)


def flops_to_load(problem: DPProblem, task: int, flops: float, rate: float) -> float:
    """``flops`` of ``task``'s kind of work in the plan's cost units (at ``rate`` when the loads
    are seconds)."""
    if problem.seconds_per_load is not None:
        return flops / rate / problem.seconds_per_load
    total = problem.costs[task].flops
    return flops * (problem.loads[task] / total if total else 0.0)


def price_pair(problem: DPProblem, task: int, split: bool, hw: HardwareProfile,
               link: LinkProfile) -> PairShare:
    """A Muon task shared by two DP indices over ``link``: each piece's FLOPs and its load, its
    compute plus its exchanges at the profile's rate, in the plan's cost units."""
    t = problem.tasks[task]
    rows, cols = t.shape
    rate = profile_rate(hw)
    o = shared_piece("dp", 2, split, max(rows, cols), min(rows, cols),
                     problem.settings.ns_steps, 2, link, rate=rate, exchange=rows < cols)
    compute = o.compute_s(rate)
    load = math.ceil(seconds_to_load(problem, task, o.alone_s(rate), rate))
    return PairShare(-(-rows // 2), split, (load, load), (o.piece_flops, o.piece_flops), compute,
                     o.comm_s, hidden_s=o.hidden_s)


def priced_for(problem: DPProblem, pairs: dict[int, PairShare],
               owners: dict[int, tuple[int, int]], hw: HardwareProfile) -> dict[int, PairShare]:
    """``pairs`` with each Muon pair's exchanges priced on the link between its owners (the
    decision assumed NVLink; a pair the cuts put on two nodes exchanges over the network)."""
    if not problem.settings.spec.gram_shared:
        return pairs
    return {i: x if pair_link(hw, owners[i], problem.sizes.tp) is hw.intra_node
            else price_pair(problem, i, x.split_poly, hw, hw.inter_node)
            for i, x in pairs.items()}


def price_tp_pair(problem: DPProblem, task: int, split: bool, hw: HardwareProfile) -> PairShare:
    """A tall column-parallel Muon task shared by its TP group and the same TP ranks at a
    partner DP index (:func:`tp_pair_piece`, the partner over ``hw.link(2·tp)``): every TP shard
    cut at the same row, half of its rows (``row``, a row of the shard) on each DP index; per
    piece the load one TP rank carries (its compute and the collectives its own Gram products
    do not hide, at the profile's rate, in cost units) and its FLOPs per rank."""
    t = problem.tasks[task]
    tp = problem.sizes.tp
    rows, cols = t.shape
    rate = profile_rate(hw)
    o = tp_pair_piece(tp, split, rows, cols, problem.settings.ns_steps, 2, hw.link(tp),
                      hw.link(2 * tp), rate=rate)
    load = math.ceil(seconds_to_load(problem, task, o.alone_s(rate), rate))
    return PairShare(-(-rows // tp) // 2, split, (load, load), (o.piece_flops, o.piece_flops),
                     o.compute_s(rate), o.comm_s, hidden_s=o.hidden_s)
