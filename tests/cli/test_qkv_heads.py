"""The fused QKV split per attention head: ``canzona plan --qkv-split heads`` plans one task per
query, key and value head (GQA-aware, in Megatron's storage order), each whole on the TP rank
that holds it (nothing gathered, schema version 7); ``--split-qkv`` stays the alias of ``qkv``
and the other plans keep their text."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import canzona
from canzona.planner import OptimizerSettings, ParallelSizes, build_inventory
from canzona.planner.cost import build_tasks
from canzona.planner.errors import CanzonaError, ModelError, SizeError
from canzona.planner.heads import head_parts, head_ranks
from canzona.planner.inventory import Part, ParamSpec
from canzona.planner.models import load_hf_config
from canzona.planner.plan import BASE_VERSION, HEADS_VERSION
from canzona.planner.hardware import load_hardware
from canzona.planner.simulate.from_plan import workload_from_plan

from cli_helpers import run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "plans" / "old" / "tiny-config.json"  # 4 query and 2 KV heads of 16, hidden 64
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def _plan(tmp_path: Path, *extra: object, tp: int = 2):
    out = tmp_path / f"p{len(list(tmp_path.iterdir()))}.plan.json"
    r = run("plan", "--config", TINY, "--dp", 2, "--tp", tp, "--bucket-size", 20000, "-o", out,
            *extra)
    assert r.exit_code == 0, r.output
    return canzona.load_plan(out), out.read_text()


def test_one_task_per_head_in_storage_order(tmp_path):
    plan, text = _plan(tmp_path, "--qkv-split", "heads", "--share", "off")
    heads = [t for t in plan.tasks if t.param == QKV]
    # per KV group: its two query heads, its key head, its value head
    assert [t.part for t in heads] == ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]
    assert {t.shape for t in heads} == {(16, 64)}
    # whole on the TP rank that holds them: not hosted, not shared, nothing gathered
    assert all(t.host is None and t.micro_group is None and t.tp_comm_bytes == 0 for t in heads)
    assert not any(x.id in {t.id for t in heads} for ix in plan.tp.indices for x in ix.shared)
    assert plan.schema_version == HEADS_VERSION
    assert json.loads(text)["inputs"]["optimizer"]["qkv_split"] == "heads"
    assert "split_qkv" not in json.loads(text)["inputs"]["optimizer"]
    r = run("inspect", tmp_path / "p0.plan.json", "--config", TINY)
    assert r.exit_code == 0, r.output
    assert "QKV per head" in r.stdout


def test_each_head_counts_once_on_the_tp_rank_holding_it(tmp_path):
    """The simulator charges every head's FLOPs to the one TP rank holding it (not to each TP
    rank, as a replicated matrix), and the two TP ranks of an owner alike (one KV group each);
    the per-head work is far below the fused matrix's."""
    plan, _ = _plan(tmp_path, "--qkv-split", "heads", "--share", "off")
    w = workload_from_plan(plan, load_hardware("h100"))
    heads = [t for t in plan.tasks if "linear_qkv" in t.param]
    # outside the micro-groups (share off) the ranks compute the heads and nothing else
    assert sum(r.matrix_flops for r in w.ranks) == sum(t.flops for t in heads)
    for d in range(2):
        mine = sum(t.flops for t in heads if t.owner == d)
        assert [w.ranks[d * 2 + r].matrix_flops for r in range(2)] == [mine // 2] * 2
    assert all(ix.local_load[0] == ix.local_load[1] for ix in plan.tp.indices)
    fused, _ = _plan(tmp_path, "--share", "off")
    assert sum(t.flops for t in fused.tasks if "linear_qkv" in t.param) > sum(
        t.flops for t in heads)


def test_the_planners_per_gpu_loads_count_each_head_once(tmp_path):
    """Summed over every GPU, the plan's per-GPU loads are every task's load once (a replicated
    tensor's on each TP rank): a head is charged to one rank, not to each."""
    plan, _ = _plan(tmp_path, "--qkv-split", "heads", "--share", "off")
    spec = build_inventory(load_hf_config(TINY))
    want = sum(t.cost * (2 if spec[t.param].tp_layout == "replicated" else 1)
               for t in plan.tasks)
    got = sum(map(sum, plan.tp.metrics.gpu_load))
    assert abs(got - want) <= 4 * 2, (got, want)  # each GPU's load rounded twice


def test_split_qkv_is_the_alias_of_qkv_and_the_default_keeps_its_text(tmp_path):
    alias, a = _plan(tmp_path, "--split-qkv")
    named, b = _plan(tmp_path, "--qkv-split", "qkv")
    assert a == b and json.loads(a)["inputs"]["optimizer"]["split_qkv"] is True
    assert [t.part for t in alias.tasks if t.param == QKV] == ["q", "k", "v"]
    fused, c = _plan(tmp_path)
    assert json.loads(c)["inputs"]["optimizer"]["split_qkv"] is False
    assert fused.schema_version == BASE_VERSION
    assert OptimizerSettings(split_qkv=True).qkv_split == "qkv"


@pytest.mark.parametrize("args,needle", [
    (("--qkv-split", "head"), "--qkv-split must be one of: fused, qkv, heads"),
    (("--split-qkv", "--qkv-split", "heads"), "--split-qkv means --qkv-split qkv"),
])
def test_bad_choices_fail_in_one_line(tmp_path, args, needle):
    r = run("plan", "--config", TINY, "--dp", 2, "-o", tmp_path / "x.plan.json", *args)
    assert r.exit_code != 0
    assert needle in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "x.plan.json").exists()


def test_a_head_size_that_does_not_divide_a_projection_names_the_ones_that_do():
    p = ParamSpec("qkv", (96 + 64, 64), "fp32", "matrix", 0, None, "qkv",
                  parts=(Part("q", 96), Part("k", 32), Part("v", 32)), head_rows=24)
    with pytest.raises(ModelError, match=r"a head of 24 rows does not divide its k rows") as e:
        head_parts(p)
    assert "head sizes that divide them: 1, 2, 4, 8, 16, 32" in str(e.value)
    assert "\n" not in str(e.value)
    ok = dataclasses.replace(p, head_rows=16)  # 6 query heads, 2 KV heads
    assert [x.name for x in head_parts(ok)] == ["q0", "q1", "q2", "k0", "v0",
                                                "q3", "q4", "q5", "k1", "v1"]
    q = ParamSpec("q_proj.weight", (64, 32), "fp32", "matrix", 0, None, "column", head_rows=16)
    assert [(x.name, x.rows) for x in head_parts(q)] == [(f"h{i}", 16) for i in range(4)]


def test_heads_straddling_two_shards_are_refused():
    assert head_ranks([16] * 8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(CanzonaError, match="straddle"):
        head_ranks([24, 16, 24], 2)


def test_the_hf_names_split_each_projection_per_head():
    spec = build_inventory(load_hf_config(TINY), names="hf")
    tasks = build_tasks(spec, OptimizerSettings(qkv_split="heads"), ParallelSizes(dp=2, tp=1))
    q = [t for t in tasks if t.param == "model.layers.0.self_attn.q_proj.weight"]
    k = [t for t in tasks if t.param == "model.layers.0.self_attn.k_proj.weight"]
    assert [t.part for t in q] == ["h0", "h1", "h2", "h3"] and [t.part for t in k] == ["h0", "h1"]
    assert {t.shape for t in q + k} == {(16, 64)}


def test_weights_without_a_head_size_are_refused_in_one_line():
    spec = build_inventory(load_hf_config(TINY), names="hf")
    bare = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, head_rows=0)
                                                  for p in spec.params), _index={})
    with pytest.raises(SizeError, match="head_dim=") as e:
        build_tasks(bare, OptimizerSettings(qkv_split="heads"), ParallelSizes(dp=2, tp=1))
    assert "\n" not in str(e.value)
