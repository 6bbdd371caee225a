"""Expert TP 1 under tp > 1: every expert matrix whole on the one GPU that holds it.

Megatron orders expert ranks expert-TP fastest, then EP, then expert-DP, so at etp = 1 the TP
ranks of one DP index hold different experts. The planner places each expert bucket rank on
its GPU, charges its work to that GPU alone, and the plan reads back consistent."""

from __future__ import annotations

import json

import pytest

from canzona.planner import DPOptions, ParallelSizes, SizeError, build_inventory
from canzona.planner.models import ModelConfig
from canzona.planner.pipeline import plan_problem
from canzona.planner.plan.load import parse_plan
from canzona.planner.planning import default_plan_name, make_problem, owner_of
from canzona.planner.tp import gpu_loads, index_work
from canzona.planner.tp.context import gpu_total

MOE = ModelConfig(name="tiny-moe", arch="qwen3_moe", hidden=64, ffn=0, layers=2, q_heads=4,
                  kv_heads=2, head_dim=16, vocab=256, tied_embeddings=False, qk_norm=True,
                  num_experts=4, experts_per_token=2, moe_ffn=32)


@pytest.mark.parametrize("dp,tp,ep", [(2, 2, 2), (2, 4, 2), (4, 2, 4), (2, 2, 4)])
def test_expert_places_cover_every_gpu_once_in_megatron_order(dp, tp, ep):
    sizes = ParallelSizes(dp, tp, ep=ep, etp=1)
    seen = {}
    for k in range(ep):
        for r in range(sizes.edp):
            d, t = sizes.expert_place(k, r)
            g = d * tp + t
            assert g % ep == k and g // ep == r  # expert rank g = r·ep + k
            seen[g] = (k, r)
    assert sorted(seen) == list(range(dp * tp))
    # at expert TP = TP a bucket rank is a DP index, every TP rank of it holding a shard
    same = ParallelSizes(dp * tp // tp, tp, ep=ep)
    if same.dp % ep == 0:
        assert [same.expert_place(1, r) for r in range(same.edp)] == [
            (r * ep + 1, None) for r in range(same.edp)]


@pytest.fixture(scope="module")
def problem():
    return make_problem(build_inventory(MOE), ParallelSizes(dp=2, tp=2, ep=2, etp=1),
                        bucket_size=20000)


@pytest.fixture(scope="module")
def plan(problem):
    return plan_problem(problem, dp_options=DPOptions(bucket_size=20000, reorder=False),
                        model_source="hf_config")


def test_the_plan_reads_back_and_names_expert_tp_1(plan):
    again = parse_plan(plan.to_json(), "<etp1>")
    assert again.inputs.etp == 1 and again.inputs.tp == 2
    assert default_plan_name("tiny-moe", ParallelSizes(dp=2, tp=2, ep=2, etp=1),
                             "muon") == "tiny-moe-dp2-tp2-ep2-etp1-muon.plan.json"
    data = json.loads(plan.to_json())
    experts = [b for b in data["buffers"] if b["expert"]]
    assert len(experts) == 2 and all(b["dp_size"] == 2 for b in experts)  # edp = 2·2/2


def test_expert_work_lands_on_one_gpu_and_owners_are_dp_indices(problem, plan):
    sizes = problem.sizes
    cuts = {(b.buffer, b.bucket): plan.buffers[b.buffer].buckets[b.bucket].cuts
            for b in problem.buckets}
    base, owned, pinned = index_work(problem, cuts)
    assert pinned is not None
    expected = [[0.0] * sizes.tp for _ in range(sizes.dp)]
    for b in problem.buckets:
        buf = problem.layout.buffers[b.buffer]
        if not buf.expert:
            continue
        c = cuts[(b.buffer, b.bucket)]
        for it in b.items:
            if not it.atomic:
                continue
            r = owner_of(c, it.start)
            d, t = sizes.expert_place(buf.ep_rank, r)
            expected[d][t] += it.load
            for i in it.tasks:
                assert plan.tasks[i].owner == d  # the plan's owner: the DP index
    # the experts' matrices on their GPU alone (AdamW on their slices beside them)
    assert all(p >= e for row, erow in zip(pinned, expected) for p, e in zip(row, erow))
    assert sum(map(sum, expected)) > 0
    grid = gpu_loads(problem, cuts)
    # the same total as any cuts give (AdamW shares round down per slice)
    slices = sum(len(b.items) for b in problem.buckets) * sizes.dp
    assert sum(map(sum, grid)) == pytest.approx(gpu_total(problem), abs=slices)
    # each GPU carries the common load, its own experts, and what it hosts
    for d in range(sizes.dp):
        for t in range(sizes.tp):
            assert grid[d][t] >= base[d] + pinned[d][t] - 1e-6
    # the recorded per-GPU loads are what the plan's own checks recompute
    recorded = plan.tp.metrics.gpu_load
    assert all(abs(recorded[d][t] - grid[d][t]) <= 1 for d in range(sizes.dp)
               for t in range(sizes.tp))


def test_expert_tp_other_than_1_or_tp_is_refused_in_one_line():
    with pytest.raises(SizeError) as e:
        make_problem(build_inventory(MOE.model_copy(update={"moe_ffn": 64})),
                     ParallelSizes(dp=1, tp=4, ep=2, etp=2))
    msg = str(e.value)
    assert "\n" not in msg and "expert tp=2 must be 1 or tp=4" in msg


def test_expert_tp_on_a_dense_model_is_refused_naming_the_field():
    dense = MOE.model_copy(update={"arch": "qwen3", "ffn": 128, "num_experts": 0,
                                   "experts_per_token": 0, "moe_ffn": 0})
    with pytest.raises(SizeError) as e:
        make_problem(build_inventory(dense), ParallelSizes(dp=2, tp=2, etp=1))
    assert "needs a mixture-of-experts model" in str(e.value)
    assert "ParallelSizes.etp" in e.value.fields
