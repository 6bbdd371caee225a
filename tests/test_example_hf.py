"""examples/train_hf.py under torchrun (2 gloo ranks): ``transformers.Trainer`` with
``canzona.hf.CanzonaTrainer`` gives, step by step, the loss and global gradient norm of canzona's
hand-written loop on the same batches (within 1e-5 relative), with a MoE model (3-D experts) and
gradient accumulation; and CanzonaTrainer's bad input fails clearly."""

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

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_hf.py"


def _run(loop: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--loop", loop, "--model", "qwen3-moe", "--accum", "2", "--steps", "4",
           "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{out[-3000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in rows] == [1, 2, 3, 4], proc.stdout
    return rows


def test_trainer_equals_the_hand_written_loop():
    trainer, manual = _run("trainer"), _run("manual")
    for t, m in zip(trainer, manual, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(t[key] - m[key]) <= 1e-5 * abs(m[key]), (key, t, m)
    # the optimizer did something: the loss moves and the norm is a real (global) norm
    assert (len({round(r["loss"], 6) for r in manual}) > 1
            and all(r["grad_norm"] > 0 for r in manual))


def test_canzona_trainer_refuses_what_would_be_wrong(tmp_path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, TrainingArguments

    from canzona.hf import CanzonaTrainer
    from canzona.planner import CanzonaError
    from canzona.runtime.optimizer import CanzonaOptimizer

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8))
    opt = CanzonaOptimizer.__new__(CanzonaOptimizer)  # the type is what is checked first
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(CanzonaError, match="max_grad_norm is 1.0.*clip_grad_norm="):
        CanzonaTrainer(model=model, args=args, optimizers=(opt, None))
    with pytest.raises(CanzonaError, match="needs optimizers=.*got SGD"):
        CanzonaTrainer(model=model, args=args,
                       optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))
    with pytest.raises(CanzonaError, match="clip_grad_norm must be > 0"):
        CanzonaTrainer(model=model, args=args, optimizers=(opt, None), clip_grad_norm=0)
