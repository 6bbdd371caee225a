"""The plan file: a versioned, frozen, deterministic pydantic v2 schema, written atomically.

A plan holds the inputs that shaped it, the rank layout, the inventory fingerprint, Megatron's
buffers → buckets with the DP cut points, every task with its owner DP index (and, under TP, host
rank and micro-group), and the load metrics. It holds no wall-clock time, so the same inputs give a
byte-identical file in any process. This module is a leaf: it imports only ``errors`` and
``settings`` of the planner (never the cost model, inventory or layout), so the communication
model, ``planning`` and the torch runtime import the schema without the planner's machinery.

Versions: ``schema_version`` is the lowest version that holds the plan — 2 (:data:`BASE_VERSION`)
for a plan that shares no matrix, 3 (:data:`TP_SHARE_VERSION`) when its TP groups share matrices
(``tp.share``, ``tp.indices[d].shared``), 4 (:data:`DP_PAIR_VERSION`) when DP pairs do
(``dp_shared``), 5 (:data:`TP_PAIR_VERSION`) when TP groups share with a partner DP index's, 6
(:data:`RECIPE_VERSION`) when its optimizer settings record a Newton–Schulz schedule other than
``simple`` (``inputs.optimizer.ns_coefficients``), 7 (:data:`HEADS_VERSION`) when they split the
fused QKV per attention head (``inputs.optimizer.qkv_split``), 8 (:data:`COMPACT_VERSION`) when it
has more than ``compact.COMPACT_TASKS`` tasks and is written compact (:mod:`.compact`), 11
(:data:`SUB_GROUP_VERSION`) when TP sub-groups share matrices (``SharedTaskPlan.sub``); an
older canzona then asks for an upgrade instead of running a plan without its shared tasks, and a
plan without them keeps the text version 2 wrote. Reading a file — the version checks, the
converters of older versions (:mod:`canzona.planner.plan.convert`), this schema and every
consistency check — is :func:`canzona.planner.plan.load.load_plan` (``canzona.load_plan``).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import secrets
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..comm import METHODS
from ..errors import PlanFileError
from ..settings import OptimizerSettings
from . import compact

#: The newest plan version this canzona reads and writes.
SCHEMA_VERSION = 11
#: The version of a plan that shares no matrix (what every plan was before version 3).
BASE_VERSION = 2
#: The version of a plan whose TP groups share matrices (and no DP pair does).
TP_SHARE_VERSION = 3
#: The version of a plan whose DP pairs share matrices (tp = 1).
DP_PAIR_VERSION = 4
#: The version of a plan whose optimizer settings record what version 5 has no field for (a
#: Newton–Schulz schedule other than ``simple``), whatever it shares.
RECIPE_VERSION = 6
#: The version of a plan whose optimizer settings split the fused QKV per attention head (what
#: version 6 has no field for), whatever else it records.
HEADS_VERSION = 7
#: The version of a plan written compact (:mod:`~canzona.planner.plan.compact`: more than
#: ``COMPACT_TASKS`` tasks), whatever else it records.
COMPACT_VERSION = 8
#: The version of a plan for one pipeline stage (``inputs.stage``) and of a pipeline's file
#: (:class:`PipelinePlan`), whatever else it records.
PIPELINE_VERSION = 9
#: The version of a plan for FSDP2's storage (:class:`FSDP2Plan`: every parameter in ``Shard(0)``
#: rows over the DP ranks, each matrix gathered to its owner by all-to-all rounds).
FSDP2_VERSION = 10
#: The version of a plan whose TP sub-groups share matrices (``SharedTaskPlan.sub``: k < tp
#: strided TP ranks share one matrix, tp/k of them side by side).
SUB_GROUP_VERSION = 11
#: The version of a plan whose TP groups share matrices with a partner DP index's (tp > 1,
#: k = 2·tp: ``dp_shared`` at tp > 1, ``SharedTaskPlan.partner``).
TP_PAIR_VERSION = 5

#: Bucket collective methods (``canzona.planner.comm.METHODS``; the runtime's spelling).
CollectiveMethod = Literal[METHODS]  # type: ignore[valid-type]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def record(cls: type[BaseModel], validated: bool, /, **fields: Any) -> Any:
    """A record of ``cls`` with ``fields``: the validated model, or (``validated`` False) a
    namespace of the same fields, the schema's defaults for those not given, several times
    quicker to make. The unvalidated kind is for a plan the planner only simulates (the
    candidates it judges the plan it makes against): read like a plan, never written or run."""
    if validated:
        return cls(**fields)
    return SimpleNamespace(**{**_defaults(cls), **fields})


@lru_cache(maxsize=None)
def _defaults(cls: type[BaseModel]) -> dict[str, Any]:
    """``cls``'s fields that have a default, with it."""
    return {name: f.get_default(call_default_factory=True)
            for name, f in cls.model_fields.items() if not f.is_required()}


class SolverOptions(_Frozen):
    """How the DP partition (and TP schedule) were solved; recorded so a plan can be reproduced."""

    strategy: str = Field(
        description="zero1 | asc | canzona-greedy | canzona (see docs/compare.md).")
    solver: str = Field(default="none", description="greedy | cpsat | none.")
    alpha: float = Field(default=1.0, ge=0.0, le=1.0)
    time_limit_s: float | None = Field(default=None, gt=0)
    seed: int = 0
    workers: int = Field(default=1, ge=1)
    reorder: bool = Field(default=False, description="parameters reordered inside buckets.")
    objective: str = Field(default="max-load", description="what the DP solvers minimised: "
                                                           "step-time | max-load.")


class StageInputs(_Frozen):
    """The pipeline stage a plan is for (``canzona.planner.stages``): stage ``stage`` of ``pp``,
    holding decoder layers ``first_layer`` … ``first_layer + layers - 1`` (global numbers), the
    embedding on stage 0, the output layer on the last (with tied embeddings, a copy of the
    embedding there, ``tied_copy``)."""

    pp: int = Field(ge=2)
    stage: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    layers: int = Field(ge=0, description="decoder layers on this stage.")
    tied_copy: bool = Field(default=False, description="this end stage holds one of the tied "
                                                       "embedding's two copies (stage 0 the "
                                                       "embedding, the last stage its copy).")

    @model_validator(mode="after")
    def _in_range(self) -> StageInputs:
        if self.stage >= self.pp:
            raise ValueError(f"stage {self.stage} is not below pp {self.pp}")
        return self


class PlanInputs(_Frozen):
    """Everything that determines the plan."""

    model: str
    model_source: Literal["preset", "hf_config", "module"]
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    ep: int = Field(default=1, ge=1)
    etp: int = Field(default=1, ge=1, description="expert tensor parallel size.")
    optimizer: OptimizerSettings
    cost_model: str = "flops"
    bucket_size: int | None = Field(description="elements per bucket; null = one bucket.")
    grad_dtype: str = "fp32"
    comm_dtype: str = "bf16"
    solver: SolverOptions
    stage: StageInputs | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the pipeline stage (pp > 1; schema version 9); absent for a whole model.")


class RankLayout(_Frozen):
    """Global rank ↔ (DP index d, TP rank t). Megatron's order: t fastest, rank = d·tp + t."""

    order: Literal["tp-fastest"] = "tp-fastest"
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)

    def global_rank(self, d: int, t: int) -> int:
        return d * self.tp + t

    def coords(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.tp)


class SlotPlan(_Frozen):
    """A parameter's element range [start, end) in its buffer (TP-local shard)."""

    name: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class BucketPlan(_Frozen):
    """A bucket and its DP cut points.

    ``cuts`` has dp_size + 1 monotone offsets from ``start`` to ``end``; DP rank r owns
    [cuts[r], cuts[r+1]). Equal cuts are Megatron's ZeRO-1; Canzona moves cuts to parameter
    boundaries so every matrix is whole on one rank.
    """

    index: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    numel_unpadded: int = Field(ge=0)
    cuts: tuple[int, ...]
    slots: tuple[SlotPlan, ...]
    method: CollectiveMethod = Field(description="the collective pair that moves the slices "
                                                 "(the fastest under the plan's comm model).")

    @model_validator(mode="after")
    def _check(self) -> BucketPlan:
        c = self.cuts
        if len(c) < 2 or c[0] != self.start or c[-1] != self.end or any(
                a > b for a, b in zip(c, c[1:])):
            raise ValueError(f"bucket {self.index}: cuts must run monotonically from start "
                             f"{self.start} to end {self.end}")
        return self


class BufferPlan(_Frozen):
    key: str
    dtype: str
    grad_dtype: str
    expert: bool
    ep_rank: int | None
    dp_size: int = Field(ge=1)
    buckets: tuple[BucketPlan, ...]


class TaskPlan(_Frozen):
    """One optimizer task: what it updates, who computes it, what it costs."""

    id: int = Field(ge=0)
    param: str
    part: str | None = None
    shape: tuple[int, ...]
    optimizer: Literal["matrix", "adamw"]
    owner: int | None = Field(description="DP index that computes the update (matrix tasks).")
    host: int | None = Field(default=None, description="TP rank hosting the whole matrix.")
    micro_group: int | None = None
    cost: int = Field(ge=0, description="scalar load under the plan's cost model.")
    flops: int = Field(ge=0)
    state_bytes: int = Field(ge=0)
    tp_comm_bytes: int = Field(ge=0)


class Metrics(_Frozen):
    """Per-DP-index loads and how far the busiest index is from the lower bound."""

    dp_load: tuple[int, ...] = Field(description="cost-model load per DP index.")
    dp_flops: tuple[int, ...]
    dp_state_bytes: tuple[int, ...]
    dp_reduce_scatter_bytes: tuple[int, ...] = Field(
        description="grad bytes each DP index receives from the reduce-scatters.")
    max_over_mean: float
    lower_bound: int = Field(description="max(total/dp, largest task) in cost units.")
    certified_bound: int = Field(description="best proven lower bound on the max load.")
    gap_to_bound: float = Field(description="max load / certified bound - 1.")
    split_matrices: int = Field(description="matrices cut across DP ranks (0 for Canzona).")
    solver_status: str


class ShardLayoutPlan(_Frozen):
    """How TP shards concatenate into a task's logical matrix (``canzona.planner.shards``).

    ``segments`` are (rank, local_start, full_start, length) along ``dim``, sorted by full_start:
    ``local[local_start:local_start+length]`` of TP rank ``rank`` is ``full[full_start:…]``. On
    the wire, each rank sends a task's segments in this order; the host places them back the same
    way.
    """

    dim: int | None = Field(description="partition dim (0 rows, 1 columns); null: replicated.")
    local_shape: tuple[int, ...] = Field(description="one rank's shard of the whole parameter.")
    full_shape: tuple[int, ...] = Field(description="logical shape of the task's matrix.")
    segments: tuple[tuple[int, int, int, int], ...]


class GroupTaskPlan(_Frozen):
    """A TP-split matrix task inside a micro-group."""

    id: int = Field(ge=0, description="task id (plan.tasks).")
    host: int = Field(ge=0, description="TP rank that gathers, computes and scatters it.")
    layout: int = Field(ge=0, description="index into tp.layouts.")
    load: int = Field(ge=0)
    gathered_bytes: int = Field(ge=0, description="full matrix in the comm dtype.")


class MicroGroupPlan(_Frozen):
    """One micro-group of a TP group, in execution order.

    ``tasks`` are in wire order (by host, then id): in the gather all-to-all, rank t's send buffer
    holds, for each task in this order, its segments; ``gather_send[t][h]`` is the number of
    elements rank t sends to rank h (the self entry is the local copy), ``gather_recv[h][t]`` what
    h receives from t. The scatter is the reverse: ``scatter_send = gather_recv``,
    ``scatter_recv = gather_send``.
    """

    index: int = Field(ge=0)
    tasks: tuple[GroupTaskPlan, ...]
    peak_gathered_bytes: int = Field(ge=0, description="max over ranks of hosted full bytes.")
    rank_load: tuple[int, ...] = Field(description="compute load hosted per TP rank.")
    gather_send: tuple[tuple[int, ...], ...]
    gather_recv: tuple[tuple[int, ...], ...]
    scatter_send: tuple[tuple[int, ...], ...]
    scatter_recv: tuple[tuple[int, ...], ...]
    oversized: bool = Field(default=False, description="a single task larger than C_max.")
    timeline_s: tuple[float, ...] = Field(
        default=(), description="modelled gather start/end, compute start/end, scatter "
                                "start/end (seconds, hardware profile; not measured).")


class SubGroupPlan(_Frozen):
    """Where a shared task runs when a TP sub-group shares it: ``k`` of its TP group's ``tp``
    ranks, strided (TP ranks ``slot``, ``slot`` + tp/k, …), each gathering tp/k shards of the
    matrix from its block of tp/k consecutive TP ranks, orthogonalising its rows with shared
    Newton–Schulz over the sub-group and returning the update rows
    (``runtime.optim.sub_groups``). A round is tp/k alike matrices of one DP index, one per
    slot, consecutive in the index's ``shared`` list in slot order: every TP rank computes one
    piece of it."""

    k: int = Field(ge=2, description="ranks sharing the matrix: a divisor of tp below tp.")
    round: int = Field(ge=0, description="the round among this DP index's sub-group rounds, in "
                                         "plan order (0, 1, …).")
    slot: int = Field(ge=0, description="the sub-group computing it: TP ranks slot, slot + "
                                        "tp/k, … (below tp/k).")


class SharedTaskPlan(_Frozen):
    """A TP-split Muon matrix task its TP group shares (``TPOptions.share``), alone or with the
    same TP ranks at a ``partner`` DP index (each index then holds half of every shard's rows,
    ``plan.dp_shared``): every TP rank orthogonalises the rows of its own shard with shared
    Newton–Schulz (one all-reduce of the symmetric n × n Gram's upper block rows per iteration
    over the TP group) and applies its part; nothing is gathered. The shared tasks run before the
    micro-groups, in this order on every TP rank."""

    id: int = Field(ge=0, description="task id (plan.tasks).")
    layout: int = Field(ge=0, description="index into tp.layouts (where each shard sits).")
    split_poly: bool = Field(description="the symmetric polynomial bG + cG² computed over the "
                                         "TP group (each rank the upper parts of two block "
                                         "rows) and all-gathered.")
    load: int = Field(ge=0, description="per TP rank, cost-model units: its FLOPs and the time "
                                        "it waits for its collectives (at the profile's rate).")
    modelled_s: float = Field(ge=0, description="per TP rank: compute and the collectives "
                                                "its own Gram products do not hide, seconds "
                                                "(hardware profile; not measured).")
    partner: int | None = Field(
        default=None, ge=0, exclude_if=lambda v: v is None,
        description="the DP index whose TP group shares the matrix with this one (k = 2·tp; "
                    "its rows cut between them as dp_shared says): this index's half, summed "
                    "with the partner's by the same TP ranks (written only when set, so a task "
                    "its TP group shares alone keeps the text of schema version 3; version 5).")
    sub: SubGroupPlan | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="the TP sub-group computing it, with tp/k alike matrices of this index side "
                    "by side (written only when set, so other shared tasks keep their text; "
                    "version 11).")


class TPIndexPlan(_Frozen):
    """The TP schedule of one DP index (its TP group)."""

    dp_index: int = Field(ge=0)
    local_load: tuple[int, ...] = Field(
        description="per TP rank: AdamW on its shards plus replicated matrices (at expert TP 1 "
                    "under tp > 1, plus the experts whole on that rank).")
    groups: tuple[MicroGroupPlan, ...]
    modelled_s: float = Field(default=0.0, description="modelled pipelined makespan, seconds.")
    shared: tuple[SharedTaskPlan, ...] = Field(
        default=(), exclude_if=lambda v: not v,
        description="tasks the TP group shares, run first (written only when any: plans that "
                    "share nothing keep the text they had before sharing existed).")
    shared_load: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0,
                             description="per TP rank: the shared tasks run in lockstep, cost "
                                         "units (in local_load; written only when not 0).")


class TPMetrics(_Frozen):
    """Per-GPU (DP index × TP rank) loads and the bound LB_gpu."""

    gpu_load: tuple[tuple[int, ...], ...] = Field(description="dp × tp, cost-model units.")
    max_gpu_load: int
    mean_gpu_load: float
    max_over_mean: float
    lb_gpu: int = Field(description="max(total / (dp·tp), largest task).")
    gap_to_lb_gpu: float
    micro_groups: int
    peak_gathered_bytes: int = Field(description="largest group peak, oversized groups included "
                                                 "(those exceed C_max; see the groups' oversized).")
    oversized_tasks: tuple[str, ...] = ()
    all_to_all_bytes: tuple[tuple[int, ...], ...] = Field(
        description="dp × tp: bytes each GPU sends + receives off-rank (gather and scatter).")
    modelled_step_s: float = 0.0


class TPPlan(_Frozen):
    """Micro-group schedule of every TP group (Canzona §TP)."""

    cmax_bytes: int = Field(ge=1, description="C_max: gathered full-matrix bytes per host rank "
                                              "and micro-group.")
    comm_dtype: str
    solver: str = Field(description="greedy | cpsat.")
    status: str
    hardware: str = Field(description="profile of the modelled timeline.")
    layouts: tuple[ShardLayoutPlan, ...]
    indices: tuple[TPIndexPlan, ...]
    metrics: TPMetrics
    share: Literal["off", "auto", "all", "all-split", "pairs", "sub-groups"] = Field(
        default="off", exclude_if=lambda v: v == "off",
        description="TPOptions.share, or off where no task is shared (written only when not "
                    "off, as by a plan that shares, version 3: a plan that shares nothing stays "
                    "the version-2 text an older canzona reads).")


class CommPlan(_Frozen):
    """The communication model the bucket methods were chosen with (``canzona.planner.comm``)
    and what it predicts, against ZeRO-1's even collectives on the same buckets."""

    hardware: str = Field(description="hardware profile name.")
    hardware_version: int = Field(ge=1, description="revision of the profile's numbers.")
    gpus_per_node: int = Field(ge=1)
    link: Literal["intra_node", "inter_node"] = Field(description="link of the DP groups.")
    busbw: float = Field(gt=0, description="that link's bus bandwidth, bytes/s.")
    latency_s: float = Field(ge=0, description="that link's per-call latency α, seconds.")
    predicted_s: float = Field(ge=0, description="collective time per iteration, busiest DP "
                                                 "index (reduce + gather of every bucket).")
    zero1_s: float = Field(ge=0, description="the same for ZeRO-1's even collectives.")
    max_sent_bytes: int = Field(ge=0, description="most bytes any rank sends per iteration.")
    zero1_max_sent_bytes: int = Field(ge=0)
    methods: dict[str, int] = Field(description="buckets per method.")
    converted_from: int | None = Field(
        default=None, description="schema version of the file this plan was converted from "
                                  "(methods then chosen with the default profile).")


class PairTaskPlan(_Frozen):
    """A Muon matrix task two DP indices share (``TPOptions.share``): a bucket cut falls inside
    the parameter, at row ``row``, so DP index ``owners[0]`` holds rows [0, row) and
    ``owners[1]`` rows [row, m) of the parameter (at tp > 1: of every TP shard, a tall
    column-parallel one; the two TP groups share it, ``SharedTaskPlan.partner``), its gradient
    and its momentum (the indices between them, if any, hold nothing of that bucket). Both
    orthogonalise the matrix with shared Newton–Schulz, exchanging over the DP group (the Gram's
    upper block rows per iteration; a wide matrix's row blocks are first swapped for column
    blocks ⌈cols/2⌉ wide, and back after) and apply their rows. Pairs run in ``phase`` order;
    no DP index is in two pairs of one phase, so the pairs of a phase run side by side and every
    index meets its partners in the order they meet it."""

    id: int = Field(ge=0, description="task id (plan.tasks); its owner is owners[0].")
    owners: tuple[int, int] = Field(description="the two DP indices, ascending.")
    phase: int = Field(ge=0, description="when the pair runs (an edge colouring of the pairs).")
    row: int = Field(gt=0, description="the first row of owners[1]'s piece.")
    split_poly: bool = Field(description="the symmetric polynomial bG + cG² computed over the "
                                         "pair (each rank the upper parts of two block rows) "
                                         "and exchanged.")
    loads: tuple[int, int] = Field(description="per piece, cost-model units (Muon: its FLOPs "
                                               "and its exchanges' time at the profile's "
                                               "rate).")
    flops: tuple[int, int] = Field(description="per piece and step (Muon: shared "
                                               "Newton–Schulz).")
    state_bytes: tuple[int, int] = Field(description="per piece: the optimizer state its owner "
                                                     "holds.")
    modelled_s: float = Field(ge=0, description="per piece: compute and the exchanges its "
                                                "own Gram products do not hide, seconds "
                                                "(hardware profile; not measured).")


class Plan(_Frozen):
    """A canzona plan (schema version 2; 3 when its TP groups share matrices; 4 when DP pairs
    do; 5 when TP groups share with a partner DP index's; 6 when its optimizer settings record
    a Newton–Schulz schedule; 7 when they split the fused QKV per head; 8 when it is written
    compact; 9 for a pipeline stage; 11 when TP sub-groups share matrices)."""

    schema_version: Literal[2, 3, 4, 5, 6, 7, 8, 9, 11] = BASE_VERSION
    inputs: PlanInputs
    rank_layout: RankLayout
    fingerprint: str = Field(
        description="sha256 of the inventory: names, shapes, dtypes, TP attrs.")
    total_params: int
    buffers: tuple[BufferPlan, ...]
    tasks: tuple[TaskPlan, ...]
    metrics: Metrics
    tp: TPPlan | None = Field(default=None, description="TP micro-group schedule (tp > 1).")
    comm: CommPlan
    dp_shared: tuple[PairTaskPlan, ...] = Field(
        default=(), exclude_if=lambda v: not v,
        description="matrix tasks split over two DP indices (written only when any, so every "
                    "other plan stays byte for byte what version 2 or 3 wrote; schema version "
                    "4; at tp > 1, where two TP groups share them, 5).")

    @model_validator(mode="after")
    def _version_fits(self) -> Plan:
        shares = self.tp is not None and any(ix.shared for ix in self.tp.indices)
        if shares and self.schema_version < TP_SHARE_VERSION:
            raise ValueError(f"tp.indices hold shared tasks, which need schema_version "
                             f"{TP_SHARE_VERSION} (found {self.schema_version})")
        if self.dp_shared and self.schema_version < DP_PAIR_VERSION:
            raise ValueError(f"dp_shared lists tasks shared by DP pairs, which need "
                             f"schema_version {DP_PAIR_VERSION} (found {self.schema_version})")
        if self.dp_shared and self.inputs.tp > 1 and self.schema_version < TP_PAIR_VERSION:
            raise ValueError(f"dp_shared lists tasks two TP groups share (tp > 1), which need "
                             f"schema_version {TP_PAIR_VERSION} (found {self.schema_version})")
        for needs, version, what in ((self.inputs.optimizer.records_recipe, RECIPE_VERSION,
                                      "a Newton–Schulz schedule (ns_coefficients)"),
                                     (self.inputs.optimizer.records_heads, HEADS_VERSION,
                                      "per-head QKV (qkv_split: heads)")):
            if needs and self.schema_version < version:
                raise ValueError(f"inputs.optimizer records {what}, which needs schema_version "
                                 f"{version} (found {self.schema_version})")
        if self.sub_groups and self.schema_version < SUB_GROUP_VERSION:
            raise ValueError(f"tp.indices hold tasks TP sub-groups share, which need "
                             f"schema_version {SUB_GROUP_VERSION} (found "
                             f"{self.schema_version})")
        if self.inputs.stage is not None and self.schema_version < PIPELINE_VERSION:
            raise ValueError(f"inputs.stage records a pipeline stage, which needs "
                             f"schema_version {PIPELINE_VERSION} (found {self.schema_version})")
        return self

    @property
    def sub_groups(self) -> bool:
        """Whether any task is shared by a TP sub-group (``SharedTaskPlan.sub``)."""
        return self.tp is not None and any(x.sub is not None for ix in self.tp.indices
                                           for x in ix.shared)

    @property
    def compact(self) -> bool:
        """Whether the file is written compact (:mod:`.compact`): a version-8 plan
        (:data:`COMPACT_VERSION`, which says so), and a later one of more than
        ``compact.COMPACT_TASKS`` tasks."""
        v = self.schema_version
        return v == COMPACT_VERSION or (v > COMPACT_VERSION
                                        and len(self.tasks) > compact.COMPACT_TASKS)

    def data(self) -> dict[str, Any]:
        """The plan as the JSON data its file holds (compact or not, :attr:`compact`)."""
        got = self.model_dump(mode="json")
        return compact.encode(got) if self.compact else got

    def to_json(self) -> str:
        """Canonical text: fields in schema order, two-space indent, trailing newline; a compact
        plan (:attr:`compact`) in the form of :mod:`.compact`, unindented."""
        if self.compact:
            return json.dumps(self.data(), separators=(",", ":"), ensure_ascii=False) + "\n"
        return self.model_dump_json(indent=2) + "\n"


class PipelinePlan(_Frozen):
    """A plan per pipeline stage, in one file (schema version 9): ``stages[s]`` is stage s's
    plan, over that stage's DP and TP groups, its ``inputs.stage`` saying which layers it holds.
    The stages' layers follow one another and the stages share the model, the parallel sizes
    and the optimizer settings."""

    schema_version: Literal[9] = PIPELINE_VERSION
    pp: int = Field(ge=2)
    stages: tuple[Plan, ...]

    @model_validator(mode="after")
    def _stages_fit(self) -> PipelinePlan:
        if len(self.stages) != self.pp:
            raise ValueError(f"stages holds {len(self.stages)} plans for pp {self.pp}")
        first = self.stages[0].inputs
        at = 0
        for s, plan in enumerate(self.stages):
            st = plan.inputs.stage
            if st is None or st.stage != s or st.pp != self.pp:
                raise ValueError(f"stages.{s}.inputs.stage must be stage {s} of pp {self.pp}")
            if st.first_layer != at:
                raise ValueError(f"stages.{s}.inputs.stage.first_layer is {st.first_layer}; "
                                 f"the stages before it end at layer {at}")
            at += st.layers
            same = plan.inputs.model_copy(update={"stage": None, "solver": first.solver})
            if same != first.model_copy(update={"stage": None}):
                raise ValueError(f"stages.{s}.inputs differ from stage 0's beyond the stage "
                                 "and the solver's record (model, sizes, optimizer)")
        return self

    def stage(self, s: int) -> Plan:
        """Stage ``s``'s plan."""
        return self.stages[s]

    def to_json(self) -> str:
        """Canonical text: the version, ``pp``, then each stage's plan as its own file would
        hold it (a large stage compact), unindented; trailing newline."""
        data = {"schema_version": self.schema_version, "pp": self.pp,
                "stages": [p.data() for p in self.stages]}
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n"


class RoundPlan(_Frozen):
    """One all-to-all round of an FSDP2 plan: the matrices whose rows travel to their owners
    together (one all-to-all), are computed there (alike shapes batched) and whose update rows
    travel back together (a second all-to-all). Round k + 1's gather runs during round k's
    compute."""

    index: int = Field(ge=0)
    tasks: tuple[int, ...] = Field(description="matrix task ids (plan.tasks), each computed by "
                                               "its task's owner.")
    gathered_bytes: tuple[int, ...] = Field(
        description="per DP rank: the whole matrices it owns in this round, in the comm dtype "
                    "(what the round's cap bounds).")
    sent_bytes: tuple[int, ...] = Field(
        description="per DP rank: the bytes it sends in the round's gather (its rows of other "
                    "ranks' matrices); the return sends as many back.")
    received_bytes: tuple[int, ...] = Field(
        description="per DP rank: the bytes it receives in the gather (other ranks' rows of "
                    "its matrices).")
    compute_s: tuple[float, ...] = Field(description="per DP rank: its owned updates, seconds "
                                                     "(hardware profile; not measured).")


class FSDP2SharedPlan(_Frozen):
    """A matrix task of an FSDP2 plan computed by adjacent ranks together: each gathers its
    block of the matrix's long dimension (rows of a tall matrix, columns of a wide one), they
    run the Newton–Schulz together (its Gram summed over them), and each returns its block's
    update rows."""

    id: int = Field(ge=0, description="task id (plan.tasks); its owner is owners[0].")
    owners: tuple[int, ...] = Field(description="the ranks sharing it, ascending and adjacent "
                                                "(2s, 2s + 1).")
    blocks: tuple[int, ...] = Field(description="len(owners) + 1 boundaries along the long "
                                                "dimension: owners[j] computes [blocks[j], "
                                                "blocks[j + 1]).")
    piece_s: float = Field(ge=0, description="per member: its block's compute and the Gram's "
                                             "collectives it does not hide, seconds (hardware "
                                             "profile; not measured).")


class FSDP2Section(_Frozen):
    """How an FSDP2 plan moves and computes the matrices (:class:`FSDP2Plan`)."""

    cmax_bytes: int = Field(ge=1, description="cap on the whole-matrix bytes a rank holds in "
                                              "one round (an oversized matrix has a round of "
                                              "its own).")
    comm_dtype: str = Field(description="dtype the rows travel in (the gradients' and the "
                                        "updates').")
    hardware: str = Field(description="profile of the modelled times.")
    link: Literal["intra_node", "inter_node"] = Field(description="link of the DP mesh.")
    rounds: tuple[RoundPlan, ...]
    modelled_step_s: float = Field(ge=0, description="the matrices' part of the optimizer "
                                                     "step: the rounds' gathers, compute and "
                                                     "returns pipelined, seconds.")
    bound_s: float = Field(ge=0, description="a lower bound on that time for any owners, pairs "
                                             "and rounds, seconds.")
    shared: tuple[FSDP2SharedPlan, ...] = Field(
        default=(), exclude_if=lambda v: not v,
        description="matrix tasks computed by adjacent ranks together (written only when "
                    "any).")
    split_dims: tuple[int | None, ...] = Field(
        default=(), exclude_if=lambda v: not v,
        description="with TP (inputs.tp > 1): per task, the dimension TP shards (null: "
                    "replicated over TP); ranks are d·tp + t of the dp × tp mesh "
                    "(formulas.fsdp2_block).")


class FSDP2Plan(_Frozen):
    """A plan for FSDP2's storage (schema version 10): the model is ``fully_shard``-ed over the
    DP ranks, so every parameter is held as ``Shard(0)`` rows (``torch.chunk``'s rule,
    ``formulas.fsdp2_rows``; with TP, of each TP shard, ``formulas.fsdp2_block``, over the
    dp · tp ranks d·tp + t) and FSDP2 itself reduces the gradients and gathers the parameters.
    The plan chooses each matrix task's owner (``tasks[i].owner``) and the all-to-all rounds
    that bring its rows there and its update rows back (``fsdp2.rounds``); AdamW parameters
    are updated on every rank's own rows."""

    schema_version: Literal[10] = FSDP2_VERSION
    storage: Literal["fsdp2"] = "fsdp2"
    inputs: PlanInputs
    fingerprint: str = Field(
        description="sha256 of the inventory: names, shapes, dtypes, TP attrs.")
    total_params: int
    tasks: tuple[TaskPlan, ...]
    metrics: Metrics
    fsdp2: FSDP2Section

    def to_json(self) -> str:
        """Canonical text: fields in schema order, two-space indent, trailing newline."""
        return self.model_dump_json(indent=2) + "\n"


def sub_round_problem(plan: Plan) -> tuple[str, str] | None:
    """What is wrong with ``plan``'s rounds of TP sub-groups (``SharedTaskPlan.sub``), as (the
    field, what is wrong), or None: a round is tp/k alike matrices (one layout's full and
    local shape and dim, one polynomial split) of Muon (an optimizer sharing its
    Newton–Schulz), with no partner DP index, consecutive in its index's ``shared`` list in
    slot order 0, …, tp/k − 1, the index's rounds numbered 0, 1, … in plan order; k divides tp
    and lies in [2, tp). The one check of a round's structure: the plan's loader and the
    runtime (a plan made in code) both read it."""
    T = plan.tp
    if T is None:
        return None
    tp, opt = plan.inputs.tp, plan.inputs.optimizer
    for i, ix in enumerate(T.indices):
        shared, at, number = ix.shared, 0, 0
        while at < len(shared):
            x = shared[at]
            if x.sub is None:
                at += 1
                continue
            where, k = f"tp.indices[{i}].shared[{at}].sub", x.sub.k
            name = plan.tasks[x.id].param if x.id < len(plan.tasks) else f"task {x.id}"
            if not opt.spec.gram_shared or opt.spec.block_hosted:
                return where, (f"shares '{name}' over a TP sub-group, but {opt.name} shares no "
                               f"Newton–Schulz (it preconditions each shard apart)")
            if not 2 <= k < tp or tp % k:
                return f"{where}.k", (f"is {k}, but a TP sub-group's size divides tp = {tp} "
                                      f"and lies in [2, {tp})")
            if x.sub.round != number:
                return f"{where}.round", (f"is {x.sub.round}, but DP index {ix.dp_index}'s "
                                          f"rounds are numbered 0, 1, … in plan order (this "
                                          f"one is {number})")
            n = tp // k
            for j in range(n):
                y = shared[at + j] if at + j < len(shared) else None
                sub = y.sub if y is not None else None
                if y is None or sub is None or sub.round != number:
                    return where, (f"round {number} of DP index {ix.dp_index} has tp/k = {n} "
                                   f"members, consecutive in the shared list in slot order, "
                                   f"but only {j} follow one another")
                w = f"tp.indices[{i}].shared[{at + j}]"
                if sub.k != k:
                    return f"{w}.sub.k", (f"is {sub.k}, but round {number} of DP index "
                                          f"{ix.dp_index} has k = {k}")
                if sub.slot != j:
                    return f"{w}.sub.slot", (f"is {sub.slot}, but round {number}'s members are "
                                             f"listed in slot order 0, …, {n - 1} (this one is "
                                             f"slot {j})")
                if y.partner is not None:
                    return f"{w}.partner", (f"is {y.partner}, but task {y.id} is in a round of "
                                            f"TP sub-groups, not shared with a partner DP index")
                a, b = T.layouts[x.layout], T.layouts[y.layout]
                if (a.dim, tuple(a.full_shape), tuple(a.local_shape), x.split_poly) != \
                        (b.dim, tuple(b.full_shape), tuple(b.local_shape), y.split_poly):
                    return f"{w}.sub", (f"task {x.id} {list(a.full_shape)} (dim {a.dim}, "
                                        f"split_poly {x.split_poly}) and task {y.id} "
                                        f"{list(b.full_shape)} (dim {b.dim}, split_poly "
                                        f"{y.split_poly}) are in round {number} of DP index "
                                        f"{ix.dp_index}, but a round's matrices are alike")
            at += n
            number += 1
    return None


def _open_temp(folder: Path, name: str) -> tuple[int, Path]:
    """Create a new, empty temporary file next to the target, mode 0666 & ~umask.

    ``os.open`` with mode 0o666 lets the kernel apply the umask (and a default ACL), so the plan
    gets the permissions any new file gets; ``tempfile.mkstemp`` would force 0600.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(folder))


def save_plan(plan: Plan | PipelinePlan | FSDP2Plan, path: str | Path) -> Path:
    """Write ``plan`` atomically (temporary file in the same folder, fsync, rename).

    The file gets the permissions of any new file under the current umask (0666 & ~umask); the
    temporary file is removed on any failure.

    Raises:
        PlanFileError: the folder does not exist or is not writable.
    """
    return write_atomically(path, plan.to_json(), what="plan")


def write_atomically(path: str | Path, text: str, *, what: str = "plan",
                     error: type[Exception] = PlanFileError) -> Path:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, fsync, rename
    (a reader sees the old file or the new one, never a part). ``error`` (named for ``what``)
    is raised when the folder does not exist or is not writable."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = _open_temp(folder, path.name)
    except OSError as exc:
        raise error(f"cannot write {what} to '{path}': {exc.strerror or exc} "
                    f"(folder '{folder}').") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise error(f"cannot write {what} to '{path}': {exc.strerror or exc}.") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a plan is built or checked.

    A large plan is millions of small objects and no cycles; each collection the allocations
    trigger walks all of them (it about halves the load time of a 235B-parameter MoE plan).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
