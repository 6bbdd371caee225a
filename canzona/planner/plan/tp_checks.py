"""The TP section against its tasks and the planner's formulas: micro-groups, the tasks TP groups
share, the per-GPU metrics; one part of :func:`canzona.planner.plan.checks.check_plan`."""

from __future__ import annotations

import math

from .. import optimizers
from ..cost import DTYPE_BYTES, RooflineCost
from ..hardware import load_hardware
from ..options import HARDWARE_COSTS
from ..shards import Segment, ShardMap
from ..sharing import (profile_rate, shard_blocks_aligned, shared_piece, tp_pair_piece,
                       tp_sub_piece)
from .inverse import recorded_hardware
from .messages import label, matches
from .schema import Plan, sub_round_problem

__all__ = ["check_tp"]


def check_tp(plan: Plan, slots: dict, bad) -> None:  # noqa: ANN001
    """Micro-groups against their tasks and shard layouts; the per-GPU metrics."""
    inp, tasks, T = plan.inputs, plan.tasks, plan.tp
    assert T is not None
    dp, tp = inp.dp, inp.tp
    nbytes = DTYPE_BYTES[T.comm_dtype]
    sent = []  # per layout: elements each TP rank contributes to the gather
    full_numel, local_numel = [], []
    for L in T.layouts:
        full_numel.append(math.prod(L.full_shape))
        local_numel.append(math.prod(L.local_shape))
        row = [0] * tp
        if L.dim is not None:
            other = full_numel[-1] // L.full_shape[L.dim]
            for rank, _, _, length in L.segments:
                row[rank] += length * other
        sent.append(row)
    a2a = [[0] * tp for _ in range(dp)]
    peak_all = 0
    oversized: list[str] = []
    grid_sum = [[0] * tp for _ in range(dp)]
    for d, ix in enumerate(T.indices):
        for gi, g in enumerate(ix.groups):
            gf = f"tp.indices[{d}].groups[{gi}]"
            load = [0] * tp
            mem = [0] * tp
            count: dict[tuple[int, int], int] = {}
            for k, gt in enumerate(g.tasks):
                t = tasks[gt.id]
                li = gt.layout
                L = T.layouts[li]
                if L.dim is None or L.full_shape != t.shape:
                    raise bad(f"{gf}.tasks[{k}].layout",
                              f"tp.layouts[{li}] has full shape {list(L.full_shape)} (dim {L.dim}) "
                              f"but task {gt.id} ('{label(t)}') is a TP-split {list(t.shape)} "
                              f"matrix")
                if local_numel[li] != slots[t.param][2]:
                    raise bad(f"{gf}.tasks[{k}].layout",
                              f"tp.layouts[{li}] has local shape {list(L.local_shape)} but the "
                              f"slot of '{t.param}' holds {slots[t.param][2]} elements")
                if gt.load != t.cost:
                    raise bad(f"{gf}.tasks[{k}].load", f"is {gt.load} but task {gt.id} costs "
                                                       f"{t.cost}")
                gb = full_numel[li] * nbytes
                if gt.gathered_bytes != gb:
                    raise bad(f"{gf}.tasks[{k}].gathered_bytes",
                              f"is {gt.gathered_bytes} but task {gt.id}'s full matrix is {gb} "
                              f"bytes in {T.comm_dtype}")
                h = gt.host
                load[h] += gt.load
                mem[h] += gb
                count[h, li] = count.get((h, li), 0) + 1
            send = [[0] * tp for _ in range(tp)]
            for (h, li), c in count.items():
                row = sent[li]
                for r in range(tp):
                    send[r][h] += c * row[r]
            if list(g.rank_load) != load:
                raise bad(f"{gf}.rank_load", f"is {list(g.rank_load)} but its tasks' loads per "
                                             f"host rank are {load}")
            recv = [list(col) for col in zip(*send)]
            for name, exp in (("gather_send", send), ("gather_recv", recv),
                              ("scatter_send", recv), ("scatter_recv", send)):
                got = [list(r) for r in getattr(g, name)]
                if got != exp:
                    raise bad(f"{gf}.{name}", f"is {got} but the group's tasks and shard layouts "
                                              f"give {exp}")
            if g.peak_gathered_bytes != max(mem):
                raise bad(f"{gf}.peak_gathered_bytes", f"is {g.peak_gathered_bytes} but the "
                                                       f"largest host holds {max(mem)} bytes")
            if g.oversized:
                if len(g.tasks) != 1 or max(mem) <= T.cmax_bytes:
                    raise bad(f"{gf}.oversized", f"is true but only a single task larger than "
                                                 f"C_max = {T.cmax_bytes} bytes is oversized")
                oversized.extend(label(tasks[gt.id]) for gt in g.tasks)
            elif max(mem) > T.cmax_bytes:
                raise bad(f"{gf}.tasks", f"a host rank gathers {max(mem)} bytes, over C_max = "
                                         f"{T.cmax_bytes} (tp.cmax_bytes)")
            peak_all = max(peak_all, max(mem))
            for t in range(tp):
                off = sum(send[t][h] + recv[t][h] for h in range(tp) if h != t)
                a2a[d][t] += 2 * off * nbytes
                grid_sum[d][t] += load[t]
    pieces = _check_shared(plan, slots, local_numel, full_numel, bad)
    M = T.metrics
    for d in range(dp):
        for t in range(tp):
            exp = T.indices[d].local_load[t] + grid_sum[d][t]
            if abs(M.gpu_load[d][t] - exp) > 1:  # local_load and gpu_load are rounded separately
                raise bad(f"tp.metrics.gpu_load[{d}][{t}]",
                          f"is {M.gpu_load[d][t]} but local_load + hosted loads of DP index {d}, "
                          f"TP rank {t} give {exp}")
    flat = [x for r in M.gpu_load for x in r]
    mx, mean = max(flat), sum(flat) / len(flat)
    largest = max((pieces.get(t.id, t.cost) for t in tasks if t.optimizer == "matrix"), default=0)
    lb = max(math.ceil(sum(flat) / (dp * tp)), math.ceil(largest))
    checks = (
        ("max_gpu_load", M.max_gpu_load, mx, "the largest gpu_load"),
        ("mean_gpu_load", M.mean_gpu_load, round(mean, 3), "the mean gpu_load"),
        ("max_over_mean", M.max_over_mean, round(mx / mean, 6) if mean else 1.0,
         "max/mean of gpu_load"),
        ("lb_gpu", M.lb_gpu, lb, "max(⌈Σ gpu_load / (dp·tp)⌉, largest matrix task or shared "
                                 "piece)"),
        ("gap_to_lb_gpu", M.gap_to_lb_gpu, round(mx / lb - 1, 6) if lb else 0.0,
         "max_gpu_load / lb_gpu - 1"),
        ("peak_gathered_bytes", M.peak_gathered_bytes, peak_all,
         "the largest group peak (oversized groups included)"),
    )
    for name, got, exp, what in checks:
        if not matches(got, exp):
            raise bad(f"tp.metrics.{name}", f"is {got} but {what} is {exp}")
    if tuple(M.oversized_tasks) != tuple(oversized):
        raise bad("tp.metrics.oversized_tasks", f"lists {len(M.oversized_tasks)} tasks but the "
                                                f"oversized groups hold {len(oversized)}")
    got_a2a = [list(r) for r in M.all_to_all_bytes]
    if got_a2a != a2a:
        d, t = next((d, t) for d in range(dp) for t in range(tp) if got_a2a[d][t] != a2a[d][t])
        raise bad(f"tp.metrics.all_to_all_bytes[{d}][{t}]",
                  f"is {got_a2a[d][t]} but the micro-groups' split sizes give {a2a[d][t]}")


def _check_shard_blocks(plan: Plan, x, L, xf: str, bad) -> float:  # noqa: ANN001
    """A Shampoo matrix its TP group preconditions shard by shard: every shard whole blocks of
    the matrix (``sharing.shard_blocks_aligned``), its per-rank load at least its shard's
    FLOPs. Returns that load."""
    inp, t = plan.inputs, plan.tasks[x.id]
    st = inp.optimizer
    smap = ShardMap(L.dim, inp.tp, tuple(L.local_shape), tuple(L.full_shape),
                    tuple(Segment(*seg) for seg in L.segments))
    if x.split_poly or not shard_blocks_aligned(smap, st.max_preconditioner_dim):
        raise bad(f"{xf}.layout", f"Shampoo task {x.id} ('{label(t)}') is preconditioned shard "
                                  f"by shard, but its shards in tp.layouts[{x.layout}] are not "
                                  f"whole blocks of {st.max_preconditioner_dim} (or split_poly is "
                                  f"set): each rank's blocks would differ from the matrix's")
    piece = optimizers.get(st.name).flops(*L.local_shape, st)
    want = piece * t.cost / t.flops if t.flops else 0.0
    if x.load < want - 1:
        raise bad(f"{xf}.load", f"is {x.load} but Shampoo on task {x.id}'s shard costs "
                                f"{round(want)} per rank")
    return x.load


def piece_floor(plan: Plan):  # noqa: ANN201
    """``floor(cost, flops, piece_flops)``: the least load a shared piece of ``piece_flops``
    may record, of a task of load ``cost`` and ``flops``: with loads in seconds, its FLOPs at
    the recorded profile's rate (0 for a profile file's, which cannot be read here); otherwise
    at its task's load per FLOP. The profile is read once per plan."""
    if plan.inputs.cost_model in HARDWARE_COSTS:
        hw = recorded_hardware(plan)
        per_flop = 1 / profile_rate(hw) / RooflineCost.seconds_per_load if hw else 0.0
        return lambda cost, flops, piece_flops: piece_flops * per_flop
    return lambda cost, flops, piece_flops: piece_flops * cost / flops if flops else 0.0


def _sub_piece(x, t, tp: int, steps: int, link):  # noqa: ANN001, ANN202
    """The piece of a task of a round of TP sub-groups (its round's structure and its shards'
    orientation checked before): a sub-group member's FLOPs per rank."""
    rows, cols = t.shape
    return tp_sub_piece(tp, x.sub.k, x.split_poly, max(rows, cols), min(rows, cols), steps, 2,
                        link, rate=1.0)


def _check_shared(plan: Plan, slots: dict, local_numel: list[int], full_numel: list[int],
                  bad) -> dict[int, float]:  # noqa: ANN001
    """The tasks TP groups share (``tp.indices[d].shared``): each a Muon matrix TP splits along
    its long dimension, its layout its own, its per-rank load the shared Newton–Schulz FLOPs in
    the plan's cost units — or a Shampoo matrix whose shards are whole blocks
    (:func:`_check_shard_blocks`). Returns task id → that load."""
    inp, tasks, T = plan.inputs, plan.tasks, plan.tp
    assert T is not None
    out: dict[int, float] = {}
    pairs = {x.id: x for x in plan.dp_shared}
    halves: dict[int, int] = {}
    wrong = sub_round_problem(plan)
    if wrong is not None:
        raise bad(*wrong)
    link = load_hardware("h100").intra_node  # the FLOPs depend on neither the link nor a rate
    floor = piece_floor(plan)
    for d, ix in enumerate(T.indices):
        if ix.shared_load > min(ix.local_load, default=0) or (ix.shared_load and not ix.shared):
            raise bad(f"tp.indices[{d}].shared_load", f"is {ix.shared_load} but local_load is "
                                                      f"{list(ix.local_load)} with "
                                                      f"{len(ix.shared)} shared tasks (the shared "
                                                      f"phase is part of local_load)")
        for k, x in enumerate(ix.shared):
            xf = f"tp.indices[{d}].shared[{k}]"
            t = tasks[x.id]
            L = T.layouts[x.layout]
            if not inp.optimizer.spec.shareable:
                raise bad(f"{xf}.id", f"shares task {x.id} but {inp.optimizer.name} updates "
                                      f"every matrix whole; only a shareable optimizer (Muon: "
                                      f"shared Newton–Schulz, Shampoo: blocks shard by shard) "
                                      f"shares over TP")
            if L.dim is None or L.full_shape != t.shape or len(t.shape) != 2:
                raise bad(f"{xf}.layout", f"tp.layouts[{x.layout}] has full shape "
                                          f"{list(L.full_shape)} (dim {L.dim}) but task {x.id} "
                                          f"('{label(t)}') is a TP-split {list(t.shape)} matrix")
            if slots[t.param][0] != inp.tp:
                raise bad(f"{xf}.id", f"shares task {x.id} ('{label(t)}') split over "
                                      f"{slots[t.param][0]} TP ranks, but a TP group has "
                                      f"{inp.tp} (expert TP is not shared)")
            if local_numel[x.layout] != slots[t.param][2] or t.part is not None:
                raise bad(f"{xf}.layout", f"task {x.id} ('{label(t)}') must be a whole TP-split "
                                          f"parameter whose shard is tp.layouts[{x.layout}]")
            if inp.optimizer.spec.block_hosted:  # (no rounds: sub_round_problem)
                out[x.id] = _check_shard_blocks(plan, x, L, xf, bad)
                continue
            rows, cols = t.shape
            if rows != cols and L.dim != (0 if rows > cols else 1):
                raise bad(f"{xf}.layout", f"task {x.id} ('{label(t)}', {rows}×{cols}) is split "
                                          f"along its short dimension: its shards are not row "
                                          f"blocks of the matrix, which sharing needs")
            if x.sub is not None:  # a round of TP sub-groups
                o = _sub_piece(x, t, inp.tp, inp.optimizer.ns_steps, link)
                s = inp.tp // x.sub.k
                want = floor(t.cost, t.flops, o.piece_flops) / s
                if x.load < want - 1:
                    raise bad(f"{xf}.load", f"is {x.load} but a round of {s} matrices like task "
                                            f"{x.id} over TP sub-groups of {x.sub.k} costs at "
                                            f"least {round(want * s)} per rank ({round(want)} "
                                            f"per matrix)")
                head = ix.shared[k - x.sub.slot].id  # the round's piece: its loads together
                out[head] = out.get(head, 0) + x.load
                out.setdefault(x.id, 0)
                continue
            if x.partner is not None:  # its half, with the partner's TP group
                if L.dim != 0:
                    raise bad(f"{xf}.layout", f"task {x.id} ('{label(t)}') is shared by two TP "
                                              f"groups but split along dim {L.dim}: the cut "
                                              f"between them must be a row of its shards "
                                              f"(a column-parallel weight)")
                pair = pairs.get(x.id)
                if pair is None or sorted((d, x.partner)) != list(pair.owners):
                    raise bad(f"{xf}.partner", f"is {x.partner} but dp_shared "
                                               f"{'lists no pair for' if pair is None else 'puts'}"
                                               f" task {x.id}"
                                               + ("" if pair is None else
                                                  f" on DP indices {list(pair.owners)}"))
                if x.split_poly != pair.split_poly:
                    raise bad(f"{xf}.split_poly", f"is {x.split_poly} but dp_shared says "
                                                  f"{pair.split_poly} for task {x.id}")
                halves[x.id] = halves.get(x.id, 0) + 1
                o = tp_pair_piece(inp.tp, x.split_poly, rows, cols, inp.optimizer.ns_steps, 2,
                                  link, link, rate=1.0)
            else:
                if x.id in pairs:
                    raise bad(f"{xf}.partner", f"is unset but dp_shared shares task {x.id} "
                                               f"with a partner DP index")
                o = shared_piece("tp", inp.tp, x.split_poly, max(rows, cols), min(rows, cols),
                                 inp.optimizer.ns_steps, 2, link, rate=1.0)
            want = floor(t.cost, t.flops, o.piece_flops)
            if x.load < want - 1:  # its FLOPs, plus its collectives' time on the plan's profile
                raise bad(f"{xf}.load", f"is {x.load} but shared Newton–Schulz of task {x.id} "
                                        f"over {o.k} ranks costs at least {round(want)} per "
                                        f"rank")
            out[x.id] = max(out.get(x.id, 0), x.load)
    for k, x in enumerate(plan.dp_shared):
        if halves.get(x.id, 0) != 2:
            raise bad(f"dp_shared[{k}].id", f"task {x.id} is shared by DP indices "
                                            f"{list(x.owners)} but the TP schedule lists "
                                            f"{halves.get(x.id, 0)} of its halves (two needed, "
                                            f"each with its partner)")
    return out
