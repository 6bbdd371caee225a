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
