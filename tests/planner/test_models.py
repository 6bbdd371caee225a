"""Presets and Hugging Face configs: exact parameter counts and errors."""

import json

import pytest

from canzona.planner import ModelError, build_inventory, get_preset, load_hf_config, resolve_model
from canzona.planner.models import PRESETS

EXACT = {
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


def test_every_preset_is_listed():
    assert set(PRESETS) == set(EXACT)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_parameter_counts(name):
    assert build_inventory(get_preset(name)).total_params == EXACT[name]


def test_names_are_case_insensitive():
    assert get_preset("Qwen3-32B") is get_preset("qwen3-32b")
    assert get_preset("  LLAMA3-8B ") is get_preset("llama3-8b")


def test_unknown_model_suggests_and_lists():
    with pytest.raises(ModelError) as e:
        get_preset("qwen3-33b")
    msg = str(e.value)
    assert "unknown model 'qwen3-33b'" in msg and "qwen3-32b" in msg and "llama3-70b" in msg
    assert "\n" not in msg


def _hf(tmp_path, **cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


QWEN3_32B_HF = dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600,
                    num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def test_hf_config_qwen3_matches_preset(tmp_path):
    cfg = load_hf_config(_hf(tmp_path, **QWEN3_32B_HF))
    assert build_inventory(cfg).total_params == EXACT["qwen3-32b"]
    # Same inventory as the preset, so the same fingerprint.
    assert (build_inventory(cfg).fingerprint()
            == build_inventory(get_preset("qwen3-32b")).fingerprint())


def test_hf_config_qwen3_moe(tmp_path):
    cfg = load_hf_config(_hf(tmp_path, model_type="qwen3_moe", hidden_size=2048,
                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                             head_dim=128, vocab_size=151936, num_experts=128,
                             num_experts_per_tok=8, moe_intermediate_size=768,
                             tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]))
    assert cfg.is_moe and build_inventory(cfg).total_params == EXACT["qwen3-30b-a3b"]


def test_hf_config_llama_defaults_head_dim(tmp_path):
    cfg = load_hf_config(_hf(tmp_path, model_type="llama", hidden_size=4096,
                             intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    assert cfg.head_dim == 128 and not cfg.qk_norm
    assert build_inventory(cfg).total_params == EXACT["llama3-8b"]


def test_hf_config_unsupported_architecture_lists_supported(tmp_path):
    with pytest.raises(ModelError,
                       match=r"unsupported model_type 'mistral'.*qwen3, qwen3_moe, llama"):
        load_hf_config(_hf(tmp_path, model_type="mistral", hidden_size=8))


def test_hf_config_missing_field_is_named(tmp_path):
    cfg = dict(QWEN3_32B_HF)
    del cfg["num_hidden_layers"]
    with pytest.raises(ModelError, match="num_hidden_layers"):
        load_hf_config(_hf(tmp_path, **cfg))


def test_hf_config_bad_value_is_one_line(tmp_path):
    with pytest.raises(ModelError) as e:
        load_hf_config(_hf(tmp_path, **{**QWEN3_32B_HF, "hidden_size": -3}))
    assert "\n" not in str(e.value) and "hidden" in str(e.value)


def test_hf_config_unreadable_and_malformed(tmp_path):
    with pytest.raises(ModelError, match="cannot read"):
        load_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_hf_config(bad)


def test_resolve_model_needs_exactly_one_source(tmp_path):
    with pytest.raises(ModelError, match="exactly one"):
        resolve_model()
    with pytest.raises(ModelError, match="exactly one"):
        resolve_model("qwen3-8b", tmp_path / "config.json")
