"""Plans that parse but contradict themselves fail to load in one line, and plan
files get the permissions of any new file under the umask (defect 7)."""

from __future__ import annotations

import copy
import json
import os
import random
import stat
from pathlib import Path

import pytest

import canzona
from canzona.planner import (OptimizerSettings, ParallelSizes, PlanFileError, build_inventory,
                             get_preset)
from canzona.planner.pipeline import plan_problem
from canzona.planner.plan import Plan, save_plan
from canzona.planner.plan.checks import check_plan
from canzona.planner.plan.load import load_plan, parse_plan
from canzona.planner.plan.build import baseline_plan
from canzona.planner.planning import make_problem

PLANS = Path(__file__).resolve().parents[3] / "plans"


def _make(model: str, dp: int, tp: int, ep: int = 1, cost: str = "flops", **settings) -> Plan:
    problem = make_problem(build_inventory(get_preset(model)), ParallelSizes(dp, tp, ep=ep),
                           OptimizerSettings(**settings), cost=cost)
    return plan_problem(problem)


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    """Real plans as JSON: tp = 1, tp = 2, and an MoE plan with ep = 4 (expert buffers over edp)."""
    made = {"tp1": _make("qwen3-0.6b", 8, 1), "tp2": _make("qwen3-0.6b", 8, 2),
            "moe": _make("qwen3-30b-a3b", 8, 2, ep=4)}
    # the plan's data in full (the MoE plan's file is compact, version 8; read alike written out)
    return {k: p.model_dump(mode="json") for k, p in made.items()}


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "edited.plan.json"
    path.write_text(json.dumps(data))
    return path


def _error(tmp_path: Path, data: dict, *needles: str) -> str:
    """The one-line PlanFileError of loading ``data``, naming the file and every needle."""
    path = _write(tmp_path, data)
    with pytest.raises(PlanFileError) as e:
        load_plan(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


def _matrix_task(data: dict) -> int:
    return next(t["id"] for t in data["tasks"] if t["optimizer"] == "matrix")


# --- what the planner writes passes -------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in PLANS.glob("*.plan.json")))
def test_every_committed_example_plan_passes(name):
    plan = load_plan(PLANS / name)
    assert plan.tp is not None and plan.inputs.tp > 1


@pytest.mark.parametrize("model,dp,tp,ep,cost,settings", [
    ("qwen3-0.6b", 4, 2, 1, "flops", {"name": "shampoo"}),
    ("qwen3-0.6b", 4, 2, 1, "flops", {"name": "soap", "split_qkv": True, "split_gate_up": True}),
    ("qwen3-0.6b", 4, 1, 1, "numel", {"name": "muon", "ns_steps": 3}),
    ("llama3-8b", 4, 2, 1, "flops", {}),
    ("qwen3-1.7b", 2, 4, 1, "flops", {}),
])
def test_plans_of_every_optimizer_cost_and_size_pass(tmp_path, model, dp, tp, ep, cost, settings):
    plan = _make(model, dp, tp, ep, cost, **settings)
    check_plan(plan)
    path = save_plan(plan, tmp_path / "p.json")
    assert load_plan(path) == plan


def test_baseline_plans_pass_with_and_without_split_matrices(tmp_path):
    problem = make_problem(build_inventory(get_preset("qwen3-30b-a3b")), ParallelSizes(8, 2, ep=4))
    for strategy in ("asc", "zero1"):  # zero1 charges split matrices by fragments
        plan = baseline_plan(problem, strategy)
        # Both keep ZeRO-1's equal cuts, so they split exactly the matrices the layout says.
        assert plan.tp is None
        assert plan.metrics.split_matrices == len(problem.layout.split_matrices()) == 431
        check_plan(plan)


def test_fixture_plans_pass_and_top_level_load_plan_validates(tmp_path, plans):
    for data in plans.values():
        path = _write(tmp_path, data)
        assert load_plan(path) == canzona.load_plan(path) == parse_plan(path.read_text())
    bad = copy.deepcopy(plans["tp1"])
    bad["total_params"] += 1
    with pytest.raises(PlanFileError, match="total_params"):
        canzona.load_plan(_write(tmp_path, bad))


# --- sizes against cuts --------------------------------------------------------------------------


@pytest.mark.parametrize("new_dp", [4, 16])
def test_inputs_dp_edited(tmp_path, plans, new_dp):
    for key in ("tp1", "tp2"):
        data = copy.deepcopy(plans[key])
        data["inputs"]["dp"] = new_dp
        _error(tmp_path, data, "field 'rank_layout.dp'", f"inputs.dp is {new_dp}",
               "regenerate it with 'canzona plan'")


def test_dp_edited_in_inputs_and_rank_layout(tmp_path, plans):
    data = copy.deepcopy(plans["tp2"])
    data["inputs"]["dp"] = data["rank_layout"]["dp"] = 4
    _error(tmp_path, data, "field 'buffers[0].dp_size'", "inputs.dp = 4")


def test_dp_edited_everywhere_but_the_cuts(tmp_path, plans):
    data = copy.deepcopy(plans["tp1"])
    data["inputs"]["dp"] = data["rank_layout"]["dp"] = 4
    for buf in data["buffers"]:
        buf["dp_size"] = 4
    for name in ("dp_load", "dp_flops", "dp_state_bytes", "dp_reduce_scatter_bytes"):
        data["metrics"][name] = data["metrics"][name][:4]
    _error(tmp_path, data, "field 'buffers[0].buckets[0].cuts'", "9 entries", "dp_size + 1 = 5")


def test_expert_buffer_uses_the_expert_data_parallel_size(tmp_path, plans):
    data = copy.deepcopy(plans["moe"])
    k = next(i for i, b in enumerate(data["buffers"]) if b["expert"])
    assert data["buffers"][k]["dp_size"] == 8 * 2 // (4 * 2)  # edp = dp·tp / (ep·etp)
    data["buffers"][k]["dp_size"] = 8
    _error(tmp_path, data, f"field 'buffers[{k}].dp_size'", "edp", "= 2")
    data = copy.deepcopy(plans["moe"])
    data["inputs"]["ep"] = 2
    _error(tmp_path, data, "dp_size", "edp")


def test_metric_tuples_have_one_entry_per_dp_index(tmp_path, plans):
    data = copy.deepcopy(plans["tp1"])
    data["metrics"]["dp_state_bytes"].append(0)
    _error(tmp_path, data, "field 'metrics.dp_state_bytes'", "9 entries", "inputs.dp is 8")


# --- owners, tasks, totals ------------------------------------------------------------------------


@pytest.mark.parametrize("owner", [-1, 8])
def test_owner_out_of_range(tmp_path, plans, owner):
    for key in ("tp1", "tp2", "moe"):
        data = copy.deepcopy(plans[key])
        i = _matrix_task(data)
        data["tasks"][i]["owner"] = owner
        _error(tmp_path, data, f"field 'tasks[{i}].owner'", f"is {owner}", "0 … 7")


def test_owner_against_the_cuts(tmp_path, plans):
    data = copy.deepcopy(plans["tp1"])
    i = _matrix_task(data)
    data["tasks"][i]["owner"] = (data["tasks"][i]["owner"] + 1) % 8
    _error(tmp_path, data, f"field 'tasks[{i}].owner'", "cuts")


def test_no_tasks_and_bad_ids(tmp_path, plans):
    data = copy.deepcopy(plans["tp1"])
    data["tasks"] = []
    _error(tmp_path, data, "field 'tasks'", "empty")
    data = copy.deepcopy(plans["tp1"])
    data["tasks"][1]["id"] = 0
    _error(tmp_path, data, "field 'tasks[1].id'", "0 …")
    data = copy.deepcopy(plans["tp1"])
    del data["tasks"][-1]
    _error(tmp_path, data, "has no task")


def test_task_param_not_in_any_slot(tmp_path, plans):
    data = copy.deepcopy(plans["tp1"])
    data["tasks"][0]["param"] = "no.such.weight"
    _error(tmp_path, data, "field 'tasks[0].param'", "no.such.weight")


@pytest.mark.parametrize("key", ["tp1", "tp2", "moe"])
def test_total_params(tmp_path, plans, key):
    data = copy.deepcopy(plans[key])
    data["total_params"] += 1
    _error(tmp_path, data, "field 'total_params'")


def test_total_params_is_the_global_count_under_tp_and_ep(plans):
    models = {"tp1": "qwen3-0.6b", "tp2": "qwen3-0.6b", "moe": "qwen3-30b-a3b"}
    for key, data in plans.items():
        # Tasks have logical (global) shapes; slots hold TP-local shards.
        assert data["total_params"] == build_inventory(get_preset(models[key])).total_params
        slots = sum(s["end"] - s["start"] for b in data["buffers"] for k in b["buckets"]
                    for s in k["slots"])
        assert (slots < data["total_params"]) == (data["inputs"]["tp"] > 1)


# --- costs against the optimizer ----------------------------------------------------------------


@pytest.mark.parametrize("key", ["tp1", "tp2"])
def test_optimizer_name_edited(tmp_path, plans, key):
    data = copy.deepcopy(plans[key])
    data["inputs"]["optimizer"]["name"] = "soap"
    _error(tmp_path, data, ".flops'", "the task costs do not match optimizer 'soap'",
           "match 'muon'")


def test_optimizer_setting_edited(tmp_path, plans):
    data = copy.deepcopy(plans["tp1"])
    data["inputs"]["optimizer"]["ns_steps"] = 6
    _error(tmp_path, data, ".flops'", "optimizer 'muon'")


def test_task_costs(tmp_path, plans):
    i = _matrix_task(plans["tp2"])
    for field in ("flops", "state_bytes", "cost", "tp_comm_bytes"):
        data = copy.deepcopy(plans["tp2"])
        data["tasks"][i][field] += 1
        _error(tmp_path, data, f"field 'tasks[{i}].{field}'")


# --- totals against tasks and metrics -------------------------------------------------------------


@pytest.mark.parametrize("name", ["dp_load", "dp_flops", "dp_state_bytes",
                                  "dp_reduce_scatter_bytes"])
def test_metric_changed(tmp_path, plans, name):
    for key in ("tp1", "moe"):
        data = copy.deepcopy(plans[key])
        data["metrics"][name][3] += 1
        _error(tmp_path, data, f"field 'metrics.{name}[3]'", "DP index 3")


def test_dp_totals_are_owned_tasks_plus_the_adamw_share(plans):
    """The relation the check enforces, spelled out: whole matrix tasks per owner, AdamW
    parameters shared by their elements in each slice (the shares of one add up to it)."""
    for data in plans.values():
        m, tasks = data["metrics"], data["tasks"]
        matrix = [0] * 8
        for t in tasks:
            if t["optimizer"] == "matrix":
                matrix[t["owner"]] += t["flops"]
        adamw = sum(t["flops"] for t in tasks if t["optimizer"] == "adamw")
        assert sum(m["dp_flops"]) == sum(matrix) + adamw
        assert all(f >= x for f, x in zip(m["dp_flops"], matrix))


def test_bounds_and_ratios(tmp_path, plans):
    for field, delta in (("lower_bound", 1), ("max_over_mean", 0.5), ("gap_to_bound", 0.5),
                         ("split_matrices", 1)):
        data = copy.deepcopy(plans["tp1"])
        data["metrics"][field] += delta
        _error(tmp_path, data, f"field 'metrics.{field}'")


# --- the TP section against tp --------------------------------------------------------------------


def test_tp_section_removed_or_added(tmp_path, plans):
    data = copy.deepcopy(plans["tp2"])
    data["tp"] = None
    _error(tmp_path, data, "field 'tp'", "missing", "inputs.tp is 2")
    data = copy.deepcopy(plans["tp1"])
    data["tp"] = copy.deepcopy(plans["tp2"]["tp"])
    _error(tmp_path, data, "field 'tp'", "inputs.tp is 1")


def test_tp_host_out_of_range(tmp_path, plans):
    data = copy.deepcopy(plans["tp2"])
    gt = data["tp"]["indices"][0]["groups"][0]["tasks"][-1]
    gt["host"] = 2
    _error(tmp_path, data, "field 'tp.indices[0].groups[0].tasks[", ".host'", "0 … 1")
    data = copy.deepcopy(plans["tp2"])
    i = next(t["id"] for t in data["tasks"] if t["host"] is not None)
    data["tasks"][i]["host"] = 5
    _error(tmp_path, data, f"field 'tasks[{i}].host'", "0 … 1")


def test_tp_shapes_and_ids(tmp_path, plans):
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["indices"].pop()
    _error(tmp_path, data, "field 'tp.indices'", "inputs.dp is 8")
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["indices"][0]["groups"][0]["gather_send"][0].append(0)
    _error(tmp_path, data, "gather_send'", "2 × 2")
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["metrics"]["gpu_load"].pop()
    _error(tmp_path, data, "field 'tp.metrics.gpu_load'", "8 × 2")
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["indices"][0]["groups"][0]["tasks"][0]["id"] = len(data["tasks"])
    _error(tmp_path, data, ".id'", "the plan's tasks are 0 …")
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["indices"][0]["groups"][0]["tasks"].pop(0)
    _error(tmp_path, data, ".host'", "in no micro-group")


def test_tp_numbers(tmp_path, plans):
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["indices"][1]["groups"][0]["gather_send"][0][1] += 1
    _error(tmp_path, data, "field 'tp.indices[1].groups[0].gather_send'")
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["indices"][1]["groups"][0]["rank_load"][0] += 1
    _error(tmp_path, data, "field 'tp.indices[1].groups[0].rank_load'")
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["metrics"]["gpu_load"][2][1] += 10
    _error(tmp_path, data, "field 'tp.metrics.gpu_load[2][1]'")
    data = copy.deepcopy(plans["tp2"])
    data["tp"]["metrics"]["all_to_all_bytes"][2][1] += 1
    _error(tmp_path, data, "field 'tp.metrics.all_to_all_bytes[2][1]'")
    data = copy.deepcopy(plans["moe"])
    data["tp"]["metrics"]["lb_gpu"] += 1
    _error(tmp_path, data, "field 'tp.metrics.lb_gpu'")


def test_random_edits_load_or_fail_in_one_line(tmp_path, plans):
    """Any edit of a number either still gives a consistent plan or a one-line PlanFileError."""
    base = plans["tp2"]
    leaves: list[tuple] = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*path, k))
        elif isinstance(x, list):
            for k, v in enumerate(x):
                walk(v, (*path, k))
        elif isinstance(x, int) and not isinstance(x, bool):
            leaves.append(path)

    walk(base, ())
    rng = random.Random(9)
    failed = 0
    for path in rng.sample(leaves, 150):
        data = copy.deepcopy(base)
        node = data
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = rng.choice([node[path[-1]] + 1, node[path[-1]] - 1, -1, 0, 10**12])
        try:
            load_plan(_write(tmp_path, data))
        except PlanFileError as e:
            assert "\n" not in str(e)
            failed += 1
    assert failed > 100


# --- defect 7: plan files get 0666 & ~umask -------------------------------------------------------


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_saved_plan_mode_follows_the_umask(tmp_path, plans, umask, mode):
    plan = Plan.model_validate(plans["tp1"])
    old = os.umask(umask)
    try:
        path = save_plan(plan, tmp_path / "p.plan.json")
        again = save_plan(plan, tmp_path / "p.plan.json")  # replacing keeps the rule
    finally:
        os.umask(old)
    assert path == again
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert [f.name for f in tmp_path.iterdir()] == ["p.plan.json"]  # no temporary file left
    assert load_plan(path) == plan


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_failed_save_removes_its_temporary_file(tmp_path, plans, monkeypatch):
    plan = Plan.model_validate(plans["tp1"])

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(PlanFileError, match="No space left"):
        save_plan(plan, tmp_path / "p.plan.json")
    assert list(tmp_path.iterdir()) == []
