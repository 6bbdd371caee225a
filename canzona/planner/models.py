"""Model configurations: built-in presets and Hugging Face ``config.json`` files.

Values are the published Hugging Face configs. A :class:`ModelConfig` holds only
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
SUPPORTED_MODEL_TYPES: dict[str, Arch] = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                                           "llama": "llama"}


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


def _qwen3(name: str, hidden: int, ffn: int, layers: int, q: int, kv: int,
           tied: bool) -> ModelConfig:
    return ModelConfig(name=name, arch="qwen3", hidden=hidden, ffn=ffn, layers=layers, q_heads=q,
                       kv_heads=kv, head_dim=128, vocab=151936, tied_embeddings=tied, qk_norm=True)


def _qwen3_moe(name: str, hidden: int, moe_ffn: int, layers: int, q: int, kv: int) -> ModelConfig:
    return ModelConfig(name=name, arch="qwen3_moe", hidden=hidden, ffn=0, layers=layers, q_heads=q,
                       kv_heads=kv, head_dim=128, vocab=151936, tied_embeddings=False, qk_norm=True,
                       num_experts=128, experts_per_token=8, moe_ffn=moe_ffn)


def _llama3(name: str, hidden: int, ffn: int, layers: int, q: int) -> ModelConfig:
    return ModelConfig(name=name, arch="llama", hidden=hidden, ffn=ffn, layers=layers, q_heads=q,
                       kv_heads=8, head_dim=128, vocab=128256, tied_embeddings=False, qk_norm=False)


#: Built-in presets, keyed by lower-case name.
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


#: The largest size of one dimension (hidden, heads, head_dim, ffn, vocab, …): int32, far beyond
#: any model, so that every element offset stays an int64 (the planner's buffers, torch's views).
MAX_DIM = 2**31 - 1
#: The most parameter tensors a model may have: the planner handles each one (qwen3-235b-a22b has
#: about 25,000); a config far beyond it is a typo, not a model to spend an hour on.
MAX_TENSORS = 100_000
#: The most parameters a model may have (2^53, ~9·10^15; the largest preset has 2.4·10^11).
MAX_PARAMS = 2**53

#: ModelConfig field → the Hugging Face config key it comes from (for error messages).
_HF_KEYS = {"hidden": "hidden_size", "ffn": "intermediate_size", "layers": "num_hidden_layers",
            "q_heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "vocab": "vocab_size", "experts_per_token": "num_experts_per_tok",
            "moe_ffn": "moe_intermediate_size", "num_experts": "num_experts",
            "head_dim": "head_dim"}


def _tensor_count(cfg: ModelConfig) -> int:
    """An upper bound on the parameter tensors of either naming (Megatron's or transformers')."""
    per_layer = 12 + (3 * cfg.num_experts if cfg.is_moe else 0)
    return 4 + cfg.layers * per_layer


def _param_count(cfg: ModelConfig) -> int:
    """The parameters of ``cfg`` (norms and biases counted generously), without building them."""
    h, hd, nq, nkv = cfg.hidden, cfg.head_dim, cfg.q_heads, cfg.kv_heads
    attn = 2 * nq * hd * h + 2 * nkv * hd * h + 2 * h + 2 * hd
    mlp = (cfg.num_experts * h + 3 * cfg.num_experts * h * cfg.moe_ffn if cfg.is_moe
           else 3 * h * cfg.ffn)
    return (1 if cfg.tied_embeddings else 2) * cfg.vocab * h + cfg.layers * (attn + mlp) + h


def check_config(cfg: ModelConfig) -> None:
    """What a model config must satisfy beyond each field's range, before anything is built.

    A dense model has an MLP width; a mixture-of-experts model has experts, their width and
    1 … num_experts of them per token; the KV heads divide the query heads (grouped-query
    attention); every size is at most :data:`MAX_DIM`, the model at most :data:`MAX_TENSORS`
    parameter tensors and :data:`MAX_PARAMS` parameters.

    Raises:
        ModelError: one line naming the field (as ``{ModelConfig.<field>}``, which
            :func:`load_hf_config` spells as the config file's key) and the fix.
    """
    def err(message: str, *names: str) -> ModelError:
        return ModelError(message, fields=tuple(f"ModelConfig.{n}" for n in names))

    for name in ("hidden", "ffn", "q_heads", "kv_heads", "head_dim", "vocab", "num_experts",
                 "experts_per_token", "moe_ffn", "layers"):
        value = getattr(cfg, name)
        if value > MAX_DIM:
            raise err(f"{{ModelConfig.{name}}} is {value}, larger than any model canzona plans "
                      f"(at most {MAX_DIM}); check the value.", name)
    if cfg.is_moe:
        if cfg.moe_ffn < 1:
            raise err(f"{{ModelConfig.moe_ffn}} is {cfg.moe_ffn} but a mixture-of-experts model "
                      f"needs its experts' MLP width (≥ 1).", "moe_ffn")
        if not 1 <= cfg.experts_per_token <= cfg.num_experts:
            raise err(f"{{ModelConfig.experts_per_token}} is {cfg.experts_per_token} but each "
                      f"token is routed to 1 … {{ModelConfig.num_experts}} = {cfg.num_experts} "
                      f"experts.", "experts_per_token", "num_experts")
    elif cfg.arch == "qwen3_moe":
        raise err("{ModelConfig.num_experts} is 0 but a qwen3_moe model needs experts (≥ 1).",
                  "num_experts")
    elif cfg.ffn < 1:
        raise err(f"{{ModelConfig.ffn}} is {cfg.ffn} but a dense {cfg.arch} model needs its MLP "
                  f"width (≥ 1).", "ffn")
    if cfg.q_heads % cfg.kv_heads:
        valid = [d for d in range(1, cfg.q_heads + 1) if cfg.q_heads % d == 0]
        near = min(valid, key=lambda d: (abs(d - cfg.kv_heads), d))
        raise err(f"{{ModelConfig.kv_heads}} = {cfg.kv_heads} does not divide "
                  f"{{ModelConfig.q_heads}} = {cfg.q_heads}: grouped-query attention shares each "
                  f"KV head among the same number of query heads; nearest valid: {near}.",
                  "kv_heads", "q_heads")
    tensors = _tensor_count(cfg)
    if tensors > MAX_TENSORS:
        raise err(f"{{ModelConfig.layers}} = {cfg.layers}"
                  + (f" with {{ModelConfig.num_experts}} = {cfg.num_experts}" if cfg.is_moe else "")
                  + f" makes up to {tensors} parameter tensors; canzona plans at most "
                  f"{MAX_TENSORS}: check the value.",
                  "layers", *(("num_experts",) if cfg.is_moe else ()))
    params = _param_count(cfg)
    if params > MAX_PARAMS:
        raise err(f"the sizes make about {params:.3g} parameters, more than canzona plans "
                  f"(2^53): check {{ModelConfig.hidden}} = {cfg.hidden}, "
                  f"{{ModelConfig.vocab}} = {cfg.vocab} and the MLP and head sizes.",
                  "hidden", "vocab")


#: A config's ``dtype`` (transformers 5) or ``torch_dtype`` → the plan's parameter dtype.
_HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

_MISSING = object()
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "true/false", type(None): "null"}


class _Reader:
    """Typed fields of one config file; every problem is one ModelError naming the file and key."""

    def __init__(self, cfg: dict, path: Path) -> None:
        self.cfg, self.path = cfg, path

    def fail(self, message: str) -> ModelError:
        return ModelError(f"{self.path}: {message}")

    def int(self, key: str, *, minimum: int = 1, default: object = _MISSING,
            null_is_missing: bool = False) -> int:
        value = self.cfg.get(key, _MISSING)
        if value is _MISSING or (value is None and null_is_missing):
            if default is _MISSING:
                raise self.fail(f"field '{key}' is missing from the config; it is required for "
                                f"model_type '{self.cfg.get('model_type')}'.")
            return default  # type: ignore[return-value]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"invalid value for '{key}': {json.dumps(value)} is not an integer "
                            f"(a size is a whole number ≥ {minimum}).")
        if value < minimum:
            raise self.fail(f"invalid value for '{key}': {value}; it must be ≥ {minimum}.")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"invalid value for '{key}': {json.dumps(value)} is not true or "
                            f"false.")
        return value

    def dtype(self) -> str:
        key = "dtype" if self.cfg.get("dtype") is not None else "torch_dtype"
        value = self.cfg.get(key)
        if value is None:
            return "bf16"
        if not isinstance(value, str) or value not in _HF_DTYPES:
            raise self.fail(f"invalid value for '{key}': {json.dumps(value)}; canzona plans "
                            f"{', '.join(_HF_DTYPES)} parameters.")
        return _HF_DTYPES[value]


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` of a Qwen3, Qwen3-MoE or Llama model.

    Every size is an integer in range (no strings, floats or booleans), ``tie_word_embeddings`` a
    boolean, the dtype one canzona plans, and the whole passes :func:`check_config` (spelled with
    the file's keys).

    Raises:
        ModelError: unreadable file, malformed JSON, unsupported architecture, a missing field or
            a value out of range; one line naming the file and the key.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ModelError(f"cannot read model config '{path}': {reason}.") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg}).") from None
    except RecursionError:
        raise ModelError(f"{path}: not a model config (nested too deeply).") from None
    if not isinstance(cfg, dict):
        found = _JSON_TYPES.get(type(cfg), "a value")
        raise ModelError(f"{path}: expected a JSON object, found {found}.")
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ModelError(
            f"{path}: no 'model_type' field; a Hugging Face config.json names its architecture "
            f"there (supported: {', '.join(SUPPORTED_MODEL_TYPES)}).")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"{path}: unsupported model_type "
            f"{repr(model_type) if isinstance(model_type, str) else json.dumps(model_type)}; "
            f"supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen3, Qwen3-MoE, Llama)."
        )
    arch = SUPPORTED_MODEL_TYPES[model_type]
    read = _Reader(cfg, path)
    hidden = read.int("hidden_size")
    q_heads = read.int("num_attention_heads")
    kv_heads = read.int("num_key_value_heads", default=q_heads, null_is_missing=True)
    head_dim = read.int("head_dim", default=None, null_is_missing=True)
    if head_dim is None:
        if hidden % q_heads:
            raise read.fail(f"'hidden_size' = {hidden} is not a multiple of "
                            f"'num_attention_heads' = {q_heads} and there is no 'head_dim'; give "
                            f"head_dim or make the sizes divide.")
        head_dim = hidden // q_heads
    moe = arch == "qwen3_moe"
    # Hub configs say num_experts; transformers 5 writes num_local_experts
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    num_experts = read.int(experts_key) if moe else 0
    # Qwen3-MoE may keep dense layers (mlp_only_layers / decoder_sparse_step); our presets do not.
    if moe:
        dense = cfg.get("mlp_only_layers")
        dense = [] if dense is None else dense
        if not isinstance(dense, list):
            raise read.fail(f"invalid value for 'mlp_only_layers': {json.dumps(dense)} is not a "
                            f"list of layer indices.")
        if dense or read.int("decoder_sparse_step", default=1, null_is_missing=True) != 1:
            raise read.fail("Qwen3-MoE configs with dense layers (mlp_only_layers, "
                            "decoder_sparse_step != 1) are not supported yet.")
    layers = read.int("num_hidden_layers")
    vocab = read.int("vocab_size")
    ffn = read.int("intermediate_size") if not moe else 0
    per_token = read.int("num_experts_per_tok") if moe else 0
    moe_ffn = read.int("moe_intermediate_size") if moe else 0
    try:
        config = ModelConfig(
            name=path.parent.name if path.name == "config.json" and path.parent.name else path.stem,
            arch=arch, hidden=hidden, ffn=ffn, layers=layers, q_heads=q_heads,
            kv_heads=kv_heads, head_dim=head_dim, vocab=vocab,
            tied_embeddings=read.bool("tie_word_embeddings", False),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=num_experts, experts_per_token=per_token, moe_ffn=moe_ffn,
            dtype=read.dtype(),  # type: ignore[arg-type]
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "?"
        key = _HF_KEYS.get(field, field)
        raise ModelError(f"{path}: invalid value for '{key}': {err['msg']} "
                         f"(got {err.get('input')!r}).") from None
    keys = {f"ModelConfig.{k}": f"'{experts_key if k == 'num_experts' else v}'"
            for k, v in _HF_KEYS.items()}
    try:
        check_config(config)
    except ModelError as exc:
        raise ModelError(f"{path}: {exc.render(keys)}") from None
    return config


def resolve_model(model: str | None = None, config: str | Path | None = None) -> ModelConfig:
    """Exactly one of a preset name or a ``config.json`` path."""
    if (model is None) == (config is None):
        raise ModelError("give exactly one of --model NAME or --config PATH.")
    if model is not None:
        return get_preset(model)
    return load_hf_config(config)  # type: ignore[arg-type]
