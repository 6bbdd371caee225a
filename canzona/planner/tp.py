"""Micro-group scheduling for tensor parallelism, and the per-GPU (joint DP × TP) objective.

Canzona (arXiv 2602.06079, §TP). Under TP every matrix is split over the TP group, so its update
needs the whole matrix on one *host* rank: gather the shards, compute, scatter the update back.
For each DP index d (its TP group holds the shards of every parameter d owns) this module chooses

* a host TP rank per TP-split matrix task (replicated parameters stay local, computed by every
  rank; AdamW works on each rank's shard);
* ordered *micro-groups*: the full matrices a rank hosts in one group fit a memory cap C_max
  (bytes of the gathered full matrices in the communication dtype; the update overwrites the
  gathered gradient, and Newton–Schulz / Shampoo workspace is not counted; with the pipeline
  below two groups are in flight, so the peak is up to 2·C_max);
* the exact all-to-all split sizes of every group, so the runtime does no planning.

::

    TP group of DP index d (tp = 4)         time ─────────────────────────────────────►
    comm    │ gather g0 │ gather g1 │ scatter g0 │ gather g2 │ scatter g1 │   │ scatter g2 │
    t=0     │           │ compute g0 (hosted on 0)│ compute g1            │ compute g2 │
    t=1..3  │           │ compute g0 (hosted on t)│ …  (every rank waits for the slowest in g)

Solvers: ``greedy`` is the paper's global LPT with rollback (tasks by decreasing load, each to
the rank with the least total load; if that rank's share of the current group would exceed C_max
the group closes and a new one starts); ``cpsat`` re-hosts every group with OR-Tools (minimise the
busiest rank's running total, then the group's max − min), warm-started from greedy. The order of
the groups is a two-machine flow shop (gather of group i+1 overlaps compute of group i), which
Johnson's rule solves exactly, so no search is needed there.

The objective that costs time is the slowest GPU, max over (d, t): :func:`gpu_loads` evaluates a DP
partition plus a TP schedule on that grid and :func:`joint_refine` moves DP cut points (whole
matrices between neighbouring DP indices of a bucket) to lower it. LB_gpu = max(total / (dp·tp),
largest task) bounds every schedule with whole-matrix tasks.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from .cost import DTYPE_BYTES, load_hardware
from .errors import CanzonaError, OversizedTaskWarning
from .plan import (GroupTaskPlan, MicroGroupPlan, Plan, ShardLayoutPlan, TaskPlan, TPIndexPlan,
                   TPMetrics, TPPlan)
from .planning import BucketProblem, DPProblem, Item, owner_of
from .shards import ShardMap, shard_map

TP_SOLVERS = ("greedy", "cpsat")
MIB = 1 << 20
Cuts = dict[tuple[int, int], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class TPSettings:
    """How the TP schedule is made (recorded in the plan).

    Attributes:
        cmax_mib: memory cap C_max per host rank and micro-group, MiB of gathered full matrices.
        solver: ``greedy`` (the paper) or ``cpsat`` (greedy, then CP-SAT per group).
        group_time_limit_s: CP-SAT deterministic time limit per group.
        total_time_limit_s: CP-SAT deterministic time budget over all groups (later groups keep
            greedy once it is spent).
        seed: CP-SAT random seed.
        workers: CP-SAT worker count (fixed, so plans are reproducible).
        hardware: hardware profile for the modelled timeline (compute rate, TP link bandwidth).
    """

    cmax_mib: float = 512.0
    solver: str = "greedy"
    group_time_limit_s: float = 0.2
    total_time_limit_s: float = 5.0
    seed: int = 0
    workers: int = 1
    hardware: str = "h100"

    def __post_init__(self) -> None:
        if not self.cmax_mib > 0:
            raise CanzonaError(f"--cmax must be a positive number of MiB, got {self.cmax_mib}.")
        if self.solver not in TP_SOLVERS:
            raise CanzonaError(f"unknown TP solver '{self.solver}'; choose one of: "
                               f"{', '.join(TP_SOLVERS)}.")
        if not self.group_time_limit_s > 0 or not self.total_time_limit_s > 0:
            raise CanzonaError("TP CP-SAT time limits must be positive seconds.")

    @property
    def cmax_bytes(self) -> int:
        return int(self.cmax_mib * MIB)


# --- per-task TP facts ---------------------------------------------------------------------------


@dataclass(slots=True)
class TPContext:
    """Per-task facts the TP schedule needs, computed once per problem.

    ``split[i]``: task i is a matrix task whose parameter TP splits (it needs a host);
    ``gathered[i]``: bytes of its full matrix in the comm dtype; ``layout[i]``: index into
    ``maps`` (distinct shard maps), so ``maps[layout[i]].sent_numel(t)`` is what rank t sends.
    """

    problem: DPProblem
    comm_dtype: str
    split: list[bool]
    gathered: list[int]
    layout: list[int]
    maps: list[ShardMap]
    tp_of: list[int]
    _map_index: dict = field(default_factory=dict)

    @classmethod
    def build(cls, problem: DPProblem, comm_dtype: str = "bf16") -> TPContext:
        if comm_dtype not in DTYPE_BYTES:
            raise CanzonaError(f"unknown comm dtype '{comm_dtype}'; choose one of: "
                               f"{', '.join(DTYPE_BYTES)}.")
        spec, sizes = problem.spec, problem.sizes
        ctx = cls(problem, comm_dtype, [], [], [], [], [])
        kv = spec.config.kv_heads
        for t in problem.tasks:
            p = spec[t.param]
            tp = sizes.expert_tp if p.is_expert else sizes.tp
            ctx.tp_of.append(tp)
            is_split = t.optimizer == "matrix" and t.tp_split
            ctx.split.append(is_split)
            if not is_split:
                ctx.gathered.append(0)
                ctx.layout.append(-1)
                continue
            key = (p.shape, p.tp_layout, p.parts, t.part, tp)
            k = ctx._map_index.get(key)
            if k is None:
                k = len(ctx.maps)
                ctx._map_index[key] = k
                ctx.maps.append(shard_map(p, tp, kv_groups=kv, part=t.part))
            ctx.layout.append(k)
            ctx.gathered.append(ctx.maps[k].full_numel * DTYPE_BYTES[comm_dtype])
        return ctx


def _item_gpu_load(problem: DPProblem, item_task: int, load: int, tp: int) -> float:
    """Per-GPU share of an element-wise (AdamW) load: split parameters are sharded over TP,
    replicated ones are computed by every rank."""
    return load / tp if problem.tasks[item_task].tp_split else float(load)


def index_work(problem: DPProblem, cuts: Cuts, ctx: TPContext | None = None
               ) -> tuple[list[float], list[list[int]]]:
    """Per DP index: the load every TP rank carries anyway (AdamW shards, replicated matrices),
    and the TP-split matrix tasks it owns (ids, ascending)."""
    ctx = ctx or TPContext.build(problem)
    dp = problem.dp
    base = [0.0] * dp
    owned: list[list[int]] = [[] for _ in range(dp)]
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        for it in b.items:
            first = owner_of(c, it.start)
            if it.atomic:
                d = problem.dp_index(b, first)
                for i in it.tasks:
                    if ctx.split[i]:
                        owned[d].append(i)
                    else:  # replicated (or tp = 1): the whole matrix on every rank of d
                        base[d] += problem.loads[i]
                continue
            last = owner_of(c, it.end - 1)
            n = it.end - it.start
            tp = ctx.tp_of[it.tasks[0]]
            for r in range(first, last + 1):
                lo, hi = max(it.start, c[r]), min(it.end, c[r + 1])
                if hi > lo:
                    base[problem.dp_index(b, r)] += _item_gpu_load(
                        problem, it.tasks[0], it.load * (hi - lo) // n, tp)
    for ids in owned:
        ids.sort()
    return base, owned


def lpt_bins(loads: Sequence[int], tp: int) -> list[int]:
    """Longest-processing-time packing of ``loads`` on ``tp`` ranks: every rank's load."""
    heap = [0] * max(1, tp)
    for x in sorted(loads, reverse=True):
        heapq.heapreplace(heap, heap[0] + x)
    return heap


def lpt_makespan(loads: Sequence[int], tp: int) -> int:
    """Longest-processing-time packing of ``loads`` on ``tp`` ranks: the busiest rank's load."""
    if tp <= 1:
        return int(sum(loads))
    heap = [0] * tp
    for x in sorted(loads, reverse=True):
        heapq.heapreplace(heap, heap[0] + x)
    return max(heap)


# --- schedule records ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MicroGroup:
    """One micro-group of a TP group: tasks in wire order (by host, then id)."""

    tasks: tuple[int, ...]
    hosts: tuple[int, ...]
    rank_load: tuple[int, ...]
    rank_flops: tuple[int, ...]
    rank_bytes: tuple[int, ...]  # gathered full-matrix bytes hosted per rank
    gather_send: tuple[tuple[int, ...], ...]  # [src t][dst h] elements
    oversized: bool

    @property
    def peak_bytes(self) -> int:
        return max(self.rank_bytes)

    @property
    def gather_recv(self) -> tuple[tuple[int, ...], ...]:
        """[host h][src t] elements h receives from t (the transpose of ``gather_send``)."""
        return tuple(zip(*self.gather_send))


@dataclass(frozen=True, slots=True)
class IndexSchedule:
    """The TP schedule of one DP index: groups in execution order, modelled timeline."""

    dp_index: int
    tp: int
    base: tuple[float, ...]  # per rank: AdamW shard + replicated matrices
    groups: tuple[MicroGroup, ...]
    timeline: tuple[tuple[float, float, float, float, float, float], ...]  # per group, seconds:
    #   gather start/end, compute start/end, scatter start/end

    def gpu_load(self) -> list[float]:
        load = list(self.base)
        for g in self.groups:
            for t in range(self.tp):
                load[t] += g.rank_load[t]
        return load

    @property
    def makespan_s(self) -> float:
        return max((x[5] for x in self.timeline), default=0.0)


@dataclass(frozen=True, slots=True)
class TPSchedule:
    """Every DP index's TP schedule plus the per-GPU metrics."""

    settings: TPSettings
    comm_dtype: str
    indices: tuple[IndexSchedule, ...]
    status: str
    oversized: tuple[str, ...]

    def grid(self) -> list[list[int]]:
        """Per-GPU load, dp × tp (cost-model units)."""
        return [[int(round(x)) for x in s.gpu_load()] for s in self.indices]


# --- greedy: global LPT with rollback ----------------------------------------------------------------


def _make_group(ctx: TPContext, pairs: list[tuple[int, int]], tp: int, oversized: bool) -> MicroGroup:
    pairs = sorted(pairs, key=lambda x: (x[1], x[0]))  # wire order: by host, then task id
    loads, flops, mem = [0] * tp, [0] * tp, [0] * tp
    send = [[0] * tp for _ in range(tp)]
    pr = ctx.problem
    for i, h in pairs:
        loads[h] += pr.loads[i]
        flops[h] += pr.costs[i].flops
        mem[h] += ctx.gathered[i]
        m = ctx.maps[ctx.layout[i]]
        for t in range(tp):
            send[t][h] += m.sent_numel(t)
    return MicroGroup(tuple(i for i, _ in pairs), tuple(h for _, h in pairs), tuple(loads),
                      tuple(flops), tuple(mem), tuple(tuple(r) for r in send), oversized)


def _greedy_groups(ctx: TPContext, ids: list[int], base: list[float], tp: int, cap: int
                   ) -> list[tuple[list[tuple[int, int]], bool]]:
    """The paper's global LPT with rollback; returns (pairs (task, host), oversized) per group."""
    loads = ctx.problem.loads
    cum = list(base)
    groups: list[tuple[list[tuple[int, int]], bool]] = []
    cur: list[tuple[int, int]] = []
    cur_bytes = [0] * tp
    for i in sorted(ids, key=lambda i: (-loads[i], i)):
        h = min(range(tp), key=lambda t: (cum[t], t))  # least total load; lowest rank on ties
        b = ctx.gathered[i]
        if b > cap:
            groups.append(([(i, h)], True))  # alone, over the cap: reported and warned about
        else:
            if cur_bytes[h] + b > cap:
                # Rollback: the LPT rank has no room left in this group; close it, open the next.
                groups.append((cur, False))
                cur, cur_bytes = [], [0] * tp
            cur.append((i, h))
            cur_bytes[h] += b
        cum[h] += loads[i]
    if cur:
        groups.append((cur, False))
    return groups


# --- CP-SAT per group ----------------------------------------------------------------------------------


def _cpsat_group(ctx: TPContext, pairs: list[tuple[int, int]], base: list[float], tp: int,
                 cap: int, settings: TPSettings) -> tuple[list[tuple[int, int]], str, float]:
    """Re-host one group. Returns (pairs, status, deterministic time used).

    data:      tasks k of the group with loads w_k and gathered bytes b_k; ranks t with the load
               base_t they carry before this group (earlier groups, AdamW, replicated matrices).
    variables: x[k, t] = 1 if task k is hosted on rank t.
               M = max_t (base_t + Σ_k w_k x[k, t])  (the busiest rank's running total),
               hi, lo = max_t, min_t Σ_k w_k x[k, t]  (this group's spread).
    constraints:
      * every task has exactly one host;
      * Σ_k b_k x[k, t] ≤ C_max for every rank (the group's memory cap);
      * M ≥ base_t + load_t, hi ≥ load_t, lo ≤ load_t for every rank.
    objective: minimise M, then hi − lo (weighted so that M dominates).
    """
    from ortools.sat.python import cp_model

    pr = ctx.problem
    ids = [i for i, _ in pairs]
    hint = {i: h for i, h in pairs}
    top = max(base) + sum(pr.loads[i] for i in ids)
    unit = max(1.0, top / 100_000)  # integer loads at 1e-5 of the scale (heuristic, not a bound)
    w = [max(0, round(pr.loads[i] / unit)) for i in ids]
    bs = [max(0, round(b / unit)) for b in base]
    span = sum(w) + 1

    model = cp_model.CpModel()
    x = {(k, t): model.new_bool_var(f"x_{k}_{t}") for k in range(len(ids)) for t in range(tp)}
    for k in range(len(ids)):
        # Every task has exactly one host.
        model.add_exactly_one(x[k, t] for t in range(tp))
    hi = model.new_int_var(0, span, "hi")
    lo = model.new_int_var(0, span, "lo")
    M = model.new_int_var(0, max(bs) + span, "M")
    for t in range(tp):
        # The rank's gathered full matrices fit the cap.
        model.add(sum(ctx.gathered[i] * x[k, t] for k, i in enumerate(ids)) <= cap)
        load_t = sum(w[k] * x[k, t] for k in range(len(ids)))
        # M bounds every rank's running total; hi and lo bracket this group's loads.
        model.add(M >= bs[t] + load_t)
        model.add(hi >= load_t)
        model.add(lo <= load_t)
    model.minimize(M * span + (hi - lo))
    for k, i in enumerate(ids):
        for t in range(tp):
            model.add_hint(x[k, t], 1 if hint[i] == t else 0)

    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = float(settings.group_time_limit_s)
    solver.parameters.max_time_in_seconds = 10.0 * float(settings.group_time_limit_s)
    solver.parameters.num_workers = int(settings.workers)
    solver.parameters.random_seed = int(settings.seed)
    status = solver.solve(model)
    used = float(solver.deterministic_time)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # The greedy hint is feasible, so only UNKNOWN (no time) can happen: keep greedy.
        return pairs, "unknown", used
    new = [(i, t) for k, i in enumerate(ids) for t in range(tp) if solver.value(x[k, t])]

    def exact(ps):  # judge on unscaled loads: keep greedy unless CP-SAT is strictly better
        run = list(base)
        grp = [0] * tp
        for i, h in ps:
            run[h] += pr.loads[i]
            grp[h] += pr.loads[i]
        return (max(run), max(grp) - min(grp))

    if exact(new) >= exact(pairs):
        return pairs, "optimal" if status == cp_model.OPTIMAL else "feasible", used
    return new, "optimal" if status == cp_model.OPTIMAL else "improved", used


def _group_lower_bound(base: list[float], loads: list[int], tp: int) -> float:
    return max(max(base), (sum(base) + sum(loads)) / tp, min(base) + max(loads, default=0))


# --- ordering and timeline ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rates:
    flops_per_s: float
    bytes_per_s: float
    latency_s: float


def _rates(hardware: str) -> _Rates:
    hw = load_hardware(hardware)
    return _Rates(hw.peak_flops["bf16"] * hw.compute_efficiency, hw.intra_node.busbw,
                  hw.intra_node.latency_s)


def _a2a_seconds(g: MicroGroup, rates: _Rates, nbytes: int) -> float:
    """All-to-all time: the rank moving the most off-rank bytes (sent or received) sets it."""
    tp = len(g.gather_send)
    worst = 0
    for t in range(tp):
        sent = sum(g.gather_send[t][h] for h in range(tp) if h != t)
        recv = sum(g.gather_send[s][t] for s in range(tp) if s != t)
        worst = max(worst, sent, recv)
    return 0.0 if worst == 0 else rates.latency_s + worst * nbytes / rates.bytes_per_s


def _order_and_timeline(groups: list[MicroGroup], rates: _Rates, nbytes: int
                        ) -> tuple[list[MicroGroup], list[tuple[float, ...]]]:
    """Johnson's rule for the two-stage flow shop (gather, then compute), then the timeline.

    Groups whose gather is shorter than their compute go first, by increasing gather; the rest
    last, by decreasing compute. This minimises the pipelined makespan of gather + compute
    exactly; scatters then run on the communication stream as soon as it is free.
    """
    G = [_a2a_seconds(g, rates, nbytes) for g in groups]
    C = [max(g.rank_flops) / rates.flops_per_s for g in groups]
    first = sorted((k for k in range(len(groups)) if G[k] < C[k]), key=lambda k: (G[k], k))
    last = sorted((k for k in range(len(groups)) if G[k] >= C[k]), key=lambda k: (-C[k], k))
    order = first + last
    out = [groups[k] for k in order]
    G = [G[k] for k in order]
    C = [C[k] for k in order]
    timeline: list[tuple[float, ...]] = []
    n = len(out)
    gather_end = [0.0] * n
    comm = 0.0
    if n:
        gather_end[0] = G[0]
        comm = G[0]
    starts = [0.0] * n
    compute_free = 0.0
    rows = []
    for k in range(n):
        cs = max(gather_end[k], compute_free)
        if k + 1 < n:  # the next group's gather is issued as this group's compute starts
            gs = max(comm, cs)
            starts[k + 1] = gs
            gather_end[k + 1] = gs + G[k + 1]
            comm = gather_end[k + 1]
        ce = cs + C[k]
        compute_free = ce
        ss = max(ce, comm)
        se = ss + G[k]  # the scatter moves the same elements back
        comm = se
        rows.append((starts[k], gather_end[k], cs, ce, ss, se))
    timeline = [tuple(round(v, 9) for v in r) for r in rows]
    return out, timeline


# --- the schedule ------------------------------------------------------------------------------------


def schedule_index(ctx: TPContext, d: int, ids: list[int], base_value: float,
                   settings: TPSettings, budget: list[float] | None = None
                   ) -> tuple[IndexSchedule, str]:
    """Schedule one DP index's TP-split tasks. ``budget``: remaining CP-SAT time (mutable)."""
    pr = ctx.problem
    tp = pr.sizes.tp
    if any(ctx.tp_of[i] != tp for i in ids):
        raise CanzonaError("expert tensor parallel size differs from tp; not supported yet.")
    cap = settings.cmax_bytes
    base = [base_value] * tp
    raw = _greedy_groups(ctx, ids, base, tp, cap)
    status = "greedy"
    if settings.solver == "cpsat" and tp > 1:
        status = "optimal"
        run = list(base)
        new_raw = []
        for pairs, over in raw:
            loads = [pr.loads[i] for i, _ in pairs]
            grp_run = list(run)
            for i, h in pairs:
                grp_run[h] += pr.loads[i]
            proven = max(grp_run) <= _group_lower_bound(run, loads, tp)
            if not over and len(pairs) > 1 and not proven:
                if budget is not None and budget[0] <= 0:
                    status = "feasible"
                else:
                    pairs, st, used = _cpsat_group(ctx, pairs, run, tp, cap, settings)
                    if budget is not None:
                        budget[0] -= used
                    if st not in ("optimal",):
                        status = "feasible"
            for i, h in pairs:
                run[h] += pr.loads[i]
            new_raw.append((pairs, over))
        raw = new_raw
    groups = [_make_group(ctx, pairs, tp, over) for pairs, over in raw]
    rates = _rates(settings.hardware)
    groups, timeline = _order_and_timeline(groups, rates, DTYPE_BYTES[ctx.comm_dtype])
    return IndexSchedule(d, tp, tuple(base), tuple(groups), tuple(timeline)), status


def schedule_tp(problem: DPProblem, cuts: Cuts, settings: TPSettings | None = None, *,
                comm_dtype: str = "bf16", ctx: TPContext | None = None,
                warn: bool = True) -> TPSchedule:
    """The TP schedule of every DP index for the DP partition ``cuts``.

    Args:
        problem: the DP problem (tasks, costs, layout).
        cuts: the DP cut points per (buffer, bucket).
        settings: C_max, solver, time limits.
        comm_dtype: dtype of the gathered matrices (bf16 unless the parameters are fp32).
        warn: emit an :class:`~canzona.planner.errors.OversizedTaskWarning` (a ``UserWarning``)
            naming the tasks larger than C_max; the CLI prints it as one note.
    """
    settings = settings or TPSettings()
    ctx = ctx or TPContext.build(problem, comm_dtype)
    base, owned = index_work(problem, cuts, ctx)
    budget = [settings.total_time_limit_s]
    indices = []
    statuses = []
    for d in range(problem.dp):
        s, st = schedule_index(ctx, d, owned[d], base[d], settings, budget)
        indices.append(s)
        statuses.append(st)
    oversized = tuple(problem.tasks[i].name for s in indices for g in s.groups if g.oversized
                      for i in g.tasks)
    if warn and oversized:
        cap = settings.cmax_mib
        shown = ", ".join(oversized[:5]) + (f" and {len(oversized) - 5} more" if len(oversized) > 5
                                            else "")
        warnings.warn(f"{len(oversized)} matrices exceed C_max = {cap:g} MiB when gathered and get "
                      f"a micro-group of their own (raise --cmax to group them): {shown}.",
                      OversizedTaskWarning, stacklevel=2)
    if settings.solver == "greedy" or problem.sizes.tp == 1:
        status = "greedy"
    else:
        status = "cpsat-optimal" if all(s == "optimal" for s in statuses) else "cpsat-feasible"
    return TPSchedule(settings, ctx.comm_dtype, tuple(indices), status, oversized)


# --- the per-GPU objective and bounds ----------------------------------------------------------------


def lb_gpu(problem: DPProblem, grid: list[list[int]] | None = None,
           ctx: TPContext | None = None) -> int:
    """LB_gpu = max(⌈total per-GPU work / (dp·tp)⌉, largest task).

    The per-GPU total counts AdamW on shards and replicated matrices on every TP rank (work any
    schedule must do); without a ``grid`` it is computed from ZeRO-1's equal cuts (the total does
    not depend on the cuts).
    """
    if grid is None:
        from .planning import equal_cuts

        ctx = ctx or TPContext.build(problem)
        base, owned = index_work(problem, {(b.buffer, b.bucket): equal_cuts(b)
                                           for b in problem.buckets}, ctx)
        total = sum(base) * problem.sizes.tp + sum(problem.loads[i] for ids in owned for i in ids)
    else:
        total = sum(sum(r) for r in grid)
    largest = max((problem.loads[t.id] for t in problem.tasks if t.optimizer == "matrix"),
                  default=0)
    return max(math.ceil(total / (problem.dp * problem.sizes.tp)), largest)


def gpu_loads(problem: DPProblem, cuts: Cuts, schedule: TPSchedule | None = None,
              ctx: TPContext | None = None) -> list[list[float]]:
    """Per-GPU load (dp × tp) of a DP partition and a TP schedule.

    Without ``schedule``, each index's TP-split tasks are packed by LPT (the greedy's hosting:
    the rollback only closes groups, it never changes a host), which is what the DP side should
    evaluate: it is fast and exact for the greedy schedule.
    """
    if schedule is not None:
        return [s.gpu_load() for s in schedule.indices]
    ctx = ctx or TPContext.build(problem)
    base, owned = index_work(problem, cuts, ctx)
    tp = problem.sizes.tp
    out = []
    for d in range(problem.dp):
        heap = [(base[d], t) for t in range(tp)]
        load = [base[d]] * tp
        for i in sorted(owned[d], key=lambda i: (-problem.loads[i], i)):
            _, t = heapq.heappop(heap)
            load[t] += problem.loads[i]
            heapq.heappush(heap, (load[t], t))
        out.append(load)
    return out


def index_gpu_max(problem: DPProblem, cuts: Cuts, ctx: TPContext | None = None) -> list[float]:
    """The DP side's TP-aware load: per DP index, its busiest GPU after LPT packing.

    Use in place of the DP load (``evaluate(...).load``) when judging cuts under TP.
    """
    ctx = ctx or TPContext.build(problem)
    base, owned = index_work(problem, cuts, ctx)
    tp = problem.sizes.tp
    return [base[d] + lpt_makespan([problem.loads[i] for i in owned[d]], tp)
            for d in range(problem.dp)]


def joint_refine(problem: DPProblem, cuts: Cuts, *, ctx: TPContext | None = None,
                 rounds: int = 6, tolerance: float = 0.005, max_evals: int = 400_000) -> Cuts:
    """Re-place whole matrices among DP indices to lower the busiest GPU (the joint objective).

    Block coordinate descent over buckets, like the DP polish but on the per-GPU objective: a
    bucket's matrices are taken out, and its contiguous, rank-ordered split is re-chosen exactly
    (dynamic programming over (rank, matrices so far)) given every other bucket, where giving
    matrices j..i−1 to rank r costs the busiest GPU of r's DP index after LPT packing of its
    TP-split tasks (its AdamW share and replicated matrices included). Objectives: the squared
    overload of every GPU above LB_gpu·(1 + tolerance) (graded where the maximum is flat), then
    Σ v⁸, then max v. Stops
    when the worst index is within ``tolerance`` of LB_gpu, after ``rounds`` sweeps, or after
    ``max_evals`` candidate evaluations (deterministic: no wall clock).

    The cuts are then rebuilt: each is clamped into the gap its matrices allow, as close to the
    original cut as possible, so AdamW slices change little (``partition.rebalance_divisible``
    may slide them further; it keeps every matrix owner).
    """
    ctx = ctx or TPContext.build(problem)
    tp = problem.sizes.tp
    loads = problem.loads
    base, owned = index_work(problem, cuts, ctx)
    bag = [[loads[i] for i in ids] for ids in owned]
    bound = lb_gpu(problem, ctx=ctx)
    scale = float(bound or 1)

    atoms, rank = {}, {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        atoms[key] = [it for it in b.items if it.atomic]
        rank[key] = [owner_of(cuts[key], it.start) for it in atoms[key]]

    def split_of(it) -> tuple[list[int], float]:
        return ([loads[i] for i in it.tasks if ctx.split[i]],
                float(sum(loads[i] for i in it.tasks if not ctx.split[i])))

    def value(d: int) -> float:
        return base[d] + lpt_makespan(bag[d], tp)

    cache: dict[int, list[int]] = {}  # index → LPT bins of its bag (a heap), while unchanged

    def take(d: int, sp: list[int], rep: float, sign: int) -> None:
        cache.pop(d, None)
        if sign > 0:
            bag[d].extend(sp)
        else:
            for y in sp:
                bag[d].remove(y)
        base[d] += sign * rep

    evals = 0  # work budget (deterministic, unlike a wall-clock limit)
    order = sorted((b for b in problem.buckets if len(atoms[(b.buffer, b.bucket)]) > 0),
                   key=lambda b: (-b.load, b.buffer, b.bucket))
    target = 1 + tolerance
    for objective in ("excess", "p8", "max"):
        for _ in range(rounds):
            if max(value(d) for d in range(problem.dp)) <= bound * (1 + tolerance):
                break
            changed = False
            for b in order:
                if evals > max_evals:
                    break
                key = (b.buffer, b.bucket)
                its = [split_of(it) for it in atoms[key]]
                m, R = len(its), b.ranks
                ds = [problem.dp_index(b, r) for r in range(R)]
                # A rank takes at most ``span`` matrices of the bucket (twice its share, or as
                # many as it has now): keeps the DP near-linear in the bucket's matrices.
                have = max((rank[key].count(r) for r in set(rank[key])), default=0)
                span = max(have, 2 * -(-m // R) + 1)
                for k, (sp, rep) in enumerate(its):
                    take(ds[rank[key][k]], sp, rep, -1)
                INF = float("inf")
                g = [0.0] + [INF] * m  # g[i]: best objective with matrices < i placed on ranks ≤ r
                choice = []
                for r in range(R):
                    d = ds[r]
                    if d not in cache:
                        cache[d] = lpt_bins(bag[d], tp)
                    b0 = cache[d]
                    ng = [INF] * (m + 1)
                    ch = [0] * (m + 1)
                    for j in range(m + 1):
                        if g[j] == INF:
                            continue
                        bins = list(b0)  # a heap: the index's LPT bins without this bucket
                        rep_sum = 0.0
                        for i in range(j, min(m, j + span) + 1):
                            evals += 1
                            if i > j:
                                # Matrices j..i-1 join the least-loaded bins (LPT insertion).
                                for x in sorted(its[i - 1][0], reverse=True):
                                    heapq.heapreplace(bins, bins[0] + x)
                                rep_sum += its[i - 1][1]
                            v = (base[d] + rep_sum + max(bins)) / scale
                            if objective == "max":
                                tot = max(g[j], v)
                            elif objective == "excess":
                                # Overload of every GPU above the target, squared: graded even
                                # when an index's maximum sits on a plateau.
                                tot = g[j] + sum(max(0.0, (base[d] + rep_sum + x) / scale - target)
                                                 ** 2 for x in bins)
                            else:
                                tot = g[j] + v ** 8
                            if tot < ng[i] - 1e-12:
                                ng[i], ch[i] = tot, j
                    g = ng
                    choice.append(ch)
                # Walk back the choices: matrices choice[r][i]..i-1 go to rank r.
                new = [0] * m
                i = m
                for r in range(R - 1, -1, -1):
                    j = choice[r][i]
                    for k in range(j, i):
                        new[k] = r
                    i = j
                if new != rank[key]:
                    changed = True
                rank[key] = new
                for k, (sp, rep) in enumerate(its):
                    take(ds[new[k]], sp, rep, +1)
            if not changed:
                break

    out: Cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        c = list(cuts[key])
        ats, rs = atoms[key], rank[key]
        new_c = [b.start]
        for r in range(1, b.ranks):
            # Cut r lies after every matrix of a rank < r and before every matrix of a rank ≥ r.
            lo = max((a.end for a, x in zip(ats, rs) if x < r), default=b.start)
            hi = min((a.start for a, x in zip(ats, rs) if x >= r), default=b.end)
            new_c.append(max(new_c[-1], min(max(c[r], lo), hi)))
        new_c.append(b.end)
        out[key] = tuple(new_c)
    # Never worse than the input on the per-GPU objective.
    before = max(index_gpu_max(problem, cuts, ctx))
    after = max(index_gpu_max(problem, out, ctx))
    return out if after <= before else cuts


# --- TP baselines ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TPBaselineRow:
    name: str
    max_gpu_load: float
    mean_gpu_load: float
    max_over_mean: float
    gap_to_lb_gpu: float


def tp_baselines(problem: DPProblem, cuts: Cuts, schedule: TPSchedule | None = None,
                 ctx: TPContext | None = None) -> list[TPBaselineRow]:
    """``sc`` (all-gather and redundant compute on every TP rank, Megatron's ``duplicated``, on
    the same DP partition), ``canzona-greedy`` (the paper's DP greedy and TP greedy) and, given a
    schedule, ``canzona``."""
    from .partition import greedy

    ctx = ctx or TPContext.build(problem)
    lb = lb_gpu(problem, ctx=ctx)
    rows = []

    def row(name: str, grid: list[list[float]]) -> TPBaselineRow:
        flat = [x for r in grid for x in r]
        mx, mean = max(flat), sum(flat) / len(flat)
        return TPBaselineRow(name, mx, mean, mx / mean if mean else 1.0, mx / lb - 1 if lb else 0.0)

    base, owned = index_work(problem, cuts, ctx)
    tp = problem.sizes.tp
    rows.append(row("sc", [[base[d] + sum(problem.loads[i] for i in owned[d])] * tp
                           for d in range(problem.dp)]))
    g = greedy(problem, alpha=1.0)
    rows.append(row("canzona-greedy", gpu_loads(problem, g, ctx=ctx)))
    if schedule is not None:
        rows.append(row("canzona", gpu_loads(problem, cuts, schedule)))
    return rows


# --- into the plan -------------------------------------------------------------------------------------


def tp_plan(problem: DPProblem, schedule: TPSchedule, ctx: TPContext | None = None) -> TPPlan:
    """The plan's TP section: layouts, groups with hosts and split sizes, per-GPU metrics."""
    ctx = ctx or TPContext.build(problem, schedule.comm_dtype)
    nbytes = DTYPE_BYTES[schedule.comm_dtype]
    used = sorted({ctx.layout[i] for s in schedule.indices for g in s.groups for i in g.tasks})
    remap = {k: j for j, k in enumerate(used)}
    layouts = tuple(ShardLayoutPlan(dim=ctx.maps[k].dim, local_shape=ctx.maps[k].local_shape,
                                    full_shape=ctx.maps[k].full_shape,
                                    segments=tuple((s.rank, s.local_start, s.full_start, s.length)
                                                   for s in ctx.maps[k].segments))
                    for k in used)
    indices = []
    a2a = [[0] * problem.sizes.tp for _ in range(problem.dp)]
    for s in schedule.indices:
        groups = []
        for gi, g in enumerate(s.groups):
            tp = len(g.gather_send)
            recv = g.gather_recv
            for t in range(tp):
                off = sum(g.gather_send[t][h] + recv[t][h] for h in range(tp) if h != t)
                a2a[s.dp_index][t] += 2 * off * nbytes  # gather and scatter
            groups.append(MicroGroupPlan(
                index=gi,
                tasks=tuple(GroupTaskPlan(id=i, host=h, layout=remap[ctx.layout[i]],
                                          load=problem.loads[i], gathered_bytes=ctx.gathered[i])
                            for i, h in zip(g.tasks, g.hosts)),
                peak_gathered_bytes=g.peak_bytes, rank_load=g.rank_load,
                gather_send=g.gather_send, gather_recv=recv,
                scatter_send=recv, scatter_recv=g.gather_send, oversized=g.oversized,
                timeline_s=s.timeline[gi]))
        indices.append(TPIndexPlan(dp_index=s.dp_index,
                                   local_load=tuple(int(round(x)) for x in s.base),
                                   groups=tuple(groups), modelled_s=round(s.makespan_s, 9)))
    grid = schedule.grid()
    flat = [x for r in grid for x in r]
    mx, mean = max(flat), sum(flat) / len(flat)
    lb = lb_gpu(problem, grid)
    peak = max((g.peak_bytes for s in schedule.indices for g in s.groups), default=0)
    metrics = TPMetrics(
        gpu_load=tuple(tuple(r) for r in grid), max_gpu_load=mx, mean_gpu_load=round(mean, 3),
        max_over_mean=round(mx / mean, 6) if mean else 1.0, lb_gpu=lb,
        gap_to_lb_gpu=round(mx / lb - 1, 6) if lb else 0.0,
        micro_groups=sum(len(s.groups) for s in schedule.indices),
        peak_gathered_bytes=peak, oversized_tasks=schedule.oversized,
        all_to_all_bytes=tuple(tuple(r) for r in a2a),
        modelled_step_s=round(max((s.makespan_s for s in schedule.indices), default=0.0), 9))
    st = schedule.settings
    return TPPlan(cmax_bytes=st.cmax_bytes, comm_dtype=schedule.comm_dtype, solver=st.solver,
                  status=schedule.status, hardware=st.hardware, layouts=layouts,
                  indices=tuple(indices), metrics=metrics)


def attach_tp(plan: Plan, problem: DPProblem, schedule: TPSchedule,
              ctx: TPContext | None = None) -> Plan:
    """``plan`` with every TP-split task's host and micro-group filled in and the TP section."""
    where: dict[int, tuple[int, int]] = {}
    for s in schedule.indices:
        for gi, g in enumerate(s.groups):
            for i, h in zip(g.tasks, g.hosts):
                where[i] = (h, gi)
    tasks = tuple(t if t.id not in where else
                  TaskPlan.model_validate({**t.model_dump(), "host": where[t.id][0],
                                           "micro_group": where[t.id][1]})
                  for t in plan.tasks)
    return plan.model_copy(update={"tasks": tasks, "tp": tp_plan(problem, schedule, ctx)})


def problem_from_plan(problem: DPProblem, plan: Plan) -> tuple[DPProblem, Cuts]:
    """``problem`` with every bucket's parameters in the plan's order (plans made with reordering
    move parameters inside buckets), and the plan's cuts."""
    import dataclasses

    cuts: Cuts = {}
    buckets = []
    by_key = {(b.buffer, b.bucket): b for b in problem.buckets}
    for bi, buf in enumerate(plan.buffers):
        for bp in buf.buckets:
            old = by_key[(bi, bp.index)]
            items = {old_it.tasks: old_it for old_it in old.items}
            by_name = {problem.tasks[t[0]].param: it for t, it in items.items()}
            new_items = tuple(
                Item(k, s.start, s.end, by_name[s.name].load, by_name[s.name].flops,
                     by_name[s.name].state_bytes, by_name[s.name].atomic, by_name[s.name].tasks)
                for k, s in enumerate(bp.slots))
            buckets.append(BucketProblem(bi, bp.index, bp.start, bp.end, old.ranks, new_items))
            cuts[(bi, bp.index)] = tuple(bp.cuts)
    return dataclasses.replace(problem, buckets=tuple(buckets)), cuts


def plan_tp(problem: DPProblem, plan: Plan, settings: TPSettings | None = None) -> Plan:
    """Schedule the TP side of a DP plan and return the plan with its TP section.

    Args:
        problem: the problem the plan was made from (``make_problem`` with the plan's inputs).
        plan: a DP plan (``partition.plan_dp``); its cut points and parameter order are used.
        settings: C_max and solver.
    """
    pr, cuts = problem_from_plan(problem, plan)
    ctx = TPContext.build(pr, plan.inputs.comm_dtype)
    sch = schedule_tp(pr, cuts, settings, comm_dtype=plan.inputs.comm_dtype, ctx=ctx, warn=True)
    return attach_tp(plan, pr, sch, ctx)
