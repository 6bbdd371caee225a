"""`canzona inspect` on plan files edited by hand: one error line, exit 1, never a
traceback."""

from __future__ import annotations

import copy
import json

import pytest
from cli_helpers import plan_files, run


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """qwen3-0.6b at dp = 8, tp = 1 and tp = 2, as JSON."""
    files = plan_files(tmp_path_factory.mktemp("plans"), dp=8)
    return {tp: json.loads(path.read_text()) for tp, (path, _) in files.items()}


def _matrix(data):
    return next(t["id"] for t in data["tasks"] if t["optimizer"] == "matrix")


def _dp(d, v):
    d["inputs"]["dp"] = v


def _owner(d, v):
    d["tasks"][_matrix(d)]["owner"] = v


def _metric(d):
    d["metrics"]["dp_flops"][3] += 1


def _host(d):
    d["tp"]["indices"][0]["groups"][0]["tasks"][-1]["host"] = 2


EDITS = [
    # (name, tp of the plan, edit, words the error line names)
    ("dp 8 -> 4", 1, lambda d: _dp(d, 4), ("rank_layout.dp", "inputs.dp is 4")),
    ("dp 8 -> 16", 1, lambda d: _dp(d, 16), ("rank_layout.dp", "inputs.dp is 16")),
    ("dp 8 -> 4, tp 2", 2, lambda d: _dp(d, 4), ("rank_layout.dp", "inputs.dp is 4")),
    ("dp 8 -> 16, tp 2", 2, lambda d: _dp(d, 16), ("rank_layout.dp", "inputs.dp is 16")),
    ("owner -1", 1, lambda d: _owner(d, -1), (".owner'", "is -1")),
    ("owner = dp", 2, lambda d: _owner(d, 8), (".owner'", "is 8")),
    ("no tasks", 1, lambda d: d.update(tasks=[]), ("field 'tasks'", "empty")),
    ("muon -> soap", 1, lambda d: d["inputs"]["optimizer"].update(name="soap"),
     ("do not match optimizer 'soap'",)),
    ("total_params + 1", 2, lambda d: d.update(total_params=d["total_params"] + 1),
     ("total_params",)),
    ("metric changed", 1, _metric, ("metrics.dp_flops[3]",)),
    ("TP host out of range", 2, _host, (".host'", "0 … 1")),
    ("TP section removed", 2, lambda d: d.update(tp=None), ("field 'tp'", "missing")),
]


@pytest.mark.parametrize("name,tp,edit,needles", EDITS, ids=[e[0] for e in EDITS])
def test_inspect_edited_plan_is_one_error_line(tmp_path, plans, name, tp, edit, needles):
    data = copy.deepcopy(plans[tp])
    edit(data)
    path = tmp_path / "edited.plan.json"
    path.write_text(json.dumps(data, indent=2))
    for args in ((), ("--json",)):
        r = run("inspect", path, *args)
        assert r.exit_code == 1, r.output
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
        assert "Traceback" not in r.output and r.stdout == "", r.output
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
        assert str(path) in lines[0] and "regenerate it with 'canzona plan'" in lines[0], lines[0]
        for n in needles:
            assert n in lines[0], lines[0]


def test_tp_section_added_to_a_tp1_plan(tmp_path, plans):
    data = copy.deepcopy(plans[1])
    data["tp"] = copy.deepcopy(plans[2]["tp"])
    path = tmp_path / "edited.plan.json"
    path.write_text(json.dumps(data))
    r = run("inspect", path)
    assert r.exit_code == 1 and "Traceback" not in r.output
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "field 'tp'" in lines[0] and "inputs.tp is 1" in lines[0], r.stderr


def test_unedited_plans_still_inspect(tmp_path, plans):
    for tp, data in plans.items():
        path = tmp_path / f"p{tp}.plan.json"
        path.write_text(json.dumps(data))
        r = run("inspect", path, "--top", 0)
        assert r.exit_code == 0, r.output
