"""Pipeline stages through the CLI: ``plan --pp``, ``inspect``, ``simulate`` and ``compare`` of
a pipeline, and the bad input they refuse in one line."""

import json

import pytest

from canzona.planner.plan import PipelinePlan
from canzona.planner.plan.load import load_plan
from cli_helpers import one_error_line, run


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp")
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "--tp", 2, "--pp", 4, "-o", folder)
    assert r.exit_code == 0, r.output
    return folder / "qwen3-0.6b-dp2-tp2-pp4-muon.plan.json", r.output


def test_plan_pp_writes_a_stage_per_plan_and_shows_them_side_by_side(staged):
    path, out = staged
    p = load_plan(path)
    assert isinstance(p, PipelinePlan) and p.pp == 4
    assert [s.inputs.stage.first_layer for s in p.stages] == [0, 7, 14, 21]
    assert "◀ critical" in out and "+ emb" in out and "+ out" in out
    assert "uneven split: stage 0 holds embedding.word_embeddings.weight" in out
    assert "(tied: one weight in two copies)" in out


def test_inspect_simulate_and_compare_read_a_pipeline(staged):
    path, _ = staged
    r = run("inspect", path, "--stage", 2)
    assert r.exit_code == 0, r.output
    assert "stage 2 of 4, in full" in r.output and "Per DP index" in r.output
    r = run("simulate", path, "--json", "--microbatches", 8)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    ends = [s["end_s"] for s in d["pipeline"]["stages"]]
    assert d["pipeline"]["microbatches"] == 8
    assert d["stage"] == d["pipeline"]["critical_stage"] == ends.index(max(ends))
    r = run("compare", "--plan", path, "--strategies", "layerwise,canzona", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert [x["strategy"] for x in d["strategies"]] == ["layerwise", "canzona"]
    assert all(len(x["stages"]) == 4 for x in d["strategies"])


@pytest.mark.parametrize("args, needles", [
    (("plan", "--model", "qwen3-0.6b", "--pp", 3), ("--pp 3 must divide the 28", "--first-stage")),
    (("plan", "--model", "qwen3-0.6b", "--first-stage-layers", 2), ("need --pp > 1",)),
    (("plan", "--model", "qwen3-0.6b", "--pp", 2, "--first-stage-layers", 30),
     ("--first-stage-layers 30 is more than the 28 decoder layers",)),
    (("compare", "--model", "qwen3-0.6b", "--pp", 5), ("--pp 5 must divide",)),
])
def test_bad_stage_splits_are_one_line(args, needles):
    one_error_line(run(*args), *needles)


def test_options_that_do_not_fit_the_plan_are_one_line(staged, tmp_path):
    path, _ = staged
    one_error_line(run("inspect", path, "--stage", 4), "--stage 4", "stages 0 to 3")
    one_error_line(run("compare", "--plan", path, "--pp", 2), "--pp 2 contradicts")
    one_error_line(run("simulate", path, "--backward", 0.1), "drop --backward")
    whole = tmp_path / "whole.json"
    assert run("plan", "--model", "qwen3-0.6b", "--dp", 2, "-o", whole).exit_code == 0
    one_error_line(run("inspect", whole, "--stage", 0), "pp 1", "drop --stage")
    one_error_line(run("simulate", whole, "--microbatches", 4), "drop them")
