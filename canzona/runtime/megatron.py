"""A live Megatron-core ``GPTModel`` read as the planner's model config (duck-typed: no import of
megatron here).

Megatron's ``TransformerConfig`` (``model.config``) and the model's ``vocab_size`` and
``share_embeddings_and_output_weights`` give a :class:`~canzona.planner.models.ModelConfig`; the
planner's inventory of that config under Megatron names is the model's parameter list with its
TP layouts (fused QKV grouped per KV group, fc1 as [gate; up] with ``partition_stride`` 2, the
vocabulary-parallel embedding and output layer). :func:`megatron_spec` checks that inventory
against the live parameters (names, order, local shard shapes at the model's TP size, Megatron's
``tensor_model_parallel``/``partition_dim``/``partition_stride`` and
``is_embedding_or_output_parameter`` attributes) and takes
each parameter's dtype from the model, so that a bare ``GPTModel`` (float32 norms beside bf16
matrices) plans with its real buffers.

Supported: the decoder-only models the planner describes (Llama and Qwen3 style: RMSNorm, GQA,
gated SwiGLU, no linear biases, optional QK layernorm; Qwen3-MoE with per-expert weights, at
any expert-parallel size with expert TP = TP or 1), any pipeline-parallel size with one model
chunk per stage (the layers split evenly or by ``num_layers_in_first/last_pipeline_stage``; a
stage's module is read as its part of the whole model, :func:`megatron_stages`), canzona as the
data parallelism (no FSDP storage). The experts are read from either of Megatron's expert
modules that hold one 2-D weight per expert (:data:`EXPERT_MODULES`): ``SequentialMLP``
(``local_experts.{j}.linear_fc1.weight``) and ``TEGroupedMLP`` (``linear_fc1.weight{j}``, the
planner's ``megatron-grouped`` naming); the legacy ``GroupedMLP``, every local expert in one
matrix, is refused. Under expert parallelism a rank holds E/ep experts numbered from 0 (its
first global index is the ``MoELayer``'s ``local_expert_indices[0]``); the inventory names every
expert by its global index. Anything else is refused with the setting that differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from canzona.planner.errors import ModelError
from canzona.planner.inventory import ModelSpec, ParamSpec, build_inventory
from canzona.planner.layout import padded_vocab
from canzona.planner.models import ModelConfig
from canzona.planner.shards import shard_map
from canzona.planner.stages import StageSplit, split_model
from canzona.runtime.checkpoint.names import Placement, global_name
from canzona.runtime.introspect import dtype_name, local_tensor, named_params

__all__ = ["EXPERT_MODULES", "MEGATRON_SUM_GRADS", "check_megatron_model", "find_gpt",
           "megatron_config", "megatron_ep", "megatron_spec", "megatron_stages",
           "megatron_sum_grads", "megatron_tp"]

#: Replicated parameters whose gradient each TP rank holds only in part under Megatron: the
#: QK layernorms see only the rank's attention heads (Megatron's ``finalize_model_grads`` sums
#: them over TP when ``qk_layernorm`` is set).
MEGATRON_SUM_GRADS: tuple[str, ...] = ("*self_attention.q_layernorm.weight",
                                       "*self_attention.k_layernorm.weight")

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

#: TransformerConfig settings the planner's models do not have: (field, the value they need,
#: why).
_REQUIRED: tuple[tuple[str, Any, str], ...] = (
    ("virtual_pipeline_model_parallel_size", None,
     "virtual (interleaved) pipeline stages are not supported yet: one model chunk per stage"),
    ("account_for_embedding_in_pipeline_split", False,
     "the planner splits the layers by Megatron's first/last stage counts only"),
    ("account_for_loss_in_pipeline_split", False,
     "the planner splits the layers by Megatron's first/last stage counts only"),
    ("pipeline_model_parallel_layout", None,
     "the planner splits the layers by Megatron's first/last stage counts only"),
    ("context_parallel_size", 1, "context parallelism is not planned"),
    ("add_bias_linear", False, "linear biases are not in the planner's models"),
    ("add_qkv_bias", False, "QKV biases are not in the planner's models"),
    ("gated_linear_unit", True, "fc1 must be the gated [gate; up] SwiGLU weight"),
    ("normalization", "RMSNorm", "LayerNorm biases are not in the planner's models"),
    ("multi_latent_attention", False, "multi-latent attention is not in the planner's models"),
    ("moe_shared_expert_intermediate_size", None, "shared experts are not in the planner's models"),
)


#: Megatron-core's expert modules, by the name part their first weight carries: (name part,
#: the module, the planner naming that lists its weights — ``inventory.NAMINGS`` —, or None where
#: canzona does not read it).
EXPERT_MODULES: tuple[tuple[str, str, str | None], ...] = (
    (".mlp.experts.local_experts.", "SequentialMLP", "megatron"),
    (".mlp.experts.linear_fc1.weight", "TEGroupedMLP", "megatron-grouped"),
    (".mlp.experts.weight1", "GroupedMLP", None),
)


def find_gpt(model: Any) -> tuple[str, nn.Module] | None:
    """``(prefix, gpt)``: the Megatron-core language model inside ``model`` (the module itself,
    or under ``Float16Module``/DDP wrappers' ``module`` attribute) and the prefix its parameter
    names carry in ``model``; None when ``model`` is not one."""
    prefix, m = "", model
    for _ in range(4):
        if not isinstance(m, nn.Module):
            return None
        cfg = getattr(m, "config", None)
        if (cfg is not None and hasattr(cfg, "num_query_groups") and hasattr(cfg, "kv_channels")
                and hasattr(m, "vocab_size") and hasattr(m, "decoder")):
            return prefix, m
        inner = getattr(m, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        prefix, m = prefix + "module.", inner
    return None


def megatron_sum_grads(model: Any) -> tuple[str, ...]:
    """The QK-layernorm globs (any name prefix) for a Megatron-core GPTModel built with
    ``qk_layernorm``, else none."""
    found = find_gpt(model)
    if found is None or not getattr(found[1].config, "qk_layernorm", False):
        return ()
    return MEGATRON_SUM_GRADS


def megatron_config(gpt: nn.Module, *, vocab: int | None = None,
                    name: str | None = None) -> ModelConfig:
    """The planner's config of a Megatron-core GPTModel.

    Args:
        gpt: the GPTModel (``find_gpt`` unwraps).
        vocab: the tokenizer's vocabulary before Megatron's padding (default: the model's
            ``vocab_size``, which the training script has already padded). Given, the model's
            vocabulary must be that one padded (the planner pads it as Megatron does).
        name: the config's name (default ``megatron-<class name>``).

    Raises:
        ModelError: a setting the planner's models do not have, naming the TransformerConfig field.
    """
    c = gpt.config  # type: ignore[attr-defined]
    ep = int(getattr(c, "expert_model_parallel_size", 1) or 1)
    etp = getattr(c, "expert_tensor_parallel_size", None)
    tp = int(getattr(c, "tensor_model_parallel_size", 1) or 1)
    if ep > 1 and etp is not None and int(etp) not in (1, tp):
        raise ModelError(f"TransformerConfig.expert_tensor_parallel_size is {etp!r}; canzona "
                         "executes expert parallelism with expert TP 1 or equal to "
                         f"tensor_model_parallel_size ({tp}; Megatron's default, None).")
    for field, want, why in _REQUIRED:
        got = getattr(c, field, want)
        if got != want and not (want is None and not got):
            raise ModelError(f"TransformerConfig.{field} is {got!r}; canzona.plan_model reads "
                             f"Megatron models with {field}={want!r} ({why}).")
    if getattr(c, "num_moe_experts", None) and getattr(c, "moe_layer_freq", 1) not in (1, None):
        raise ModelError(f"TransformerConfig.moe_layer_freq is {c.moe_layer_freq!r}; the planner's "
                         "MoE models have an MoE MLP in every layer (moe_layer_freq=1).")
    model_vocab = int(gpt.vocab_size)  # type: ignore[attr-defined]
    tp = int(getattr(c, "tensor_model_parallel_size", 1) or 1)
    if vocab is not None:
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ModelError(f"vocab must be the tokenizer's vocabulary size (an int >= 1), got "
                             f"{vocab!r}.")
        if padded_vocab(vocab, tp) != model_vocab:
            raise ModelError(f"vocab={vocab} pads to {padded_vocab(vocab, tp)} at tp={tp} "
                             f"(Megatron's multiple of 128·tp) but the model's vocab_size is "
                             f"{model_vocab}; pass the vocabulary the model was padded from, or "
                             "leave vocab out to plan the model's padded vocabulary.")
    if vocab is None and model_vocab % (128 * tp):
        raise ModelError(f"the model's vocab_size {model_vocab} is not a multiple of 128·tp = "
                         f"{128 * tp}, as Megatron's training script pads it "
                         "(--make-vocab-size-divisible-by 128); canzona plans that padded layout: "
                         "build the model with the padded vocabulary.")
    dtype = _DTYPES.get(getattr(c, "params_dtype", torch.float32), "fp32")
    moe = int(getattr(c, "num_moe_experts", None) or 0)
    try:
        return ModelConfig(
            name=name or f"megatron-{type(gpt).__name__.lower()}",
            arch="qwen3_moe" if moe else ("qwen3" if c.qk_layernorm else "llama"),
            hidden=int(c.hidden_size), ffn=0 if moe else int(c.ffn_hidden_size),
            layers=int(c.num_layers), q_heads=int(c.num_attention_heads),
            kv_heads=int(c.num_query_groups or c.num_attention_heads),
            head_dim=int(c.kv_channels), vocab=vocab or model_vocab,
            tied_embeddings=bool(getattr(gpt, "share_embeddings_and_output_weights", False)),
            qk_norm=bool(c.qk_layernorm), num_experts=moe,
            experts_per_token=int(c.moe_router_topk or 0) if moe else 0,
            moe_ffn=int(c.moe_ffn_hidden_size or 0) if moe else 0, dtype=dtype)
    except ValueError as exc:  # pydantic's ValidationError
        raise ModelError("the Megatron model's TransformerConfig does not describe a model "
                         f"canzona plans: {exc}") from None


#: (tensor_model_parallel, partition_dim, partition_stride): Megatron's TP attributes.
TPAttrs = tuple[bool, int | None, int]


def _megatron_attrs(t: Any) -> TPAttrs:
    """(tensor_model_parallel, partition_dim, partition_stride) as Megatron sets them (None and 1
    for a replicated parameter)."""
    if not getattr(t, "tensor_model_parallel", False):
        return (False, None, 1)
    return (True, int(getattr(t, "partition_dim", 0)), int(getattr(t, "partition_stride", 1) or 1))


def _planned_attrs(p: ParamSpec, grouped: bool, explicit_comm: bool) -> TPAttrs:
    """The TP attributes Megatron gives ``p`` in a model that the planner's layout describes
    (``grouped``: its experts are TEGroupedMLP's).

    Megatron's own layers mark the split they make. TEGroupedMLP's per-expert weights are marked
    by Transformer Engine's ``GroupedLinear``: every weight tensor-parallel with stride 1, dim 1
    in row-parallel mode and 0 otherwise; Megatron gives it no parallel mode where it exchanges
    the expert activations itself (expert TP > 1 or ep > 1: ``explicit_comm``), so there fc2 is
    marked dim 0 as well. Their split is SequentialMLP's all the same (fc1's shard holds
    [gate_r; up_r], fc2's its columns), which is what the plan lays out.
    """
    if grouped and p.is_expert:
        return (True, 1 if p.tp_layout == "row" and not explicit_comm else 0, 1)
    return (p.tp_layout != "replicated", p.tp_dim, p.tp_stride)


def _expert_naming(names: list[str]) -> str:
    """The planner naming of the expert module whose weights ``names`` carries (``megatron``
    for a dense model).

    Raises:
        ModelError: the legacy GroupedMLP (every local expert concatenated in one matrix).
    """
    for name in names:
        for part, module, naming in EXPERT_MODULES:
            if part not in name:
                continue
            if naming is None:
                raise ModelError(
                    f"the Megatron model's experts are the legacy {module} ('{name}' holds every "
                    "local expert in one matrix); canzona reads one 2-D weight per expert: build "
                    "the MoE layers with TransformerConfig.moe_grouped_gemm=False "
                    "(SequentialMLP) or, with Transformer Engine, moe_grouped_gemm=True and "
                    "moe_use_legacy_grouped_gemm=False (TEGroupedMLP).")
            return naming
    return "megatron"


def check_megatron_model(model: Any) -> None:
    """Refuse, before any collective, a Megatron-core model whose storage canzona does not read:
    parameters under Megatron's or torch's fully sharded data parallelism (canzona's ZeRO-1 is
    the data parallelism: it takes the model in place of Megatron's ``DistributedDataParallel``
    and distributed optimizer), or experts in the legacy GroupedMLP. Other models pass.

    Megatron-FSDP shows in the ``ddp_config`` of a wrapper between ``model`` and the GPTModel
    (``use_megatron_fsdp``, or its deprecated ``use_custom_fsdp``) and in the
    ``_megatron_fsdp_model`` it attaches to every parameter; torch FSDP2 (Megatron-LM's
    ``--use-torch-fsdp2``, a training argument that no config of the model records) only in the
    parameters, which it turns into DTensors.

    Raises:
        ModelError: naming the setting and the fix.
    """
    found = find_gpt(model)
    if found is None:
        return
    m = model
    while m is not found[1] and isinstance(m, nn.Module):
        ddp = getattr(m, "ddp_config", None)
        for field in ("use_megatron_fsdp", "use_custom_fsdp"):
            if getattr(ddp, field, False):
                raise ModelError(
                    f"DistributedDataParallelConfig.{field} is True: the Megatron model's "
                    "parameters are stored by Megatron-FSDP, which canzona does not execute; "
                    "give canzona the model without the FSDP wrapper (canzona's ZeRO-1 replaces "
                    "Megatron's data parallelism).")
        m = getattr(m, "module", None)
    pairs = named_params(found[1])
    for name, t in pairs:
        if getattr(t, "_megatron_fsdp_model", None) is not None:
            raise ModelError(
                f"the Megatron model's '{name}' is stored by Megatron-FSDP "
                "(DistributedDataParallelConfig.use_megatron_fsdp=True), which canzona does not "
                "execute; build the model without it (canzona's ZeRO-1 replaces Megatron's data "
                "parallelism).")
        if local_tensor(t) is not t:
            raise ModelError(
                f"the Megatron model's '{name}' is a DTensor: its parameters are sharded by "
                "torch FSDP2 (Megatron-LM's --use-torch-fsdp2, TorchFullyShardedDataParallel), "
                "which canzona does not execute; build the model without it (canzona's ZeRO-1 "
                "replaces Megatron's data parallelism).")
    _expert_naming([n for n, _ in pairs])


def megatron_ep(model: Any) -> int:
    """The expert-parallel size a Megatron-core model was built for (1 for other models)."""
    found = find_gpt(model)
    if found is None:
        return 1
    return int(getattr(found[1].config, "expert_model_parallel_size", 1) or 1)


def megatron_etp(model: Any) -> int | None:
    """The expert tensor-parallel size a Megatron-core MoE model was built for, when it differs
    from its TP size (``ParallelSizes.etp``); None otherwise and for other models."""
    found = find_gpt(model)
    if found is None:
        return None
    c = found[1].config
    etp = getattr(c, "expert_tensor_parallel_size", None)
    if etp is None or not getattr(c, "num_moe_experts", None):
        return None
    return None if int(etp) == megatron_tp(model) else int(etp)


def _expert_offset(gpt: nn.Module) -> int:
    """The global index of this rank's first expert (Megatron's ``MoELayer``
    ``local_expert_indices``); 0 for a dense model."""
    for m in gpt.modules():
        indices = getattr(m, "local_expert_indices", None)
        if indices:
            return int(indices[0])
    return 0


def megatron_stages(model: Any) -> StageSplit:
    """The pipeline stages a Megatron-core model was built for (its TransformerConfig's
    ``pipeline_model_parallel_size`` and first/last stage layer counts; pp 1 for other models)."""
    found = find_gpt(model)
    if found is None:
        return StageSplit()
    c = found[1].config
    pp = int(getattr(c, "pipeline_model_parallel_size", 1) or 1)
    if pp == 1:
        return StageSplit()
    return StageSplit(pp=pp, first_stage_layers=getattr(c, "num_layers_in_first_pipeline_stage",
                                                        None),
                      last_stage_layers=getattr(c, "num_layers_in_last_pipeline_stage", None))


def _stage_of(gpt: nn.Module, parts: tuple[ModelSpec, ...]) -> ModelSpec:
    """The stage of ``parts`` (the whole model's, :func:`~canzona.planner.stages.split_model`)
    the stage module ``gpt`` holds: its first layer's global number (Megatron's 1-based
    ``layer_number``) and whether it embeds (``pre_process``) and outputs (``post_process``)."""
    layers = list(getattr(gpt.decoder, "layers", ()))
    first = int(layers[0].layer_number) - 1 if layers else None
    pre, post = bool(getattr(gpt, "pre_process", True)), bool(getattr(gpt, "post_process", True))
    for part in parts:
        st = part.stage
        assert st is not None
        if st.first == pre and st.last == post and (
                (first is None and st.layers == 0) or (first == st.first_layer and st.layers)):
            return part
    raise ModelError(f"the Megatron stage module (first layer {first}, pre_process {pre}, "
                     f"post_process {post}) is none of the {len(parts)} stages its "
                     "TransformerConfig lays out; build each stage with Megatron's "
                     "pre_process/post_process for its pipeline rank.")


def megatron_tp(model: Any) -> int:
    """The tensor-parallel size a Megatron-core model was built for (1 for other models)."""
    found = find_gpt(model)
    if found is None:
        return 1
    return int(getattr(found[1].config, "tensor_model_parallel_size", 1) or 1)


def megatron_spec(model: Any, *, vocab: int | None = None, name: str | None = None,
                  matrix_globs: tuple[str, ...] | list[str] = (),
                  adamw_globs: tuple[str, ...] | list[str] = ()) -> ModelSpec | None:
    """The planner's inventory of a live Megatron-core model (None when ``model`` is not one):
    the config's parameters under Megatron names (prefixed as ``model`` names them), each with
    the live dtype, after checking names, order and local shard shapes.

    Raises:
        ModelError: the model is a Megatron GPTModel the config does not describe (naming the
            first parameter that differs).
    """
    found = find_gpt(model)
    if found is None:
        return None
    prefix, gpt = found
    cfg = megatron_config(gpt, vocab=vocab, name=name)
    check_megatron_model(model)
    tp = megatron_tp(gpt)
    etp = megatron_etp(gpt) or tp
    live = named_params(model)
    naming = _expert_naming([n for n, _ in live])
    spec = build_inventory(cfg, names=naming, matrix_globs=tuple(
        g.removeprefix(prefix) for g in matrix_globs), adamw_globs=tuple(
        g.removeprefix(prefix) for g in adamw_globs))
    # A pipeline stage's module holds its stage's parameters, its layers numbered from 0; under
    # expert parallelism the rank holds E/ep experts, numbered from 0 in its names: named by
    # their global layer and expert index, they are the plan's.
    split = megatron_stages(gpt)
    mine, first_layer = spec, 0
    if split.pp > 1:
        mine = _stage_of(gpt, split_model(spec, split))
        first_layer = mine.stage.first_layer  # type: ignore[union-attr]
    ep = megatron_ep(gpt)
    offset, per_rank = _expert_offset(gpt), cfg.num_experts // ep if ep > 1 else 0
    local = [p for p in mine.params if ep == 1 or not p.is_expert
             or offset <= p.expert < offset + per_rank]
    planned = [prefix + p.name for p in local]
    names = [global_name(n, Placement(layer_offset=first_layer, expert_offset=offset))
             for n, _ in live]
    if names != planned:
        k = next((k for k, (a, b) in enumerate(zip(planned, names)) if a != b),
                 min(len(planned), len(names)))
        a = planned[k] if k < len(planned) else "nothing"
        b = live[k][0] if k < len(names) else "nothing"
        raise ModelError(f"the Megatron model's parameter #{k} is '{b}' but its TransformerConfig "
                         f"describes '{a}' there; canzona.plan_model reads GPTModels built with "
                         "the local layer spec of a Llama/Qwen3 model (experts as SequentialMLP "
                         "or TEGroupedMLP).")
    params = []
    live_of = {p.name: nt for p, nt in zip(local, live)}
    # another EP rank's expert or another stage's parameter: the dtype this rank's parameters
    # of its kind have
    held_dtype = {}
    for p in local:
        held_dtype.setdefault(p.kind, dtype_name(live_of[p.name][1].dtype))
    for p in spec.params:
        if p.name not in live_of:
            params.append(dataclasses.replace(p, name=prefix + p.name,
                                              dtype=held_dtype.get(p.kind, p.dtype)))
            continue
        n, t = live_of[p.name]
        t_p = etp if p.is_expert else tp  # experts: Megatron's expert TP
        want = shard_map(p, t_p, kv_groups=cfg.kv_heads).local_shape if t_p > 1 else (
            (padded_vocab(p.shape[0], 1), *p.shape[1:]) if p.tp_layout == "vocab" else p.shape)
        got = tuple(local_tensor(t).shape)
        if got != tuple(want):
            raise ModelError(f"the Megatron model's '{n}' is {list(got)} on this rank but its "
                             f"TransformerConfig at tp={t_p} gives {list(want)}.")
        attrs = _megatron_attrs(t)
        planned_attrs = _planned_attrs(p, naming == "megatron-grouped", etp > 1 or ep > 1)
        if attrs != planned_attrs:
            raise ModelError(f"the Megatron model's '{n}' has tensor_model_parallel, "
                             f"partition_dim, partition_stride = {attrs} but its TransformerConfig "
                             f"gives the '{p.tp_layout}' layout {planned_attrs}.")
        if (getattr(t, "is_embedding_or_output_parameter", False)
                and p.kind not in ("embedding", "output")):
            raise ModelError(f"the Megatron model marks '{n}' is_embedding_or_output_parameter but "
                             f"its TransformerConfig gives a {p.kind} there.")
        params.append(dataclasses.replace(p, name=prefix + p.name, dtype=dtype_name(t.dtype, n)))
    return ModelSpec(config=cfg, params=tuple(params), label=cfg.name)
