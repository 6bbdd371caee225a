"""Model configurations: built-in presets and Hugging Face ``config.json`` files.

Values are the published Hugging Face configs (REFERENCE.md §1). A :class:`ModelConfig` holds only
what the parameter inventory needs; :func:`canzona.planner.inventory.build_inventory` turns it into
parameters.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ModelError

Arch = Literal["qwen3", "qwen3_moe", "llama"]

#: Hugging Face ``model_type`` values we read, and the architecture each maps to.
SUPPORTED_MODEL_TYPES: dict[str, Arch] = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}


class ModelConfig(BaseModel):
    """The shape-defining hyper-parameters of a decoder-only transformer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Preset name or the config file's stem.")
    arch: Arch
    hidden: int = Field(gt=0)
    ffn: int = Field(ge=0, description="Dense MLP width (0 for all-MoE models).")
    layers: int = Field(gt=0)
    q_heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab: int = Field(gt=0)
    tied_embeddings: bool
    qk_norm: bool = Field(description="Qwen3's per-head-dim RMSNorm on queries and keys.")
    num_experts: int = Field(default=0, ge=0)
    experts_per_token: int = Field(default=0, ge=0)
    moe_ffn: int = Field(default=0, ge=0)
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _qwen3(name: str, hidden: int, ffn: int, layers: int, q: int, kv: int, tied: bool) -> ModelConfig:
    return ModelConfig(name=name, arch="qwen3", hidden=hidden, ffn=ffn, layers=layers, q_heads=q,
                       kv_heads=kv, head_dim=128, vocab=151936, tied_embeddings=tied, qk_norm=True)


def _qwen3_moe(name: str, hidden: int, moe_ffn: int, layers: int, q: int, kv: int) -> ModelConfig:
    return ModelConfig(name=name, arch="qwen3_moe", hidden=hidden, ffn=0, layers=layers, q_heads=q,
                       kv_heads=kv, head_dim=128, vocab=151936, tied_embeddings=False, qk_norm=True,
                       num_experts=128, experts_per_token=8, moe_ffn=moe_ffn)


def _llama3(name: str, hidden: int, ffn: int, layers: int, q: int) -> ModelConfig:
    return ModelConfig(name=name, arch="llama", hidden=hidden, ffn=ffn, layers=layers, q_heads=q,
                       kv_heads=8, head_dim=128, vocab=128256, tied_embeddings=False, qk_norm=False)


#: Built-in presets, keyed by lower-case name (REFERENCE.md §1).
PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, 8, tied=True),
        _qwen3("qwen3-1.7b", 2048, 6144, 28, 16, 8, tied=True),
        _qwen3("qwen3-4b", 2560, 9728, 36, 32, 8, tied=True),
        _qwen3("qwen3-8b", 4096, 12288, 36, 32, 8, tied=False),
        _qwen3("qwen3-14b", 5120, 17408, 40, 40, 8, tied=False),
        _qwen3("qwen3-32b", 5120, 25600, 64, 64, 8, tied=False),
        _qwen3_moe("qwen3-30b-a3b", 2048, 768, 48, 32, 4),
        _qwen3_moe("qwen3-235b-a22b", 4096, 1536, 94, 64, 4),
        _llama3("llama3-8b", 4096, 14336, 32, 32),
        _llama3("llama3-70b", 8192, 28672, 80, 64),
    )
}


def get_preset(name: str) -> ModelConfig:
    """Return the preset called ``name`` (case-insensitive).

    Raises:
        ModelError: unknown name; the message lists the presets and the closest match.
    """
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(key, list(PRESETS), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ModelError(
        f"unknown model '{name}'.{hint} Built-in models: {', '.join(PRESETS)} "
        "(or pass --config path/to/config.json)."
    )


def _field(cfg: dict, key: str, path: Path, default: object = None) -> object:
    if key in cfg:
        return cfg[key]
    if default is not None:
        return default
    raise ModelError(f"{path}: field '{key}' is missing from the config; it is required for "
                     f"model_type '{cfg.get('model_type')}'.")


#: ModelConfig field → the Hugging Face config key it comes from (for error messages).
_HF_KEYS = {"hidden": "hidden_size", "ffn": "intermediate_size", "layers": "num_hidden_layers",
            "q_heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "vocab": "vocab_size", "experts_per_token": "num_experts_per_tok",
            "moe_ffn": "moe_intermediate_size"}


#: A config's ``dtype`` (transformers 5) or ``torch_dtype`` → the plan's parameter dtype.
_HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` of a Qwen3, Qwen3-MoE or Llama model.

    Raises:
        ModelError: unreadable file, malformed JSON, unsupported architecture or missing field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelError(f"cannot read model config '{path}': {exc.strerror or exc}.") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg}).") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path}: expected a JSON object, found {type(cfg).__name__}.")
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ModelError(
            f"{path}: no 'model_type' field; a Hugging Face config.json names its architecture "
            f"there (supported: {', '.join(SUPPORTED_MODEL_TYPES)}).")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{path}: unsupported model_type '{model_type}'; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen3, Qwen3-MoE, Llama)."
        )
    arch = SUPPORTED_MODEL_TYPES[model_type]
    hidden = int(_field(cfg, "hidden_size", path))
    q_heads = int(_field(cfg, "num_attention_heads", path))
    kv_heads = int(cfg.get("num_key_value_heads") or q_heads)
    head_dim = int(cfg.get("head_dim") or hidden // q_heads)
    moe = arch == "qwen3_moe"
    # Hub configs say num_experts; transformers 5 writes num_local_experts
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    num_experts = int(_field(cfg, experts_key, path)) if moe else 0
    # Qwen3-MoE may keep dense layers (mlp_only_layers / decoder_sparse_step); our presets do not.
    if moe and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1):
        raise ModelError(f"{path}: Qwen3-MoE configs with dense layers (mlp_only_layers, "
                         "decoder_sparse_step != 1) are not supported yet.")
    try:
        return ModelConfig(
            name=path.parent.name if path.name == "config.json" and path.parent.name else path.stem,
            arch=arch,
            hidden=hidden,
            ffn=int(cfg.get("intermediate_size", 0)) if not moe else 0,
            layers=int(_field(cfg, "num_hidden_layers", path)),
            q_heads=q_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=int(_field(cfg, "vocab_size", path)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=num_experts,
            experts_per_token=int(_field(cfg, "num_experts_per_tok", path)) if moe else 0,
            moe_ffn=int(_field(cfg, "moe_intermediate_size", path)) if moe else 0,
            dtype=_HF_DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
                                 "bf16"),
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "?"
        key = _HF_KEYS.get(field, field)
        raise ModelError(f"{path}: invalid value for '{key}': {err['msg']} "
                         f"(got {err.get('input')!r}).") from None
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{path}: invalid config values ({exc}).") from None


def resolve_model(model: str | None = None, config: str | Path | None = None) -> ModelConfig:
    """Exactly one of a preset name or a ``config.json`` path."""
    if (model is None) == (config is None):
        raise ModelError("give exactly one of --model NAME or --config PATH.")
    return get_preset(model) if model is not None else load_hf_config(config)  # type: ignore[arg-type]
