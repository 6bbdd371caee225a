"""Pipeline stages in the step simulator: one iteration of a 1F1B schedule, and each stage's
optimizer step behind its own last backward.

Stage s of ``pp`` runs its microbatches in the 1F1B order (Megatron's
``forward_backward_pipelining_without_interleaving``, ``torch.distributed.pipelining``'s
``Schedule1F1B``): ``min(pp - s - 1, m)`` warm-up forwards, then one forward and one backward in
turn, then the remaining backwards. A forward of microbatch i on stage s starts when stage s is
free and stage s - 1 has finished that microbatch's forward; a backward when stage s is free and
stage s + 1 has finished its backward (point-to-point transfers are not timed). Stage times may
differ (an embedding or output layer makes the end stages heavier), so the schedule is played
out op by op rather than by formula.

Each stage's optimizer step (:func:`~canzona.planner.simulate.engine.simulate` of that stage's
workload) starts at its last backward: its gradient reductions run behind that microbatch's
backward, as a trainer's ``no_sync`` leaves them for the last microbatch. Stage 0 finishes its
backwards last; the iteration ends when the slowest stage's step does, and that stage is the
critical one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..hardware import HardwareProfile
from ..plan import PipelinePlan
from .engine import StepSim
from .from_plan import plan_forward_backward, simulate_plan

__all__ = ["MICROBATCHES_PER_STAGE", "PipelineSim", "one_f_one_b", "pipeline_iteration",
           "simulate_pipeline"]

#: Microbatches per stage a pipeline is simulated with unless told (m = 4·pp keeps 1F1B's
#: bubble, (pp - 1) / m of the forwards and backwards, under a quarter).
MICROBATCHES_PER_STAGE = 4


def one_f_one_b(forward_s: Sequence[float], backward_s: Sequence[float],
                microbatches: int) -> tuple[float, ...]:
    """When each stage's last backward ends under 1F1B (module docstring), 0 = the first
    forward's start; ``forward_s[s]``, ``backward_s[s]``: one microbatch on stage s."""
    pp, m = len(forward_s), microbatches
    if pp != len(backward_s) or pp < 1 or m < 1:
        raise ValueError("one forward and one backward time per stage, and m ≥ 1 microbatches")
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        ops = [("f", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("f", warm + i), ("b", i)]
        ops += [("b", i) for i in range(m - warm, m)]
        orders.append(ops)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    at = [0] * pp
    while any(at[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while at[s] < len(orders[s]):
                kind, i = orders[s][at[s]]
                need = (("f", s - 1, i) if s > 0 else None) if kind == "f" else \
                    (("b", s + 1, i) if s < pp - 1 else ("f", s, i))
                if need is not None and need not in done:
                    break
                start = max(free[s], done[need] if need is not None else 0.0)
                free[s] = start + (forward_s[s] if kind == "f" else backward_s[s])
                done[(kind, s, i)] = free[s]
                at[s] += 1
                moved = True
        if not moved:  # 1F1B never deadlocks; a wrong order would
            raise RuntimeError("the 1F1B order is stuck")
    return tuple(done[("b", s, m - 1)] for s in range(pp))


@dataclass(frozen=True, slots=True)
class PipelineSim:
    """One iteration of ``pp`` stages: when each stage's backwards end and its optimizer
    step."""

    microbatches: int
    forward_s: tuple[float, ...]  # per stage, one microbatch
    backward_s: tuple[float, ...]
    backward_end_s: tuple[float, ...]  # per stage: its last backward's end
    steps: tuple[StepSim, ...]  # per stage: its optimizer step behind its last backward

    @property
    def pp(self) -> int:
        return len(self.steps)

    @property
    def stage_end_s(self) -> tuple[float, ...]:
        """Per stage: its parameters ready (last backward's end plus its step)."""
        return tuple(e + st.step_s for e, st in zip(self.backward_end_s, self.steps))

    @property
    def forward_backward_s(self) -> float:
        """The schedule's forwards and backwards: stage 0's last backward ends last."""
        return max(self.backward_end_s)

    @property
    def iteration_s(self) -> float:
        return max(self.stage_end_s)

    @property
    def step_s(self) -> float:
        """The optimizer step as the pipeline sees it: from the last backward's end to the
        slowest stage's parameters ready."""
        return self.iteration_s - self.forward_backward_s

    @property
    def critical_stage(self) -> int:
        """The stage whose step ends last (ties: the lowest)."""
        ends = self.stage_end_s
        return ends.index(max(ends))

    def to_dict(self) -> dict:
        r = 9
        return {"pp": self.pp, "microbatches": self.microbatches,
                "forward_backward_s": round(self.forward_backward_s, r),
                "step_s": round(self.step_s, r), "iteration_s": round(self.iteration_s, r),
                "critical_stage": self.critical_stage,
                "stages": [{"stage": s, "forward_s": round(self.forward_s[s], r),
                            "backward_s": round(self.backward_s[s], r),
                            "backward_end_s": round(self.backward_end_s[s], r),
                            "step_s": round(self.steps[s].step_s, r),
                            "end_s": round(self.stage_end_s[s], r)}
                           for s in range(self.pp)]}


def pipeline_iteration(forward_backward_s: Sequence[float], steps: Sequence[StepSim],
                       microbatches: int) -> PipelineSim:
    """The iteration of stages whose forward and backward over the whole batch take
    ``forward_backward_s[s]`` (split 1 : 2 and over ``microbatches``), each stage's step
    ``steps[s]`` simulated behind one microbatch's backward (:func:`microbatch_times`)."""
    fwd, bwd = microbatch_times(forward_backward_s, microbatches)
    return PipelineSim(microbatches, fwd, bwd, one_f_one_b(fwd, bwd, microbatches),
                       tuple(steps))


def microbatch_times(forward_backward_s: Sequence[float], microbatches: int
                     ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage, one microbatch's forward and backward: the stage's forward and backward over
    the whole batch (1 : 2) divided by ``microbatches``."""
    fwd = tuple(fb / 3.0 / microbatches for fb in forward_backward_s)
    return fwd, tuple(2.0 * f for f in fwd)


def simulate_pipeline(plan: PipelinePlan, hw: HardwareProfile, *,
                      microbatches: int | None = None, overlap_param_gather: bool = False,
                      forward_backward_s: Sequence[float] | None = None) -> PipelineSim:
    """One iteration of a pipeline's plan on ``hw``: each stage's forward and backward from its
    own parameters (:func:`~canzona.planner.simulate.from_plan.plan_forward_backward`: 6 · its
    active parameters · tokens over its dp · tp GPUs, unless ``forward_backward_s`` gives them),
    in 1F1B over ``microbatches`` (default :data:`MICROBATCHES_PER_STAGE` · pp), and each
    stage's plan simulated behind its last microbatch's backward."""
    m = microbatches or MICROBATCHES_PER_STAGE * plan.pp
    fbs = tuple(forward_backward_s) if forward_backward_s is not None else tuple(
        plan_forward_backward(p, hw)[0] for p in plan.stages)
    if len(fbs) != plan.pp:
        raise ValueError(f"forward_backward_s holds {len(fbs)} times for pp {plan.pp}")
    fwd, bwd = microbatch_times(fbs, m)
    steps = tuple(simulate_plan(p, hw, backward_s=b, forward_s=f,
                                overlap_param_gather=overlap_param_gather)
                  for p, f, b in zip(plan.stages, fwd, bwd))
    return PipelineSim(m, fwd, bwd, one_f_one_b(fwd, bwd, m), steps)
