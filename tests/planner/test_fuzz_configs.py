"""Bad model configs: missing fields, wrong types, wrong architectures, absurd
or inconsistent sizes — through ``load_hf_config`` and through ``canzona plan --config``: one
``ModelError`` line naming the key (the CLI: exit status 1, no traceback, no file written), or a
config that plans. Hypothesis mutates a valid Qwen3 config; fixed cases pin the messages."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canzona.planner import build_inventory
from canzona.planner.errors import CanzonaError, ModelError
from canzona.planner.models import load_hf_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import run  # noqa: E402

VALID = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
             tie_word_embeddings=False)
KEYS = list(VALID)
BAD_VALUES = [None, "abc", "64", [], {}, 0, -1, 64.5, True, 10**18, 2**31]


def _write(folder: Path, cfg: dict) -> Path:
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _outcome(path: Path):
    """The loaded-and-inventoried config, or the project's one-line error."""
    try:
        cfg = load_hf_config(path)
        build_inventory(cfg)
        return cfg
    except CanzonaError as exc:
        assert "\n" not in str(exc), str(exc)
        return exc


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=st.sampled_from(BAD_VALUES), drop=st.booleans())
def test_mutated_config_loads_or_names_the_key(tmp_path, key, value, drop):
    cfg = dict(VALID)
    if drop:
        cfg.pop(key)
    else:
        cfg[key] = value
    got = _outcome(_write(tmp_path, cfg))
    if isinstance(got, CanzonaError):
        assert isinstance(got, ModelError)
        named = key in str(got) or key.split("_")[0] in str(got) or "model_type" in str(got)
        assert named or drop, str(got)


@pytest.mark.parametrize("change,words", [
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 64.5}, "hidden_size"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),  # does not divide 4 heads
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"torch_dtype": "float8_weird"}, "dtype"),
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
    ({"vocab_size": 10**18}, "vocab_size"),
    ({"model_type": "bert"}, "model_type"),
    ({"model_type": ["qwen3"]}, "model_type"),
])
def test_bad_config_values_are_one_line_naming_the_key(tmp_path, change, words):
    got = _outcome(_write(tmp_path, {**VALID, **change}))
    assert isinstance(got, ModelError), got
    assert words in str(got), str(got)


def test_missing_field_is_named(tmp_path):
    cfg = dict(VALID)
    del cfg["num_attention_heads"]
    got = _outcome(_write(tmp_path, cfg))
    assert isinstance(got, ModelError) and "num_attention_heads" in str(got)


@pytest.mark.parametrize("change", [{"num_key_value_heads": 3}, {"hidden_size": None},
                                    {"model_type": "bert"}, {"num_hidden_layers": 10**6}])
def test_cli_bad_config_exits_1_without_a_file(tmp_path, change):
    out = tmp_path / "x.plan.json"
    r = run("plan", "--config", _write(tmp_path, {**VALID, **change}), "--dp", 2, "-o", out)
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and r.output.strip()
    assert not out.exists() and not list(tmp_path.glob("*.plan.json*"))


def test_the_valid_config_plans(tmp_path):
    out = tmp_path / "x.plan.json"
    r = run("plan", "--config", _write(tmp_path, VALID), "--dp", 2, "-o", out)
    assert r.exit_code == 0, r.output
    assert out.exists()
