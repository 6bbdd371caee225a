"""How a plan is made: :class:`DPOptions` and :class:`TPOptions`, keyword-only and checked on
construction (a value out of range raises :class:`~canzona.planner.errors.OptionError` naming the
field, e.g. ``DPOptions.alpha``; the CLI shows its flag instead).

A leaf module (it imports only the errors and the hardware profiles' names), so the pipeline,
the solvers and every front end share one definition of each option and its default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import OptionError
from .hardware import hardware_names

#: DP solvers (``DPOptions.solver``).
SOLVERS = ("auto", "greedy", "cpsat")
#: Cost models by name (``DPOptions.cost``); a ``CostModel`` object is accepted too.
COSTS = ("roofline", "flops", "numel")
#: The default cost model: every task in seconds on the hardware profile.
DEFAULT_COST = "roofline"
#: The cost models whose loads depend on the hardware profile (a plan's are priced on the
#: profile it records).
HARDWARE_COSTS = ("roofline",)
#: TP hosting solvers (``TPOptions.solver``).
TP_SOLVERS = ("greedy", "cpsat")
#: TPOptions.share: "off" (every TP-split matrix hosted whole), "auto" (the planner shares the
#: heaviest Muon matrices over their TP group, ``planner.sharing``), "all" / "all-split" (every
#: Muon matrix TP splits along its long dimension, without / with the polynomial split); at
#: tp = 1 the same choices share matrices over DP pairs (``sharing.pair_decision``); "pairs"
#: (tp > 1): every tall column-parallel Muon matrix shared by two TP groups (k = 2·tp), the
#: others by their TP group, with the polynomial split; "sub-groups" (tp ≥ 4): every class of
#: alike Muon matrices the TP group shares in rounds of tp/k, each matrix shared by a TP
#: sub-group of k strided ranks (the smallest k), the rest by their TP group.
TP_SHARE = ("off", "auto", "all", "all-split", "pairs", "sub-groups")
#: The default share mode: the planner shares matrices where the modelled step is shorter.
DEFAULT_SHARE = "auto"
#: Objectives by name (``DPOptions.objective``); an ``Objective`` object is accepted too.
OBJECTIVES = ("step-time", "max-load")
#: How far (percentage points of the certified bound) the communication stage of the
#: ``step-time`` objective may raise the busiest DP index's compute.
STEP_TIME_GAP_PP = 0.5
#: Communication dtypes (``TPOptions.comm_dtype``).
COMM_DTYPES = ("bf16", "fp16", "fp32")
MIB = 1 << 20


def _err(cls: str, field: str, problem: str) -> OptionError:
    name = f"{cls}.{field}"
    return OptionError(f"{{{name}}} {problem}", fields=(name,))


def _one_of(cls: str, field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _err(cls, field, f"must be one of: {', '.join(allowed)}; got {value!r}.")


def _positive_int(cls: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _err(cls, field, f"must be a positive integer, got {value!r}.")


def _positive(cls: str, field: str, value: Any, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise _err(cls, field, f"must be a positive number of {unit}, got {value!r}.")


@dataclass(frozen=True, slots=True, kw_only=True)
class DPOptions:
    """The DP side: ZeRO-1 buckets, the cost of a task, and how the cut points are chosen.

    Attributes:
        solver: ``auto`` (greedy + exact per-bucket polish), ``greedy`` (the paper) or ``cpsat``.
        alpha: the paper's α ∈ [0, 1] for the greedy start (0: even split, 1: fill deficits).
        time_limit_s: CP-SAT's deterministic time limit per phase (``cpsat`` only: the busiest
            load, then the optimizer state and slice sizes with that load held).
        seed: CP-SAT's random seed (recorded in the plan).
        workers: CP-SAT worker count (fixed, so plans are reproducible).
        comm_limit: bound on each slice, in multiples of the even slice S/R (None: unbounded).
        reorder: let parameters change places inside their bucket (see ``dp.reorder``).
        cost: the load of a task: ``roofline`` (the default, :data:`DEFAULT_COST`: its
            seconds under ``TPOptions.hardware``: FLOPs at the achieved rate, memory traffic
            at the bandwidth), ``flops`` (optimizer FLOPs), ``numel`` (the paper's), or a
            ``CostModel`` object.
        bucket_size: elements per bucket (None: Megatron's max(40M, 1M·dp)).
        overlap_grad_reduce: False puts each buffer in one bucket (Megatron without overlap).
        objective: what the DP solvers minimise: ``step-time`` (the default: the busiest
            compute, then a communication stage that lowers the predicted collective time while
            the compute gap grows by at most STEP_TIME_GAP_PP points), ``max-load`` (the
            busiest DP index's load only), or a ``canzona.planner.objective.Objective``.
    """

    solver: str = "auto"
    alpha: float = 1.0
    time_limit_s: float = 10.0
    seed: int = 0
    workers: int = 1
    comm_limit: float | None = None
    reorder: bool = True
    cost: Any = DEFAULT_COST
    bucket_size: int | None = None
    overlap_grad_reduce: bool = True
    objective: Any = "step-time"

    def __post_init__(self) -> None:
        c = "DPOptions"
        _one_of(c, "solver", self.solver, SOLVERS)
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise _err(c, "alpha", f"must be in [0, 1], got {a!r}.")
        _positive(c, "time_limit_s", self.time_limit_s, "seconds")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _err(c, "seed", f"must be an integer, got {self.seed!r}.")
        _positive_int(c, "workers", self.workers)
        cl = self.comm_limit
        if cl is not None and (isinstance(cl, bool) or not isinstance(cl, (int, float))
                               or not 1.0 <= cl < math.inf):
            raise _err(c, "comm_limit", f"must be ≥ 1 (a multiple of the even slice), got {cl!r}.")
        if isinstance(self.cost, str):
            _one_of(c, "cost", self.cost, COSTS)
        elif not callable(getattr(self.cost, "cost", None)):
            raise _err(c, "cost", f"must be one of: {', '.join(COSTS)}, or an object with a "
                                  f"cost(task) method; got {self.cost!r}.")
        if self.bucket_size is not None:
            if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) \
                    or self.bucket_size < 1:
                raise _err(c, "bucket_size", f"must be a positive number of elements, got "
                                             f"{self.bucket_size!r}.")
        if isinstance(self.objective, str):
            _one_of(c, "objective", self.objective, OBJECTIVES)
        elif self.objective is not None and not callable(getattr(self.objective, "score", None)):
            raise _err(c, "objective", f"must be one of: {', '.join(OBJECTIVES)}, or a "
                                       f"canzona.planner.objective.Objective; got "
                                       f"{self.objective!r}.")


@dataclass(frozen=True, slots=True, kw_only=True)
class TPOptions:
    """The TP side: the micro-group cap, the hosting solver and the modelled hardware.

    Attributes:
        cmax_mib: memory cap C_max per host rank and micro-group, MiB of gathered full matrices.
        solver: ``greedy`` (the paper) or ``cpsat`` (greedy, then CP-SAT per group).
        group_time_limit_s: CP-SAT deterministic time limit per group.
        total_time_limit_s: CP-SAT deterministic time budget over all groups (later groups keep
            greedy once it is spent).
        seed: CP-SAT random seed.
        workers: CP-SAT worker count (fixed, so plans are reproducible).
        hardware: hardware profile (a built-in name or a profile file's path) of the modelled
            timeline and of the DP communication model (compute rate, link bandwidths).
        comm_dtype: dtype of the gathered matrices (the gather/scatter bytes).
        share: ``off``: every TP-split matrix is hosted whole by one TP rank; ``auto`` (the
            default, :data:`DEFAULT_SHARE`): Muon matrices heavier than the mean per-GPU work
            are shared by their TP group (shared Newton–Schulz over its shards, no gather)
            where the cost model says it lowers the busiest GPU (``planner.sharing``), or
            every eligible one with the polynomial split, whichever plan has the lighter
            busiest GPU; ``all`` /
            ``all-split``: every Muon matrix TP splits along its long dimension is shared,
            without / with the polynomial split (for tests and measurements); ``pairs``
            (tp > 1): as ``all-split``, and every tall column-parallel matrix (fc1, QKV) shared
            by its TP group and the same TP ranks at a partner DP index (k = 2·tp, each holding
            half of every shard's rows; ``auto`` does that where it lowers the objective). At
            tp = 1 the same choices share whole matrices over two DP ranks each (DP pairs: the
            bucket cut inside the matrix at a row boundary; ``auto`` keeps them only where the
            busiest DP index gets lighter).
            Shampoo: at tp > 1 every TP-split matrix whose shards are whole blocks is
            preconditioned by its TP group shard by shard (``sharing.shard_block_decision``: no
            gather) under ``all``/``all-split``, and under ``auto`` where the objective prefers
            that plan to hosting; at tp = 1 block rows are hosted by two DP ranks.
    """

    cmax_mib: float = 512.0
    solver: str = "greedy"
    group_time_limit_s: float = 0.2
    total_time_limit_s: float = 5.0
    seed: int = 0
    workers: int = 1
    hardware: str = "h100"
    comm_dtype: str = "bf16"
    share: str = DEFAULT_SHARE

    def __post_init__(self) -> None:
        c = "TPOptions"
        _one_of(c, "share", self.share, TP_SHARE)
        _positive(c, "cmax_mib", self.cmax_mib, "MiB")
        _one_of(c, "solver", self.solver, TP_SOLVERS)
        _positive(c, "group_time_limit_s", self.group_time_limit_s, "seconds")
        _positive(c, "total_time_limit_s", self.total_time_limit_s, "seconds")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _err(c, "seed", f"must be an integer, got {self.seed!r}.")
        _positive_int(c, "workers", self.workers)
        _one_of(c, "comm_dtype", self.comm_dtype, COMM_DTYPES)
        hw = self.hardware
        if not isinstance(hw, str) or not (hw.endswith(".json") or "/" in hw
                                           or hw.lower() in hardware_names()):
            raise _err(c, "hardware", f"must be one of: {', '.join(hardware_names())}, or a "
                                      f"profile file (.json); got {hw!r}.")

    @property
    def cmax_bytes(self) -> int:
        return int(self.cmax_mib * MIB)
