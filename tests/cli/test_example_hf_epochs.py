"""examples/train_hf.py under torchrun (2 gloo ranks) past the end of an epoch: the Trainer and
``--loop manual`` print the same steps, each once, with the same loss and gradient norm (the
README's Hugging Face section says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                           "'canzona[dev]' pins it)")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_hf.py"


def _run(loop: str, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--loop", loop, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{proc.stderr[-3000:]}"
    return [x for x in proc.stdout.splitlines() if x.strip()]


def test_trainer_and_manual_loop_agree_past_an_epoch():
    # 256 samples, 4 per rank and batch: 32 batches per epoch; accum 3 makes 11 steps per epoch,
    # the 11th of 2 batches; 12 steps run into the second epoch.
    args = ("--accum", "3", "--steps", "12", "--json")
    trainer, manual = _run("trainer", *args), _run("manual", *args)
    rows = {}
    for name, lines in (("trainer", trainer), ("manual", manual)):
        assert all(x.startswith('{"step"') for x in lines), (name, lines)  # each step once
        rows[name] = [json.loads(x) for x in lines]
        assert [r["step"] for r in rows[name]] == list(range(1, 13)), (name, lines)
    for t, m in zip(rows["trainer"], rows["manual"], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(t[key] - m[key]) <= 1e-5 * abs(m[key]), (key, t, m)


def test_default_runs_print_each_step_once():
    lines = _run("trainer", "--steps", "3")
    assert [x.split()[:2] for x in lines] == [["step", "1"], ["step", "2"], ["step", "3"]], lines
