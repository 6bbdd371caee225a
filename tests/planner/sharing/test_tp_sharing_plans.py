"""Plans whose TP groups share the heaviest Muon matrices (``TPOptions.share``):
the decision, the per-GPU loads and bounds, the simulated step, the schema (version 3 only for
plans that share; every other plan byte for byte as before) and the checks of an edited file."""

from __future__ import annotations

import pytest

import dataclasses

from canzona.planner import (DPOptions, OptimizerSettings, ParallelSizes, TPOptions,
                             build_inventory, get_preset)
from canzona.planner.dp import greedy
from canzona.planner.solve import solve
from canzona.planner.dp.reorder import reorder_problem
from canzona.planner.dp.units import owners_to_cuts
from canzona.planner.formulas import LOCKSTEP_CMAX
from canzona.planner.hardware import load_hardware
from canzona.planner.pipeline import plan
from canzona.planner.plan import BASE_VERSION, TP_PAIR_VERSION, TP_SHARE_VERSION, save_plan
from canzona.planner.planning import evaluate, make_problem
from canzona.planner.report import useful_mean
from canzona.planner.sharing import kind_of, share_decision
from canzona.planner.simulate import simulate_plan
from canzona.planner.tp import MIB, TPContext, index_gpu_max, schedule_tp
from canzona.planner.tp.joint import lockstep_assign
from canzona.planner.plan.load import load_plan, parse_plan


def _plan(model: str, dp: int, tp: int, share: str, hardware: str = "h800"):
    return plan(model, ParallelSizes(dp=dp, tp=tp),
                tp_options=TPOptions(share=share, hardware=hardware))


@pytest.fixture(scope="module")
def q32_plans():
    return {s: _plan("qwen3-32b", 32, 8, s) for s in ("off", "auto")}


def test_auto_shares_the_heavy_mlp_matrices_and_hosts_the_rest(q32_plans):
    p = q32_plans["auto"]
    shared = {x.id for ix in p.tp.indices for x in ix.shared}
    kinds = {kind_of(p.tasks[i].param) for i in shared}
    assert "mlp.linear_fc1" in kinds and len(shared) >= 64
    for i in shared:  # shared: no host, no micro-group, owned by the index that shares it
        t = p.tasks[i]
        assert t.host is None and t.micro_group is None
        assert any(x.id == i for x in p.tp.indices[t.owner].shared)
    hosted = {gt.id for ix in p.tp.indices for g in ix.groups for gt in g.tasks}
    assert not hosted & shared
    matrices = {t.id for t in p.tasks if t.host is not None or t.id in shared}
    assert hosted | shared == matrices  # every TP-split matrix hosted or shared, not both
    # version 3; 5 where TP groups also share a matrix with a partner index (k = 2·tp)
    assert p.schema_version == (TP_PAIR_VERSION if p.dp_shared else TP_SHARE_VERSION)
    assert p.tp.share == "auto"


def test_auto_keeps_the_lighter_of_its_candidates():
    """``auto`` plans the bound's choice (the MLP matrices above the mean) and every eligible
    task with the polynomial split, and keeps the lighter busiest GPU (at qwen3-32b dp32 tp8:
    every matrix shared, their collectives hidden by each other's compute in lockstep)."""
    for model, dp, hw in (("qwen3-32b", 32, "h800"), ("qwen3-0.6b", 4, "h100")):
        auto = _plan(model, dp, 8 if dp == 32 else 2, "auto", hardware=hw)
        split = _plan(model, dp, 8 if dp == 32 else 2, "all-split", hardware=hw)
        assert auto.tp.metrics.max_gpu_load <= split.tp.metrics.max_gpu_load


def test_sharing_lowers_the_busiest_gpu_and_the_simulated_compute(q32_plans):
    off, auto = q32_plans["off"].tp.metrics, q32_plans["auto"].tp.metrics
    assert off.max_over_mean == pytest.approx(2.04, abs=0.01)  # the atomic floor
    assert auto.max_gpu_load < off.max_gpu_load
    hw = load_hardware("h800")
    sim = {k: simulate_plan(p, hw).breakdown() for k, p in q32_plans.items()}

    def path(b):
        return b["compute"] + b["tp_gather_scatter"]

    assert path(sim["auto"]) < 0.5 * path(sim["off"])  # the issue: at most half
    # the issue: ≤ 1.10 the mean useful work (single-device FLOPs; the shared polynomial's
    # symmetric half makes the pieces lighter than that)
    assert q32_plans["auto"].tp.metrics.max_gpu_load / useful_mean(q32_plans["auto"]) <= 1.10


@pytest.mark.parametrize("model,dp,most", [("qwen3-32b", 128, 1.25), ("llama3-70b", 256, 2.2)])
def test_at_scale_the_floor_goes(model, dp, most):
    """8.2× and 13× the mean useful work per GPU with whole matrices; within ``most`` with
    sharing, judged on the compute (``--objective max-load``; the busiest GPU's load counts the
    collectives its lockstep phase does not hide), and the simulated compute path at least three
    times shorter. qwen3-32b dp128: the issue's 1.25, reached by pairing each index's pieces
    (fc1 with proj, fc2 with QKV) so that compute hides collectives
    (``tp.joint.lockstep_assign``); llama3-70b's fc1 piece over 8 ranks is alone 1.6× the mean
    (k > tp is not done). The default objective keeps that placement only where the modelled
    step with the bucket collectives is shorter: at dp128 fc1 + proj owns 1.25× the mean bytes,
    and the default keeps a partition whose collectives are faster (10 % faster than the
    max-load plan without TP sub-groups; 1 % than the one with them, whose rounds put
    fewer bytes on the busiest index)."""
    off = _plan(model, dp, 8, "off")
    auto = plan(model, ParallelSizes(dp=dp, tp=8), dp_options=DPOptions(objective="max-load"),
                tp_options=TPOptions(share="auto", hardware="h800"))
    default = _plan(model, dp, 8, "auto")
    if model == "qwen3-32b":
        assert default.comm.predicted_s < (0.99 if auto.sub_groups else 0.95) \
            * auto.comm.predicted_s
    assert default.tp.metrics.max_gpu_load / useful_mean(default) <= 2.2
    assert parse_plan(auto.to_json()).to_json() == auto.to_json()  # a plan file's every check
    assert off.tp.metrics.max_gpu_load / useful_mean(off) > 8
    assert auto.tp.metrics.max_gpu_load / useful_mean(auto) <= most
    hw = load_hardware("h800")
    a, b = (simulate_plan(p, hw).breakdown() for p in (auto, off))
    assert a["compute"] + a["tp_gather_scatter"] <= (b["compute"] + b["tp_gather_scatter"]) / 3


def _shared_problem(model: str, dp: int, tp: int, cmax_mib: float = 512.0,
                    cost: str = "roofline"):
    pr = make_problem(build_inventory(get_preset(model)), ParallelSizes(dp=dp, tp=tp),
                      OptimizerSettings(name="muon"), hardware="h800", cost=cost)
    return dataclasses.replace(pr, shared=share_decision(pr, "h800", "all-split"),
                               lockstep_cap=int(LOCKSTEP_CMAX * cmax_mib * MIB))


@pytest.mark.parametrize("model,dp,tp,cmax", [("qwen3-0.6b", 4, 2, 512.0),
                                              ("qwen3-0.6b", 4, 2, 8.0),
                                              ("qwen3-1.7b", 8, 4, 20.0)])
def test_the_dp_side_sees_the_schedules_lockstep_phase(model, dp, tp, cmax):
    """``index_gpu_max`` (what the DP side optimises) is the TP schedule's busiest GPU, the
    shared pieces in lockstep batches under the scratch cap included: a small C_max cuts the
    phase into batches whose collectives the others no longer hide."""
    opts = TPOptions(cmax_mib=cmax, hardware="h800")
    pr = _shared_problem(model, dp, tp, cmax)
    sol = solve(pr)
    ctx = TPContext.build(sol.problem)
    sch = schedule_tp(sol.problem, sol.cuts, opts, ctx=ctx, warn=False)
    assert [max(r) for r in sch.grid()] == pytest.approx(
        index_gpu_max(sol.problem, sol.cuts, ctx), rel=1e-9, abs=4)


@pytest.mark.parametrize("model,dp,tp", [("qwen3-1.7b", 16, 4), ("qwen3-4b", 32, 4)])
def test_lockstep_assign_pairs_pieces_and_keeps_matrices_whole(model, dp, tp):
    """From the paper's greedy cuts (Megatron's order), re-placing whole matrices freely
    lowers the busiest GPU by more than a tenth here, every matrix stays whole and on a rank
    of its bucket."""
    pr = _shared_problem(model, dp, tp)
    cuts = greedy(pr)
    rank = lockstep_assign(pr, cuts)
    assert rank is not None
    for b in pr.buckets:
        r = rank[(b.buffer, b.bucket)]
        assert len(r) == len(b.items) and all(0 <= x < b.ranks for x in r)
    rp, owners = reorder_problem(pr, rank)
    new = owners_to_cuts(rp, owners)
    assert evaluate(rp, new).split_matrices == 0
    assert sorted(it.tasks for b in rp.buckets for it in b.items) == \
        sorted(it.tasks for b in pr.buckets for it in b.items)
    assert max(index_gpu_max(rp, new)) < 0.9 * max(index_gpu_max(pr, cuts))


def test_lockstep_placement_keeps_the_state_guard():
    """Under step-time the free re-placement must gain for real, and more where it piles the
    optimizer state up (as the joint refinement): at qwen3-4b dp32 tp4 it would gain 2e-9 of
    the busiest GPU for 18 % more state on the busiest index, and is not kept."""
    from canzona.planner.solve import _state_excess

    sol = solve(_shared_problem("qwen3-4b", 32, 4, cost="flops"))
    assert _state_excess(sol.problem, sol.cuts) == 0


def test_off_is_the_plan_it_was():
    a = plan("qwen3-0.6b", ParallelSizes(dp=2, tp=2))
    b = _plan("qwen3-0.6b", 2, 2, "off", hardware="h100")
    assert a.to_json() == b.to_json()
    assert a.schema_version == BASE_VERSION and '"shared"' not in a.to_json()
    assert '"share"' not in a.to_json()


@pytest.fixture(scope="module")
def small_shared():
    return _plan("qwen3-0.6b", 2, 2, "all", hardware="h100")


def test_a_shared_plan_round_trips_and_is_deterministic(tmp_path, small_shared):
    p = small_shared
    assert all(ix.shared for ix in p.tp.indices) and p.tp.metrics.micro_groups == 0
    path = tmp_path / "s.plan.json"
    save_plan(p, path)
    assert load_plan(path) == p
    assert _plan("qwen3-0.6b", 2, 2, "all", hardware="h100").to_json() == p.to_json()


def test_edited_shared_plans_are_refused(refused_edit, small_shared):
    p = small_shared
    x = p.tp.indices[0].shared[0]

    def v2(d):
        d["schema_version"] = 2

    def hosted(d):
        d["tasks"][x.id]["host"], d["tasks"][x.id]["micro_group"] = 0, 0

    def cheap(d):
        d["tp"]["indices"][0]["shared"][0]["load"] = 1

    def twice(d):
        d["tp"]["indices"][0]["shared"].append(d["tp"]["indices"][0]["shared"][0])

    assert "schema_version 3" in refused_edit(p, v2)
    assert "shared by its TP group" in refused_edit(p, hosted)
    assert "costs at least" in refused_edit(p, cheap)
    assert "scheduled twice" in refused_edit(p, twice)


def test_share_is_checked():
    from canzona.planner.errors import CanzonaError

    with pytest.raises(CanzonaError, match="share"):
        TPOptions(share="sometimes")


def _shampoo(dp: int, share: str, objective: str = "max-load", block: int = 256):
    return plan("qwen3-0.6b", ParallelSizes(dp=dp, tp=4),
                OptimizerSettings(name="shampoo", max_preconditioner_dim=block),
                dp_options=DPOptions(objective=objective),
                tp_options=TPOptions(share=share, hardware="h800"))


def test_shampoo_blocks_shard_by_shard_plan_simulate_and_validate(tmp_path):
    """Shampoo at tp 4 with blocks of 256 (qwen3-0.6b): fc1's 768-row gate/up segments, fc2's and
    proj's 768 and 512 columns are whole blocks, each TP rank preconditions its own (no gather,
    no micro-group for them); QKV's 128-row K/V segments are not, so it stays hosted. The busiest
    GPU gets lighter, the simulated compute path shorter, and the plan file passes every check —
    but not with blocks of 1024, which its shards do not hold whole."""

    whole, shard = _shampoo(32, "off"), _shampoo(32, "all")
    shared = [x for ix in shard.tp.indices for x in ix.shared]
    assert {kind_of(shard.tasks[x.id].param) for x in shared} == {
        "mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj"}
    assert len(shared) == 3 * 28 and not any(x.split_poly for x in shared)
    hosted = {kind_of(shard.tasks[t.id].param) for ix in shard.tp.indices for g in ix.groups
              for t in g.tasks}
    assert hosted == {"self_attention.linear_qkv"}
    # the busiest GPU 1.83× → 1.22× the mean: hosting left whole fc1s on single TP ranks
    assert shard.tp.metrics.max_gpu_load < 0.7 * whole.tp.metrics.max_gpu_load
    hw = load_hardware("h800")

    def path(p):  # the simulated compute and exposed TP gather/scatter of the critical rank
        b = simulate_plan(p, hw).breakdown()
        return b["compute"] + b["tp_gather_scatter"]

    assert path(shard) < path(whole)
    path = tmp_path / "shard.json"
    save_plan(shard, path)
    assert load_plan(path) == shard
    # the check a plan file's shared Shampoo task passes, against blocks of 1024
    from canzona.planner.plan.tp_checks import _check_shard_blocks

    def bad(field, msg):
        return ValueError(f"{field}: {msg}")

    ix = next(ix for ix in shard.tp.indices if ix.shared)
    x = ix.shared[0]
    lay = shard.tp.layouts[x.layout]
    assert _check_shard_blocks(shard, x, lay, "x", bad) == x.load
    opt = shard.inputs.optimizer.model_copy(update={"max_preconditioner_dim": 1024})
    coarse = shard.model_copy(update={"inputs": shard.inputs.model_copy(update={
        "optimizer": opt})})
    with pytest.raises(ValueError, match="not whole blocks of 1024"):
        _check_shard_blocks(coarse, x, lay, "x", bad)


def test_shampoo_auto_weighs_the_step():
    """``--share auto`` with Shampoo: shard blocks save compute only. Under max-load the plan
    keeps them for the lighter busiest GPU; under step-time only if the modelled step (busiest
    GPU + bucket collectives) is shorter than hosting's — at qwen3-8b dp64 tp4 on the H800
    profile it is not: the partition with them moves more bytes (the collectives take ~300 ms,
    Shampoo's compute ~2 ms), so auto hosts them there."""
    assert any(ix.shared for ix in _shampoo(32, "auto").tp.indices)

    def q8(share):
        return plan("qwen3-8b", ParallelSizes(dp=64, tp=4), OptimizerSettings(name="shampoo"),
                    tp_options=TPOptions(share=share, hardware="h800"))

    auto, every = q8("auto"), q8("all")
    assert not any(ix.shared for ix in auto.tp.indices)
    assert any(ix.shared for ix in every.tp.indices)
    assert every.tp.metrics.max_gpu_load < auto.tp.metrics.max_gpu_load
    assert auto.comm.predicted_s < every.comm.predicted_s


def test_shampoo_share_with_no_whole_block_shards_says_so():
    """Blocks of 1024 against qwen3-0.6b's tp-4 shards (768 rows, 768 and 512 columns): nothing
    can be preconditioned shard by shard, and the planner says why instead of sharing nothing
    silently."""
    from canzona.planner.errors import CanzonaWarning

    with pytest.warns(CanzonaWarning, match="whole blocks of max_preconditioner_dim = 1024"):
        p = _shampoo(8, "all", block=1024)
    assert not any(ix.shared for ix in p.tp.indices)


def test_shampoo_shard_blocks_beside_hosted_qkv_pack_per_gpu():
    """qwen3-8b dp64 tp4, Shampoo with every fc1/fc2/proj preconditioned shard by shard and QKV
    hosted: a hosted QKV loads one GPU, a shard piece all four of its index, so the packing
    wants QKVs together on indices without pieces. The lockstep placement's move/swap search
    from the partition's cuts stopped at 1.39× the mean (an index with four QKVs and a piece);
    from a fresh placement it reaches 1.08× (objective max-load: the compute alone; FLOPs)."""
    p = plan("qwen3-8b", ParallelSizes(dp=64, tp=4), OptimizerSettings(name="shampoo"),
             dp_options=DPOptions(objective="max-load", cost="flops"),
             tp_options=TPOptions(share="all", hardware="h800"))
    assert sum(len(ix.shared) for ix in p.tp.indices) == 108
    assert p.tp.metrics.max_over_mean < 1.15
