"""TP micro-group schedule: hosting, caps, split sizes, joint objective, plan section (no torch)."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner import (OptimizerSettings, OversizedTaskWarning, ParallelSizes,
                             build_inventory, get_preset)
from canzona.planner.dp import greedy
from canzona.planner.solve import solve
from canzona.planner.plan import SolverOptions
from canzona.planner.plan.load import parse_plan
from canzona.planner.plan.build import build_plan
from canzona.planner.plan.tp_section import placements, tp_plan
from canzona.planner.planning import equal_cuts, make_problem
from canzona.planner.tp import (MIB, TPContext, TPOptions, gpu_loads, index_gpu_max,
                                joint_refine, lb_gpu, schedule_tp)
from canzona.planner.strategies import tp_baseline_rows

_CACHE: dict = {}


def _problem(model="qwen3-0.6b", dp=4, tp=4, split=False):
    key = (model, dp, tp, split)
    if key not in _CACHE:
        s = OptimizerSettings(name="muon", split_qkv=split, split_gate_up=split)
        pr = make_problem(build_inventory(get_preset(model)), ParallelSizes(dp=dp, tp=tp), s)
        _CACHE[key] = (pr, greedy(pr), TPContext.build(pr))
    return _CACHE[key]


def _check(pr, ctx, sch, cap):
    hosted = {}
    for s in sch.indices:
        for g in s.groups:
            tp = len(g.gather_send)
            # Hosts are TP ranks; each rank's hosted full matrices fit the cap unless oversized.
            assert all(0 <= h < tp for h in g.hosts)
            if g.oversized:
                assert len(g.tasks) == 1 and ctx.gathered[g.tasks[0]] > cap
            else:
                assert g.peak_bytes <= cap
            for i, h in zip(g.tasks, g.hosts):
                assert i not in hosted, "a task is hosted twice"
                hosted[i] = (s.dp_index, h)
            # Both sides of the all-to-all agree and sum to the hosted matrices.
            recv = g.gather_recv
            for t in range(tp):
                for h in range(tp):
                    assert g.gather_send[t][h] == recv[h][t]
            for h in range(tp):
                want = sum(ctx.maps[ctx.layout[i]].full_numel
                           for i, hh in zip(g.tasks, g.hosts) if hh == h)
                assert sum(recv[h]) == want
            for t in range(tp):
                assert sum(g.gather_send[t]) == sum(ctx.maps[ctx.layout[i]].sent_numel(t)
                                                   for i in g.tasks)
    split = [t.id for t in pr.tasks if ctx.split[t.id]]
    assert sorted(hosted) == split, "every TP-split task is hosted exactly once"
    return hosted


@settings(max_examples=12, deadline=None)
@given(dp=st.sampled_from([2, 4]), tp=st.sampled_from([2, 4, 8]),
       cmax=st.sampled_from([1.0, 8.0, 40.0, 512.0]), split=st.booleans(),
       solver=st.sampled_from(["greedy", "cpsat"]))
def test_schedule_properties(dp, tp, cmax, split, solver):
    pr, cuts, ctx = _problem(dp=dp, tp=tp, split=split)
    ts = TPOptions(cmax_mib=cmax, solver=solver, group_time_limit_s=0.05, total_time_limit_s=0.5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sch = schedule_tp(pr, cuts, ts, ctx=ctx)
    hosted = _check(pr, ctx, sch, ts.cmax_bytes)
    owners = {t: d for t, (d, _) in hosted.items()}
    from canzona.planner.planning import evaluate

    ev = evaluate(pr, cuts)
    assert all(ev.owners[t] == d for t, d in owners.items()), "hosts live in the owner's TP group"
    over = [g for s in sch.indices for g in s.groups if g.oversized]
    assert bool(over) == any("exceed C_max" in str(x.message) for x in w)
    for g in over:
        assert pr.tasks[g.tasks[0]].name in sch.oversized
    # The grid adds up to the work every schedule must do, whatever the cuts (ZeRO-1's equal cuts
    # give the same total), and LB_gpu, computed without the schedule, bounds its maximum.
    grid = sch.grid()
    equal = {(b.buffer, b.bucket): equal_cuts(b) for b in pr.buckets}
    total = sum(map(sum, grid))
    # integer rounding: a unit per GPU, or a millionth (loads in ns: AdamW shares of a few units)
    slack = max(dp * tp, 1e-6 * total)
    assert abs(total - sum(map(sum, gpu_loads(pr, cuts, ctx=ctx)))) <= slack
    assert abs(total - sum(map(sum, gpu_loads(pr, equal, ctx=ctx)))) <= slack
    largest = max(pr.loads[t.id] for t in pr.tasks if t.optimizer == "matrix")
    assert max(max(r) for r in grid) >= largest - 1
    assert max(max(r) for r in grid) >= lb_gpu(pr, ctx=ctx) - 1


def test_oversized_task_warns_and_is_alone():
    pr, cuts, ctx = _problem()
    with pytest.warns(OversizedTaskWarning, match="exceed C_max"):
        sch = schedule_tp(pr, cuts, TPOptions(cmax_mib=0.5), ctx=ctx)
    assert sch.oversized
    _check(pr, ctx, sch, int(0.5 * MIB))


def test_greedy_hosting_is_lpt_and_matches_index_gpu_max():
    pr, cuts, ctx = _problem(dp=2, tp=4)
    with pytest.warns(OversizedTaskWarning, match="exceed C_max = 4 MiB"):
        sch = schedule_tp(pr, cuts, TPOptions(cmax_mib=4.0), ctx=ctx)
    # The rollback only closes groups; hosts are LPT's, so the DP side's fast view is exact.
    grid = sch.grid()
    fast = index_gpu_max(pr, cuts, ctx)
    assert [max(r) for r in grid] == pytest.approx(fast, abs=4)


def test_joint_refine_never_worse_and_keeps_matrices_whole():
    pr, cuts, ctx = _problem(dp=4, tp=4, split=True)
    new = joint_refine(pr, cuts, ctx=ctx)
    assert max(index_gpu_max(pr, new, ctx)) <= max(index_gpu_max(pr, cuts, ctx))
    from canzona.planner.planning import evaluate

    assert evaluate(pr, new).split_matrices == 0
    for b in pr.buckets:
        c = new[(b.buffer, b.bucket)]
        assert c[0] == b.start and c[-1] == b.end and list(c) == sorted(c)


def test_plan_section_round_trips_and_is_deterministic():
    pr, cuts, ctx = _problem(dp=2, tp=4)
    sol = solve(pr)
    sch = schedule_tp(pr, sol.cuts, TPOptions(cmax_mib=16.0, solver="cpsat",
                                               group_time_limit_s=0.05), ctx=ctx)

    def assemble(schedule, ctx=None):
        return build_plan(pr, sol.cuts, solver=SolverOptions(strategy="canzona"),
                          tp=tp_plan(pr, schedule, ctx), placements=placements(schedule))

    a = assemble(sch, ctx).to_json()
    sch2 = schedule_tp(pr, sol.cuts, TPOptions(cmax_mib=16.0, solver="cpsat",
                                                group_time_limit_s=0.05))
    assert assemble(sch2).to_json() == a
    p = parse_plan(a)
    assert p.tp is not None
    # LB_gpu as the plan records it: max(⌈mean of its per-GPU grid⌉, its largest matrix task).
    m = p.tp.metrics
    flat = [x for r in m.gpu_load for x in r]
    largest = max(t.cost for t in p.tasks if t.optimizer == "matrix")
    assert m.lb_gpu == max(-(-sum(flat) // len(flat)), largest) == lb_gpu(pr, ctx=ctx)
    assert m.gap_to_lb_gpu == round(m.max_gpu_load / m.lb_gpu - 1, 6)
    hosted = {t.id: (t.host, t.micro_group) for t in p.tasks if t.host is not None}
    for ix in p.tp.indices:
        for g in ix.groups:
            for gt in g.tasks:
                assert hosted[gt.id] == (gt.host, g.index)
            assert g.scatter_send == g.gather_recv and g.scatter_recv == g.gather_send
    rows = {r.name: r for r in tp_baseline_rows(pr, sol.cuts, schedule=sch, ctx=ctx)}
    assert rows["sc"].max_gpu_load >= rows["canzona"].max_gpu_load


@pytest.mark.parametrize("field,value,says", [
    ("cmax_mib", 0, "must be a positive number of MiB, got 0"),
    ("cmax_mib", float("inf"), "must be a positive number of MiB"),
    ("solver", "magic", "must be one of: greedy, cpsat; got 'magic'"),
    ("group_time_limit_s", -1.0, "must be a positive number of seconds"),
    ("comm_dtype", "int8", "must be one of: bf16, fp16, fp32"),
])
def test_tp_options_name_the_field(field, value, says):
    from canzona.planner import OptionError

    with pytest.raises(OptionError) as info:
        TPOptions(**{field: value})
    assert str(info.value).startswith(f"TPOptions.{field} ") and says in str(info.value)
