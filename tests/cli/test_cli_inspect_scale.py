"""``canzona inspect`` stays readable at 1,024 DP indices: a summary of distributions and the
busiest indices instead of a row per index (``--ranks all`` lists every one), and charts that
draw no mark per index above 64 of them and stay under 3,000 px wide.

The fixture is ``canzona plan --model qwen3-8b --dp 1024 -o …`` with default options, built
once and kept in ``tests/fixtures`` (planning it takes about a minute)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from cli_helpers import run

FIXTURE = Path(__file__).parents[1] / "fixtures" / "qwen3-8b-dp1024-muon.plan.json"


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_inspect_at_1024_indices_is_a_summary():
    r = run("inspect", str(FIXTURE))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) <= 80, len(lines)
    assert "the distribution over 1024 indices" in r.stdout
    assert "the 5 busiest" in r.stdout
    assert lines[1].startswith("predicted optimizer step")


def test_ranks_all_lists_every_index():
    r = run("inspect", str(FIXTURE), "--ranks", "all")
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("│") and "FLOP" in ln]
    assert len(rows) >= 1024


def test_a_small_plan_still_lists_every_index(tmp_path):
    path = tmp_path / "p.json"
    assert run("plan", "--model", "qwen3-0.6b", "--dp", 8, "-o", str(path)).exit_code == 0
    r = run("inspect", str(path))
    assert "distribution" not in r.stdout
    assert "the 5 busiest" not in r.stdout


def test_plot_at_1024_indices_stays_narrow(tmp_path):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "q8.png"
    r = run("inspect", str(FIXTURE), "--plot", str(chart))
    assert r.exit_code == 0, r.output
    width, height = _png_size(chart)
    assert width <= 3000 and height <= 3000, (width, height)
