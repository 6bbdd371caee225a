"""Megatron's ways to give DP ranks whole matrices, and the DP rows ``canzona inspect`` prints.

The assignments (the strategy registry, :mod:`canzona.planner.strategies`, reads them for both
``compare`` and ``inspect``):

* :func:`megatron_layerwise` — megatron-core 0.16.1's ``LayerWiseDistributedOptimizer
  .shard_params``: every parameter whole, sorted by ascending local (TP-shard) size and dealt
  ping-pong (0 … R−1, R−1 … 0) over the ranks of its group; the parameters all-reduced over the
  DP group (the dense ones, and the experts at ep = 1) over it, the expert-parallel ones (ep > 1)
  over their expert-data-parallel group, each with its own count. Ties keep Megatron's
  parameter-group order (:func:`megatron_param_order`).
* :func:`layerwise_lpt` — the same groups dealt by LPT on max(m,n)·min(m,n)² of the TP-local
  shape (elements for the other parameters): each parameter, largest first, to the least loaded
  rank of its group.
* :func:`megatron_packed` — Megatron's 2026 shard-aligned layer-wise layout: whole matrices
  packed into even per-rank shards, each bucket padded to its largest shard, so the stock
  reduce-scatter / all-gather stay.

Every row (:class:`BaselineRow`) has its compute balance (load per DP index) and its
communication under the α–β model of :mod:`canzona.planner.comm` on the plan's link (its recorded
bus bandwidth and α): the most bytes any rank sends per iteration and the predicted collective
time of the busiest DP index (reduce + gather of every bucket, one after another). What each
row's collectives are:

* zero1, asc: ZeRO-1's even reduce-scatter + all-gather of every bucket (zero1 charges split
  matrices by fragments, asc each whole to the rank holding its start).
* the dealt rows (layerwise, layerwise-lpt): a ring all-reduce of every ZeRO-1 bucket (grad
  dtype), then one uneven all-gather per dealing group of the parameters each DP index was dealt
  (param dtype), which NCCL runs as one broadcast per root (Megatron's ``allgather_params``:
  ``torch.distributed.all_gather`` with per-rank sizes, no padding). Bytes ≈ 1.5× ZeRO-1's
 .
* megatron-packed: even reduce-scatter + all-gather over every bucket's padded size R·shard.
* canzona-greedy: the greedy's cuts, each bucket moved by its fastest method (what a plan
  records); canzona: the plan's own methods.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from . import comm as cm
from .dp.bounds import pigeonhole_bound
from .dp.greedy import greedy
from .hardware import DEFAULT_HARDWARE, LinkProfile, load_hardware
from .layout import Slot
from .plan import Plan
from .plan.comm_section import plan_summary
from .planning import BucketProblem, DPProblem, Item, equal_cuts, evaluate
from .settings import PARAM_ALIGN

__all__ = ["BaselineInputs", "BaselineRow", "Dealing", "DealtGroup", "PackedBucket",
           "PackedLayout", "asc_row", "dealt_row", "greedy_row", "layerwise_lpt",
           "megatron_layerwise", "megatron_packed", "megatron_param_order", "packed_row",
           "plan_row", "problem_link", "zero1_row", "NUMEL_EPSILON", "PADDING_FLOOR"]

#: Megatron's per-shard element cap while packing a bucket: a matrix goes to the least
#: compute-loaded shard whose fill stays ≤ (1 + ε)·(bucket elements / R) (``_NUMEL_EPSILON``).
NUMEL_EPSILON = 0.3
#: Megatron's bucket soft minimum: a bucket closes only once it holds max(bucket_size,
#: PADDING_FLOOR · R · its largest matrix) elements, so the padding that its largest matrix forces
#: (every shard at least that large) is at most 1/0.9 − 1 ≈ 11 % of the bucket.
PADDING_FLOOR = 0.9

#: An item of a problem: (index into ``problem.buckets``, index into that bucket's items).
Ref = tuple[int, int]


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
         summary: cm.CommSummary | None = None, padding: float | None = None) -> BaselineRow:
    mean = sum(load) / len(load)
    mx = max(load)
    return BaselineRow(name, mx, mean, mx / mean if mean else 1.0,
                       mx / bound - 1 if bound else 0.0, split, sync,
                       None if summary is None else summary.max_sent,
                       None if summary is None else summary.seconds, tuple(load), padding)


# --- layer-wise dealing ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DealtGroup:
    """Whole parameters dealt over one group of DP indices: the DP group (the dense buffers'
    parameters) or an expert-data-parallel group (an expert buffer's: one EP rank's experts)."""

    members: tuple[int, ...]  # the DP index of each rank of the group, by rank
    expert: bool
    items: tuple[Ref, ...]  # in dealing order
    owners: tuple[int, ...]  # the DP index each item is dealt to

    def numel(self, problem: DPProblem) -> tuple[int, ...]:
        """Elements dealt to each member (the sizes of the group's uneven all-gather)."""
        per = dict.fromkeys(self.members, 0)
        for (bi, ii), d in zip(self.items, self.owners):
            it = problem.buckets[bi].items[ii]
            per[d] += it.end - it.start
        return tuple(per[d] for d in self.members)


@dataclass(frozen=True, slots=True)
class Dealing:
    """Every parameter of a problem dealt whole to one DP index, group by group."""

    groups: tuple[DealtGroup, ...]

    def owners(self) -> dict[Ref, int]:
        """Item → the DP index it is dealt to."""
        return {ref: d for g in self.groups for ref, d in zip(g.items, g.owners)}


def _slot(problem: DPProblem, b: BucketProblem, it: Item) -> Slot:
    return problem.layout.buffers[b.buffer].buckets[b.bucket].slots[it.slot]


def _groups(problem: DPProblem) -> list[tuple[bool, tuple[int, ...], list[Ref]]]:
    """(expert, members, items) of every dealing group, dense first, in bucket order: a
    parameter is dealt over the DP indices of its bucket's sharding group, the parameters of
    an expert buffer (expert-parallel: ep > 1) apart from the dense ones. At ep = 1 the experts
    are in the dense buffer and Megatron marks them all-reduced like the dense parameters, so
    they are dealt with them."""
    groups: dict[tuple[bool, tuple[int, ...]], list[Ref]] = {}
    for bi, b in enumerate(problem.buckets):
        members = tuple(problem.dp_index(b, r) for r in range(b.ranks))
        expert = problem.layout.buffers[b.buffer].expert
        groups.setdefault((expert, members), []).extend((bi, ii) for ii in range(len(b.items)))
    return [(e, m, refs) for (e, m), refs in sorted(groups.items())]


def megatron_param_order(problem: DPProblem) -> dict[str, tuple[int, int]]:
    """Parameter name → its place in the list ``shard_params`` sorts (a stable sort, so this
    breaks ties of equal size): the Muon optimizer's parameters first (2-D, not the embedding or
    the output layer), then AdamW's default parameter group (the embedding and output layer),
    then its no-weight-decay group (1-D parameters and biases), each in registration order
    (``named_parameters``). Expert-parallel parameters (ep > 1) have groups of their own after
    the dense ones, which does not matter: they are dealt apart."""
    out = {}
    for i, p in enumerate(problem.spec.params):
        if len(p.shape) == 2 and p.kind not in ("embedding", "output"):
            group = 0
        elif len(p.shape) == 1 or p.name.endswith(".bias"):
            group = 2
        else:
            group = 1
        out[p.name] = (group, i)
    return out


def megatron_layerwise(problem: DPProblem) -> Dealing:
    """megatron-core 0.16.1's ``LayerWiseDistributedOptimizer.shard_params``: in each group
    the parameters sorted by ascending local (TP-shard) size, ties in Megatron's parameter-group
    order (:func:`megatron_param_order`), dealt ping-pong: ranks 0 … R−1, then R−1 … 0, again."""
    order = megatron_param_order(problem)
    groups = []
    for expert, members, refs in _groups(problem):
        def key(ref: Ref) -> tuple[int, tuple[int, int]]:
            b = problem.buckets[ref[0]]
            it = b.items[ref[1]]
            return it.end - it.start, order[_slot(problem, b, it).name]

        loop = list(range(len(members))) + list(range(len(members)))[::-1]
        dealt = sorted(refs, key=key)
        owners = tuple(members[loop[k % len(loop)]] for k in range(len(dealt)))
        groups.append(DealtGroup(members, expert, tuple(dealt), owners))
    return Dealing(tuple(groups))


def lpt_cost(problem: DPProblem, ref: Ref) -> int:
    """The layer-wise LPT's cost of an item: max(m,n)·min(m,n)² of a matrix's TP-local shape,
    elements otherwise."""
    b = problem.buckets[ref[0]]
    it = b.items[ref[1]]
    if it.atomic:
        shape = _slot(problem, b, it).local_shape
        if len(shape) == 2:
            return max(shape) * min(shape) ** 2
    return it.end - it.start


def layerwise_lpt(problem: DPProblem) -> Dealing:
    """The layer-wise groups dealt by LPT on :func:`lpt_cost`: largest first (ties: buffer,
    start), each to the least loaded rank of its group (ties: the lowest DP index)."""
    groups = []
    for expert, members, refs in _groups(problem):
        def key(ref: Ref) -> tuple[int, int, int]:
            b = problem.buckets[ref[0]]
            return -lpt_cost(problem, ref), b.buffer, b.items[ref[1]].start

        heap = [(0, d) for d in members]
        dealt = sorted(refs, key=key)
        owners = []
        for ref in dealt:
            c, d = heapq.heappop(heap)
            owners.append(d)
            heapq.heappush(heap, (c + lpt_cost(problem, ref), d))
        groups.append(DealtGroup(members, expert, tuple(dealt), tuple(owners)))
    return Dealing(tuple(groups))


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

    Re-derived from Megatron-LM's
    ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`` and
    ``compute_full_param_layout`` (megatron/core/optimizer/layer_wise_optimizer.py, 2026):

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
    * Each bucket is packed largest first — by Megatron's Newton–Schulz cost max(m,n)·min(m,n)² of
      the TP-local shape (:func:`lpt_cost`; elements for non-2-D tensors), not by elements — onto
      the least compute-loaded shard (loads persist across the buffer's buckets) among those whose
      fill stays ≤ (1 + 0.3) · the bucket's elements / R (:data:`NUMEL_EPSILON`); when none has
      room, onto the least-filled shard. Starts are 64-aligned; every shard is padded to the largest
      fill, rounded up to lcm(64, lcm(R, 128)/R), so R·shard is a valid bucket and the stock even
      reduce-scatter and all-gather move it. Nothing is ever split: the per-shard cap is soft and
      the last bucket is whatever remains, so padding has no hard bound
      (:attr:`PackedLayout.padding` reports it; e.g. qwen3-32b dp32 tp8: 4 matrix buckets, 12.9 %;
      qwen3-8b dp32 tp4: 43 %, its last bucket — a remainder of fewer matrices than ranks — padded
      3.5×; qwen3-0.6b dp8: 16 %).
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
        index, share = cm.bucket_places(buf, R, ep=ep, tp=problem.sizes.tp,
                                        etp=problem.sizes.expert_tp)
        g, p = cm.ELEMENT_BYTES[buf.grad_dtype], cm.ELEMENT_BYTES[buf.dtype]

        def item(ref: tuple[int, int]):
            return problem.buckets[ref[0]].items[ref[1]]

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
            costs = [lpt_cost(problem, r) for r in chunk]
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
            slices.append(cm.BucketSlices((shard,) * R, g, p, index, share))

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
            slices.append(cm.BucketSlices((chunk_size,) * R, g, p, index, share))
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
                                   *cm.bucket_places(buf, b.ranks, ep=problem.sizes.ep,
                                                     tp=problem.sizes.tp,
                                                     etp=problem.sizes.expert_tp)))
    return out


def _even(slices: Sequence[cm.BucketSlices], dp: int, link: LinkProfile) -> cm.CommSummary:
    """ZeRO-1's even collectives on every bucket."""
    lines = []
    for s in slices:
        z = cm.zero1(sum(s.sizes), len(s.sizes), grad_bytes=s.grad_bytes,
                     param_bytes=s.param_bytes, link=link)
        lines.append(cm.BucketLine(s, z, z))
    return cm.CommSummary(tuple(lines), dp)


def _dealt_comm(problem: DPProblem, even: Sequence[cm.BucketSlices], dealing: Dealing,
                link: LinkProfile) -> cm.CommSummary:
    """All-reduce of every bucket, then one uneven all-gather (one broadcast per root) per
    dealing group."""
    lines = []
    for s in even:
        R = len(s.sizes)
        red = cm.reduce_traffic(cm.ALL_REDUCE, s.sizes, s.grad_bytes)
        none = cm.Traffic(0, (0,) * R, (0,) * R)
        c = cm.BucketComm(cm.ALL_REDUCE, red, none, red.seconds(link))
        lines.append(cm.BucketLine(s, c, c))
    for g in dealing.groups:
        pb = max(cm.ELEMENT_BYTES[problem.layout.buffers[problem.buckets[bi].buffer].dtype]
                 for bi, _ in g.items)
        numel = g.numel(problem)
        gat = cm.gather_traffic(cm.PER_ROOT, numel, pb)
        none = cm.Traffic(0, (0,) * len(numel), (0,) * len(numel))
        c = cm.BucketComm(cm.PER_ROOT, none, gat, gat.seconds(link))
        lines.append(cm.BucketLine(cm.BucketSlices(numel, pb, pb, g.members), c, c))
    return cm.CommSummary(tuple(lines), problem.dp)


# --- the rows ----------------------------------------------------------------------------------


class BaselineInputs:
    """What every row reads: the problem, canzona's plan (None: no canzona row), the link
    (default :func:`problem_link`), the bound (the pigeonhole bound, or the plan's certified one
    if larger) and ZeRO-1's equal cuts with their even collectives."""

    def __init__(self, problem: DPProblem, plan: Plan | None = None,
                 link: LinkProfile | None = None) -> None:
        self.problem, self.plan = problem, plan
        self.link = link or problem_link(problem, plan)
        self.bound = max(pigeonhole_bound(problem), plan.metrics.certified_bound if plan else 0)
        self.equal = {(b.buffer, b.bucket): equal_cuts(b) for b in problem.buckets}
        self.even = _cut_slices(problem, self.equal)
        self.zero1 = _even(self.even, problem.dp, self.link)


def zero1_row(x: BaselineInputs, name: str, sync: str) -> BaselineRow:
    """ZeRO-1's equal chunks, split matrices charged by fragments."""
    ev = evaluate(x.problem, x.equal, split_mode="fragments")
    return _row(name, ev.load, x.bound, ev.split_matrices, sync, x.zero1)


def asc_row(x: BaselineInputs, name: str, sync: str) -> BaselineRow:
    """ZeRO-1's equal chunks, each matrix whole on the rank holding its start."""
    ev = evaluate(x.problem, x.equal, split_mode="owner")
    return _row(name, ev.load, x.bound, 0, sync, x.zero1)


def dealt_row(x: BaselineInputs, name: str, sync: str, dealing: Dealing) -> BaselineRow:
    """Whole parameters as ``dealing`` gives them; all-reduce, then the uneven all-gathers."""
    load = [0] * x.problem.dp
    for g in dealing.groups:
        for (bi, ii), d in zip(g.items, g.owners):
            load[d] += x.problem.buckets[bi].items[ii].load
    return _row(name, load, x.bound, 0, sync, _dealt_comm(x.problem, x.even, dealing, x.link))


def packed_row(x: BaselineInputs, name: str, sync: str) -> BaselineRow:
    """Megatron's packed layout and its even collectives."""
    packed = megatron_packed(x.problem)
    return _row(name, packed.load, x.bound, 0, sync,
                _even(packed.slices, x.problem.dp, x.link), packed.padding)


def greedy_row(x: BaselineInputs, name: str, sync: str) -> BaselineRow:
    """The paper's α-balanced greedy (α = 1), each bucket moved by its fastest method."""
    cuts = greedy(x.problem, alpha=1.0)
    ev = evaluate(x.problem, cuts)
    return _row(name, ev.load, x.bound, ev.split_matrices, sync,
                cm.summarise(_cut_slices(x.problem, cuts), x.problem.dp, x.link))


def plan_row(x: BaselineInputs, name: str, sync: str) -> BaselineRow | None:
    """The plan's recorded loads and its own methods (None without a plan)."""
    if x.plan is None:
        return None
    m = x.plan.metrics
    return _row(name, m.dp_load, x.bound, m.split_matrices, sync,
                plan_summary(x.plan, x.link))
