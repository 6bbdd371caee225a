"""Into the plan: the plan's TP section (:func:`tp_plan`) and every task's host and micro-group
(:func:`placements`), which :func:`canzona.planner.plan.build.build_plan` writes into the plan in
one step."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..cost import DTYPE_BYTES
from ..planning import DPProblem
from ..tp.context import TPContext, lb_gpu
from ..tp.schedule import SharedRun, TPSchedule
from .schema import (GroupTaskPlan, MicroGroupPlan, ShardLayoutPlan, SharedTaskPlan, SubGroupPlan,
                     TPIndexPlan,
                     TPMetrics, TPPlan, record)


def tp_plan(problem: DPProblem, schedule: TPSchedule, ctx: TPContext | None = None, *,
            validated: bool = True) -> TPPlan:
    """The plan's TP section: layouts, groups with hosts and split sizes, per-GPU metrics
    (``validated`` False: for a plan only simulated, its records unvalidated namespaces,
    ``schema.record``)."""
    v = validated
    group_task = _group_task if v else _unvalidated_group_task
    ctx = ctx or TPContext.build(problem, schedule.comm_dtype)
    nbytes = DTYPE_BYTES[schedule.comm_dtype]
    used = sorted({ctx.layout[i] for s in schedule.indices for g in s.groups for i in g.tasks}
                  | {ctx.layout[x.task] for s in schedule.indices for x in s.shared})
    remap = {k: j for j, k in enumerate(used)}
    layouts = tuple(record(ShardLayoutPlan, v, dim=ctx.maps[k].dim,
                           local_shape=ctx.maps[k].local_shape,
                           full_shape=ctx.maps[k].full_shape,
                           segments=tuple((s.rank, s.local_start, s.full_start, s.length)
                                          for s in ctx.maps[k].segments))
                    for k in used)
    indices = []
    a2a = [[0] * problem.sizes.tp for _ in range(problem.dp)]
    for s in schedule.indices:
        groups = []
        for gi, g in enumerate(s.groups):
            tp = len(g.gather_send)
            recv = g.gather_recv
            for t in range(tp):
                off = sum(g.gather_send[t][h] + recv[t][h] for h in range(tp) if h != t)
                a2a[s.dp_index][t] += 2 * off * nbytes  # gather and scatter
            groups.append(record(
                MicroGroupPlan, v, index=gi,
                tasks=tuple(group_task(i, h, remap[ctx.layout[i]], problem.loads[i],
                                        ctx.gathered[i]) for i, h in zip(g.tasks, g.hosts)),
                peak_gathered_bytes=g.peak_bytes, rank_load=g.rank_load,
                gather_send=g.gather_send, gather_recv=recv,
                scatter_send=recv, scatter_recv=g.gather_send, oversized=g.oversized,
                timeline_s=s.timeline[gi]))
        shared = tuple(record(SharedTaskPlan, v, id=x.task, layout=remap[ctx.layout[x.task]],
                              split_poly=x.split_poly, load=int(round(x.load)),
                              modelled_s=round(x.seconds, 9), partner=x.partner,
                              sub=_sub(x, s.shared, v))
                       for x in s.shared)
        # (each task's load and seconds alone; local_load holds the group's lockstep phase)
        indices.append(record(TPIndexPlan, v, dp_index=s.dp_index,
                              local_load=tuple(int(round(x)) for x in s.base),
                              groups=tuple(groups), modelled_s=round(s.makespan_s, 9),
                              shared=shared, shared_load=int(round(s.shared_load))))
    grid = schedule.grid()
    flat = [x for r in grid for x in r]
    mx, mean = max(flat), sum(flat) / len(flat)
    lb = lb_gpu(problem, grid)
    peak = max((g.peak_bytes for s in schedule.indices for g in s.groups), default=0)
    metrics = TPMetrics(
        gpu_load=tuple(tuple(r) for r in grid), max_gpu_load=mx, mean_gpu_load=round(mean, 3),
        max_over_mean=round(mx / mean, 6) if mean else 1.0, lb_gpu=lb,
        gap_to_lb_gpu=round(mx / lb - 1, 6) if lb else 0.0,
        micro_groups=sum(len(s.groups) for s in schedule.indices),
        peak_gathered_bytes=peak, oversized_tasks=schedule.oversized,
        all_to_all_bytes=tuple(tuple(r) for r in a2a),
        modelled_step_s=round(max((s.makespan_s for s in schedule.indices), default=0.0), 9))
    st = schedule.options
    # ``share`` is written only when a task is shared: a plan sharing nothing records "off", as
    # it reads back
    share = st.share if any(ix.shared for ix in indices) else "off"
    return record(TPPlan, v, cmax_bytes=st.cmax_bytes, comm_dtype=schedule.comm_dtype,
                  solver=st.solver, status=schedule.status, hardware=st.hardware,
                  layouts=layouts, indices=tuple(indices), metrics=metrics, share=share)


def _sub(x: SharedRun, runs: tuple[SharedRun, ...], v: bool) -> Any:
    """Run ``x``'s record of its round of TP sub-groups (k, the round's place among the index's
    rounds, its slot), or None outside one."""
    r = x.round
    if r is None:
        return None
    firsts = [y.task for y in runs if y.round is not None and y.task == y.round.tasks[0]]
    return record(SubGroupPlan, v, k=r.k, round=firsts.index(r.tasks[0]),
                  slot=r.tasks.index(x.task))


@lru_cache(maxsize=1 << 17)
def _group_task(i: int, host: int, layout: int, load: int, gathered: int) -> GroupTaskPlan:
    """One hosted task's record (validated once: the plans a candidate is judged against host
    most tasks alike, and a record is frozen)."""
    return GroupTaskPlan(id=i, host=host, layout=layout, load=load, gathered_bytes=gathered)


def _unvalidated_group_task(i: int, host: int, layout: int, load: int, gathered: int) -> Any:
    """:func:`_group_task`'s record unvalidated (``schema.record``)."""
    return record(GroupTaskPlan, False, id=i, host=host, layout=layout, load=load,
                  gathered_bytes=gathered)


def placements(schedule: TPSchedule) -> dict[int, tuple[int, int]]:
    """Task id → (host TP rank, micro-group index) of every TP-split matrix task."""
    return {i: (h, gi) for s in schedule.indices for gi, g in enumerate(s.groups)
            for i, h in zip(g.tasks, g.hosts)}
