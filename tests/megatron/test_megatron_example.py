"""examples/train_megatron.py end to end under torchrun (gloo), as the README runs it: a
Megatron-core GPTModel trained by canzona at dp 2 × tp 2 with ``plan_model``, again with the same
plan made offline from the matching config (Megatron names; ``--plan``), which must print the
same losses, at tp 2 with bf16 parameters and fp32 main copies, a MoE model at ep 2 (twice,
the same losses), QK-clip and pipeline stages under Megatron's own schedule. Each run exits 0
with a falling loss and no abort at shutdown."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_example_plan_model_and_offline_plan(tmp_path, examples):
    from canzona.planner import ParallelSizes
    from canzona.planner.models import ModelConfig
    from canzona.planner.pipeline import plan
    from canzona.planner.plan import save_plan

    live = examples.losses("train_megatron.py", 4, "--tp", "2", "--steps", "30")
    assert live[-1] < live[0] - 0.5, f"the loss did not fall: {live}"
    # the example's model as a config: the plan made offline applies without renaming
    cfg = ModelConfig(name="megatron-example", arch="qwen3", hidden=128, ffn=352, layers=2,
                      q_heads=8, kv_heads=2, head_dim=32, vocab=1000, tied_embeddings=False,
                      qk_norm=True, dtype="fp32")
    path = tmp_path / "plan.json"
    save_plan(plan(cfg, ParallelSizes(dp=2, tp=2)), path)
    assert examples.losses("train_megatron.py", 4, "--tp", "2", "--steps", "30", "--plan",
                           str(path)) == live


def test_example_bf16_tp2(examples):
    losses = examples.losses("train_megatron.py", 2, "--tp", "2", "--steps", "30", "--bf16")
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"


def test_example_moe_ep2_twice(examples):
    """A Qwen3-MoE-style model at dp 4 × ep 2: the loss falls, and a second run prints the same
    losses."""
    losses = examples.losses("train_megatron.py", 4, "--tp", "1", "--ep", "2", "--steps", "20")
    assert losses[-1] < losses[0] - 0.5, f"the loss did not fall: {losses}"
    assert examples.losses("train_megatron.py", 4, "--tp", "1", "--ep", "2", "--steps",
                           "20") == losses


def test_example_qk_clip(examples):
    """``--qk-clip`` with bf16 parameters and fp32 main copies at dp 2 × tp 2, on attention
    without QK layernorm (where the clipping reaches the logits): the loss falls (that QK-clip
    equals one process: ``tests/runtime/test_qk_clip.py``; a second run printing the same
    losses: the MoE case above)."""
    args = ("--tp", "2", "--steps", "10", "--bf16", "--qk-clip", "0.25", "--no-qk-layernorm")
    losses = examples.losses("train_megatron.py", 4, *args)
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"


def test_example_pipeline_stages(examples):
    """``--pp 2 --tied`` at pp 2 × dp 1 with Megatron's 1F1B schedule: exit 0 and a falling loss
    (a short run: that it equals one process is ``test_megatron_pipeline.py``; two runs print
    the same losses by hand, as the README runs it)."""
    losses = examples.losses("train_megatron.py", 2, "--tp", "1", "--pp", "2", "--tied",
                             "--steps", "4")
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
