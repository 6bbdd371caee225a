"""What a plan records about its inputs, with no planner machinery behind it.

:class:`OptimizerSettings` (the matrix optimizer and the settings of it that change the plan),
Megatron's :data:`PARAM_ALIGN` and its expert rank order (:func:`expert_place`) live here so
that the plan schema (``canzona.planner.plan``) can import them without loading the cost model,
the inventory or the layout. This module imports only pydantic, the standard library,
:mod:`canzona.planner.formulas` (itself stdlib-only, for the optimizer kernels' defaults) and
the optimizer registry :mod:`canzona.planner.optimizers` (which names are valid).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from . import formulas, optimizers

__all__ = ["PARAM_ALIGN", "OptimizerName", "OptimizerSettings", "expert_place"]

#: Megatron pads each parameter's start to 64 elements (128-byte addresses at 16 bits).
PARAM_ALIGN = 64


def expert_place(r: int, ep_rank: int, *, ep: int, tp: int, etp: int | None = None
                 ) -> tuple[int, int | None]:
    """Where rank ``r`` of EP rank ``ep_rank``'s expert-data-parallel group sits: its DP index,
    and its TP rank when expert TP is 1 under tp > 1 (its experts are whole there, on that TP
    rank alone; None at etp = tp, where every TP rank of the index holds a shard).

    Megatron orders dense ranks TP fastest, then DP (global rank g = d·tp + t), and expert ranks
    expert-TP fastest, then EP, then expert-DP (g = (r·ep + k)·etp + e)."""
    etp = tp if etp is None else etp
    g = (r * ep + ep_rank) * etp
    if etp == tp:
        return g // tp, None
    return g // tp, g % tp


def _registered(name: str) -> str:
    if name not in optimizers.names():
        raise ValueError(f"unknown optimizer {name!r}; registered: {', '.join(optimizers.names())}")
    return name


def _enum_of_registered(schema: dict[str, Any]) -> None:
    # The JSON schema a Literal of the registered names would have (enum first, as pydantic
    # writes it), so the schema stays what it was when the names were written out.
    rest = {k: v for k, v in schema.items() if k != "type"}
    schema.clear()
    schema.update(enum=list(optimizers.names()), type="string", **rest)


#: A matrix optimizer's name: one registered in :mod:`canzona.planner.optimizers`.
OptimizerName = Annotated[str, AfterValidator(_registered)]


class OptimizerSettings(BaseModel):
    """The matrix optimizer and the settings of it that change the plan (costs, task shapes).

    Runtime hyper-parameters (lr, weight decay, betas) belong to the optimizer constructor.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: OptimizerName = Field(default="muon", json_schema_extra=_enum_of_registered)
    ns_steps: int = Field(default=5, ge=1, description="Muon: Newton–Schulz iterations.")
    max_preconditioner_dim: int = Field(default=1024, ge=1,
                                        description="Shampoo: block size of the logical matrix.")
    shampoo_precondition_frequency: int = Field(
        default=formulas.SHAMPOO_DEFAULT_PRECONDITION_FREQUENCY, ge=1)
    shampoo_grafting: bool = True
    soap_precondition_frequency: int = Field(default=10, ge=1)
    soap_max_precond_dim: int = Field(default=10000, ge=1)
    split_qkv: bool = Field(default=False, description="Q, K, V as separate matrices.")
    split_gate_up: bool = Field(default=False, description="gate and up as separate matrices.")

    @property
    def spec(self) -> optimizers.OptimizerSpec:
        """The registry's spec of this optimizer: its formulas and capabilities."""
        return optimizers.get(self.name)
