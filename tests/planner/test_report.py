"""canzona.planner.report: the data behind ``canzona models/layout/inspect --json``, no CLI."""

import json

import pytest

from canzona.planner import PRESETS, CanzonaError, ParallelSizes, get_preset
from canzona.planner.pipeline import plan
from canzona.planner.report import (busiest_index, inspect_report, layout_dict, layout_of,
                                    model_rows, rebuild_problem)

QWEN3_0_6B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tp2_plan():
    return plan("qwen3-0.6b", ParallelSizes(4, 2))


def test_inspect_report_restates_the_plan_and_adds_the_baselines(tp2_plan):
    p = tp2_plan
    phases = []
    rep = inspect_report(p, top=3, progress=phases.append)
    assert phases == ["rebuilding the model's problem", "baselines", "TP baselines"]
    assert json.loads(json.dumps(rep)) == rep  # plain data
    assert (rep["model"], rep["dp"], rep["tp"]) == ("qwen3-0.6b", 4, 2)
    assert rep["metrics"]["max_load"] == max(p.metrics.dp_load)
    assert rep["metrics"]["mean_load"] == sum(p.metrics.dp_load) / 4
    assert [r["load"] for r in rep["ranks"]] == list(p.metrics.dp_load)
    assert sum(r["matrices"] for r in rep["ranks"]) == sum(t.owner is not None for t in p.tasks)
    costs = [t["cost"] for t in rep["heaviest_tasks"]]
    assert costs == sorted((t.cost for t in p.tasks), reverse=True)[:3]
    ours = rep["baselines"][-1]
    assert ours["name"] == "canzona" and ours["max_load"] == max(p.metrics.dp_load)
    tp = rep["tp_schedule"]
    assert tp["gpu_load"] == [list(r) for r in p.tp.metrics.gpu_load]
    assert [b["name"] for b in tp["baselines"]][-1] == "canzona"
    assert tp["baselines"][-1]["max_gpu_load"] == p.tp.metrics.max_gpu_load
    assert {b["name"] for b in tp["baselines"]} == {"sc", "canzona-greedy", "canzona"}


def test_inspect_report_of_a_tp1_plan_has_no_tp_schedule():
    rep = inspect_report(plan("qwen3-0.6b", ParallelSizes(2, 1)), top=0)
    assert rep["tp_schedule"] is None and rep["heaviest_tasks"] == []


def test_hf_config_plans_need_their_config_and_the_right_one(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_0_6B))
    p = plan(cfg, ParallelSizes(2, 1))
    with pytest.raises(CanzonaError) as info:
        inspect_report(p)
    assert info.value.fields == ("inspect_report.config",)
    assert "pass it again with inspect_report.config PATH" in str(info.value)
    assert "pass it again with --config PATH" in info.value.render(
        {"inspect_report.config": "--config"})
    assert inspect_report(p, config=cfg)["baselines"] is not None
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**QWEN3_0_6B, "num_hidden_layers": 27}))
    with pytest.raises(CanzonaError, match="does not match config .*other parameters"):
        rebuild_problem(p, other)


def test_layout_dict_counts_what_the_layout_splits():
    phases = []
    spec, lay = layout_of(get_preset("qwen3-0.6b"), ParallelSizes(8, 1), progress=phases.append)
    assert phases == ["model inventory", "buffers and buckets"]
    d = layout_dict(spec, lay)
    assert d["matrices"] == 28 * 4 and d["split_matrices"] == len(d["split"])
    buckets = [k for b in d["buffers"] for k in b["buckets"]]
    assert d["split_matrices"] == sum(k["split_matrices"] for k in buckets)
    assert sum(k["params"] for k in buckets) == len(spec.params)


def test_model_rows_and_busiest_index():
    assert [r["name"] for r in model_rows()] == list(PRESETS)
    assert busiest_index([[1, 5], [5, 2], [3, 3]]) == 0  # ties: the lowest DP index
    assert busiest_index([[1, 2], [3, 6], [6, 1]]) == 1
