"""The TP schedule of every DP index: hosts (the paper's global LPT with rollback, optionally
re-hosted by CP-SAT per group), micro-groups under C_max, their order (Johnson's rule) and the
modelled timeline; :func:`gpu_loads` evaluates a partition plus a schedule per GPU."""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from ..comm import all_to_all_busiest
from ..cost import DTYPE_BYTES
from ..errors import CanzonaError, OversizedTaskWarning
from ..formulas import LOCKSTEP_CMAX, lockstep_batches
from ..hardware import LinkProfile, load_hardware
from ..options import TPOptions
from ..planning import Cuts, DPProblem, SubRound, coupled, pair_owners
from .context import (TPContext, half_bytes, index_work, lockstep_scratch, lockstep_seconds,
                      pinned_at, round_piece, shared_by_index)

# --- schedule records -----------------------------------------------------------------------------


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
class SharedRun:
    """A task the TP group shares (shared Newton–Schulz over its TP shards, no gather), or its
    half that it shares with the same TP ranks at the ``partner`` DP index (``DPProblem.pairs``
    at tp > 1): each rank's ``load`` (cost units), its ``compute_s`` and ``comm_s``, and
    ``hidden_s`` of those beside its own Gram products (``sharing.ShareOption.hidden_s``)."""

    task: int
    split_poly: bool
    load: float
    compute_s: float
    comm_s: float
    hidden_s: float = 0.0
    #: the DP index whose TP group shares the task with this one (its half here, k = 2·tp)
    partner: int | None = None
    #: the round of TP sub-groups it is in (its load and seconds then 1/s of the round's)
    round: SubRound | None = None

    @property
    def seconds(self) -> float:
        """Alone: its compute, and the collectives its own Gram products do not hide."""
        return self.compute_s + self.comm_s - self.hidden_s


@dataclass(frozen=True, slots=True)
class IndexSchedule:
    """The TP schedule of one DP index: the shared tasks (run first, by every TP rank), then the
    micro-groups in execution order, and the modelled timeline."""

    dp_index: int
    tp: int
    base: tuple[float, ...]  # per rank: AdamW shard + replicated matrices + shared pieces
    groups: tuple[MicroGroup, ...]
    timeline: tuple[tuple[float, float, float, float, float, float], ...]  # per group, seconds:
    #   gather start/end, compute start/end, scatter start/end
    shared: tuple[SharedRun, ...] = ()

    def gpu_load(self) -> list[float]:
        load = list(self.base)  # the shared pieces are in the base
        for g in self.groups:
            for t in range(self.tp):
                load[t] += g.rank_load[t]
        return load

    #: the shared phase's modelled seconds (its tasks in lockstep) and its load per rank
    shared_phase_s: float = 0.0
    shared_load: float = 0.0

    @property
    def shared_s(self) -> float:
        return self.shared_phase_s

    @property
    def makespan_s(self) -> float:
        return max((x[5] for x in self.timeline), default=self.shared_s)


@dataclass(frozen=True, slots=True)
class TPSchedule:
    """Every DP index's TP schedule plus the per-GPU metrics."""

    options: TPOptions
    comm_dtype: str
    indices: tuple[IndexSchedule, ...]
    status: str
    oversized: tuple[str, ...]

    def grid(self) -> list[list[int]]:
        """Per-GPU load, dp × tp (cost-model units)."""
        return [[int(round(x)) for x in s.gpu_load()] for s in self.indices]


# --- greedy: global LPT with rollback -------------------------------------------------------------


def _make_group(ctx: TPContext, pairs: list[tuple[int, int]], tp: int,
                oversized: bool) -> MicroGroup:
    pairs = sorted(pairs, key=lambda x: (x[1], x[0]))  # wire order: by host, then task id
    loads, flops, mem = [0] * tp, [0] * tp, [0] * tp
    send = [[0] * tp for _ in range(tp)]
    pr = ctx.problem
    for i, h in pairs:
        loads[h] += pr.loads[i]
        flops[h] += pr.costs[i].flops
        mem[h] += ctx.gathered[i]
        for t, x in enumerate(ctx.sent(i, tp)):
            send[t][h] += x
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


# --- CP-SAT per group -----------------------------------------------------------------------------


def _cpsat_group(ctx: TPContext, pairs: list[tuple[int, int]], base: list[float], tp: int,
                 cap: int, settings: TPOptions) -> tuple[list[tuple[int, int]], str, float]:
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


# --- ordering and timeline ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Rates:
    flops_per_s: float
    link: LinkProfile  # the TP group's (intra-node)
    seconds_per_load: float | None = None  # loads in seconds (the ``roofline`` cost)

    def compute_s(self, g: MicroGroup) -> float:
        """The busiest host's compute in group ``g``: its load when loads are seconds, else
        its FLOPs at the rate."""
        if self.seconds_per_load is not None:
            return max(g.rank_load) * self.seconds_per_load
        return max(g.rank_flops) / self.flops_per_s


def _rates(hardware: str, seconds_per_load: float | None = None) -> _Rates:
    hw = load_hardware(hardware)
    return _Rates(hw.peak_flops["bf16"] * hw.compute_efficiency, hw.intra_node,
                  seconds_per_load)


def _a2a_seconds(g: MicroGroup, rates: _Rates, nbytes: int) -> float:
    """All-to-all time: the rank moving the most off-rank bytes (sent or received) sets it."""
    worst = all_to_all_busiest(g.gather_send)
    return 0.0 if worst == 0 else rates.link.seconds(worst * nbytes)


def _order_and_timeline(groups: list[MicroGroup], rates: _Rates, nbytes: int
                        ) -> tuple[list[MicroGroup], list[tuple[float, ...]]]:
    """Johnson's rule for the two-stage flow shop (gather, then compute), then the timeline.

    Groups whose gather is shorter than their compute go first, by increasing gather; the rest
    last, by decreasing compute. This minimises the pipelined makespan of gather + compute
    exactly; scatters then run on the communication stream as soon as it is free.
    """
    G = [_a2a_seconds(g, rates, nbytes) for g in groups]
    C = [rates.compute_s(g) for g in groups]
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


# --- the schedule ---------------------------------------------------------------------------------


def shared_phase_s(pr: DPProblem, runs: Sequence[SharedRun], cap: int) -> tuple[float, float]:
    """Seconds of one index's shared tasks as the runtime runs them (``runtime.tp_shared``): the
    halves it shares with a partner index first, then its TP group's own matrices, in batches
    whose scratch fits 2 · ``cap`` (C_max), each batch in lockstep (:func:`lockstep_seconds`; a
    half holds its rows of 2·tp). Returns (the batches holding a half, the others): partners
    finish the first together."""
    ordered = [x for x in runs if x.partner is not None] + [x for x in runs if x.partner is None]
    units, sizes = [], []  # a round of TP sub-groups is one unit: one piece per rank
    for x in ordered:
        if x.round is not None:
            if x.task == x.round.tasks[0]:
                r = x.round
                units.append((False, (r.compute_s, r.comm_s, r.hidden_s)))
                sizes.append(round_piece(pr, r)[4])
            continue
        units.append((x.partner is not None, (x.compute_s, x.comm_s, x.hidden_s)))
        if x.partner is None:
            sizes.append(lockstep_scratch(pr, x.task))
            continue
        sizes.append(half_bytes(pr, x.task, x.split_poly))
    first = rest = 0.0
    for b in lockstep_batches(units, sizes, LOCKSTEP_CMAX * cap):
        s = lockstep_seconds([piece for _, piece in b], pr.settings.ns_steps)
        if any(half for half, _ in b):
            first += s
        else:
            rest += s
    return first, rest


def schedule_index(ctx: TPContext, d: int, ids: list[int], base_value: float,
                   settings: TPOptions, budget: list[float] | None = None,
                   runs: tuple[SharedRun, ...] = (), phase_at_least: float = 0.0,
                   pinned: Sequence[float] | None = None) -> tuple[IndexSchedule, str]:
    """Schedule one DP index's TP-split tasks. ``budget``: remaining CP-SAT time (mutable);
    ``runs``: the tasks this index's TP group shares (``problem.shared``), run before the
    groups, in task order (halves shared with a partner index among them);
    ``phase_at_least``: seconds its shared phase lasts at least (its halves' part as long as
    its partner's: they exchange every iteration, so they finish it together); ``pinned``: the
    load each TP rank alone carries (:func:`~.context.index_work`), hosted around."""
    pr = ctx.problem
    tp = pr.sizes.tp
    if any(ctx.tp_of[i] != tp for i in ids):
        raise CanzonaError("expert tensor parallel size differs from tp; not supported yet.")
    cap = settings.cmax_bytes
    phase_s = 0.0
    if runs:
        # index_work counted each piece alone (max of its compute and collectives); the group
        # runs them in lockstep: its phase, at the profile's rate, replaces their sum (at
        # least the partners' phase where it shares a task with another index).
        phase_s = max(sum(shared_phase_s(pr, runs, cap)), phase_at_least)
        if pr.seconds_per_load is not None:
            phase_load = phase_s / pr.seconds_per_load
        else:
            rate = _rates(settings.hardware).flops_per_s
            unit = sum(pr.loads[x.task] for x in runs) / max(1, sum(pr.costs[x.task].flops
                                                                     for x in runs))
            phase_load = phase_s * rate * unit
        base_value += phase_load - sum(x.load for x in runs)
    else:
        phase_load = 0.0
    base = [base_value + p for p in (pinned or [0.0] * tp)]  # the shared phase included
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
    rates = _rates(settings.hardware, ctx.problem.seconds_per_load)
    groups, timeline = _order_and_timeline(groups, rates, DTYPE_BYTES[ctx.comm_dtype])
    # The shared phase runs first (its collectives involve every TP rank): the groups follow.
    if phase_s:
        timeline = [tuple(round(v + phase_s, 9) for v in row) for row in timeline]
    return IndexSchedule(d, tp, tuple(base), tuple(groups), tuple(timeline), runs,
                         phase_s, phase_load), status


def schedule_tp(problem: DPProblem, cuts: Cuts, options: TPOptions | None = None, *,
                ctx: TPContext | None = None, warn: bool = True) -> TPSchedule:
    """The TP schedule of every DP index for the DP partition ``cuts``.

    Args:
        problem: the DP problem (tasks, costs, layout).
        cuts: the DP cut points per (buffer, bucket).
        options: C_max, solver, time limits, comm dtype.
        ctx: the problem's :class:`TPContext`, if already built (with ``options.comm_dtype``).
        warn: emit an :class:`~canzona.planner.errors.OversizedTaskWarning` (a ``UserWarning``)
            naming the tasks larger than C_max; the CLI prints it as one note.
    """
    settings = options or TPOptions()
    ctx = ctx or TPContext.build(problem, settings.comm_dtype)
    if ctx.comm_dtype != settings.comm_dtype:
        raise ValueError(f"the TP context was built for comm dtype {ctx.comm_dtype}, the options "
                         f"say {settings.comm_dtype}")
    base, owned, pinned = index_work(problem, cuts, ctx)
    budget = [settings.total_time_limit_s]
    runs: list[list[SharedRun]] = [[] for _ in range(problem.dp)]
    owners = {i: d for d, ids in enumerate(shared_by_index(problem, cuts)) for i in ids}
    for i, d in sorted(owners.items()):
        load, split, comp, comm, hidden = problem.shared[i]
        runs[d].append(SharedRun(i, split, load, comp, comm, hidden,
                                 round=problem.rounds.get(i)))
    if problem.rounds:  # a round's members together, where its first task falls
        for r in runs:
            r.sort(key=lambda x: (x.round.tasks[0] if x.round else x.task, x.task))
    partners: list[set[int]] = [set() for _ in range(problem.dp)]
    if problem.pairs and problem.sizes.tp > 1:  # halves shared with a partner (k = 2·tp)
        for i, (a, b) in sorted(pair_owners(problem, cuts).items()):
            if a == b:
                raise CanzonaError(f"planner bug: both halves of task {i} "
                                   f"('{problem.tasks[i].name}') are on DP index {a}")
            x = problem.pairs[i]
            for d, e, load in ((a, b, x.loads[0]), (b, a, x.loads[1])):
                runs[d].append(SharedRun(i, x.split_poly, load, x.compute_s, x.comm_s,
                                         x.hidden_s, partner=e))
                partners[d].add(e)
        for r in runs:  # plan order: the halves first (both partners alike), then the own
            r.sort(key=lambda x: (x.partner is None,
                                  x.round.tasks[0] if x.round else x.task, x.task))
    parts = [shared_phase_s(problem, r, settings.cmax_bytes) if r else (0.0, 0.0)
             for r in runs]
    halves = coupled([h for h, _ in parts], partners)  # partners end their halves together
    phase = [h + own for h, (_, own) in zip(halves, parts)]
    indices = []
    statuses = []
    for d in range(problem.dp):
        s, st = schedule_index(ctx, d, owned[d], base[d], settings, budget, tuple(runs[d]),
                               phase[d] if partners[d] else 0.0,
                               pinned[d] if pinned else None)
        indices.append(s)
        statuses.append(st)
    oversized = tuple(problem.tasks[i].name for s in indices for g in s.groups if g.oversized
                      for i in g.tasks)
    if warn and oversized:
        warn_oversized(oversized, settings, stacklevel=3)
    if settings.solver == "greedy" or problem.sizes.tp == 1:
        status = "greedy"
    else:
        status = "cpsat-optimal" if all(s == "optimal" for s in statuses) else "cpsat-feasible"
    return TPSchedule(settings, ctx.comm_dtype, tuple(indices), status, oversized)


def warn_oversized(oversized: tuple[str, ...], settings: TPOptions, *, stacklevel: int = 2
                   ) -> None:
    """The :class:`~canzona.planner.errors.OversizedTaskWarning` (a ``UserWarning``) naming the
    matrices larger than C_max, which get a micro-group of their own."""
    shown = ", ".join(oversized[:5]) + (f" and {len(oversized) - 5} more" if len(oversized) > 5
                                        else "")
    warnings.warn(f"{len(oversized)} matrices exceed C_max = {settings.cmax_mib:g} MiB when "
                  f"gathered and get a micro-group of their own (raise C_max, --cmax or "
                  f"TPOptions.cmax_mib, to group them): {shown}.", OversizedTaskWarning,
                  stacklevel=stacklevel)


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
    base, owned, pinned = index_work(problem, cuts, ctx)
    tp = problem.sizes.tp
    out = []
    for d in range(problem.dp):
        load = [base[d] + p for p in pinned_at(pinned, d, tp)]
        heap = [(x, t) for t, x in enumerate(load)]
        heapq.heapify(heap)
        for i in sorted(owned[d], key=lambda i: (-problem.loads[i], i)):
            _, t = heapq.heappop(heap)
            load[t] += problem.loads[i]
            heapq.heappush(heap, (load[t], t))
        out.append(load)
    return out
