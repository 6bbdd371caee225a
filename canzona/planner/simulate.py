"""The step simulator: what one optimizer step of a plan costs on a cluster, rank by rank.

Torch-free. Two layers:

* **Plain data** (:class:`Workload`): per global rank the seconds of its local optimizer work, per
  DP bucket its collective times and the DP indices that join it, per DP index its TP micro-groups
  (gather / per-rank compute / scatter seconds). Anything that can say what a strategy does — a
  plan (:func:`workload_from_plan`), or a baseline built by hand (layer-wise, ``sc``, …) — is
  simulated by the same :func:`simulate`.
* **The adapter** :func:`workload_from_plan` turns a :class:`~canzona.planner.plan.Plan` and a
  :class:`~canzona.planner.hardware.HardwareProfile` into a workload: bucket collectives from
  :mod:`canzona.planner.comm` under the bucket's recorded ``method`` (α–β, the DP link of
  :func:`~canzona.planner.comm.plan_link`), TP all-to-alls from the micro-groups' element matrices
  (the TP link is ``hw.link(tp)``: NVLink when tp ≤ gpus_per_node), compute as
  ``FLOPs / (peak[dtype] · compute_efficiency)`` (matrix work and AdamW in ``bf16`` unless told);
  AdamW is a roofline, the larger of that and its memory traffic,
  :data:`ADAMW_BYTES_PER_ELEMENT` per element over ``memory_bandwidth``.

The model (a small deterministic event simulation; times in seconds, 0 = start of backward):

1. **Backward and the reduces.** Backward lasts ``backward_s``. A bucket's gradients are complete
   when backward has gone through its part of the buffer: buffers are laid out in reverse layer
   order, so bucket k of a buffer of S elements is ready at ``backward_s · end_k / S``. Each DP
   index has one DP communication stream; buckets are issued in ready order (ties: buffer, bucket)
   and a collective starts when it is ready and every joining index's stream is free (collectives
   are synchronous), then takes its α–β time. What ends before ``backward_s`` is hidden behind
   backward; the rest is the exposed ``dp_reduce``.
2. **The step** of DP index d starts when backward has ended and its reduces are done (the
   optimizer waits for all of them). On every TP rank of d, in the plan's group order: the gather
   all-to-all of group 0 starts; group k's compute on rank t starts when its gather has ended and
   t's compute stream is free; group k+1's gather is issued as soon as every rank has started
   group k's compute (it overlaps that compute); group k's scatter follows on the TP stream once
   every rank has finished group k (all-to-alls are synchronous over the TP group). This is the
   pipeline of :mod:`canzona.planner.tp.schedule`, with per-rank compute instead of the busiest
   rank's (equal to its ``modelled_s`` when the busiest rank is the same in every group). After
   its last group the rank computes its owned whole matrices (not TP-split) and its AdamW
   slices; it is done when that compute and the last scatter have ended.
3. **The all-gathers** of TP rank t's DP group start when every rank (·, t) that joins them is done,
   one after another in forward order (reverse of the reduce order). The parameters are ready at
   the last one's end. With ``overlap_param_gather`` they run into the next forward: only the part
   longer than ``forward_s`` is charged to the step.

Totals: the optimizer step is the time from the end of backward to the parameters ready on every
rank; the critical rank is the one done last (the all-gathers then wait for it; ties, to the
nanosecond: the one computing the most, then the lowest global rank). Its breakdown —
``dp_reduce`` (exposed), ``compute`` (the critical rank's compute seconds), ``tp_gather_scatter``
(its step span not spent computing: exposed TP all-to-alls and waiting for the TP group),
``dp_gather`` (exposed) — sums to the step time. Vocabulary padding makes the embedding and
output layer's AdamW slices a little larger than the logical shapes (the update runs on them).

What overlaps what (:meth:`StepSim.hidden`, and every rank's stages by stream in
:meth:`StepSim.rank_timeline`): the reduces with backward; the TP gather of group k+1 and the
scatter of group k with the compute of groups k and k+1; the all-gathers with the next forward
(``overlap_param_gather`` only). Compute, the DP stream and the TP stream run concurrently.

Iteration: :func:`forward_backward_seconds` is ``6 · N_active · tokens`` at a stated MFU, split
1 : 2 into forward and backward (:func:`split_forward_backward`); :func:`iteration_time` adds
the step's exposed time (simulate the step with that ``backward_s`` and ``forward_s``).

Not modelled: contention between the DP and TP streams or with backward's own kernels, NCCL's
coalescing of per-root calls (each pays α, as in ``comm``), launch overheads, the memory traffic
of the matrix optimizers (taken as compute-bound).
Deterministic: no randomness, fixed iteration orders, floats rounded to nanoseconds on output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .comm import ELEMENT_BYTES, all_to_all_busiest, bucket_comm, buffer_slices, plan_link
from . import optimizers
from .errors import CanzonaError
from .hardware import HardwareProfile, LinkProfile, hardware_names, load_hardware
from .plan import Plan
from .formulas import LOCKSTEP_CMAX
from .planning import coupled
from .sharing import (Run, lockstep_batches, lockstep_bytes, lockstep_seconds, pair_link,
                      pair_timeline, shared_piece, tp_pair_piece)

#: AdamW's memory traffic per element: fp32 master parameter read and written (8), fp32 gradient
#: read (4), two fp32 moments read and written (16), the bf16 parameter written (2).
ADAMW_BYTES_PER_ELEMENT = 30

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


# --- the plan adapter -----------------------------------------------------------------------------


def _a2a(matrix: Sequence[Sequence[int]], elem_bytes: int, link: LinkProfile) -> tuple[float, int]:
    """All-to-all time and busiest rank's off-rank bytes for ``matrix[src][dst]`` elements."""
    b = all_to_all_busiest(matrix) * elem_bytes
    return (link.seconds(b) if b else 0.0), b


def workload_from_plan(plan: Plan, hw: HardwareProfile, *, matrix_dtype: str = "bf16",
                       adamw_dtype: str = "bf16") -> Workload:
    """The workload of ``plan`` on ``hw`` (the bucket methods the plan records)."""
    inp = plan.inputs
    dp, tp, ep = inp.dp, inp.tp, inp.ep
    _, dp_link = plan_link(hw, dp, tp)
    tp_link = hw.link(tp)
    mat_rate = hw.peak_flops[matrix_dtype] * hw.compute_efficiency
    adam_rate = hw.peak_flops[adamw_dtype] * hw.compute_efficiency
    if tp > 1 and plan.tp is None:
        raise ValueError("plan has tp > 1 but no TP schedule")

    # Buckets: collectives under the recorded method; ready at their end's share of the buffer.
    buckets: list[BucketWork] = []
    slices = buffer_slices(plan.buffers, ep)
    k = 0
    for bi, buf in enumerate(plan.buffers):
        total = max((b.end for b in buf.buckets), default=0) or 1
        for b in buf.buckets:
            s = slices[k]
            k += 1
            c = bucket_comm(b.method, s.sizes, grad_bytes=s.grad_bytes,
                            param_bytes=s.param_bytes, link=dp_link)
            buckets.append(BucketWork(f"{bi}.{b.index}", b.end / total, s.dp_indices,
                                      c.reduce.seconds(dp_link), c.gather.seconds(dp_link),
                                      b.method, c.reduce.busiest, c.gather.busiest))

    # Element-wise (unowned) tasks: FLOPs per element of the logical parameter.
    per_elem: dict[str, list[int]] = {}
    for task in plan.tasks:
        if task.owner is None:
            acc = per_elem.setdefault(task.param, [0, 0])
            acc[0] += task.flops
            acc[1] += math.prod(task.shape) if task.shape else 1
    adam_flops = [0.0] * (dp * tp)
    adam_elems = [0] * (dp * tp)
    for buf in plan.buffers:
        for b in buf.buckets:
            for slot in b.slots:
                acc = per_elem.get(slot.name)
                if acc is None or acc[1] == 0:
                    continue
                for r in range(len(b.cuts) - 1):
                    lo, hi = max(slot.start, b.cuts[r]), min(slot.end, b.cuts[r + 1])
                    if hi <= lo:
                        continue
                    d = r * ep + buf.ep_rank if buf.expert else r
                    f = acc[0] * (hi - lo) / acc[1]  # the slot is this TP rank's shard
                    for t in range(tp):
                        adam_flops[d * tp + t] += f
                        adam_elems[d * tp + t] += hi - lo

    # Matrix tasks outside the micro-groups: whole on every TP rank of the owner (replicated or
    # tp = 1). Tasks in micro-groups: on their host, in their group.
    grouped = set()
    if plan.tp is not None:
        for ix in plan.tp.indices:
            for g in ix.groups:
                grouped.update(gt.id for gt in g.tasks)
            grouped.update(x.id for x in ix.shared)
    # DP pairs at tp = 1 (at tp > 1 a pair's halves are in its two TP groups' shared phases)
    pairs = {x.id: x for x in plan.dp_shared} if tp == 1 else {}
    mat_flops = [0] * (dp * tp)
    waits = [0.0] * (dp * tp)  # DP pairs: their runs' time beyond the pieces' own compute
    for task in plan.tasks:
        if task.owner is not None and task.id not in grouped and task.id not in pairs:
            for t in range(tp):
                mat_flops[task.owner * tp + t] += task.flops
    runs: dict[tuple[int, tuple[int, int]], list[Run]] = {}
    for x in pairs.values():  # tp = 1: each of the two ranks computes its piece
        for d, f in zip(x.owners, x.flops):
            mat_flops[d] += f
        if inp.optimizer.name == "muon":  # shared Newton–Schulz: exchanges with the partner
            rows, cols = plan.tasks[x.id].shape
            o = shared_piece("dp", 2, x.split_poly, max(rows, cols), min(rows, cols),
                             inp.optimizer.ns_steps, ELEMENT_BYTES[matrix_dtype],
                             pair_link(hw, x.owners), rate=mat_rate, exchange=rows < cols)
            runs.setdefault((x.phase, tuple(x.owners)), []).append(
                (o.piece_flops / mat_rate, o.comm_s, o.hidden_s))
    # The runtime runs the pairs first, phase by phase, each pair's matrices in lockstep: a pair
    # starts when both partners are free, so waits chain along pairs of later phases.
    free = pair_timeline(runs, inp.optimizer.ns_steps, dp * tp)
    for (_, pair), pieces in runs.items():
        for d in pair:
            waits[d] -= sum(c for c, _, _ in pieces)
    waits = [w + f for w, f in zip(waits, free)]

    flops_of = {task.id: task.flops for task in plan.tasks}
    groups: list[tuple[GroupWork, ...]] = []
    if plan.tp is not None:
        eb = ELEMENT_BYTES[plan.tp.comm_dtype]
        by_index = {ix.dp_index: ix for ix in plan.tp.indices}
        steps = inp.optimizer.ns_steps
        # d → (FLOPs, seconds of the halves' part, of the own part, compute)
        phases: dict[int, tuple[int, float, float, float]] = {}
        partners: list[set[int]] = [set() for _ in range(dp)]
        for d in range(dp):
            ix = by_index.get(d)
            if ix is not None and ix.shared:
                # The shared tasks first, every TP rank alike, in lockstep: each rank's
                # Newton–Schulz FLOPs, the Gram all-reduces (and split-polynomial all-gathers)
                # of each matrix running while the others compute (``lockstep_seconds``); a
                # half shared with a partner index over k = 2·tp (``tp_pair_piece``).
                fl, pieces, sizes, half = 0, [], [], []
                cap = LOCKSTEP_CMAX * plan.tp.cmax_bytes
                for x in ix.shared:
                    if inp.optimizer.name == "shampoo":  # its own shard's blocks, no collective
                        piece = optimizers.get("shampoo").flops(
                            *plan.tp.layouts[x.layout].local_shape, inp.optimizer)
                        fl += piece
                        pieces.append((piece / mat_rate, 0.0, 0.0))
                        sizes.append(0)
                        half.append(False)
                        continue
                    rows, cols = plan.tasks[x.id].shape
                    m, n = max(rows, cols), min(rows, cols)
                    if x.partner is None:
                        k = tp
                        o = shared_piece("tp", tp, x.split_poly, m, n, steps,
                                         ELEMENT_BYTES[matrix_dtype], tp_link, rate=mat_rate)
                    else:
                        k = 2 * tp
                        partners[d].add(x.partner)
                        o = tp_pair_piece(tp, x.split_poly, m, n, steps,
                                          ELEMENT_BYTES[matrix_dtype], tp_link, hw.link(2 * tp),
                                          rate=mat_rate)
                    fl += o.piece_flops
                    pieces.append((o.piece_flops / mat_rate, o.comm_s, o.hidden_s))
                    sizes.append(lockstep_bytes(-(-m // k), n, k, x.split_poly,
                                                ELEMENT_BYTES[matrix_dtype]))
                    half.append(x.partner is not None)
                # the runtime runs the halves first, then the own matrices (``runtime.tp``):
                # the batches holding a half end together on both partners
                order = sorted(range(len(pieces)), key=lambda j: not half[j])
                secs = [0.0, 0.0]
                for b in lockstep_batches(order, [sizes[j] for j in order], cap):
                    secs[0 if any(half[j] for j in b) else 1] += \
                        lockstep_seconds([pieces[j] for j in b], steps)
                phases[d] = (fl, secs[0], secs[1], sum(c for c, _, _ in pieces))
        # partners exchange every iteration: they end their halves' part together
        ends = coupled([phases[d][1] if d in phases else 0.0 for d in range(dp)], partners)
        for d in range(dp):
            ix = by_index.get(d)
            gs = []
            if d in phases:
                fl, _, own, comp = phases[d]
                # compute as compute; what the lockstep does not hide of the collectives as TP
                gs.append(GroupWork(0.0, max(0.0, ends[d] + own - comp), (comp,) * tp, 0,
                                    (fl,) * tp, barrier=True))
            for g in (ix.groups if ix else ()):
                fl = [0] * tp
                for gt in g.tasks:
                    fl[gt.host] += flops_of[gt.id]
                gs_s, gb = _a2a(g.gather_send, eb, tp_link)
                sc_s, _ = _a2a(g.scatter_send, eb, tp_link)
                gs.append(GroupWork(gs_s, sc_s, tuple(f / mat_rate for f in fl), gb, tuple(fl)))
            groups.append(tuple(gs))

    ranks = tuple(RankWork(mat_flops[r] / mat_rate + waits[r],
                           max(adam_flops[r] / adam_rate,
                               adam_elems[r] * ADAMW_BYTES_PER_ELEMENT / hw.memory_bandwidth),
                           mat_flops[r], int(round(adam_flops[r]))) for r in range(dp * tp))
    notes = (f"hardware {hw.name} v{hw.version}; matrix work in {matrix_dtype} at "
             f"{hw.compute_efficiency:g} of peak; AdamW in {adamw_dtype}, or its "
             f"{ADAMW_BYTES_PER_ELEMENT} B/element over {hw.memory_bandwidth / 1e12:g} TB/s "
             f"if slower",
             f"DP link {'intra' if dp_link is hw.intra_node else 'inter'}-node "
             f"({dp_link.busbw / 1e9:g} GB/s, α {dp_link.latency_s * 1e6:g} µs); TP link "
             f"{'intra' if tp_link is hw.intra_node else 'inter'}-node")
    if (plan.comm.hardware, plan.comm.hardware_version) != (hw.name, hw.version):
        notes += (f"the plan's bucket methods were chosen for {plan.comm.hardware} "
                  f"v{plan.comm.hardware_version}; simulated as recorded on {hw.name}",)
    label = f"{inp.model} dp{dp} tp{tp}" + (f" ep{ep}" if ep > 1 else "") + \
        f" {inp.solver.strategy}"
    return Workload(dp, tp, ranks, tuple(buckets), tuple(groups) if plan.tp is not None else (),
                    label, notes)


def plan_hardware(plan: Plan, name: str | None = None) -> HardwareProfile:
    """The profile to simulate ``plan`` on: ``name`` (a built-in profile or a file), else the one
    the plan records (``plan.comm.hardware``).

    Raises:
        CanzonaError: an unknown name or a bad file, or a recorded profile that is not built in.
    """
    if name is not None:
        return load_hardware(name)
    rec = plan.comm.hardware
    if rec.lower() not in hardware_names():
        raise CanzonaError(f"the plan was made with hardware profile '{rec}', which is not "
                           f"built in; give --hardware {'|'.join(hardware_names())} or a "
                           f"profile file (.json).")
    return load_hardware(rec)


def simulate_plan(plan: Plan, hw: HardwareProfile, *, backward_s: float = 0.0,
                  overlap_param_gather: bool = False, forward_s: float = 0.0,
                  matrix_dtype: str = "bf16", adamw_dtype: str = "bf16") -> StepSim:
    """:func:`simulate` of :func:`workload_from_plan`."""
    work = workload_from_plan(plan, hw, matrix_dtype=matrix_dtype, adamw_dtype=adamw_dtype)
    return simulate(work, backward_s=backward_s, overlap_param_gather=overlap_param_gather,
                    forward_s=forward_s)
