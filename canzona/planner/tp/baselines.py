"""TP rows on the same model and sizes (per GPU), which the strategy registry
(:mod:`canzona.planner.strategies`) lists: :func:`sc_row`, :func:`greedy_row` and
:func:`schedule_row` (canzona's).

Above the DP package (it runs the paper's DP greedy), so ``tp/__init__`` does not import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..dp.greedy import greedy
from ..planning import Cuts, DPProblem
from .context import TPContext, index_work, lb_gpu, pinned_at
from .schedule import TPSchedule, gpu_loads


@dataclass(frozen=True, slots=True)
class TPBaselineRow:
    name: str
    max_gpu_load: float
    mean_gpu_load: float
    max_over_mean: float
    gap_to_lb_gpu: float


class TPBaselineInputs:
    """What every TP row reads: the problem, the DP partition (``cuts``), canzona's row as a plan
    recorded it or its schedule (neither: no canzona row), the TP context and LB_gpu."""

    def __init__(self, problem: DPProblem, cuts: Cuts, *, recorded: TPBaselineRow | None = None,
                 schedule: TPSchedule | None = None, ctx: TPContext | None = None) -> None:
        self.problem, self.cuts, self.recorded, self.schedule = problem, cuts, recorded, schedule
        self.ctx = ctx or TPContext.build(problem)
        self.lb = lb_gpu(problem, ctx=self.ctx)

    def row(self, name: str, grid: list[list[float]]) -> TPBaselineRow:
        """The row of a per-GPU load grid."""
        flat = [x for r in grid for x in r]
        mx, mean = max(flat), sum(flat) / len(flat)
        return TPBaselineRow(name, mx, mean, mx / mean if mean else 1.0,
                             mx / self.lb - 1 if self.lb else 0.0)


def sc_row(x: TPBaselineInputs, name: str) -> TPBaselineRow:
    """Every TP rank all-gathers and computes every matrix of its DP index (Megatron's
    ``duplicated``), on the same DP partition."""
    p = x.problem
    base, owned, pinned = index_work(p, x.cuts, x.ctx)
    return x.row(name, [[base[d] + sum(p.loads[i] for i in owned[d]) + pin
                         for pin in pinned_at(pinned, d, p.sizes.tp)] for d in range(p.dp)])


def greedy_row(x: TPBaselineInputs, name: str) -> TPBaselineRow:
    """The paper's DP greedy (α = 1) and TP greedy."""
    return x.row(name, gpu_loads(x.problem, greedy(x.problem, alpha=1.0), ctx=x.ctx))


def schedule_row(x: TPBaselineInputs, name: str) -> TPBaselineRow | None:
    """canzona's: the row its plan recorded, else the schedule's per-GPU loads (None without
    either)."""
    if x.recorded is not None:
        return dataclasses.replace(x.recorded, name=name)
    if x.schedule is not None:
        return x.row(name, gpu_loads(x.problem, x.cuts, x.schedule))
    return None
