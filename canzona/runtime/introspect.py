"""Live inventory: a planner :class:`~canzona.planner.inventory.ModelSpec` read from an ``nn.Module``.

The planner needs names, shapes, dtypes, a kind per parameter and the optimizer route. They come
from ``named_parameters()`` (registration order, shared parameters once, as Megatron's buffers see
them) and, when a module is given, from the module types:

* ``nn.Embedding`` / ``nn.EmbeddingBag`` weights, and names that look like embeddings in Hugging
  Face or Megatron naming (``embed_tokens``, ``wte``, ``wpe``, ``word_embeddings``,
  ``position_embeddings``) → kind ``embedding`` → AdamW;
* output heads (``lm_head``, Megatron's ``output_layer``, GPT-NeoX's ``embed_out``) → ``output``
  → AdamW;
* MoE routers (Megatron ``mlp.router``, Hugging Face ``mlp.gate``) → ``router`` → AdamW;
* 1-D tensors (norms, biases) → ``vector`` → AdamW; other 2-D weights → ``matrix`` (Muon,
  Shampoo or SOAP); tensors of 3 or more dims go to AdamW (Megatron's rule, REFERENCE.md §2).

Each rule is a list of name globs the caller can replace, and ``matrix_globs``/``adamw_globs``
override the final route exactly as for presets (``canzona.planner.inventory.route``). The TP layout
is read from Megatron's ``tensor_model_parallel``/``partition_dim`` attributes when present (so a
live Megatron model fingerprints like the preset inventory of the same model) and is
``replicated`` otherwise.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from canzona.planner.errors import ModelError
from canzona.planner.inventory import Kind, ModelSpec, ParamSpec, TPLayout, route

__all__ = [
    "DEFAULT_EMBEDDING_GLOBS",
    "DEFAULT_OUTPUT_GLOBS",
    "DEFAULT_ROUTER_GLOBS",
    "dtype_name",
    "inventory",
    "named_params",
]

#: Names of embedding tables (HF: embed_tokens, wte, wpe; Megatron: word/position_embeddings).
DEFAULT_EMBEDDING_GLOBS: tuple[str, ...] = (
    "*embed_tokens.weight", "*wte.weight", "*wpe.weight", "*word_embeddings.weight",
    "*position_embeddings.weight", "*tok_embeddings.weight", "*embeddings.weight",
)
#: Output heads (HF lm_head, Megatron output_layer, GPT-NeoX embed_out).
DEFAULT_OUTPUT_GLOBS: tuple[str, ...] = (
    "lm_head.weight", "*.lm_head.weight", "output_layer.weight", "*.output_layer.weight",
    "embed_out.weight", "*.embed_out.weight",
)
#: MoE routers (Megatron mlp.router, HF Qwen3-MoE / Mixtral mlp.gate / block_sparse_moe.gate).
DEFAULT_ROUTER_GLOBS: tuple[str, ...] = ("*mlp.router.weight", "*mlp.gate.weight", "*moe.gate.weight",
                                         "*block_sparse_moe.gate.weight")

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MEGATRON_FUSED: tuple[tuple[str, TPLayout], ...] = (("linear_qkv", "qkv"), ("linear_fc1", "gate_up"))


def dtype_name(dtype: torch.dtype, name: str = "?") -> str:
    """The planner's dtype string (fp32, bf16, fp16) of a torch dtype."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ModelError(f"parameter '{name}' has dtype {dtype}; canzona plans fp32, bf16 and fp16 "
                         "parameters.") from None


def named_params(model: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` pairs of a module or of a ``named_parameters()`` iterable."""
    pairs = list(model.named_parameters()) if isinstance(model, nn.Module) else list(model)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError("model must be an nn.Module or an iterable of (name, tensor) pairs, "
                            f"got an item {type(item).__name__}")
    return pairs


def _embedding_names(model: nn.Module) -> set[str]:
    out = set()
    for mname, mod in model.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
            out.add(f"{mname}.weight" if mname else "weight")
    return out


def _tp_layout(name: str, p: torch.Tensor) -> TPLayout:
    if not getattr(p, "tensor_model_parallel", False):
        return "replicated"
    for key, layout in _MEGATRON_FUSED:
        if f"{key}." in name:
            return layout
    if "word_embeddings" in name or "output_layer" in name:
        return "vocab"
    return "row" if getattr(p, "partition_dim", 0) == 1 else "column"


def _match(name: str, globs: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def inventory(
    model: nn.Module | Iterable[tuple[str, torch.Tensor]],
    *,
    name: str | None = None,
    matrix_globs: Sequence[str] = (),
    adamw_globs: Sequence[str] = (),
    embedding_globs: Sequence[str] = DEFAULT_EMBEDDING_GLOBS,
    output_globs: Sequence[str] = DEFAULT_OUTPUT_GLOBS,
    router_globs: Sequence[str] = DEFAULT_ROUTER_GLOBS,
) -> ModelSpec:
    """Read a model's parameters into a planner ``ModelSpec`` (no model config; tp = 1 only).

    Args:
        model: an ``nn.Module`` or its ``named_parameters()``.
        name: the model name recorded in the plan (default: the module's class name).
        matrix_globs: names forced onto the matrix optimizer (must be 2-D).
        adamw_globs: names forced onto AdamW (take precedence).
        embedding_globs, output_globs, router_globs: the name rules for kinds routed to AdamW.

    Raises:
        ModelError: no parameters, an unsupported dtype, or an override matching nothing.
    """
    pairs = named_params(model)
    if not pairs:
        raise ModelError("the model has no parameters to plan.")
    embeddings = _embedding_names(model) if isinstance(model, nn.Module) else set()
    specs = []
    for pname, p in pairs:
        shape = tuple(int(s) for s in p.shape)
        kind: Kind
        if pname in embeddings or _match(pname, embedding_globs):
            kind = "embedding"
        elif _match(pname, output_globs):
            kind = "output"
        elif _match(pname, router_globs):
            kind = "router"
        elif len(shape) <= 1:
            kind = "vector"
        else:
            kind = "matrix"
        specs.append(ParamSpec(name=pname, shape=shape, dtype=dtype_name(p.dtype, pname), kind=kind,
                               layer=None, expert=None, tp_layout=_tp_layout(pname, p)))
    label = name or (type(model).__name__ if isinstance(model, nn.Module) else "module")
    return ModelSpec(config=None, label=label,
                     params=tuple(route(specs, matrix_globs=matrix_globs, adamw_globs=adamw_globs)))
