"""The step simulator (:mod:`canzona.planner.simulate`) and ``canzona simulate``."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from functools import lru_cache
from pathlib import Path

import pytest
from planner_helpers import scaled_hardware

from canzona.planner import DPOptions, ParallelSizes, TPOptions
from canzona.planner.pipeline import plan as plan_model
from canzona.planner.comm import bucket_comm, plan_link
from canzona.planner.plan.comm_section import plan_summary
from canzona.planner.hardware import LinkProfile, load_hardware
from canzona.planner.plan.load import parse_plan
from canzona.planner.errors import CanzonaError
from canzona.planner.simulate import (BucketWork, GroupWork, RankWork, Workload,
                                      iteration_time, plan_hardware, simulate, simulate_plan,
                                      split_forward_backward, workload_from_plan)
from canzona.planner.simulate.from_plan import _a2a

PLANS = sorted((Path(__file__).parents[3] / "plans").glob("*.plan.json"))
SMALL = next(p for p in PLANS if p.name == "qwen3-1.7b-dp16-tp8-muon.plan.json")
BIG = next(p for p in PLANS if p.name == "qwen3-32b-dp32-tp8-muon.plan.json")


@lru_cache(maxsize=None)
def _plan(path: Path):
    return parse_plan(path.read_text(encoding="utf-8"))


def _work(dp=1, tp=1, ranks=None, buckets=(), groups=()):
    return Workload(dp, tp, tuple(ranks or [RankWork()] * (dp * tp)), tuple(buckets),
                    tuple(groups))


# --- invariants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [SMALL, BIG], ids=lambda p: p.name)
@pytest.mark.parametrize("backward", [0.0, 0.5])
def test_time_never_decreases_with_less_bandwidth_or_more_flops(path, backward):
    plan, hw = _plan(path), load_hardware("h800")
    base = simulate_plan(plan, hw, backward_s=backward)
    for kw in ({"intra": 2.0}, {"inter": 2.0}, {"latency": 3.0}, {"flops": 2.0},
               {"memory": 100.0}, {"intra": 1.5, "inter": 1.5, "flops": 1.5}):
        worse = simulate_plan(plan, scaled_hardware(hw, **kw), backward_s=backward)
        assert worse.step_s >= base.step_s - 1e-12, kw
        assert all(w.done >= b.done - 1e-12 for w, b in zip(worse.ranks, base.ranks)), kw
        assert worse.params_ready >= base.params_ready - 1e-12


def test_time_never_decreases_when_plain_flops_grow():
    groups = ((GroupWork(0.1, 0.1, (0.3, 0.2)), GroupWork(0.2, 0.05, (0.1, 0.4))),
              (GroupWork(0.05, 0.05, (0.2, 0.2)),))
    ranks = [RankWork(0.1, 0.02), RankWork(0.0, 0.02), RankWork(0.3, 0.01), RankWork(0, 0)]
    buckets = [BucketWork("a", 0.4, (0, 1), 0.2, 0.1), BucketWork("b", 1.0, (0, 1), 0.3, 0.2)]
    base = simulate(_work(2, 2, ranks, buckets, groups), backward_s=0.6)
    for f in (1.01, 1.5, 3.0):
        g2 = tuple(tuple(dataclasses.replace(g, compute_s=tuple(c * f for c in g.compute_s))
                         for g in gs) for gs in groups)
        r2 = [dataclasses.replace(r, matrix_s=r.matrix_s * f, adamw_s=r.adamw_s * f)
              for r in ranks]
        assert simulate(_work(2, 2, r2, buckets, g2), backward_s=0.6).step_s >= base.step_s


def test_all_work_on_one_rank_predicts_that_ranks_compute():
    ranks = [RankWork()] * 4
    ranks[2] = RankWork(matrix_s=1.25, adamw_s=0.5)
    s = simulate(_work(4, 1, ranks, [BucketWork("0", 1.0, (0, 1, 2, 3), 0.0, 0.0)]))
    assert s.step_s == pytest.approx(1.75)
    assert s.critical_rank == 2
    assert s.breakdown() == pytest.approx({"compute": 1.75, "tp_gather_scatter": 0.0,
                                           "dp_reduce": 0.0, "dp_gather": 0.0})
    # The same under TP: one micro-group whose only work is on TP rank 1 of DP index 0.
    g = GroupWork(0.0, 0.0, (0.0, 2.0, 0.0))
    s = simulate(_work(1, 3, None, (), ((g,),)))
    assert s.step_s == pytest.approx(2.0) and s.critical_rank == 1
    assert s.breakdown()["compute"] == pytest.approx(2.0)


# --- α–β pieces and the timeline by hand ---------------------------------------------------------


def test_alpha_beta_pieces_by_hand():
    link = LinkProfile(busbw=1e9, latency_s=1e-5)
    # all-to-all [src][dst] elements, bf16, off-rank: rank 0 sends 10 and receives 50, rank 1
    # sends 60 and receives 30, rank 2 sends 50 and receives 40: the busiest moves 60 el.
    m = ((0, 10, 0), (20, 0, 40), (30, 20, 0))
    s, b = _a2a(m, 2, link)
    assert b == 120
    assert s == pytest.approx(1e-5 + 120 / 1e9)
    assert _a2a(((5, 0), (0, 7)), 2, link) == (0.0, 0)  # only local copies: free
    # ring reduce-scatter of 4 slices of 100 fp32 elements: 3 · 100 · 4 bytes through each rank.
    c = bucket_comm("equal", (100,) * 4, grad_bytes=4, param_bytes=2, link=link)
    assert c.reduce.seconds(link) == pytest.approx(1e-5 + 1200 / 1e9)
    assert c.gather.seconds(link) == pytest.approx(1e-5 + 600 / 1e9)


def test_pipeline_and_backward_overlap_by_hand():
    # Two groups: gathers 1, 2; compute 3, 1 (one TP rank busy); scatters 1, 2.
    #   g0 gather [0, 1]; g0 compute [1, 4]; g1 gather issued at 1 → [1, 3];
    #   g0 scatter [4, 5]; g1 compute [4, 5]; g1 scatter [5, 7].
    groups = ((GroupWork(1.0, 1.0, (3.0, 0.0)), GroupWork(2.0, 2.0, (1.0, 0.0))),)
    s = simulate(_work(1, 2, None, (), groups))
    r0 = s.ranks[0]
    assert [(x.name, x.start, x.end) for x in r0.stages] == [
        ("gather g0", 0.0, 1.0), ("compute g0", 1.0, 4.0), ("scatter g0", 4.0, 5.0),
        ("gather g1", 1.0, 3.0), ("compute g1", 4.0, 5.0), ("scatter g1", 5.0, 7.0)]
    assert s.step_s == pytest.approx(7.0)
    assert s.breakdown()["compute"] == pytest.approx(4.0)
    assert s.breakdown()["tp_gather_scatter"] == pytest.approx(3.0)
    # Backward of 10 s; buckets ready at half-way and at the end; reduces 3 and 4; gathers 2, 1.
    b = [BucketWork("x", 0.5, (0, 1), 3.0, 2.0), BucketWork("y", 1.0, (0, 1), 4.0, 1.0)]
    s = simulate(_work(2, 1, [RankWork(0.5), RankWork()], b), backward_s=10.0)
    assert [(x.start, x.end) for x in s.reduces] == [(5.0, 8.0), (10.0, 14.0)]
    # The step starts at 14, rank 0 computes until 14.5; all-gathers y then x (forward order).
    assert [(x.start, x.end) for x in s.gathers[0]] == [(14.5, 15.5), (15.5, 17.5)]
    assert s.step_s == pytest.approx(7.5)
    assert s.breakdown() == pytest.approx({"compute": 0.5, "tp_gather_scatter": 0.0,
                                           "dp_reduce": 4.0, "dp_gather": 3.0})
    assert s.hidden()["dp_reduce_behind_backward"] == pytest.approx(3.0)
    # The all-gathers into the next forward: 1 s of forward hides 1 s of them.
    o = simulate(_work(2, 1, [RankWork(0.5), RankWork()], b), backward_s=10.0,
                 overlap_param_gather=True, forward_s=1.0)
    assert o.step_s == pytest.approx(6.5)
    fb = 15.0
    fwd, bwd = split_forward_backward(fb)
    assert (fwd, bwd) == (5.0, 10.0)
    assert iteration_time(fb, s) == pytest.approx(22.5)


def test_disjoint_groups_run_in_parallel_and_rank_timeline():
    # Expert buckets: DP index 0 and 1 each join their own; a dense bucket joins both.
    b = [BucketWork("e0", 1.0, (0,), 1.0, 0.5), BucketWork("e1", 1.0, (1,), 2.0, 0.5),
         BucketWork("dense", 1.0, (0, 1), 1.0, 1.0)]
    s = simulate(_work(2, 1, [RankWork(0.25), RankWork(0.25)], b))
    assert [(x.start, x.end) for x in s.reduces] == [(0.0, 1.0), (0.0, 2.0), (2.0, 3.0)]
    assert s.dp_reduce_total == pytest.approx(3.0)  # DP index 1: 2 + 1
    assert s.dp_gather_total == pytest.approx(1.5)
    # Both start at 3 (dense waits for e1), compute to 3.25; gathers dense, then e0 / e1.
    assert [(x.name, x.start, x.end) for x in s.gathers[0]] == [
        ("gather dense", 3.25, 4.25), ("gather e1", 4.25, 4.75), ("gather e0", 4.25, 4.75)]
    tl = s.rank_timeline(0)
    assert [x.name for x in tl] == ["reduce e0", "wait reduces", "reduce dense", "matrices",
                                    "gather dense", "gather e0"]
    assert s.step_s == pytest.approx(4.75)


def test_plan_hardware():
    plan = _plan(SMALL)
    assert plan_hardware(plan).name == plan.comm.hardware
    assert plan_hardware(plan, "h800").name == "h800"
    other = plan.model_copy(update={"comm": plan.comm.model_copy(update={"hardware": "mine"})})
    with pytest.raises(CanzonaError, match="made with hardware profile 'mine'"):
        plan_hardware(other)
    with pytest.raises(CanzonaError, match="unknown hardware profile"):
        plan_hardware(plan, "h900")


def test_bad_workload_is_refused():
    with pytest.raises(ValueError):
        _work(2, 2, [RankWork()] * 3)
    with pytest.raises(ValueError):
        _work(1, 1, None, [BucketWork("z", 1.5, (0,), 0.0, 0.0)])
    with pytest.raises(ValueError):
        simulate(_work(), backward_s=-1.0)


# --- against the plans and the communication model -----------------------------------------------


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_every_plan_simulates_deterministically(path):
    plan = _plan(path)
    hw = load_hardware(plan.comm.hardware)
    a = json.dumps(simulate_plan(plan, hw).to_dict(), sort_keys=True)
    b = json.dumps(simulate_plan(parse_plan(path.read_text(encoding="utf-8")), hw).to_dict(),
                   sort_keys=True)
    assert a == b
    d = json.loads(a)
    assert math.isfinite(d["step_s"]) and d["step_s"] > 0
    assert sum(d["breakdown"].values()) == pytest.approx(d["step_s"], abs=1e-8)
    assert all(v >= -1e-9 for v in d["breakdown"].values())


@pytest.mark.parametrize("path", [SMALL, BIG], ids=lambda p: p.name)
@pytest.mark.parametrize("hardware", ["h100", "h800"])
def test_dp_collectives_equal_the_comm_model_where_nothing_overlaps(path, hardware):
    plan, hw = _plan(path), load_hardware(hardware)
    _, link = plan_link(hw, plan.inputs.dp, plan.inputs.tp)
    s = simulate_plan(plan, hw)  # no backward: nothing hides the reduces
    assert s.dp_reduce_total + s.dp_gather_total == pytest.approx(
        plan_summary(plan, link).seconds, rel=1e-12)
    assert s.breakdown()["dp_reduce"] == pytest.approx(s.dp_reduce_total, rel=1e-12)
    if hardware == plan.comm.hardware:
        assert s.dp_reduce_total + s.dp_gather_total == pytest.approx(plan.comm.predicted_s,
                                                                      abs=1e-9)


#: The stages of a micro-group (the shared phase is group 0 of an index that shares).
GROUP_STAGE = re.compile(r"(gather|compute|scatter) g\d+$")


@lru_cache(maxsize=None)
def _roofline_plan(model: str, dp: int, tp: int):
    return plan_model(model, ParallelSizes(dp=dp, tp=tp), dp_options=DPOptions(cost="roofline"))


@pytest.mark.parametrize("config", [("qwen3-1.7b", 16, 8), ("qwen3-32b", 32, 8)],
                         ids=lambda c: f"{c[0]}-dp{c[1]}-tp{c[2]}")
def test_tp_pipeline_matches_the_plans_modelled_timeline(config):
    """Under the roofline cost the planner's TP timeline and the simulator's are one model."""
    plan = _roofline_plan(*config)
    s = simulate_plan(plan, load_hardware(plan.tp.hardware))
    for ix in plan.tp.indices:
        spans = [r.span for r in s.ranks if r.dp_index == ix.dp_index]
        # Local work (AdamW, replicated matrices) runs after the groups, so the rank spans are at
        # least the group makespan; the groups alone are never slower than the planner's model.
        group_end = max(st.end for r in s.ranks if r.dp_index == ix.dp_index
                        for st in r.stages if GROUP_STAGE.match(st.name)) - s.ranks[0].step_start
        assert group_end <= ix.modelled_s + 1e-9
        assert group_end == pytest.approx(ix.modelled_s, rel=1e-6)
        assert max(spans) >= group_end - 1e-12


def test_adapter_puts_every_flop_somewhere():
    # whole matrices: every task's FLOPs in its group (a shared one's pieces do more)
    plan = plan_model("qwen3-1.7b", ParallelSizes(dp=16, tp=8), tp_options=TPOptions(share="off"))
    hw = load_hardware("h100")
    w = workload_from_plan(plan, hw)
    slow = workload_from_plan(plan, scaled_hardware(hw, memory=1000.0))  # AdamW now memory-bound
    assert all(b.adamw_s >= a.adamw_s for a, b in zip(w.ranks, slow.ranks))
    assert max(b.adamw_s for b in slow.ranks) > max(a.adamw_s for a in w.ranks)
    grouped = sum(sum(g.flops) for gs in w.groups for g in gs)
    in_groups = {gt.id for ix in plan.tp.indices for g in ix.groups for gt in g.tasks}
    assert grouped == sum(t.flops for t in plan.tasks if t.id in in_groups)
    assert sum(r.adamw_flops for r in w.ranks) >= sum(t.flops for t in plan.tasks
                                                     if t.owner is None)


# --- the command ---------------------------------------------------------------------------------


def test_cli_simulate_table_json_and_errors(tmp_path):
    from typer.testing import CliRunner

    from canzona.cli.main import app

    run = CliRunner().invoke
    r = run(app, ["simulate", str(SMALL), "--hardware", "h800", "--top", "3"])
    assert r.exit_code == 0, r.output
    assert "Critical path" in r.stdout and "critical rank" in r.stdout and "h800" in r.stdout
    r1 = run(app, ["simulate", str(SMALL), "--json"])
    r2 = run(app, ["simulate", str(SMALL), "--json"])
    assert r1.exit_code == 0 and r1.stdout == r2.stdout
    d = json.loads(r1.stdout)
    assert d["hardware"]["name"] == _plan(SMALL).comm.hardware
    assert set(d["simulation"]["breakdown"]) == {"compute", "tp_gather_scatter", "dp_reduce",
                                                 "dp_gather"}
    assert len(d["simulation"]["ranks"]) == 16 * 8
    for args, words in ((["simulate", str(tmp_path / "none.json")], "cannot read plan"),
                        (["simulate", str(SMALL), "--hardware", "h900"], "unknown hardware"),
                        (["simulate", str(Path(__file__))], "not a plan file")):
        r = run(app, args)
        assert r.exit_code == 1 and words in r.output and len(r.output.strip().splitlines()) == 1
