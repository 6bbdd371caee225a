"""A plan's fields against each other, without cost formulas: the structural checks
:func:`canzona.planner.plan.checks.check_plan` runs first (loading a plan runs it after the
schema); the arithmetic checks rely on them.
"""

from __future__ import annotations

import math

from ..comm import EQUAL
from ..errors import PlanFileError
from ..settings import PARAM_ALIGN
from .messages import REGENERATE, inconsistency
from .schema import Plan

#: Strategies without a TP schedule even for tp > 1 (ZeRO-1 equal-cut baselines).
BASELINE_STRATEGIES = ("asc", "zero1")


def check_structure(plan: Plan, source: str = "<plan>") -> None:
    """Check what a plan's fields say about each other, without cost formulas.

    Sizes against cuts (each bucket has dp_size + 1 cuts; dense buffers are sharded over dp,
    expert buffers over edp = dp·tp / (ep·etp); rank layout and per-DP-index metrics match
    inputs.dp and tp), buckets tiling their buffer with 64-aligned, non-overlapping slots, every
    parameter in one slot, a bucket's ``equal`` method only with equal slices, task ids
    0 … n-1, every task's parameter in a slot and every slot with a task, owners (matrix tasks)
    in [0, dp), hosts in [0, tp), and the TP section: present iff tp > 1 (plans of the ZeRO-1
    baselines ``asc`` / ``zero1`` may omit it), one entry per DP index, shard layouts whose
    shards keep every dimension but the split one whole, tp × tp split sizes, hosts and task ids
    in range, every hosted task scheduled once and in agreement with its task's owner, host and
    micro-group. The arithmetic relations (costs, loads, totals) are in
    :mod:`canzona.planner.plan.checks`.

    Raises:
        PlanFileError: one line naming the file, the field and the fix.
    """
    def bad(field: str, problem: str, fix: str = REGENERATE) -> PlanFileError:
        return inconsistency(source, field, problem, fix)

    inp = plan.inputs
    dp, tp, ep, etp = inp.dp, inp.tp, inp.ep, inp.etp
    rl = plan.rank_layout
    if rl.dp != dp:
        raise bad("rank_layout.dp", f"is {rl.dp} but inputs.dp is {dp}; they must agree")
    if rl.tp != tp:
        raise bad("rank_layout.tp", f"is {rl.tp} but inputs.tp is {tp}; they must agree")
    if etp not in (1, tp):
        raise bad("inputs.etp", f"is {etp} but inputs.tp is {tp}; canzona plans expert tensor "
                                f"parallelism with etp = 1 or etp = tp")

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
                    raise bad(f"{bf}.slots[{k}].start", f"is {sl.start} but the previous slot "
                                                        f"(or the bucket) ends at {pos}: slots "
                                                        f"must not overlap")
                if sl.start % PARAM_ALIGN:
                    raise bad(f"{bf}.slots[{k}].start", f"is {sl.start}, not aligned to "
                                                        f"{PARAM_ALIGN} elements")
                if sl.end <= sl.start:
                    raise bad(f"{bf}.slots[{k}].end", f"is {sl.end}, not after its start "
                                                      f"{sl.start}")
                if sl.name in slot_of:
                    raise bad(f"{bf}.slots[{k}].name", f"parameter '{sl.name}' already has a "
                                                       f"slot ({_slot_field(slot_of[sl.name])})")
                slot_of[sl.name] = (i, j, k)
                pos = sl.end
            if pos > b.end:
                raise bad(f"{bf}.end", f"is {b.end} but its slots reach {pos}")
            if b.numel_unpadded != pos - b.start:
                raise bad(f"{bf}.numel_unpadded", f"is {b.numel_unpadded} but its slots span "
                                                  f"{pos - b.start} elements")
            sizes = [y - x for x, y in zip(b.cuts, b.cuts[1:])]
            if b.method == EQUAL and len(set(sizes)) > 1:
                raise bad(f"{bf}.method", f"is 'equal' but the cuts give the DP ranks slices of "
                                          f"{min(sizes)} to {max(sizes)} elements; the stock "
                                          f"reduce-scatter/all-gather move equal slices only")
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
    if n == 0 and (plan.inputs.stage is None or plan.total_params or plan.buffers):
        raise bad("tasks", "is empty but a plan has one task per parameter (or per split part; "
                           "only a pipeline stage without parameters has none)")
    tasks_of: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        if t.id != i:
            raise bad(f"tasks[{i}].id", f"is {t.id} but task ids run 0 … {n - 1} in order "
                                        f"(this one is {i})")
        if t.shape and min(t.shape) < 1:
            raise bad(f"tasks[{i}].shape", f"is {list(t.shape)}; every dimension must be positive")
        if t.param not in slot_of:
            raise bad(f"tasks[{i}].param", f"'{t.param}' is in no bucket's slots")
        if t.optimizer == "matrix":
            if t.owner is None:
                raise bad(f"tasks[{i}].owner", "is null but a matrix task needs the DP index "
                                               "that computes it")
            if not 0 <= t.owner < dp:
                raise bad(f"tasks[{i}].owner", f"is {t.owner} but DP indices run 0 … {dp - 1} "
                                               f"(inputs.dp = {dp})")
        elif t.owner is not None or t.host is not None or t.micro_group is not None:
            attr = next(a for a in ("owner", "host", "micro_group") if getattr(t, a) is not None)
            raise bad(f"tasks[{i}].{attr}", f"is {getattr(t, attr)} but an AdamW task has none "
                                            f"(null): its elements follow the cuts")
        if t.host is not None and not 0 <= t.host < tp:
            raise bad(f"tasks[{i}].host", f"is {t.host} but TP ranks run 0 … {tp - 1} "
                                          f"(inputs.tp = {tp})")
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
            raise bad(f"{_slot_field(where)}.name", f"parameter '{name}' has no task (every "
                                                    f"parameter slot needs one)")

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


def _check_shard_cover(plan: Plan, seen: dict[int, str], bad) -> None:  # noqa: ANN001
    """The hosted tasks of each parameter (its parts, or the one whole matrix) read every row or
    column of each TP rank's local shard exactly once: otherwise a part would be gathered from
    another part's rows (updating one twice and the other never)."""
    T, tasks = plan.tp, plan.tasks
    assert T is not None
    layout_of = {gt.id: gt.layout for ix in T.indices for g in ix.groups for gt in g.tasks}
    layout_of.update({x.id: x.layout for ix in T.indices for x in ix.shared})
    parts: dict[str, list[int]] = {}
    for i in sorted(layout_of):
        parts.setdefault(tasks[i].param, []).append(i)
    covered: set[tuple[int, ...]] = set()  # the layouts of parts found to cover their shard
    for name, ids in parts.items():
        key = tuple(layout_of[i] for i in ids)
        if key in covered:
            continue  # the same layouts cover alike (the experts of a layer, its twins)
        lays = [T.layouts[k] for k in key]
        if any(L.dim is None for L in lays):
            continue  # a replicated layout for a hosted task: the checks name it
        first = lays[0]
        for i, L in zip(ids, lays):
            if L.dim != first.dim or L.local_shape != first.local_shape:
                raise bad(f"{seen[i]}.layout", f"has split dim {L.dim} and local shape "
                                               f"{list(L.local_shape)} but another part of "
                                               f"'{name}' has dim {first.dim} and "
                                               f"{list(first.local_shape)} (one shard, one "
                                               f"layout of it)")
        size = first.local_shape[first.dim]
        for r in range(plan.inputs.tp):
            spans = sorted((ls, ls + n, i) for i, L in zip(ids, lays)
                           for rank, ls, _, n in L.segments if rank == r)
            pos = 0
            for a, z, i in spans:
                if a != pos:
                    how = "twice" if a < pos else "by no part"
                    raise bad(f"{seen[i]}.layout", f"reads rows/columns {a} … {z - 1} of TP rank "
                                               f"{r}'s shard of '{name}', which leaves "
                                               f"{min(a, pos)} … covered {how}: the parts of a "
                                               f"parameter read each row of its shard once")
                pos = z
            if pos < size:
                raise bad(f"{seen[ids[-1]]}.layout", f"leaves rows/columns {pos} … {size - 1} of "
                                                     f"TP rank {r}'s shard of '{name}' to no part: "
                                                     f"the parts of a parameter read each row of "
                                                     f"its shard once")
        covered.add(key)


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
        if any(a != b for k, (a, b) in enumerate(zip(L.local_shape, L.full_shape)) if k != L.dim):
            raise bad(f"{lf}.local_shape", f"is {list(L.local_shape)} for full shape "
                                           f"{list(L.full_shape)} split along dim {L.dim}: a "
                                           f"shard keeps every other dimension whole")
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
    halves: dict[int, tuple[int, str]] = {}  # a task two TP groups share: its first half
    groups = 0
    for d, ix in enumerate(T.indices):
        xf = f"tp.indices[{d}]"
        if ix.dp_index != d:
            raise bad(f"{xf}.dp_index", f"is {ix.dp_index} but it is entry {d}")
        if len(ix.local_load) != tp:
            raise bad(f"{xf}.local_load", f"has {len(ix.local_load)} entries but inputs.tp is "
                                          f"{tp} (one per TP rank)")
        if len(set(ix.local_load)) > 1 and plan.inputs.etp == tp:  # etp 1: own experts
            raise bad(f"{xf}.local_load", f"is {list(ix.local_load)} but every TP rank of a DP "
                                          f"index carries the same AdamW shards and replicated "
                                          f"matrices (at expert TP = TP)")
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
        for k, x in enumerate(ix.shared):
            sf = f"{xf}.shared[{k}]"
            if not 0 <= x.id < n:
                raise bad(f"{sf}.id", f"is {x.id} but the plan's tasks are 0 … {n - 1}")
            if x.layout >= len(T.layouts):
                raise bad(f"{sf}.layout", f"is {x.layout} but tp.layouts has {len(T.layouts)} "
                                          f"entries")
            task = tasks[x.id]
            if task.optimizer != "matrix":
                raise bad(f"{sf}.id", f"is {x.id}, an AdamW task; only matrix tasks are shared")
            if x.partner is not None:  # a half: on its two indices (the checks pair them)
                if x.partner == d or not 0 <= x.partner < dp:
                    raise bad(f"{sf}.partner", f"is {x.partner} but must be another DP index "
                                               f"in [0, {dp})")
                if halves.setdefault(x.id, (d, sf)) != (d, sf) and \
                        halves[x.id][0] != x.partner:
                    raise bad(f"{sf}.id", f"task {x.id}'s halves are on DP indices "
                                          f"{halves[x.id][0]} and {d} but this one names "
                                          f"partner {x.partner}")
                if x.id in seen and seen[x.id] != halves[x.id][1]:
                    raise bad(f"{sf}.id", f"task {x.id} is scheduled twice (also {seen[x.id]})")
                seen.setdefault(x.id, sf)
                if task.owner not in (d, x.partner):
                    raise bad(f"tasks[{x.id}].owner", f"is {task.owner} but DP indices {d} and "
                                                      f"{x.partner} share task {x.id} ({sf})")
                if task.host is not None or task.micro_group is not None:
                    raise bad(f"tasks[{x.id}].host", f"is {task.host} but task {x.id} is shared "
                                                     f"by two TP groups ({sf}), not hosted")
                continue
            if x.id in seen:
                raise bad(f"{sf}.id", f"task {x.id} is scheduled twice (also {seen[x.id]})")
            seen[x.id] = sf
            if task.owner != d:
                raise bad(f"tasks[{x.id}].owner", f"is {task.owner} but DP index {d}'s TP group "
                                                  f"shares task {x.id} ({sf})")
            if task.host is not None or task.micro_group is not None:
                raise bad(f"tasks[{x.id}].host", f"is {task.host} but task {x.id} is shared by "
                                                 f"its TP group ({sf}), not hosted")
    for i, t in enumerate(tasks):
        if t.host is not None and i not in seen:
            raise bad(f"tasks[{i}].host", f"is {t.host} but task {i} is in no micro-group of the "
                                          f"TP section")
    _check_shard_cover(plan, seen, bad)
    M = T.metrics
    for name in ("gpu_load", "all_to_all_bytes"):
        mat = getattr(M, name)
        if len(mat) != dp or any(len(row) != tp for row in mat):
            raise bad(f"tp.metrics.{name}", f"must be dp × tp = {dp} × {tp} (one entry per GPU)")
    if M.micro_groups != groups:
        raise bad("tp.metrics.micro_groups", f"is {M.micro_groups} but tp.indices hold {groups} "
                                             f"groups")
