"""A plan against the planner's own formulas: what loading a plan checks after its schema and
structure (:mod:`canzona.planner.plan.load`).

:func:`~canzona.planner.plan.structure.check_structure` checks the fields against each other
(sizes against cuts, ids, owners and hosts in range, the TP section's shape); :func:`check_plan`
runs it, then every relation the planner computes, recomputed from the plan itself with the
planner's code:

* ``total_params`` = Σ over tasks of the numel of their logical (global, unsharded) shape — the
  whole model's parameter count, whatever tp; the buffers' slots hold TP-local shards, so each
  slot spans the parameter's numel (replicated), numel / t (TP-split over t = tp, or etp for
  expert buffers) or its padded-vocabulary shard (``layout.padded_vocab``);
* each task's ``flops`` and ``state_bytes`` from ``cost.task_cost`` (``formulas``) at the plan's
  optimizer settings, ``cost`` from the cost model (``flops``: = flops, ``numel``: = numel) and
  ``tp_comm_bytes`` (2·(numel − numel // t)·bytes of the comm dtype for TP-split matrices, else
  0);
* owners and the per-DP-index metrics from the cuts by ``planning.evaluate`` on the plan read back
  as its problem (:func:`canzona.planner.plan.inverse.read_problem`): a matrix belongs to
  the rank whose slice holds its first element (``zero1`` plans charge split matrices by
  fragments), ``dp_load``/``dp_flops``/``dp_state_bytes`` at index d = Σ over matrix tasks owned
  by d + Σ over AdamW parameters of their share of the elements in d's slices (cumulative integer
  rounding, so the shares of a parameter add up exactly), ``dp_reduce_scatter_bytes`` = Σ slice
  elements · grad bytes; expert buckets' rank r is DP index r·ep + ep_rank; and the bounds and
  ratios of ``plan.build.build_plan``;
* the matrices DP pairs split (``dp_shared``: :mod:`canzona.planner.plan.pair_checks`);
* under TP, every micro-group against its tasks and shard layouts (loads, gathered bytes, the
  all-to-all split sizes, C_max), the tasks TP groups share and the per-GPU metrics of
  ``plan.tp_section.tp_plan`` (:mod:`canzona.planner.plan.tp_checks`).

Every failure is one :class:`~canzona.planner.errors.PlanFileError` line naming the file, the
field and the fix.
"""

from __future__ import annotations

from .. import optimizers
from ..cost import DTYPE_BYTES, Task, TaskCost, make_cost_model, task_cost
from ..errors import CanzonaError, PlanFileError
from ..heads import head_places, is_head
from ..layout import ParallelSizes, padded_vocab
from ..options import HARDWARE_COSTS
from ..planning import GRAD_BYTES, evaluate, owner_of, pair_owners
from ..settings import OptimizerSettings
from .inverse import read_problem, recorded_hardware
from .messages import inconsistency, label, matches
from .pair_checks import check_pairs
from .schema import Plan, gc_paused
from .structure import check_structure
from .tp_checks import check_tp

__all__ = ["check_plan"]


def check_plan(plan: Plan, source: str = "<plan>") -> None:
    """Check that ``plan`` is what the planner computes from its own contents: its structure
    (:func:`~canzona.planner.plan.structure.check_structure`), then every relation of the module
    docstring.

    Raises:
        PlanFileError: one line naming ``source``, the field and the fix.
    """
    with gc_paused():  # no cycles are made here; the collector would walk the whole plan
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

    # Slots (TP-local shards) against their tasks: which parameters TP splits.
    check_pairs(plan, bad)
    slots: dict[str, tuple[int, str, int, tuple[int, int, int]]] = {}  # t, split?, numel, where
    for bi, buf in enumerate(plan.buffers):
        t_size = inp.etp if buf.expert else tp
        for j, b in enumerate(buf.buckets):
            for k, sl in enumerate(b.slots):
                ids = tasks_of[sl.name]
                t0 = tasks[ids[0]]
                n = numel[ids[0]] if len(ids) == 1 else sum(numel[i] for i in ids)
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
    hw = recorded_hardware(plan) if inp.cost_model in HARDWARE_COSTS else None
    timed = make_cost_model(inp.cost_model, settings, ParallelSizes(dp=dp, tp=tp, ep=ep), hw) \
        if hw is not None else None  # loads in seconds, recomputed on the recorded profile
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
        if timed is not None and t.cost != (want := timed.load_of(c)):
            raise bad(f"tasks[{i}].cost", f"is {t.cost} but the cost model is "
                                          f"'{inp.cost_model}' "
                                          f"(inputs.cost_model) on {plan.comm.hardware}, so it "
                                          f"must be the task's time {want} ns")
        if by_numel and t.cost != numel[i]:
            raise bad(f"tasks[{i}].cost", f"is {t.cost} but the cost model is 'numel' "
                                          f"(inputs.cost_model), so it must equal the task's "
                                          f"numel {numel[i]}")
        matrix = t.optimizer == "matrix"
        # a head of a fused QKV split per head lies whole on one TP rank's shard (``heads``)
        one_rank = matrix and settings.records_heads and is_head(t.part)
        if plan.tp is not None and matrix:
            hosted = i in scheduled
            split = (kind == "yes" and not one_rank) or (kind == "either" and hosted)
            if split != hosted:
                why = ("TP splits it (its slot holds one shard)" if split
                       else "it is one attention head, whole on one TP rank" if one_rank
                       else "TP replicates it (its slot holds the whole matrix)")
                raise bad(f"tasks[{i}].host", f"is {t.host} but task {i} ('{label(t)}'): {why}, "
                                              f"so it {'needs' if split else 'takes no'} host "
                                              f"rank in a micro-group"
                                              f"{' (or its TP group shares it)' if split else ''}")
        else:
            split = kind == "yes" or (kind == "either" and t.tp_comm_bytes != 0)
        exp = c.tp_comm_bytes if split and matrix else 0
        if t.tp_comm_bytes != exp:
            how = f"split over {t_size} TP ranks" if split else "not TP-split"
            raise bad(f"tasks[{i}].tp_comm_bytes",
                      f"is {t.tp_comm_bytes} but task {i} ('{label(t)}') moves {exp} bytes in the "
                      f"TP gather/scatter ({how}, comm dtype {inp.comm_dtype})")

    if settings.records_heads:  # every head whole in one TP rank's shard
        try:
            head_places(tasks, tp)
        except CanzonaError as e:
            raise bad("tasks", str(e)) from None
    _check_loads(plan, slots, bad)
    if plan.tp is not None:
        check_tp(plan, slots, bad)


def _cost_mismatch(t, field: str, exp: int, settings: OptimizerSettings,  # noqa: ANN001
                   cost_of, t_size: int) -> str:  # noqa: ANN001
    shape = "×".join(str(x) for x in t.shape)
    msg = (f"is {getattr(t, field)} but optimizer '{settings.name}' with the plan's settings "
           f"(inputs.optimizer) gives {exp} for task {t.id} ('{label(t)}', {shape}): the task "
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


def _check_loads(plan: Plan, slots: dict, bad) -> None:  # noqa: ANN001
    """Owners and metrics from the cuts, by the planner's own ``evaluate`` on the plan read back
    as its problem (the pieces of the matrices DP pairs split checked by ``check_pairs``)."""
    inp, tasks, m = plan.inputs, plan.tasks, plan.metrics
    dp = inp.dp
    problem = read_problem(plan)
    buckets, cuts = problem.buckets, problem.cuts
    fragments = inp.solver.strategy == "zero1"
    ev = evaluate(problem, cuts, split_mode="fragments" if fragments else "owner")
    for i, t in enumerate(tasks):
        if t.optimizer != "matrix":
            continue
        d = ev.owners[i]
        if t.owner != d:
            bi, j, k = slots[t.param][3]
            raise bad(f"tasks[{i}].owner",
                      f"is {t.owner} but the cuts of buffers[{bi}].buckets[{j}] put '{label(t)}' "
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
        raise bad("metrics.lower_bound", f"is {m.lower_bound} but max(⌈total load / dp⌉, "
                                         f"largest matrix) = {lb}")
    if m.certified_bound < lb:
        raise bad("metrics.certified_bound", f"is {m.certified_bound}, below the lower bound {lb}")
    mean = sum(ev.load) / len(ev.load)
    exp_ratio = round(max(ev.load) / mean, 6) if mean else 1.0
    if not matches(m.max_over_mean, exp_ratio):
        raise bad("metrics.max_over_mean", f"is {m.max_over_mean} but max/mean of dp_load is "
                                           f"{exp_ratio}")
    bound = m.certified_bound
    exp_gap = round(max(ev.load) / bound - 1, 6) if bound else 0.0
    if not matches(m.gap_to_bound, exp_gap):
        raise bad("metrics.gap_to_bound", f"is {m.gap_to_bound} but max(dp_load) / "
                                          f"certified_bound - 1 is {exp_gap}")

