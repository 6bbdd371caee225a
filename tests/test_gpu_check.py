"""``benchmarks/gpu_check.py --smoke``: every section of the GPU check on the CPU (gloo), so the
script a GPU owner runs unattended keeps working. Its own checks do the asserting (exit 1 on any
failure); here its JSON is read back for the figures they rest on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_smoke_runs_every_section_and_its_checks_hold(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ["runtime", "streams", "newton_schulz", "shared_ns", "calibrate"]
    assert {n: r["status"] for n, r in sections.items()} == dict.fromkeys(sections, "ok")
    runtime = sections["runtime"]
    # every named method runs over the one-rank group and gives the bucket copy's bits
    assert set(runtime["runs"]) == {"local", "padded", "per_root", "all_to_all", "all_reduce"}
    assert runtime["max_rel_diff_between_methods"] == 0.0
    assert runtime["max_rel_diff_vs_cpu"] == 0.0  # the CPU against itself
    assert sections["streams"]["all_to_all_mismatches"] == 0
    assert sections["streams"]["gram_rel_diff"]["fp32"] < 1e-5
    shapes = {tuple(r["shape"]) for r in sections["newton_schulz"]["rows"]}
    assert (51200 // 32, 5120 // 32) in shapes  # qwen3-32b's fc1, divided for the CPU
    steps = sections["calibrate"]["steps"]
    assert steps["shipped"]["step_ms"] > 0 and steps["calibrated"]["step_ms"] > 0
    assert "runtime" in run.stdout and "calibrate" in run.stdout  # the table


def test_without_a_gpu_it_says_to_use_smoke(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--smoke" in run.stderr
    assert not (tmp_path / "x.json").exists()
