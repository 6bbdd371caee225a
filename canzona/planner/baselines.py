"""Baselines in the same framework, so reports compare like with like (DESIGN.md).

* ``zero1`` — Megatron's equal chunks; split matrices are charged by fragments (what each rank
  would compute if it ran the optimizer on its piece — not the exact optimizer).
* ``asc`` — equal chunks, each matrix computed whole by the rank holding its start index.
* ``layerwise`` — Megatron's layer-wise optimizer: whole parameters dealt to DP ranks, ignoring
  the bucket geometry, so gradients must be all-reduced (ping-pong dealing by numel, legacy).
* ``layerwise-lpt`` — the same with Megatron's newer LPT on max(m,n)·min(m,n)².
* ``canzona-greedy`` — the paper's α-balanced greedy; ``canzona`` — the chosen solver's plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .dp.bounds import pigeonhole_bound
from .dp.greedy import greedy
from .plan import Plan
from .planning import DPProblem, equal_cuts, evaluate


@dataclass(frozen=True, slots=True)
class BaselineRow:
    name: str
    max_load: int
    mean_load: float
    max_over_mean: float
    gap_to_bound: float  # max load / certified bound - 1
    split_matrices: int
    grad_sync: str  # "reduce-scatter" or "all-reduce"


def _row(name: str, load: list[int] | tuple[int, ...], bound: int, split: int, sync: str) -> BaselineRow:
    mean = sum(load) / len(load)
    mx = max(load)
    return BaselineRow(name, mx, mean, mx / mean if mean else 1.0,
                       mx / bound - 1 if bound else 0.0, split, sync)


def _layerwise(problem: DPProblem, lpt: bool) -> list[int]:
    items = [it for b in problem.buckets for it in b.items]
    load = [0] * problem.dp
    if lpt:
        def key(it):  # Megatron's compute-balanced cost for matrices, numel otherwise
            task = problem.tasks[it.tasks[0]]
            if len(task.shape) == 2:
                m, n = sorted(task.shape)
                return n * m * m
            return it.end - it.start
        heap = [(0, d) for d in range(problem.dp)]
        cost = [0] * problem.dp
        for it in sorted(items, key=lambda it: (-key(it), it.start)):
            c, d = heapq.heappop(heap)
            load[d] += it.load
            cost[d] = c + key(it)
            heapq.heappush(heap, (cost[d], d))
        return load
    # Ping-pong: sorted by numel, dealt 0..R-1 then R-1..0.
    R = problem.dp
    for k, it in enumerate(sorted(items, key=lambda it: (-(it.end - it.start), it.start))):
        lap, pos = divmod(k, R)
        load[pos if lap % 2 == 0 else R - 1 - pos] += it.load
    return load


def baselines(problem: DPProblem, plan: Plan | None = None) -> list[BaselineRow]:
    """Every baseline's max/mean and gap to the certified bound (and ``plan`` as ``canzona``)."""
    bound = max(pigeonhole_bound(problem), plan.metrics.certified_bound if plan else 0)
    eq = {(b.buffer, b.bucket): equal_cuts(b) for b in problem.buckets}
    rows = []
    ev = evaluate(problem, eq, split_mode="fragments")
    rows.append(_row("zero1", ev.load, bound, ev.split_matrices, "reduce-scatter"))
    ev = evaluate(problem, eq, split_mode="owner")
    rows.append(_row("asc", ev.load, bound, 0, "reduce-scatter"))
    rows.append(_row("layerwise", _layerwise(problem, lpt=False), bound, 0, "all-reduce"))
    rows.append(_row("layerwise-lpt", _layerwise(problem, lpt=True), bound, 0, "all-reduce"))
    ev = evaluate(problem, greedy(problem, alpha=1.0))
    rows.append(_row("canzona-greedy", ev.load, bound, ev.split_matrices, "reduce-scatter"))
    if plan is not None:
        rows.append(_row("canzona", plan.metrics.dp_load, bound, plan.metrics.split_matrices,
                         "reduce-scatter"))
    return rows
