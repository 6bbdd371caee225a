"""What a plan records about its inputs, with no planner machinery behind it.

:class:`OptimizerSettings` (the matrix optimizer and the settings of it that change the plan),
Megatron's :data:`PARAM_ALIGN` and its expert rank order (:func:`expert_place`) live here so
that the plan schema (``canzona.planner.plan``) can import them without loading the cost model,
the inventory or the layout. This module imports only pydantic, the standard library,
:mod:`canzona.planner.formulas` (itself stdlib-only, for the optimizer kernels' defaults) and
the optimizer registry :mod:`canzona.planner.optimizers` (which names are valid).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, model_serializer,
                      model_validator)

from . import formulas, optimizers

__all__ = ["NS_SCHEDULES", "PARAM_ALIGN", "Coefficients", "OptimizerName", "OptimizerSettings",
           "QKV_SPLITS", "expert_place", "ns_schedule"]

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


#: One Newton–Schulz step's polynomial coefficients (a, b, c): X ← aX + b(XXᵀ)X + c(XXᵀ)²X.
Coefficients = tuple[float, float, float]

#: The named Newton–Schulz coefficient schedules (``OptimizerSettings.ns_coefficients``,
#: ``canzona plan --ns``, Muon's ``ns_coefficients``): per-step (a, b, c).
#:
#: * ``"simple"``: Keller Jordan's (3.4445, −4.7750, 2.0315) at every step (torch.optim.Muon's);
#: * ``"quintic"``: the 5 per-step triples of modded-nanogpt and Cesista's coefficient search,
#:   Megatron-LM's ``coefficient_type="quintic"``;
#: * ``"polar_express"``: the 8 per-step triples of Polar Express (Amsel et al.,
#:   arXiv 2505.16932, safety 1e-2), as ``pytorch-optimizer`` ships them.
NS_SCHEDULES: dict[str, tuple[Coefficients, ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.237312490495555, -23.157747414558198, 16.680568411445915),
        (4.082441999064835, -2.893047735332586, 0.5252849256975648),
        (3.9263479922546582, -2.8547468034765298, 0.5318022422894988),
        (3.2982187133085143, -2.424541981026706, 0.48632008358844075),
        (2.2970369434552573, -1.63662558125903, 0.4002628455953627),
        (1.8763805351440397, -1.2347896577722228, 0.35891887501668385),
        (1.8564423485617974, -1.2132449880935525, 0.3568003487825883),
        (1.8749994008682747, -1.2499988017229169, 0.3749994008546422),
    ),
}


def ns_schedule(spec: object, ns_steps: int, owner: str = "ns_coefficients"
                ) -> tuple[Coefficients, ...]:
    """The (a, b, c) of each of ``ns_steps`` Newton–Schulz steps from ``spec``: a name of
    :data:`NS_SCHEDULES`, one (a, b, c) used at every step, or a per-step list of them. Step i
    takes entry min(i, len − 1) of a list, so a shorter list repeats its last step (Polar
    Express's rule) and a longer one is cut.

    Raises:
        ValueError: an unknown name or a malformed triple (the message starts with ``owner``
            and lists the names).
    """

    def triple(t: object) -> Coefficients:
        if (not isinstance(t, (tuple, list)) or len(t) != 3
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                           and math.isfinite(x) for x in t)):
            raise ValueError(f"{owner}: {t!r} is not a triple (a, b, c) of finite numbers")
        return (float(t[0]), float(t[1]), float(t[2]))

    if isinstance(spec, str):
        if spec not in NS_SCHEDULES:
            raise ValueError(f"{owner}: unknown schedule {spec!r}; choose one of "
                             f"{', '.join(NS_SCHEDULES)}, one (a, b, c) or a per-step list of "
                             "them")
        steps = NS_SCHEDULES[spec]
    elif (isinstance(spec, (tuple, list)) and len(spec) > 0
          and all(isinstance(x, (tuple, list)) for x in spec)):
        steps = tuple(triple(t) for t in spec)
    else:
        return (triple(spec),) * ns_steps
    return tuple(steps[min(i, len(steps) - 1)] for i in range(ns_steps))


def _known_schedule(spec: str | tuple[Coefficients, ...]) -> str | tuple[Coefficients, ...]:
    ns_schedule(spec, 1)
    return spec


#: A plan's Newton–Schulz schedule: a name of :data:`NS_SCHEDULES` or per-step (a, b, c).
NSCoefficients = Annotated[str | tuple[Coefficients, ...], AfterValidator(_known_schedule)]


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


#: How Megatron's fused QKV is orthogonalised: one matrix, Q, K and V apart, or head by head.
QKV_SPLITS = ("fused", "qkv", "heads")
QKVSplit = Literal[QKV_SPLITS]  # type: ignore[valid-type]

#: A matrix optimizer's name: one registered in :mod:`canzona.planner.optimizers`.
OptimizerName = Annotated[str, AfterValidator(_registered)]


class OptimizerSettings(BaseModel):
    """The matrix optimizer and the settings of it that change the plan (costs, task shapes).

    Runtime hyper-parameters (lr, weight decay, betas) belong to the optimizer constructor.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: OptimizerName = Field(default="muon", json_schema_extra=_enum_of_registered)
    ns_steps: int = Field(default=5, ge=1, description="Muon: Newton–Schulz iterations.")
    ns_coefficients: NSCoefficients = Field(
        default="simple", description="Muon: the Newton–Schulz schedule, a name (simple, "
        "quintic, polar_express) or per-step (a, b, c); written only when not simple.")
    max_preconditioner_dim: int = Field(default=1024, ge=1,
                                        description="Shampoo: block size of the logical matrix.")
    shampoo_precondition_frequency: int = Field(
        default=formulas.SHAMPOO_DEFAULT_PRECONDITION_FREQUENCY, ge=1)
    shampoo_grafting: bool = True
    soap_precondition_frequency: int = Field(default=10, ge=1)
    soap_max_precond_dim: int = Field(default=10000, ge=1)
    qkv_split: QKVSplit = Field(
        default="fused", description="Megatron's fused QKV: one matrix (fused), Q, K and V as "
        "three (qkv), or one per attention head of each (heads); written as split_qkv unless "
        "heads.")
    split_gate_up: bool = Field(default=False, description="gate and up as separate matrices.")

    @model_validator(mode="before")
    @classmethod
    def _split_qkv_flag(cls, data: Any) -> Any:
        """``split_qkv`` (a bool: what plans write for ``fused`` and ``qkv``) reads as
        ``qkv_split``."""
        if not isinstance(data, dict) or "split_qkv" not in data:
            return data
        data = dict(data)
        flag = data.pop("split_qkv")
        if not isinstance(flag, bool):
            raise ValueError(f"split_qkv must be true or false, got {flag!r}; or give "
                             f"qkv_split: one of {', '.join(QKV_SPLITS)}")
        if "qkv_split" in data and data["qkv_split"] != ("qkv" if flag else "fused"):
            raise ValueError(f"split_qkv={flag} and qkv_split={data['qkv_split']!r} disagree; "
                             "give qkv_split alone")
        data["qkv_split"] = "qkv" if flag else "fused"
        return data

    @model_serializer(mode="wrap")
    def _as_written_before(self, handler):  # noqa: ANN001, ANN202
        """The default schedule is not written, and the QKV split is written as the flag
        ``split_qkv`` unless it is per head, so a plan that uses neither has the text it had
        before they were recorded (and an older canzona reads it)."""
        out = handler(self)
        if self.ns_coefficients == "simple":
            out.pop("ns_coefficients", None)
        if self.qkv_split != "heads" and "qkv_split" in out:
            out = {("split_qkv" if k == "qkv_split" else k):
                   (self.qkv_split == "qkv" if k == "qkv_split" else v) for k, v in out.items()}
        return out

    @property
    def split_qkv(self) -> bool:
        """Q, K and V are three matrices (``qkv_split == "qkv"``)."""
        return self.qkv_split == "qkv"

    @property
    def records_recipe(self) -> bool:
        """The settings record a choice a version-5 plan has no field for (a Newton–Schulz
        schedule other than ``simple``)."""
        return self.ns_coefficients != "simple"

    @property
    def records_heads(self) -> bool:
        """The settings record a choice a version-6 plan has no field for (one matrix per
        attention head)."""
        return self.qkv_split == "heads"

    @property
    def spec(self) -> optimizers.OptimizerSpec:
        """The registry's spec of this optimizer: its formulas and capabilities."""
        return optimizers.get(self.name)
