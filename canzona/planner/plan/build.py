"""The one place a plan is assembled: :func:`build_plan` turns a problem, its cut points and
(tp > 1) its TP section (:mod:`canzona.planner.plan.tp_section`) into a
:class:`~canzona.planner.plan.schema.Plan`, with each bucket's collective method chosen by the
communication model and the plan's ``comm`` section (:mod:`canzona.planner.plan.comm_section`).
It writes the lowest schema version that holds the plan."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from .. import comm as comm_model
from ..hardware import DEFAULT_HARDWARE, HardwareProfile, load_hardware
from ..planning import Cuts, DPProblem, equal_cuts, evaluate, pair_owners, pair_phases
from ..stages import tied_name
from .comm_section import comm_section
from .compact import COMPACT_TASKS
from .schema import (BASE_VERSION, COMPACT_VERSION, DP_PAIR_VERSION, HEADS_VERSION,
                     PIPELINE_VERSION, RECIPE_VERSION, SUB_GROUP_VERSION, TP_PAIR_VERSION,
                     TP_SHARE_VERSION, BucketPlan, BufferPlan, Metrics, PairTaskPlan, Plan,
                     PlanInputs, RankLayout, SlotPlan, SolverOptions, StageInputs, TaskPlan,
                     TPPlan, record)

__all__ = ["baseline_plan", "build_plan"]


def build_plan(
    problem: DPProblem,
    cuts: Cuts,
    *,
    solver: SolverOptions,
    model_source: str = "preset",
    certified_bound: int | None = None,
    status: str = "n/a",
    split_mode: str = "owner",
    tp: TPPlan | None = None,
    placements: Mapping[int, tuple[int, int]] | None = None,
    hardware: HardwareProfile | None = None,
    validated: bool = True,
) -> Plan:
    """Assemble the plan file from a problem and its cut points (the one place a Plan is built).

    Args:
        tp: the plan's TP section (``plan.tp_section.tp_plan``), for tp > 1.
        placements: task id → (host TP rank, micro-group) of every TP-split matrix task.
        hardware: the profile whose communication model picks each bucket's collective method
            (None: the default, ``h100``).
        validated: False for a plan that is only simulated: its records are unvalidated
            namespaces (:func:`~canzona.planner.plan.schema.record`), and so must ``tp``'s be
            (``tp_plan(..., validated=False)``).
    """
    v = validated
    slot = _slot if v else lambda name, start, end: record(SlotPlan, v, name=name, start=start,
                                                            end=end)
    task = _task if v else _unvalidated_task
    ev = evaluate(problem, cuts, split_mode=split_mode)
    sizes = problem.sizes
    hw = hardware or load_hardware(DEFAULT_HARDWARE)
    _, link = comm_model.plan_link(hw, sizes.dp, sizes.tp)
    buffers = []
    slices: list[comm_model.BucketSlices] = []
    methods: list[str] = []
    for bi, buf in enumerate(problem.layout.buffers):
        buckets = []
        for b in buf.buckets:
            c = cuts[(bi, b.index)]
            sl = comm_model.BucketSlices(
                tuple(y - x for x, y in zip(c, c[1:])), comm_model.ELEMENT_BYTES[buf.grad_dtype],
                comm_model.ELEMENT_BYTES[buf.dtype],
                *comm_model.bucket_places(buf, len(c) - 1, ep=sizes.ep, tp=sizes.tp,
                                          etp=sizes.expert_tp))
            method = comm_model.choose(sl.sizes, grad_bytes=sl.grad_bytes,
                                       param_bytes=sl.param_bytes, link=link).method
            slices.append(sl)
            methods.append(method)
            buckets.append(record(
                BucketPlan, v, index=b.index, start=b.start, end=b.end,
                numel_unpadded=b.numel_unpadded, cuts=c,
                slots=tuple(slot(s.name, s.start, s.end) for s in b.slots), method=method))
        buckets = tuple(buckets)
        buffers.append(record(BufferPlan, v, key=buf.key, dtype=buf.dtype,
                              grad_dtype=buf.grad_dtype, expert=buf.expert, ep_rank=buf.ep_rank,
                              dp_size=buf.dp_size, buckets=buckets))
    tasks = tuple(
        task(t.id, t.param, t.part, t.shape, t.optimizer,
              ev.owners.get(t.id) if t.optimizer == "matrix" else None,
              problem.loads[t.id], c.flops, c.state_bytes, c.tp_comm_bytes,
              *(placements.get(t.id, (None, None)) if placements is not None else (None, None)))
        for t, c in zip(problem.tasks, problem.costs))
    lb = problem.lower_bound()
    bound = max(lb, certified_bound or 0)
    mean = sum(ev.load) / len(ev.load)
    metrics = Metrics(
        dp_load=ev.load, dp_flops=ev.flops, dp_state_bytes=ev.state_bytes,
        dp_reduce_scatter_bytes=ev.rs_bytes,
        max_over_mean=round(max(ev.load) / mean, 6) if mean else 1.0,
        lower_bound=lb, certified_bound=bound,
        gap_to_bound=round(max(ev.load) / bound - 1, 6) if bound else 0.0,
        split_matrices=ev.split_matrices, solver_status=status)
    inputs = PlanInputs(
        model=problem.spec.name, model_source=model_source,  # type: ignore[arg-type]
        dp=sizes.dp, tp=sizes.tp, ep=sizes.ep, etp=sizes.expert_tp, optimizer=problem.settings,
        cost_model=problem.cost_model, bucket_size=problem.layout.bucket_size,
        grad_dtype=problem.layout.buffers[0].grad_dtype if problem.layout.buffers else "fp32",
        comm_dtype=problem.comm_dtype, solver=solver, stage=_stage(problem))
    pairs = pair_owners(problem, cuts)
    # pieces that exchange Gram products meet in phases; block rows never wait for each other
    phases = pair_phases(pairs) if problem.settings.spec.gram_shared else {}
    dp_shared = tuple(
        record(PairTaskPlan, v, id=i, owners=pairs[i], phase=phases.get(pairs[i], 0), row=x.row,
                     split_poly=x.split_poly, loads=x.loads, flops=x.flops,
                     state_bytes=x.state_bytes(problem.costs[i].state_bytes,
                                               problem.tasks[i].shape[0] // sizes.tp),
                     modelled_s=round(x.alone_s, 9))
        for i, x in sorted(problem.pairs.items()))
    tp_shares = tp is not None and any(ix.shared for ix in tp.indices)
    version = (HEADS_VERSION if problem.settings.records_heads
               else RECIPE_VERSION if problem.settings.records_recipe
               else TP_PAIR_VERSION if dp_shared and sizes.tp > 1 else DP_PAIR_VERSION if dp_shared
               else TP_SHARE_VERSION if tp_shares else BASE_VERSION)
    if len(tasks) > COMPACT_TASKS:
        version = COMPACT_VERSION
    if inputs.stage is not None:
        version = PIPELINE_VERSION
    if tp is not None and any(x.sub is not None for ix in tp.indices for x in ix.shared):
        version = SUB_GROUP_VERSION
    return record(Plan, v, schema_version=version,
                  inputs=inputs, rank_layout=RankLayout(dp=sizes.dp, tp=sizes.tp),
                  fingerprint=problem.spec.fingerprint(), total_params=problem.spec.total_params,
                  buffers=tuple(buffers), tasks=tasks, metrics=metrics, tp=tp,
                  comm=comm_section(slices, methods, hw, dp=sizes.dp, tp=sizes.tp),
                  dp_shared=dp_shared)


def _stage(problem: DPProblem) -> StageInputs | None:
    """The pipeline stage the problem's model is (None: a whole model)."""
    st = problem.spec.stage
    if st is None or st.pp == 1:
        return None
    spec = problem.spec
    tied = (st.first or st.last) and tied_name(spec) is not None
    return StageInputs(pp=st.pp, stage=st.stage, first_layer=st.first_layer, layers=st.layers,
                       tied_copy=tied)


@lru_cache(maxsize=1 << 17)
def _task(id: int, param: str, part: str | None,  # noqa: A002
          shape: tuple[int, ...], optimizer: str, owner: int | None, cost: int, flops: int,
          state_bytes: int, tp_comm_bytes: int, host: int | None,
          micro_group: int | None) -> TaskPlan:
    """One task's record (validated once: the candidates a plan is judged against share most of
    their tasks, and a record is frozen)."""
    return TaskPlan(id=id, param=param, part=part, shape=shape,
                    optimizer=optimizer,  # type: ignore[arg-type]
                    owner=owner, host=host, micro_group=micro_group, cost=cost, flops=flops,
                    state_bytes=state_bytes, tp_comm_bytes=tp_comm_bytes)


def _unvalidated_task(id: int, param: str, part: str | None,  # noqa: A002
                      shape: tuple[int, ...], optimizer: str, owner: int | None, cost: int,
                      flops: int, state_bytes: int, tp_comm_bytes: int, host: int | None,
                      micro_group: int | None) -> Any:
    """:func:`_task`'s record unvalidated (``schema.record``)."""
    return record(TaskPlan, False, id=id, param=param, part=part, shape=shape,
                  optimizer=optimizer, owner=owner, host=host, micro_group=micro_group,
                  cost=cost, flops=flops, state_bytes=state_bytes, tp_comm_bytes=tp_comm_bytes)


@lru_cache(maxsize=1 << 17)
def _slot(name: str, start: int, end: int) -> SlotPlan:
    return SlotPlan(name=name, start=start, end=end)


def baseline_plan(problem: DPProblem, strategy: str = "asc", model_source: str = "preset") -> Plan:
    """ZeRO-1's equal cuts, charged as ``asc`` (owner = start rank) or ``zero1`` (fragments)."""
    if strategy not in ("asc", "zero1"):
        raise ValueError(f"strategy must be 'asc' or 'zero1', got {strategy!r}")
    cuts = {(b.buffer, b.bucket): equal_cuts(b) for b in problem.buckets}
    return build_plan(problem, cuts, solver=SolverOptions(strategy=strategy), status="baseline",
                      model_source=model_source,
                      split_mode="owner" if strategy == "asc" else "fragments")
