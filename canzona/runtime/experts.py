"""Expert parallelism as the runtime sees it: which experts this rank holds, under which names the
plan knows them, and over which group their buckets are sharded.

Megatron's layout, which the planner emulates (``canzona.planner.layout``): with ep > 1 the
expert weights leave the dense buffers for buffers of their own, one set per EP rank k holding
experts [k·E/ep, (k+1)·E/ep), each sharded over the expert-data-parallel group of edp =
dp·tp / (ep·etp) ranks. With expert TP = TP, Megatron's rank order (TP fastest, then EP, then
expert-DP) makes the dense DP index d of a rank the pair d = j·ep + k of its EP rank k and its
expert-DP rank j: the expert-DP group of DP rank d is the DP ranks with the same d mod ep. The
plan's expert buckets have edp + 1 cuts indexed by j, and an expert task's ``owner`` is the DP
index j·ep + k that computes it (the planner reports every load per DP index).

A rank's model names its experts from 0 (Megatron's ``local_experts.{j}``, a ``ModuleList`` of
experts); the plan names them by their global index (``checkpoint.names.global_name``).
The expert gradients are summed over the expert-DP group and divided by the DP size, as
Megatron's ``expert_gradient_scaling_factor`` does: every expert's gradient is then the mean
over the whole batch, as a single device computes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from canzona.planner.errors import ModelError
from canzona.planner.inventory import ModelSpec, ParamSpec
from canzona.planner.plan import Plan
from canzona.runtime.checkpoint.names import Placement, expert_index, global_name
from canzona.runtime.errors import PlanMismatchError

__all__ = ["ExpertLayout", "expert_dp_group", "expert_layout", "global_inventory",
           "plan_experts"]


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """This rank's place in the plan's expert parallelism.

    Attributes:
        ep: the plan's expert-parallel size (1: experts live in the dense buffers).
        ep_rank: which EP rank's experts this rank holds (k = d mod ep).
        edp: the expert-data-parallel size, dp / ep at expert TP = TP.
        edp_rank: this rank's place in its expert-DP group (j = d div ep).
        experts: the plan's number of experts (0 for a dense model).
    """

    ep: int = 1
    ep_rank: int = 0
    edp: int = 1
    edp_rank: int = 0
    experts: int = 0

    @property
    def placement(self) -> Placement:
        """The offset of this rank's first expert, for :func:`global_name`."""
        return Placement(expert_offset=self.ep_rank * (self.experts // max(self.ep, 1)))

    def holds(self, buf: Any) -> bool:
        """Whether this rank holds the plan buffer ``buf`` (dense, or its EP rank's experts)."""
        return not buf.expert or buf.ep_rank == self.ep_rank

    def held(self, plan: Plan, *, experts_only: bool = False) -> set[str] | None:
        """The plan's parameters this rank holds (the dense ones and its EP rank's experts; with
        ``experts_only`` its experts alone); None at ep = 1 (every parameter)."""
        if self.ep == 1:
            return None
        return {s.name for buf in plan.buffers if self.holds(buf)
                and (buf.expert or not experts_only) for b in buf.buckets for s in b.slots}

    def plan_names(self, names: list[str]) -> list[str]:
        """The live parameter names as the plan names them (experts by global index)."""
        if self.ep == 1:
            return list(names)
        return [global_name(n, self.placement) for n in names]

    def group_rank(self, owner: int) -> int:
        """The place in its bucket's expert-DP group of the DP index ``owner`` of an expert task
        this rank holds."""
        return owner // self.ep


def expert_layout(plan: Plan, dp_rank: int) -> ExpertLayout:
    """The expert layout of DP rank ``dp_rank`` under ``plan``.

    Raises:
        PlanMismatchError: the plan's expert tensor parallelism differs from its TP (expert TP
            of 1 under tp > 1 is not executed yet).
    """
    ep = plan.inputs.ep
    if ep == 1:
        return ExpertLayout()
    if plan.inputs.etp != plan.inputs.tp:
        raise PlanMismatchError(
            f"the plan is for expert tp={plan.inputs.etp} under tp={plan.inputs.tp}; the runtime "
            "executes expert parallelism with expert TP = TP (Megatron's default); plan with "
            "etp equal to tp.")
    dp = plan.inputs.dp
    return ExpertLayout(ep=ep, ep_rank=dp_rank % ep, edp=dp // ep, edp_rank=dp_rank // ep,
                        experts=len(plan_experts(plan)))


def plan_experts(plan: Plan) -> set[int]:
    """The global expert indices the plan's parameters carry (empty for a dense model)."""
    return {expert_index(s.name) for buf in plan.buffers for b in buf.buckets
            for s in b.slots} - {None}  # type: ignore[operator]


def expert_dp_group(layout: ExpertLayout, dp_group: Any, tp: int) -> Any:
    """The expert-DP group of this rank: the DP ranks with its EP rank, built once by every rank
    of the world (``new_subgroups_by_enumeration`` is collective over the world).

    The DP groups are Megatron's (global rank = d·tp + t, the plan's ``rank_layout``): every rank
    enumerates the expert-DP groups of every TP rank alike. A DP group that is not (its ranks
    are not those of this TP rank in that order) must come with an explicit
    ``expert_dp_group``.
    """
    world = dist.get_world_size()
    dp = world // tp
    me = dist.get_rank()
    members = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(world))
    t = me % tp
    if members != [d * tp + t for d in range(dp)]:
        raise PlanMismatchError(
            f"the DP group holds global ranks {members[:8]}{'…' if len(members) > 8 else ''}, not "
            f"Megatron's order for TP rank {t} ({[d * tp + t for d in range(min(dp, 8))]}…), so "
            "the expert-DP groups cannot be derived: pass expert_dp_group= (the DP ranks holding "
            "this rank's experts).")
    ranks = [[d * tp + t for d in range(k, dp, layout.ep)] for t in range(tp)
             for k in range(layout.ep)]
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group



def global_inventory(spec: ModelSpec, ep: int) -> ModelSpec:
    """A live module's inventory, one EP rank's experts numbered from 0, as the whole model's:
    every per-expert 2-D weight (a name with ``.experts.<j>.`` or ``.local_experts.<j>.``)
    marked ``expert`` with its global index, each run of the rank's expert weights repeated for
    every EP rank with its experts renumbered (EP rank k's expert j is k·E/ep + j). Every rank
    gets the same inventory.

    Raises:
        ModelError: ep > 1 for a module without per-expert weights.
    """
    params: list[ParamSpec] = []
    run: list[tuple[ParamSpec, int]] = []

    def flush() -> None:
        per = max(j for _, j in run) + 1
        for k in range(ep):
            for p, j in run:
                params.append(dataclasses.replace(
                    p, name=global_name(p.name, Placement(expert_offset=k * per)), kind="expert",
                    expert=k * per + j))
        run.clear()

    for p in spec.params:
        j = expert_index(p.name) if p.optimizer == "matrix" and len(p.shape) == 2 else None
        if j is None:
            if run:
                flush()
            params.append(p)
        else:
            run.append((p, j))
    if run:
        flush()
    if ep > 1 and len(params) == len(spec.params):
        raise ModelError(f"ep={ep} needs per-expert 2-D weights named '….experts.<j>.…' (each "
                         f"rank's experts numbered from 0); {spec.name} has none.")
    return ModelSpec(config=None, params=tuple(params), label=spec.label)
