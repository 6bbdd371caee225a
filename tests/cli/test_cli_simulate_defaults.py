"""``canzona simulate`` runs a plan behind the same forward/backward as ``canzona compare``
(6·N_active·tokens at the MFU), so both print the same step for the same plan, and both print
the step from the gradients reduced on (the paper's accounting) beside the whole step."""

from __future__ import annotations

import json

import pytest

from cli_helpers import run


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim") / "p.plan.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "-o", str(path))
    assert r.exit_code == 0, r.output
    return path


def test_simulate_and_compare_give_the_same_steps(plan_file):
    sim = json.loads(run("simulate", str(plan_file), "--json").stdout)
    comp = json.loads(run("compare", "--plan", str(plan_file), "--json").stdout)
    row = next(r for r in comp["strategies"] if r["strategy"] == "canzona")
    assert sim["step_s"] == pytest.approx(row["step_s"], rel=1e-6)
    assert sim["reduced_step_s"] == pytest.approx(row["reduced_step_s"], rel=1e-6)
    assert sim["forward_backward"]["backward_s"] == pytest.approx(
        comp["forward_backward_s"] * 2 / 3, rel=1e-6)
    assert 0 < sim["reduced_step_s"] <= sim["step_s"]


def test_backward_zero_hides_nothing_and_the_human_report_labels_both(plan_file):
    hidden = json.loads(run("simulate", str(plan_file), "--json").stdout)
    bare = json.loads(run("simulate", str(plan_file), "--backward", 0, "--json").stdout)
    assert bare["step_s"] > hidden["step_s"]  # nothing hides the reduce-scatters
    text = run("simulate", str(plan_file)).stdout
    assert "whole" in text and "after the gradients are reduced" in text
    assert "MFU 0.4" in text


def test_backward_and_forward_backward_together_are_refused(plan_file):
    r = run("simulate", str(plan_file), "--backward", 1, "--forward-backward", 2)
    assert r.exit_code == 1 and "not both" in r.output


def test_plan_prints_the_predicted_step_first_and_simulate_agrees(tmp_path):
    path = tmp_path / "q.plan.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "-o", str(path), "--json")
    assert r.exit_code == 0, r.output
    predicted = json.loads(r.stdout)["predicted"]
    sim = json.loads(run("simulate", str(path), "--json").stdout)
    assert predicted["step_s"] == pytest.approx(sim["step_s"], rel=1e-12)
    assert predicted["reduced_step_s"] == pytest.approx(sim["reduced_step_s"], rel=1e-12)
    assert predicted["decided_by"] == max(predicted["parts_s"], key=predicted["parts_s"].get)
    text = run("plan", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "-o",
               str(tmp_path / "again.json")).stdout.splitlines()
    assert text[1].startswith("predicted optimizer step")
    assert any(line.startswith("decided by") for line in text[2:5])


def test_every_command_gives_the_step_under_one_name(plan_file):
    got = {
        "plan": json.loads(run("plan", "--model", "qwen3-0.6b", "--dp", 4, "--tp", 2, "-o",
                               str(plan_file.parent / "again.json"), "--json").stdout)["predicted"],
        "inspect": json.loads(run("inspect", str(plan_file), "--json").stdout)["predicted"],
        "simulate": json.loads(run("simulate", str(plan_file), "--json").stdout),
        "compare": next(r for r in json.loads(run("compare", "--plan", str(plan_file),
                                                  "--json").stdout)["strategies"]
                        if r["strategy"] == "canzona"),
    }
    for key in ("step_s", "reduced_step_s"):
        values = {name: d[key] for name, d in got.items()}
        assert max(values.values()) == pytest.approx(min(values.values()), rel=1e-6), values


@pytest.mark.parametrize("cost", ["flops", "roofline"])
def test_a_plan_made_with_a_profile_file_is_planned_and_inspected(tmp_path, cost):
    """The plan records the file's profile by name only: plan predicts the step with the file
    it was given; inspect says how to predict it, and reports the rest (a roofline plan's loads,
    priced on that profile, are not recomputed)."""
    from canzona.planner.hardware import load_hardware

    box = load_hardware("h800").model_copy(update={"name": "this-box"})
    profile = tmp_path / "box.json"
    profile.write_text(box.model_dump_json())
    path = tmp_path / "p.json"
    r = run("plan", "--model", "qwen3-0.6b", "--dp", 2, "--hardware", str(profile), "-o",
            str(path), "--cost", cost)
    assert r.exit_code == 0, r.output
    assert "predicted optimizer step" in r.stdout and "on this-box" in r.stdout
    r = run("inspect", str(path))
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())  # the terminal's line breaks aside
    assert "'this-box' is not built in" in text and "--hardware FILE.json" in text


def test_plan_and_inspect_print_the_same_load_figures_for_a_plan_with_pairs(tmp_path):
    """A TP pair's pieces carry their exchanges in their loads, so the loads are not the FLOPs:
    ``plan`` prints the load row (what the bound speaks of) with the same max, mean and
    max/mean as ``inspect``."""
    import re

    path = tmp_path / "p.json"
    r = run("plan", "--model", "qwen3-4b", "--dp", 4, "--tp", 4, "--share", "pairs",
            "--cost", "flops", "-o", str(path))
    assert r.exit_code == 0, r.output
    row = re.search(r"load \(flops\)\s+(\S+ \S+)\s+(\S+ \S+)\s+([\d.]+)", r.stdout)
    assert row, r.stdout
    r = run("inspect", str(path))
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert f"max load {row[1]}, mean {row[2]}; max/mean {row[3]}" in text, (row.groups(), text)
