"""Pipeline stages as Megatron-core lays them out: which decoder layers each of ``pp`` stages
builds, and each stage's parameters as an inventory of its own.

Megatron's rule (``get_num_layers_to_build``): without ``num_layers_in_first_pipeline_stage``
and ``num_layers_in_last_pipeline_stage`` the layers split evenly, so ``pp`` must divide them;
with either given, the layers left over split evenly among the other stages. Stage 0 holds the
embedding, the last stage the final norm and the output layer; with tied embeddings and pp > 1
the last stage holds a copy of the embedding as ``output_layer.weight`` (Megatron's
``shared_embedding_or_output_weight``), whose gradient the trainer sums with the first stage's.

The planner moves nothing across stages: the stage layout is the trainer's. Each stage is
planned on its own, over its own DP and TP groups (:func:`canzona.planner.pipeline.plan`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import SizeError
from .inventory import ModelSpec, ParamSpec, Stage

__all__ = ["StageSplit", "split_model", "stage_layers", "stage_model", "tied_copy",
           "tied_name"]

@dataclass(frozen=True, slots=True)
class StageSplit:
    """How the trainer splits the decoder layers over ``pp`` stages: Megatron's
    ``pipeline_model_parallel_size``, ``num_layers_in_first_pipeline_stage`` and
    ``num_layers_in_last_pipeline_stage`` (None: an even share)."""

    pp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


#: The fields of :class:`StageSplit` as errors name them (a front end respells them).
PP, FIRST, LAST = "StageSplit.pp", "StageSplit.first_stage_layers", "StageSplit.last_stage_layers"


def stage_layers(layers: int, split: StageSplit) -> tuple[int, ...]:
    """The number of decoder layers on each stage (Megatron's rule, module docstring).

    Raises:
        SizeError: a split that does not fit ``layers``, naming the option and a fix.
    """
    pp, first, last = split.pp, split.first_stage_layers, split.last_stage_layers
    if pp < 1:
        raise SizeError(f"{{{PP}}} must be ≥ 1; got {pp}.", fields=(PP,))
    for name, value in ((FIRST, first), (LAST, last)):
        if value is not None and value < 0:
            raise SizeError(f"{{{name}}} must be ≥ 0; got {value}.", fields=(name,))
    if pp == 1:
        if first is not None or last is not None:
            raise SizeError(f"{{{FIRST}}} and {{{LAST}}} need {{{PP}}} > 1; got pp 1.",
                            fields=(PP, FIRST, LAST))
        return (layers,)
    if first is None and last is None:
        if layers % pp:
            fits = [d for d in range(2, layers + 1) if layers % d == 0]
            raise SizeError(
                f"{{{PP}}} {pp} must divide the {layers} decoder layers; give the first and last "
                f"stages' layers ({{{FIRST}}}, {{{LAST}}}) or a pp among "
                f"{', '.join(map(str, fits[:8]))}.", fields=(PP, FIRST, LAST))
        return (layers // pp,) * pp
    ends = (first is not None) + (last is not None)
    rest = layers - (first or 0) - (last or 0)
    middle = pp - ends
    given = " + ".join(f"{{{n}}} {v}" for n, v in ((FIRST, first), (LAST, last))
                       if v is not None)
    if rest < 0:
        raise SizeError(f"{given} is more than the {layers} decoder layers; change "
                        f"{{{FIRST}}} or {{{LAST}}}.", fields=(PP, FIRST, LAST))
    if (middle == 0 and rest) or (middle and rest % middle):
        raise SizeError(
            f"{given} leaves {rest} of the {layers} decoder layers for {middle} other "
            f"stage{'s' if middle != 1 else ''} at pp {pp}, which must split them evenly; "
            f"change {{{FIRST}}} or {{{LAST}}}.", fields=(PP, FIRST, LAST))
    each = rest // middle if middle else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def split_model(spec: ModelSpec, split: StageSplit) -> tuple[ModelSpec, ...]:
    """Each stage's parameters of ``spec`` (the whole model), in registration order and under
    their global names, as inventories that know their stage (:class:`Stage`).

    Raises:
        SizeError: a split that does not fit the model's layers.
    """
    if spec.stage is not None:
        raise ValueError("split_model takes the whole model's inventory, not a stage's")
    counts = stage_layers(_layer_count(spec), split)
    firsts = [sum(counts[:s]) for s in range(len(counts))]
    return tuple(stage_model(spec, Stage(pp=split.pp, stage=s, first_layer=f, layers=n))
                 for s, (f, n) in enumerate(zip(firsts, counts)))


def stage_model(spec: ModelSpec, stage: Stage) -> ModelSpec:
    """Stage ``stage`` of the whole model ``spec``: its decoder layers, the embedding on the
    first stage, what follows the decoder on the last (and there, with tied embeddings, the
    embedding's copy, :func:`tied_copy`)."""
    end = stage.first_layer + stage.layers
    held = [p for p in spec.params
            if (stage.first_layer <= p.layer < end if p.layer is not None
                else stage.first if p.kind == "embedding" else stage.last)]
    name = tied_name(spec)
    if stage.last and stage.pp > 1 and name is not None:
        held.append(tied_copy(next(p for p in spec.params if p.kind == "embedding"), name))
    return dataclasses.replace(spec, params=tuple(held), stage=stage, _index={})


def tied_name(spec: ModelSpec) -> str | None:
    """The name of the output layer that shares the embedding's weight, None when none does: a
    live module's (``ModelSpec.tied``), or for a tied config Megatron's ``output_layer.weight``
    (the ``transformers`` model's ``lm_head.weight`` under its names)."""
    if spec.tied is not None:
        return spec.tied
    if spec.config is None or not spec.config.tied_embeddings:
        return None
    emb = next((p for p in spec.params if p.kind == "embedding"), None)
    hf = emb is not None and emb.name.startswith("model.")
    return "lm_head.weight" if hf else "output_layer.weight"


def tied_copy(embedding: ParamSpec, name: str) -> ParamSpec:
    """The last stage's copy of a tied embedding under the output layer's ``name``: the
    embedding's shape, layout and optimizer."""
    return dataclasses.replace(embedding, name=name, kind="output")


def _layer_count(spec: ModelSpec) -> int:
    if spec.config is not None:
        return spec.config.layers
    got = {p.layer for p in spec.params if p.layer is not None}
    return max(got) + 1 if got else 0
