"""Expert parallelism as the runtime sees it: which experts this rank holds, under which names the
plan knows them, and over which group their buckets are sharded.

Megatron's layout, which the planner emulates (``canzona.planner.layout``): with ep > 1 the
expert weights leave the dense buffers for buffers of their own, one set per EP rank k holding
experts [k·E/ep, (k+1)·E/ep), each sharded over the expert-data-parallel group of edp =
dp·tp / (ep·etp) ranks. Megatron orders expert ranks expert-TP fastest, then EP, then expert-DP
(``canzona.planner.layout.expert_place``):
* with expert TP = TP the dense DP index d of a rank is the pair d = j·ep + k of its EP rank k
  and its expert-DP rank j: the expert-DP group of DP rank d is the DP ranks with the same
  d mod ep, and every TP rank of d holds a shard of the same experts;
* with expert TP 1 under tp > 1 the global rank g = d·tp + t is j·ep + k: the TP ranks of one
  DP index hold different experts, each whole, and the expert-DP group of g is the global ranks
  with the same g mod ep.
The plan's expert buckets have edp + 1 cuts indexed by j, and an expert task's ``owner`` is the
DP index that computes it (the planner reports every load per DP index); the runtime takes j
from the cuts.

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
from canzona.planner.settings import expert_place
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
        ep_rank: which EP rank's experts this rank holds (k = d mod ep, or g mod ep at expert
            TP 1).
        edp: the expert-data-parallel size, dp·tp / (ep·etp).
        edp_rank: this rank's place in its expert-DP group (j = d div ep, or g div ep).
        experts: the plan's number of experts (0 for a dense model).
        tp, etp: the plan's TP and expert TP sizes.
    """

    ep: int = 1
    ep_rank: int = 0
    edp: int = 1
    edp_rank: int = 0
    experts: int = 0
    tp: int = 1
    etp: int = 1

    @property
    def whole(self) -> bool:
        """Whether this rank's experts are whole on it under tp > 1 (expert TP 1): no TP rank
        shares them, so clipping counts them on this rank alone."""
        return self.ep > 1 and self.etp < self.tp

    def dp_index(self, r: int) -> int:
        """The DP index of rank ``r`` of this rank's expert-DP group."""
        return expert_place(r, self.ep_rank, ep=self.ep, tp=self.tp, etp=self.etp)[0]

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



def expert_layout(plan: Plan, dp_rank: int, tp_rank: int = 0) -> ExpertLayout:
    """The expert layout of the rank at DP index ``dp_rank`` and TP rank ``tp_rank`` under
    ``plan`` (expert TP = TP, or 1)."""
    ep = plan.inputs.ep
    if ep == 1:
        return ExpertLayout()
    dp, tp, etp = plan.inputs.dp, plan.inputs.tp, plan.inputs.etp
    g = dp_rank if etp == tp else dp_rank * tp + tp_rank  # the expert-TP group's index
    return ExpertLayout(ep=ep, ep_rank=g % ep, edp=dp * tp // (ep * etp), edp_rank=g // ep,
                        experts=len(plan_experts(plan)), tp=tp, etp=etp)


def plan_experts(plan: Plan) -> set[int]:
    """The global expert indices the plan's parameters carry (empty for a dense model)."""
    return {expert_index(s.name) for buf in plan.buffers for b in buf.buckets
            for s in b.slots} - {None}  # type: ignore[operator]


def expert_dp_group(layout: ExpertLayout, dp_group: Any, tp: int) -> Any:
    """The expert-DP group of this rank: the ranks holding its EP rank's experts (at expert TP =
    TP the DP ranks with its EP rank; at expert TP 1 the global ranks g ≡ its g mod ep), built
    once by every rank of the world (``new_subgroups_by_enumeration`` is collective over the
    world).

    The DP groups are Megatron's (global rank = d·tp + t, the plan's ``rank_layout``): every rank
    enumerates the expert-DP groups alike, global rank (j·ep + k)·etp + e for expert-DP rank j,
    EP rank k and expert-TP rank e. A DP group that is not (its ranks
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
    ep, etp = layout.ep, layout.etp
    ranks = [[(j * ep + k) * etp + e for j in range(layout.edp)] for e in range(etp)
             for k in range(ep)]
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
