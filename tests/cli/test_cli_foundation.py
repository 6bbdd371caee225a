"""`canzona models` and `canzona layout` through typer's CliRunner, every error path included."""

import json

import pytest

from canzona.planner import ParallelSizes, get_preset
from canzona.planner.models import PRESETS
from canzona.planner.report import layout_dict, layout_of, model_rows
from cli_helpers import run


def test_models_table_lists_every_preset():
    r = run("models")
    assert r.exit_code == 0
    for name in PRESETS:
        assert name in r.output
    assert "32,762,123,264" in r.output


def test_models_json():
    r = run("models", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert rows == model_rows()
    assert [x["name"] for x in rows] == list(PRESETS)
    assert {x["name"]: x["params"] for x in rows}["qwen3-235b-a22b"] == 235_093_634_560


def test_layout_reports_buckets_and_split_count():
    r = run("layout", "--model", "Qwen3-32B", "--dp", "32", "--tp", "8")
    assert r.exit_code == 0, r.output
    assert "dense bf16/fp32" in r.output and "66" in r.output
    assert "split 256 of 256" in r.output


def test_layout_json_and_buckets():
    r = run("layout", "--model", "qwen3-0.6b", "--dp", "8", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data == layout_dict(*layout_of(get_preset("qwen3-0.6b"), ParallelSizes(dp=8, tp=1)))
    assert data["dp"] == 8 and data["matrices"] == 28 * 4
    assert sum(b["split_matrices"] for b in data["buffers"][0]["buckets"]) == data["split_matrices"]
    r = run("layout", "--model", "qwen3-0.6b", "--dp", "8", "--buckets")
    assert r.exit_code == 0 and "Buckets" in r.output


def test_layout_moe_and_no_overlap():
    r = run("layout", "--model", "qwen3-30b-a3b", "--dp", "8", "--tp", "2", "--ep", "4")
    assert r.exit_code == 0 and "each of 4 EP ranks" in r.output
    r = run("layout", "--model", "qwen3-8b", "--dp", "8", "--no-overlap", "--json")
    assert [len(b["buckets"]) for b in json.loads(r.output)["buffers"]] == [1]


def test_layout_from_hf_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                                   num_hidden_layers=28, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                   tie_word_embeddings=True)))
    r = run("layout", "--config", str(cfg), "--dp", "4", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["matrices"] == 28 * 4


@pytest.mark.parametrize("args, needle", [
    (["layout", "--model", "qwen3-32b", "--tp", "3"], "tp=3 must divide"),
    (["layout", "--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["layout"], "exactly one of --model"),
    (["layout", "--model", "qwen3-8b", "--config", "x.json"], "exactly one of --model"),
    (["layout", "--config", "/nonexistent/config.json"], "cannot read model config"),
    (["layout", "--model", "qwen3-8b", "--dp", "0"], "--dp must be a positive integer"),
    (["layout", "--model", "qwen3-8b", "--ep", "2"], "dense"),
    (["layout", "--model", "qwen3-30b-a3b", "--ep", "3", "--dp", "3"], "ep=3 must divide"),
    (["layout", "--model", "qwen3-8b", "--bucket-size", "-1"], "--bucket-size"),
])
def test_error_paths_are_one_line(args, needle):
    r = run(*args)
    assert r.exit_code == 1
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.output
    assert "Traceback" not in r.output


def test_usage_error_exit_code():
    r = run("layout", "--dpp", "2")  # an unknown option is a usage error (a bad value is not)
    assert r.exit_code == 2


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and r.output.startswith("canzona ")
