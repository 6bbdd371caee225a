"""An FSDP2 plan file (:class:`~canzona.planner.plan.schema.FSDP2Plan`): its one assembly step,
:func:`build_fsdp2_plan` (a problem of :mod:`canzona.planner.fsdp2` and a solution → the
plan), and its checks, :func:`check_fsdp2_plan`, which loading runs: every relation the
assembly computes from the tasks, owners and rounds is recomputed from the plan itself —

* task ids in order, each matrix task with an owner in ``[0, dp · tp)`` (rank d·tp + t of the
  mesh) and each AdamW task none; with TP, a split dimension per task;
* every matrix task in exactly one round, AdamW tasks in none, rounds indexed in order;
* each shared task a matrix task of a Gram-shared optimizer, on an adjacent pair (2s, 2s + 1)
  whose first member is its owner, its blocks ``fsdp2.block_bounds``;
* per round and rank, the whole-matrix (or block) bytes gathered and the bytes sent and
  received (``fsdp2.gather_bytes`` at the plan's dp, tp and comm dtype);
* each task's ``flops`` and ``state_bytes`` from ``cost.task_cost``; ``total_params``;
* the per-rank metrics from the owners, and their bounds and ratios.

Every failure is one :class:`~canzona.planner.errors.PlanFileError` line naming the field and
the fix.
"""

from __future__ import annotations

from ..comm import ELEMENT_BYTES
from ..cost import Task, make_cost_model, task_cost
from ..formulas import fsdp2_blocks
from ..fsdp2 import (SHARE_K, FSDP2Problem, FSDP2Solution, block_bounds, gather_bytes,
                     round_traffic)
from ..layout import ParallelSizes
from .messages import inconsistency, label
from .schema import (FSDP2Plan, FSDP2Section, FSDP2SharedPlan, Metrics, PlanInputs, RoundPlan,
                     SolverOptions, TaskPlan)

__all__ = ["build_fsdp2_plan", "check_fsdp2_plan"]


def build_fsdp2_plan(problem: FSDP2Problem, solution: FSDP2Solution, *, cost: str,
                     solver: SolverOptions, model_source: str = "preset") -> FSDP2Plan:
    """The plan file of ``solution`` (``cost``: the cost model of the tasks' ``cost`` and the
    per-rank loads, a key of ``cost.make_cost_model``)."""
    sizes = ParallelSizes(dp=problem.dp, tp=1)
    model = make_cost_model(cost, problem.settings, sizes, problem.hardware)
    owners = solution.owners
    tasks = tuple(
        TaskPlan(id=t.id, param=t.param, part=t.part, shape=t.shape,
                 optimizer=t.optimizer,  # type: ignore[arg-type]
                 owner=owners.get(t.id) if t.optimizer == "matrix" else None,
                 cost=model.cost(t), flops=c.flops, state_bytes=c.state_bytes, tp_comm_bytes=0)
        for t, c in zip(problem.tasks, problem.costs))
    places = solution.places
    rounds = []
    for k, ids in enumerate(solution.rounds):
        gathered, sent, received, compute = round_traffic(problem, places, ids)
        rounds.append(RoundPlan(index=k, tasks=ids, gathered_bytes=tuple(gathered),
                                sent_bytes=tuple(sent), received_bytes=tuple(received),
                                compute_s=tuple(round(c, 9) for c in compute)))
    section = FSDP2Section(
        cmax_bytes=problem.cmax_bytes, comm_dtype=problem.comm_dtype,
        hardware=problem.hardware.name, link=problem.link_name,  # type: ignore[arg-type]
        split_dims=problem.split_dims if problem.tp > 1 else (),
        rounds=tuple(rounds), modelled_step_s=round(solution.step_s, 9),
        bound_s=round(solution.bound_s, 9),
        shared=tuple(FSDP2SharedPlan(id=i, owners=ranks,
                                     blocks=problem.blocks(i, len(ranks)),
                                     piece_s=round(problem.piece_s(i, len(ranks)), 9))
                     for i, ranks in sorted(solution.shared.items())))
    inputs = PlanInputs(
        model=problem.spec.name, model_source=model_source,  # type: ignore[arg-type]
        dp=problem.dp, tp=problem.tp, optimizer=problem.settings,
        cost_model=getattr(model, "name", cost),
        bucket_size=None, grad_dtype="fp32", comm_dtype=problem.comm_dtype, solver=solver)
    return FSDP2Plan(inputs=inputs, fingerprint=problem.spec.fingerprint(),
                     total_params=problem.spec.total_params, tasks=tasks,
                     metrics=_metrics(tasks, problem.dp, problem.tp, problem.split_dims,
                                      _received(rounds, problem.ranks), solution.shared,
                                      problem.settings.spec.local_state,
                                      status=solution.strategy),
                     fsdp2=section)


def _received(rounds, dp: int) -> tuple[int, ...]:  # noqa: ANN001
    """Per rank, the bytes its gathers receive over every round."""
    return tuple(sum(r.received_bytes[d] for r in rounds) for d in range(dp))


def _metrics(tasks: tuple[TaskPlan, ...], dp: int, tp: int, dims: tuple[int | None, ...],
             received: tuple[int, ...], shared: dict[int, tuple[int, ...]], local_state: bool,
             *, status: str) -> Metrics:
    """Per rank: its matrices' loads and FLOPs (a shared matrix's split evenly over its
    members, cumulative integer rounding) and their state — on their owners, or with
    ``local_state`` (Muon's momentum) by each rank's share of their rows —; its AdamW tensors'
    by its share of their rows (each rank updates its own rows); the bytes its gathers receive
    (recorded as ``dp_reduce_scatter_bytes``: FSDP2's own reduce-scatter is not the plan's).
    Bounds in cost units over whole matrices. Per rank of the dp × tp mesh."""
    ranks = dp * tp
    load, flops, state = [0] * ranks, [0] * ranks, [0] * ranks
    for t in tasks:
        if t.optimizer == "matrix":
            members = shared.get(t.id, (t.owner,))
            k = len(members)
            for j, o in enumerate(members):
                load[o] += t.cost * (j + 1) // k - t.cost * j // k
                flops[o] += t.flops * (j + 1) // k - t.flops * j // k
                if not local_state:
                    state[o] += t.state_bytes * (j + 1) // k - t.state_bytes * j // k
            if local_state:
                _by_blocks(t.shape, dims[t.id], dp, tp, ((state, t.state_bytes),))
            continue
        _by_blocks(t.shape, dims[t.id], dp, tp,
                   ((load, t.cost), (flops, t.flops), (state, t.state_bytes)))
    matrix = [t.cost for t in tasks if t.optimizer == "matrix"]
    total = sum(load)
    lower = max(-(-total // ranks), max(matrix, default=0))
    mean = total / ranks
    return Metrics(dp_load=tuple(load), dp_flops=tuple(flops), dp_state_bytes=tuple(state),
                   dp_reduce_scatter_bytes=tuple(received),
                   max_over_mean=round(max(load) / mean, 6) if mean else 1.0,
                   lower_bound=lower, certified_bound=lower,
                   gap_to_bound=round(max(load) / lower - 1, 6) if lower else 0.0,
                   split_matrices=0, solver_status=status)


def _by_blocks(shape: tuple[int, ...], split_dim: int | None, dp: int, tp: int,
               parts: tuple[tuple[list[int], int], ...]) -> None:
    """Add each (per-rank list, amount) of a tensor of ``shape`` by every rank's share of it
    (its block, ``formulas.fsdp2_block``; rank d·tp + t), cumulative integer rounding over the
    DP ranks, so a TP shard's (or a TP copy's) shares add up exactly."""
    numel = 1
    for x in shape:
        numel *= x
    if split_dim is not None and tp == 1:
        split_dim = None  # one TP rank: its shard is the whole
    all_blocks = fsdp2_blocks(shape, split_dim, dp, tp)
    for t in range(tp):
        # the TP shard's (or copy's) share of the amount, then its rows over the DP ranks
        blocks = all_blocks[t::tp]
        sizes = [(r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks]
        whole = sum(sizes)
        done = [0] * len(parts)
        at = 0
        for d, n in enumerate(sizes):
            at += n
            for j, (out, amount) in enumerate(parts):
                now = _share(amount, split_dim, whole, numel, at)
                out[d * tp + t] += now - done[j]
                done[j] = now


def _share(amount: int, split_dim: int | None, whole: int, numel: int, at: int) -> int:
    """Of ``amount`` over a tensor of ``numel`` elements, the part of the first ``at``
    elements of a TP shard of ``whole`` (a TP copy: the whole tensor)."""
    if not numel:
        return 0
    shard = amount if split_dim is None else amount * whole // numel
    return shard * at // whole if whole else 0


def check_fsdp2_plan(plan: FSDP2Plan, source: str = "<plan>") -> None:
    """Check ``plan`` against what :func:`build_fsdp2_plan` computes from its tasks, owners and
    rounds (the module docstring).

    Raises:
        PlanFileError: one line naming ``source``, the field and the fix.
    """
    def bad(field: str, problem: str) -> Exception:
        return inconsistency(source, field, problem)

    inp, dp, tp = plan.inputs, plan.inputs.dp, plan.inputs.tp
    ranks = dp * tp
    if inp.ep != 1 or inp.stage is not None:
        raise bad("inputs", "an FSDP2 plan has no expert parallelism (ep 1) and no pipeline "
                            "stage")
    dims = plan.fsdp2.split_dims
    if tp > 1 and len(dims) != len(plan.tasks):
        raise bad("fsdp2.split_dims", f"has {len(dims)} entries for {len(plan.tasks)} tasks at "
                                      f"tp {tp}")
    if tp == 1 and dims:
        raise bad("fsdp2.split_dims", "is given at tp 1; leave it out")
    if any(x not in (None, 0, 1) for x in dims):
        raise bad("fsdp2.split_dims", "holds a dimension other than 0, 1 or null")
    dims = dims or (None,) * len(plan.tasks)
    e = ELEMENT_BYTES.get(plan.fsdp2.comm_dtype)
    if e is None:
        raise bad("fsdp2.comm_dtype", f"is {plan.fsdp2.comm_dtype!r}; choose one of "
                                      f"{', '.join(ELEMENT_BYTES)}")
    sizes = ParallelSizes(dp=dp, tp=1)
    total = 0
    for i, t in enumerate(plan.tasks):
        if t.id != i:
            raise bad(f"tasks[{i}].id", f"is {t.id}; tasks are numbered in order from 0")
        n = 1
        for x in t.shape:
            n *= x
        total += n
        if t.optimizer == "matrix":
            if len(t.shape) != 2:
                raise bad(f"tasks[{i}].shape", f"'{label(t)}' is a matrix task of shape "
                                               f"{t.shape}; matrix tasks are 2-D")
            if t.owner is None or not 0 <= t.owner < ranks:
                raise bad(f"tasks[{i}].owner", f"'{label(t)}' has owner {t.owner}; a matrix "
                                               f"task's owner is a rank in [0, {ranks})")
        elif t.owner is not None:
            raise bad(f"tasks[{i}].owner", f"'{label(t)}' is an AdamW task with an owner; "
                                           "AdamW tensors are updated on every rank's rows")
        c = task_cost(Task(t.id, t.param, t.part, t.shape, t.optimizer, False), inp.optimizer,
                      sizes, plan.fsdp2.comm_dtype)
        if (t.flops, t.state_bytes) != (c.flops, c.state_bytes):
            raise bad(f"tasks[{i}]", f"'{label(t)}' records flops {t.flops} and state_bytes "
                                     f"{t.state_bytes}; the formulas give {c.flops} and "
                                     f"{c.state_bytes}")
    if plan.total_params != total:
        raise bad("total_params", f"is {plan.total_params} but the tasks' shapes add up to "
                                  f"{total} parameters")
    shared = _check_shared(plan, bad)
    seen: dict[int, int] = {}
    for k, rnd in enumerate(plan.fsdp2.rounds):
        if rnd.index != k:
            raise bad(f"fsdp2.rounds[{k}].index", f"is {rnd.index}; rounds are numbered in "
                                                  "order from 0")
        for i in rnd.tasks:
            if not 0 <= i < len(plan.tasks) or plan.tasks[i].optimizer != "matrix":
                raise bad(f"fsdp2.rounds[{k}].tasks", f"lists {i}, which is not a matrix task")
            if i in seen:
                raise bad(f"fsdp2.rounds[{k}].tasks", f"lists task {i} "
                                                      f"('{label(plan.tasks[i])}') again "
                                                      f"(round {seen[i]} has it)")
            seen[i] = k
        _check_round(plan, k, e, shared, dims, bad)
    missing = [t for t in plan.tasks if t.optimizer == "matrix" and t.id not in seen]
    if missing:
        raise bad("fsdp2.rounds", f"no round has task {missing[0].id} "
                                  f"('{label(missing[0])}'); every matrix task is in one round")
    want = _metrics(plan.tasks, dp, tp, dims, _received(plan.fsdp2.rounds, ranks), shared,
                    inp.optimizer.spec.local_state, status=plan.metrics.solver_status)
    for name in ("dp_load", "dp_flops", "dp_state_bytes", "dp_reduce_scatter_bytes",
                 "max_over_mean", "lower_bound"):
        if getattr(plan.metrics, name) != getattr(want, name):
            raise bad(f"metrics.{name}", f"is {getattr(plan.metrics, name)} but the owners "
                                         f"give {getattr(want, name)}")


def _check_shared(plan: FSDP2Plan, bad) -> dict[int, tuple[int, ...]]:  # noqa: ANN001
    """The shared tasks against the tasks and the pairing rule; task id → its members."""
    out: dict[int, tuple[int, ...]] = {}
    dp = plan.inputs.dp * plan.inputs.tp
    for j, x in enumerate(plan.fsdp2.shared):
        where = f"fsdp2.shared[{j}]"
        if not 0 <= x.id < len(plan.tasks) or plan.tasks[x.id].optimizer != "matrix":
            raise bad(f"{where}.id", f"is {x.id}, which is not a matrix task")
        t = plan.tasks[x.id]
        if not plan.inputs.optimizer.spec.gram_shared:
            raise bad(where, f"shares '{label(t)}', but {plan.inputs.optimizer.name}'s update "
                             "is not shared by its Gram")
        a = x.owners[0] if x.owners else -1
        if (len(x.owners) != SHARE_K or a % SHARE_K
                or x.owners != tuple(range(a, a + SHARE_K)) or x.owners[-1] >= dp):
            raise bad(f"{where}.owners", f"is {list(x.owners)}; a shared task's ranks are an "
                                         f"adjacent pair (2s, 2s + 1) of the {dp}")
        if t.owner != a:
            raise bad(f"tasks[{x.id}].owner", f"is {t.owner} but '{label(t)}' is shared by "
                                              f"{list(x.owners)}; its owner is the first")
        if x.blocks != block_bounds(t.shape, len(x.owners)):
            raise bad(f"{where}.blocks", f"is {list(x.blocks)}; the long dimension's blocks "
                                         f"are {list(block_bounds(t.shape, len(x.owners)))}")
        if x.id in out:
            raise bad(f"{where}.id", f"task {x.id} is shared twice")
        out[x.id] = x.owners
    return out


def _check_round(plan: FSDP2Plan, k: int, e: int, shared: dict[int, tuple[int, ...]],
                 dims: tuple[int | None, ...], bad) -> None:  # noqa: ANN001
    """Round ``k``'s per-rank bytes from its tasks' shapes, owners, blocks and TP splits."""
    dp, tp = plan.inputs.dp, plan.inputs.tp
    size = dp * tp
    rnd = plan.fsdp2.rounds[k]
    gathered, sent, received = [0] * size, [0] * size, [0] * size
    for i in rnd.tasks:
        t = plan.tasks[i]
        members = shared.get(i, (t.owner,))
        b = block_bounds(t.shape, len(members))
        out, into = gather_bytes(tuple(t.shape), dims[i], dp, tp, e,
                                 tuple((o, b[j], b[j + 1]) for j, o in enumerate(members)))
        for r in range(size):
            sent[r] += out[r]
            received[r] += into[r]
        for j, o in enumerate(members):
            gathered[o] += (b[j + 1] - b[j]) * min(t.shape) * e if len(members) > 1 \
                else t.shape[0] * t.shape[1] * e
    for name, got in (("gathered_bytes", gathered), ("sent_bytes", sent),
                      ("received_bytes", received)):
        if tuple(getattr(rnd, name)) != tuple(got):
            raise bad(f"fsdp2.rounds[{k}].{name}", f"is {list(getattr(rnd, name))} but the "
                                                   f"round's tasks and owners give {got}")
    if len(rnd.compute_s) != size:
        raise bad(f"fsdp2.rounds[{k}].compute_s", f"has {len(rnd.compute_s)} entries for "
                                                  f"{size} ranks")
