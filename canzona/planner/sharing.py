"""Beyond the atomic bound: which matrix updates a few ranks would share, over which group, and
the per-GPU bound that gives (issue 18, items 2 and 4: the planner's decision and bound; the TP
schedule and the runtime execute what ``TPOptions.share`` chooses).

Whole-matrix ownership has a floor: no GPU finishes before the largest single task, so the atomic
bound is LB = max(mean, largest task), the mean being the useful work per GPU (the single-device
cost of every task, AdamW shards and replicated matrices included, over dp·tp GPUs). Muon's
Newton–Schulz can be shared by k ranks exactly (``canzona.runtime.optim.shared_ns``): each rank
holds a row block of the matrix oriented along its long dimension (m × n, m ≥ n) and per
iteration computes its partial Gram (one all-reduce of its packed upper part, about n²/2) and
its rows of the update:
``s·(4n²⌈m/k⌉ + 2n³)`` FLOPs per rank, or ``s·(4n²⌈m/k⌉ + poly_flops(n, k))`` with the
polynomial split (≈ n³/k: each rank the packed upper parts of two block rows of the symmetric
polynomial; one all-gather of them more per iteration). The sharing groups:

* ``tp``: the TP group of the owning DP index (k = tp) — for a TP-split matrix whose split
  dimension is its long one (column-parallel QKV and fc1, row-parallel proj and fc2 of the usual
  shapes): the shards *are* the row blocks, nothing is gathered to a host;
* ``tp_pair``: the TP group and the same TP ranks at a second DP index (k = 2·tp) — for a
  tall column-parallel matrix whose piece over its TP group alone outweighs a GPU's share
  (llama3-70b's fused gate/up at tp 8): each TP shard's ZeRO-1 cut moves to a row boundary
  between the two DP indices; the Gram is reduce-scattered over TP, its 1/tp chunks summed
  across the pair, all-gathered over TP (``runtime.optim.shared_ns.TPPair``: the kernel). The
  planner places them on fixed partner indices (2s, 2s + 1) where that lowers its objective
  (``tp_pair_decision``, ``bundles.tp_bundle_candidate``; ``TPOptions.share = "pairs"``: every
  one), the runtime's TP lockstep runs them;
* ``dp``: k = 2 or 4 DP indices — for a matrix TP does not split (tp = 1): its ZeRO-1 cut moves
  to a row boundary; a wide matrix's row blocks are blocks of its short dimension, so the ranks
  swap them for column blocks before the iteration and back after (two all-to-alls). The
  planner and the runtime do pairs (``pair_decision``, ``runtime.pairs``); quads are in the
  bound only;
* ``tp_sub``: a sub-group of k < tp ranks of the TP group (k dividing tp), tp/k matrices of one
  DP index side by side, one per sub-group (:func:`tp_sub_piece`): each member gathers tp/k
  shards of its matrix (a row block) from the TP group, the k orthogonalise together, the
  updates go back to the shards' ranks (``runtime.optim.sub_groups``: the kernel). Per rank
  the compute grows as 1/k while the Gram's collectives stay about the same, so fewer ranks
  per matrix spend fewer collective seconds per FLOP. The gather and the return count as
  collectives, which the other pieces of a lockstep may hide (the kernel's ``sub_group_rows``
  can start them asynchronously; its one-matrix entry waits for them). In the bound's model
  only (``groups`` must name it): the planner and the optimizer do not place such pieces yet.

The collectives sit on the critical path of every iteration (the next step needs the reduced
Gram): their modelled time (α–β on the group's link, ``HardwareProfile.link``) is part of a
piece's critical path, charged at the profile's achieved rate — less what runs beside the
piece's own Gram products, as the kernel reduces the Gram chunk by chunk while computing the
next chunk (:func:`gram_pipeline`, ``ShareOption.hidden_s``). They are not work a GPU must do —
it computes other tasks while it waits, as the micro-groups already overlap — so the mean grows
only by the FLOPs sharing adds (each rank's 2n³ of the polynomial, or its split share).
:func:`sharing_bound` decides greedily: while the heaviest unshared task exceeds the mean (the
useful work plus the FLOPs added so far), share it with the option of least added FLOPs whose
critical path fits under that mean, else the one with the shortest path. The bound with sharing
is on each GPU's work: max(that mean, largest unshared task, largest shared piece); the longest
critical path (``longest_path``) is reported beside it, a floor on the step's time. Loads are in
the plan's cost units (a task's load per FLOP converts FLOPs and seconds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .cost import load_hardware
from .formulas import (gram_chunks, lockstep_batches, lockstep_bytes, poly_flops,
                       poly_packed_numel)
from .hardware import HardwareProfile, LinkProfile
from .planning import DPProblem, PairShare, equal_cuts, evaluate
from .tp.context import Run, lockstep_seconds

__all__ = ["PairShare", "Run", "ShareOption", "SharedTask", "SharingReport", "block_decision",
           "gram_pipeline", "kind_of", "lockstep_batches", "lockstep_bytes", "lockstep_seconds",
           "pair_decision", "pair_link", "price_pair", "price_tp_pair", "priced_for",
           "profile_rate",
           "shard_block_decision", "shard_blocks_aligned", "share_options", "sharing_bound",
           "tp_pair_decision", "tp_sub_piece"]

Group = Literal["tp", "tp_pair", "dp", "tp_sub"]
#: DP sharing group sizes: adjacent DP indices in fixed pairs or quads.
DP_GROUP_SIZES = (2, 4)


@dataclass(frozen=True, slots=True)
class ShareOption:
    """One way to share a task: ``k`` ranks of a ``group``, with or without the polynomial split.

    ``piece_flops``: Newton–Schulz FLOPs per sharing rank (all steps); ``comm_s``: seconds of
    its collectives (all steps: all-reduces of the Gram, all-gathers of the split polynomial);
    ``hidden_s``: how much of ``comm_s`` runs beside the rank's own Gram products (the Gram is
    all-reduced chunk by chunk as it is computed, ``formulas.gram_chunks``), so a piece alone
    takes ``compute + comm_s − hidden_s`` (:meth:`alone_s`)."""

    group: Group
    k: int
    split_poly: bool
    piece_flops: int
    comm_s: float
    hidden_s: float = 0.0

    def alone_s(self, rate: float) -> float:
        """Seconds of the piece alone at ``rate`` FLOP/s: its compute and what its own compute
        does not hide of its collectives."""
        return self.piece_flops / rate + self.comm_s - self.hidden_s


@dataclass(frozen=True, slots=True)
class SharedTask:
    """A task the bound shares, in the plan's cost units: its load alone; ``piece_load``, each
    sharing rank's work (its FLOPs); ``path_load``, its critical path on a sharing rank (those
    FLOPs and the collectives it waits for); ``overhead``, the FLOPs added over the whole group
    (k pieces minus the task)."""

    task: int
    name: str
    shape: tuple[int, int]
    load: int
    option: ShareOption
    piece_load: float
    path_load: float
    overhead: float


@dataclass(frozen=True, slots=True)
class SharingReport:
    """The atomic bound and the bound with sharing, per GPU, in the plan's cost units."""

    optimizer: str
    gpus: int
    mean: float  # useful work per GPU
    largest_task: int
    atomic_lb: float
    shared_lb: float
    overhead: float  # Σ of the shared tasks' added FLOPs (cost units)
    shared: tuple[SharedTask, ...]
    note: str = ""
    #: the longest single task's critical path (a shared piece with its collectives, or an
    #: unshared task): a floor on the step, not on any GPU's work
    longest_path: float = 0.0

    @property
    def atomic_ratio(self) -> float:
        return self.atomic_lb / self.mean if self.mean else 1.0

    @property
    def shared_ratio(self) -> float:
        return self.shared_lb / self.mean if self.mean else 1.0

    def to_dict(self) -> dict:
        return {
            "optimizer": self.optimizer, "gpus": self.gpus, "mean": self.mean,
            "largest_task": self.largest_task, "atomic_lb": self.atomic_lb,
            "atomic_lb_over_mean": round(self.atomic_ratio, 6), "shared_lb": self.shared_lb,
            "shared_lb_over_mean": round(self.shared_ratio, 6), "overhead": self.overhead,
            "longest_path": self.longest_path,
            "longest_path_over_mean": round(self.longest_path / self.mean, 6) if self.mean else 1.0,
            "note": self.note,
            "shared": [{"task": s.task, "name": s.name, "shape": list(s.shape), "load": s.load,
                        "group": s.option.group, "k": s.option.k,
                        "split_poly": s.option.split_poly, "piece_load": s.piece_load,
                        "path_load": s.path_load, "overhead": s.overhead,
                        "comm_s": s.option.comm_s, "hidden_s": s.option.hidden_s}
                       for s in self.shared],
        }


def profile_rate(hw: HardwareProfile) -> float:
    """The achieved FLOP/s the sharing decisions time compute at: the profile's bf16 peak (its
    largest without one) times its compute efficiency."""
    return hw.peak_flops.get("bf16", max(hw.peak_flops.values())) * hw.compute_efficiency


def _all_reduce_s(numel: int, e: int, k: int, link: LinkProfile) -> float:
    return link.latency_s + 2 * (k - 1) / k * numel * e / link.busbw


def _all_gather_s(numel: int, e: int, k: int, link: LinkProfile) -> float:
    """All-gather of ``numel`` elements in all (each rank contributing numel / k)."""
    return link.latency_s + (k - 1) / k * numel * e / link.busbw


def gram_pipeline(rows: int, n: int, rate: float,
                  chunk_comm: Callable[[int], tuple[float, float]]) -> tuple[float, float]:
    """One step's Gram on a rank with ``rows`` rows, as the kernel runs it
    (``formulas.gram_chunks``): each chunk's rows of G computed (at ``rate`` FLOP/s), then the
    sum of its packed upper part launched while the next chunk is computed. ``chunk_comm``
    gives, for a chunk's packed elements, the seconds of the collective that starts at once
    (an all-reduce; a ``TPPair``'s reduce-scatter over TP) and of what follows only when the
    chunk is waited for (nothing; the partner's sum and the all-gather). Returns (seconds of all
    the chunks' collectives, seconds of them that run beside the Gram's own products): the
    products and the collectives that start at once form a two-stage pipeline ending at max over
    chunks j of (compute of chunks ≤ j + collectives of chunks ≥ j)."""
    chunks = gram_chunks(n)
    comp = [2 * rows * (r1 - r0) * n / rate for r0, r1, _, _ in chunks]
    comm = [chunk_comm(p1 - p0) for _, _, p0, p1 in chunks]
    now = [a for a, _ in comm]
    end = max(sum(comp[:j + 1]) + sum(now[j:]) for j in range(len(comp)))
    return sum(now) + sum(b for _, b in comm), max(0.0, sum(comp) + sum(now) - end)


def shared_piece(group: Group, k: int, split: bool, m: int, n: int, steps: int, e: int,
                 link: LinkProfile, *, rate: float, exchange: bool = False) -> ShareOption:
    """One sharing rank's Newton–Schulz FLOPs and collective seconds (all ``steps``) for an
    m × n matrix (m ≥ n) shared by ``k`` ranks over ``link`` (``e`` bytes per element); the Gram
    all-reduced chunk by chunk beside its own products (:func:`gram_pipeline`, its compute at
    ``rate`` FLOP/s). ``exchange``: the ranks hold blocks of the short dimension (a wide matrix
    cut between two rows in a DP buffer) and swap them for long-dimension blocks before the
    iteration and back after (``runtime.pairs``): two all-to-alls of each rank's m·n/k
    elements, which nothing hides."""
    rows = -(-m // k)
    reduce_s, hidden = gram_pipeline(rows, n, rate,
                                     lambda numel: (_all_reduce_s(numel, e, k, link), 0.0))
    if split:  # each rank computes and all-gathers its packed upper parts of the symmetric P
        flops = steps * (4 * n * n * rows + poly_flops(n, k))
        comm = steps * (reduce_s + _all_gather_s(k * poly_packed_numel(n, k), e, k, link))
    else:
        flops = steps * (4 * n * n * rows + 2 * n ** 3)
        comm = steps * reduce_s
    if exchange:
        comm += 2 * (link.latency_s + (k - 1) / k * (m * n / k) * e / link.busbw)
    return ShareOption(group, k, split, flops, comm, steps * hidden)


def tp_pair_piece(tp: int, split: bool, m: int, n: int, steps: int, e: int,
                  tp_link: LinkProfile, pair_link: LinkProfile, *, rate: float) -> ShareOption:
    """One rank's FLOPs and collective seconds (all ``steps``) for an m × n matrix (m ≥ n)
    shared by a TP group of ``tp`` and the same TP ranks at a partner DP index (k = 2·tp; the
    kernel's ``TPPair``): the Gram, chunk by chunk, reduce-scattered over the TP group
    (``tp_link``) beside the next chunk's products (:func:`gram_pipeline`, at ``rate``), then,
    when waited for, each rank's 1/tp part summed with the partner's (``pair_link``) and
    all-gathered over the TP group; with the split, this rank's packed parts of P swapped with
    the partner, then both gathered over the TP group."""
    k = 2 * tp
    rows = -(-m // k)

    def over_tp(numel: int) -> float:  # a reduce-scatter or all-gather of numel over TP
        return tp_link.latency_s + (tp - 1) / tp * numel * e / tp_link.busbw

    comm, hidden = gram_pipeline(rows, n, rate, lambda numel: (
        over_tp(numel), pair_link.latency_s + numel / tp * e / pair_link.busbw + over_tp(numel)))
    if split:
        q = poly_packed_numel(n, k)
        flops = steps * (4 * n * n * rows + poly_flops(n, k))
        comm += (pair_link.latency_s + q * e / pair_link.busbw
                 + _all_gather_s(2 * tp * q, e, tp, tp_link))
    else:
        flops = steps * (4 * n * n * rows + 2 * n ** 3)
    return ShareOption("tp_pair", k, split, flops, steps * comm, steps * hidden)


def tp_sub_piece(tp: int, k: int, split: bool, m: int, n: int, steps: int, e: int,
                 link: LinkProfile, *, rate: float) -> ShareOption:
    """One rank's FLOPs and collective seconds (all ``steps``) for an m × n matrix (m ≥ n, its
    TP shards row blocks) shared by a sub-group of ``k`` of its TP group's ``tp`` ranks, with
    tp/k matrices of the index side by side, one per sub-group. Sub-groups are strided (matrix
    j's on TP ranks j, j + tp/k, …; member i holds shards [i·tp/k, (i+1)·tp/k), its own among
    them), so each rank receives tp/k − 1 shards of the matrix it shares and sends as many of
    the others' (an all-to-all over the TP group, ``link``), the same again to return the
    update rows; between them :func:`shared_piece` over the sub-group (on the same link: the
    strided ranks span the TP group). ``k = tp`` is the TP group's own piece (nothing
    gathered)."""
    if k < 1 or tp % k:
        raise ValueError(f"a TP sub-group's size divides tp ({tp}); got {k}")
    piece = shared_piece("tp_sub", k, split, m, n, steps, e, link, rate=rate)
    moved = (tp // k - 1) * -(-m // tp) * n * e  # shards one rank receives (and sends)
    a2a = 2 * (link.latency_s + moved / link.busbw) if moved else 0.0
    return dataclasses.replace(piece, comm_s=piece.comm_s + a2a)


def share_options(problem: DPProblem, task: int, hw: HardwareProfile, *,
                  ns_bytes: int = 2, groups: tuple[Group, ...] = ("tp", "tp_pair", "dp"),
                  dp_sizes: tuple[int, ...] = DP_GROUP_SIZES) -> list[ShareOption]:
    """Every way ``task`` may be shared over the ``groups`` kinds (none for a non-Muon task or
    one that cannot be). DP groups (``dp_sizes`` DP indices) share a whole parameter cut in its
    buffer between two rows (a wide one's blocks exchanged for column blocks: its cost)."""
    t = problem.tasks[task]
    if problem.settings.name != "muon" or t.optimizer != "matrix" or len(t.shape) != 2:
        return []
    rows, cols = t.shape
    m, n = max(rows, cols), min(rows, cols)
    long_dim = 0 if rows >= cols else 1
    steps = problem.settings.ns_steps
    sizes = problem.sizes
    p = problem.spec[t.param]
    tp = sizes.expert_tp if p.is_expert else sizes.tp
    rate = profile_rate(hw)
    out = []
    if t.tp_split and tp > 1 and tp == sizes.tp:  # the dense TP group
        # The TP shards are row blocks of the oriented matrix when the split dim is the long one.
        if (p.tp_dim == long_dim or rows == cols) and t.part is None and "tp" in groups:
            link = hw.link(tp)
            out += [shared_piece("tp", tp, s, m, n, steps, ns_bytes, link, rate=rate)
                    for s in (False, True)]
        if (p.tp_dim == long_dim or rows == cols) and t.part is None and "tp_sub" in groups:
            link = hw.link(tp)  # strided sub-groups span the TP group
            out += [tp_sub_piece(tp, k, s, m, n, steps, ns_bytes, link, rate=rate)
                    for k in range(2, tp) if tp % k == 0 for s in (False, True)]
        # More ranks than the TP group: each shard cut at a row boundary between two DP
        # indices — a ZeRO-1 cut of a shard is a block of its stored rows, so the shard must be
        # a row block of the oriented matrix with whole rows (a tall column-parallel weight).
        if (p.tp_dim == 0 and rows >= cols and t.part is None and sizes.dp >= 2
                and "tp_pair" in groups):
            pair = hw.link(2 * tp)  # two DP indices: their global ranks lie tp apart
            out += [tp_pair_piece(tp, s, m, n, steps, ns_bytes, hw.link(tp), pair, rate=rate)
                    for s in (False, True)]
    elif (tp == 1 or not t.tp_split) and "dp" in groups and t.part is None:
        # The ZeRO-1 cut moves to a row boundary; a wide matrix's row blocks are swapped for
        # column blocks (its long dimension) before the iteration and back after.
        for k in dp_sizes:  # pairs: any two DP indices; quads (the bound): fixed groups
            if k <= sizes.dp and (k == 2 or sizes.dp % k == 0) and min(rows, cols) >= k:
                link = hw.link(k * sizes.tp)
                out += [shared_piece("dp", k, s, m, n, steps, ns_bytes, link, rate=rate,
                                     exchange=rows < cols) for s in (False, True)]
    return out


def _useful_total(problem: DPProblem) -> float:
    """Per-GPU work summed over all GPUs: every task once, AdamW shards once per TP rank, matrices
    TP does not split once per TP rank (every rank of the index computes them)."""
    from .tp.context import TPContext, index_work

    ctx = TPContext.build(problem, problem.comm_dtype)
    cuts = {(b.buffer, b.bucket): equal_cuts(b) for b in problem.buckets}
    base, owned = index_work(problem, cuts, ctx)
    return sum(base) * problem.sizes.tp + sum(problem.loads[i] for ids in owned for i in ids)


def sharing_bound(problem: DPProblem, *, hardware: str | HardwareProfile = "h100",
                  ns_bytes: int = 2, groups: tuple[Group, ...] = ("tp", "tp_pair", "dp"),
                  lockstep: bool = False,
                  dp_sizes: tuple[int, ...] = DP_GROUP_SIZES) -> SharingReport:
    """The atomic per-GPU bound and the bound with Muon tasks shared (see the module docstring).

    Args:
        problem: the plan's DP problem (``make_problem``; ``report.rebuild_problem`` for a plan).
        hardware: the profile whose links time the collectives and whose achieved rate turns
            seconds into FLOPs.
        ns_bytes: bytes per element of the Newton–Schulz iteration (bf16: 2).
        groups: the sharing groups allowed (``("tp",)``: the TP schedule's ``share="auto"``).
        dp_sizes: the DP group sizes allowed (``(2,)``: the pairs ``pair_decision`` plans).
        lockstep: choose among the options that fit by the longer of a piece's compute and its
            collectives (what it adds to a group run in lockstep, where the others hide the
            shorter) instead of by the FLOPs sharing adds.
    """
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    gpus = problem.dp * problem.sizes.tp
    total = _useful_total(problem)
    mean = total / gpus
    matrix = [t.id for t in problem.tasks if t.optimizer == "matrix"]
    largest = max((problem.loads[i] for i in matrix), default=0)
    atomic = max(mean, float(largest))
    name = problem.settings.name
    if name == "shampoo" and problem.sizes.tp > 1:
        # blocks shard by shard: no FLOPs added, no collective
        blocks = shard_block_decision(problem, hw)
        shared = []
        for i, (piece, *_) in sorted(blocks.items()):
            t = problem.tasks[i]
            flops = problem.costs[i].flops
            o = ShareOption("tp", problem.sizes.tp, False,
                            int(piece * flops / problem.loads[i]) if problem.loads[i] else 0, 0.0)
            shared.append(SharedTask(i, t.name, (max(t.shape), min(t.shape)), problem.loads[i],
                                     o, piece, piece, 0.0))
        rest = max((problem.loads[i] for i in matrix if i not in blocks), default=0)
        top = max([s.piece_load for s in shared] + [float(rest)], default=0.0)
        return SharingReport(name, gpus, mean, largest, atomic, max(mean, top), 0.0,
                             tuple(shared), longest_path=top,
                             note="Shampoo: the matrices whose TP shards are whole blocks are "
                                  "preconditioned shard by shard (no gather); the others stay "
                                  "whole")
    if name != "muon":
        return SharingReport(name, gpus, mean, largest, atomic, atomic, 0.0, (),
                             note=f"sharing applies to Muon's Newton–Schulz (and Shampoo's "
                                  f"blocks); {name} tasks stay whole")
    rate = profile_rate(hw)
    order = sorted(matrix, key=lambda i: (-problem.loads[i], i))
    shared: list[SharedTask] = []
    extra = 0.0
    for i in order:
        load = problem.loads[i]
        target = (total + extra) / gpus
        if load <= target:
            break
        flops = problem.costs[i].flops
        unit = load / flops if flops else 0.0
        best = None
        for o in share_options(problem, i, hw, ns_bytes=ns_bytes, groups=groups,
                               dp_sizes=dp_sizes):
            path = o.alone_s(rate) * rate * unit
            over = max(0.0, (o.k * o.piece_flops - flops) * unit)
            fits = path <= target
            cost = max(o.piece_flops, o.comm_s * rate) * unit if lockstep else over
            key = (not fits, cost if fits else path, o.k, o.split_poly)
            if best is None or key < best[0]:
                best = (key, o, path, over)
        t = problem.tasks[i]
        if best is None or best[2] >= load:
            continue
        _, o, path, over = best
        m, n = max(t.shape), min(t.shape)
        s = SharedTask(i, t.name, (m, n), load, o, o.piece_flops * unit, path, over)
        shared.append(s)
        extra += s.overhead
    mean_with = (total + extra) / gpus
    pieces = max((s.piece_load for s in shared), default=0.0)
    rest = [problem.loads[i] for i in matrix if i not in {s.task for s in shared}]
    unshared_max = max(rest, default=0)
    bound = max(mean_with, pieces, float(unshared_max))
    path = max((s.path_load for s in shared), default=0.0)
    return SharingReport(name, gpus, mean, largest, atomic, max(bound, mean), extra,
                         tuple(shared), longest_path=max(path, float(unshared_max)))


def pair_decision(problem: DPProblem, hardware: str | HardwareProfile = "h100",
                  mode: str = "auto") -> dict[int, PairShare]:
    """``TPOptions.share`` at tp = 1: the tasks DP pairs share (Shampoo: ``block_decision``;
    ``auto``: those the bound shares over pairs; ``all``/``all-split``: every eligible one — a whole Muon matrix of a
    dense buffer). A piece's load is its compute plus its exchanges (a DP index rarely holds two
    pieces of one pair to hide one behind the other), priced on NVLink (``priced_for`` reprices
    the pairs the cuts put on two nodes)."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    if problem.settings.name == "shampoo":
        return block_decision(problem, mode)
    if problem.sizes.tp != 1 or problem.dp < 2 or problem.settings.name != "muon":
        return {}
    dense = {problem.tasks[i].param for b in problem.buckets for it in b.items for i in it.tasks
             if not problem.layout.buffers[b.buffer].expert}
    if mode in ("all", "all-split"):
        chosen = {}
        for t in problem.tasks:
            opts = [o for o in share_options(problem, t.id, hw, groups=("dp",), dp_sizes=(2,))
                    if o.split_poly == (mode == "all-split")]
            if opts:
                chosen[t.id] = opts[0]
    else:
        report = sharing_bound(problem, hardware=hw, groups=("dp",), dp_sizes=(2,))
        chosen = {x.task: x.option for x in report.shared}
    return {i: price_pair(problem, i, o.split_poly, hw, hw.link(2))
            for i, o in sorted(chosen.items()) if problem.tasks[i].param in dense}


def tp_pair_decision(problem: DPProblem, hardware: str | HardwareProfile = "h100",
                     mode: str = "auto") -> dict[int, PairShare]:
    """At tp > 1 (Muon): the tall column-parallel matrices a TP group would share with the same
    TP ranks at a partner DP index (k = 2·tp, ``runtime.optim.shared_ns.TPPair``): ``auto``,
    those the bound shares so (:func:`sharing_bound` over TP groups and TP pairs); ``all`` /
    ``all-split``, every eligible one, with or without the polynomial split. Each priced by
    :func:`price_tp_pair`. The DP problem (``with_pairs``), the per-GPU objective
    (``tp.context``), the TP schedule (a half in each partner's lockstep), the plan
    (``dp_shared`` at tp > 1, ``SharedTaskPlan.partner``) and the runtime account for them."""
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    sizes = problem.sizes
    if problem.settings.name != "muon" or sizes.tp == 1 or problem.dp < 2:
        return {}
    if mode in ("all", "all-split"):
        chosen = {}
        for t in problem.tasks:
            opts = [o for o in share_options(problem, t.id, hw, groups=("tp_pair",))
                    if o.split_poly == (mode == "all-split")]
            if opts:
                chosen[t.id] = opts[0]
    else:
        report = sharing_bound(problem, hardware=hw, groups=("tp", "tp_pair"))
        chosen = {x.task: x.option for x in report.shared if x.option.group == "tp_pair"}
    return {i: price_tp_pair(problem, i, o.split_poly, hw) for i, o in sorted(chosen.items())
            if problem.tasks[i].shape[0] // sizes.tp >= 2}


def price_tp_pair(problem: DPProblem, task: int, split: bool, hw: HardwareProfile) -> PairShare:
    """A tall column-parallel Muon task shared by its TP group and the same TP ranks at a
    partner DP index (:func:`tp_pair_piece`, the partner over ``hw.link(2·tp)``): every TP shard
    cut at the same row, half of its rows (``row``, a row of the shard) on each DP index; per
    piece the load one TP rank carries (its compute and the collectives its own Gram products
    do not hide, at the profile's rate, in cost units) and its FLOPs per rank."""
    t = problem.tasks[task]
    tp = problem.sizes.tp
    rows, cols = t.shape
    rate = profile_rate(hw)
    o = tp_pair_piece(tp, split, rows, cols, problem.settings.ns_steps, 2, hw.link(tp),
                      hw.link(2 * tp), rate=rate)
    flops = problem.costs[task].flops
    unit = problem.loads[task] / flops if flops else 0.0
    load = math.ceil(o.alone_s(rate) * rate * unit)
    return PairShare(-(-rows // tp) // 2, split, (load, load), (o.piece_flops, o.piece_flops),
                     o.piece_flops / rate, o.comm_s, hidden_s=o.hidden_s)


def pair_link(hw: HardwareProfile, owners: tuple[int, int], tp: int = 1) -> LinkProfile:
    """The link between two DP indices (their global ranks d·tp): NVLink within a node."""
    a, b = (d * tp // hw.gpus_per_node for d in owners)
    return hw.intra_node if a == b else hw.inter_node


def price_pair(problem: DPProblem, task: int, split: bool, hw: HardwareProfile,
               link: LinkProfile) -> PairShare:
    """A Muon task shared by two DP indices over ``link``: each piece's FLOPs and its load, its
    compute plus its exchanges at the profile's rate, in the plan's cost units."""
    t = problem.tasks[task]
    rows, cols = t.shape
    rate = profile_rate(hw)
    o = shared_piece("dp", 2, split, max(rows, cols), min(rows, cols),
                     problem.settings.ns_steps, 2, link, rate=rate, exchange=rows < cols)
    flops = problem.costs[task].flops
    unit = problem.loads[task] / flops if flops else 0.0
    compute = o.piece_flops / rate
    load = math.ceil(o.alone_s(rate) * rate * unit)
    return PairShare(-(-rows // 2), split, (load, load), (o.piece_flops, o.piece_flops), compute,
                     o.comm_s, hidden_s=o.hidden_s)


def priced_for(problem: DPProblem, pairs: dict[int, PairShare],
               owners: dict[int, tuple[int, int]], hw: HardwareProfile) -> dict[int, PairShare]:
    """``pairs`` with each Muon pair's exchanges priced on the link between its owners (the
    decision assumed NVLink; a pair the cuts put on two nodes exchanges over the network)."""
    if problem.settings.name != "muon":
        return pairs
    return {i: x if pair_link(hw, owners[i], problem.sizes.tp) is hw.intra_node
            else price_pair(problem, i, x.split_poly, hw, hw.inter_node)
            for i, x in pairs.items()}


def pairs_in_nodes(base: DPProblem, pairs: dict[int, PairShare], cuts: dict,
                   hw: HardwareProfile) -> dict:
    """Cuts whose Muon pairs span two nodes less often: where the ranks of a bucket between a
    pair's two pieces hold nothing, one piece's rank range moves to an empty rank in the other
    piece's node (its whole range in that bucket, so nothing else changes owner but that
    index). A move is kept if the busiest DP index gets no heavier, nor the largest optimizer
    state, and the summed load falls (the pair exchanges over NVLink instead of the network;
    ``priced_for``'s pricing)."""
    from .planning import owner_of, pair_owners, with_pairs

    if base.settings.name != "muon" or not pairs:
        return cuts
    problem = with_pairs(base, pairs)  # NVLink-priced pieces; a pair on two nodes adds `extra`
    extra = {i: price_pair(base, i, x.split_poly, hw, hw.inter_node).loads[0] - x.loads[0]
             for i, x in pairs.items()}
    tp = base.sizes.tp
    # A trial moves one bucket's cuts: its loads and states are the totals with that bucket's
    # share swapped (integers, so exactly what evaluating the whole problem gives).
    alone = {(b.buffer, b.bucket): dataclasses.replace(problem, buckets=(b,))
             for b in problem.buckets}

    def part(key: tuple[int, int], c: tuple[int, ...]) -> tuple[list[int], list[int]]:
        ev = evaluate(alone[key], {key: c})
        return list(ev.load), list(ev.state_bytes)

    def score(c: dict, load: list[int], state: list[int]) -> tuple[float, float, int]:
        load = list(load)
        for i, (a, b) in pair_owners(problem, c).items():
            if a != b and pair_link(hw, (a, b), tp) is not hw.intra_node:
                load[a] += extra[i]
                load[b] += extra[i]
        return max(load), sum(load), max(state)

    def node(d: int) -> int:
        return d * tp // hw.gpus_per_node

    out = {k: tuple(c) for k, c in cuts.items()}
    ev = evaluate(problem, out)
    tot_load, tot_state = list(ev.load), list(ev.state_bytes)
    best = score(out, tot_load, tot_state)
    for bk in base.buckets:
        key = (bk.buffer, bk.bucket)
        items = next(b for b in problem.buckets if (b.buffer, b.bucket) == key).items
        for first, second in zip(items, items[1:]):
            if first.tasks != second.tasks or first.tasks[0] not in pairs:
                continue
            c = out[key]
            ra, rb = owner_of(c, first.start), owner_of(c, second.start)
            da, db = problem.dp_index(bk, ra), problem.dp_index(bk, rb)
            if rb <= ra + 1 or node(da) == node(db) or c[ra + 1] != c[rb]:
                continue  # adjacent, one node already, or ranks between them hold something
            trials = []
            for r in range(ra + 1, rb):  # rb's range to an empty rank r in a's node, or ra's
                moved = list(c)
                if node(problem.dp_index(bk, r)) == node(da):
                    moved[r + 1:rb + 1] = [c[rb + 1]] * (rb - r)
                    trials.append(moved)
                if node(problem.dp_index(bk, r)) == node(db):
                    moved = list(c)
                    moved[ra + 1:r + 1] = [c[ra]] * (r - ra)
                    trials.append(moved)
            old = part(key, out[key])
            for moved in trials:
                trial = {**out, key: tuple(moved)}
                new = part(key, trial[key])
                load = [t - o + n for t, o, n in zip(tot_load, old[0], new[0])]
                state = [t - o + n for t, o, n in zip(tot_state, old[1], new[1])]
                sc = score(trial, load, state)
                if sc[0] <= best[0] and sc[2] <= best[2] and sc[1] < best[1]:
                    out, best, tot_load, tot_state, old = trial, sc, load, state, new
    return out


def pair_waits(problem: DPProblem, cuts: dict) -> list[float]:
    """Per DP index of a plan with Muon pairs (``problem.pairs``, priced as the plan records
    them), its load counting the waits between partners as the runtime meets them (and the
    simulator models them): pairs run first, phase by phase, each pair's matrices in lockstep,
    and a pair starts when both partners are free — waits chain along the pairs of later
    phases. The rest of an index's load follows its pairs."""
    from .planning import pair_owners, pair_phases

    load = list(evaluate(problem, cuts).load)
    if problem.settings.name != "muon" or not problem.pairs:
        return [float(x) for x in load]
    owners = {i: o for i, o in pair_owners(problem, cuts).items() if o[0] != o[1]}
    phases = pair_phases(owners)
    runs: dict[tuple[int, tuple[int, int]], list[Run]] = {}
    for i, o in owners.items():
        x = problem.pairs[i]
        runs.setdefault((phases[o], o), []).append(x.run_piece())
        for d, piece in zip(o, x.loads):
            load[d] -= piece  # counted below, with its waits
    free = pair_timeline(runs, problem.settings.ns_steps, problem.dp)
    return [x + f for x, f in zip(load, free)]


def pair_timeline(runs: dict[tuple[int, tuple[int, int]], list[Run]],
                  steps: int, ranks: int) -> list[float]:
    """When each of ``ranks`` is done with its DP pairs: ``runs`` maps (phase, (a, b)) to the
    pair's matrices' (compute, collectives, hidden) (:data:`Run`); pairs run in phase order, each in lockstep
    (:func:`lockstep_seconds`), and a pair starts when both partners are free."""
    free = [0.0] * ranks
    for (_, (a, b)), pieces in sorted(runs.items()):
        free[a] = free[b] = max(free[a], free[b]) + lockstep_seconds(pieces, steps)
    return free


def block_row(rows: int, max_block: int) -> int | None:
    """Where a Shampoo matrix with ``rows`` rows is cut into two runs of whole block rows
    (blocks of ``max_block``, the remainder last): after ⌈blocks/2⌉ of them; None for one."""
    blocks = -(-rows // max_block)
    return None if blocks < 2 else -(-blocks // 2) * max_block


def block_pieces(settings, rows: int, cols: int, row: int) -> tuple[tuple[int, int],  # noqa: ANN001
                                                                    tuple[int, int]]:
    """(FLOPs, state bytes) of the two pieces of a Shampoo matrix cut before block row ``row``:
    each is the kernel on its own rows (blocks are preconditioned independently)."""
    from . import optimizers
    from .cost import STATE_BYTES

    spec = optimizers.get(settings.name)
    parts = ((row, cols), (rows - row, cols))
    return (tuple(spec.flops(m, n, settings) for m, n in parts),  # type: ignore[return-value]
            tuple(spec.state_numel(m, n, settings) * STATE_BYTES for m, n in parts))


def piece_loads(load: int, flops: int, piece_flops: tuple[int, int]) -> tuple[int, int]:
    """A task's load split over its pieces in proportion to their FLOPs."""
    return tuple(load * f // flops if flops else 0 for f in piece_flops)  # type: ignore[return-value]


def block_decision(problem: DPProblem, mode: str = "auto") -> dict[int, PairShare]:
    """Shampoo at tp = 1: the matrices whose blocks two DP indices host (item 3 of issue 18).
    A matrix is cut between two runs of whole block rows (``block_row``); each piece is the
    Shampoo kernel on its rows, exactly the whole matrix's update on those rows, with no
    exchange. ``auto``: the matrices heavier than a quarter of the mean load per DP index;
    ``all``/``all-split``: every one with two block rows or more."""
    st = problem.settings
    if problem.sizes.tp != 1 or problem.dp < 2 or st.name != "shampoo":
        return {}
    dense = {problem.tasks[i].param for b in problem.buckets for it in b.items for i in it.tasks
             if not problem.layout.buffers[b.buffer].expert}
    floor = problem.total / problem.dp / 4 if mode == "auto" else -1
    out = {}
    for t in problem.tasks:
        if t.optimizer != "matrix" or t.part is not None or len(t.shape) != 2 \
                or t.param not in dense or problem.loads[t.id] <= floor:
            continue
        rows, cols = t.shape
        row = block_row(rows, st.max_preconditioner_dim)
        if row is None:
            continue
        flops, states = block_pieces(st, rows, cols, row)
        loads = piece_loads(problem.loads[t.id], problem.costs[t.id].flops, flops)
        out[t.id] = PairShare(row, False, loads, flops, 0.0, 0.0, states)
    return out


def shard_blocks_aligned(smap, block: int) -> bool:  # noqa: ANN001  (shards.ShardMap)
    """Whether every TP rank's shard of a matrix (``shards.ShardMap``) is whole blocks of the
    matrix's Shampoo block grid (``block`` per side, the remainder last), laid out so that the
    shard's own grid is those blocks: every segment starts on a block boundary, in the shard and
    in the matrix, and is whole blocks long (or ends both at the matrix's end and the shard's).
    Then each TP rank preconditions its own blocks and gets the whole matrix's update on them."""
    if smap.dim is None or len(smap.full_shape) != 2:
        return False
    full, local = smap.full_shape[smap.dim], smap.local_shape[smap.dim]
    for s in smap.segments:
        if s.local_start % block or s.full_start % block:
            return False
        if s.length % block and not (s.full_start + s.length == full
                                     and s.local_start + s.length == local):
            return False
    return True


def shard_block_decision(problem: DPProblem, hardware: str | HardwareProfile = "h100"
                         ) -> dict[int, tuple[float, bool, float, float, float]]:
    """Shampoo at tp > 1 (item 3 of issue 18): the TP-split matrices whose shards are whole
    blocks (:func:`shard_blocks_aligned`), each preconditioned by its TP group shard by shard —
    every TP rank its own blocks, nothing gathered, no host, no collective; exactly the whole
    matrix's update (Shampoo's statistics, roots, grafting and momentum are per block or per
    element). Task id → (load per TP rank, False, compute seconds, 0.0, 0.0), what
    ``DPProblem.shared`` holds; the load is the task's load in proportion to its shard's FLOPs.
    Every eligible matrix: on the GPUs it is never heavier than hosting (the same FLOPs over tp
    ranks, no gather); whether the plan keeps them is the objective's call
    (``pipeline.plan_problem``: ``share="auto"`` compares with hosting)."""
    from . import optimizers
    from .shards import shard_map

    st, sizes = problem.settings, problem.sizes
    if st.name != "shampoo" or sizes.tp == 1:
        return {}
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    rate = profile_rate(hw)
    spec = optimizers.get(st.name)
    kv = problem.spec.config.kv_heads if problem.spec.config is not None else None
    out = {}
    for t in problem.tasks:
        if t.optimizer != "matrix" or not t.tp_split or t.part is not None or len(t.shape) != 2:
            continue
        p = problem.spec[t.param]
        if p.is_expert or len(p.shape) != 2:
            continue
        smap = shard_map(p, sizes.tp, kv_groups=kv)
        if not shard_blocks_aligned(smap, st.max_preconditioner_dim):
            continue
        flops = problem.costs[t.id].flops
        piece = spec.flops(*smap.local_shape, st)
        load = problem.loads[t.id] * piece / flops if flops else 0.0
        out[t.id] = (load, False, piece / rate, 0.0, 0.0)
    return out


def kind_of(name: str) -> str:
    """``decoder.layers.3.mlp.linear_fc1.weight`` → ``mlp.linear_fc1``."""
    parts = [p for p in name.split("#")[0].split(".") if not p.isdigit() and p != "weight"]
    return ".".join(parts[-2:]) if len(parts) >= 2 else (parts[0] if parts else name)


def share_decision(problem: DPProblem, hardware: str, mode: str = "auto"
                   ) -> dict[int, tuple[float, bool, float, float, float]]:
    """``TPOptions.share``: the tasks shared over their TP group (``auto``: those the bound of
    ``planner.sharing`` shares; ``all``/``all-split``: every eligible one): task id → (load per
    TP rank, polynomial split, compute seconds, collective seconds, of those the seconds beside
    its own Gram products), what ``DPProblem.shared`` holds; the load is max(compute,
    collectives) in cost units. Shampoo: the matrices whose
    shards are whole blocks, preconditioned shard by shard (``sharing.shard_block_decision``)."""
    if problem.settings.name == "shampoo":  # blocks preconditioned shard by shard, every mode
        return shard_block_decision(problem, hardware)
    hw = load_hardware(hardware)
    rate = profile_rate(hw)
    out = {}
    if mode in ("all", "all-split"):
        for t in problem.tasks:
            opts = [o for o in share_options(problem, t.id, hw, groups=("tp",))
                    if o.split_poly == (mode == "all-split")]
            if opts:
                out[t.id] = _entry(problem, t.id, opts[0], rate)
        return out
    report = sharing_bound(problem, hardware=hw, groups=("tp",), lockstep=True)
    for x in report.shared:
        out[x.task] = _entry(problem, x.task, x.option, rate)
    return out


def _entry(problem: DPProblem, task: int, o, rate: float  # noqa: ANN001
           ) -> tuple[float, bool, float, float, float]:
    """(load, split, compute s, collective s, hidden s) of one shared task: the load, for the DP side,
    is the longer of its compute and its collectives (the others of its group hide the shorter
    in the lockstep run); the schedule replaces the sum by the group's lockstep phase."""
    flops = problem.costs[task].flops
    unit = problem.loads[task] / flops if flops else 0.0
    compute = o.piece_flops / rate
    return (max(compute, o.comm_s) * rate * unit, o.split_poly, compute, o.comm_s, o.hidden_s)
