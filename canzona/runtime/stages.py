"""Pipeline stages as the runtime sees them: which stage of a pipeline's plan this rank runs,
its parameters under the plan's (global) names, the tied embedding's two copies, and what the
stages agree on.

Each stage's ranks build ``CanzonaOptimizer(stage_module, plan, pp_group=…)``: ``pp_group`` is
this rank's pipeline group (Megatron's ``get_pipeline_model_parallel_group()``: the ranks with
its DP and TP place, one per stage, in stage order), whose rank is the stage unless ``stage=``
says otherwise. Everything else is the stage's plan over the stage's DP and TP groups.

* **Names.** The plan names decoder layers by their global number. A stage module that numbers
  its layers from 0 (Megatron's ``decoder.layers.{i}``, a ``ModuleList`` of its layers) has them
  renumbered by the stage's first layer; one that keeps the global keys (a ``ModuleDict`` with
  the others deleted, as torchtitan splits) is read as it is.
* **Tied embeddings.** The first stage holds the embedding, the last a copy as its output layer
  (Megatron's ``shared_embedding_or_output_weight``). Their gradients are summed between the
  two ranks of the same DP and TP place before the DP reduction, as Megatron's embedding group
  does (canzona replaces the DDP wrapper that would); the buckets holding them are reduced at
  ``step()`` for that. After each step the first stage's updated embedding is sent to the last
  stage's copy, so that the two are bit-identical whatever the stages' reductions did. The
  copy counts once in the gradient norm (Megatron's ``param_is_not_shared``).
* **Agreement.** The gradient norm for clipping is summed over DP, TP and PP; a non-finite
  gradient or a rank without gradients that makes one stage raise makes every stage raise, so
  no stage is left waiting in the next iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.planner.inventory import Stage
from canzona.planner.plan import PipelinePlan, Plan
from canzona.runtime.checkpoint.names import Placement, global_name
from canzona.runtime.errors import PlanMismatchError, UnevenBackwardError
from canzona.runtime.optim._base import NonFiniteGradientError
from canzona.runtime.waits import wait_for

__all__ = ["StagePlace", "agree_over_stages", "global_names", "stage_plan"]


@dataclass(frozen=True)
class StagePlace(Stage):
    """This rank's stage (the planner's :class:`~canzona.planner.inventory.Stage`: ``stage`` of
    ``pp``, its decoder layers), the pipeline group and, with tied embeddings, the tied weight's
    name on this stage."""

    group: Any = None
    tied: str | None = None  # the tied weight's name on this stage (embedding or its copy)
    embedding: str | None = None  # the last stage: the tied embedding's name on the first

    def checkpoint_aliases(self) -> dict[str, str]:
        """The last stage's tied copy → the embedding's name: the keys it saves nothing under
        and loads from (``runtime.checkpoint``)."""
        if self.last and self.pp > 1 and self.tied is not None and self.embedding is not None:
            return {self.tied: self.embedding}
        return {}

    @property
    def peer(self) -> int:
        """The global rank of the other end stage (the tied weight's other holder)."""
        return dist.get_global_rank(self.group, self.pp - 1 if self.first else 0)


#: The place of a rank outside any pipeline.
NO_STAGES = StagePlace(pp=1, stage=0, first_layer=0, layers=0, group=None, tied=None)


def stage_plan(plan: Plan | PipelinePlan, pp_group: Any, stage: int | None
               ) -> tuple[Plan, StagePlace]:
    """The plan this rank runs and its stage: a pipeline's plan's section for the stage (the
    ``pp_group`` rank, or ``stage``), or a plan of one stage, checked against the group.

    Raises:
        PlanMismatchError: a pipeline's plan without ``pp_group``, a group of another size than
            the plan's pp, a stage out of range, or ``pp_group`` with a whole model's plan.
    """
    if not isinstance(plan, (Plan, PipelinePlan)):
        return plan, NO_STAGES  # the argument checks name what it should be
    if isinstance(plan, PipelinePlan):
        pp = plan.pp
        if pp_group is None:
            raise PlanMismatchError(
                f"the plan has {pp} pipeline stages: pass pp_group= (this rank's pipeline "
                "group, one rank per stage in stage order; Megatron's "
                "parallel_state.get_pipeline_model_parallel_group()).")
    elif plan.inputs.stage is not None:
        pp = plan.inputs.stage.pp
        if pp_group is None:
            raise PlanMismatchError(f"the plan is stage {plan.inputs.stage.stage} of {pp}: pass "
                                    "pp_group= (this rank's pipeline group).")
    else:
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            raise PlanMismatchError(
                f"pp_group has {dist.get_world_size(pp_group)} ranks but the plan is for a "
                "whole model (pp 1); plan the stages: canzona plan --pp P, or "
                "canzona.plan_model(model, pp=P).")
        if stage not in (None, 0):
            raise PlanMismatchError(f"stage={stage} but the plan is for a whole model (pp 1).")
        return plan, NO_STAGES
    size = dist.get_world_size(pp_group)
    if size != pp:
        raise PlanMismatchError(f"pp_group has {size} ranks but the plan has {pp} pipeline "
                                "stages: pass the group of this rank's stages, one rank each.")
    s = dist.get_rank(pp_group) if stage is None else stage
    if not 0 <= s < pp:
        raise PlanMismatchError(f"stage={s} but the plan has stages 0 to {pp - 1}.")
    mine = plan.stage(s) if isinstance(plan, PipelinePlan) else plan
    st = mine.inputs.stage
    assert st is not None
    if st.stage != s:
        raise PlanMismatchError(f"the plan is stage {st.stage}'s but this rank runs stage {s} "
                                "(its pp_group rank, or stage=): give each stage's ranks that "
                                "stage's plan, or the pipeline's file.")
    tied = _tied_name(mine)
    embedding = _tied_name(plan.stages[0]) if isinstance(plan, PipelinePlan) else None
    return mine, StagePlace(pp=pp, stage=s, first_layer=st.first_layer, layers=st.layers,
                            group=pp_group, tied=tied, embedding=embedding)


def _tied_name(plan: Plan) -> str | None:
    """The tied weight's name on this stage (``inputs.stage.tied_copy``): the embedding on the
    first stage (its first parameter), the copy on the last (its last), None elsewhere."""
    st = plan.inputs.stage
    if st is None or not st.tied_copy or not plan.tasks:
        return None
    return plan.tasks[0].param if st.stage == 0 else plan.tasks[-1].param


def global_names(names: Sequence[str], place: StagePlace, plan_names: set[str]) -> list[str]:
    """The module's parameter names as the plan has them: decoder layers renumbered from the
    stage's first layer when the module numbers its own from 0 (module docstring)."""
    if place.pp == 1 or place.first_layer == 0 or all(n in plan_names for n in names):
        return list(names)
    at = Placement(layer_offset=place.first_layer)
    return [global_name(n, at) for n in names]


class TiedWeights:
    """The tied embedding's two copies on the end stages: the gradient exchange before the DP
    reduction and the first stage's weight sent to the last stage's copy after the step."""

    def __init__(self, place: StagePlace, index: int, *, timeout_s: float | None,
                 rank: int) -> None:
        self.place, self.index = place, index
        self.timeout_s, self.rank = timeout_s, rank

    def sum_grads(self, grad: Tensor) -> None:
        """``grad`` (this end's accumulated, not yet DP-reduced gradient of the tied weight) +=
        the other end's, the same sum on both (a + b = b + a)."""
        other = torch.empty_like(grad)
        peer = self.place.peer
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, grad, peer),
                                        dist.P2POp(dist.irecv, other, peer)])
        for w in works:
            wait_for(w, "the tied embedding's gradient exchange between the first and last "
                        "pipeline stages", self.timeout_s, self.rank)
        grad.add_(other)

    def share_weight(self, weight: Tensor) -> None:
        """The first stage sends its updated weight, the last stage's copy takes it."""
        peer = self.place.peer
        op = dist.isend if self.place.first else dist.irecv
        w = dist.batch_isend_irecv([dist.P2POp(op, weight, peer)])[0]
        wait_for(w, "the tied embedding's weight sent from the first to the last pipeline "
                    "stage", self.timeout_s, self.rank)


def agree_over_stages(raises: int, place: StagePlace, *, device: torch.device,
                      timeout_s: float | None, rank: int, reset: Any) -> None:
    """Every stage raises if one does: ``raises`` is this stage's verdict (0 nothing, 1 a
    non-finite gradient it raises for, 2 a DP rank without gradients); a MAX all-reduce over
    the pipeline group tells each stage the others'. A stage that raises on its own does so
    after this call, with its own message."""
    if place.pp == 1:
        return
    verdicts = torch.zeros(place.pp, dtype=torch.int32, device=device)
    verdicts[place.stage] = raises
    work = dist.all_reduce(verdicts, op=dist.ReduceOp.MAX, group=place.group, async_op=True)
    wait_for(work, "the pipeline stages' agreement on the gradients", timeout_s, rank)
    got = verdicts.cpu().tolist()
    if raises or not any(got):
        return
    reset()
    uneven = [s for s, v in enumerate(got) if v == 2]
    if uneven:
        raise UnevenBackwardError(
            f"pipeline stage(s) {', '.join(map(str, uneven))} had DP ranks without gradients "
            "this step, so every stage drops the step's gradients: call loss.backward() (the "
            "pipeline schedule) on every rank before step().")
    bad = [s for s, v in enumerate(got) if v == 1]
    exc = NonFiniteGradientError([f"pipeline stage {s}" for s in bad])
    exc.args = (f"non-finite gradient (NaN or Inf) on pipeline stage(s) "
                f"{', '.join(map(str, bad))}, which raise for it, so every stage does; nothing was "
                "updated (set nonfinite='skip' to skip such parameters instead)",)
    raise exc
