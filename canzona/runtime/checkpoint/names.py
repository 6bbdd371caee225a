"""The logical key scheme's names: a parameter as the whole model knows it, whatever the layout.

A rank's model names a parameter by its own local structure: a pipeline stage numbers its layers
from 0 (Megatron-core's ``decoder.layers.0`` on every stage), an expert-parallel rank numbers its
experts from 0 (Megatron's ``mlp.experts.local_experts.{j}`` and TEGroupedMLP's
``mlp.experts.linear_fc1.weight{j}``, Hugging Face's ``mlp.experts.{j}``). A checkpoint key must
name the same tensor under every layout, so :func:`global_name` renames a local name by the
rank's :class:`Placement`: the global index of its first layer and of its first expert. The
canonical unsplit tensor behind the name is :mod:`~canzona.runtime.checkpoint.mapping`'s (TP
shards, fused parts and the vocabulary's padding resolved there).

Checkpoints record the key scheme as ``canzona.json``'s ``format``. :data:`KEY_UPGRADES` maps a
format to the function that renames its keys into the next format's, so a checkpoint of an older
format loads through the chain (:func:`upgrade_key`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from canzona.planner.inventory import LAYER_NAME

__all__ = ["FORMAT", "KEY_UPGRADES", "Placement", "expert_index", "global_name", "upgrade_key"]

#: The key scheme this canzona writes: 2 names layers and experts by their global index.
FORMAT = 2

#: Format n → the renaming of its keys into format n + 1. Format 1 wrote the local names of
#: runs with one pipeline stage and one expert-parallel rank, where they are the global ones.
KEY_UPGRADES: dict[int, Callable[[str], str]] = {1: lambda key: key}

_LAYER = LAYER_NAME
_EXPERT = (re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)"),  # Megatron SequentialMLP
           re.compile(r"(\.experts\.linear_fc[12]\.weight)(\d+)($)"),  # Megatron grouped GEMM
           re.compile(r"(\.experts\.)(\d+)(\.)"))  # Hugging Face, one module per expert


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a rank's local model sits in the whole: the global index of its first layer (a
    pipeline stage's offset) and of its first expert (an expert-parallel rank's offset)."""

    layer_offset: int = 0
    expert_offset: int = 0

    def __post_init__(self) -> None:
        if self.layer_offset < 0 or self.expert_offset < 0:
            raise ValueError(f"Placement offsets must be ≥ 0, got layer_offset="
                             f"{self.layer_offset}, expert_offset={self.expert_offset}")


def global_name(name: str, placement: Placement = Placement()) -> str:
    """``name`` (a parameter's local name, or ``param#part``) with its layer and expert indices
    made global: the first ``layers.N.`` gains ``placement.layer_offset`` and the expert index
    (in any of the layouts above) ``placement.expert_offset``. Names without them (embeddings,
    the final norm, the output layer) are unchanged, and so is a stacked ``[E, m, n]`` expert
    tensor's name: its rank's experts are rows of the one canonical tensor."""
    if placement.layer_offset:
        name = _LAYER.sub(lambda m: f"{m[1]}layers.{int(m[2]) + placement.layer_offset}.", name,
                          count=1)
    if placement.expert_offset:
        for pattern in _EXPERT:
            renamed = pattern.sub(
                lambda m: f"{m[1]}{int(m[2]) + placement.expert_offset}{m[3]}", name, count=1)
            if renamed != name:
                return renamed
    return name


def expert_index(name: str) -> int | None:
    """The expert index ``name`` carries (in any of the layouts above), or None."""
    for pattern in _EXPERT:
        m = pattern.search(name)
        if m is not None:
            return int(m[2])
    return None


def upgrade_key(key: str, version: int) -> str:
    """``key`` of a checkpoint of format ``version`` renamed into this canzona's
    :data:`FORMAT`, through every step of :data:`KEY_UPGRADES`."""
    for v in range(version, FORMAT):
        key = KEY_UPGRADES[v](key)
    return key
