"""Strategies side by side (:mod:`canzona.planner.strategies`): workloads and ``compare``."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import pytest
from planner_helpers import scaled_hardware

from canzona.planner import ParallelSizes
from canzona.planner.comm import ELEMENT_BYTES
from canzona.planner.cost import Roofline
from canzona.planner.hardware import load_hardware
from canzona.planner.inventory import build_inventory
from canzona.planner.models import get_preset
from canzona.planner.plan.load import parse_plan
from canzona.planner.planning import make_problem
from canzona.planner.settings import OptimizerSettings
from canzona.planner.simulate import (BucketWork, GroupWork, RankWork, Workload, simulate,
                                      split_forward_backward)
from canzona.planner.baselines import layerwise_lpt, lpt_cost, megatron_layerwise
from canzona.planner.simulate import active_params
from canzona.planner.strategies import (DESCRIPTIONS, EXACT, REGISTRY, STRATEGIES, baseline_rows,
                                        compare, compare_plan, compare_problem, strategy_workload)

PLANS = sorted((Path(__file__).parents[3] / "plans").glob("*.plan.json"))


@lru_cache(maxsize=None)
def _problem(model: str, dp: int, tp: int = 1, ep: int = 1, cost: str = "roofline"):
    return make_problem(build_inventory(get_preset(model)), ParallelSizes(dp=dp, tp=tp, ep=ep),
                        OptimizerSettings(name="muon"), cost=cost)


# --- every plan in plans/ ------------------------------------------------------------------------


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_every_plan_predicts_canzona_le_greedy_le_sc(path):
    """At the comparison's defaults (forward/backward from 6·N·tokens at MFU 0.4, the plan's
    hardware profile), the plan is no slower than the paper's method, which beats ``sc``."""
    c = compare_plan(parse_plan(path.read_text(encoding="utf-8")),
                     strategies=("sc", "canzona-greedy", "canzona"))
    step = {r.name: r.step_s for r in c.runs}
    assert step["canzona"] <= step["canzona-greedy"] <= step["sc"], step
    it = {r.name: r.iteration_s for r in c.runs}
    assert it["canzona"] <= it["canzona-greedy"] <= it["sc"], it


def test_compare_is_deterministic_and_json_ready():
    import json

    path = next(p for p in PLANS if p.name == "qwen3-1.7b-dp16-tp8-muon.plan.json")
    plan = parse_plan(path.read_text(encoding="utf-8"))
    a = json.dumps(compare_plan(plan).to_dict(stages=True), sort_keys=True)
    b = json.dumps(compare_plan(plan).to_dict(stages=True), sort_keys=True)
    assert a == b
    d = json.loads(a)
    assert [s["strategy"] for s in d["strategies"]] == list(STRATEGIES)
    assert [s["exact"] for s in d["strategies"]] == [s != "zero1" for s in STRATEGIES]


# --- the registry and the dealings ----------------------------------------------------------------


def test_one_registry_feeds_compare_and_inspect():
    """Both front ends list the registry's strategies in its order: compare those with a
    workload, inspect those with a DP row; every one has its description."""
    names = list(REGISTRY)
    assert list(STRATEGIES) == [n for n in names if REGISTRY[n].workload is not None]
    assert set(DESCRIPTIONS) == set(names) and all(DESCRIPTIONS.values())
    pr = _problem("qwen3-0.6b", 4, cost="flops")
    rows = [r.name for r in baseline_rows(pr)]  # no plan: no canzona row
    assert rows == [n for n in names if REGISTRY[n].baseline is not None and n != "canzona"]
    assert {"layerwise", "layerwise-lpt"} <= set(STRATEGIES) & set(rows)
    # the same dealing in both: compare's FLOPs per DP index are inspect's loads (cost: FLOPs)
    c = compare_problem(pr, load_hardware("h100"), strategies=("layerwise", "layerwise-lpt"))
    by_name = {r.name: r for r in baseline_rows(pr)}
    for run in c.runs:
        assert run.dp_flops == by_name[run.name].load


@pytest.mark.parametrize("dp,tp,ep", [(4, 1, 1), (3, 2, 1), (8, 1, 2)])
def test_layerwise_deals_ascending_sizes_ping_pong(dp, tp, ep):
    """megatron-core's shard_params: per group, ascending local size, ranks 0 … R−1, R−1 … 0;
    the expert buffers of each EP rank (ep > 1) over their own members, apart."""
    pr = _problem("qwen3-30b-a3b" if ep > 1 else "qwen3-0.6b", dp, tp, ep)
    groups = megatron_layerwise(pr).groups
    seen = [ref for g in groups for ref in g.items]
    assert sorted(seen) == [(bi, ii) for bi, b in enumerate(pr.buckets)
                            for ii in range(len(b.items))]  # every item once
    assert [g.members for g in groups if not g.expert] == [tuple(range(dp))]
    assert sorted(g.members for g in groups if g.expert) == (
        [tuple(range(e, dp, ep)) for e in range(ep)] if ep > 1 else [])
    for g in groups:
        sizes = [pr.buckets[bi].items[ii].end - pr.buckets[bi].items[ii].start
                 for bi, ii in g.items]
        assert sizes == sorted(sizes)
        R = len(g.members)
        loop = [*range(R), *reversed(range(R))]
        assert list(g.owners) == [g.members[loop[k % (2 * R)]] for k in range(len(g.items))]


def test_layerwise_lpt_gives_each_item_to_the_least_loaded():
    pr = _problem("qwen3-0.6b", 8, 2)
    for g in layerwise_lpt(pr).groups:
        load = dict.fromkeys(g.members, 0)
        costs = [lpt_cost(pr, ref) for ref in g.items]
        assert costs == sorted(costs, reverse=True)
        for ref, d in zip(g.items, g.owners):
            assert load[d] == min(load.values())
            load[d] += lpt_cost(pr, ref)


# --- the workloads -------------------------------------------------------------------------------


@pytest.mark.parametrize("dp,tp", [(4, 1), (4, 2)])
def test_every_strategy_puts_every_flop_somewhere(dp, tp):
    """Exact strategies compute each matrix once per owner's TP rank (sc: once per DP rank
    too), each at its roofline time; zero1 splits them; every AdamW element is updated by
    someone."""
    pr = _problem("qwen3-0.6b", dp, tp)
    hw = load_hardware("h100")
    roof = Roofline.of(hw)
    mats = sum(roof.seconds(c) for t, c in zip(pr.tasks, pr.costs) if t.optimizer == "matrix")
    split = sum(roof.seconds(c) for t, c in zip(pr.tasks, pr.costs)
                if t.optimizer == "matrix" and t.tp_split)
    c = compare_problem(pr, hw, strategies=STRATEGIES)
    for r in c.runs:
        w = strategy_workload(r.name, pr, hw, plan=c.plan if r.name == "canzona" else None) \
            if r.name != "canzona-greedy" else None
        if w is None:
            continue
        total = sum(x.matrix_s for x in w.ranks)
        total += sum(sum(g.compute_s) for gs in w.groups for g in gs)
        if r.name == "sc":
            assert total == pytest.approx(mats * dp * tp, rel=1e-9)
        elif r.name == "zero1":  # fragments: each TP rank its shard of split matrices
            assert total == pytest.approx((mats - split) * tp + split, rel=1e-6)
        elif r.name == "canzona":  # hosts compute split matrices once per TP group
            assert total == pytest.approx((mats - split) * tp + split, rel=1e-9)
        else:  # duplicated: every TP rank of the owner computes the whole matrix
            assert total == pytest.approx(mats * tp, rel=1e-9)
        assert sum(r.dp_flops) == pytest.approx(
            sum(c.flops for c in pr.costs) * (dp if r.name == "sc" else 1), rel=1e-6)


def test_layerwise_moves_one_and_a_half_times_zero1s_bytes():
    """All-reduce (2(R−1)/R·S) + all-gather ((R−1)/R·S) against reduce-scatter + all-gather
    ((R−1)/R·S each, the gather in half the bytes here): by hand from the bucket sizes."""
    pr = _problem("qwen3-1.7b", 8)
    hw = load_hardware("h100")
    R = 8
    buf = pr.layout.buffers[0]
    g, p = ELEMENT_BYTES[buf.grad_dtype], ELEMENT_BYTES[buf.dtype]
    S = sum(b.end - b.start for b in pr.buckets)
    c = compare_problem(pr, hw, strategies=("layerwise", "zero1", "sc"))
    sent = {r.name: r.sent_bytes for r in c.runs}
    assert sent["sc"] == pytest.approx(2 * (R - 1) / R * S * g, rel=1e-3)
    assert sent["zero1"] == pytest.approx((R - 1) / R * S * (g + p), rel=1e-3)
    # the uneven all-gather: one broadcast per root, a rank sends its own dealt elements
    assert sent["layerwise"] >= sent["sc"]
    assert sent["layerwise"] <= sent["sc"] + S * p


def test_sc_computes_everything_on_every_rank_and_has_no_gather():
    pr = _problem("qwen3-0.6b", 4)
    hw = load_hardware("h100")
    w = strategy_workload("sc", pr, hw)
    assert len({x.matrix_s for x in w.ranks}) == 1
    assert all(b.gather_s == 0 and b.method == "all_reduce" for b in w.buckets)
    sim = simulate(w)
    assert sim.step_s == pytest.approx(sim.ranks[0].compute_s + sim.dp_reduce_total, rel=1e-9)


def test_duplicated_tp_matrices_are_not_pipelined():
    """sc/layerwise at tp > 1: one all-gather per TP-split matrix, computed after it, the next
    gather only after that compute (Megatron's duplicated mode has no prefetch)."""
    g = GroupWork(0.1, 0.0, (1.0, 1.0))
    rw = (RankWork(),) * 2
    piped = simulate(Workload(1, 2, rw, (), ((g, g),)))
    serial = simulate(Workload(1, 2, rw, (), ((g, g),), tp_pipelined=False))
    assert piped.step_s == pytest.approx(0.1 + 2.0)
    assert serial.step_s == pytest.approx(2 * (0.1 + 1.0))
    pr = _problem("qwen3-0.6b", 2, 2)
    w = strategy_workload("layerwise", pr, load_hardware("h100"))
    assert not w.tp_pipelined and all(g.scatter_s == 0 for gs in w.groups for g in gs)


def test_layerwise_gather_is_not_hidden_by_overlap_param_gather():
    b = BucketWork("params", 0.0, (0, 1), 0.0, 0.5, "per_root", overlappable=False)
    a = BucketWork("b", 1.0, (0, 1), 0.2, 0.3)
    w = Workload(2, 1, (RankWork(),) * 2, (a, b))
    sim = simulate(w, backward_s=1.0, forward_s=10.0, overlap_param_gather=True)
    # the ordinary bucket's gather hides; the layer-wise all-gather does not
    assert sim.step_s == pytest.approx(0.2 + 0.3 + 0.5)
    w2 = Workload(2, 1, (RankWork(),) * 2, (a,))
    assert simulate(w2, backward_s=1.0, forward_s=10.0, overlap_param_gather=True).step_s == \
        pytest.approx(0.2)


@pytest.mark.parametrize("name", ["sc", "layerwise", "megatron-packed", "zero1"])
def test_time_never_decreases_with_less_bandwidth_or_more_flops(name):
    pr = _problem("qwen3-0.6b", 8, 2)
    hw = load_hardware("h800")
    fwd, bwd = split_forward_backward(0.05)
    base = simulate(strategy_workload(name, pr, hw), backward_s=bwd, forward_s=fwd)
    for kw in ({"intra": 2.0, "inter": 2.0}, {"latency": 3.0}, {"flops": 2.0},
               {"intra": 1.5, "inter": 1.5, "flops": 1.5}):
        worse = simulate(strategy_workload(name, pr, scaled_hardware(hw, **kw)), backward_s=bwd,
                         forward_s=fwd)
        assert worse.step_s >= base.step_s - 1e-12, kw


def test_active_params_scale_experts_and_drop_the_lookup_table():
    spec = build_inventory(get_preset("qwen3-30b-a3b"))
    cfg = spec.config
    dense = sum(p.numel for p in spec.params if not p.is_expert and p.kind != "embedding")
    experts = sum(p.numel for p in spec.params if p.is_expert)
    assert active_params(spec) == pytest.approx(
        dense + experts * cfg.experts_per_token / cfg.num_experts)
    tied = build_inventory(get_preset("qwen3-0.6b"))
    assert active_params(tied) == pytest.approx(tied.total_params)  # the table is the output


def test_compare_by_preset_forward_backward_and_errors():
    c = compare("qwen3-0.6b", ParallelSizes(dp=4, tp=1), hardware="h800", mfu=0.5, seq=1024,
                strategies=("zero1", "canzona"))
    hw = load_hardware("h800")
    assert c.tokens == 4 * 1024
    assert c.forward_backward_s == pytest.approx(
        6 * active_params(build_inventory(get_preset("qwen3-0.6b"))) * 4096
        / (4 * hw.peak_flops["bf16"] * 0.5))
    assert not c.run("zero1").exact and c.run("canzona").exact
    assert c.run("canzona").iteration_s == pytest.approx(c.forward_backward_s
                                                         + c.run("canzona").step_s)
    assert math.isclose(c.run("canzona").sim.backward_s, 2 * c.forward_backward_s / 3)
    with pytest.raises(ValueError, match="unknown strategies"):
        compare("qwen3-0.6b", ParallelSizes(dp=2, tp=1), strategies=("fast",))
    assert EXACT == set(STRATEGIES) - {"zero1"}
