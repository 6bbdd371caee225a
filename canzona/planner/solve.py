"""The solve: :func:`solve` runs the DP stages (``dp``) and chooses every bucket's cut points
(``canzona.planner.pipeline`` turns them into a plan). Under TP it judges cuts per GPU with the
TP side's joint refinement (``tp.joint``), so it sits above both ``dp`` and ``tp``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from .hardware import DEFAULT_HARDWARE, HardwareProfile, load_hardware
from .objective import MAX_LOAD, Objective, StepTime
from .options import STEP_TIME_GAP_PP, DPOptions
from .planning import DPProblem, evaluate
from .tp.context import TPContext, index_gpu_max, lb_gpu
from .tp.joint import joint_refine, lockstep_assign
from .dp.bounds import packing_bound, pigeonhole_bound
from .dp.cpsat import solve_cpsat
from .dp.greedy import greedy
from .dp.polish import improve, improve_comm, rebalance_divisible
from .dp.reorder import assign_free, reorder_problem
from .dp.units import Cuts, owners_to_cuts

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


@dataclass(slots=True)
class _Run:
    """One solve: the options, the objective that judges every candidate, and progress."""

    problem: DPProblem
    options: DPOptions
    objective: Objective
    say: Callable[[str], None]
    bound: int = 0  # certified lower bound on the max load so far
    greedy_score: float = 0.0  # the paper's greedy, the score no result may exceed
    state_aware: bool = False  # step-time: the optimizer state breaks near-ties of the load
    reference_load: float | None = None  # the best max load seen, when a heavier one was kept
    hardware: HardwareProfile | None = None  # step-time: the communication model's profile
    #: the communication stage's results by problem, cuts, bound and reference load (a
    #: partition judged twice, by the lockstep placement and at the end, is re-cut once)
    recut: dict = field(default_factory=dict)

    def score(self, problem: DPProblem, cuts: Cuts) -> float:
        return self.objective.score(problem, cuts)

    def gpu_score(self, problem: DPProblem, cuts: Cuts, ctx: TPContext) -> float:
        return self.objective.gpu_score(index_gpu_max(problem, cuts, ctx), problem, cuts)


def solve(problem: DPProblem, options: DPOptions | None = None, *,
          progress: Callable[[str], None] | None = None,
          hardware: HardwareProfile | None = None) -> Solution:
    """Choose every bucket's cut points.

    ``options`` (:class:`~canzona.planner.options.DPOptions`): the solver (``auto``: greedy +
    exact per-bucket polish; ``greedy``: the paper; ``cpsat``), α for the greedy start, CP-SAT's
    time limit, seed and workers, the comm limit, the objective, and ``reorder``: parameters
    may change places inside their bucket (see ``dp.reorder``); the result keeps Megatron's
    order when that is at least as good. The compute stages are never worse than the paper's
    greedy (the ``step-time`` stage may then add STEP_TIME_GAP_PP points of the bound); within
    PACKING_BOUND_ABOVE of the bound, the Megatron-order search is skipped. Its layout fields
    (cost, bucket size) belong to ``make_problem``. ``progress`` is told each stage's name.

    Stages: greedy → search (reordered candidate, Megatron-order polish) → joint DP × TP
    (tp > 1) → CP-SAT (``cpsat``) → bounds → communication (the ``step-time`` objective, with
    ``hardware``'s communication model; None: the default profile).
    """
    o = options or DPOptions()
    custom = o.objective if isinstance(o.objective, Objective) else None
    run = _Run(problem, o, custom or MAX_LOAD, progress or (lambda _msg: None),
               bound=pigeonhole_bound(problem), state_aware=o.objective == "step-time",
               hardware=hardware)
    run.say("greedy")
    start = greedy(problem, alpha=o.alpha)
    run.greedy_score = run.score(problem, start)
    if o.solver == "greedy" and o.comm_limit is None:
        # The paper's algorithm: its cuts, with the AdamW elements between matrices re-spread.
        used, cuts, searched = problem, _rebalance(run, problem, start), False
    else:
        used, cuts, searched = _search(run, start)
    if problem.sizes.tp > 1 and (searched or o.solver != "greedy"):
        fallback = start if searched and o.comm_limit is None else None
        used, cuts = _joint_tp(run, used, cuts, fallback)
    status = "heuristic"
    if o.solver == "cpsat":
        run.say("cp-sat")
        cuts, status, cp_bound = solve_cpsat(used, cuts, time_limit_s=o.time_limit_s, seed=o.seed,
                                             workers=o.workers, comm_limit=o.comm_limit,
                                             objective=run.objective)
        run.bound = max(run.bound, cp_bound)
    load = _max_load(used, cuts)
    if load > run.bound * (1 + PACKING_BOUND_ABOVE):
        run.say("bounding")
        run.bound = max(run.bound, packing_bound(used, load))
    if load <= run.bound:
        status = "optimal"
    if o.objective == "step-time":
        hw = hardware or load_hardware(DEFAULT_HARDWARE)
        cuts = _communication(run, used, cuts, hw)
        if o.solver != "greedy" and o.comm_limit is None:
            # The paper's greedy cuts through the same stage: kept if their step is shorter.
            run.reference_load = None
            paper = _communication(run, problem, _rebalance(run, problem, start), hw)
            if _within_compute_slack(run, problem, paper, used, cuts) and \
                    modelled_step(problem, paper, hw) < \
                    (1 - PAPER_STEP_MARGIN) * modelled_step(used, cuts, hw):
                used, cuts = problem, paper
                status = "optimal" if _max_load(used, cuts) <= run.bound else "heuristic"
    return Solution(cuts, status, run.bound, used)


#: The paper's greedy cuts replace ours at the end of the ``step-time`` stage only if their
#: modelled step is shorter by more than this (relative): they usually hold more optimizer
#: state on the busiest rank and balance DP indices worse, a trade worth a clear gain only.
PAPER_STEP_MARGIN = 0.01


def _within_compute_slack(run: _Run, problem: DPProblem, cuts: Cuts, used: DPProblem,
                          ours: Cuts) -> bool:
    """Whether ``cuts``' busiest compute is within STEP_TIME_GAP_PP points of ``ours``: of the
    certified bound for the busiest DP index (tp = 1), of LB_gpu for the busiest GPU (tp > 1,
    where the GPU is what the step waits for)."""
    if problem.sizes.tp > 1:
        ctx = TPContext.build(problem)
        slack = STEP_TIME_GAP_PP / 100 * lb_gpu(problem, ctx=ctx)
        return max(index_gpu_max(problem, cuts, ctx)) <= \
            max(index_gpu_max(used, ours, TPContext.build(used))) + slack
    return _max_load(problem, cuts) <= _max_load(used, ours) + STEP_TIME_GAP_PP / 100 * run.bound


def modelled_step(problem: DPProblem, cuts: Cuts, hw: HardwareProfile) -> float:
    """The step the ``step-time`` objective models, without its state term or ceiling: the
    busiest DP index's compute (under TP, the busiest GPU's) plus the predicted collectives,
    in load units. The last stage keeps the paper's greedy cuts (through the communication
    stage too) when this is lower for them: the optimizer state may not cost step time against
    the paper's method."""
    obj = StepTime(problem, hw)
    if problem.sizes.tp > 1:
        return obj.gpu_score(index_gpu_max(problem, cuts), problem, cuts)
    return max(evaluate(problem, cuts).load) + obj.bucket_terms(problem, cuts)


#: The optimizer-state balance the ``step-time`` stage aims at: max/mean ≤ this, unless one
#: matrix's state alone is larger.
STATE_BALANCE = 1.10


def state_target(problem: DPProblem) -> float:
    """max(STATE_BALANCE × the mean state per DP index, the largest single matrix's state)."""
    total = sum(it.state_bytes for b in problem.buckets for it in b.items)
    largest = max((it.state_bytes for b in problem.buckets for it in b.items if it.atomic),
                  default=0)
    return max(STATE_BALANCE * total / problem.dp, float(largest))


def _state_excess(problem: DPProblem, cuts: Cuts) -> float:
    """How far the busiest optimizer state is above :func:`state_target` (0 when under)."""
    return max(0.0, max(evaluate(problem, cuts).state_bytes) - state_target(problem))


def _communication(run: _Run, problem: DPProblem, cuts: Cuts, hw: HardwareProfile) -> Cuts:
    """The ``step-time`` stage: re-cut buckets where the predicted collective time falls by
    more than the compute grows (:class:`~canzona.planner.objective.StepTime`), the busiest
    DP index's load held within STEP_TIME_GAP_PP points of the certified bound of where it
    was (and, under TP, the busiest GPU's likewise of LB_gpu), and the busiest optimizer
    state brought under :func:`state_target` where the cuts allow."""
    key = (id(problem), id(hw), tuple(cuts.items()), run.bound, run.reference_load)
    got = run.recut.get(key)
    if got is None or got[0] is not problem or got[1] is not hw:  # (held: ids not reused)
        got = run.recut[key] = (problem, hw, _recut(run, problem, cuts, hw))
    return got[2]


def _recut(run: _Run, problem: DPProblem, cuts: Cuts, hw: HardwareProfile) -> Cuts:
    load = min(_max_load(problem, cuts), run.reference_load or math.inf)
    ceiling = load + STEP_TIME_GAP_PP / 100 * run.bound
    obj = StepTime(problem, hw, ceiling=ceiling, state_cap=state_target(problem))
    run.say("communication")
    cand = improve_comm(problem, cuts, run.options.comm_limit, objective=obj)
    if obj.score(problem, cand) >= obj.score(problem, cuts) or _max_load(problem, cand) > ceiling:
        return cuts
    if problem.sizes.tp > 1:
        ctx = TPContext.build(problem)
        slack = STEP_TIME_GAP_PP / 100 * lb_gpu(problem, ctx=ctx)
        if max(index_gpu_max(problem, cand, ctx)) > max(index_gpu_max(problem, cuts, ctx)) + slack:
            return cuts
    return cand


def _max_load(problem: DPProblem, cuts: Cuts) -> int:
    """The busiest DP index's load: what the certified bounds bound."""
    return max(evaluate(problem, cuts).load)


def _rebalance(run: _Run, problem: DPProblem, cuts: Cuts) -> Cuts:
    return rebalance_divisible(problem, cuts, comm_limit=run.options.comm_limit,
                               ceiling=run.greedy_score, objective=run.objective)


@dataclass(frozen=True, slots=True)
class _Candidate:
    problem: DPProblem
    cuts: Cuts
    score: float


def _reordered(run: _Run) -> _Candidate | None:
    """Parameters placed freely inside their buckets (``dp.reorder``), then polished; None when
    that is worse than the paper's greedy."""
    run.say("reordering")
    best: _Candidate | None = None
    least = math.inf  # the lightest candidate's score: what a state-chosen one is held to
    # step-time also tries the heavy AdamW tensors' buckets' matrices at the ends (dp.reorder)
    for spread in (False, True) if run.state_aware else (False,):
        rp, owners = reorder_problem(run.problem, assign_free(run.problem, spread_heavy=spread))
        rcuts = owners_to_cuts(rp, owners)
        if run.options.comm_limit is not None or _max_load(rp, rcuts) > run.bound * 1.001:
            # The free assignment is nearly balanced: a few polish rounds finish it.
            rcuts = improve(rp, rcuts, run.options.comm_limit, max_rounds=2,
                            objective=run.objective)
        rcuts = _rebalance(run, rp, rcuts)
        cand = _Candidate(rp, rcuts, run.score(rp, rcuts))
        least = min(least, cand.score)
        if best is None or cand.score < best.score or (
                cand.score <= best.score + STEP_TIME_GAP_PP / 100 * run.bound
                and _state_excess(rp, rcuts) < _state_excess(best.problem, best.cuts)):
            best = cand
    if best is not None and best.score > least:
        # the optimizer state chose it: the communication stage's ceiling stays the lightest's
        run.reference_load = least
    return best if best is not None and best.score <= run.greedy_score else None


def _search(run: _Run, start: Cuts) -> tuple[DPProblem, Cuts, bool]:
    """The reordered candidate, then (unless that is within PACKING_BOUND_ABOVE of the bound)
    the Megatron-order polish of the greedy cuts; the better one wins, ties to Megatron's order.
    Returns the problem, its cuts and whether the Megatron-order search ran."""
    problem, comm_limit = run.problem, run.options.comm_limit
    reordered = _reordered(run) if run.options.reorder else None
    if reordered is not None and reordered.score <= run.bound * (1 + PACKING_BOUND_ABOVE):
        # Near the bound already: the Megatron-order search can only tie or lose by less.
        return reordered.problem, reordered.cuts, False
    run.say("polishing")
    best = improve(problem, start, comm_limit, objective=run.objective)
    best = _rebalance(run, problem, best)
    best_score = run.score(problem, best)
    if reordered is not None:
        if run.state_aware and reordered.score <= best_score + STEP_TIME_GAP_PP / 100 * run.bound \
                and _state_excess(reordered.problem, reordered.cuts) < _state_excess(problem, best):
            run.reference_load = min(best_score, reordered.score)
            return reordered.problem, reordered.cuts, True  # the optimizer state decides
        if best_score <= reordered.score:
            return problem, best, True  # reordering did not help: keep Megatron's order
        return reordered.problem, reordered.cuts, True
    # Polishing works on a discretisation of the AdamW items: keep the greedy cuts if they are
    # better (unless they break the comm limit, which greedy does not know).
    if comm_limit is not None or best_score <= run.greedy_score:
        return problem, best, True
    return problem, start, True


def _lockstep_reorder(run: _Run, used: DPProblem, cuts: Cuts, gpu: float, ctx: TPContext
                      ) -> tuple[DPProblem, Cuts, float]:
    """Tasks the TP group shares: whole matrices re-placed freely among DP indices
    (``tp.joint.lockstep_assign``: which pieces share an index decides its lockstep phase), the
    bucket reordered, its AdamW elements re-spread; kept if the per-GPU score falls."""
    if run.options.comm_limit is not None:  # the spread cuts would not respect it
        return used, cuts, gpu
    rank = lockstep_assign(used, cuts, ctx=ctx)
    if rank is None:
        return used, cuts, gpu
    run.say("lockstep placement")
    rp, owners = reorder_problem(used, rank)
    rcuts = _rebalance(run, rp, owners_to_cuts(rp, owners))
    score = run.gpu_score(rp, rcuts, TPContext.build(rp))
    # as the joint refinement: a real gain, and more where it piles optimizer state up
    if score >= gpu * (1 - JOINT_TP_MARGIN) - _piling_slack(run, rp, rcuts, cuts, ctx, used):
        return used, cuts, gpu
    if run.state_aware:
        # step-time: the pieces an index pairs may hold more bytes than the mean (qwen3-32b
        # dp128 tp8: fc1 + proj), and its bucket slices then slow the collectives by more than
        # the busiest GPU gains: kept only if the modelled step is shorter
        hw = run.hardware or load_hardware(DEFAULT_HARDWARE)
        if modelled_step(rp, _communication(run, rp, rcuts, hw), hw) >= \
                modelled_step(used, _communication(run, used, cuts, hw), hw):
            return used, cuts, gpu
    return rp, rcuts, score


def _piling_slack(run: _Run, problem: DPProblem, cand: Cuts, cuts: Cuts, ctx: TPContext,
                  before: DPProblem | None = None) -> float:
    """What a per-GPU candidate that piles optimizer state up (its excess over
    :func:`state_target` above that of ``cuts``) must gain, in load units: under step-time,
    STEP_TIME_GAP_PP points of LB_gpu; with loads in seconds, any gain is refused (inf).

    In seconds an AdamW tensor weighs in the balance (its memory traffic) while it holds 8 B of
    state per element, so a per-GPU balance would trade many gigabytes of state for a sliver of
    compute; FLOPs and element counts keep the paper's trade (and their recorded plans)."""
    if not run.state_aware or \
            _state_excess(problem, cand) <= _state_excess(before or problem, cuts):
        return 0.0
    if problem.seconds_per_load is not None:
        return math.inf
    return STEP_TIME_GAP_PP / 100 * lb_gpu(before or problem, ctx=ctx)


def _joint_tp(run: _Run, used: DPProblem, cuts: Cuts,
              greedy_cuts: Cuts | None) -> tuple[DPProblem, Cuts]:
    """Under TP, judge by the busiest GPU (DP index × TP rank), not the busiest DP index: refine
    the cuts on the per-GPU objective (``tp.joint_refine``) when they are more than 1% above
    LB_gpu, and fall back to the paper's greedy cuts if those pack better per GPU."""
    original = run.problem
    ctx = TPContext.build(used)
    per_index = index_gpu_max(used, cuts, ctx)
    gpu = run.objective.gpu_score(per_index, used, cuts)
    if max(per_index) > 1.01 * lb_gpu(used, ctx=ctx):
        run.say("joint DP×TP refinement")
        refined = joint_refine(used, cuts, ctx=ctx, objective=run.objective)
        refined_gpu = run.gpu_score(used, refined, ctx)
        if refined_gpu < gpu - _piling_slack(run, used, refined, cuts, ctx):
            cuts, gpu = refined, refined_gpu
    if used.shared and run.options.reorder:
        used, cuts, gpu = _lockstep_reorder(run, used, cuts, gpu, ctx)
    if greedy_cuts is not None:
        # Only for a real gain: per-GPU maxima are often flat (the largest matrix), and a tie
        # broken by a sliver of AdamW work must not bring back a badly balanced DP partition.
        gctx = ctx if used is original else TPContext.build(original)
        if run.gpu_score(original, greedy_cuts, gctx) < gpu * (1 - JOINT_TP_MARGIN) and not (
                run.state_aware
                and _state_excess(original, greedy_cuts) > _state_excess(used, cuts)):
            return original, greedy_cuts
    return used, cuts
