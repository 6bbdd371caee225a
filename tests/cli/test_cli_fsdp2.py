"""FSDP2 storage through the CLI: ``plan --storage fsdp2``, ``inspect``, ``simulate`` and
``compare`` of its plan (the FSDP2 strategies side by side), and the bad input they refuse in
one line."""

import json

import pytest

from canzona.planner.plan import FSDP2Plan
from canzona.planner.plan.load import load_plan
from cli_helpers import one_error_line, run


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp2")
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 8, "--storage", "fsdp2", "--hardware",
            "h800", "-o", folder)
    assert r.exit_code == 0, r.output
    return folder / "qwen3-0.6b-dp8-tp1-fsdp2-muon.plan.json", r.output


def test_plan_writes_an_fsdp2_plan_and_shows_the_strategies(sharded):
    path, out = sharded
    p = load_plan(path)
    assert isinstance(p, FSDP2Plan) and p.inputs.dp == 8 and p.fsdp2.hardware == "h800"
    assert "FSDP2 storage" in out and "all-to-all rounds" in out
    for name in ("canzona", "dist-muon", "sync"):
        assert name in out


@pytest.mark.parametrize("command", ["inspect", "simulate"])
def test_inspect_and_simulate_report_the_modelled_step(sharded, command: str):
    path, _ = sharded
    r = run(command, path, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)["fsdp2"]
    rows = {s["strategy"]: s for s in d["strategies"]}
    assert rows["canzona"]["step_s"] == d["modelled_step_s"] >= d["bound_s"] > 0
    assert rows["canzona"]["step_s"] <= rows["dist-muon"]["step_s"] < rows["sync"]["step_s"]


def test_compare_plans_fsdp2_or_reads_its_plan(sharded):
    path, _ = sharded
    made = run("compare", "--model", "qwen3-0.6b", "--dp", 8, "--storage", "fsdp2",
               "--hardware", "h800", "--json")
    read = run("compare", "--plan", path, "--json")
    assert made.exit_code == read.exit_code == 0, made.output + read.output
    assert json.loads(made.output) == json.loads(read.output)


@pytest.mark.parametrize("args, needles", [
    (("plan", "--model", "qwen3-0.6b", "--dp", 4, "--pp", 2, "--storage", "fsdp2"),
     ("--pp 2", "pp 1")),
    (("plan", "--model", "qwen3-0.6b", "--dp", 4, "--storage", "ddp"), ("--storage",)),
])
def test_bad_plans_are_refused_in_one_line(tmp_path, args, needles):
    one_error_line(run(*args, "-o", tmp_path), *needles)


@pytest.mark.parametrize("args, needles", [
    (("inspect", "{p}", "--stage", 1), ("--stage", "FSDP2 plan")),
    (("simulate", "{p}", "--hardware", "h100"), ("--hardware h100", "re-plan")),
    (("compare", "--plan", "{p}", "--pp", 2), ("--pp",)),
    (("compare", "--plan", "{p}", "--storage", "zero1"), ("--storage zero1", "fsdp2")),
    (("compare", "--plan", "{p}", "--dp", 4), ("--dp 4",)),
])
def test_options_that_do_not_apply_are_refused(sharded, args, needles):
    path, _ = sharded
    one_error_line(run(*(str(path) if a == "{p}" else a for a in args)), *needles)


def test_fsdp2_with_tp_sets_every_strategy_on_the_whole_mesh():
    """dp 2 × tp 2 is four owners for every strategy, as dp 4 is."""
    mesh = run("compare", "--model", "qwen3-0.6b", "--dp", 2, "--tp", 2, "--storage", "fsdp2",
               "--json")
    flat = run("compare", "--model", "qwen3-0.6b", "--dp", 4, "--storage", "fsdp2", "--json")
    assert mesh.exit_code == flat.exit_code == 0, mesh.output + flat.output
    a, b = json.loads(mesh.output)["fsdp2"], json.loads(flat.output)["fsdp2"]
    assert (a["dp"], a["tp"]) == (2, 2)
    rounds = {d["strategy"]: d["rounds"] for d in a["strategies"]}
    assert rounds == {d["strategy"]: d["rounds"] for d in b["strategies"]}
