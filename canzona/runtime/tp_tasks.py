"""This rank's TP work, read from the plan once: frozen records and their builders.

* :class:`TPTask` and :class:`TPGroup` (:func:`build_tp_groups`): each micro-group of this DP
  index's TP schedule as this TP rank sees it — its tasks in wire order, the ones it hosts, and
  the all-to-all split sizes, checked against the plan's ``gather_send``/``gather_recv``.
* :class:`SharedTask` (:func:`build_shared_tasks`): the TP-split matrices this DP index's TP group
  shares, in plan order, with this rank's shard (or its rows of the shard, where a partner DP
  index holds the others) located in its own slice of the bucket, and the round of TP
  sub-groups a matrix is in (:func:`check_sub_rounds` checks every index's rounds).

Anything the plan says that the runtime cannot follow raises ``PlanMismatchError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from canzona.planner.plan import Plan, sub_round_problem
from canzona.runtime.errors import PlanMismatchError

__all__ = ["SharedTask", "TPGroup", "TPTask", "build_shared_tasks", "build_tp_groups",
           "check_sub_rounds", "sub_group_sizes"]


@dataclass(frozen=True, slots=True)
class TPTask:
    """A TP-split matrix task of this DP index.

    ``lo``/``hi``: the parameter's elements in its owner's own slice of bucket ``bucket`` (the
    whole local shard, every part); ``segments``: (rank, local_start, full_start, length) along
    ``dim``, in full_start order."""

    id: int
    param: int
    name: str
    part: str | None
    host: int
    bucket: int
    lo: int
    hi: int
    dim: int
    local_shape: tuple[int, int]
    full_shape: tuple[int, int]
    segments: tuple[tuple[int, int, int, int], ...]

    def of(self, rank: int) -> tuple[tuple[int, int, int, int], ...]:
        """The segments TP rank ``rank`` holds, in wire order."""
        return tuple(s for s in self.segments if s[0] == rank)

    def numel(self, rank: int) -> int:
        other = self.full_shape[1 - self.dim]
        return sum(s[3] for s in self.of(rank)) * other


@dataclass(frozen=True, slots=True)
class TPGroup:
    """One micro-group as this TP rank sees it."""

    index: int
    tasks: tuple[TPTask, ...]  # wire order
    hosted: tuple[TPTask, ...]  # the tasks this rank computes, wire order
    send: tuple[int, ...]  # gather: elements this rank sends to each TP rank
    recv: tuple[int, ...]  # gather: elements this rank receives from each TP rank


def build_tp_groups(plan: Plan, names: list[str], param_bucket: Sequence[int],
                    param_range: Sequence[tuple[int, int]], own_start: Sequence[int],
                    dp_rank: int, tp_rank: int) -> tuple[TPGroup, ...]:
    """This rank's micro-groups (DP index ``dp_rank``, TP rank ``tp_rank``), checked against the
    plan's split sizes. ``own_start[b]``: where this DP rank's own slice of bucket b starts."""
    T = plan.tp
    if T is None:
        return ()
    index = {n: i for i, n in enumerate(names)}
    tasks = {t.id: t for t in plan.tasks}
    tp = plan.inputs.tp
    mine = next((ix for ix in T.indices if ix.dp_index == dp_rank), None)
    if mine is None:
        raise PlanMismatchError(f"the plan's TP section has no schedule for DP index {dp_rank}.")
    groups = []
    for g in mine.groups:
        built = []
        for gt in g.tasks:
            t = tasks[gt.id]
            lay = T.layouts[gt.layout]
            i = index[t.param]
            bi = param_bucket[i]
            lo, hi = param_range[i]
            if lay.dim is None or len(lay.local_shape) != 2:
                raise PlanMismatchError(f"the plan's TP layout of '{t.param}' is not a split "
                                        "matrix; the plan is inconsistent.")
            name = t.param if t.part is None else f"{t.param}#{t.part}"
            built.append(TPTask(
                t.id, i, name, t.part, gt.host, bi, lo - own_start[bi], hi - own_start[bi],
                lay.dim, tuple(lay.local_shape),  # type: ignore[arg-type]
                tuple(lay.full_shape), tuple(lay.segments)))  # type: ignore[arg-type]
        send = tuple(sum(t.numel(tp_rank) for t in built if t.host == h) for h in range(tp))
        recv = tuple(sum(t.numel(r) for t in built if t.host == tp_rank) for r in range(tp))
        if send != tuple(g.gather_send[tp_rank]) or recv != tuple(g.gather_recv[tp_rank]):
            raise PlanMismatchError(f"micro-group {g.index} of DP index {dp_rank}: the split "
                                    f"sizes of TP rank {tp_rank} ({send}, {recv}) are not the "
                                    "plan's; the plan is inconsistent.")
        groups.append(TPGroup(g.index, tuple(built),
                              tuple(t for t in built if t.host == tp_rank), send, recv))
    return tuple(groups)


@dataclass(frozen=True, slots=True)
class SharedTask:
    """A TP-split Muon matrix its TP group shares (the plan's ``tp.indices[d].shared``): this
    rank's shard is ``[lo, hi)`` of its own slice of bucket ``bucket``, viewed ``local_shape``;
    ``dim`` the split dimension (the long one: the shard is a row block of the oriented matrix)."""

    id: int
    param: int
    name: str
    bucket: int
    lo: int
    hi: int
    dim: int
    local_shape: tuple[int, int]
    full_shape: tuple[int, int]
    split_poly: bool
    #: Shampoo: this rank preconditions the blocks of its own shard (whole blocks of the
    #: matrix), no collective; else Muon's shared Newton–Schulz over the TP group
    blocks: bool = False
    #: shared with the same TP ranks at a partner DP index (k = 2·tp): the two DP indices,
    #: ascending; this rank holds rows [row0, row0 + local_shape[0]) of its shard
    pair: tuple[int, int] | None = None
    row0: int = 0
    #: shared by a TP sub-group (``SharedTaskPlan.sub``): (k, round, slot) — the round's tp/k
    #: matrices are consecutive in slot order, and the k TP ranks slot, slot + tp/k, … compute
    #: this one (``runtime.optim.sub_groups``); this rank still holds its whole shard
    sub: tuple[int, int, int] | None = None


def build_shared_tasks(plan: Plan, names: list[str], param_bucket: Sequence[int],
                       param_range: Sequence[tuple[int, int]], own_start: Sequence[int],
                       dp_rank: int) -> tuple[SharedTask, ...]:
    """The tasks DP index ``dp_rank``'s TP group shares, in plan order (every TP rank runs them
    in that order: their collectives must match), the rounds of TP sub-groups of every index
    checked first (:func:`check_sub_rounds`)."""
    T = plan.tp
    if T is None:
        return ()
    check_sub_rounds(plan)
    mine = next((ix for ix in T.indices if ix.dp_index == dp_rank), None)
    if mine is None or not (mine.shared or plan.dp_shared):
        return ()
    name, spec = plan.inputs.optimizer.name, plan.inputs.optimizer.spec
    if mine.shared and not spec.shareable:
        raise PlanMismatchError(f"the plan shares matrices over TP but its optimizer {name} "
                                f"updates every matrix whole; the plan is inconsistent.")
    index = {n: i for i, n in enumerate(names)}
    tasks = {t.id: t for t in plan.tasks}
    pairs = {x.id: x for x in plan.dp_shared}
    out = []
    for x in mine.shared:
        t, lay = tasks[x.id], T.layouts[x.layout]
        i = index[t.param]
        bi = param_bucket[i]
        lo, hi = param_range[i]
        if lay.dim is None or len(lay.local_shape) != 2 or t.part is not None:
            raise PlanMismatchError(f"the plan shares '{t.param}' over TP but its layout is not "
                                    "a split matrix; the plan is inconsistent.")
        shape = tuple(lay.local_shape)
        pair, row0 = None, 0
        if x.partner is None and x.id in pairs:
            raise PlanMismatchError(f"the plan shares '{t.param}' by DP indices "
                                    f"{list(pairs[x.id].owners)} but DP index {dp_rank}'s TP "
                                    f"group lists it without its partner; the plan is "
                                    f"inconsistent.")
        if x.partner is not None:  # this index's rows of every shard (the cut inside them)
            p = pairs.get(x.id)
            if p is None or sorted((dp_rank, x.partner)) != list(p.owners) or lay.dim != 0 \
                    or not spec.gram_shared:
                raise PlanMismatchError(f"the plan shares '{t.param}' with DP index "
                                        f"{x.partner} but its dp_shared entry or layout does "
                                        f"not say so; the plan is inconsistent.")
            pair = tuple(p.owners)
            first = dp_rank == p.owners[0]
            row0, rows = (0, p.row) if first else (p.row, shape[0] - p.row)
            lo += row0 * shape[1]
            hi = lo + rows * shape[1]
            shape = (rows, shape[1])
        sub = None if x.sub is None else (x.sub.k, x.sub.round, x.sub.slot)
        out.append(SharedTask(
            t.id, i, t.param, bi, lo - own_start[bi], hi - own_start[bi],
            lay.dim, shape, tuple(lay.full_shape),  # type: ignore[arg-type]
            x.split_poly, spec.block_hosted, pair, row0, sub))  # type: ignore[arg-type]
    listed = {x.id for x in out if x.pair is not None}
    for p in pairs.values():
        if plan.inputs.tp > 1 and dp_rank in p.owners and p.id not in listed:
            raise PlanMismatchError(f"the plan shares '{tasks[p.id].param}' by DP indices "
                                    f"{list(p.owners)} but DP index {dp_rank}'s TP group does "
                                    f"not list its half; the plan is inconsistent.")
    return tuple(out)


def sub_group_sizes(plan: Plan) -> list[int]:
    """Every k of the TP sub-groups the plan uses at any DP index, ascending: the sub-groups
    every rank creates, alike, once (``runtime.optim.sub_groups.tp_sub_groups``)."""
    if plan.tp is None:
        return []
    return sorted({x.sub.k for ix in plan.tp.indices for x in ix.shared if x.sub is not None})


def check_sub_rounds(plan: Plan) -> None:
    """The rounds of TP sub-groups of every DP index as the runtime runs them
    (``planner.plan.schema.sub_round_problem``, the plan loader's check too), on every rank
    alike and without a collective (each index's ranks run only their own rounds, so a rank
    checks the others' too: all refuse a plan together).

    Raises:
        PlanMismatchError: naming the field (``tp.indices[i].shared[j].sub…``) that breaks it.
    """
    wrong = sub_round_problem(plan)
    if wrong is not None:
        field, what = wrong
        raise _inconsistent(f"{field} {what}")


def _inconsistent(what: str) -> PlanMismatchError:
    return PlanMismatchError(f"{what}; the plan is inconsistent.")
