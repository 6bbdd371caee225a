"""Plans made offline from a Hugging Face ``config.json`` with ``names="hf"`` fit the live
``transformers`` model: the fingerprint check passes, and the plan equals the one
``plan_model`` makes from the live module (Qwen3, Qwen3-MoE with 3-D experts, Llama; tied and
untied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                           "'canzona[dev]' pins it)")

import torch  # noqa: E402

import canzona  # noqa: E402
from canzona.planner import ParallelSizes  # noqa: E402
from canzona.planner.pipeline import plan  # noqa: E402
from canzona.runtime.checks import fingerprint_problem  # noqa: E402
from canzona.runtime.introspect import inventory  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)


def _models():
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    return {
        "qwen3": (Qwen3Config(intermediate_size=64, tie_word_embeddings=True, **COMMON),
                  Qwen3ForCausalLM),
        "qwen3-untied": (Qwen3Config(intermediate_size=64, tie_word_embeddings=False, **COMMON),
                         Qwen3ForCausalLM),
        "qwen3-moe": (Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4,
                                     num_experts_per_tok=2, decoder_sparse_step=1,
                                     mlp_only_layers=[], tie_word_embeddings=False, **COMMON),
                      Qwen3MoeForCausalLM),
        "llama": (LlamaConfig(intermediate_size=64, tie_word_embeddings=False, **COMMON),
                  LlamaForCausalLM),
    }


def _config_file(cfg, folder: Path, dtype: str) -> Path:
    d = cfg.to_dict()
    d["dtype"] = dtype
    path = folder / "config.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("which", ["qwen3", "qwen3-untied", "qwen3-moe", "llama"])
def test_an_offline_plan_with_hf_names_fits_the_live_model(which, tmp_path):
    cfg, cls = _models()[which]
    torch.manual_seed(0)
    model = cls(cfg).to(torch.bfloat16)
    path = _config_file(cfg, tmp_path, "bfloat16")
    offline = plan(path, ParallelSizes(dp=2, tp=1), "muon", names="hf")
    assert offline.fingerprint == inventory(model).fingerprint()
    assert fingerprint_problem(offline, list(model.named_parameters())) is None
    live = canzona.plan_model(model, dp=2)
    key = lambda p: [(t.param, t.part, tuple(t.shape), t.optimizer, t.owner)  # noqa: E731
                     for t in p.tasks]
    assert key(offline) == key(live)
    assert offline.buffers == live.buffers
    # separate projections: every q/k/v/gate/up its own task (the separate-projection rule)
    names = {t.param for t in offline.tasks}
    assert any(n.endswith("q_proj.weight") for n in names)
    if which == "qwen3-moe":
        assert sum(1 for t in offline.tasks if t.part and t.part.startswith("expert")) == \
            2 * 2 * 4  # layers × tensors × experts
    # the Megatron-named plan of the same config does not fit the live model
    megatron = plan(path, ParallelSizes(dp=2, tp=1), "muon")
    assert fingerprint_problem(megatron, list(model.named_parameters())) is not None


def test_cli_plan_names_hf_and_its_errors(tmp_path):
    from typer.testing import CliRunner

    from canzona.cli.main import app

    cfg, cls = _models()["qwen3"]
    path = _config_file(cfg, tmp_path, "float32")
    out = tmp_path / "q.plan.json"
    run = CliRunner().invoke
    r = run(app, ["plan", "--config", str(path), "--dp", "2", "--names", "hf", "-o", str(out)])
    assert r.exit_code == 0, r.output
    torch.manual_seed(0)
    model = cls(cfg)  # float32, as the config says
    assert fingerprint_problem(canzona.load_plan(out), list(model.named_parameters())) is None
    r = run(app, ["inspect", str(out), "--config", str(path)])
    assert r.exit_code == 0, r.output
    for args, words in ((["--tp", "2"], "--tp"), (["--names", "jax"], "--names must be one of")):
        r = run(app, ["plan", "--config", str(path), "--dp", "2", "--names", "hf", *args,
                      "-o", str(tmp_path / "x.json")] if args[0] != "--names" else
                ["plan", "--config", str(path), "--dp", "2", *args, "-o", str(tmp_path / "x.json")])
        assert r.exit_code == 1 and words in r.output, r.output
