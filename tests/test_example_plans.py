"""The committed example plans (plans/) are what the planner makes today, byte for byte."""

import importlib.util
import subprocess
import sys
from pathlib import Path

PLANS = Path(__file__).resolve().parents[1] / "plans"


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("plans_regenerate", PLANS / "regenerate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_regenerate_is_deterministic_in_process():
    mod = _regenerate_module()
    a = mod.build("qwen3-1.7b", 16, 8).to_json()
    b = mod.build("qwen3-1.7b", 16, 8).to_json()
    assert a == b


def test_cli_in_a_fresh_process_reproduces_the_committed_plan(tmp_path):
    mod = _regenerate_module()
    assert len(mod.CASES) == 15
    name = mod.plan_name("qwen3-1.7b", 16, 8)
    committed = PLANS / name
    assert committed.exists(), "run: python plans/regenerate.py"
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "canzona.cli.main", "plan", "--model", "qwen3-1.7b",
                        "--dp", "16", "--tp", "8", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == committed.read_bytes(), (
        f"plans/{name} is stale (the planner changed): run python plans/regenerate.py")


def test_old_schema_versions_load_and_convert(tmp_path, monkeypatch):
    """plans/old holds a file of every older schema version; each loads (and the version-1 one
    converts). A missing version, or a file that no longer loads, is named."""
    mod = _regenerate_module()
    assert mod.old_versions_problems() == []
    for path in mod.OLD.glob("*.plan.json"):
        if "-v3." not in path.name:
            (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"))
    v2 = tmp_path / "tiny-dp2-tp2-v2.plan.json"
    v2.write_text(v2.read_text().replace('"total_params": ', '"total_params": 1'))
    monkeypatch.setattr(mod, "OLD", tmp_path)
    problems = mod.old_versions_problems()
    assert any("no file of schema version 3" in p for p in problems), problems
    assert any(p.startswith("plans/old/tiny-dp2-tp2-v2.plan.json: does not load")
               and "total_params" in p for p in problems), problems
    assert len(problems) == 2
