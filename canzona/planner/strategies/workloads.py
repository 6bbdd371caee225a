"""The workloads of the strategies ``canzona compare`` simulates (torch-free): every strategy of
the registry (:mod:`canzona.planner.strategies.registry`) becomes a
:class:`~canzona.planner.simulate.Workload` of the same problem, hardware and compute, AdamW and
link formulas: the whole-parameter ones are charged here (:class:`_Builder`), the planned ones
come from their plans (:func:`~canzona.planner.simulate.workload_from_plan`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .. import comm as cm
from ..baselines import Dealing, megatron_packed
from ..cost import Roofline, TaskCost
from ..formulas import ADAMW_BYTES_PER_ELEMENT
from ..hardware import HardwareProfile
from ..plan import Plan
from ..planning import DPProblem, equal_cuts, owner_of
from ..simulate import BucketWork, GroupWork, RankWork, Workload, workload_from_plan
from ..tp import TPContext

#: A strategy's workload, and the logical FLOPs and state bytes it charges each DP index.
Built = tuple[Workload, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class WorkloadInputs:
    """What a strategy's workload is built from: the problem and hardware, the strategy's own
    plan (the planned strategies), the dtypes the matrix optimizer and AdamW compute in, and the
    collective of the layer-wise all-gathers (``per_root`` on NCCL, ``padded`` on gloo)."""

    problem: DPProblem
    hw: HardwareProfile
    plan: Plan | None = None
    matrix_dtype: str = "bf16"
    adamw_dtype: str = "bf16"
    gather_method: str = cm.PER_ROOT


# --- shared pieces --------------------------------------------------------------------------------


class _Builder:
    """Per-rank work of a whole-parameter strategy: owners, AdamW elements and the TP gathers."""

    def __init__(self, x: WorkloadInputs) -> None:
        problem, hw = x.problem, x.hw
        self.problem, self.hw = problem, hw
        self.dp, self.tp = problem.dp, problem.sizes.tp
        self.ctx = TPContext.build(problem, problem.comm_dtype)
        self.roof, self.adam_roof = Roofline.of(hw, x.matrix_dtype), Roofline.of(hw, x.adamw_dtype)
        self.tp_link = hw.link(self.tp)
        self.dp_link = cm.plan_link(hw, self.dp, self.tp)[1]
        n = self.dp * self.tp
        self.mat_flops = [0] * n
        self.mat_s = [0.0] * n  # each task at its roofline
        self.adam_flops = [0.0] * n
        self.adam_elems = [0] * n
        self.groups: list[list[GroupWork]] = [[] for _ in range(self.dp)]
        self.dp_flops = [0.0] * self.dp  # logical FLOPs and state bytes per DP index
        self.dp_state = [0.0] * self.dp
        # AdamW FLOPs per element of the TP-local slot (logical FLOPs / logical elements).
        self.per_elem = {}
        for t, c in zip(problem.tasks, problem.costs):
            if t.optimizer != "matrix":
                self.per_elem[t.param] = c.flops / max(1, math.prod(t.shape) if t.shape else 1)

    def adamw(self, d: int, item, elements: int) -> None:
        """DP index ``d`` updates ``elements`` of ``item`` (an AdamW slot) on every TP rank."""
        f = self.per_elem[self.problem.tasks[item.tasks[0]].param] * elements
        share = elements / max(1, item.end - item.start)
        self.dp_flops[d] += item.flops * share
        self.dp_state[d] += item.state_bytes * share
        for t in range(self.tp):
            self.adam_flops[d * self.tp + t] += f
            self.adam_elems[d * self.tp + t] += elements

    def matrix(self, d: int, item, *, duplicated: bool) -> None:
        """DP index ``d`` updates the whole matrix ``item``: replicated (or tp = 1) on every TP
        rank; TP-split ones all-gathered and computed on every TP rank (``duplicated``)."""
        self.dp_flops[d] += item.flops
        self.dp_state[d] += item.state_bytes
        for i in item.tasks:
            fl = self.problem.costs[i].flops
            sec = self.roof.seconds(self.problem.costs[i])
            if self.ctx.split[i] and duplicated:
                m = self.ctx.maps[self.ctx.layout[i]]
                received = max(m.full_numel - x for x in self.ctx.sent(i, self.tp))
                b = received * cm.ELEMENT_BYTES[self.problem.comm_dtype]
                g = self.tp_link.seconds(b) if b else 0.0
                self.groups[d].append(GroupWork(g, 0.0, (sec,) * self.tp, b, (fl,) * self.tp))
            else:  # replicated: all of it on every rank; a weight's heads: 1/tp each
                for t in range(self.tp):
                    self.mat_flops[d * self.tp + t] += int(self.ctx.each_rank(i, fl))
                    self.mat_s[d * self.tp + t] += self.ctx.each_rank(i, sec)

    def fragment(self, d: int, item, share: float) -> None:
        """zero1: DP index ``d`` applies the optimizer to ``share`` of a matrix, each TP rank to
        its own shard of it (split matrices) or all of it (replicated)."""
        self.dp_flops[d] += item.flops * share
        self.dp_state[d] += item.state_bytes * share
        for i in item.tasks:
            part = share / self.tp if self.ctx.split[i] or self.ctx.one_rank[i] else share
            sec = self.roof.seconds(self.problem.costs[i]) * part
            for t in range(self.tp):
                self.mat_flops[d * self.tp + t] += int(round(self.problem.costs[i].flops * part))
                self.mat_s[d * self.tp + t] += sec

    def ranks(self) -> tuple[RankWork, ...]:
        """Every global rank's work outside the TP gathers (rank = d·tp + t)."""
        return tuple(RankWork(self.mat_s[r],
                              self.adam_roof.seconds(TaskCost(
                                  round(self.adam_flops[r]), 0, 0,
                                  self.adam_elems[r] * ADAMW_BYTES_PER_ELEMENT)),
                              self.mat_flops[r], int(round(self.adam_flops[r])))
                     for r in range(self.dp * self.tp))

    def workload(self, buckets: Sequence[BucketWork], label: str, notes: Sequence[str],
                 *, pipelined: bool = False) -> Workload:
        """The workload of what was charged, with ``buckets``' collectives."""
        groups = tuple(tuple(g) for g in self.groups) if self.tp > 1 else ()
        return Workload(self.dp, self.tp, self.ranks(), tuple(buckets), groups, label,
                        tuple(notes), tp_pipelined=pipelined)

    def balance(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The logical FLOPs and state bytes charged to each DP index."""
        return (tuple(int(round(x)) for x in self.dp_flops),
                tuple(int(round(x)) for x in self.dp_state))

    # buckets --------------------------------------------------------------------------------

    def _ready(self):
        total: dict[int, int] = {}
        for b in self.problem.buckets:
            total[b.buffer] = max(total.get(b.buffer, 0), b.end)
        return lambda b: b.end / (total[b.buffer] or 1)

    def bytes_of(self, b) -> tuple[int, int]:  # noqa: ANN001  (a BucketProblem)
        """The bucket's gradient and parameter bytes per element."""
        buf = self.problem.layout.buffers[b.buffer]
        return cm.ELEMENT_BYTES[buf.grad_dtype], cm.ELEMENT_BYTES[buf.dtype]

    def group_of(self, b) -> tuple[int, ...]:  # noqa: ANN001  (a BucketProblem)
        """The DP index of each rank of the bucket's sharding group."""
        return tuple(self.problem.dp_index(b, r) for r in range(b.ranks))

    def all_reduce_buckets(self) -> list[BucketWork]:
        """Every ZeRO-1 bucket all-reduced during backward (no gather)."""
        ready = self._ready()
        out = []
        for b in self.problem.buckets:
            g, _ = self.bytes_of(b)
            sizes = cm.even_sizes(b.end - b.start, b.ranks)
            red = cm.reduce_traffic(cm.ALL_REDUCE, sizes, g)
            out.append(BucketWork(f"{b.buffer}.{b.bucket}", ready(b), self.group_of(b),
                                  red.seconds(self.dp_link), 0.0, cm.ALL_REDUCE, red.busiest, 0))
        return out

    def cut_buckets(self, cuts, methods: str | None = None) -> list[BucketWork]:
        """Every bucket moved over its cuts by ``methods`` (None: the fastest, as plans do)."""
        ready = self._ready()
        out = []
        for b in self.problem.buckets:
            g, p = self.bytes_of(b)
            c = cuts[(b.buffer, b.bucket)]
            sizes = tuple(y - x for x, y in zip(c, c[1:]))
            if methods is None:
                bc = cm.choose(sizes, grad_bytes=g, param_bytes=p, link=self.dp_link)
            else:
                bc = cm.bucket_comm(methods, sizes, grad_bytes=g, param_bytes=p,
                                    link=self.dp_link)
            out.append(BucketWork(f"{b.buffer}.{b.bucket}", ready(b), self.group_of(b),
                                  bc.reduce.seconds(self.dp_link),
                                  bc.gather.seconds(self.dp_link), bc.method,
                                  bc.reduce.busiest, bc.gather.busiest))
        return out


# --- the workloads -------------------------------------------------------------------------------


def sc_workload(x: WorkloadInputs, label: str) -> Built:
    """sc: every DP rank updates every parameter after the all-reduce."""
    bld = _Builder(x)
    p = bld.problem
    for b in p.buckets:
        for d in bld.group_of(b):
            for it in b.items:
                if it.atomic:
                    bld.matrix(d, it, duplicated=True)
                else:
                    bld.adamw(d, it, it.end - it.start)
    w = bld.workload(bld.all_reduce_buckets(), label,
                     ["gradients all-reduced in backward; every DP rank updates every "
                      "parameter; TP-split matrices all-gathered and computed on every TP "
                      "rank (duplicated), one at a time"])
    return (w, *bld.balance())


def dealt_workload(x: WorkloadInputs, label: str, dealing: Dealing, note: str) -> Built:
    """Whole parameters as ``dealing`` gives them (``note``: what the strategy does): gradients
    all-reduced in backward, TP-split matrices ``duplicated`` on the owner's TP ranks, then one
    uneven all-gather of the dealt parameters per dealing group, which the optimizer waits for
    (NCCL runs it as one broadcast per root; gloo, without uneven all-gather, padded)."""
    bld = _Builder(x)
    p = bld.problem
    buckets = bld.all_reduce_buckets()
    for g in dealing.groups:
        for (bi, ii), d in zip(g.items, g.owners):
            it = p.buckets[bi].items[ii]
            if it.atomic:
                bld.matrix(d, it, duplicated=True)
            else:
                bld.adamw(d, it, it.end - it.start)
        pb = max(bld.bytes_of(p.buckets[bi])[1] for bi, _ in g.items)
        gat = cm.gather_traffic(x.gather_method, g.numel(p), pb)
        name = f"{'expert ' if g.expert else ''}params{g.members[0]}"
        buckets.append(BucketWork(name, 0.0, g.members, 0.0, gat.seconds(bld.dp_link),
                                  x.gather_method, 0, gat.busiest, overlappable=False))
    w = bld.workload(buckets, label,
                     [note, f"one uneven all-gather of the dealt parameters per dealing group "
                            f"({x.gather_method}), waited for in the step"])
    return (w, *bld.balance())


def packed_workload(x: WorkloadInputs, label: str) -> Built:
    """Megatron's packed layout (:func:`~canzona.planner.baselines.megatron_packed`)."""
    bld = _Builder(x)
    p = bld.problem
    lay = megatron_packed(p)
    # Bucket readiness: Megatron's buckets in backprop order, each buffer's matrix buckets
    # first, then its AdamW buckets (as the packed layout lists them).
    totals: dict[int, int] = {}
    for pb in lay.buckets:
        totals[pb.buffer] = totals.get(pb.buffer, 0) + pb.numel
    seen: dict[int, int] = {}
    buckets = []
    for k, (pb, sl) in enumerate(zip(lay.buckets, lay.slices)):
        seen[pb.buffer] = seen.get(pb.buffer, 0) + pb.numel
        bc = cm.bucket_comm(cm.EQUAL, sl.sizes, grad_bytes=sl.grad_bytes,
                            param_bytes=sl.param_bytes, link=bld.dp_link)
        buckets.append(BucketWork(f"{pb.buffer}.p{k}", seen[pb.buffer] / totals[pb.buffer],
                                  sl.dp_indices, bc.reduce.seconds(bld.dp_link),
                                  bc.gather.seconds(bld.dp_link), cm.EQUAL, bc.reduce.busiest,
                                  bc.gather.busiest))
        for r, shard in enumerate(pb.shards):  # matrix buckets (AdamW ones: below)
            for bi, ii in shard:
                bld.matrix(sl.dp_indices[r], p.buckets[bi].items[ii], duplicated=True)
    # AdamW parameters: equal chunks of a plain DistributedOptimizer buffer; charge them as the
    # packed layout's loads do (by element share over the buffer's DP group).
    for b in p.buckets:
        members = bld.group_of(b)
        items = [it for it in b.items if not it.atomic]
        total = sum(it.end - it.start for it in items)
        if not total:
            continue
        chunk = -(-total // len(members))
        pos = 0
        for it in items:
            n = it.end - it.start
            lo = pos
            while lo < pos + n:
                r = lo // chunk
                hi = min(pos + n, (r + 1) * chunk)
                bld.adamw(members[r], it, hi - lo)
                lo = hi
            pos += n
    w = bld.workload(buckets, label,
                     [f"Megatron's packed layout: {sum(1 for b in lay.buckets if b.matrix)} "
                      f"matrix buckets padded {lay.padding:.1%}; even reduce-scatter and "
                      "all-gather; TP-split matrices duplicated"])
    return (w, *bld.balance())


def zero1_workload(x: WorkloadInputs, label: str) -> Built:
    """ZeRO-1's equal chunks, each rank's optimizer on its fragments."""
    bld = _Builder(x)
    p = bld.problem
    cuts = {(b.buffer, b.bucket): equal_cuts(b) for b in p.buckets}
    for b in p.buckets:
        c = cuts[(b.buffer, b.bucket)]
        for it in b.items:
            first, last = owner_of(c, it.start), owner_of(c, it.end - 1)
            n = it.end - it.start
            for r in range(first, last + 1):
                lo, hi = max(it.start, c[r]), min(it.end, c[r + 1])
                if hi <= lo:
                    continue
                d = p.dp_index(b, r)
                if it.atomic:
                    bld.fragment(d, it, (hi - lo) / n)
                else:
                    bld.adamw(d, it, hi - lo)
    w = bld.workload(bld.cut_buckets(cuts), label,
                     ["NOT the exact optimizer: each rank orthogonalises its fragments of "
                      "split matrices (and each TP rank its shard); for scale only"])
    return (w, *bld.balance())


def plan_workload(x: WorkloadInputs, label: str) -> Built:
    """The strategy's plan, simulated as it records itself.

    Raises:
        ValueError: no plan.
    """
    if x.plan is None:
        raise ValueError(f"strategy {label!r} needs its plan")
    w = workload_from_plan(x.plan, x.hw, matrix_dtype=x.matrix_dtype, adamw_dtype=x.adamw_dtype)
    return (dataclasses.replace(w, label=label), tuple(x.plan.metrics.dp_flops),
            tuple(x.plan.metrics.dp_state_bytes))
