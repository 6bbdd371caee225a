"""Plan schema: deterministic bytes, atomic writes, one-line errors for bad files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from canzona.planner import ParallelSizes, PlanFileError, build_inventory, get_preset
from canzona.planner.plan import (BASE_VERSION, SCHEMA_VERSION, FSDP2Plan, PipelinePlan, Plan,
                                  save_plan)
from canzona.planner.plan.load import load_plan, parse_plan
from canzona.planner.plan.build import baseline_plan
from canzona.planner.planning import make_problem
from canzona.planner.report import fsdp2_dict, inspect_report


def _plan(model="qwen3-1.7b", dp=8, tp=2) -> Plan:
    return baseline_plan(make_problem(build_inventory(get_preset(model)), ParallelSizes(dp, tp)))


def test_round_trip_and_identical_bytes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_plan(_plan(), a)
    save_plan(_plan(), b)
    assert a.read_bytes() == b.read_bytes()
    assert load_plan(a) == _plan()
    assert a.read_text().endswith("\n")


_SNIPPET = ("from canzona.planner import *; from canzona.planner.planning import *; "
            "from canzona.planner.plan.build import baseline_plan; "
            "import sys; sys.stdout.write(baseline_plan(make_problem(build_inventory("
            "get_preset('qwen3-30b-a3b')), ParallelSizes(8, 2, ep=4))).to_json())")


def test_identical_across_processes_and_hash_seeds():
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr.decode()
        outs.append(r.stdout)
    assert outs[0] == outs[1] and len(outs[0]) > 1000


def test_plan_contents():
    p = _plan()
    assert p.schema_version == BASE_VERSION  # it shares no matrix: version 2, as before sharing
    assert p.rank_layout.global_rank(3, 1) == 7 and p.rank_layout.coords(7) == (3, 1)
    assert p.fingerprint == build_inventory(get_preset("qwen3-1.7b")).fingerprint()
    names = {s.name for buf in p.buffers for b in buf.buckets for s in b.slots}
    assert names == {t.param for t in p.tasks}
    # The equal-chunk baseline's loads add up to the total.
    assert sum(p.metrics.dp_load) <= sum(t.cost for t in p.tasks)
    assert sum(p.metrics.dp_load) >= sum(t.cost for t in p.tasks) - len(p.tasks) * 8
    text = p.to_json().lower()
    assert "elapsed" not in text and "wall" not in text and "date" not in text


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "p.json"
    save_plan(_plan(), target)
    before = target.read_bytes()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(PlanFileError, match="No space left"):
        save_plan(_plan(dp=4), target)
    assert target.read_bytes() == before
    assert [f.name for f in tmp_path.iterdir()] == ["p.json"]


def test_unwritable_destination(tmp_path):
    with pytest.raises(PlanFileError, match="cannot write plan"):
        save_plan(_plan(), tmp_path / "missing" / "p.json")


@pytest.fixture()
def good(tmp_path):
    path = tmp_path / "plan.json"
    save_plan(_plan(), path)
    return json.loads(path.read_text())


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _one_line_error(path) -> str:
    with pytest.raises(PlanFileError) as e:
        load_plan(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_newer_version_asks_to_upgrade(tmp_path, good):
    msg = _one_line_error(_write(tmp_path, {**good, "schema_version": SCHEMA_VERSION + 1}))
    assert f"version {SCHEMA_VERSION + 1}" in msg and f"version {SCHEMA_VERSION}" in msg
    assert "upgrade canzona" in msg


def test_older_version_asks_to_regenerate(tmp_path, good):
    msg = _one_line_error(_write(tmp_path, {**good, "schema_version": 0}))
    assert "version 0" in msg and "regenerate" in msg


def test_malformed_files(tmp_path, good):
    assert "invalid JSON" in _one_line_error(_write(tmp_path, "{oops"))
    assert "no schema_version" in _one_line_error(_write(tmp_path, {"hello": 1}))
    assert "no schema_version" in _one_line_error(_write(tmp_path, [1, 2]))
    assert "must be an integer" in _one_line_error(_write(tmp_path, {**good,
                                                                     "schema_version": "1"}))
    missing = {k: v for k, v in good.items() if k != "tasks"}
    assert "field 'tasks'" in _one_line_error(_write(tmp_path, missing))
    extra = {**good, "surprise": True}
    assert "field 'surprise'" in _one_line_error(_write(tmp_path, extra))
    bad_cut = json.loads(json.dumps(good))
    bad_cut["buffers"][0]["buckets"][0]["cuts"][1] = -5
    assert "cuts must run monotonically" in _one_line_error(_write(tmp_path, bad_cut))
    assert "cannot read plan" in _one_line_error(str(tmp_path / "absent.json"))


def test_plan_is_frozen():
    p = _plan()
    with pytest.raises(ValidationError, match="frozen"):
        p.metrics = None  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        p.inputs.dp = 4  # type: ignore[misc]
    assert p.inputs.dp == 8 and p.metrics is not None
    assert parse_plan(p.to_json()) == p


def test_one_converter_per_older_version_applied_in_sequence(monkeypatch, good):
    """Every schema version from the oldest read to the one before the newest has its converter
    (n → n + 1), and loading applies them in order from the file's version."""
    from canzona.planner.plan import convert

    assert sorted(convert.UPGRADES) == list(range(convert.OLDEST_VERSION, SCHEMA_VERSION))
    seen = []
    for n, step in list(convert.UPGRADES.items()):
        def spy(data, source, n=n, step=step):
            seen.append(n)
            return step(data, source)
        monkeypatch.setitem(convert.UPGRADES, n, spy)
    assert parse_plan(json.dumps(good)) == _plan()
    assert seen == list(range(BASE_VERSION, SCHEMA_VERSION))
    seen.clear()
    v1 = {**good, "schema_version": 1}
    del v1["comm"]
    v1["buffers"] = [{**buf, "buckets": [{k: v for k, v in b.items() if k != "method"}
                                         for b in buf["buckets"]]} for buf in good["buffers"]]
    assert parse_plan(json.dumps(v1)).comm.converted_from == 1
    assert seen == list(range(1, SCHEMA_VERSION))


def test_parse_plan_checks_the_formulas_too(good):
    """``parse_plan`` (text) runs every check ``load_plan`` (file) runs: a task cost that does not
    match the optimizer's formulas is refused from text as from a file."""
    assert parse_plan(json.dumps(good)) == _plan()
    bad = json.loads(json.dumps(good))
    bad["tasks"][0]["flops"] += 1
    with pytest.raises(PlanFileError, match=r"field 'tasks\[0\]\.flops'") as e:
        parse_plan(json.dumps(bad), "<text>")
    assert str(e.value).startswith("<text>: inconsistent plan") and "\n" not in str(e.value)


def test_old_plans_inspect_with_their_config():
    """Every committed file of an older schema version reports through ``inspect`` with the tiny
    model's config beside it (its fingerprint matches; a version-1 file reports as converted)."""
    old = Path(__file__).resolve().parents[3] / "plans" / "old"
    files = sorted(old.glob("*.plan.json"))
    assert len(files) == SCHEMA_VERSION - 1
    for f in files:
        plan = load_plan(f)
        if isinstance(plan, FSDP2Plan):  # FSDP2's storage: its own report, strategies beside
            report = fsdp2_dict(plan, config=Path(old / "tiny-config.json"))
            assert report["strategies"], f.name
            continue
        if isinstance(plan, PipelinePlan):  # a pipeline's file: each stage reports so
            plan = plan.stage(0)
        report = inspect_report(plan, config=old / "tiny-config.json")
        assert report["baselines"], f.name
        assert (plan.comm.converted_from == 1) == f.name.endswith("-v1.plan.json")
