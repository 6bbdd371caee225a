"""TP sub-groups placed: rounds of tp/k alike matrices on one DP index, one lockstep piece per
TP rank (the plan's ``SharedTaskPlan.sub``), the checks that refuse a malformed round, the
simulator and the schedule pricing a round alike, the pattern model's floor under every plan,
and llama3-70b dp256 tp8 under 1.5× the mean useful work on the H800 profile."""

from __future__ import annotations

import pytest

from canzona.planner.hardware import load_hardware
from canzona.planner.layout import ParallelSizes
from canzona.planner.options import DPOptions, TPOptions
from canzona.planner.stages import StageSplit


def _plan(model: str, dp: int, tp: int, share: str, hardware: str = "h100", cost=None):
    from canzona.planner.pipeline import plan

    o = DPOptions() if cost is None else DPOptions(cost=cost)
    return plan(model, ParallelSizes(dp=dp, tp=tp), dp_options=o,
                tp_options=TPOptions(share=share, hardware=hardware))


@pytest.fixture(scope="module")
def sub_plan():
    """qwen3-0.6b dp 4 × tp 4 with every class of alike matrices in rounds (k = 2)."""
    return _plan("qwen3-0.6b", 4, 4, "sub-groups")


def _rounds(plan):
    """Per (DP index, round): its tasks' (id, slot, k) in plan order."""
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for ix in plan.tp.indices:
        for x in ix.shared:
            if x.sub is not None:
                out.setdefault((ix.dp_index, x.sub.round), []).append((x.id, x.sub.slot,
                                                                       x.sub.k))
    return out


def test_share_sub_groups_puts_each_round_on_one_index_in_slot_order(sub_plan):
    from canzona.planner.plan import SUB_GROUP_VERSION
    from canzona.planner.plan.load import parse_plan

    p = sub_plan
    assert p.schema_version == SUB_GROUP_VERSION and p.sub_groups
    rounds = _rounds(p)
    assert rounds
    tp = p.inputs.tp
    for (d, r), members in rounds.items():
        k = members[0][2]
        assert [s for _, s, _ in members] == list(range(tp // k))  # full, in slot order
        assert {p.tasks[i].shape for i, _, _ in members} == {p.tasks[members[0][0]].shape}
        assert all(p.tasks[i].owner == d and p.tasks[i].host is None for i, _, _ in members)
    for ix in p.tp.indices:  # rounds numbered in plan order, members consecutive
        subs = [x.sub for x in ix.shared if x.sub is not None]
        assert [s.round for s in subs] == sorted(s.round for s in subs)
        heads = [s for s in subs if s.slot == 0]
        assert [s.round for s in heads] == list(range(len(heads)))
    assert parse_plan(p.to_json()).to_json() == p.to_json()


def test_a_round_is_one_lockstep_piece_in_the_schedule_and_the_simulator(sub_plan):
    """An index's shared phase as the planner scheduled it (``modelled_s``: the index's
    makespan, its shared phase first) and as the simulator rebuilds it from the plan file: one
    ``tp_sub_piece`` per round, not one per matrix."""
    from canzona.planner.simulate import workload_from_plan

    p = sub_plan
    w = workload_from_plan(p, load_hardware("h100"))
    for ix, groups in zip(p.tp.indices, w.groups):
        if not ix.shared or ix.groups:
            continue
        first = groups[0]
        assert first.barrier
        phase = first.scatter_s + first.compute_s[0]
        assert phase == pytest.approx(ix.modelled_s, rel=1e-6)


def test_the_pattern_floor_lies_under_every_plan():
    """The certified floor with any sharing option (layout-free pattern model) is at most the
    busiest GPU of the plans every share mode makes, and above nothing."""
    from canzona.planner.plan.inverse import read_problem
    from canzona.planner.sharing import pattern_bound

    hw = load_hardware("h800")
    plans = {s: _plan("qwen3-0.6b", 8, 4, s, "h800", cost="flops")
             for s in ("off", "all", "all-split", "pairs", "sub-groups", "auto")}
    top = min(p.tp.metrics.max_gpu_load for p in plans.values())  # below every plan
    problem = read_problem(plans["off"], model=True).problem
    got = pattern_bound(problem, hw, top)
    assert got is not None and got.bound > 0
    for share, p in plans.items():
        assert got.bound <= p.tp.metrics.max_gpu_load, share
    assert plans["sub-groups"].sub_groups and not plans["pairs"].sub_groups


def test_edited_sub_group_plans_are_refused(sub_plan, refused_edit):
    p = sub_plan

    def subs(d):
        return [x for ix in d["tp"]["indices"] for x in ix.get("shared", ()) if "sub" in x]

    def version(d):
        d["schema_version"] = 9

    def slot(d):  # two members claiming slot 0
        subs(d)[1]["sub"]["slot"] = 0

    def k(d):  # a size that does not divide tp
        for x in subs(d):
            x["sub"]["k"] = 3

    def lone(d):  # a round missing a member
        for ix in d["tp"]["indices"]:
            got = [x for x in ix.get("shared", ()) if "sub" in x]
            if got:
                del got[-1]["sub"]
                return

    def number(d):  # rounds numbered out of plan order
        for ix in d["tp"]["indices"]:
            for x in ix.get("shared", ()):
                if "sub" in x:
                    x["sub"]["round"] += 1

    def load(d):
        subs(d)[0]["load"] = 0

    for change, field in ((version, "schema_version"), (slot, ".sub"), (k, ".sub.k"),
                          (lone, ".sub"), (number, ".sub"), (load, ".load")):
        msg = refused_edit(p, change)
        assert field in msg, (field, msg)


def test_share_sub_groups_says_what_it_needs():
    from canzona.planner.errors import CanzonaError
    from canzona.planner.pipeline import plan

    with pytest.raises(CanzonaError, match=r"4 ranks or more \(tp is 2\)"):
        _plan("qwen3-0.6b", 4, 2, "sub-groups")
    with pytest.raises(CanzonaError, match="shampoo does not"):
        plan("qwen3-0.6b", ParallelSizes(dp=4, tp=4), "shampoo",
             tp_options=TPOptions(share="sub-groups"))
    with pytest.raises(CanzonaError, match="drop --no-reorder"):
        plan("qwen3-0.6b", ParallelSizes(dp=4, tp=4), dp_options=DPOptions(reorder=False),
             tp_options=TPOptions(share="sub-groups"))
    with pytest.raises(CanzonaError, match="without pipeline stages"):
        plan("qwen3-0.6b", ParallelSizes(dp=4, tp=4), stages=StageSplit(pp=2),
             tp_options=TPOptions(share="sub-groups"))


def test_pipeline_stages_place_no_round():
    """The runtime creates sub-groups over the whole world, which a pipeline's stages share:
    ``auto`` places none in a stage's plan."""
    from canzona.planner.pipeline import plan

    p = plan("qwen3-1.7b", ParallelSizes(dp=16, tp=8), stages=StageSplit(pp=2))
    assert not any(s.sub_groups for s in p.stages)


def test_llama3_70b_dp256_tp8_reaches_under_one_and_a_half_on_h800():
    """The at-scale figure: with TP sub-groups placed (the pattern model's start, then the TP
    search), the busiest GPU of llama3-70b dp256 tp8 on the H800 profile is under 1.5× the
    mean useful work (1.540 with TP groups and TP pairs alone), and above the certified
    floor."""
    from canzona.planner.plan.inverse import read_problem
    from canzona.planner.sharing import pattern_bound
    from canzona.planner.sharing.bound import _useful_total

    p = _plan("llama3-70b", 256, 8, "auto", "h800", cost="flops")
    problem = read_problem(p, model=True).problem
    mean = _useful_total(problem) / (256 * 8)
    assert p.sub_groups
    busiest = p.tp.metrics.max_gpu_load
    assert busiest / mean <= 1.5
    floor = pattern_bound(problem, load_hardware("h800"), busiest)
    assert floor is not None and floor.bound <= busiest


def test_a_moe_model_plans_without_rounds():
    """Expert buffers are laid out by the partition, never by the TP search: ``auto`` places no
    round in a MoE model at tp ≥ 4 (and plans it)."""
    from canzona.planner.pipeline import plan

    p = plan("qwen3-30b-a3b", ParallelSizes(dp=32, tp=4, ep=8))
    assert p.tp is not None and not p.sub_groups


def test_a_truncated_pattern_list_is_no_list(monkeypatch):
    """Past the pattern limit the enumeration gives None (no start, no floor): a partial list
    could prove reachable ceilings unreachable."""
    from canzona.planner.sharing import patterns

    # a first kind heavier than the ceiling: the limit is met below it, and nothing after
    heavy = patterns.Kind(0, "host", 1, 1, None, hosted=1000.0)
    kinds = [heavy] + [patterns.Kind(c, "tp", 1, 1, (0, 1.0, 1.0, 1.0, 0, 0.0))
                       for c in range(1, 4)]
    counts = [4, 4, 4, 4]
    everything = patterns.enumerate_patterns(kinds, counts, 100.0,
                                             patterns.relaxed_load(kinds), None)
    assert everything is not None and len(everything) == 5 ** 3 - 1
    monkeypatch.setattr(patterns, "PATTERN_LIMIT", 50)
    assert patterns.enumerate_patterns(kinds, counts, 100.0, patterns.relaxed_load(kinds),
                                       None) is None


def test_inspect_reports_the_floor_or_why_not(monkeypatch):
    """``inspect``'s report holds the floor beside the plan's busiest GPU, or says why it is
    not computed (too many patterns under it), never a floor from a partial enumeration."""
    from canzona.planner.report import inspect_report
    from canzona.planner.sharing import patterns

    p = _plan("qwen3-0.6b", 8, 4, "auto", "h800", cost="flops")
    got = inspect_report(p)["sharing"]["pattern"]
    assert 0 < got["bound"] <= got["plan"] == p.tp.metrics.max_gpu_load
    monkeypatch.setattr(patterns, "PATTERN_LIMIT", 5)
    assert "patterns" in inspect_report(p)["sharing"]["pattern"]["unavailable"]
