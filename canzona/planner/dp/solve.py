"""The DP entry point: :func:`solve` chooses every bucket's cut points, :func:`plan_dp` wraps
them into a plan. Under TP it judges cuts per GPU with the TP side's joint refinement
(``tp.joint``, which does not import back)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CanzonaError
from ..plan import Plan, SolverOptions
from ..planning import DPProblem, build_plan, evaluate
from ..tp.context import TPContext, index_gpu_max, lb_gpu
from ..tp.joint import joint_refine
from .bounds import packing_bound, pigeonhole_bound
from .cpsat import solve_cpsat
from .greedy import greedy
from .polish import improve, rebalance_divisible
from .reorder import assign_free, reorder_problem
from .units import Cuts, owners_to_cuts

SOLVERS = ("auto", "greedy", "cpsat")
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


def solve(problem: DPProblem, *, solver: str = "auto", alpha: float = 1.0,
          time_limit_s: float = 10.0, seed: int = 0, comm_limit: float | None = None,
          workers: int = 1, reorder: bool = True,
          progress: Callable[[str], None] | None = None) -> Solution:
    """Choose every bucket's cut points.

    Args:
        solver: ``auto`` (greedy + exact per-bucket polish), ``greedy`` (the paper) or ``cpsat``.
        alpha: the paper's α ∈ [0, 1] for the greedy start (0: even split, 1: fill deficits).
        time_limit_s: CP-SAT's deterministic time limit.
        seed: CP-SAT's random seed (recorded in the plan).
        comm_limit: bound on each slice, in multiples of the even slice S/R (None: unbounded).
        workers: CP-SAT worker count (fixed, so plans are reproducible).
        reorder: allow parameters to change places inside their bucket (see ``dp.reorder``); the
            result keeps Megatron's order when that is at least as good. Never worse than the
            paper's greedy; within PACKING_BOUND_ABOVE of the bound, the Megatron-order search
            is skipped.
    """
    _check_options(solver, alpha, time_limit_s, comm_limit)
    bound = pigeonhole_bound(problem)
    say = progress or (lambda _msg: None)
    say("greedy")
    start = greedy(problem, alpha=alpha)
    greedy_max = _max_load(problem, start)
    if solver == "greedy" and comm_limit is None:
        # The paper's algorithm: its cuts, with the AdamW elements between matrices re-spread.
        used, cuts, searched = problem, rebalance_divisible(problem, start, ceiling=greedy_max), False
    else:
        used, cuts, searched = _search(problem, start, greedy_max, bound, reorder=reorder,
                                       comm_limit=comm_limit, say=say)
    if problem.sizes.tp > 1 and (searched or solver != "greedy"):
        fallback = start if searched and comm_limit is None else None
        used, cuts = _joint_tp(problem, used, cuts, fallback, say)
    status = "heuristic"
    if solver == "cpsat":
        say("cp-sat")
        cuts, status, cp_bound = solve_cpsat(used, cuts, time_limit_s=time_limit_s, seed=seed,
                                             workers=workers, comm_limit=comm_limit)
        bound = max(bound, cp_bound)
    load = _max_load(used, cuts)
    if load > bound * (1 + PACKING_BOUND_ABOVE):
        say("bounding")
        bound = max(bound, packing_bound(used, load))
    if load <= bound:
        status = "optimal"
    return Solution(cuts, status, bound, used)


def _check_options(solver: str, alpha: float, time_limit_s: float, comm_limit: float | None) -> None:
    if solver not in SOLVERS:
        raise CanzonaError(f"unknown solver '{solver}'; choose one of: {', '.join(SOLVERS)}.")
    if not 0.0 <= alpha <= 1.0:
        raise CanzonaError(f"--alpha must be in [0, 1], got {alpha}.")
    if time_limit_s <= 0:
        raise CanzonaError(f"--time-limit must be positive seconds, got {time_limit_s}.")
    if comm_limit is not None and comm_limit < 1.0:
        raise CanzonaError(f"--comm-limit must be ≥ 1 (a multiple of the even slice), got {comm_limit}.")


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


def plan_dp(problem: DPProblem, *, solver: str = "auto", alpha: float = 1.0,
            time_limit_s: float = 10.0, seed: int = 0, comm_limit: float | None = None,
            workers: int = 1, model_source: str = "preset", reorder: bool = True,
            progress: Callable[[str], None] | None = None) -> Plan:
    """Solve the DP partition and return the plan (strategy ``canzona``, or ``canzona-greedy``)."""
    sol = solve(problem, solver=solver, alpha=alpha, time_limit_s=time_limit_s, seed=seed,
                comm_limit=comm_limit, workers=workers, reorder=reorder, progress=progress)
    opts = SolverOptions(strategy="canzona-greedy" if solver == "greedy" else "canzona",
                         solver=solver, alpha=alpha,
                         time_limit_s=time_limit_s if solver == "cpsat" else None,
                         seed=seed, workers=workers, reorder=sol.problem is not problem)
    return build_plan(sol.problem, sol.cuts, solver=opts, model_source=model_source,
                      certified_bound=sol.bound, status=sol.status)


