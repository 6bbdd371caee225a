"""TP baselines on the same model and sizes: ``sc``, ``canzona-greedy`` and ``canzona``.

Above the DP package (it runs the paper's DP greedy), so ``tp/__init__`` does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dp.greedy import greedy
from ..planning import DPProblem
from .context import Cuts, TPContext, index_work, lb_gpu
from .schedule import TPSchedule, gpu_loads


@dataclass(frozen=True, slots=True)
class TPBaselineRow:
    name: str
    max_gpu_load: float
    mean_gpu_load: float
    max_over_mean: float
    gap_to_lb_gpu: float


def tp_baselines(problem: DPProblem, cuts: Cuts, schedule: TPSchedule | None = None,
                 ctx: TPContext | None = None) -> list[TPBaselineRow]:
    """``sc`` (all-gather and redundant compute on every TP rank, Megatron's ``duplicated``, on
    the same DP partition), ``canzona-greedy`` (the paper's DP greedy and TP greedy) and, given a
    schedule, ``canzona``."""
    ctx = ctx or TPContext.build(problem)
    lb = lb_gpu(problem, ctx=ctx)
    rows = []

    def row(name: str, grid: list[list[float]]) -> TPBaselineRow:
        flat = [x for r in grid for x in r]
        mx, mean = max(flat), sum(flat) / len(flat)
        return TPBaselineRow(name, mx, mean, mx / mean if mean else 1.0, mx / lb - 1 if lb else 0.0)

    base, owned = index_work(problem, cuts, ctx)
    tp = problem.sizes.tp
    rows.append(row("sc", [[base[d] + sum(problem.loads[i] for i in owned[d])] * tp
                           for d in range(problem.dp)]))
    g = greedy(problem, alpha=1.0)
    rows.append(row("canzona-greedy", gpu_loads(problem, g, ctx=ctx)))
    if schedule is not None:
        rows.append(row("canzona", gpu_loads(problem, cuts, schedule)))
    return rows
