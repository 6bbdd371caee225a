"""A plan against the planner's own formulas: what ``canzona.load_plan`` checks after parsing.

:func:`canzona.planner.plan_load.parse_plan` checks the schema and the structure (sizes against cuts,
ids, owners and hosts in range, the TP section's shape). This module adds every relation the
planner computes, recomputed from the plan itself with the planner's code:

* ``total_params`` = Σ over tasks of the numel of their logical (global, unsharded) shape — the
  whole model's parameter count, whatever tp; the buffers' slots hold TP-local shards, so each
  slot spans the parameter's numel (replicated), numel / t (TP-split over t = tp, or etp for
  expert buffers) or its padded-vocabulary shard (``layout.padded_vocab``);
* each task's ``flops`` and ``state_bytes`` from ``cost.task_cost`` (``formulas``) at the plan's
  optimizer settings, ``cost`` from the cost model (``flops``: = flops, ``numel``: = numel) and
  ``tp_comm_bytes`` (2·(numel − numel // t)·bytes of the comm dtype for TP-split matrices, else 0);
* owners and the per-DP-index metrics from the cuts by ``planning.evaluate``: a matrix belongs to
  the rank whose slice holds its first element (``zero1`` plans charge split matrices by
  fragments), ``dp_load``/``dp_flops``/``dp_state_bytes`` at index d = Σ over matrix tasks owned
  by d + Σ over AdamW parameters of their share of the elements in d's slices (cumulative integer
  rounding, so the shares of a parameter add up exactly), ``dp_reduce_scatter_bytes`` = Σ slice
  elements · grad bytes; expert buckets' rank r is DP index r·ep + ep_rank; and the bounds and
  ratios of ``planning.build_plan``;
* under TP, every micro-group against its tasks and shard layouts (loads, gathered bytes, the
  all-to-all split sizes, C_max) and the per-GPU metrics of ``tp.tp_plan``.

Every failure is one :class:`~canzona.planner.errors.PlanFileError` line naming the file, the field
and the fix. (A little over 400 lines: one check per relation above, each with its own message.)
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

from . import optimizers
from . import plan_load as _schema
from .cost import DTYPE_BYTES, OptimizerSettings, Task, TaskCost, task_cost
from .errors import PlanFileError
from .hardware import load_hardware
from .layout import ParallelSizes, padded_vocab
from .plan import Plan, gc_paused
from .plan_load import check_structure, inconsistency
from .planning import (GRAD_BYTES, BucketProblem, DPProblem, Item, evaluate, owner_of, pair_items,
                       pair_owners)

__all__ = ["check_plan", "load_plan", "parse_plan"]


def load_plan(path: str | Path) -> Plan:
    """Read a plan file and check everything: schema, structure, and the planner's formulas.

    This is ``canzona.load_plan``.

    Raises:
        PlanFileError: one line naming the file, the field and the fix.
    """
    plan = _schema.load_plan(path)
    check_plan(plan, str(Path(path)), structure=False)
    return plan


def parse_plan(text: str, source: str = "<plan>") -> Plan:
    """:func:`canzona.planner.plan_load.parse_plan` plus :func:`check_plan`'s formula checks."""
    plan = _schema.parse_plan(text, source)
    check_plan(plan, source, structure=False)
    return plan


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _close(a: float, b: float) -> bool:
    """Equal: integers exactly; floats (recomputed as the planner does, read back from JSON)
    to the last bits."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def _name(t) -> str:  # noqa: ANN001
    return t.param if t.part is None else f"{t.param}#{t.part}"


def check_plan(plan: Plan, source: str = "<plan>", *, structure: bool = True) -> None:
    """Check that ``plan`` is what the planner computes from its own contents.

    Args:
        structure: also run :func:`canzona.planner.plan_load.check_structure` (already done when the
            plan came from ``parse_plan``/``load_plan``; these checks rely on it).

    Raises:
        PlanFileError: one line naming ``source``, the field and the fix.
    """
    with gc_paused():  # no cycles are made here; the collector would walk the whole plan
        if structure:
            check_structure(plan, source)
        _check(plan, source)


def _check(plan: Plan, source: str) -> None:
    def bad(field: str, problem: str) -> PlanFileError:
        return inconsistency(source, field, problem)

    inp = plan.inputs
    dp, tp, ep = inp.dp, inp.tp, inp.ep
    tasks = plan.tasks
    if inp.grad_dtype not in GRAD_BYTES:
        raise bad("inputs.grad_dtype", f"is {inp.grad_dtype!r}; choose one of: "
                                       f"{', '.join(GRAD_BYTES)}")
    if inp.comm_dtype not in DTYPE_BYTES:
        raise bad("inputs.comm_dtype", f"is {inp.comm_dtype!r}; choose one of: "
                                       f"{', '.join(DTYPE_BYTES)}")

    # total_params: the global model count, from the tasks' logical shapes.
    numel: list[int] = []
    tasks_of: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        n = 1
        for x in t.shape:
            n *= x
        numel.append(n)
        ids = tasks_of.get(t.param)
        if ids is None:
            tasks_of[t.param] = [i]
        else:
            ids.append(i)
    total = sum(numel)
    if plan.total_params != total:
        raise bad("total_params", f"is {plan.total_params} but the tasks' logical shapes add up "
                                  f"to {total} parameters")

    # Slots (TP-local shards) against their tasks: which parameters TP splits; the items of the
    # DP problem the cuts were chosen for.
    pairs = {x.id: x for x in plan.dp_shared}
    _check_pairs(plan, bad)
    slots: dict[str, tuple[int, str, int, tuple[int, int, int]]] = {}  # t, split?, numel, where
    buckets = []
    cuts = {}
    for bi, buf in enumerate(plan.buffers):
        t_size = inp.etp if buf.expert else tp
        for j, b in enumerate(buf.buckets):
            items = []
            for k, sl in enumerate(b.slots):
                ids = tasks_of[sl.name]
                t0 = tasks[ids[0]]
                if len(ids) == 1:
                    n, load, flops, state = numel[ids[0]], t0.cost, t0.flops, t0.state_bytes
                else:
                    n = sum(numel[i] for i in ids)
                    load = sum(tasks[i].cost for i in ids)
                    flops = sum(tasks[i].flops for i in ids)
                    state = sum(tasks[i].state_bytes for i in ids)
                local = sl.end - sl.start
                shape = t0.shape
                whole = local == n
                sharded = t_size > 1 and local * t_size == n
                vocab = (len(ids) == 1 and len(shape) >= 1 and not whole and not sharded
                         and local == padded_vocab(shape[0], t_size) // t_size * (n // shape[0]))
                if not (whole or sharded or vocab):
                    per = f" or {n / t_size:g} per TP rank (t = {t_size})" if t_size > 1 else ""
                    raise bad(f"buffers[{bi}].buckets[{j}].slots[{k}]",
                              f"'{sl.name}' spans {local} elements but its tasks hold {n}{per}")
                if t_size == 1:
                    kind = "no"
                elif whole:
                    # A padded-vocabulary shard can be as large as the unpadded whole.
                    kind = ("either" if len(ids) == 1 and len(shape) >= 1
                            and padded_vocab(shape[0], t_size) == t_size * shape[0] else "no")
                else:
                    kind = "yes"
                slots[sl.name] = (t_size, kind, local, (bi, j, k))
                item = Item(len(items), sl.start, sl.end, load, flops, state,
                            t0.optimizer == "matrix", tuple(ids))
                x = pairs.get(ids[0]) if len(ids) == 1 else None
                if x is None:
                    items.append(item)
                else:  # split over two DP indices: its two pieces (checked in _check_pairs)
                    items.extend(pair_items(item, t0.shape, x.row, x.loads, x.flops,
                                            x.state_bytes, len(items)))
            buckets.append(BucketProblem(bi, b.index, b.start, b.end, buf.dp_size, tuple(items)))
            cuts[(bi, b.index)] = b.cuts

    # Task costs from the optimizer's formulas.
    settings = inp.optimizer
    cache: dict[tuple, TaskCost] = {}

    def cost_of(t, s: OptimizerSettings, t_size: int) -> TaskCost:  # noqa: ANN001
        key = (s.name, t.optimizer, t.shape, t_size) if s is settings else None
        c = cache.get(key) if key else None
        if c is None:
            # tp_split=True gives the comm bytes the task has if TP splits it (0 when t = 1).
            task = Task(t.id, t.param, t.part, t.shape, t.optimizer, True, expert=0)
            c = task_cost(task, s, ParallelSizes(dp=dp, tp=tp, ep=ep, etp=t_size),
                          inp.comm_dtype)
            if key:
                cache[key] = c
        return c

    scheduled: set[int] = set()
    if plan.tp is not None:
        scheduled = {gt.id for ix in plan.tp.indices for g in ix.groups for gt in g.tasks}
        scheduled |= {x.id for ix in plan.tp.indices for x in ix.shared}  # shared by its TP group
    by_flops, by_numel = inp.cost_model == "flops", inp.cost_model == "numel"
    for i, t in enumerate(tasks):
        t_size, kind, _, _ = slots[t.param]
        c = cost_of(t, settings, t_size)
        if t.flops != c.flops:
            raise bad(f"tasks[{i}].flops", _cost_mismatch(t, "flops", c.flops, settings,
                                                          cost_of, t_size))
        if t.state_bytes != c.state_bytes:
            raise bad(f"tasks[{i}].state_bytes", _cost_mismatch(t, "state_bytes", c.state_bytes,
                                                                settings, cost_of, t_size))
        if by_flops and t.cost != t.flops:
            raise bad(f"tasks[{i}].cost", f"is {t.cost} but the cost model is 'flops' "
                                          f"(inputs.cost_model), so it must equal the task's "
                                          f"flops {t.flops}")
        if by_numel and t.cost != numel[i]:
            raise bad(f"tasks[{i}].cost", f"is {t.cost} but the cost model is 'numel' "
                                          f"(inputs.cost_model), so it must equal the task's "
                                          f"numel {numel[i]}")
        matrix = t.optimizer == "matrix"
        if plan.tp is not None and matrix:
            hosted = i in scheduled
            split = kind == "yes" or (kind == "either" and hosted)
            if split != hosted:
                why = ("TP splits it (its slot holds one shard)" if split
                       else "TP replicates it (its slot holds the whole matrix)")
                raise bad(f"tasks[{i}].host", f"is {t.host} but task {i} ('{_name(t)}'): {why}, "
                                              f"so it {'needs' if split else 'takes no'} host "
                                              f"rank in a micro-group"
                                              f"{' (or its TP group shares it)' if split else ''}")
        else:
            split = kind == "yes" or (kind == "either" and t.tp_comm_bytes != 0)
        exp = c.tp_comm_bytes if split and matrix else 0
        if t.tp_comm_bytes != exp:
            how = f"split over {t_size} TP ranks" if split else "not TP-split"
            raise bad(f"tasks[{i}].tp_comm_bytes",
                      f"is {t.tp_comm_bytes} but task {i} ('{_name(t)}') moves {exp} bytes in the "
                      f"TP gather/scatter ({how}, comm dtype {inp.comm_dtype})")

    _check_loads(plan, buckets, cuts, slots, bad)
    if plan.tp is not None:
        _check_tp(plan, slots, bad)


def _cost_mismatch(t, field: str, exp: int, settings: OptimizerSettings,  # noqa: ANN001
                   cost_of, t_size: int) -> str:  # noqa: ANN001
    shape = "×".join(str(x) for x in t.shape)
    msg = (f"is {getattr(t, field)} but optimizer '{settings.name}' with the plan's settings "
           f"(inputs.optimizer) gives {exp} for task {t.id} ('{_name(t)}', {shape}): the task "
           f"costs do not match optimizer '{settings.name}'")
    for alt in optimizers.names():
        if alt == settings.name:
            continue
        other = settings.model_copy(update={"name": alt})
        c = cost_of(t, other, t_size)
        if (c.flops, c.state_bytes) == (t.flops, t.state_bytes):
            msg += f" (they match '{alt}': was inputs.optimizer.name edited?)"
            break
    return msg


def _check_loads(plan: Plan, buckets: list[BucketProblem], cuts: dict, slots: dict,
                 bad) -> None:  # noqa: ANN001
    """Owners and metrics from the cuts, by the planner's own ``evaluate``."""
    inp, tasks, m = plan.inputs, plan.tasks, plan.metrics
    dp = inp.dp
    loads = tuple(t.cost for t in tasks)
    problem = DPProblem(spec=None, sizes=ParallelSizes(dp=dp, tp=inp.tp, ep=inp.ep),  # type: ignore[arg-type]
                        settings=inp.optimizer, layout=SimpleNamespace(buffers=plan.buffers),  # type: ignore[arg-type]
                        tasks=(), costs=(), loads=loads, cost_model=inp.cost_model,
                        buckets=tuple(buckets),
                        total=sum(it.load for b in buckets for it in b.items),
                        pairs={x.id: x for x in plan.dp_shared})
    fragments = inp.solver.strategy == "zero1"
    ev = evaluate(problem, cuts, split_mode="fragments" if fragments else "owner")
    for i, t in enumerate(tasks):
        if t.optimizer != "matrix":
            continue
        d = ev.owners[i]
        if t.owner != d:
            bi, j, k = slots[t.param][3]
            raise bad(f"tasks[{i}].owner",
                      f"is {t.owner} but the cuts of buffers[{bi}].buckets[{j}] put '{_name(t)}' "
                      f"(slot {k}) on DP index {d}: a matrix belongs to the rank whose slice holds "
                      f"its first element")
    owners = pair_owners(problem, cuts)
    whole_on = {it.tasks[0]: (owner_of(cuts[(b.buffer, b.bucket)], it.start),
                              owner_of(cuts[(b.buffer, b.bucket)], it.end - 1))
                for b in buckets for it in b.items if len(it.tasks) == 1
                and it.tasks[0] in problem.pairs and it.end > it.start
                and owner_of(cuts[(b.buffer, b.bucket)], it.start)
                != owner_of(cuts[(b.buffer, b.bucket)], it.end - 1)}
    for k, x in enumerate(plan.dp_shared):
        got = owners.get(x.id)
        if got != tuple(x.owners):
            raise bad(f"dp_shared[{k}].owners", f"are {list(x.owners)} but the cuts put the "
                                               f"pieces of task {x.id} on DP indices "
                                               f"{list(got or ())}")
        if x.id in whole_on:
            raise bad(f"dp_shared[{k}].row", f"is {x.row} but a cut falls inside a piece of "
                                             f"task {x.id} (DP indices {list(whole_on[x.id])}): "
                                             f"the cut between its pieces must be at that row")
    what = {
        "dp_load": "the cost of the tasks it owns plus its share of the AdamW elements",
        "dp_flops": "the flops of the tasks it owns plus its share of the AdamW elements",
        "dp_state_bytes": "the state bytes of the tasks it owns plus its share of the AdamW "
                          "elements",
        "dp_reduce_scatter_bytes": f"its slices' elements × {GRAD_BYTES[inp.grad_dtype]} bytes "
                                   f"({inp.grad_dtype} gradients)",
    }
    for name, exp in (("dp_load", ev.load), ("dp_flops", ev.flops),
                      ("dp_state_bytes", ev.state_bytes), ("dp_reduce_scatter_bytes", ev.rs_bytes)):
        got = getattr(m, name)
        for d in range(dp):
            if got[d] != exp[d]:
                raise bad(f"metrics.{name}[{d}]", f"is {got[d]} but for DP index {d} the cuts give "
                                                  f"{exp[d]}: {what[name]}")
    if m.split_matrices != ev.split_matrices:
        raise bad("metrics.split_matrices", f"is {m.split_matrices} but the cuts split "
                                            f"{ev.split_matrices} matrices")
    lb = problem.lower_bound()
    if m.lower_bound != lb:
        raise bad("metrics.lower_bound", f"is {m.lower_bound} but max(⌈total load / dp⌉, largest "
                                         f"matrix) = {lb}")
    if m.certified_bound < lb:
        raise bad("metrics.certified_bound", f"is {m.certified_bound}, below the lower bound {lb}")
    mean = sum(ev.load) / len(ev.load)
    exp_ratio = round(max(ev.load) / mean, 6) if mean else 1.0
    if not _close(m.max_over_mean, exp_ratio):
        raise bad("metrics.max_over_mean", f"is {m.max_over_mean} but max/mean of dp_load is "
                                           f"{exp_ratio}")
    bound = m.certified_bound
    exp_gap = round(max(ev.load) / bound - 1, 6) if bound else 0.0
    if not _close(m.gap_to_bound, exp_gap):
        raise bad("metrics.gap_to_bound", f"is {m.gap_to_bound} but max(dp_load) / "
                                          f"certified_bound - 1 is {exp_gap}")


def _check_pairs(plan: Plan, bad) -> None:  # noqa: ANN001
    """The tasks split over two DP indices (``dp_shared``): each a whole matrix of a dense
    buffer (at tp > 1 a tall one TP splits along its rows, the cut a row of every shard), its
    cut row inside it, its two owners distinct and ascending (the first the task's owner). Muon (shared Newton–Schulz): no DP index in two pairs of one phase, per-piece
    FLOPs the shared kernel's, loads at least those FLOPs (the exchanges add time), state split
    by rows. Shampoo (blocks hosted apart): the cut on a block-row boundary, each piece's FLOPs
    and state the kernel's on its rows, loads in proportion to the FLOPs, phase 0, no split."""
    from .sharing import block_pieces, piece_loads, shared_piece, tp_pair_piece

    inp, tasks = plan.inputs, plan.tasks
    if not plan.dp_shared:
        return
    name = inp.optimizer.name
    tp = inp.tp
    if tp != 1 and name != "muon":
        raise bad("dp_shared", f"lists {len(plan.dp_shared)} tasks but at tp > 1 only Muon's "
                               f"TP groups share a matrix with a partner DP index (inputs."
                               f"optimizer is {name})")
    if name not in ("muon", "shampoo"):
        raise bad("dp_shared", f"lists tasks but only Muon (shared Newton–Schulz) and Shampoo "
                               f"(blocks) split a matrix over DP indices (inputs.optimizer is "
                               f"{name})")
    expert = {sl.name for buf in plan.buffers if buf.expert for b in buf.buckets
              for sl in b.slots}
    link = load_hardware("h100").intra_node  # the FLOPs depend on neither the link nor a rate
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
            raise bad(f"{xf}.id", f"task {x.id} ('{_name(t)}') is not a whole dense matrix")
        rows, cols = t.shape
        if tp > 1:  # every TP shard cut at the row: a tall column-parallel matrix's shard
            lay = next((plan.tp.layouts[s.layout] for ix in plan.tp.indices for s in ix.shared
                        if s.id == x.id), None) if plan.tp is not None else None
            if rows < cols or rows % tp or t.host is not None or lay is None or lay.dim != 0:
                raise bad(f"{xf}.id", f"task {x.id} ('{_name(t)}', {rows}×{cols}) is shared by "
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
        if not 0 < x.row < rows or (name == "shampoo" and x.row % block):
            where = f" on a block-row boundary (a multiple of {block})" if name == "shampoo" \
                else ""
            raise bad(f"{xf}.row", f"is {x.row} but task {x.id} has rows 0 … {rows}; the cut "
                                   f"must be inside them{where}")
        a, b = x.owners
        if not 0 <= a < b < inp.dp or t.owner != a:
            raise bad(f"{xf}.owners", f"are {list(x.owners)} but must be two DP indices in "
                                      f"[0, {inp.dp}), ascending, the first the task's owner "
                                      f"({t.owner})")
        if name == "shampoo":
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
        want = o.piece_flops * t.cost / t.flops if t.flops else 0.0
        if min(x.loads) < want - 1:
            raise bad(f"{xf}.loads", f"are {list(x.loads)} but a piece of task {x.id} costs at "
                                     f"least {round(want)}")
        first = t.state_bytes * x.row // rows
        if tuple(x.state_bytes) != (first, t.state_bytes - first):
            raise bad(f"{xf}.state_bytes", f"are {list(x.state_bytes)} but the momentum rows of "
                                           f"the two pieces hold {[first, t.state_bytes - first]}")


def _check_tp(plan: Plan, slots: dict, bad) -> None:  # noqa: ANN001
    """Micro-groups against their tasks and shard layouts; the per-GPU metrics."""
    inp, tasks, T = plan.inputs, plan.tasks, plan.tp
    assert T is not None
    dp, tp = inp.dp, inp.tp
    nbytes = DTYPE_BYTES[T.comm_dtype]
    sent = []  # per layout: elements each TP rank contributes to the gather
    full_numel, local_numel = [], []
    for L in T.layouts:
        full_numel.append(_numel(L.full_shape))
        local_numel.append(_numel(L.local_shape))
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
                              f"but task {gt.id} ('{_name(t)}') is a TP-split {list(t.shape)} "
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
                oversized.extend(_name(tasks[gt.id]) for gt in g.tasks)
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
        if not _close(got, exp):
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
    from . import optimizers
    from .shards import Segment, ShardMap
    from .sharing import shard_blocks_aligned

    inp, t = plan.inputs, plan.tasks[x.id]
    st = inp.optimizer
    smap = ShardMap(L.dim, inp.tp, tuple(L.local_shape), tuple(L.full_shape),
                    tuple(Segment(*seg) for seg in L.segments))
    if x.split_poly or not shard_blocks_aligned(smap, st.max_preconditioner_dim):
        raise bad(f"{xf}.layout", f"Shampoo task {x.id} ('{_name(t)}') is preconditioned shard "
                                  f"by shard, but its shards in tp.layouts[{x.layout}] are not "
                                  f"whole blocks of {st.max_preconditioner_dim} (or split_poly is "
                                  f"set): each rank's blocks would differ from the matrix's")
    piece = optimizers.get(st.name).flops(*L.local_shape, st)
    want = piece * t.cost / t.flops if t.flops else 0.0
    if x.load < want - 1:
        raise bad(f"{xf}.load", f"is {x.load} but Shampoo on task {x.id}'s shard costs "
                                f"{round(want)} per rank")
    return x.load


def _check_shared(plan: Plan, slots: dict, local_numel: list[int], full_numel: list[int],
                  bad) -> dict[int, float]:  # noqa: ANN001
    """The tasks TP groups share (``tp.indices[d].shared``): each a Muon matrix TP splits along
    its long dimension, its layout its own, its per-rank load the shared Newton–Schulz FLOPs in
    the plan's cost units — or a Shampoo matrix whose shards are whole blocks
    (:func:`_check_shard_blocks`). Returns task id → that load."""
    from .sharing import shared_piece, tp_pair_piece

    inp, tasks, T = plan.inputs, plan.tasks, plan.tp
    assert T is not None
    out: dict[int, float] = {}
    pairs = {x.id: x for x in plan.dp_shared}
    halves: dict[int, int] = {}
    link = load_hardware("h100").intra_node  # the FLOPs depend on neither the link nor a rate
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
            if inp.optimizer.name not in ("muon", "shampoo"):
                raise bad(f"{xf}.id", f"shares task {x.id} but only Muon (shared Newton–Schulz) "
                                      f"and Shampoo (blocks shard by shard) share over TP "
                                      f"(inputs.optimizer is {inp.optimizer.name})")
            if L.dim is None or L.full_shape != t.shape or len(t.shape) != 2:
                raise bad(f"{xf}.layout", f"tp.layouts[{x.layout}] has full shape "
                                          f"{list(L.full_shape)} (dim {L.dim}) but task {x.id} "
                                          f"('{_name(t)}') is a TP-split {list(t.shape)} matrix")
            if slots[t.param][0] != inp.tp:
                raise bad(f"{xf}.id", f"shares task {x.id} ('{_name(t)}') split over "
                                      f"{slots[t.param][0]} TP ranks, but a TP group has "
                                      f"{inp.tp} (expert TP is not shared)")
            if local_numel[x.layout] != slots[t.param][2] or t.part is not None:
                raise bad(f"{xf}.layout", f"task {x.id} ('{_name(t)}') must be a whole TP-split "
                                          f"parameter whose shard is tp.layouts[{x.layout}]")
            if inp.optimizer.name == "shampoo":
                out[x.id] = _check_shard_blocks(plan, x, L, xf, bad)
                continue
            rows, cols = t.shape
            if rows != cols and L.dim != (0 if rows > cols else 1):
                raise bad(f"{xf}.layout", f"task {x.id} ('{_name(t)}', {rows}×{cols}) is split "
                                          f"along its short dimension: its shards are not row "
                                          f"blocks of the matrix, which sharing needs")
            if x.partner is not None:  # its half, with the partner's TP group
                if L.dim != 0:
                    raise bad(f"{xf}.layout", f"task {x.id} ('{_name(t)}') is shared by two TP "
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
            want = o.piece_flops * t.cost / t.flops if t.flops else 0.0
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
