"""``canzona compare`` and the ``--plot`` charts of ``compare`` and ``simulate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from canzona.planner import ParallelSizes
from canzona.planner.strategies import STRATEGIES, compare

from cli_helpers import run

PLANS = Path(__file__).parents[2] / "plans"


def test_compare_table_lists_every_strategy_and_marks_zero1():
    r = run("compare", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "--hardware", "h800")
    assert r.exit_code == 0, r.output
    for s in STRATEGIES:
        assert s in r.stdout
    assert "zero1 ✗" in r.stdout and "not the exact optimizer" in r.stdout
    assert "h800" in r.stdout and "MFU 0.4" in r.stdout


def test_compare_json_equals_the_library_and_is_deterministic():
    args = ("compare", "--model", "qwen3-0.6b", "--dp", 4, "--strategies",
            "canzona,sc,layerwise", "--mfu", 0.5, "--json")
    r1, r2 = run(*args), run(*args)
    assert r1.exit_code == 0, r1.output
    assert r1.stdout == r2.stdout
    d = json.loads(r1.stdout)
    assert [s["strategy"] for s in d["strategies"]] == ["sc", "layerwise", "canzona"]  # table order
    lib = compare("qwen3-0.6b", ParallelSizes(dp=4, tp=1), hardware="h100", mfu=0.5,
                  strategies=("sc", "layerwise", "canzona"))
    for row, r in zip(d["strategies"], lib.runs):
        assert row["step_s"] == pytest.approx(r.step_s, abs=1e-9)
        assert row["iteration_s"] == pytest.approx(r.iteration_s, abs=1e-9)
    assert d["forward_backward_s"] == pytest.approx(lib.forward_backward_s, abs=1e-9)


def test_compare_a_saved_plan_and_a_given_forward_backward():
    """A saved plan against the paper's greedy, behind a given forward/backward; behind its own
    (the one the planner judged it with) it is never the slower."""
    plan = PLANS / "qwen3-1.7b-dp16-tp8-muon.plan.json"
    r = run("compare", "--plan", plan, "--forward-backward", 0.3, "--overlap-param-gather",
            "--strategies", "canzona-greedy,canzona", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["forward_backward_given"] and d["forward_backward_s"] == 0.3
    assert d["overlap_param_gather"] and (d["dp"], d["tp"]) == (16, 8)
    assert all(s["step_s"] > 0 for s in d["strategies"])
    own = json.loads(run("compare", "--plan", plan, "--strategies", "canzona-greedy,canzona",
                         "--json").stdout)
    step = {s["strategy"]: s["step_s"] for s in own["strategies"]}
    assert step["canzona"] <= step["canzona-greedy"]


def test_compare_share_plans_the_canzona_row_with_sharing():
    """``--share`` (default auto, as ``canzona plan``): the canzona row's plan shares matrices,
    the paper's greedy stays whole; at qwen3-32b dp32 tp8 the sharing plan's compute is under
    half the greedy's."""
    args = ("compare", "--model", "qwen3-32b", "--dp", 32, "--tp", 8, "--hardware", "h800",
            "--strategies", "canzona-greedy,canzona", "--json")
    whole, shared = (json.loads(run(*args, *extra).stdout) for extra in (("--share", "off"), ()))
    assert (whole["canzona_share"], shared["canzona_share"]) == ("off", "auto")

    def compute(d, name):
        row = next(s for s in d["strategies"] if s["strategy"] == name)
        return row["simulation"]["breakdown"]["compute"]

    assert compute(shared, "canzona-greedy") == compute(whole, "canzona-greedy")
    assert compute(shared, "canzona") < 0.5 * compute(shared, "canzona-greedy")
    r = run(*args[:-1])
    assert "matrices shared: auto" in r.stdout


def test_compare_plot_writes_the_bars_and_the_timeline(tmp_path):
    r = run("compare", "--model", "qwen3-0.6b", "--dp", 2, "--tp", 2, "--plot", tmp_path)
    assert r.exit_code == 0, r.output
    bars = tmp_path / "qwen3-0.6b-dp2-tp2-compare.png"
    line = tmp_path / "qwen3-0.6b-dp2-tp2-compare-timeline.png"
    for f in (bars, line):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f
        assert str(f.name) in r.stdout
    r = run("simulate", PLANS / "qwen3-1.7b-dp16-tp8-muon.plan.json", "--plot",
            tmp_path / "t.svg")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("args,words", [
    (("--model", "nope", "--dp", 2), "unknown model"),
    (("--model", "qwen3-0.6b", "--dp", 2, "--strategies", "fast"), "--strategies must be one of"),
    (("--model", "qwen3-0.6b", "--dp", 2, "--mfu", 0), "--mfu must be in"),
    (("--model", "qwen3-0.6b", "--dp", 2, "--hardware", "h900"), "--hardware must be one of"),
    (("--model", "qwen3-0.6b", "--dp", 2, "--plot", "/nonexistent/x.png"), "does not exist"),
    (("--model", "qwen3-0.6b", "--plan", PLANS / "qwen3-1.7b-dp16-tp8-muon.plan.json"),
     "not both"),
    (("--model", "qwen3-0.6b", "--dp", 3, "--tp", 3), "tp"),
    (("--model", "qwen3-0.6b", "--dp", 2, "--share", "maybe"), "--share must be one of"),
    (("--plan", PLANS / "qwen3-1.7b-dp16-tp8-muon.plan.json", "--share", "auto"),
     "already records what it shares"),
])
def test_compare_bad_input_is_one_line(args, words):
    r = run("compare", *args)
    assert r.exit_code == 1, r.output
    assert words in r.output and len(r.output.strip().splitlines()) == 1, r.output
