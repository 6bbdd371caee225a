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
