"""The plan file: a versioned, frozen, deterministic pydantic v2 schema, written atomically.

A plan holds the inputs that shaped it, the rank layout, the inventory fingerprint, Megatron's
buffers → buckets with the DP cut points, every task with its owner DP index (and, under TP, host
rank and micro-group), and the load metrics. It holds no wall-clock time, so the same inputs give a
byte-identical file in any process. The runtime reads plans through this module, which imports
only ``errors`` and ``settings`` of the planner (never the cost model, inventory or layout).

Versioning: ``schema_version`` is checked before anything else; a newer file asks the user to
upgrade canzona, an older one to regenerate the plan (converters arrive with the first change).

Loading checks, in order: JSON, version, the pydantic schema (types, ranges, unknown fields), then
:func:`check_structure` — the plan's internal consistency that needs no cost formulas (sizes
against cuts, owners and hosts in range, ids, every parameter slot covered, the TP section's
shape). :mod:`canzona.planner.validate` adds the arithmetic relations (task costs from the
optimizer's formulas, loads against cuts, totals); ``canzona.load_plan`` runs both.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import math
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import PlanFileError
from .settings import PARAM_ALIGN, OptimizerSettings

SCHEMA_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SolverOptions(_Frozen):
    """How the DP partition (and TP schedule) were solved; recorded so a plan can be reproduced."""

    strategy: str = Field(description="zero1 | asc | canzona-greedy | canzona (see README).")
    solver: str = Field(default="none", description="greedy | cpsat | none.")
    alpha: float = Field(default=1.0, ge=0.0, le=1.0)
    time_limit_s: float | None = Field(default=None, gt=0)
    seed: int = 0
    workers: int = Field(default=1, ge=1)
    reorder: bool = Field(default=False, description="parameters reordered inside buckets.")


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
    ``local[local_start:local_start+length]`` of TP rank ``rank`` is ``full[full_start:…]``. On the
    wire, each rank sends a task's segments in this order; the host places them back the same way.
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


class TPIndexPlan(_Frozen):
    """The TP schedule of one DP index (its TP group)."""

    dp_index: int = Field(ge=0)
    local_load: tuple[int, ...] = Field(
        description="per TP rank: AdamW on its shards plus replicated matrices.")
    groups: tuple[MicroGroupPlan, ...]
    modelled_s: float = Field(default=0.0, description="modelled pipelined makespan, seconds.")


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


class Plan(_Frozen):
    """A canzona plan (schema version 1)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    inputs: PlanInputs
    rank_layout: RankLayout
    fingerprint: str = Field(description="sha256 of the inventory: names, shapes, dtypes, TP attrs.")
    total_params: int
    buffers: tuple[BufferPlan, ...]
    tasks: tuple[TaskPlan, ...]
    metrics: Metrics
    tp: TPPlan | None = Field(default=None, description="TP micro-group schedule (tp > 1).")

    def to_json(self) -> str:
        """Canonical text: fields in schema order, two-space indent, trailing newline."""
        return self.model_dump_json(indent=2) + "\n"


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


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` atomically (temporary file in the same folder, fsync, rename).

    The file gets the permissions of any new file under the current umask (0666 & ~umask); the
    temporary file is removed on any failure.

    Raises:
        PlanFileError: the folder does not exist or is not writable.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    text = plan.to_json()
    try:
        fd, tmp = _open_temp(folder, path.name)
    except OSError as exc:
        raise PlanFileError(f"cannot write plan to '{path}': {exc.strerror or exc} "
                            f"(folder '{folder}').") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PlanFileError(f"cannot write plan to '{path}': {exc.strerror or exc}.") from None
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


def parse_plan(text: str, source: str = "<plan>") -> Plan:
    """Parse plan JSON text; every failure is one line naming the problem (and versions).

    Checks the JSON, the schema version, the fields, then :func:`check_structure`.
    """
    with gc_paused():
        return _parse_plan(text, source)


def _parse_plan(text: str, source: str) -> Plan:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"{source}: not a plan file: invalid JSON at line {exc.lineno} "
                            f"({exc.msg}).") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise PlanFileError(f"{source}: not a canzona plan (no schema_version field).")
    found = data["schema_version"]
    if not isinstance(found, int) or isinstance(found, bool):
        raise PlanFileError(f"{source}: schema_version must be an integer, found {found!r}.")
    if found > SCHEMA_VERSION:
        raise PlanFileError(f"{source}: plan schema version {found} is newer than this canzona "
                            f"reads (version {SCHEMA_VERSION}); upgrade canzona.")
    if found < SCHEMA_VERSION:
        raise PlanFileError(f"{source}: plan schema version {found} is older than this canzona "
                            f"reads (version {SCHEMA_VERSION}); regenerate it with 'canzona plan'.")
    try:
        plan = Plan.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        raise PlanFileError(_one_line(f"{source}: malformed plan (schema version {SCHEMA_VERSION}): "
                                      f"field '{loc}': {err['msg']}{more}.")) from None
    _check_structure(plan, source)
    return plan


def load_plan(path: str | Path) -> Plan:
    """Read a plan file and check its schema and structure (:func:`check_structure`).

    ``canzona.load_plan`` (:func:`canzona.planner.validate.load_plan`) also checks the task costs
    and loads against the optimizer's formulas; use that one for files from elsewhere.

    Raises:
        PlanFileError: unreadable, not JSON, another schema version, fields that do not validate,
            or an inconsistent structure.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PlanFileError(f"cannot read plan '{path}': {reason}.") from None
    return parse_plan(text, str(path))


# --- structural consistency --------------------------------------------------------------------

#: The fix named by every consistency error: plans are written by the planner, never by hand.
REGENERATE = "regenerate it with 'canzona plan'"
#: Strategies without a TP schedule even for tp > 1 (ZeRO-1 equal-cut baselines).
BASELINE_STRATEGIES = ("asc", "zero1")


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def inconsistency(source: str, field: str, problem: str, fix: str = REGENERATE) -> PlanFileError:
    """The one-line error for a plan that parses but contradicts itself."""
    return PlanFileError(_one_line(f"{source}: inconsistent plan: field '{field}': {problem}; "
                                   f"{fix}."))


def check_structure(plan: Plan, source: str = "<plan>") -> None:
    """Check what a plan's fields say about each other, without cost formulas.

    Sizes against cuts (each bucket has dp_size + 1 cuts; dense buffers are sharded over dp,
    expert buffers over edp = dp·tp / (ep·etp); rank layout and per-DP-index metrics match
    inputs.dp and tp), buckets tiling their buffer with 64-aligned, non-overlapping slots, every
    parameter in one slot, task ids 0 … n-1, every task's parameter in a slot and every slot with
    a task, owners (matrix tasks) in [0, dp), hosts in [0, tp), and the TP section: present iff
    tp > 1 (plans of the ZeRO-1 baselines ``asc`` / ``zero1`` may omit it), one entry per DP
    index, tp × tp split sizes, hosts and task ids in range, every hosted task scheduled once and
    in agreement with its task's owner, host and micro-group. The arithmetic relations (costs,
    loads, totals) are :func:`canzona.planner.validate.check_plan`'s.

    Raises:
        PlanFileError: one line naming the file, the field and the fix.
    """

    with gc_paused():
        _check_structure(plan, source)


def _check_structure(plan: Plan, source: str) -> None:
    def bad(field: str, problem: str, fix: str = REGENERATE) -> PlanFileError:
        return inconsistency(source, field, problem, fix)

    inp = plan.inputs
    dp, tp, ep, etp = inp.dp, inp.tp, inp.ep, inp.etp
    rl = plan.rank_layout
    if rl.dp != dp:
        raise bad("rank_layout.dp", f"is {rl.dp} but inputs.dp is {dp}; they must agree")
    if rl.tp != tp:
        raise bad("rank_layout.tp", f"is {rl.tp} but inputs.tp is {tp}; they must agree")
    if etp != tp:
        raise bad("inputs.etp", f"is {etp} but inputs.tp is {tp}; canzona plans expert tensor "
                                f"parallelism only with etp = tp")

    # Buffers and buckets: the sizes their cuts are made for.
    has_expert = any(b.expert for b in plan.buffers)
    if ep > 1 and not has_expert:
        raise bad("inputs.ep", f"is {ep} but the plan has no expert buffers (ep > 1 needs a "
                               f"mixture-of-experts model)")
    edp = None
    if has_expert:
        if (dp * tp) % (ep * etp):
            raise bad("inputs.ep", f"ep·etp = {ep}·{etp} does not divide dp·tp = {dp}·{tp}")
        edp = dp * tp // (ep * etp)
    slot_of: dict[str, tuple[int, int, int]] = {}
    seen_keys: dict[tuple[str, int | None], int] = {}
    for i, buf in enumerate(plan.buffers):
        f = f"buffers[{i}]"
        if buf.grad_dtype != inp.grad_dtype:
            raise bad(f"{f}.grad_dtype", f"is {buf.grad_dtype!r} but inputs.grad_dtype is "
                                         f"{inp.grad_dtype!r}")
        if buf.expert:
            if buf.ep_rank is None or not 0 <= buf.ep_rank < ep:
                raise bad(f"{f}.ep_rank", f"is {buf.ep_rank} but an expert buffer belongs to an "
                                          f"EP rank in 0 … {ep - 1} (inputs.ep = {ep})")
            if buf.dp_size != edp:
                raise bad(f"{f}.dp_size", f"is {buf.dp_size} but expert buffers are sharded over "
                                          f"the expert-data-parallel group, edp = dp·tp/(ep·etp) "
                                          f"= {dp}·{tp}/({ep}·{etp}) = {edp}")
            key = f"expert ep{buf.ep_rank} {buf.dtype}/{buf.grad_dtype}"
        else:
            if buf.ep_rank is not None:
                raise bad(f"{f}.ep_rank", f"is {buf.ep_rank} but a dense buffer has none (null)")
            if buf.dp_size != dp:
                raise bad(f"{f}.dp_size", f"is {buf.dp_size} but dense buffers are sharded over "
                                          f"the DP group, inputs.dp = {dp}")
            key = f"dense {buf.dtype}/{buf.grad_dtype}"
        if buf.key != key:
            raise bad(f"{f}.key", f"is {buf.key!r} but its dtype, expert flag and EP rank make "
                                  f"it {key!r}")
        if (buf.dtype, buf.ep_rank) in seen_keys:
            raise bad(f"{f}.key", f"{key!r} is also buffers[{seen_keys[buf.dtype, buf.ep_rank]}] "
                                  f"(one buffer per dtype and EP rank)")
        seen_keys[buf.dtype, buf.ep_rank] = i
        div = math.lcm(buf.dp_size, 128)
        end = 0
        for j, b in enumerate(buf.buckets):
            bf = f"{f}.buckets[{j}]"
            if b.index != j:
                raise bad(f"{bf}.index", f"is {b.index} but it is bucket {j} of its buffer")
            if b.start != end:
                raise bad(f"{bf}.start", f"is {b.start} but the previous bucket ends at {end} "
                                         f"(buckets tile their buffer)")
            if len(b.cuts) != buf.dp_size + 1:
                raise bad(f"{bf}.cuts", f"has {len(b.cuts)} entries but the buffer is sharded over "
                                        f"dp_size = {buf.dp_size} ranks, which needs dp_size + 1 "
                                        f"= {buf.dp_size + 1}")
            if b.end % div:
                raise bad(f"{bf}.end", f"is {b.end}, not padded to a multiple of lcm(dp_size, "
                                       f"128) = {div}")
            pos = b.start
            for k, sl in enumerate(b.slots):
                if sl.start < pos:
                    raise bad(f"{bf}.slots[{k}].start", f"is {sl.start} but the previous slot (or the "
                                             f"bucket) ends at {pos}: slots must not overlap")
                if sl.start % PARAM_ALIGN:
                    raise bad(f"{bf}.slots[{k}].start", f"is {sl.start}, not aligned to {PARAM_ALIGN} "
                                             f"elements")
                if sl.end <= sl.start:
                    raise bad(f"{bf}.slots[{k}].end", f"is {sl.end}, not after its start {sl.start}")
                if sl.name in slot_of:
                    raise bad(f"{bf}.slots[{k}].name", f"parameter '{sl.name}' already has a slot "
                                            f"({_slot_field(slot_of[sl.name])})")
                slot_of[sl.name] = (i, j, k)
                pos = sl.end
            if pos > b.end:
                raise bad(f"{bf}.end", f"is {b.end} but its slots reach {pos}")
            if b.numel_unpadded != pos - b.start:
                raise bad(f"{bf}.numel_unpadded", f"is {b.numel_unpadded} but its slots span "
                                                  f"{pos - b.start} elements")
            end = b.end

    m = plan.metrics
    for name in ("dp_load", "dp_flops", "dp_state_bytes", "dp_reduce_scatter_bytes"):
        k = len(getattr(m, name))
        if k != dp:
            raise bad(f"metrics.{name}", f"has {k} entries but inputs.dp is {dp} (one per DP "
                                         f"index)")

    # Tasks: ids, shapes, owners, hosts; every task in a slot and every slot with a task.
    tasks = plan.tasks
    n = len(tasks)
    if n == 0:
        raise bad("tasks", "is empty but a plan has one task per parameter (or per split part)")
    tasks_of: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        if t.id != i:
            raise bad(f"tasks[{i}].id", f"is {t.id} but task ids run 0 … {n - 1} in order (this one is "
                                  f"{i})")
        if t.shape and min(t.shape) < 1:
            raise bad(f"tasks[{i}].shape", f"is {list(t.shape)}; every dimension must be positive")
        if t.param not in slot_of:
            raise bad(f"tasks[{i}].param", f"'{t.param}' is in no bucket's slots")
        if t.optimizer == "matrix":
            if t.owner is None:
                raise bad(f"tasks[{i}].owner", "is null but a matrix task needs the DP index that "
                                         "computes it")
            if not 0 <= t.owner < dp:
                raise bad(f"tasks[{i}].owner", f"is {t.owner} but DP indices run 0 … {dp - 1} "
                                         f"(inputs.dp = {dp})")
        elif t.owner is not None or t.host is not None or t.micro_group is not None:
            attr = next(a for a in ("owner", "host", "micro_group") if getattr(t, a) is not None)
            raise bad(f"tasks[{i}].{attr}", f"is {getattr(t, attr)} but an AdamW task has none (null): "
                                      f"its elements follow the cuts")
        if t.host is not None and not 0 <= t.host < tp:
            raise bad(f"tasks[{i}].host", f"is {t.host} but TP ranks run 0 … {tp - 1} (inputs.tp = "
                                    f"{tp})")
        if (t.host is None) != (t.micro_group is None):
            raise bad(f"tasks[{i}].micro_group", f"is {t.micro_group} with host {t.host}: a hosted "
                                           f"task has both, other tasks neither")
        if t.micro_group is not None and t.micro_group < 0:
            raise bad(f"tasks[{i}].micro_group", f"is {t.micro_group}; micro-groups count from 0")
        tasks_of.setdefault(t.param, []).append(i)
    for name, ids in tasks_of.items():
        if len(ids) > 1:
            parts = [tasks[i].part for i in ids]
            for i in ids:
                if tasks[i].part is None or parts.count(tasks[i].part) > 1:
                    raise bad(f"tasks[{i}].part", f"is {tasks[i].part!r} but parameter '{name}' "
                                                  f"has {len(ids)} tasks, which need distinct "
                                                  f"parts")
                if tasks[i].optimizer != tasks[ids[0]].optimizer:
                    raise bad(f"tasks[{i}].optimizer", f"is {tasks[i].optimizer!r} but another "
                                                       f"part of '{name}' is "
                                                       f"{tasks[ids[0]].optimizer!r}")
    for name, where in slot_of.items():
        if name not in tasks_of:
            raise bad(f"{_slot_field(where)}.name", f"parameter '{name}' has no task (every parameter slot "
                                       f"needs one)")

    # The TP section.
    strategy = inp.solver.strategy
    if plan.tp is None:
        if tp > 1 and strategy not in BASELINE_STRATEGIES:
            raise bad("tp", f"is missing but inputs.tp is {tp}: a '{strategy}' plan for tp > 1 "
                            f"holds its TP micro-group schedule")
        for i, t in enumerate(tasks):
            if t.host is not None:
                raise bad(f"tasks[{i}].host", f"is {t.host} but the plan has no TP section")
        return
    if tp == 1:
        raise bad("tp", "is present but inputs.tp is 1 (a TP schedule exists only for tp > 1)")
    _check_tp_structure(plan, bad)


def _slot_field(where: tuple[int, int, int]) -> str:
    i, j, k = where
    return f"buffers[{i}].buckets[{j}].slots[{k}]"


def _check_tp_structure(plan: Plan, bad) -> None:  # noqa: ANN001
    inp, T, tasks = plan.inputs, plan.tp, plan.tasks
    assert T is not None
    dp, tp, n = inp.dp, inp.tp, len(tasks)
    if T.comm_dtype != inp.comm_dtype:
        raise bad("tp.comm_dtype", f"is {T.comm_dtype!r} but inputs.comm_dtype is "
                                   f"{inp.comm_dtype!r}")
    for li, L in enumerate(T.layouts):
        lf = f"tp.layouts[{li}]"
        if len(L.local_shape) != len(L.full_shape) or any(x < 1 for x in L.full_shape):
            raise bad(f"{lf}.local_shape", f"is {list(L.local_shape)} for full shape "
                                           f"{list(L.full_shape)}")
        if L.dim is None:
            continue
        if not 0 <= L.dim < len(L.full_shape):
            raise bad(f"{lf}.dim", f"is {L.dim} for a {len(L.full_shape)}-D matrix")
        pos = 0
        for si, (rank, local_start, full_start, length) in enumerate(L.segments):
            if (not 0 <= rank < tp or local_start < 0 or full_start != pos or length < 1
                    or local_start + length > L.local_shape[L.dim]):
                raise bad(f"{lf}.segments[{si}]", f"is {[rank, local_start, full_start, length]}: "
                                                  f"segments tile the full matrix in order, "
                                                  f"from TP ranks 0 … {tp - 1} and inside the "
                                                  f"local shard")
            pos += length
        if pos != L.full_shape[L.dim]:
            raise bad(f"{lf}.segments", f"cover {pos} of the {L.full_shape[L.dim]} rows/columns "
                                        f"of dim {L.dim}")
        held: list[list[tuple[int, int]]] = [[] for _ in range(tp)]
        for rank, local_start, _, length in L.segments:
            held[rank].append((local_start, local_start + length))
        for rank, spans in enumerate(held):
            spans.sort()
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                raise bad(f"{lf}.segments", f"overlap in the local shard of TP rank {rank}")
        if len({sum(b - a for a, b in spans) for spans in held}) > 1:
            raise bad(f"{lf}.segments", "give the TP ranks shards of different sizes (every "
                                        "rank holds an equal shard)")
    if len(T.indices) != dp:
        raise bad("tp.indices", f"has {len(T.indices)} entries but inputs.dp is {dp} (one TP "
                                f"group per DP index)")
    seen: dict[int, str] = {}
    groups = 0
    for d, ix in enumerate(T.indices):
        xf = f"tp.indices[{d}]"
        if ix.dp_index != d:
            raise bad(f"{xf}.dp_index", f"is {ix.dp_index} but it is entry {d}")
        if len(ix.local_load) != tp:
            raise bad(f"{xf}.local_load", f"has {len(ix.local_load)} entries but inputs.tp is "
                                          f"{tp} (one per TP rank)")
        if len(set(ix.local_load)) > 1:
            raise bad(f"{xf}.local_load", f"is {list(ix.local_load)} but every TP rank of a DP "
                                          f"index carries the same AdamW shards and replicated "
                                          f"matrices")
        for gi, g in enumerate(ix.groups):
            gf = f"{xf}.groups[{gi}]"
            groups += 1
            if g.index != gi:
                raise bad(f"{gf}.index", f"is {g.index} but it is group {gi} of DP index {d}")
            if len(g.rank_load) != tp:
                raise bad(f"{gf}.rank_load", f"has {len(g.rank_load)} entries but inputs.tp is "
                                             f"{tp} (one per TP rank)")
            for name in ("gather_send", "gather_recv", "scatter_send", "scatter_recv"):
                mat = getattr(g, name)
                if len(mat) != tp or any(len(row) != tp for row in mat):
                    raise bad(f"{gf}.{name}", f"must be tp × tp = {tp} × {tp} split sizes")
            if g.timeline_s and len(g.timeline_s) != 6:
                raise bad(f"{gf}.timeline_s", f"has {len(g.timeline_s)} entries; it holds gather, "
                                              f"compute and scatter start/end (6) or none")
            prev = (-1, -1)
            for k, gt in enumerate(g.tasks):
                kf = f"{gf}.tasks[{k}]"
                if not 0 <= gt.host < tp:
                    raise bad(f"{kf}.host", f"is {gt.host} but TP ranks run 0 … {tp - 1} "
                                            f"(inputs.tp = {tp})")
                if not 0 <= gt.id < n:
                    raise bad(f"{kf}.id", f"is {gt.id} but the plan's tasks are 0 … {n - 1}")
                if gt.layout >= len(T.layouts):
                    raise bad(f"{kf}.layout", f"is {gt.layout} but tp.layouts has "
                                              f"{len(T.layouts)} entries")
                if (gt.host, gt.id) <= prev:
                    raise bad(f"{kf}", "is out of wire order: a group's tasks are sorted by "
                                       "host, then id")
                prev = (gt.host, gt.id)
                task = tasks[gt.id]
                if task.optimizer != "matrix":
                    raise bad(f"{kf}.id", f"is {gt.id}, an AdamW task; only matrix tasks are "
                                          f"hosted")
                if gt.id in seen:
                    raise bad(f"{kf}.id", f"task {gt.id} is scheduled twice (also {seen[gt.id]})")
                seen[gt.id] = kf
                if task.owner != d:
                    raise bad(f"tasks[{gt.id}].owner", f"is {task.owner} but the TP schedule has "
                                                       f"task {gt.id} in DP index {d}'s group "
                                                       f"({kf})")
                if task.host != gt.host or task.micro_group != gi:
                    raise bad(f"tasks[{gt.id}].host", f"host {task.host}, micro-group "
                                                      f"{task.micro_group} disagree with {kf} "
                                                      f"(host {gt.host}, group {gi})")
    for i, t in enumerate(tasks):
        if t.host is not None and i not in seen:
            raise bad(f"tasks[{i}].host", f"is {t.host} but task {i} is in no micro-group of the "
                                          f"TP section")
    M = T.metrics
    for name in ("gpu_load", "all_to_all_bytes"):
        mat = getattr(M, name)
        if len(mat) != dp or any(len(row) != tp for row in mat):
            raise bad(f"tp.metrics.{name}", f"must be dp × tp = {dp} × {tp} (one entry per GPU)")
    if M.micro_groups != groups:
        raise bad("tp.metrics.micro_groups", f"is {M.micro_groups} but tp.indices hold {groups} "
                                             f"groups")
