"""The matrices DP pairs split (``dp_shared``) against the planner's sharing formulas: one part
of :func:`canzona.planner.plan.checks.check_plan`."""

from __future__ import annotations

from ..hardware import load_hardware
from ..sharing import block_pieces, piece_loads, shared_piece, tp_pair_piece
from .messages import label
from .tp_checks import piece_floor
from .schema import Plan

__all__ = ["check_pairs"]


def check_pairs(plan: Plan, bad) -> None:  # noqa: ANN001
    """The tasks split over two DP indices (``dp_shared``): each a whole matrix of a dense
    buffer (at tp > 1 a tall one TP splits along its rows, the cut a row of every shard), its
    cut row inside it, its two owners distinct and ascending (the first the task's owner).
    Muon (shared Newton–Schulz): no DP index in two pairs of one phase, per-piece FLOPs the
    shared kernel's, loads at least those FLOPs (the exchanges add time), state split by rows.
    Shampoo (blocks hosted apart): the cut on a block-row boundary, each piece's FLOPs and state
    the kernel's on its rows, loads in proportion to the FLOPs, phase 0, no split."""
    inp, tasks = plan.inputs, plan.tasks
    if not plan.dp_shared:
        return
    name, spec = inp.optimizer.name, inp.optimizer.spec
    tp = inp.tp
    if tp != 1 and not spec.gram_shared:
        raise bad("dp_shared", f"lists {len(plan.dp_shared)} tasks but at tp > 1 only an "
                               f"optimizer shared by Gram all-reduces (Muon) shares a matrix "
                               f"with a partner DP index's TP group (inputs.optimizer is "
                               f"{name})")
    if not spec.shareable:
        raise bad("dp_shared", f"lists tasks but {name} updates every matrix whole; only a "
                               f"shareable optimizer (Muon: shared Newton–Schulz, Shampoo: "
                               f"blocks) splits a matrix over DP indices")
    expert = {sl.name for buf in plan.buffers if buf.expert for b in buf.buckets
              for sl in b.slots}
    link = load_hardware("h100").intra_node  # the FLOPs depend on neither the link nor a rate
    floor = piece_floor(plan)
    seen: set[int] = set()
    partner_of: dict[int, tuple[int, int]] = {}
    phase: dict[tuple[int, int], int] = {}
    busy: dict[tuple[int, int], tuple[int, int]] = {}
    for k, x in enumerate(plan.dp_shared):
        xf = f"dp_shared[{k}]"
        if x.id >= len(tasks) or x.id in seen:
            raise bad(f"{xf}.id", f"is {x.id}: not a task id, or listed twice")
        seen.add(x.id)
        t = tasks[x.id]
        if t.optimizer != "matrix" or t.part is not None or len(t.shape) != 2 \
                or t.param in expert:
            raise bad(f"{xf}.id", f"task {x.id} ('{label(t)}') is not a whole dense matrix")
        rows, cols = t.shape
        if tp > 1:  # every TP shard cut at the row: a tall column-parallel matrix's shard
            lay = next((plan.tp.layouts[s.layout] for ix in plan.tp.indices for s in ix.shared
                        if s.id == x.id), None) if plan.tp is not None else None
            if rows < cols or rows % tp or t.host is not None or lay is None or lay.dim != 0:
                raise bad(f"{xf}.id", f"task {x.id} ('{label(t)}', {rows}×{cols}) is shared by "
                                      f"two TP groups, which needs a tall matrix split along "
                                      f"its rows (column-parallel), listed in the TP groups' "
                                      f"shared tasks and hosted by no micro-group")
            for d in x.owners:  # the runtime meets one partner per index, in task order
                other = partner_of.setdefault(d, tuple(x.owners))
                if other != tuple(x.owners):
                    raise bad(f"{xf}.owners", f"put DP index {d} in the pairs {list(other)} and "
                                              f"{list(x.owners)}: at tp > 1 an index shares "
                                              f"with one partner only")
            rows //= tp
        block = inp.optimizer.max_preconditioner_dim
        if not 0 < x.row < rows or (spec.block_hosted and x.row % block):
            where = f" on a block-row boundary (a multiple of {block})" if spec.block_hosted \
                else ""
            raise bad(f"{xf}.row", f"is {x.row} but task {x.id} has rows 0 … {rows}; the cut "
                                   f"must be inside them{where}")
        a, b = x.owners
        if not 0 <= a < b < inp.dp or t.owner != a:
            raise bad(f"{xf}.owners", f"are {list(x.owners)} but must be two DP indices in "
                                      f"[0, {inp.dp}), ascending, the first the task's owner "
                                      f"({t.owner})")
        if spec.block_hosted:
            flops, states = block_pieces(inp.optimizer, rows, cols, x.row)
            loads = piece_loads(t.cost, t.flops, flops)
            for field, got, want in (("flops", x.flops, flops), ("state_bytes", x.state_bytes,
                                                                   states),
                                     ("loads", x.loads, loads)):
                if tuple(got) != tuple(want):
                    raise bad(f"{xf}.{field}", f"are {list(got)} but the Shampoo kernel on rows "
                                               f"[0, {x.row}) and [{x.row}, {rows}) of task "
                                               f"{x.id} gives {list(want)}")
            if x.phase or x.split_poly:
                raise bad(f"{xf}.phase", "Shampoo's pieces exchange nothing: phase 0, "
                                         "split_poly false")
            continue
        if phase.setdefault((a, b), x.phase) != x.phase:
            raise bad(f"{xf}.phase", f"is {x.phase} but pair {[a, b]} runs in phase "
                                     f"{phase[(a, b)]}")
        for d in (a, b):
            other = busy.setdefault((d, x.phase), (a, b))
            if other != (a, b):
                raise bad(f"{xf}.phase", f"puts DP index {d} in pairs {list(other)} and "
                                         f"{[a, b]} in phase {x.phase}: they would wait for "
                                         f"each other")
        if tp > 1:
            o = tp_pair_piece(tp, x.split_poly, rows * tp, cols, inp.optimizer.ns_steps, 2, link,
                              link, rate=1.0)
        else:
            o = shared_piece("dp", 2, x.split_poly, max(rows, cols), min(rows, cols),
                             inp.optimizer.ns_steps, 2, link, rate=1.0)
        if tuple(x.flops) != (o.piece_flops, o.piece_flops):
            raise bad(f"{xf}.flops", f"are {list(x.flops)} but shared Newton–Schulz of task "
                                     f"{x.id} over {o.k} ranks is {o.piece_flops} per piece")
        want = floor(t.cost, t.flops, o.piece_flops)
        if min(x.loads) < want - 1:
            raise bad(f"{xf}.loads", f"are {list(x.loads)} but a piece of task {x.id} costs at "
                                     f"least {round(want)}")
        first = t.state_bytes * x.row // rows
        if tuple(x.state_bytes) != (first, t.state_bytes - first):
            raise bad(f"{xf}.state_bytes", f"are {list(x.state_bytes)} but the momentum rows of "
                                           f"the two pieces hold {[first, t.state_bytes - first]}")


