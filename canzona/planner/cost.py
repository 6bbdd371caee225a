"""Tasks and their costs: what each optimizer update costs in FLOPs, state memory and TP traffic.

A *task* is one logical matrix update (or one split part of a fused matrix when the user treats
Q/K/V or gate/up as separate matrices), or one AdamW parameter. Its :class:`TaskCost` vector holds
the FLOPs of the chosen optimizer (its spec in the registry ``canzona.planner.optimizers``, from
``canzona.planner.formulas``, the same formulas the runtime kernels are tested against), the
optimizer-state bytes, and the bytes its host moves in the TP gather/scatter. A
:class:`CostModel` turns a task into the scalar load the solvers balance: ``roofline`` (seconds
under a hardware profile, :class:`Roofline`, in integer nanoseconds), ``flops`` (the default:
Newton–Schulz work is cubic in the short side, so numel under-balances it), ``numel`` (what the
Canzona paper balances) or ``calibrated`` (measured seconds per shape).

:class:`Roofline` is the one place a task's FLOPs and bytes become seconds: the roofline cost
model, the step simulator and ``canzona compare`` all call :meth:`Roofline.seconds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

from . import formulas, optimizers
from .errors import CanzonaError, SizeError
from .hardware import DEFAULT_HARDWARE, HardwareProfile, load_hardware
from .heads import head_parts, is_head
from .inventory import EXPERT_PART, ModelSpec
from .layout import ParallelSizes
from .settings import OptimizerSettings

CostName = Literal["roofline", "flops", "numel"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
STATE_BYTES = 4  # optimizer states are fp32


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of optimizer work.

    Attributes:
        id: position in the task list (deterministic: parameter order, then part order).
        param: the parameter it updates.
        part: the part of a fused parameter (``q``, ``k``, ``v``, ``gate``, ``up``, a head
            ``q<h>``/``k<g>``/``v<g>``) or None.
        shape: logical shape of the matrix (or of the AdamW tensor).
        optimizer: "matrix" or "adamw".
        tp_split: whether TP splits the task's matrix, so a host must gather it (a head of a
            fused QKV is whole on one TP rank: not split, ``heads``).
    """

    id: int
    param: str
    part: str | None
    shape: tuple[int, ...]
    optimizer: str
    tp_split: bool
    expert: int | None = None

    @property
    def name(self) -> str:
        return self.param if self.part is None else f"{self.param}#{self.part}"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class TaskCost:
    """Cost vector of one task (whole TP group's view: the full logical matrix).

    ``flops`` are the matrix optimizer's matmul FLOPs (AdamW: its element-wise FLOPs), and
    ``flops_bytes`` the bytes the kernels doing them move; ``traffic_bytes`` are the bytes of
    the element-wise passes those FLOPs leave out (a matrix optimizer's momentum, casts and
    update; 0 for AdamW, whose passes are its FLOPs)."""

    flops: int
    state_bytes: int
    tp_comm_bytes: int  # bytes the host receives + sends in the TP gather/scatter
    flops_bytes: int = 0
    traffic_bytes: int = 0


def build_tasks(spec: ModelSpec, settings: OptimizerSettings, sizes: ParallelSizes) -> list[Task]:
    """One task per matrix-optimizer parameter (or per part, when split), one per AdamW
    parameter."""
    tasks: list[Task] = []
    for p in spec.params:
        t = sizes.expert_tp if p.is_expert else sizes.tp
        tp_split = p.tp_layout != "replicated" and t > 1
        split = p.optimizer == "matrix" and p.parts and (
            (p.tp_layout == "qkv" and settings.split_qkv)
            or (p.tp_layout == "gate_up" and settings.split_gate_up))
        if p.optimizer == "matrix" and p.head_rows and settings.qkv_split == "heads":
            # one task per head, each whole on the TP rank whose shard holds it (``heads``)
            for part in head_parts(p):
                tasks.append(Task(len(tasks), p.name, part.name, (part.rows, p.shape[1]),
                                  p.optimizer, False, p.expert))
        elif split:
            for part in p.parts:
                tasks.append(Task(len(tasks), p.name, part.name, (part.rows, p.shape[1]),
                                  p.optimizer, tp_split, p.expert))
        elif p.optimizer == "matrix" and p.stacked_experts:
            if tp_split:
                raise SizeError(f"'{p.name}' is a 3-D tensor of {p.stacked_experts} expert "
                                f"matrices split by tensor parallelism; canzona plans such "
                                "tensors at tp = 1 only (per-expert 2-D weights, as Megatron "
                                "stores them, work at any tp).")
            for e in range(p.stacked_experts):  # one task per expert matrix: rows e·m … (e+1)·m
                tasks.append(Task(len(tasks), p.name, f"{EXPERT_PART}{e}", p.shape[1:],
                                  p.optimizer, False, p.expert))
        else:
            tasks.append(Task(len(tasks), p.name, None, p.shape, p.optimizer, tp_split, p.expert))
    if settings.qkv_split == "heads" and not any(is_head(t.part) for t in tasks):
        raise SizeError(f"qkv_split='heads' cuts attention weights per head, but '{spec.name}' "
                        "has none on the matrix optimizer whose head size is known (a live "
                        "module's q, k and v projections need plan_model(..., head_dim=)); use "
                        "qkv_split='fused'.")
    return tasks


def task_cost(task: Task, settings: OptimizerSettings, sizes: ParallelSizes,
              comm_dtype: str = "bf16") -> TaskCost:
    """FLOPs, fp32 state bytes and TP gather/scatter bytes of ``task``."""
    t = sizes.expert_tp if task.expert is not None else sizes.tp
    return _cost(task.optimizer, task.shape, task.tp_split, t, settings, comm_dtype)


@lru_cache(maxsize=4096)
def _cost(optimizer: str, shape: tuple[int, ...], tp_split: bool, t: int,
          settings: OptimizerSettings, comm_dtype: str) -> TaskCost:
    """:func:`task_cost` of a task by what it depends on: a model's layers repeat a few shapes,
    so each is costed once."""
    numel = 1
    for d in shape:
        numel *= d
    if optimizer == "adamw" or len(shape) != 2:
        return TaskCost(formulas.adamw_flops(numel),
                        formulas.adamw_state_numel(numel) * STATE_BYTES, 0,
                        formulas.adamw_traffic_bytes(numel))
    m, n = shape
    spec = optimizers.get(settings.name)
    flops = spec.flops(m, n, settings)
    state = spec.state_numel(m, n, settings)
    mm_bytes = spec.matmul_bytes(m, n, settings) if spec.matmul_bytes else 0
    traffic = spec.traffic(m, n, settings) if spec.traffic else 0
    comm = 0
    if tp_split:
        # The host receives (t-1)/t of the matrix and sends (t-1)/t of the update back.
        comm = 2 * (numel - numel // t) * DTYPE_BYTES[comm_dtype]
    return TaskCost(flops, state * STATE_BYTES, comm, mm_bytes, traffic)


def work_of(shape: tuple[int, ...], optimizer: str, settings: OptimizerSettings) -> TaskCost:
    """The FLOPs and bytes of one task of ``shape`` (``"matrix"`` or ``"adamw"``), without TP
    traffic: what a plan's task, or a piece of one, costs wherever it runs."""
    return _cost(optimizer, tuple(shape), False, 1, settings, "bf16")


@dataclass(frozen=True, slots=True)
class Roofline:
    """Seconds of optimizer work on one GPU: each kernel class at its roofline.

    The kernels doing a task's FLOPs take max(FLOPs / rate, their bytes / bandwidth); the
    element-wise passes they leave out run at the memory bandwidth. ``rate`` is the profile's
    peak in the work's dtype times its achieved fraction, ``bandwidth`` its memory bandwidth.
    """

    rate: float  # FLOP/s
    bandwidth: float  # bytes/s

    @classmethod
    def of(cls, hw: HardwareProfile, dtype: str = "bf16") -> Roofline:
        """The roofline of ``hw`` for work in ``dtype`` (a dtype the profile lacks: its best)."""
        peak = hw.peak_flops.get(dtype, max(hw.peak_flops.values()))
        return cls(peak * hw.compute_efficiency, hw.memory_bandwidth)

    def seconds(self, c: TaskCost) -> float:
        """Seconds of the work ``c`` describes."""
        return max(c.flops / self.rate, c.flops_bytes / self.bandwidth) + \
            c.traffic_bytes / self.bandwidth

    def memory_s(self, c: TaskCost) -> float:
        """The part of :meth:`seconds` beyond ``c``'s FLOPs at the rate (the memory-bound
        passes, and a kernel's excess of bytes over its FLOPs)."""
        return self.seconds(c) - c.flops / self.rate


class CostModel(Protocol):
    """Turns a task into the scalar load the solvers balance (an int, for exact CP-SAT models)."""

    name: str

    def cost(self, task: Task) -> int: ...


@dataclass(frozen=True)
class NumelCost:
    """Load = number of elements (the Canzona paper's proxy)."""

    name: str = "numel"

    def cost(self, task: Task) -> int:
        return task.numel


@dataclass(frozen=True)
class FlopsCost:
    """Load = FLOPs of the chosen optimizer's update of the whole task."""

    settings: OptimizerSettings
    sizes: ParallelSizes
    name: str = "flops"

    def cost(self, task: Task) -> int:
        return task_cost(task, self.settings, self.sizes).flops


@dataclass(frozen=True)
class CalibratedCost:
    """Load = measured nanoseconds per task shape, falling back to FLOPs at a measured rate.

    Args:
        seconds_by_shape: measured step time of one task of each (rows, cols) shape.
        flops_per_second: achieved rate for shapes that were not measured.
    """

    settings: OptimizerSettings
    sizes: ParallelSizes
    seconds_by_shape: dict[tuple[int, ...], float]
    flops_per_second: float
    name: str = "calibrated"

    def cost(self, task: Task) -> int:
        sec = self.seconds_by_shape.get(task.shape)
        if sec is None:
            sec = task_cost(task, self.settings, self.sizes).flops / self.flops_per_second
        return max(1, round(sec * 1e9))


@dataclass(frozen=True)
class RooflineCost:
    """Load = the task's :meth:`Roofline.seconds` under a hardware profile, in nanoseconds (an
    integer, for the exact CP-SAT models; at least 1)."""

    settings: OptimizerSettings
    sizes: ParallelSizes
    roofline: Roofline
    name: str = "roofline"
    #: seconds per unit of load
    seconds_per_load: float = 1e-9

    def seconds(self, task: Task) -> float:
        return self.roofline.seconds(task_cost(task, self.settings, self.sizes))

    def load_of(self, c: TaskCost) -> int:
        """The load of a task whose cost vector is ``c``."""
        return max(1, round(self.roofline.seconds(c) / self.seconds_per_load))

    def cost(self, task: Task) -> int:
        return self.load_of(task_cost(task, self.settings, self.sizes))


_COST_MODELS = {
    "roofline": lambda settings, sizes, hw: RooflineCost(
        settings, sizes, Roofline.of(hw if isinstance(hw, HardwareProfile) else load_hardware(hw))),
    "flops": lambda settings, sizes, hw: FlopsCost(settings, sizes),
    "numel": lambda settings, sizes, hw: NumelCost(),
}


def make_cost_model(name: str, settings: OptimizerSettings, sizes: ParallelSizes,
                    hardware: str | HardwareProfile | None = None) -> CostModel:
    """A cost model by name (``roofline`` under the profile ``hardware``, default the
    planner's)."""
    make = _COST_MODELS.get(name)
    if make is None:
        raise CanzonaError(f"unknown cost model '{name}'; choose one of: "
                           f"{', '.join(_COST_MODELS)}.")
    return make(settings, sizes, hardware or DEFAULT_HARDWARE)
