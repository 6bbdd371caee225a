"""Live inventory: a planner :class:`~canzona.planner.inventory.ModelSpec` read from an
``nn.Module``.

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
  Shampoo or SOAP); tensors of 3 or more dims go to AdamW (Megatron's rule).

Each rule is a list of name globs the caller can replace, and ``matrix_globs``/``adamw_globs``
override the final route exactly as for presets (``canzona.planner.inventory.route``). The TP layout
is read from Megatron's ``tensor_model_parallel``/``partition_dim`` attributes when present (so a
live Megatron model fingerprints like the preset inventory of the same model), from a DTensor's
placement on its ``tp`` mesh dim (``Shard(0)`` → ``column``, ``Shard(1)`` → ``row``,
``Replicate`` → ``replicated``; the recorded shape is the DTensor's global one), and is
``replicated`` otherwise. The parameters of a ``fully_shard``-ed module (FSDP2) are read whole:
their ``Shard(0)`` over the DP mesh is where FSDP2 stores the rows, not tensor parallelism, so
they record their global shape and ``replicated``, as the module had before it was sharded
(:func:`fsdp2_managed`); with TP (``parallelize_module`` over ``mesh["tp"]``, then
``fully_shard`` over ``mesh["dp"]`` of a mesh named ("dp", "tp")) their layout is their
placement on the "tp" dim, the parameters TP left whole (on the "dp" sub-mesh) ``replicated``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from canzona.planner.errors import ModelError
from canzona.planner.inventory import Kind, ModelSpec, ParamSpec, TPLayout, layer_index, route

__all__ = [
    "DEFAULT_EMBEDDING_GLOBS",
    "DEFAULT_EXPERT_GLOBS",
    "DEFAULT_HEAD_GLOBS",
    "DEFAULT_OUTPUT_GLOBS",
    "DEFAULT_ROUTER_GLOBS",
    "dtype_name",
    "fsdp2_managed",
    "fsdp2_modules",
    "inventory",
    "is_tp_split",
    "local_grad",
    "local_tensor",
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
#: 3-D parameters named so hold E expert matrices ([E, m, n]: transformers' MoE experts).
DEFAULT_EXPERT_GLOBS: tuple[str, ...] = ("*.experts.*", "experts.*")
#: Attention projections whose rows are heads of ``head_dim`` rows (HF, Llama and Qwen names),
#: what ``qkv_split="heads"`` orthogonalises head by head.
DEFAULT_HEAD_GLOBS: tuple[str, ...] = ("*q_proj.weight", "*k_proj.weight", "*v_proj.weight")

DEFAULT_ROUTER_GLOBS: tuple[str, ...] = ("*mlp.router.weight", "*mlp.gate.weight",
                                         "*moe.gate.weight", "*block_sparse_moe.gate.weight")

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MEGATRON_FUSED: tuple[tuple[str, TPLayout], ...] = (("linear_qkv", "qkv"),
                                                     ("linear_fc1", "gate_up"))


def dtype_name(dtype: torch.dtype, name: str = "?") -> str:
    """The planner's dtype string (fp32, bf16, fp16) of a torch dtype."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ModelError(f"parameter '{name}' has dtype {dtype}; canzona plans fp32, bf16 and fp16 "
                         "parameters.") from None


def named_params(
    model: nn.Module | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
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


try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None


def _is_dtensor(p: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(p, _DTensor)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor a rank holds: a DTensor's local shard (the very object the DTensor wraps, so
    that setting its ``.data`` re-points the DTensor), any other tensor itself."""
    return p._local_tensor if _is_dtensor(p) else p  # type: ignore[attr-defined]


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` as this rank holds it: for a DTensor parameter the local shard of its gradient,
    redistributed first to the parameter's placements if autograd left it otherwise (a
    ``Partial`` gradient is summed over its mesh dim)."""
    g = p.grad
    if g is None or not _is_dtensor(g):
        return g
    if tuple(g.placements) != tuple(p.placements):  # type: ignore[attr-defined]
        g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
    return g._local_tensor  # type: ignore[attr-defined]


def _dtensor_layout(name: str, p: torch.Tensor) -> TPLayout:
    """``column``/``row``/``replicated`` from the placement on the ``tp`` mesh dim (the only dim of
    a 1-D mesh); every other mesh dim must be ``Replicate`` (data parallelism is canzona's)."""
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or ()
    if all(pl.is_replicate() for pl in placements):
        return "replicated"
    if "tp" in names:
        tp_dim = names.index("tp")
    elif mesh.ndim == 1 and not names:
        tp_dim = 0
    else:
        raise ModelError(f"parameter '{name}' is a DTensor sharded on a mesh without a dim named "
                         f"'tp' (dims {names or mesh.ndim}); name the mesh dims ('dp', 'tp').")
    for k, pl in enumerate(placements):
        if k != tp_dim and not pl.is_replicate():
            raise ModelError(f"parameter '{name}' is a DTensor placed {pl!r} on mesh dim "
                             f"{names[k] if k < len(names) else k}; canzona needs Replicate there "
                             "(it shards optimizer state over DP itself).")
    return _tp_placement(name, p, placements[tp_dim])


def _tp_placement(name: str, p: torch.Tensor, pl: object) -> TPLayout:
    """The TP layout of a DTensor placed ``pl`` on its ``tp`` mesh dim."""
    if pl.is_replicate():  # type: ignore[attr-defined]
        return "replicated"
    if pl.is_shard() and len(p.shape) == 2 and pl.dim in (0, 1):  # type: ignore[attr-defined]
        return "column" if pl.dim == 0 else "row"  # type: ignore[attr-defined]
    if pl.is_shard(0) and len(p.shape) == 1:  # type: ignore[attr-defined]
        return "column"  # a column-parallel bias
    raise ModelError(f"parameter '{name}' (shape {list(p.shape)}) is a DTensor placed {pl!r} on "
                     "the tp mesh dim; canzona reads Shard(0) (column), Shard(1) (row) of a "
                     "matrix, Shard(0) of a vector, or Replicate.")


def fsdp2_modules(model: object) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module of ``model`` that ``fully_shard`` (FSDP2) has sharded
    (``FSDPModule``), in ``named_modules`` order; none for a model without them or a list of
    named parameters."""
    if not isinstance(model, nn.Module):
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def fsdp2_managed(model: object) -> set[int]:
    """The ``id`` of every parameter a ``fully_shard``-ed module of ``model`` manages: the
    parameters of each ``FSDPModule`` and of the modules under it (``fully_shard`` takes every
    parameter below the module not taken by a nested call)."""
    return {id(p) for _, m in fsdp2_modules(model) for p in m.parameters()}


def is_tp_split(p: torch.Tensor) -> bool:
    """The live tensor is a TP shard (Megatron's ``tensor_model_parallel``, a sharded DTensor)."""
    if _is_dtensor(p):
        return _dtensor_layout("?", p) != "replicated"
    return bool(getattr(p, "tensor_model_parallel", False))


def _tp_layout(name: str, p: torch.Tensor, fsdp2: bool = False) -> TPLayout:
    if fsdp2:  # FSDP2's rows over the "dp" mesh dim: storage, read whole; TP's on "tp"
        mesh = p.device_mesh if _is_dtensor(p) else None  # type: ignore[attr-defined]
        if mesh is None or mesh.ndim == 1:
            return "replicated"
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim != 2 or names != ("dp", "tp"):
            raise ModelError(f"parameter '{name}' is sharded by fully_shard over a {mesh.ndim}-D "
                             f"mesh with dims {names or '(unnamed)'}; canzona reads fully_shard "
                             "over one DP mesh dimension, with TP over a 2-D mesh named "
                             "('dp', 'tp').")
        return _tp_placement(name, p, p.placements[1])  # type: ignore[attr-defined]
    if _is_dtensor(p):
        return _dtensor_layout(name, p)
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
    expert_globs: Sequence[str] = DEFAULT_EXPERT_GLOBS,
    head_dim: int | None = None,
    head_globs: Sequence[str] = DEFAULT_HEAD_GLOBS,
) -> ModelSpec:
    """Read a model's parameters into a planner ``ModelSpec`` (no model config; tp > 1 for
    DTensor or Megatron column/row shards, whose global shapes are recorded).

    Args:
        model: an ``nn.Module`` or its ``named_parameters()``.
        name: the model name recorded in the plan (default: the module's class name).
        matrix_globs: names forced onto the matrix optimizer (must be 2-D).
        adamw_globs: names forced onto AdamW (take precedence).
        embedding_globs, output_globs, router_globs: the name rules for kinds routed to AdamW.
        expert_globs: 3-D tensors named so are E stacked expert matrices (each its own matrix
            task); other 3-D tensors (convolutions) take AdamW.
        head_dim: rows per attention head of the matrices named by ``head_globs`` (q, k and v
            projections), which ``qkv_split="heads"`` then cuts per head; None: none is.

    Raises:
        ModelError: no parameters, an unsupported dtype, or an override matching nothing.
    """
    pairs = named_params(model)
    if not pairs:
        raise ModelError("the model has no parameters to plan.")
    embeddings = _embedding_names(model) if isinstance(model, nn.Module) else set()
    managed = fsdp2_managed(model)
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
        elif len(shape) == 3 and _match(pname, expert_globs):
            kind = "expert"  # E stacked expert matrices (transformers' MoE experts)
        else:
            kind = "matrix"
        heads = head_dim if head_dim and kind == "matrix" and _match(pname, head_globs) else 0
        specs.append(ParamSpec(name=pname, shape=shape, dtype=dtype_name(p.dtype, pname), kind=kind,
                               layer=layer_index(pname), expert=None,
                               tp_layout=_tp_layout(pname, p, id(p) in managed),
                               head_rows=heads))
    label = name or (_class_name(model) if isinstance(model, nn.Module) else "module")
    return ModelSpec(config=None, label=label,
                     params=tuple(route(specs, matrix_globs=matrix_globs, adamw_globs=adamw_globs)),
                     tied=_tied_output(model, specs, output_globs))


def _class_name(model: nn.Module) -> str:
    """The module's class name; for a ``fully_shard``-ed module its own class's (FSDP2 makes
    it an ``FSDP<Class>``), so that it plans under the name it had before."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return type(model).__name__
    return next(c.__name__ for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _tied_output(model: object, specs: Sequence[ParamSpec],
                 output_globs: Sequence[str]) -> str | None:
    """The output head's name when it is the embedding's very tensor (``named_parameters``
    lists it once, as the embedding): what a pipeline's last stage holds as a copy."""
    if not isinstance(model, nn.Module):
        return None
    kinds = {s.name: s.kind for s in specs}
    first: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        held = first.setdefault(id(p), pname)
        if held != pname and kinds.get(held) == "embedding" and _match(pname, output_globs):
            return pname
    return None
