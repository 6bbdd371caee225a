"""Baselines in the same framework, so reports compare like with like (DESIGN.md).

* ``zero1`` — Megatron's equal chunks; split matrices are charged by fragments (what each rank
  would compute if it ran the optimizer on its piece — not the exact optimizer).
* ``asc`` — equal chunks, each matrix computed whole by the rank holding its start index.
* ``layerwise`` — Megatron's legacy layer-wise optimizer: whole parameters dealt to DP ranks,
  ignoring the bucket geometry, so gradients must be all-reduced (ping-pong dealing by numel).
* ``layerwise-lpt`` — the same with Megatron's newer LPT on max(m,n)·min(m,n)².
* ``megatron-packed`` — Megatron's 2026 shard-aligned layer-wise layout
  (:func:`megatron_packed`): whole matrices packed into even per-rank shards, each bucket padded
  to its largest shard, so the stock reduce-scatter / all-gather stay.
* ``canzona-greedy`` — the paper's α-balanced greedy; ``canzona`` — the chosen solver's plan.

Every row has its compute balance (load per DP index) and its communication under the α–β model
of :mod:`canzona.planner.comm` on the plan's link (its recorded bus bandwidth and α): the most
bytes any rank sends per iteration and the predicted collective time of the busiest DP index
(reduce + gather of every bucket, one after another). What each row's collectives are:

* zero1, asc: ZeRO-1's even reduce-scatter + all-gather of every bucket.
* layerwise, layerwise-lpt: a ring all-reduce of every ZeRO-1 bucket (grad dtype), then one
  uneven all-gather of the parameters each DP index was dealt (param dtype), which NCCL runs as one
  broadcast per root (Megatron's legacy ``allgather_params``: ``torch.distributed.all_gather``
  with per-rank sizes, no padding). Bytes ≈ 1.5× ZeRO-1's (REFERENCE.md §6). Expert parameters
  are dealt over all DP indices like the dense ones (as the compute figures are), so for MoE
  models this is an approximation.
* megatron-packed: even reduce-scatter + all-gather over every bucket's padded size R·shard.
* canzona-greedy: the greedy's cuts, each bucket moved by its fastest method (what a plan
  records); canzona: the plan's own methods.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from . import comm as cm
from .dp.bounds import pigeonhole_bound
from .dp.greedy import greedy
from .hardware import DEFAULT_HARDWARE, LinkProfile, load_hardware
from .plan import Plan
from .planning import DPProblem, equal_cuts, evaluate
from .settings import PARAM_ALIGN

__all__ = ["BaselineRow", "PackedBucket", "PackedLayout", "baselines", "megatron_packed",
           "problem_link", "NUMEL_EPSILON", "PADDING_FLOOR"]

#: Megatron's per-shard element cap while packing a bucket: a matrix goes to the least
#: compute-loaded shard whose fill stays ≤ (1 + ε)·(bucket elements / R) (``_NUMEL_EPSILON``).
NUMEL_EPSILON = 0.3
#: Megatron's bucket soft minimum: a bucket closes only once it holds max(bucket_size,
#: PADDING_FLOOR · R · its largest matrix) elements, so the padding that its largest matrix forces
#: (every shard at least that large) is at most 1/0.9 − 1 ≈ 11 % of the bucket.
PADDING_FLOOR = 0.9


@dataclass(frozen=True, slots=True)
class BaselineRow:
    """One strategy's compute balance and communication (same model, sizes and bound)."""

    name: str
    max_load: int
    mean_load: float
    max_over_mean: float
    gap_to_bound: float  # max load / certified bound - 1
    split_matrices: int
    grad_sync: str  # "reduce-scatter" or "all-reduce"
    max_sent_bytes: int | None = None  # most bytes any rank sends per iteration
    collective_s: float | None = None  # predicted collective time per iteration (busiest index)
    load: tuple[int, ...] = ()  # per DP index
    padding: float | None = None  # megatron-packed: its matrix buckets' padding (PackedLayout)


def _row(name: str, load: Sequence[int], bound: int, split: int, sync: str,
         summary: cm.CommSummary | None = None) -> BaselineRow:
    mean = sum(load) / len(load)
    mx = max(load)
    return BaselineRow(name, mx, mean, mx / mean if mean else 1.0,
                       mx / bound - 1 if bound else 0.0, split, sync,
                       None if summary is None else summary.max_sent,
                       None if summary is None else summary.seconds, tuple(load))


# --- layer-wise (legacy) -----------------------------------------------------------------------


def _layerwise(problem: DPProblem, lpt: bool) -> tuple[list[int], list[int]]:
    """Load and elements dealt per DP index."""
    items = [it for b in problem.buckets for it in b.items]
    load = [0] * problem.dp
    numel = [0] * problem.dp
    if lpt:
        def key(it):  # Megatron's compute-balanced cost for matrices, numel otherwise
            task = problem.tasks[it.tasks[0]]
            if len(task.shape) == 2:
                m, n = sorted(task.shape)
                return n * m * m
            return it.end - it.start
        heap = [(0, d) for d in range(problem.dp)]
        cost = [0] * problem.dp
        for it in sorted(items, key=lambda it: (-key(it), it.start)):
            c, d = heapq.heappop(heap)
            load[d] += it.load
            numel[d] += it.end - it.start
            cost[d] = c + key(it)
            heapq.heappush(heap, (cost[d], d))
        return load, numel
    # Ping-pong: sorted by numel, dealt 0..R-1 then R-1..0.
    R = problem.dp
    for k, it in enumerate(sorted(items, key=lambda it: (-(it.end - it.start), it.start))):
        lap, pos = divmod(k, R)
        d = pos if lap % 2 == 0 else R - 1 - pos
        load[d] += it.load
        numel[d] += it.end - it.start
    return load, numel


# --- Megatron's packed (shard-aligned) layer-wise layout ---------------------------------------


def _pad(x: int, d: int) -> int:
    return -(-x // d) * d


@dataclass(frozen=True, slots=True)
class PackedBucket:
    """One bucket of Megatron's packed layout.

    ``matrix`` buckets hold whole matrix-optimizer parameters, ``shards[r]`` those of rank r as
    (index into ``problem.buckets``, index into its items), each starting 64-aligned; every shard
    is padded to ``shard`` elements. The other buckets hold the AdamW parameters, cut wherever
    ZeRO-1's equal chunks of ``shard`` elements fall (``shards`` is empty there).
    """

    buffer: int  # index into problem.layout.buffers
    matrix: bool
    ranks: int
    shard: int  # elements per rank, padded
    fill: tuple[int, ...]  # elements each shard holds before padding (64-aligned starts)
    unpadded: int  # Σ parameter elements
    shards: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def numel(self) -> int:
        """The bucket's size in the buffer: R · shard."""
        return self.ranks * self.shard


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Megatron's packed layout of a problem: its buckets, loads per DP index and collectives."""

    buckets: tuple[PackedBucket, ...]
    load: tuple[int, ...]
    flops: tuple[int, ...]
    state_bytes: tuple[int, ...]
    slices: tuple[cm.BucketSlices, ...]  # one per bucket, equal slices

    @property
    def padding(self) -> float:
        """Padding of the matrix buckets: (Σ R·shard − Σ elements) / Σ elements."""
        mats = [b for b in self.buckets if b.matrix]
        unpadded = sum(b.unpadded for b in mats)
        return (sum(b.numel for b in mats) - unpadded) / unpadded if unpadded else 0.0


def megatron_packed(problem: DPProblem) -> PackedLayout:
    """Megatron's 2026 layer-wise layout of ``problem``'s buffers (no parameter is ever split).

    Re-derived from Megatron-LM's ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``
    and ``compute_full_param_layout`` (megatron/core/optimizer/layer_wise_optimizer.py, 2026):

    * Matrix-optimizer parameters (Muon's: 2-D, not embedding/output) get buffers of their own;
      the other parameters (norms, embeddings, output layer) a plain DistributedOptimizer buffer:
      64-aligned starts, buckets closed at ``bucket_size``, ends padded to lcm(R, 128), equal
      chunks (charged by fragments here, as for zero1: AdamW is element-wise).
    * Matrix buckets are formed in backprop (buffer) order: a bucket closes once it holds
      max(bucket_size, ⌊:data:`PADDING_FLOOR` · R · largest matrix⌋) elements *and* the next
      matrix would not fit in the padding of an estimated least-filled-shard packing (it keeps
      absorbing matrices that fill padding). That soft minimum is Megatron's padding cap: every
      closed bucket is at least 0.9·R times its largest matrix, so the padding that matrix forces
      is ≤ 1/0.9 − 1 ≈ 11 %. The buffer's last bucket may be smaller.
    * Each bucket is packed largest first — by Megatron's Newton–Schulz cost max(m,n)·min(m,n)²
      of the TP-local shape (elements for non-2-D tensors), not by elements — onto the least
      compute-loaded shard (loads persist across the buffer's buckets) among those whose fill
      stays ≤ (1 + 0.3) · the bucket's elements / R (:data:`NUMEL_EPSILON`); when none has room,
      onto the least-filled shard. Starts are 64-aligned; every shard is padded to the largest
      fill, rounded up to lcm(64, lcm(R, 128)/R), so R·shard is a valid bucket and the stock even
      reduce-scatter and all-gather move it. Nothing is ever split: the per-shard cap is soft
      and the last bucket is whatever remains, so padding has no hard bound
      (:attr:`PackedLayout.padding` reports it; e.g. qwen3-32b dp32 tp8: 4 matrix buckets,
      12.9 %; qwen3-8b dp32 tp4: 43 %, its last bucket — a remainder of fewer matrices than
      ranks — padded 3.5×; qwen3-0.6b dp8: 16 %).
    * Shared (tied) embeddings get an isolated bucket in Megatron; they are AdamW here, so they
      stay in the even buffer.

    The buckets are therefore Megatron's own, not ZeRO-1's: forcing ZeRO-1's buckets would pad a
    bucket holding one large matrix to R times it, which Megatron's soft minimum avoids. Loads
    are per DP index (expert buffers: rank r of EP rank e is index r·ep + e).
    """
    layout = problem.layout
    bucket_size = layout.bucket_size
    dp = problem.dp
    ep = problem.sizes.ep
    load, flops, state = [0] * dp, [0] * dp, [0] * dp
    by_buffer: dict[int, list[tuple[int, int]]] = {}
    for bi, b in enumerate(problem.buckets):
        for ii in range(len(b.items)):
            by_buffer.setdefault(b.buffer, []).append((bi, ii))
    out: list[PackedBucket] = []
    slices: list[cm.BucketSlices] = []
    for buf_i, refs in sorted(by_buffer.items()):
        buf = layout.buffers[buf_i]
        R = buf.dp_size
        index = [r * ep + buf.ep_rank if buf.expert else r  # type: ignore[operator]
                 for r in range(R)]
        g, p = cm.ELEMENT_BYTES[buf.grad_dtype], cm.ELEMENT_BYTES[buf.dtype]

        def item(ref: tuple[int, int]):
            return problem.buckets[ref[0]].items[ref[1]]

        def ns_cost(ref: tuple[int, int]) -> int:
            bp = problem.buckets[ref[0]]
            shape = layout.buffers[bp.buffer].buckets[bp.bucket].slots[item(ref).slot].local_shape
            if len(shape) != 2:
                return math.prod(shape)
            big, small = max(shape), min(shape)
            return big * small * small

        mats = [r for r in refs if item(r).atomic]
        others = [r for r in refs if not item(r).atomic]
        divisor = math.lcm(PARAM_ALIGN, math.lcm(R, 128) // R)
        compute = [0] * R  # persists across the buffer's buckets

        def emit(chunk: list[tuple[int, int]]) -> None:
            if not chunk:
                return
            n_of = [item(r).end - item(r).start for r in chunk]
            cap = sum(n_of) / R * (1 + NUMEL_EPSILON)
            fill = [0] * R
            shards: list[list[tuple[int, int]]] = [[] for _ in range(R)]
            costs = [ns_cost(r) for r in chunk]
            for k in sorted(range(len(chunk)), key=lambda k: -costs[k]):  # stable: ties in order
                n = n_of[k]
                cand = [s for s in range(R) if _pad(fill[s], PARAM_ALIGN) + n <= cap]
                s = (min(cand, key=lambda s: compute[s]) if cand
                     else min(range(R), key=lambda s: fill[s]))
                fill[s] = _pad(fill[s], PARAM_ALIGN) + n
                compute[s] += costs[k]
                shards[s].append(chunk[k])
                it = item(chunk[k])
                d = index[s]
                load[d] += it.load
                flops[d] += it.flops
                state[d] += it.state_bytes
            shard = _pad(max(fill), divisor)
            out.append(PackedBucket(buf_i, True, R, shard, tuple(fill), sum(n_of),
                                    tuple(tuple(x) for x in shards)))
            slices.append(cm.BucketSlices((shard,) * R, g, p, tuple(index)))

        # Bucket formation (backprop order), with Megatron's estimate of the packing.
        chunk: list[tuple[int, int]] = []
        chunk_numel = chunk_max = 0
        est = [0] * R
        for ref in mats:
            n = item(ref).end - item(ref).start
            if bucket_size is not None and chunk:
                threshold = max(bucket_size, int(R * chunk_max * PADDING_FLOOR))
                absorbs = _pad(min(est), PARAM_ALIGN) + n <= _pad(max(est), divisor)
                if chunk_numel >= threshold and not absorbs:
                    emit(chunk)
                    chunk, chunk_numel, chunk_max, est = [], 0, 0, [0] * R
            s = min(range(R), key=lambda s: est[s])
            est[s] = _pad(est[s], PARAM_ALIGN) + n
            chunk.append(ref)
            chunk_numel += n
            chunk_max = max(chunk_max, n)
        emit(chunk)

        # The other parameters: DistributedOptimizer's byte-level layout, equal chunks.
        end_div = math.lcm(R, 128)
        pos = start = 0
        group: list[tuple[int, int, int]] = []  # (ref index, start, end) inside the bucket

        def close(end: int) -> None:
            nonlocal start, group
            size = _pad(end - start, end_div)
            chunk_size = size // R
            for ref, lo_, hi_ in group:
                it = item(ref)
                n = hi_ - lo_
                for r in range(lo_ // chunk_size, (hi_ - 1) // chunk_size + 1):
                    a = max(lo_, r * chunk_size) - lo_
                    z = min(hi_, (r + 1) * chunk_size) - lo_
                    d = index[r]
                    load[d] += it.load * z // n - it.load * a // n
                    flops[d] += it.flops * z // n - it.flops * a // n
                    state[d] += it.state_bytes * z // n - it.state_bytes * a // n
            out.append(PackedBucket(buf_i, False, R, chunk_size, (chunk_size,) * R,
                                    sum(h - lo for _, lo, h in group), ()))
            slices.append(cm.BucketSlices((chunk_size,) * R, g, p, tuple(index)))
            start = start + size
            group = []

        for ref in others:
            it = item(ref)
            lo = _pad(pos, PARAM_ALIGN)
            hi = lo + it.end - it.start
            group.append((ref, lo - start, hi - start))
            if bucket_size is not None and hi - start >= bucket_size:
                close(hi)
                pos = start
            else:
                pos = hi
        if group:
            close(pos)
    return PackedLayout(tuple(out), tuple(load), tuple(flops), tuple(state), tuple(slices))


# --- communication -----------------------------------------------------------------------------


def problem_link(problem: DPProblem, plan: Plan | None = None) -> LinkProfile:
    """The link of the DP groups: the plan's recorded one (its bus bandwidth and α, so old plans
    keep what they predicted), else the default hardware profile's."""
    if plan is not None:
        return LinkProfile(busbw=plan.comm.busbw, latency_s=plan.comm.latency_s)
    hw = load_hardware(DEFAULT_HARDWARE)
    return cm.plan_link(hw, problem.sizes.dp, problem.sizes.tp)[1]


def _cut_slices(problem: DPProblem, cuts: dict) -> list[cm.BucketSlices]:
    out = []
    for b in problem.buckets:
        buf = problem.layout.buffers[b.buffer]
        c = cuts[(b.buffer, b.bucket)]
        out.append(cm.BucketSlices(tuple(y - x for x, y in zip(c, c[1:])),
                                   cm.ELEMENT_BYTES[buf.grad_dtype], cm.ELEMENT_BYTES[buf.dtype],
                                   tuple(problem.dp_index(b, r) for r in range(b.ranks))))
    return out


def _even(slices: Sequence[cm.BucketSlices], dp: int, link: LinkProfile) -> cm.CommSummary:
    """ZeRO-1's even collectives on every bucket."""
    lines = []
    for s in slices:
        z = cm.zero1(sum(s.sizes), len(s.sizes), grad_bytes=s.grad_bytes,
                     param_bytes=s.param_bytes, link=link)
        lines.append(cm.BucketLine(s, z, z))
    return cm.CommSummary(tuple(lines), dp)


def _layerwise_comm(problem: DPProblem, even: Sequence[cm.BucketSlices], numel: Sequence[int],
                    link: LinkProfile) -> cm.CommSummary:
    """All-reduce of every bucket, then one uneven all-gather (one broadcast per root)."""
    lines = []
    for s in even:
        R = len(s.sizes)
        red = cm.reduce_traffic("all_reduce", s.sizes, s.grad_bytes)
        none = cm.Traffic(0, (0,) * R, (0,) * R)
        c = cm.BucketComm("all_reduce", red, none, red.seconds(link))
        lines.append(cm.BucketLine(s, c, c))
    pb = even[0].param_bytes if even else 2
    gat = cm.gather_traffic("per_root", tuple(numel), pb)
    none = cm.Traffic(0, (0,) * len(numel), (0,) * len(numel))
    c = cm.BucketComm("per_root", none, gat, gat.seconds(link))
    s = cm.BucketSlices(tuple(numel), pb, pb, tuple(range(problem.dp)))
    lines.append(cm.BucketLine(s, c, c))
    return cm.CommSummary(tuple(lines), problem.dp)


def baselines(problem: DPProblem, plan: Plan | None = None,
              link: LinkProfile | None = None) -> list[BaselineRow]:
    """Every baseline's max/mean, gap to the certified bound and collectives (and ``plan`` as
    ``canzona``), on ``link`` (default: :func:`problem_link`)."""
    link = link or problem_link(problem, plan)
    bound = max(pigeonhole_bound(problem), plan.metrics.certified_bound if plan else 0)
    eq = {(b.buffer, b.bucket): equal_cuts(b) for b in problem.buckets}
    even = _cut_slices(problem, eq)
    zero1 = _even(even, problem.dp, link)
    rows = []
    ev = evaluate(problem, eq, split_mode="fragments")
    rows.append(_row("zero1", ev.load, bound, ev.split_matrices, "reduce-scatter", zero1))
    ev = evaluate(problem, eq, split_mode="owner")
    rows.append(_row("asc", ev.load, bound, 0, "reduce-scatter", zero1))
    for name, lpt in (("layerwise", False), ("layerwise-lpt", True)):
        load, numel = _layerwise(problem, lpt)
        rows.append(_row(name, load, bound, 0, "all-reduce",
                         _layerwise_comm(problem, even, numel, link)))
    packed = megatron_packed(problem)
    rows.append(dataclasses.replace(
        _row("megatron-packed", packed.load, bound, 0, "reduce-scatter",
             _even(packed.slices, problem.dp, link)), padding=packed.padding))
    ev = evaluate(problem, cuts := greedy(problem, alpha=1.0))
    rows.append(_row("canzona-greedy", ev.load, bound, ev.split_matrices, "reduce-scatter",
                     cm.summarise(_cut_slices(problem, cuts), problem.dp, link)))
    if plan is not None:
        rows.append(_row("canzona", plan.metrics.dp_load, bound, plan.metrics.split_matrices,
                         "reduce-scatter", cm.plan_summary(plan, link)))
    return rows
