"""Strategies side by side: the workload of each way to run the optimizer step, simulated alike.

Torch-free. Every strategy becomes a :class:`~canzona.planner.simulate.Workload` of the same
model, sizes and hardware, and :func:`compare` simulates them all with the same backward and
forward times, so their optimizer-step and iteration times compare like with like:

* ``sc`` — synchronous compute, how DDP + Muon runs: every gradient bucket is all-reduced
  during backward (ring all-reduce, 2(R−1)/R·S per rank) and every DP rank updates every
  parameter; a TP-split matrix is first all-gathered over the TP group and computed whole on every
  TP rank (Megatron's TP Muon ``duplicated`` mode), one matrix at a time. No all-gather after.
* ``layerwise`` — Megatron's ``LayerWiseDistributedOptimizer``: the gradients all-reduced as in
  ``sc``; whole parameters dealt to DP ranks by its LPT on max(m,n)·min(m,n)² (elements for
  the AdamW tensors); TP-split matrices ``duplicated`` on the owner's TP ranks; then one uneven
  all-gather of the parameters each rank was dealt, which NCCL runs as one broadcast per root
  (``gather_method``; ``padded`` is what gloo, without uneven all-gather, runs instead). Per
  iteration it moves all-reduce + all-gather ≈ 1.5× ZeRO-1's bytes (REFERENCE.md §6).
* ``megatron-packed`` — Megatron's 2026 shard-aligned layer-wise layout
  (:func:`~canzona.planner.baselines.megatron_packed`): its own padded buckets, the stock even
  reduce-scatter and all-gather, whole matrices per shard, TP-split matrices ``duplicated``.
* ``zero1`` — ZeRO-1's equal chunks, the optimizer applied to each rank's fragments (every
  TP rank its own shard of them): **not the exact optimizer** (a split matrix is orthogonalised
  in pieces); shown for scale only.
* ``canzona-greedy`` — the paper's method: α-balanced greedy cuts (α = 1) and the TP greedy
  micro-groups, each bucket moved by the method the communication model picks.
* ``canzona`` — the planner's default plan (or the one given).

The canzona rows are simulated from their plans (:func:`~canzona.planner.simulate.workload_from_plan`);
the others are built here from the same :class:`~canzona.planner.planning.DPProblem` with the
same compute, AdamW and link formulas. Deterministic.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import comm as cm
from .baselines import megatron_packed
from .cost import OptimizerSettings
from .hardware import HardwareProfile, load_hardware
from .inventory import ModelSpec
from .layout import ParallelSizes
from .options import MIB, DPOptions, TPOptions
from .plan import Plan
from .planning import DPProblem, equal_cuts, make_problem, owner_of
from .simulate import (ADAMW_BYTES_PER_ELEMENT, BucketWork, GroupWork, RankWork, StepSim,
                       Workload, forward_backward_seconds, simulate, split_forward_backward,
                       workload_from_plan)
from .tp import TPContext

__all__ = ["STRATEGIES", "EXACT", "DESCRIPTIONS", "StrategyRun", "Comparison", "active_params",
           "strategy_workload", "compare", "compare_problem", "compare_plan"]

#: Every strategy, in the order tables print them.
STRATEGIES = ("sc", "layerwise", "megatron-packed", "zero1", "canzona-greedy", "canzona")
#: The strategies that compute the exact single-device optimizer (zero1 updates fragments).
EXACT = frozenset(s for s in STRATEGIES if s != "zero1")
DESCRIPTIONS = {
    "sc": "all-reduce; every rank updates everything (TP: duplicated)",
    "layerwise": "all-reduce; whole params dealt by LPT; uneven all-gather (TP: duplicated)",
    "megatron-packed": "Megatron's packed shards; even RS/AG, padded (TP: duplicated)",
    "zero1": "equal chunks, optimizer on fragments — NOT the exact optimizer",
    "canzona-greedy": "the paper: α-greedy cuts, TP greedy micro-groups",
    "canzona": "the planner's plan",
}


def active_params(spec: ModelSpec) -> float:
    """Parameters one token's forward and backward multiply by: every parameter but the input
    embedding's lookup table (when untied), MoE experts scaled by top-k / experts."""
    cfg = spec.config
    frac = (cfg.experts_per_token / cfg.num_experts) if cfg is not None and cfg.is_moe else 1.0
    tied = cfg.tied_embeddings if cfg is not None else False
    n = 0.0
    for p in spec.params:
        if p.kind == "embedding" and not tied:
            continue
        n += p.numel * (frac if p.is_expert else 1.0)
    return n


# --- shared pieces --------------------------------------------------------------------------------


class _Builder:
    """Per-rank work of a whole-parameter strategy: owners, AdamW elements and the TP gathers."""

    def __init__(self, problem: DPProblem, hw: HardwareProfile, matrix_dtype: str,
                 adamw_dtype: str) -> None:
        self.problem, self.hw = problem, hw
        self.dp, self.tp = problem.dp, problem.sizes.tp
        self.ctx = TPContext.build(problem, problem.comm_dtype)
        self.mat_rate = hw.peak_flops[matrix_dtype] * hw.compute_efficiency
        self.adam_rate = hw.peak_flops[adamw_dtype] * hw.compute_efficiency
        self.tp_link = hw.link(self.tp)
        self.dp_link = cm.plan_link(hw, self.dp, self.tp)[1]
        n = self.dp * self.tp
        self.mat_flops = [0] * n
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
            if self.ctx.split[i] and duplicated:
                m = self.ctx.maps[self.ctx.layout[i]]
                received = max(m.full_numel - m.sent_numel(t) for t in range(self.tp))
                b = received * cm.ELEMENT_BYTES[self.problem.comm_dtype]
                g = self.tp_link.seconds(b) if b else 0.0
                self.groups[d].append(GroupWork(g, 0.0, (fl / self.mat_rate,) * self.tp, b,
                                                (fl,) * self.tp))
            else:
                for t in range(self.tp):
                    self.mat_flops[d * self.tp + t] += fl

    def fragment(self, d: int, item, share: float) -> None:
        """zero1: DP index ``d`` applies the optimizer to ``share`` of a matrix, each TP rank to
        its own shard of it (split matrices) or all of it (replicated)."""
        self.dp_flops[d] += item.flops * share
        self.dp_state[d] += item.state_bytes * share
        for i in item.tasks:
            fl = self.problem.costs[i].flops * share
            per = fl / self.tp if self.ctx.split[i] else fl
            for t in range(self.tp):
                self.mat_flops[d * self.tp + t] += int(round(per))

    def ranks(self) -> tuple[RankWork, ...]:
        hw = self.hw
        return tuple(RankWork(self.mat_flops[r] / self.mat_rate,
                              max(self.adam_flops[r] / self.adam_rate,
                                  self.adam_elems[r] * ADAMW_BYTES_PER_ELEMENT
                                  / hw.memory_bandwidth),
                              self.mat_flops[r], int(round(self.adam_flops[r])))
                     for r in range(self.dp * self.tp))

    def workload(self, buckets: Sequence[BucketWork], label: str, notes: Sequence[str],
                 *, pipelined: bool = False) -> Workload:
        groups = tuple(tuple(g) for g in self.groups) if self.tp > 1 else ()
        return Workload(self.dp, self.tp, self.ranks(), tuple(buckets), groups, label,
                        tuple(notes), tp_pipelined=pipelined)

    def balance(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (tuple(int(round(x)) for x in self.dp_flops),
                tuple(int(round(x)) for x in self.dp_state))

    # buckets --------------------------------------------------------------------------------

    def _ready(self):
        total: dict[int, int] = {}
        for b in self.problem.buckets:
            total[b.buffer] = max(total.get(b.buffer, 0), b.end)
        return lambda b: b.end / (total[b.buffer] or 1)

    def bytes_of(self, b) -> tuple[int, int]:
        buf = self.problem.layout.buffers[b.buffer]
        return cm.ELEMENT_BYTES[buf.grad_dtype], cm.ELEMENT_BYTES[buf.dtype]

    def group_of(self, b) -> tuple[int, ...]:
        return tuple(self.problem.dp_index(b, r) for r in range(b.ranks))

    def all_reduce_buckets(self) -> list[BucketWork]:
        """Every ZeRO-1 bucket all-reduced during backward (no gather)."""
        ready = self._ready()
        out = []
        for b in self.problem.buckets:
            g, _ = self.bytes_of(b)
            sizes = cm.even_sizes(b.end - b.start, b.ranks)
            red = cm.reduce_traffic("all_reduce", sizes, g)
            out.append(BucketWork(f"{b.buffer}.{b.bucket}", ready(b), self.group_of(b),
                                  red.seconds(self.dp_link), 0.0, "all_reduce", red.busiest, 0))
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


def _lpt_cost(problem: DPProblem, b, it) -> int:
    """Megatron's layer-wise cost: max(m,n)·min(m,n)² of the TP-local shape for matrices,
    elements otherwise."""
    if it.atomic:
        shape = problem.layout.buffers[b.buffer].buckets[b.bucket].slots[it.slot].local_shape
        if len(shape) == 2:
            return max(shape) * min(shape) ** 2
    return it.end - it.start


# --- the strategies -------------------------------------------------------------------------------


def _sc(bld: _Builder, label: str) -> Workload:
    p = bld.problem
    for b in p.buckets:
        for d in bld.group_of(b):
            for it in b.items:
                if it.atomic:
                    bld.matrix(d, it, duplicated=True)
                else:
                    bld.adamw(d, it, it.end - it.start)
    return bld.workload(bld.all_reduce_buckets(), label,
                        ["gradients all-reduced in backward; every DP rank updates every "
                         "parameter; TP-split matrices all-gathered and computed on every TP "
                         "rank (duplicated), one at a time"])


def _layerwise(bld: _Builder, label: str, gather_method: str) -> Workload:
    p = bld.problem
    # Megatron's LPT per expert-data-parallel group (dense buffers: all DP indices).
    groups: dict[tuple[int, ...], list] = {}
    for b in p.buckets:
        groups.setdefault(bld.group_of(b), []).extend((b, it) for it in b.items)
    buckets = bld.all_reduce_buckets()
    for members, items in sorted(groups.items()):
        load = {d: 0 for d in members}
        dealt = {d: 0 for d in members}
        heap = [(0, d) for d in members]
        for b, it in sorted(items, key=lambda x: (-_lpt_cost(p, *x), x[0].buffer, x[1].start)):
            c, d = heapq.heappop(heap)
            load[d] = c + _lpt_cost(p, b, it)
            heapq.heappush(heap, (load[d], d))
            dealt[d] += it.end - it.start
            if it.atomic:
                bld.matrix(d, it, duplicated=True)
            else:
                bld.adamw(d, it, it.end - it.start)
        pb = max(bld.bytes_of(b)[1] for b, _ in items)
        sizes = tuple(dealt[d] for d in members)
        gat = cm.gather_traffic(gather_method, sizes, pb)
        buckets.append(BucketWork(f"params{members[0]}", 0.0, members, 0.0,
                                  gat.seconds(bld.dp_link), gather_method, 0, gat.busiest,
                                  overlappable=False))
    return bld.workload(buckets, label,
                        ["gradients all-reduced in backward; whole parameters dealt by LPT on "
                         "max(m,n)·min(m,n)²; TP-split matrices duplicated; one uneven "
                         f"all-gather of the parameters ({gather_method})"])


def _packed(bld: _Builder, label: str) -> Workload:
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
        bc = cm.bucket_comm("equal", sl.sizes, grad_bytes=sl.grad_bytes,
                            param_bytes=sl.param_bytes, link=bld.dp_link)
        buckets.append(BucketWork(f"{pb.buffer}.p{k}", seen[pb.buffer] / totals[pb.buffer],
                                  sl.dp_indices, bc.reduce.seconds(bld.dp_link),
                                  bc.gather.seconds(bld.dp_link), "equal", bc.reduce.busiest,
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
    return bld.workload(buckets, label,
                        [f"Megatron's packed layout: {sum(1 for b in lay.buckets if b.matrix)} "
                         f"matrix buckets padded {lay.padding:.1%}; even reduce-scatter and "
                         "all-gather; TP-split matrices duplicated"])


def _zero1(bld: _Builder, label: str) -> Workload:
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
    return bld.workload(bld.cut_buckets(cuts), label,
                        ["NOT the exact optimizer: each rank orthogonalises its fragments of "
                         "split matrices (and each TP rank its shard); for scale only"])


def _build(name: str, problem: DPProblem, hw: HardwareProfile, plan: Plan | None,
           matrix_dtype: str, adamw_dtype: str, gather_method: str
           ) -> tuple[Workload, tuple[int, ...], tuple[int, ...]]:
    """The workload, and the logical FLOPs and state bytes per DP index."""
    if name in ("canzona", "canzona-greedy"):
        if plan is None:
            raise ValueError(f"strategy {name!r} needs its plan")
        w = workload_from_plan(plan, hw, matrix_dtype=matrix_dtype, adamw_dtype=adamw_dtype)
        return (dataclasses.replace(w, label=name), tuple(plan.metrics.dp_flops),
                tuple(plan.metrics.dp_state_bytes))
    bld = _Builder(problem, hw, matrix_dtype, adamw_dtype)
    if name == "sc":
        w = _sc(bld, name)
    elif name == "layerwise":
        w = _layerwise(bld, name, gather_method)
    elif name == "megatron-packed":
        w = _packed(bld, name)
    elif name == "zero1":
        w = _zero1(bld, name)
    else:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return (w, *bld.balance())


def strategy_workload(name: str, problem: DPProblem, hw: HardwareProfile, *,
                      plan: Plan | None = None, matrix_dtype: str = "bf16",
                      adamw_dtype: str = "bf16", gather_method: str = "per_root") -> Workload:
    """The workload of strategy ``name`` (:data:`STRATEGIES`) on ``problem``.

    ``canzona`` and ``canzona-greedy`` need their ``plan`` (made from the same problem);
    ``gather_method`` is the layer-wise all-gather's (``per_root`` on NCCL, ``padded`` on gloo).
    """
    return _build(name, problem, hw, plan, matrix_dtype, adamw_dtype, gather_method)[0]


# --- the comparison -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StrategyRun:
    """One strategy's simulated step and iteration."""

    name: str
    exact: bool
    sim: StepSim
    forward_backward_s: float
    sent_bytes: int  # the most DP bytes any rank sends per iteration (reduce + gather)
    dp_flops: tuple[int, ...] = ()  # logical optimizer FLOPs per DP index
    dp_state: tuple[int, ...] = ()  # optimizer state bytes per DP index

    @staticmethod
    def _ratio(xs: Sequence[int]) -> float:
        mean = sum(xs) / len(xs) if xs else 0.0
        return max(xs) / mean if mean else 1.0

    @property
    def flops_balance(self) -> float:
        """DP FLOPs max/mean."""
        return self._ratio(self.dp_flops)

    @property
    def state_balance(self) -> float:
        """DP optimizer-state bytes max/mean."""
        return self._ratio(self.dp_state)

    @property
    def step_s(self) -> float:
        return self.sim.step_s

    @property
    def iteration_s(self) -> float:
        return self.forward_backward_s + self.sim.step_s


@dataclass(frozen=True, slots=True)
class Comparison:
    """Every strategy's run on one model, sizes and hardware profile."""

    model: str
    dp: int
    tp: int
    ep: int
    hardware: str
    tokens: int
    mfu: float
    forward_backward_s: float
    overlap_param_gather: bool
    runs: tuple[StrategyRun, ...]
    plan: Plan | None = None  # canzona's
    forward_backward_given: bool = False  # True: a given time, not 6·N·tokens at the MFU

    def run(self, name: str) -> StrategyRun:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def canzona_share(self) -> str:
        """What the canzona row's plan shares: ``off`` (nothing, whatever it was asked), the
        ``share`` mode of a plan whose TP groups share matrices, ``dp-pairs`` (tp 1: matrices
        split over two DP indices) or ``tp-pairs`` (tp > 1: some shared by two TP groups)."""
        if self.plan is None:
            return "off"
        if self.plan.dp_shared:
            return "dp-pairs" if self.plan.inputs.tp == 1 else "tp-pairs"
        tp = self.plan.tp
        shares = tp is not None and any(ix.shared for ix in tp.indices)
        return tp.share if shares and tp.share else "off"

    def to_dict(self, *, stages: bool = False) -> dict:
        def row(r: StrategyRun) -> dict:
            d = r.sim.to_dict(stages=stages)
            if not stages:
                d.pop("ranks")
            return {"strategy": r.name, "exact": r.exact,
                    "step_s": round(r.step_s, 9), "iteration_s": round(r.iteration_s, 9),
                    "sent_bytes": r.sent_bytes,
                    "dp_flops_max_over_mean": round(r.flops_balance, 6),
                    "dp_state_max_over_mean": round(r.state_balance, 6), "simulation": d}
        return {"model": self.model, "dp": self.dp, "tp": self.tp, "ep": self.ep,
                "hardware": self.hardware, "tokens": self.tokens, "mfu": self.mfu,
                "forward_backward_s": round(self.forward_backward_s, 9),
                "forward_backward_given": self.forward_backward_given,
                "overlap_param_gather": self.overlap_param_gather,
                "canzona_share": self.canzona_share,
                "strategies": [row(r) for r in self.runs]}


def _sent(w: Workload) -> int:
    per = [0] * w.dp
    for b in w.buckets:
        for d in b.dp_indices:
            per[d] += b.reduce_bytes + b.gather_bytes
    return max(per, default=0)


def compare_problem(problem: DPProblem, hardware: str | HardwareProfile = "h100", *,
                    strategies: Sequence[str] = STRATEGIES, plan: Plan | None = None,
                    greedy_plan: Plan | None = None, dp_options: DPOptions | None = None,
                    tp_options: TPOptions | None = None, tokens: int | None = None,
                    seq: int = 4096, mfu: float = 0.4, forward_backward_s: float | None = None,
                    overlap_param_gather: bool = False, matrix_dtype: str = "bf16",
                    adamw_dtype: str = "bf16", gather_method: str = "per_root",
                    progress: Callable[[str], None] | None = None) -> Comparison:
    """Simulate ``strategies`` on ``problem`` with one forward/backward time.

    Args:
        hardware: a built-in profile's name, a profile file's path, or a profile. Given a name or
            a path, the canzona plans pick their bucket methods for it; given a profile object,
            for ``tp_options.hardware`` (default ``h100``).
        plan, greedy_plan: the canzona / canzona-greedy plans of this problem (made here with
            ``dp_options`` / ``tp_options`` when absent; canzona-greedy is the DP and TP greedy).
        tokens: the global batch in tokens (default ``dp · seq``: one sequence per DP rank); at
            ``mfu`` it gives forward + backward
            (:func:`~canzona.planner.simulate.forward_backward_seconds`) unless
            ``forward_backward_s`` is given. Backward is two thirds of it.
        gather_method: the layer-wise all-gather's collective (``per_root`` on NCCL).
    """
    from .pipeline import plan_problem  # the pipeline imports the solvers: only when planning

    say = progress or (lambda _msg: None)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if isinstance(hardware, HardwareProfile):
        hw = hardware
        t = tp_options or TPOptions(comm_dtype=problem.comm_dtype)
    else:
        hw = load_hardware(hardware)
        t = tp_options or TPOptions(comm_dtype=problem.comm_dtype, hardware=str(hardware))
    o = dp_options or DPOptions()
    sizes = problem.sizes
    tokens = tokens if tokens is not None else sizes.dp * seq
    given = forward_backward_s is not None
    if forward_backward_s is None:
        forward_backward_s = forward_backward_seconds(active_params(problem.spec), tokens, hw,
                                                      world=sizes.dp * sizes.tp, mfu=mfu)
    fwd, bwd = split_forward_backward(forward_backward_s)
    runs = []
    for name in strategies:
        p = None
        if name == "canzona":
            if plan is None:
                say("planning canzona")
                plan = plan_problem(problem, dp_options=o, tp_options=t)
            p = plan
        elif name == "canzona-greedy":
            if greedy_plan is None:
                say("planning canzona-greedy")
                greedy_plan = plan_problem(
                    problem, dp_options=dataclasses.replace(o, solver="greedy", alpha=1.0,
                                                  objective="max-load"),
                    tp_options=dataclasses.replace(t, solver="greedy", share="off"))
            p = greedy_plan
        say(f"simulating {name}")
        w, fl, st = _build(name, problem, hw, p, matrix_dtype, adamw_dtype, gather_method)
        sim = simulate(w, backward_s=bwd, forward_s=fwd, overlap_param_gather=overlap_param_gather)
        runs.append(StrategyRun(name, name in EXACT, sim, forward_backward_s, _sent(w), fl, st))
    return Comparison(problem.spec.name, sizes.dp, sizes.tp, sizes.ep, f"{hw.name} v{hw.version}",
                      tokens, mfu, forward_backward_s, overlap_param_gather, tuple(runs), plan,
                      given)


def compare(source, sizes: ParallelSizes, optimizer: OptimizerSettings | str = "muon", *,
            hardware: str | HardwareProfile = "h100", dp_options: DPOptions | None = None,
            tp_options: TPOptions | None = None, **kwargs) -> Comparison:
    """:func:`compare_problem` of a model source (a preset name, a ``config.json`` path, a
    config or an inventory) at ``sizes``; ``dp_options`` / ``tp_options`` shape the layout (bucket
    size, cost model, comm dtype) and the canzona plans."""
    from .pipeline import inventory_of

    o = dp_options or DPOptions()
    comm_dtype = tp_options.comm_dtype if tp_options is not None else "bf16"
    settings = OptimizerSettings(name=optimizer) if isinstance(optimizer, str) else optimizer  # type: ignore[arg-type]
    spec, _ = inventory_of(source)
    problem = make_problem(spec, sizes, settings, cost=o.cost, bucket_size=o.bucket_size,
                           overlap_grad_reduce=o.overlap_grad_reduce, comm_dtype=comm_dtype)
    return compare_problem(problem, hardware, dp_options=o, tp_options=tp_options, **kwargs)


def compare_plan(plan: Plan, hardware: str | HardwareProfile | None = None, *,
                 config=None, **kwargs) -> Comparison:
    """:func:`compare_problem` with ``plan`` as the canzona row: the problem is rebuilt from the
    plan's inputs (``config``: the ``config.json`` of a plan made from one), canzona-greedy is
    planned with the plan's C_max and comm dtype.

    ``hardware`` defaults to the profile the plan records (it must then be built in).

    Raises:
        CanzonaError: the problem cannot be rebuilt (a plan of a live module, a custom cost
            model, or a fingerprint that does not match).
    """
    from .errors import CanzonaError
    from .report import rebuild_problem
    from .simulate import plan_hardware

    problem = rebuild_problem(plan, config)
    if problem is None:
        raise CanzonaError("this plan was made from a live module or with a custom cost model: "
                           "its problem cannot be rebuilt for the other strategies; compare "
                           "with --model (or simulate the plan alone).")
    ref = hardware if hardware is not None else plan_hardware(plan).name
    tp = kwargs.pop("tp_options", None)
    if tp is None and plan.tp is not None:
        tp = TPOptions(cmax_mib=plan.tp.cmax_bytes / MIB, comm_dtype=plan.tp.comm_dtype,
                       **({} if isinstance(ref, HardwareProfile) else {"hardware": str(ref)}))
    return compare_problem(problem, ref, plan=plan, tp_options=tp, **kwargs)
