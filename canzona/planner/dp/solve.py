"""The DP stage: :func:`solve` chooses every bucket's cut points (``canzona.planner.pipeline``
turns them into a plan). Under TP it judges cuts per GPU with the TP side's joint refinement
(``tp.joint``, which does not import back)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..options import SOLVERS, DPOptions
from ..planning import DPProblem, evaluate
from ..tp.context import TPContext, index_gpu_max, lb_gpu
from ..tp.joint import joint_refine
from .bounds import packing_bound, pigeonhole_bound
from .cpsat import solve_cpsat
from .greedy import greedy
from .polish import improve, rebalance_divisible
from .reorder import assign_free, reorder_problem
from .units import Cuts, owners_to_cuts

#: The bin-packing bound (a CP-SAT covering model) is computed when the plan is more than this
#: far above the simple bounds: below it the simple bound already certifies the plan.
PACKING_BOUND_ABOVE = 0.02
#: Under TP, the paper's greedy cuts replace ours only if they lower the busiest GPU by more
#: than this (relative).
JOINT_TP_MARGIN = 0.005


@dataclass(frozen=True, slots=True)
class Solution:
    cuts: Cuts
    status: str
    bound: int  # certified lower bound on the max load
    problem: DPProblem  # the problem the cuts refer to (reordered, when reordering was used)


def _joint_tp(original: DPProblem, used: DPProblem, cuts: Cuts, greedy_cuts: Cuts | None,
              say: Callable[[str], None]) -> tuple[DPProblem, Cuts]:
    """Under TP, judge by the busiest GPU (DP index × TP rank), not the busiest DP index: refine
    the cuts on the per-GPU objective (``tp.joint_refine``) when they are more than 1% above
    LB_gpu, and fall back to the paper's greedy cuts if those pack better per GPU."""
    ctx = TPContext.build(used)
    gpu_max = max(index_gpu_max(used, cuts, ctx))
    if gpu_max > 1.01 * lb_gpu(used, ctx=ctx):
        say("joint DP×TP refinement")
        refined = joint_refine(used, cuts, ctx=ctx)
        refined_max = max(index_gpu_max(used, refined, ctx))
        if refined_max < gpu_max:
            cuts, gpu_max = refined, refined_max
    if greedy_cuts is not None:
        # Only for a real gain: per-GPU maxima are often flat (the largest matrix), and a tie
        # broken by a sliver of AdamW work must not bring back a badly balanced DP partition.
        gctx = ctx if used is original else TPContext.build(original)
        if max(index_gpu_max(original, greedy_cuts, gctx)) < gpu_max * (1 - JOINT_TP_MARGIN):
            return original, greedy_cuts
    return used, cuts


def solve(problem: DPProblem, options: DPOptions | None = None, *,
          progress: Callable[[str], None] | None = None) -> Solution:
    """Choose every bucket's cut points.

    ``options`` (:class:`~canzona.planner.options.DPOptions`): the solver (``auto``: greedy +
    exact per-bucket polish; ``greedy``: the paper; ``cpsat``), α for the greedy start, CP-SAT's
    time limit, seed and workers, the comm limit, and ``reorder``: parameters may change places
    inside their bucket (see ``dp.reorder``); the result keeps Megatron's order when that is at
    least as good. Never worse than the paper's greedy; within PACKING_BOUND_ABOVE of the
    bound, the Megatron-order search is skipped. Its layout fields (cost, bucket size) belong
    to ``make_problem``. ``progress`` is told the name of each stage.
    """
    o = options or DPOptions()
    solver, comm_limit = o.solver, o.comm_limit
    bound = pigeonhole_bound(problem)
    say = progress or (lambda _msg: None)
    say("greedy")
    start = greedy(problem, alpha=o.alpha)
    greedy_max = _max_load(problem, start)
    if solver == "greedy" and comm_limit is None:
        # The paper's algorithm: its cuts, with the AdamW elements between matrices re-spread.
        used, cuts, searched = problem, rebalance_divisible(problem, start, ceiling=greedy_max), False
    else:
        used, cuts, searched = _search(problem, start, greedy_max, bound, reorder=o.reorder,
                                       comm_limit=comm_limit, say=say)
    if problem.sizes.tp > 1 and (searched or solver != "greedy"):
        fallback = start if searched and comm_limit is None else None
        used, cuts = _joint_tp(problem, used, cuts, fallback, say)
    status = "heuristic"
    if solver == "cpsat":
        say("cp-sat")
        cuts, status, cp_bound = solve_cpsat(used, cuts, time_limit_s=o.time_limit_s, seed=o.seed,
                                             workers=o.workers, comm_limit=comm_limit)
        bound = max(bound, cp_bound)
    load = _max_load(used, cuts)
    if load > bound * (1 + PACKING_BOUND_ABOVE):
        say("bounding")
        bound = max(bound, packing_bound(used, load))
    if load <= bound:
        status = "optimal"
    return Solution(cuts, status, bound, used)


def _max_load(problem: DPProblem, cuts: Cuts) -> int:
    return max(evaluate(problem, cuts).load)


@dataclass(frozen=True, slots=True)
class _Candidate:
    problem: DPProblem
    cuts: Cuts
    max_load: int


def _reordered(problem: DPProblem, greedy_max: int, bound: int, comm_limit: float | None,
               say: Callable[[str], None]) -> _Candidate | None:
    """Parameters placed freely inside their buckets (``dp.reorder``), then polished; None when
    that is worse than the paper's greedy."""
    say("reordering")
    rp, owners = reorder_problem(problem, assign_free(problem))
    rcuts = owners_to_cuts(rp, owners)
    if comm_limit is not None or _max_load(rp, rcuts) > bound * 1.001:
        # The free assignment is nearly balanced: a few polish rounds finish it.
        rcuts = improve(rp, rcuts, comm_limit, max_rounds=2)
    rcuts = rebalance_divisible(rp, rcuts, comm_limit=comm_limit, ceiling=greedy_max)
    rmax = _max_load(rp, rcuts)
    return _Candidate(rp, rcuts, rmax) if rmax <= greedy_max else None


def _search(problem: DPProblem, start: Cuts, greedy_max: int, bound: int, *, reorder: bool,
            comm_limit: float | None, say: Callable[[str], None]) -> tuple[DPProblem, Cuts, bool]:
    """The reordered candidate, then (unless that is within PACKING_BOUND_ABOVE of the bound)
    the Megatron-order polish of the greedy cuts; the better one wins, ties to Megatron's order.
    Returns the problem, its cuts and whether the Megatron-order search ran."""
    reordered = _reordered(problem, greedy_max, bound, comm_limit, say) if reorder else None
    if reordered is not None and reordered.max_load <= bound * (1 + PACKING_BOUND_ABOVE):
        # Near the bound already: the Megatron-order search can only tie or lose by less.
        return reordered.problem, reordered.cuts, False
    say("polishing")
    best = improve(problem, start, comm_limit)
    best = rebalance_divisible(problem, best, comm_limit=comm_limit, ceiling=greedy_max)
    best_max = _max_load(problem, best)
    if reordered is not None:
        if best_max <= reordered.max_load:
            return problem, best, True  # reordering did not help: keep Megatron's order
        return reordered.problem, reordered.cuts, True
    # Polishing works on a discretisation of the AdamW items: keep the greedy cuts if they are
    # better (unless they break the comm limit, which greedy does not know).
    if comm_limit is not None or best_max <= greedy_max:
        return problem, best, True
    return problem, start, True
