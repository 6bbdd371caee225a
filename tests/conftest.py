"""Fixtures every test folder shares."""

from __future__ import annotations

import json

import pytest


def _as_version_1(plan_json: str) -> dict:
    """A schema-2 plan's JSON as its schema-1 dict: no ``comm`` section, no bucket methods, no
    recorded objective (what canzona wrote before plan schema 2)."""
    data = json.loads(plan_json)
    data["schema_version"] = 1
    del data["comm"]
    del data["inputs"]["solver"]["objective"]
    for buf in data["buffers"]:
        for b in buf["buckets"]:
            del b["method"]
    return data


@pytest.fixture
def as_version_1():
    """:func:`_as_version_1`: a plan's JSON text → the schema-1 dict of the same plan."""
    return _as_version_1


@pytest.fixture
def refused_edit(tmp_path):
    """``refused_edit(plan, edit)``: the one-line ``PlanFileError`` that loading ``plan``'s JSON
    after ``edit(data)`` (a change in place) raises (the test fails if it loads)."""
    from canzona.planner.errors import PlanFileError
    from canzona.planner.validate import load_plan

    def refuse(plan, edit) -> str:
        data = json.loads(plan.to_json())
        edit(data)
        path = tmp_path / "edited.plan.json"
        path.write_text(json.dumps(data))
        with pytest.raises(PlanFileError) as info:
            load_plan(path)
        return str(info.value)

    return refuse
