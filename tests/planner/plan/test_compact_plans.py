"""Compact plan files (schema version 8): a plan of more than COMPACT_TASKS tasks is written with
what repeats stored once, reads back to the same plan, and saves byte for byte as it was read;
smaller plans keep their version's indented text; a damaged compact file is one clear line."""

from __future__ import annotations

import json

import pytest

from canzona.planner import ParallelSizes, build_inventory, get_preset
from canzona.planner.errors import PlanFileError
from canzona.planner.plan import COMPACT_VERSION, Plan
from canzona.planner.plan.build import baseline_plan
from canzona.planner.plan.compact import COMPACT_TASKS, decode, encode
from canzona.planner.plan.load import load_plan, parse_plan
from canzona.planner.plan.schema import save_plan
from canzona.planner.planning import make_problem


@pytest.fixture(scope="module")
def moe() -> Plan:
    """qwen3-30b-a3b at dp 8, tp 2, ep 4: 12,000 expert tasks and more."""
    problem = make_problem(build_inventory(get_preset("qwen3-30b-a3b")),
                           ParallelSizes(8, 2, ep=4))
    return baseline_plan(problem)


def test_a_large_plan_is_written_compact_and_reads_back_the_same(moe, tmp_path):
    assert len(moe.tasks) > COMPACT_TASKS and moe.schema_version == COMPACT_VERSION
    path = save_plan(moe, tmp_path / "moe.plan.json")
    text = path.read_text()
    data = json.loads(text)
    assert data["schema_version"] == COMPACT_VERSION and "\n" not in text.rstrip("\n")
    # every parameter's name once, the tasks' kinds a few, no task repeating its field names
    assert len(data["params"]) == len({t.param for t in moe.tasks})
    assert len(data["task_kinds"]["@rows"]) < 20
    assert data["tasks"]["@table"][0] == "param" and len(data["tasks"]["@rows"]) == len(moe.tasks)
    indented = moe.model_dump_json(indent=2)
    assert len(text) * 3 < len(indented)
    again = load_plan(path)
    assert again == moe
    assert again.to_json() == text  # saved as it was read


def test_decode_undoes_encode_exactly(moe):
    data = moe.model_dump(mode="json")
    assert decode(json.loads(json.dumps(encode(data)))) == data


def test_a_small_plan_keeps_its_indented_text():
    problem = make_problem(build_inventory(get_preset("qwen3-0.6b")), ParallelSizes(8, 2))
    plan = baseline_plan(problem)
    assert plan.schema_version < COMPACT_VERSION
    assert plan.to_json().startswith('{\n  "schema_version"')


def test_the_same_plan_indented_at_version_8_reads_too(moe, tmp_path):
    """A version-8 file written out in full (a tool's, or a hand edit) is read as it is."""
    path = tmp_path / "full.json"
    path.write_text(json.dumps(moe.model_dump(mode="json")))
    assert load_plan(path) == moe


@pytest.mark.parametrize("damage, words", [
    (lambda d: d.pop("task_kinds") and d.pop("params"), "field 'params' is missing"),
    (lambda d: d["tasks"]["@rows"][3].__setitem__(0, 10**6), "not a position in 'params'"),
    (lambda d: d["tasks"]["@rows"][0].pop(), "rows do not match its fields"),
    (lambda d: d["tasks"]["@rows"][5].__setitem__(d["tasks"]["@table"].index("kind"), -1),
     "not a position in 'task_kinds'"),
])
def test_a_damaged_compact_file_is_one_line_naming_what(moe, damage, words):
    data = json.loads(moe.to_json())
    damage(data)
    if "params" not in data:  # the markers gone: read as a full plan, whose tasks are wrong
        data["task_kinds"] = {}
    with pytest.raises(PlanFileError) as e:
        parse_plan(json.dumps(data), "moe.json")
    msg = str(e.value)
    assert "\n" not in msg and "moe.json" in msg and words in msg, msg
