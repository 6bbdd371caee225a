"""A plan read back as the DP problem it solves: the one inverse of
:func:`canzona.planner.plan.build.build_plan`.

:func:`read_problem` always reads what the plan itself records — its buckets in the plan's order,
every slot an item with its tasks' recorded loads, FLOPs and state bytes (a matrix two DP indices
share: its two pieces, ``dp_shared``), and the plan's cuts — which is what the consistency checks
evaluate (:func:`canzona.planner.planning.evaluate` reads it like a problem: a
:class:`~canzona.planner.planning.Partition`). Asked for the model, it also rebuilds the model of
the plan's inputs (a preset, or the Hugging Face ``config.json`` it was made from; checked against
the plan's fingerprint) and the planner's problem of it (``make_problem``), for the reports, the
baselines and the strategy comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..alike import Kept
from ..errors import CanzonaError
from ..inventory import NAMINGS, ModelSpec, Stage, build_inventory
from ..layout import ParallelSizes
from ..models import get_preset, load_hf_config
from ..hardware import HardwareProfile, hardware_names, load_hardware
from ..options import COSTS, HARDWARE_COSTS
from ..planning import (GRAD_BYTES, BucketProblem, Cuts, DPProblem, Item, make_problem,
                        pair_items)
from ..stages import stage_model
from .schema import BufferPlan, PairTaskPlan, Plan

__all__ = ["PlanProblem", "read_problem", "rebuild_model"]


@dataclass(frozen=True, slots=True)
class PlanProblem:
    """A plan's DP problem, read back from the plan.

    Attributes:
        sizes: the plan's dp, tp, ep (and etp when it differs from tp).
        buffers: the plan's buffers (which EP rank's experts each holds).
        buckets: every bucket in the plan's order, its items the plan's slots in the plan's
            order, each with its tasks' recorded loads, FLOPs and state bytes; a matrix two DP
            indices share (``dp_shared``) is its two pieces.
        cuts: the plan's cut points per (buffer, bucket).
        pairs: task id → its record in ``dp_shared``.
        total: Σ of the items' loads.
        problem: with the model (``read_problem(model=True)``): the planner's problem of the
            plan's inputs (``make_problem``, Megatron's parameter order); None without it, or
            where it cannot be rebuilt (a live module's plan, a custom cost model).
        in_plan_order: ``problem`` with every bucket's parameters in the plan's order, at the
            plan's offsets (plans made with reordering move parameters inside buckets); the
            plan's ``cuts`` refer to it. None with ``problem``.
    """

    sizes: ParallelSizes
    buffers: tuple[BufferPlan, ...]
    buckets: tuple[BucketProblem, ...]
    cuts: Cuts
    pairs: Mapping[int, PairTaskPlan]
    total: int
    problem: DPProblem | None = None
    in_plan_order: DPProblem | None = None

    @property
    def dp(self) -> int:
        return self.sizes.dp

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element of the buckets."""
        return GRAD_BYTES[self.buffers[0].grad_dtype] if self.buffers else 4

    def dp_index(self, bucket: BucketProblem, r: int) -> int:
        """DP index of rank ``r`` of ``bucket``'s sharding group (an expert buffer's rank r of EP
        rank k: ``ParallelSizes.expert_place``), as :meth:`DPProblem.dp_index`."""
        buf = self.buffers[bucket.buffer]
        if buf.ep_rank is None or not buf.expert:
            return r
        return self.sizes.expert_place(buf.ep_rank, r)[0]

    def dp_indices(self, bucket: BucketProblem) -> tuple[int, ...]:
        """The DP index of every rank of ``bucket``'s group, as :meth:`DPProblem.dp_indices`."""
        return tuple(self.dp_index(bucket, r) for r in range(bucket.ranks))

    def tp_rank(self, bucket: BucketProblem, r: int) -> int | None:
        """As :meth:`DPProblem.tp_rank`."""
        buf = self.buffers[bucket.buffer]
        if buf.ep_rank is None or not buf.expert:
            return None
        return self.sizes.expert_place(buf.ep_rank, r)[1]

    def lower_bound(self) -> int:
        """max(⌈total / dp⌉, largest atomic item), as :meth:`DPProblem.lower_bound`."""
        largest = max((it.load for b in self.buckets for it in b.items if it.atomic), default=0)
        return max(-(-self.total // self.dp), largest)


def read_problem(plan: Plan, *, model: bool = False, config: Path | None = None) -> PlanProblem:
    """``plan`` read back as the problem it solves (:class:`PlanProblem`).

    Args:
        plan: a plan whose structure is checked (every slot's parameter has a task:
            :func:`canzona.planner.plan.structure.check_structure`, which loading runs).
        model: also rebuild the model (:func:`rebuild_model`) and the planner's problem of it.
        config: the Hugging Face ``config.json`` the plan was made from (with ``model``, for
            plans whose ``model_source`` is ``hf_config``).

    Raises:
        CanzonaError: with ``model``: see :func:`rebuild_model`.
    """
    inp = plan.inputs
    sizes, buckets, cuts, pairs = _read(plan)
    problem = ordered = None
    hw = recorded_hardware(plan)
    if model and inp.cost_model in COSTS and (hw is not None
                                              or inp.cost_model not in HARDWARE_COSTS):
        got = _MODELLED.get((plan,), config)
        if got is None:
            spec = rebuild_model(plan, config)
            if spec is not None:
                problem = make_problem(spec, sizes, inp.optimizer, cost=inp.cost_model,
                                       bucket_size=inp.bucket_size,
                                       overlap_grad_reduce=inp.bucket_size is not None,
                                       comm_dtype=inp.comm_dtype, hardware=hw)
                ordered = _in_plan_order(problem, plan)
            got = _MODELLED.put((plan,), config, (problem, ordered))
        problem, ordered = got  # problems are frozen: the same one again
    return PlanProblem(sizes, plan.buffers, tuple(buckets), cuts, pairs,
                       sum(it.load for b in buckets for it in b.items), problem, ordered)


def _read(plan: Plan) -> tuple[ParallelSizes, tuple[BucketProblem, ...], dict, dict]:
    """The sizes, buckets, cuts and DP pairs of ``plan`` (read once per plan: loading checks
    it, and ``inspect`` and ``compare`` read it again)."""
    got = _READ.get((plan,))
    if got is not None:
        sizes, buckets, cuts, pairs = got
        return sizes, buckets, dict(cuts), dict(pairs)  # each caller its own dicts
    inp = plan.inputs
    sizes = ParallelSizes(dp=inp.dp, tp=inp.tp, ep=inp.ep,
                          etp=None if inp.etp == inp.tp else inp.etp)
    tasks = plan.tasks
    tasks_of: dict[str, list[int]] = {}
    for t in tasks:
        tasks_of.setdefault(t.param, []).append(t.id)
    pairs = {x.id: x for x in plan.dp_shared}
    buckets = []
    for bi, buf in enumerate(plan.buffers):
        for b in buf.buckets:
            items: list[Item] = []
            for sl in b.slots:
                ids = tasks_of[sl.name]
                t0 = tasks[ids[0]]
                item = Item(len(items), sl.start, sl.end, sum(tasks[i].cost for i in ids),
                            sum(tasks[i].flops for i in ids),
                            sum(tasks[i].state_bytes for i in ids), t0.optimizer == "matrix",
                            tuple(ids))
                x = pairs.get(ids[0]) if len(ids) == 1 else None
                if x is None:
                    items.append(item)
                else:  # split over two DP indices: its two pieces
                    items.extend(pair_items(item, t0.shape, x.row, x.loads, x.flops,
                                            x.state_bytes, len(items)))
            buckets.append(BucketProblem(bi, b.index, b.start, b.end, buf.dp_size, tuple(items)))
    cuts = {(bi, b.index): b.cuts for bi, buf in enumerate(plan.buffers) for b in buf.buckets}
    _READ.put((plan,), None, (sizes, tuple(buckets), cuts, pairs))
    return sizes, tuple(buckets), dict(cuts), dict(pairs)


#: What :func:`_read` gave for the last plan (a plan is frozen).
_READ = Kept(1)
#: (problem, ordered) of the last plan whose model :func:`read_problem` rebuilt, by its config.
_MODELLED = Kept(1)


def recorded_hardware(plan: Plan) -> HardwareProfile | None:
    """The profile ``plan`` was made with (``plan.comm``), when it is a built-in one of the same
    version; None for a profile file's or an older revision's (a load priced on it cannot be
    recomputed here)."""
    name = plan.comm.hardware
    if name.lower() not in hardware_names():
        return None
    hw = load_hardware(name)
    return hw if hw.version == plan.comm.hardware_version else None


def rebuild_model(plan: Plan, config: Path | None = None) -> ModelSpec | None:
    """The inventory of the model ``plan`` was made for, checked against its fingerprint, under
    the naming it was made with (``inventory.NAMINGS``: Megatron's parameter names, with either
    expert module's, or the live ``transformers`` model's).

    Args:
        config: the Hugging Face ``config.json`` the plan was made from (plans whose
            ``model_source`` is ``hf_config`` only).

    Returns:
        None for a live module's plan (its model is not a preset or a config).

    Raises:
        CanzonaError: an ``hf_config`` plan without ``config``, or a model whose parameters do
            not match the plan's fingerprint.
    """
    inp = plan.inputs
    if inp.model_source == "module":
        return None
    if inp.model_source == "hf_config":
        if config is None:
            raise CanzonaError(f"this plan was made from a Hugging Face config (model "
                               f"'{inp.model}'); pass it again with {{inspect_report.config}} "
                               f"PATH.", fields=("inspect_report.config",))
        cfg = load_hf_config(config)
    else:
        cfg = get_preset(inp.model)
    st = inp.stage
    stage = None if st is None else Stage(pp=st.pp, stage=st.stage, first_layer=st.first_layer,
                                          layers=st.layers)

    def model(names: str = "megatron") -> ModelSpec:  # the plan's stage of it, if any
        whole = build_inventory(cfg, names=names)
        return whole if stage is None else stage_model(whole, stage)

    spec = model()
    for names, naming in NAMINGS.items():  # the naming the plan was made with
        if spec.fingerprint() == plan.fingerprint:
            break
        if naming.parallel or (inp.tp == 1 and inp.ep == 1):
            other = model(names)
            spec = other if other.fingerprint() == plan.fingerprint else spec
    if spec.fingerprint() != plan.fingerprint:
        src = f"config '{config}'" if inp.model_source == "hf_config" else f"model '{inp.model}'"
        raise CanzonaError(f"plan fingerprint {plan.fingerprint[:19]}… does not match {src} "
                           f"({spec.fingerprint()[:19]}…): the plan was made for other "
                           "parameters.")
    return spec


def _in_plan_order(problem: DPProblem, plan: Plan) -> DPProblem:
    """``problem`` (``make_problem`` of the plan's inputs) with every bucket's parameters in the
    plan's order and at its offsets, their items the model's."""
    buckets = []
    by_key = {(b.buffer, b.bucket): b for b in problem.buckets}
    for bi, buf in enumerate(plan.buffers):
        for bp in buf.buckets:
            old = by_key[(bi, bp.index)]
            by_name = {problem.tasks[it.tasks[0]].param: it for it in old.items}
            buckets.append(BucketProblem(bi, bp.index, bp.start, bp.end, old.ranks, tuple(
                dataclasses.replace(by_name[s.name], slot=k, start=s.start, end=s.end)
                for k, s in enumerate(bp.slots))))
    return dataclasses.replace(problem, buckets=tuple(buckets))
