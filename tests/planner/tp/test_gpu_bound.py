"""The certified per-GPU bound at tp > 1: bin packing of the hosted matrices over the dp·tp
GPUs (``tp.context.gpu_packing_bound``), at least LB_gpu and never above a plan."""

from __future__ import annotations

from canzona.planner import DPOptions, ParallelSizes, TPOptions
from canzona.planner.dp.bounds import bin_packing_bound
from canzona.planner.pipeline import plan
from canzona.planner.plan.inverse import read_problem
from canzona.planner.tp.context import gpu_packing_bound, lb_gpu


def test_bin_packing_finds_the_optimum_of_small_instances():
    """Three items 6, 5, 5 on two bins: the mean (8) and the largest (6) say 8, the packing 10;
    5, 4, 3, 3, 3 pack perfectly (9); divisible load fills the room the items leave (a bin of
    5 and 5 holds 10, the other 6 and 4 of the divisible 6). Loads at the planner's scale."""
    g = 10**9

    def bound(items, divisible, lower, upper):
        return bin_packing_bound([x * g for x in items], divisible * g, 2, lower * g,
                                 upper * g) / g

    for items, divisible, lower, optimum in (([6, 5, 5], 0, 8, 10), ([5, 4, 3, 3, 3], 0, 9, 9),
                                             ([6, 5, 5], 4, 10, 10), ([6, 5, 5], 6, 11, 11)):
        got = bound(items, divisible, lower, optimum + 3)
        assert optimum * (1 - 1e-5) <= got <= optimum, (items, divisible, got)


def test_qwen3_0_6b_dp16_tp2_bound_says_which_part_of_the_gap_is_the_plans():
    """LB_gpu is the mean here; the 112 hosted matrices of four sizes cannot pack that evenly
    onto 32 GPUs, so the certified bound lies strictly between LB_gpu and the plan's busiest
    GPU."""
    p = plan("qwen3-0.6b", ParallelSizes(dp=16, tp=2), "muon", dp_options=DPOptions(cost="flops"),
             tp_options=TPOptions(share="off"))
    problem = read_problem(p, model=True).problem
    m = p.tp.metrics
    bound = gpu_packing_bound(problem, m.max_gpu_load)
    assert lb_gpu(problem) == m.lb_gpu < bound <= m.max_gpu_load
    assert bound > 1.03 * m.lb_gpu
