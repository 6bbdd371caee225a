"""`canzona calibrate --quick`: a profile the planner loads and plans with."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from canzona.planner.hardware import load_hardware


def _canzona(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "canzona.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=cwd)


def test_calibrate_quick_writes_a_profile_the_planner_uses(tmp_path):
    out = tmp_path / "me.json"
    r = _canzona("calibrate", "--quick", "--name", "this-box", "-o", out)
    assert r.returncode == 0, r.stderr
    hw = load_hardware(out)
    assert hw.name == "this-box" and hw.compute_efficiency == 1.0
    numbers = [*hw.peak_flops.values(), hw.memory_bytes, hw.memory_bandwidth,
               hw.intra_node.busbw, hw.inter_node.busbw, *hw.calibration.values()]
    assert all(math.isfinite(x) and x > 0 for x in numbers)
    assert hw.intra_node.latency_s >= 0 and set(hw.peak_flops) >= {"fp32", "bf16"}
    assert any(k.startswith("newton_schulz") for k in hw.calibration)
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, no temporary left
    # the planner takes it by path and records it
    plan = tmp_path / "p.json"
    r = _canzona("plan", "--model", "qwen3-0.6b", "--dp", "2", "--hardware", out, "-o", plan)
    assert r.returncode == 0, r.stderr
    comm = json.loads(plan.read_text())["comm"]
    assert comm["hardware"] == "this-box" and comm["busbw"] == hw.intra_node.busbw
    # a folder that does not exist: one line, before measuring anything
    r = _canzona("calibrate", "--quick", "-o", tmp_path / "no" / "me.json")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "cannot write hardware profile" in r.stderr and "does not exist" in r.stderr
