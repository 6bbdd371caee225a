"""The step simulator's engine: the plain-data :class:`Workload`, the event simulation
:func:`simulate` of one step and the iteration model (:mod:`canzona.planner.simulate` describes
the model). Torch-free; it reads nothing of the planner but the hardware profile."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..hardware import HardwareProfile

#: Decimal places of seconds in :meth:`StepSim.to_dict` (nanoseconds).
ROUND = 9


def _r(x: float) -> float:
    return round(float(x), ROUND)


# --- plain data -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BucketWork:
    """One DP bucket's collectives: a reduce during backward, a gather after the step.

    ``ready`` is the fraction of backward after which the bucket's gradients are complete
    (0 < ready ≤ 1); ``dp_indices`` the DP indices that join the collectives.
    """

    name: str
    ready: float
    dp_indices: tuple[int, ...]
    reduce_s: float
    gather_s: float
    method: str = ""
    reduce_bytes: int = 0  # busiest rank's bytes
    gather_bytes: int = 0
    #: Whether ``overlap_param_gather`` may run the gather into the next forward (False: the
    #: optimizer waits for it, as the layer-wise optimizer's all-gather inside ``step``).
    overlappable: bool = True


@dataclass(frozen=True, slots=True)
class GroupWork:
    """One TP micro-group of a DP index: synchronous gather and scatter, per-TP-rank compute."""

    gather_s: float
    scatter_s: float
    compute_s: tuple[float, ...]
    gather_bytes: int = 0  # busiest rank's off-rank bytes, one direction
    flops: tuple[int, ...] = ()
    #: the next group's gather waits for this group's end (the shared phase: its collectives
    #: use the TP group, and the runtime finishes it before the first gather)
    barrier: bool = False


@dataclass(frozen=True, slots=True)
class RankWork:
    """A global rank's local optimizer work (outside the micro-groups)."""

    # owned whole matrices (tp = 1, or replicated under TP); DP pairs' pieces and their exchanges
    matrix_s: float = 0.0
    adamw_s: float = 0.0  # element-wise updates of its slices
    matrix_flops: int = 0
    adamw_flops: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    """What one optimizer step does, as plain data.

    ``ranks`` has dp·tp entries in global-rank order (rank = d·tp + t); ``groups[d]`` are DP
    index d's micro-groups in execution order (empty at tp = 1).
    """

    dp: int
    tp: int
    ranks: tuple[RankWork, ...]
    buckets: tuple[BucketWork, ...]
    groups: tuple[tuple[GroupWork, ...], ...] = ()
    label: str = ""
    notes: tuple[str, ...] = ()
    #: False: a micro-group's gather waits until the previous group's compute and scatter have
    #: ended on every rank (no prefetch; Megatron's ``duplicated`` TP Muon, one matrix at a time).
    tp_pipelined: bool = True

    def __post_init__(self) -> None:
        if len(self.ranks) != self.dp * self.tp:
            raise ValueError(f"ranks: need dp·tp = {self.dp * self.tp} entries, got "
                             f"{len(self.ranks)}")
        if self.groups and len(self.groups) != self.dp:
            raise ValueError(f"groups: need one tuple per DP index ({self.dp}), got "
                             f"{len(self.groups)}")
        for b in self.buckets:
            if not 0.0 <= b.ready <= 1.0 or any(not 0 <= d < self.dp for d in b.dp_indices):
                raise ValueError(f"bucket {b.name}: ready must be in [0, 1] and DP indices "
                                 f"in [0, {self.dp})")
        for gs in self.groups:
            for g in gs:
                if len(g.compute_s) != self.tp:
                    raise ValueError("every micro-group needs one compute time per TP rank")


# --- results --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stage:
    """One interval on one stream (``dp``/``tp`` communication, ``compute``, ``backward``,
    ``wait``); a DP collective names the DP indices that join it (``members``)."""

    name: str
    stream: str
    start: float
    end: float
    members: tuple[int, ...] = ()

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class RankSim:
    rank: int
    dp_index: int
    tp_rank: int
    step_start: float  # backward end, or its reduces' end if later
    done: float  # its own update finished (compute and scatters)
    compute_s: float
    matrix_s: float
    adamw_s: float
    group_compute_s: float
    tp_comm_s: float  # its TP gathers + scatters (durations)
    stages: tuple[Stage, ...]

    @property
    def span(self) -> float:
        return self.done - self.step_start


@dataclass(frozen=True, slots=True)
class StepSim:
    """The simulated step of one workload (seconds; 0 = start of backward)."""

    label: str
    dp: int
    tp: int
    backward_s: float
    forward_s: float
    overlap_param_gather: bool
    ranks: tuple[RankSim, ...]
    reduces: tuple[Stage, ...]  # per bucket, in issue order (the same for every TP rank)
    gathers: tuple[tuple[Stage, ...], ...]  # per TP rank, in issue order
    params_ready: float
    critical_rank: int
    notes: tuple[str, ...] = field(default=())

    @property
    def reduce_end(self) -> float:
        return max((s.end for s in self.reduces), default=0.0)

    def _busiest(self, stages: Sequence[Stage]) -> float:
        per = [0.0] * self.dp
        for s in stages:
            for d in s.members:
                per[d] += s.seconds
        return max(per, default=0.0)

    @property
    def dp_reduce_total(self) -> float:
        """Reduce seconds of the DP index joining the most."""
        return self._busiest(self.reduces)

    @property
    def dp_reduce_exposed(self) -> float:
        return self.ranks[self.critical_rank].step_start - self.backward_s

    @property
    def dp_gather_total(self) -> float:
        return max((self._busiest(g) for g in self.gathers), default=0.0)

    @property
    def gather_end(self) -> float:
        return max((s.end for g in self.gathers for s in g), default=0.0)

    @property
    def dp_gather_exposed(self) -> float:
        return self.params_ready - self.ranks[self.critical_rank].done

    @property
    def step_s(self) -> float:
        """End of backward → parameters ready on every rank."""
        return self.params_ready - self.backward_s

    @property
    def reduced_step_s(self) -> float:
        """The step as the paper counts it: from the gradients reduced to the parameters ready
        (the reduction's exposed part counts in backward, not in the optimizer step)."""
        return self.step_s - self.breakdown()["dp_reduce"]

    def breakdown(self) -> dict[str, float]:
        """The critical path, summing to :attr:`step_s`."""
        c = self.ranks[self.critical_rank]
        return {"compute": c.compute_s, "tp_gather_scatter": _clip(c.span - c.compute_s),
                "dp_reduce": self.dp_reduce_exposed, "dp_gather": self.dp_gather_exposed}

    def hidden(self) -> dict[str, float]:
        """Communication overlapped with other work (seconds)."""
        c = self.ranks[self.critical_rank]
        tp_exposed = c.span - c.compute_s
        return {"dp_reduce_behind_backward": max(0.0, self.dp_reduce_total
                                                 - max(0.0, self.reduce_end - self.backward_s)),
                "tp_behind_compute": max(0.0, c.tp_comm_s - tp_exposed),
                "dp_gather_behind_forward": max(0.0, self.gather_end - self.params_ready)}

    def rank_timeline(self, rank: int) -> tuple[Stage, ...]:
        """Everything rank ``rank`` does, by start: backward, the reduces it joins, waiting for
        them, its own stages, the all-gathers it joins."""
        r = self.ranks[rank]
        out = [Stage("backward", "compute", 0.0, self.backward_s)] if self.backward_s > 0 else []
        out += [s for s in self.reduces if r.dp_index in s.members]
        if r.step_start > self.backward_s:
            out.append(Stage("wait reduces", "wait", self.backward_s, r.step_start))
        out += r.stages
        out += [s for s in self.gathers[r.tp_rank] if r.dp_index in s.members]
        order = {"backward": 0, "dp": 1, "tp": 2, "wait": 3, "compute": 4}
        return tuple(sorted(out, key=lambda s: (s.start, order.get(s.stream, 4), s.end)))

    def top_ranks(self, n: int) -> list[RankSim]:
        """The ``n`` ranks done last (ties: the most compute first, then the lowest rank)."""
        return sorted(self.ranks, key=_lateness)[:n]

    def to_dict(self, *, stages: bool = True) -> dict:
        """Everything, JSON-ready, floats rounded to nanoseconds."""
        def st(s: Stage) -> list:
            row = [s.name, s.stream, _r(s.start), _r(s.end)]
            return row + [list(s.members)] if s.members else row

        c = self.ranks[self.critical_rank]
        out: dict = {
            "label": self.label, "dp": self.dp, "tp": self.tp,
            "backward_s": _r(self.backward_s), "forward_s": _r(self.forward_s),
            "overlap_param_gather": self.overlap_param_gather,
            "step_s": _r(self.step_s),
            "breakdown": {k: _r(v) for k, v in self.breakdown().items()},
            "hidden": {k: _r(v) for k, v in self.hidden().items()},
            "totals": {"dp_reduce_s": _r(self.dp_reduce_total),
                       "dp_gather_s": _r(self.dp_gather_total),
                       "reduce_end_s": _r(self.reduce_end),
                       "params_ready_s": _r(self.params_ready)},
            "critical": {"rank": c.rank, "dp_index": c.dp_index, "tp_rank": c.tp_rank},
            "notes": list(self.notes),
            "ranks": [],
        }
        for r in self.ranks:
            row = {"rank": r.rank, "dp_index": r.dp_index, "tp_rank": r.tp_rank,
                   "step_start_s": _r(r.step_start), "done_s": _r(r.done), "span_s": _r(r.span),
                   "compute_s": _r(r.compute_s), "matrix_s": _r(r.matrix_s),
                   "adamw_s": _r(r.adamw_s), "group_compute_s": _r(r.group_compute_s),
                   "tp_comm_s": _r(r.tp_comm_s), "idle_s": _r(r.span - r.compute_s)}
            if stages:
                row["stages"] = [st(s) for s in r.stages]
            out["ranks"].append(row)
        if stages:
            out["reduces"] = [st(s) for s in self.reduces]
            out["gathers"] = [[st(s) for s in g] for g in self.gathers]
        return out


def _clip(x: float) -> float:
    """0 for float noise below a picosecond (a span equal to its compute)."""
    return 0.0 if abs(x) < 1e-12 else x


def _lateness(r: RankSim) -> tuple[float, float, int]:
    """Sort key of the critical rank: done last; on ties (a TP group's ranks end together at its
    last scatter) the one computing the most, then the lowest rank."""
    return (-_r(r.done), -_r(r.compute_s), r.rank)


# --- the simulation -------------------------------------------------------------------------------


def simulate(work: Workload, *, backward_s: float = 0.0, overlap_param_gather: bool = False,
             forward_s: float = 0.0) -> StepSim:
    """Simulate one step of ``work`` (see the module docstring for the model).

    Args:
        backward_s: how long backward runs; the reduces hide behind it (0: nothing hidden).
        overlap_param_gather: the all-gathers run into the next forward, which hides up to
            ``forward_s`` of them.
    """
    if backward_s < 0 or forward_s < 0:
        raise ValueError("backward_s and forward_s must be ≥ 0")
    dp, tp = work.dp, work.tp
    B = float(backward_s)

    # 1. Reduces, in ready order, on the DP streams (one per DP index; same on every TP rank).
    order = sorted(range(len(work.buckets)), key=lambda k: (work.buckets[k].ready, k))
    free = [0.0] * dp
    reduce_end = [B] * dp
    reduces: list[Stage] = []
    for k in order:
        b = work.buckets[k]
        start = max([b.ready * B] + [free[d] for d in b.dp_indices])
        end = start + b.reduce_s
        for d in b.dp_indices:
            free[d] = end
            reduce_end[d] = max(reduce_end[d], end)
        reduces.append(Stage(f"reduce {b.name}", "dp", start, end, tuple(b.dp_indices)))
    step_start = [max(B, reduce_end[d]) for d in range(dp)]

    # 2. Per DP index: the micro-group pipeline on its TP group, then local work per rank.
    ranks: list[RankSim] = []
    for d in range(dp):
        groups = work.groups[d] if work.groups else ()
        t0 = step_start[d]
        cfree = [t0] * tp
        comp_total = [0.0] * tp
        stages: list[list[Stage]] = [[] for _ in range(tp)]
        tp_comm = 0.0
        last_scatter = t0
        if groups:
            comm = t0
            g_start, g_end = t0, t0 + groups[0].gather_s
            comm = g_end
            for k, g in enumerate(groups):
                for t in range(tp):
                    stages[t].append(Stage(f"gather g{k}", "tp", g_start, g_end))
                starts = [max(g_end, cfree[t]) for t in range(tp)]
                if k + 1 < len(groups) and work.tp_pipelined and not g.barrier:
                    # once every rank started group k
                    n_start = max(comm, max(starts))
                    n_end = n_start + groups[k + 1].gather_s
                    comm = n_end
                ends = []
                for t in range(tp):
                    e = starts[t] + g.compute_s[t]
                    if g.compute_s[t] > 0:
                        stages[t].append(Stage(f"compute g{k}", "compute", starts[t], e))
                    comp_total[t] += g.compute_s[t]
                    cfree[t] = e
                    ends.append(e)
                s_start = max(comm, max(ends))
                s_end = s_start + g.scatter_s
                comm = s_end
                last_scatter = s_end
                if k + 1 < len(groups) and (not work.tp_pipelined or g.barrier):
                    n_start = s_end
                    n_end = n_start + groups[k + 1].gather_s
                    comm = n_end
                tp_comm += g.gather_s + g.scatter_s
                if g.scatter_s > 0:
                    for t in range(tp):
                        stages[t].append(Stage(f"scatter g{k}", "tp", s_start, s_end))
                if k + 1 < len(groups):
                    g_start, g_end = n_start, n_end
        for t in range(tp):
            rank = d * tp + t
            w = work.ranks[rank]
            x = cfree[t]
            if w.matrix_s > 0:
                stages[t].append(Stage("matrices", "compute", x, x + w.matrix_s))
                x += w.matrix_s
            if w.adamw_s > 0:
                stages[t].append(Stage("adamw", "compute", x, x + w.adamw_s))
                x += w.adamw_s
            done = max(x, last_scatter)
            comp = comp_total[t] + w.matrix_s + w.adamw_s
            ranks.append(RankSim(rank, d, t, t0, done, comp, w.matrix_s, w.adamw_s,
                                 comp_total[t], tp_comm, tuple(stages[t])))

    # 3. All-gathers per TP rank's DP group, forward order (reverse of the reduce order).
    gathers: list[tuple[Stage, ...]] = []
    gather_end = 0.0
    must_end = 0.0  # gathers the step waits for, whatever overlap_param_gather says
    for t in range(tp):
        gfree = [max(free[d], ranks[d * tp + t].done) for d in range(dp)]
        out = []
        for k in reversed(order):
            b = work.buckets[k]
            if not b.dp_indices:
                continue
            start = max(gfree[d] for d in b.dp_indices)
            end = start + b.gather_s
            for d in b.dp_indices:
                gfree[d] = end
            out.append(Stage(f"gather {b.name}", "dp", start, end, tuple(b.dp_indices)))
            gather_end = max(gather_end, end)
            if not (overlap_param_gather and b.overlappable):
                must_end = max(must_end, end)
        gathers.append(tuple(out))
    all_done = max((r.done for r in ranks), default=B)
    params_ready = max(all_done, gather_end, must_end)
    if overlap_param_gather:
        params_ready = max(all_done, gather_end - forward_s, must_end)
    critical = min(ranks, key=_lateness).rank if ranks else 0
    return StepSim(work.label, dp, tp, B, float(forward_s), overlap_param_gather, tuple(ranks),
                   tuple(reduces), tuple(gathers), params_ready, critical, work.notes)


# --- iteration model ------------------------------------------------------------------------------


def forward_backward_seconds(active_params: float, tokens: float, hw: HardwareProfile, *,
                             world: int, mfu: float = 0.4, dtype: str = "bf16") -> float:
    """Forward + backward time of one iteration: ``6 · N_active · tokens / (world · peak · mfu)``
    (``tokens`` is the global batch in tokens; attention FLOPs and pipeline bubbles ignored).
    Backward is about two thirds of it (:func:`split_forward_backward`)."""
    return 6.0 * active_params * tokens / (world * hw.peak_flops[dtype] * mfu)


def split_forward_backward(forward_backward_s: float) -> tuple[float, float]:
    """(forward_s, backward_s): backward does twice forward's FLOPs."""
    return forward_backward_s / 3.0, 2.0 * forward_backward_s / 3.0


def iteration_time(forward_backward_s: float, step: StepSim) -> float:
    """One iteration: forward + backward, plus the optimizer step's exposed part (its reduces
    beyond backward, its compute and TP traffic, its all-gathers beyond the next forward). The
    ``step`` should be simulated with ``backward_s`` (and ``forward_s``) from
    :func:`split_forward_backward` of the same ``forward_backward_s``."""
    return forward_backward_s + step.step_s
