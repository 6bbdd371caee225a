"""The plan as frozen records, built once at construction; the step loop never touches pydantic.

Offsets are element counts. A bucket's are relative to the bucket's start; a work item's
(``MatrixTask``, ``AdamWSlice``) are relative to the start of its rank's own slice of the bucket,
``[cuts[rank], cuts[rank + 1])``. The schedule holds the work order of *every* DP rank (what each
one updates, bucket by bucket, in plan order), so that a rank can check locally that the ranks
together update every element of every parameter exactly once (``checks.check_work_order``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from canzona.planner.errors import CanzonaError
from canzona.planner.heads import head_places
from canzona.planner.plan import Plan
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.experts import ExpertLayout

__all__ = ["AdamWSlice", "Bucket", "MatrixTask", "ParamSlot", "Schedule", "SplitParam", "WorkOrder",
           "build_schedule"]


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """Parameter ``param`` (index in registration order) at ``[lo, hi)`` of its bucket."""

    param: int
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """One ZeRO-1 bucket: reduced and gathered as a unit, in ``index`` order on every rank."""

    index: int
    numel: int  # padded size
    cuts: tuple[int, ...]  # dp + 1 offsets: rank r's slice is [cuts[r], cuts[r + 1])
    sizes: tuple[int, ...]  # dp slice sizes
    slots: tuple[ParamSlot, ...]
    grad_dtype: str  # the plan's name: "fp32" | "bf16" | "fp16"
    method: str  # the plan's collective method (canzona.planner.comm.METHODS)
    #: This rank's place in the group the bucket is sharded over: its DP rank, or for an expert
    #: bucket its expert-DP rank (``runtime.experts``).
    rank: int = 0
    expert: bool = False


@dataclass(frozen=True, slots=True)
class MatrixTask:
    """An owned matrix task: rows ``[row0, row0 + shape[0])`` of parameter ``param``, elements
    ``[lo, hi)`` of its owner's own slice of bucket ``bucket``."""

    id: int
    param: int
    name: str  # the parameter's name, "#part" appended for a split (Q/K/V, gate/up) part
    part: str | None  # the part's key in the parameter's state, None for a whole parameter
    bucket: int
    lo: int
    hi: int
    row0: int
    shape: tuple[int, int]
    #: A piece of a matrix two DP ranks share (``plan.dp_shared``; ``runtime.pairs``): the
    #: whole matrix's shape, the pair's DP indices, its phase and polynomial split.
    full: tuple[int, int] | None = None
    pair: tuple[int, int] | None = None
    phase: int = 0
    split_poly: bool = False

    @property
    def full_shape(self) -> tuple[int, int]:
        """The shape of the matrix this task orthogonalises (its piece's, for a shared one)."""
        return self.full or self.shape


@dataclass(frozen=True, slots=True)
class AdamWSlice:
    """Elements ``[offset, offset + hi - lo)`` of the flattened AdamW parameter ``param``, at
    ``[lo, hi)`` of its holder's own slice of bucket ``bucket``."""

    param: int
    name: str
    bucket: int
    lo: int
    hi: int
    offset: int


@dataclass(frozen=True, slots=True)
class SplitParam:
    """A TP-split matrix parameter this DP rank owns: its local shard at ``[lo, hi)`` of the
    rank's own slice of bucket ``bucket``, updated by the TP micro-groups (``runtime.tp``) — or,
    where two TP groups share it (``plan.dp_shared`` at tp > 1), this rank's rows of the shard,
    elements ``[offset, offset + hi - lo)`` of it."""

    param: int
    name: str
    bucket: int
    lo: int
    hi: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class WorkOrder:
    """What one DP rank updates, per bucket in launch order (matrix tasks in plan order)."""

    rank: int
    matrix: tuple[tuple[MatrixTask, ...], ...]
    adamw: tuple[tuple[AdamWSlice, ...], ...]
    split: tuple[tuple[SplitParam, ...], ...] = ()  # TP-split matrices (tp > 1)


@dataclass(frozen=True, slots=True)
class Schedule:
    """This rank's view of the plan."""

    dp: int
    rank: int
    buckets: tuple[Bucket, ...]
    #: Per place r in the buckets' groups, what that rank updates: a dense bucket's r is a DP
    #: rank, an expert bucket's an expert-DP rank (max(dp, edp) places: a group's entries past
    #: its size are empty).
    work: tuple[WorkOrder, ...]
    param_bucket: tuple[int, ...]  # per parameter, its bucket
    param_range: tuple[tuple[int, int], ...]  # per parameter, [lo, hi) in its bucket
    matrix_params: tuple[int, ...]  # parameters the plan gives the matrix optimizer, plan order
    mine: WorkOrder  # this rank's work order: per bucket, its place's in that bucket's group

    def own_range(self, bucket: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of a bucket."""
        b = self.buckets[bucket]
        return b.cuts[b.rank], b.cuts[b.rank + 1]


def _pieces(x: Any, name: str, lo: int, rows: int, cols: int, cuts: Sequence[int],
            what: str) -> list[tuple[int, int, int, int, int]]:
    """The two pieces of a matrix two DP indices share (``x``, its ``plan.dp_shared`` entry):
    per owner (owner, first row, end row, first element, end element) of the ``rows`` × ``cols``
    matrix (or TP shard: ``what``) stored from element ``lo`` of its bucket, each checked to lie
    in its owner's slice alone."""
    out = []
    for owner, r0, r1 in ((x.owners[0], 0, x.row), (x.owners[1], x.row, rows)):
        a, z = lo + r0 * cols, lo + r1 * cols
        holders = [r for r in range(len(cuts) - 1) if cuts[r] < z and a < cuts[r + 1]]
        if holders != [owner]:
            raise PlanMismatchError(
                f"the plan shares matrix '{name}' by DP indices {list(x.owners)} but the cuts "
                f"put rows [{r0}, {r1}){what} on DP ranks {holders}; the plan is inconsistent.")
        out.append((owner, r0, r1, a, z))
    return out


def _my_heads(plan: Plan, tp_rank: int) -> dict[int, int | None]:
    """Task id → its first row in this TP rank's shard, or None where another TP rank's shard
    holds it, for every head of an attention weight split per head (``planner.heads``)."""
    if not plan.inputs.optimizer.records_heads:
        return {}
    try:
        places = head_places(plan.tasks, plan.inputs.tp)
    except CanzonaError as e:
        raise PlanMismatchError(f"the plan is inconsistent: {e}") from None
    return {i: row0 if r == tp_rank else None for i, (r, row0) in places.items()}


def build_schedule(plan: Plan, names: list[str], rank: int,
                   experts: ExpertLayout = ExpertLayout(), tp_rank: int = 0) -> Schedule:
    """Convert the plan (already checked against the model) into records for DP rank ``rank``
    (``names``: the parameters as the plan names them) and TP rank ``tp_rank``. Under expert
    parallelism the schedule holds the dense buckets and this rank's EP rank's expert buckets
    (``experts``), whose owners are places in the expert-DP group. The heads of a fused QKV
    split per head (``planner.heads``) are the rows of the TP shard that holds them: this TP
    rank's own heads are its matrix tasks, at their rows of its shard.

    Raises:
        PlanMismatchError: the plan cuts a matrix across DP ranks (a baseline such as ``asc``).
    """
    index = {n: i for i, n in enumerate(names)}
    dp = plan.inputs.dp
    buckets: list[Bucket] = []
    param_bucket = [-1] * len(names)
    param_range = [(0, 0)] * len(names)
    for buf in plan.buffers:
        if not experts.holds(buf):
            continue
        place = experts.edp_rank if buf.expert else rank
        for b in buf.buckets:
            slots = []
            for s in b.slots:
                i = index[s.name]
                slots.append(ParamSlot(i, s.start - b.start, s.end - b.start))
                param_bucket[i] = len(buckets)
                param_range[i] = (s.start - b.start, s.end - b.start)
            cuts = tuple(c - b.start for c in b.cuts)
            sizes = tuple(y - x for x, y in zip(cuts, cuts[1:]))
            buckets.append(Bucket(len(buckets), b.end - b.start, cuts, sizes, tuple(slots),
                                  buf.grad_dtype, b.method, place, buf.expert))
    places = max(dp, experts.edp)  # a bucket's group: DP ranks, or expert-DP ranks
    matrix = [[[] for _ in buckets] for _ in range(places)]
    adamw = [[[] for _ in buckets] for _ in range(places)]
    split: list[list[list[SplitParam]]] = [[[] for _ in buckets] for _ in range(places)]
    split_seen: set[int] = set()
    rows_done: dict[str, int] = defaultdict(int)
    matrix_params: dict[int, None] = {}  # ordered set
    shared = ({x.id for ix in plan.tp.indices for x in ix.shared} if plan.tp is not None
              else set())
    tp_pairs = {x.id: x for x in plan.dp_shared} if plan.inputs.tp > 1 else {}
    pairs = {x.id: x for x in plan.dp_shared} if plan.inputs.tp == 1 else {}
    shares = plan.inputs.optimizer.spec.gram_shared  # shared Newton–Schulz; else blocks apart
    heads = _my_heads(plan, tp_rank)
    for t in plan.tasks:
        i = index.get(t.param)
        if i is None:  # another EP rank's expert
            continue
        bi = param_bucket[i]
        cuts = buckets[bi].cuts
        if buckets[bi].expert and t.owner is not None:  # its place in the expert-DP group
            j = bisect_right(cuts, param_range[i][0]) - 1
            if experts.dp_index(j) != t.owner:
                raise PlanMismatchError(
                    f"the plan's owner of expert matrix '{t.param}' is DP index {t.owner} but its "
                    f"cuts put it on expert-DP rank {j} (DP index {experts.dp_index(j)}); the "
                    "plan is inconsistent: regenerate it.")
            t = t.model_copy(update={"owner": j})
        lo, hi = param_range[i]
        if t.optimizer == "matrix" and t.id in tp_pairs:
            # Shared by two TP groups: each DP index holds rows of every TP shard (the cut is
            # inside each shard); runtime.tp updates them (SharedTask with a partner).
            x = tp_pairs[t.id]
            cols = t.shape[1]
            matrix_params[i] = None
            for owner, r0, _, a, z in _pieces(x, t.param, lo, (hi - lo) // cols, cols, cuts,
                                              " of its TP shard"):
                c0 = cuts[owner]
                split[owner][bi].append(SplitParam(i, t.param, bi, a - c0, z - c0, r0 * cols))
            continue
        if t.optimizer == "matrix" and (t.host is not None or t.id in shared):
            # TP-split: the whole local shard (every part) on its owner; runtime.tp updates it
            # (hosted in a micro-group, or shared by the TP group).
            matrix_params[i] = None
            holders = [r for r in range(len(cuts) - 1) if cuts[r] < hi and lo < cuts[r + 1]]
            if holders != [t.owner]:
                raise PlanMismatchError(
                    f"the plan cuts matrix '{t.param}' across DP ranks {holders} (owner "
                    f"{t.owner}); the runtime needs whole-matrix ownership.")
            if i not in split_seen:
                split_seen.add(i)
                c0 = cuts[t.owner]
                split[t.owner][bi].append(SplitParam(i, t.param, bi, lo - c0, hi - c0))
        elif t.optimizer == "matrix" and t.id in pairs:
            # Split over two DP ranks: each holds a row block (the cut is inside the matrix).
            x = pairs[t.id]
            rows, cols = t.shape
            rows_done[t.param] += rows
            matrix_params[i] = None
            for owner, r0, r1, a, z in _pieces(x, t.param, lo, rows, cols, cuts, ""):
                c0 = cuts[owner]
                if not shares:  # Shampoo: its blocks, preconditioned alone (plain tasks)
                    matrix[owner][bi].append(MatrixTask(t.id, i, t.param, None, bi, a - c0,
                                                        z - c0, r0, (r1 - r0, cols)))
                    continue
                matrix[owner][bi].append(MatrixTask(
                    t.id, i, t.param, None, bi, a - c0, z - c0, r0, (r1 - r0, cols),
                    full=(rows, cols),
                    pair=tuple(x.owners),  # type: ignore[arg-type]
                    phase=x.phase, split_poly=x.split_poly))
        elif t.optimizer == "matrix":
            rows, cols = t.shape
            if t.id in heads:  # a head in this TP rank's shard, or in another's (skipped)
                row0 = heads[t.id]
                if row0 is None:
                    continue
            else:
                row0 = rows_done[t.param]
                rows_done[t.param] += rows
            matrix_params[i] = None
            a, z = lo + row0 * cols, lo + (row0 + rows) * cols
            holders = [r for r in range(len(cuts) - 1) if cuts[r] < z and a < cuts[r + 1]]
            if holders != [t.owner]:
                raise PlanMismatchError(
                    f"the plan cuts matrix '{t.param}' across DP ranks {holders} (owner "
                    f"{t.owner}); the runtime needs whole-matrix ownership (strategy "
                    f"'{plan.inputs.solver.strategy}'; plan with 'canzona plan' or plan_model).")
            c0 = cuts[t.owner]
            name = t.param if t.part is None else f"{t.param}#{t.part}"
            matrix[t.owner][bi].append(MatrixTask(t.id, i, name, t.part, bi, a - c0, z - c0,
                                                  row0, (rows, cols)))
        else:
            # AdamW elements need no atomicity: every rank holding a piece updates it.
            for r in range(len(cuts) - 1):
                a, z = max(lo, cuts[r]), min(hi, cuts[r + 1])
                if a < z:
                    adamw[r][bi].append(AdamWSlice(i, t.param, bi, a - cuts[r], z - cuts[r],
                                                   a - lo))
    work = tuple(WorkOrder(r, tuple(map(tuple, matrix[r])), tuple(map(tuple, adamw[r])),
                           tuple(map(tuple, split[r])))
                 for r in range(places))
    mine = WorkOrder(rank, *(tuple(tuple(getattr(work[b.rank], f)[b.index]) for b in buckets)
                             for f in ("matrix", "adamw", "split")))
    return Schedule(dp, rank, tuple(buckets), work, tuple(param_bucket), tuple(param_range),
                    tuple(matrix_params), mine)
