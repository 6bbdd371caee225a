"""``canzona.plan_model``: plan a live ``nn.Module`` (runtime introspection → planner).

The one place that joins the torch side (``canzona.runtime.introspect``) with the torch-free
planner; it is imported lazily by ``canzona.__getattr__`` so ``import canzona`` stays torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from canzona.planner import optimizers, pipeline
from canzona.planner.errors import CanzonaError, SizeError
from canzona.planner.layout import ParallelSizes
from canzona.planner.options import DEFAULT_COST, DEFAULT_SHARE, DPOptions, TPOptions
from canzona.planner.plan import FSDP2Plan, PipelinePlan, Plan
from canzona.planner.settings import OptimizerSettings
from canzona.planner.stages import StageSplit

__all__ = ["plan_model"]


def plan_model(
    model: Any,
    *,
    dp: int,
    tp: int | None = None,
    ep: int | None = None,
    optimizer: str = "muon",
    bucket_size: int | None = None,
    overlap_grad_reduce: bool = True,
    cost: str = DEFAULT_COST,
    solver: str = "auto",
    alpha: float = 1.0,
    time_limit_s: float = 10.0,
    seed: int = 0,
    comm_limit: float | None = None,
    reorder: bool = True,
    name: str | None = None,
    matrix_globs: Sequence[str] = (),
    adamw_globs: Sequence[str] = (),
    comm_dtype: str = "bf16",
    objective: str = "step-time",
    hardware: str = "h100",
    progress: Callable[[str], None] | None = None,
    vocab: int | None = None,
    share: str = DEFAULT_SHARE,
    head_dim: int | None = None,
    pp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    storage: str | None = None,
    **settings: Any,
) -> Plan | PipelinePlan | FSDP2Plan:
    """Plan ZeRO-1 data parallelism with whole-matrix ownership for a live model.

    Args:
        model: an ``nn.Module`` or its ``named_parameters()``.
        dp: data-parallel size. tp: tensor-parallel size (default: a Megatron-core model's
            ``tensor_model_parallel_size``, else 1): > 1 for a Megatron-core GPTModel built at
            that TP size, or for a model whose TP-split parameters are DTensors placed
            ``Shard(0)`` (column) or ``Shard(1)`` (row) on the mesh dim ``tp``
            (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``); fused layouts
            (qkv, gate_up, vocab) need a model config (``canzona.planner.pipeline.plan``).
        ep: expert-parallel size (default: a Megatron-core model's
            ``expert_model_parallel_size``, else 1). With ep > 1 each rank holds E/ep experts;
            ``dp`` is the whole data-parallel size (Megatron's: ep folds into it), the expert
            buffers are sharded over expert-DP = dp·tp / (ep·etp) ranks (a Megatron model's
            expert TP is read from its ``expert_tensor_parallel_size``: tp or 1).
        optimizer: a name in the optimizer registry, ``canzona.planner.optimizers`` (built in:
            ``muon``, ``shampoo``, ``soap``); another raises ``CanzonaError`` listing them.
        bucket_size: elements per gradient bucket (Megatron's default max(40M, 1M·dp) if None).
        overlap_grad_reduce: False puts each buffer in one bucket.
        cost, solver, alpha, time_limit_s, seed, comm_limit, reorder: the fields of
            :class:`~canzona.planner.options.DPOptions` (``canzona plan``'s options).
        name: the model name in the plan (default: the module's class name).
        matrix_globs, adamw_globs: optimizer-route overrides by parameter name.
        comm_dtype: dtype of the TP gather/scatter recorded in the plan (``TPOptions.comm_dtype``:
            bf16, fp16 or fp32; fp32 for exact comparisons).
        objective: ``step-time`` (the compute, then the predicted collectives) or ``max-load``
            (``DPOptions.objective``).
        hardware: the profile whose communication model picks each bucket's collective method
            (``cpu``, ``h100``, ``h800`` or a profile file; ``TPOptions.hardware``).
        vocab: Megatron-core models only: the tokenizer's vocabulary before Megatron's padding
            (default: the model's padded ``vocab_size``); recorded as the logical vocabulary, as
            a plan made offline from the matching config records it.
        share: tp > 1: ``TPOptions.share`` — ``off``, ``auto`` (the TP group shares the Muon
            matrices heavier than the mean per-GPU work: shared Newton–Schulz over its shards),
            ``all`` or ``all-split``.
        head_dim: rows per attention head of a module's q, k and v projections (named
            ``*q_proj.weight``, ``*k_proj.weight``, ``*v_proj.weight``), which
            ``qkv_split="heads"`` orthogonalises head by head; a Megatron-core model's come from
            its config.
        pp, first_stage_layers, last_stage_layers: pipeline stages
            (:class:`~canzona.planner.stages.StageSplit`, Megatron's rule): ``model`` is the
            whole model (its decoder layers named ``layers.{i}``), each stage is planned over
            its own DP and TP groups, and the result is a
            :class:`~canzona.planner.plan.PipelinePlan` for every stage's ranks (each builds
            ``CanzonaOptimizer(stage_module, plan, pp_group=…)``). A module whose output head
            is its embedding's tensor has that weight copied to the last stage, under the head's
            name. A Megatron-core model built with ``pipeline_model_parallel_size`` > 1 is one
            stage's module: the plan is the whole model's, its stages as the TransformerConfig
            lays them out (``pp`` must then agree or be left out).
        storage: where the parameters live (``canzona.planner.pipeline.STORAGES``): ``zero1``
            (canzona's ZeRO-1 buckets) or ``fsdp2`` (a ``fully_shard``-ed model: each matrix's
            owner and the all-to-all rounds, an :class:`~canzona.planner.plan.FSDP2Plan`; with
            tp > 1 a dp × tp mesh).
            Default: ``fsdp2`` for a model with ``fully_shard``-ed modules, else ``zero1``.
        **settings: further :class:`~canzona.planner.settings.OptimizerSettings` fields
            (``ns_steps``, ``max_preconditioner_dim``, ``soap_precondition_frequency``,
            ``qkv_split``: ``fused``, ``qkv`` or ``heads``, …).

    Returns:
        The plan, ready for :class:`canzona.CanzonaOptimizer` or
        :func:`canzona.planner.plan.save_plan`.
    """
    optimizers.get(optimizer)  # an unknown name fails here, naming the registered ones
    options = DPOptions(solver=solver, alpha=alpha, time_limit_s=time_limit_s, seed=seed,
                        comm_limit=comm_limit, reorder=reorder, cost=cost,
                        bucket_size=bucket_size, overlap_grad_reduce=overlap_grad_reduce,
                        objective=objective)
    # checked before the model is read
    tp_options = TPOptions(comm_dtype=comm_dtype, hardware=hardware, share=share)
    from canzona.runtime.experts import global_inventory
    from canzona.runtime.introspect import fsdp2_modules, inventory
    from canzona.runtime.megatron import (megatron_ep, megatron_etp, megatron_spec,
                                          megatron_stages, megatron_tp)

    # A Megatron-core GPTModel is read through its TransformerConfig: the plan is the one made
    # offline from that config (Megatron names, fused layouts), with the live dtypes.
    spec = megatron_spec(model, vocab=vocab, name=name, matrix_globs=matrix_globs,
                         adamw_globs=adamw_globs)
    if spec is None:
        if vocab is not None:
            raise CanzonaError("vocab= is for Megatron-core models (the vocabulary before "
                               "Megatron's padding); this model is not one.")
        if settings.get("qkv_split") == "heads" and head_dim is None:
            raise CanzonaError("qkv_split='heads' needs the rows per attention head of this "
                               "model's q, k and v projections: pass head_dim=.")
        spec = inventory(model, name=name, matrix_globs=matrix_globs, adamw_globs=adamw_globs,
                         head_dim=head_dim)
        sharded = bool(fsdp2_modules(model))
        if sharded:  # FSDP2 with TP: the mesh's "tp" dimension
            tp = _built(tp, "tp", _mesh_tp(model), "tp", "tensor-parallel",
                        where="its device mesh's dimension")
        tp = 1 if tp is None else tp
        ep = 1 if ep is None else ep
        etp = None
        split = StageSplit(pp=1 if pp is None else pp, first_stage_layers=first_stage_layers,
                           last_stage_layers=last_stage_layers)
        if ep != 1:  # this rank's experts, numbered from 0: the whole model's, by global index
            spec = global_inventory(spec, ep)
    else:
        sharded = False
        tp = _built(tp, "tp", megatron_tp(model), "tensor_model_parallel_size",
                    "tensor-parallel")
        ep = _built(ep, "ep", megatron_ep(model), "expert_model_parallel_size",
                    "expert-parallel")
        etp = megatron_etp(model)
        split = megatron_stages(model)
        _built(pp, "pp", split.pp, "pipeline_model_parallel_size", "pipeline-parallel")
        if first_stage_layers is not None or last_stage_layers is not None:
            raise SizeError("first_stage_layers and last_stage_layers come from the Megatron "
                            "model's TransformerConfig (num_layers_in_first/last_pipeline_stage)"
                            "; leave them out.")
    return pipeline.plan(spec, ParallelSizes(dp=dp, tp=tp, ep=ep, etp=etp),
                         OptimizerSettings(name=optimizer, **settings), dp_options=options,
                         tp_options=tp_options, progress=progress, stages=split,
                         storage=storage or ("fsdp2" if sharded else "zero1"))


def _mesh_tp(model: Any) -> int:
    """The size of the ``tp`` dimension of the mesh a ``fully_shard``-ed model's parameters
    live on (1: none)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if "tp" in names:
            return int(mesh.size(names.index("tp")))
    return 1


def _built(given: int | None, arg: str, built: int, field: str, what: str, *,
           where: str = "") -> int:
    """A model's parallel size: ``built`` (a Megatron model's TransformerConfig's ``field``, or
    ``where`` names it), which ``given`` (the argument ``arg``) must equal when not None."""
    if given is not None and given != built:
        source = f"{where} '{field}'" if where else f"TransformerConfig.{field}"
        model = "model" if where else "Megatron model"
        raise SizeError(f"{arg}={given}, but the {model} is built for {what} size {built} "
                        f"({source}); pass {arg}={built} or leave {arg} out.")
    return built
