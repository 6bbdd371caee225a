"""Muon's Newton–Schulz schedule in the plan: ``canzona plan --ns/--ns-steps`` records it (schema
version 6 when it is not ``simple``), the planner costs its steps, and the runtime takes it from
the plan and refuses another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import canzona
from canzona.planner import OptimizerSettings
from canzona.planner.plan import BASE_VERSION, RECIPE_VERSION
from canzona.planner.settings import NS_SCHEDULES, ns_schedule

from cli_helpers import run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "plans" / "old" / "tiny-config.json"


def _plan(tmp_path: Path, *extra: object):
    out = tmp_path / f"p{len(list(tmp_path.iterdir()))}.plan.json"
    r = run("plan", "--config", TINY, "--dp", 2, "--tp", 2, "--bucket-size", 20000, "-o", out,
            *extra)
    assert r.exit_code == 0, r.output
    return canzona.load_plan(out), json.loads(out.read_text())


def _muon_flops(plan) -> int:
    return sum(t.flops for t in plan.tasks if t.optimizer == "matrix")


def test_the_default_schedule_is_not_written_and_keeps_the_base_version(tmp_path):
    plan, data = _plan(tmp_path)
    assert "ns_coefficients" not in data["inputs"]["optimizer"]
    assert plan.inputs.optimizer.ns_coefficients == "simple"
    assert plan.schema_version == BASE_VERSION


def test_a_named_schedule_and_its_steps_are_recorded_and_costed(tmp_path):
    base, _ = _plan(tmp_path)
    plan, data = _plan(tmp_path, "--ns", "polar_express", "--ns-steps", 8)
    assert data["inputs"]["optimizer"]["ns_coefficients"] == "polar_express"
    assert plan.inputs.optimizer.ns_steps == 8
    assert plan.schema_version == RECIPE_VERSION
    # Muon's matmul FLOPs are ns_steps times one step's: 8 steps cost 8/5 of 5
    assert _muon_flops(plan) * 5 == _muon_flops(base) * 8
    r = run("inspect", tmp_path / "p1.plan.json", "--config", TINY)
    assert r.exit_code == 0, r.output
    assert "NS polar_express × 8" in r.stdout


def test_per_step_coefficients_are_recorded(tmp_path):
    plan, _ = _plan(tmp_path, "--ns", "3.4445,-4.775,2.0315; 3,-3.2,1.2")
    assert plan.inputs.optimizer.ns_coefficients == ((3.4445, -4.775, 2.0315), (3.0, -3.2, 1.2))
    # a shorter list than ns_steps repeats its last step
    assert ns_schedule(plan.inputs.optimizer.ns_coefficients, 4)[1:] == ((3.0, -3.2, 1.2),) * 3


@pytest.mark.parametrize("bad", ["polar", "1,2;3", "1,2,x", ";"])
def test_a_bad_schedule_fails_in_one_line_naming_the_choices(tmp_path, bad):
    r = run("plan", "--config", TINY, "--dp", 2, "-o", tmp_path / "x.json", "--ns", bad)
    assert r.exit_code == 1 and r.stdout == ""
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith("error: --ns must be one of:")
    assert all(name in line for name in NS_SCHEDULES)
    assert not (tmp_path / "x.json").exists()


def test_an_unknown_schedule_in_the_settings_names_the_choices():
    with pytest.raises(ValueError, match="unknown schedule 'cans'; choose one of simple, quintic, "
                                         "polar_express"):
        OptimizerSettings(ns_coefficients="cans")


# --- the runtime takes the plan's schedule -------------------------------------------------------

torch = pytest.importorskip("torch")


def _kernel(plan, **options):
    from canzona.runtime.checks import build_matrix_kernel

    _, kernel, _ = build_matrix_kernel(plan, optimizer=None, explicit={}, options=options,
                                       ns_dtype=torch.float32)
    return kernel


def test_the_runtime_takes_the_plans_schedule_and_refuses_another(tmp_path):
    from canzona.runtime.errors import PlanMismatchError

    plan, _ = _plan(tmp_path, "--ns", "quintic", "--ns-steps", 7)
    cfg = _kernel(plan).config
    assert cfg.ns_steps == 7 and cfg.schedule == ns_schedule("quintic", 7)
    assert _kernel(plan, ns_coefficients=list(NS_SCHEDULES["quintic"])).config.ns_steps == 7
    with pytest.raises(PlanMismatchError, match=r"ns_coefficients='polar_express' disagrees "
                                                r"with the plan.*canzona plan --ns"):
        _kernel(plan, ns_coefficients="polar_express")


def test_a_default_plan_accepts_torchs_one_triple_and_refuses_another_schedule(tmp_path):
    from canzona.runtime.errors import PlanMismatchError

    plan, _ = _plan(tmp_path)
    assert _kernel(plan, ns_coefficients=(3.4445, -4.7750, 2.0315)).config.schedule == \
        ns_schedule("simple", 5)
    with pytest.raises(PlanMismatchError, match="canzona plan --ns"):
        _kernel(plan, ns_coefficients="quintic")
