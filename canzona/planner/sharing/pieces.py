"""One rank's piece of a shared matrix update: its FLOPs and the seconds of its collectives,
for every group a Muon matrix may be shared over (:func:`share_options`).

Muon's Newton–Schulz can be shared by k ranks exactly (``canzona.runtime.optim.shared_ns``):
each rank holds a row block of the matrix oriented along its long dimension (m × n, m ≥ n) and
per iteration computes its partial Gram (one all-reduce of its packed upper part, about n²/2)
and its rows of the update: ``s·(4n²⌈m/k⌉ + 2n³)`` FLOPs per rank, or
``s·(4n²⌈m/k⌉ + poly_flops(n, k))`` with the polynomial split (≈ n³/k: each rank the packed
upper parts of two block rows of the symmetric polynomial; one all-gather of them more per
iteration). The sharing groups:

* ``tp``: the TP group of the owning DP index (k = tp) — for a TP-split matrix whose split
  dimension is its long one (column-parallel QKV and fc1, row-parallel proj and fc2 of the
  usual shapes): the shards *are* the row blocks, nothing is gathered to a host;
* ``tp_pair``: the TP group and the same TP ranks at a second DP index (k = 2·tp) — for a tall
  column-parallel matrix whose piece over its TP group alone outweighs a GPU's share
  (llama3-70b's fused gate/up at tp 8): each TP shard's ZeRO-1 cut moves to a row boundary
  between the two DP indices; the Gram is reduce-scattered over TP, its 1/tp chunks summed
  across the pair, all-gathered over TP (``runtime.optim.transports.TPPair``: the kernel). The
  planner places them on fixed partner indices (2s, 2s + 1) where that lowers its objective
  (``decision.tp_pair_decision``, ``candidates.tp_bundle_candidate``;
  ``TPOptions.share = "pairs"``: every one), the runtime's TP lockstep runs them;
* ``dp``: k = 2 or 4 DP indices — for a matrix TP does not split (tp = 1): its ZeRO-1 cut
  moves to a row boundary; a wide matrix's row blocks are blocks of its short dimension, so the
  ranks swap them for column blocks before the iteration and back after (two all-to-alls). The
  planner and the runtime do pairs (``decision.pair_decision``, ``runtime.pairs``); quads are
  in the bound only;
* ``tp_sub``: a sub-group of k < tp ranks of the TP group (k dividing tp), tp/k matrices of
  one DP index side by side, one per sub-group (:func:`tp_sub_piece`): each member gathers
  tp/k shards of its matrix (a row block) from the TP group, the k orthogonalise together, the
  updates go back to the shards' ranks (``runtime.optim.sub_groups``: the kernel). Per rank the
  compute grows as 1/k while the Gram's collectives stay about the same, so fewer ranks per
  matrix spend fewer collective seconds per FLOP. The gather and the return count as the
  piece's own busy time (``ShareOption.moved_s``): the runtime waits for them before and after
  the lockstep batch. Named in ``groups`` only where asked for: the rounds (``rounds``) and the
  pattern floor (``patterns``) ask.

The collectives sit on the critical path of every iteration (the next step needs the reduced
Gram): their modelled time (α–β on the group's link, ``HardwareProfile.link``) is part of a
piece's critical path, charged at the profile's achieved rate — less what runs beside the
piece's own Gram products, as the kernel reduces the Gram chunk by chunk while computing the
next chunk (:func:`gram_pipeline`, ``ShareOption.hidden_s``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..alike import Kept
from ..cost import Roofline
from ..formulas import gram_chunks, poly_packed_numel, row_stats_numel, shared_ns_flops
from ..hardware import HardwareProfile, LinkProfile
from ..planning import DPProblem


#: The groups a matrix may be shared over (see the module docstring).
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
    takes ``compute + comm_s − hidden_s`` (:meth:`alone_s`); ``memory_s``: with loads in
    seconds, the rank's share (1/k) of its task's memory-bound passes (``Roofline.memory_s``:
    momentum, Nesterov blend, cast, norm, update), part of its compute as the simulator times
    it; 0 under the FLOPs and element costs; ``moved_s``: a TP sub-group member's gather of its
    rows and return of the update rows (:func:`tp_sub_piece`), part of its compute: nothing
    hides them."""

    group: Group
    k: int
    split_poly: bool
    piece_flops: int
    comm_s: float
    hidden_s: float = 0.0
    memory_s: float = 0.0
    moved_s: float = 0.0

    def compute_s(self, rate: float) -> float:
        """Seconds the piece keeps its rank busy outside its Gram's collectives: its FLOPs at
        ``rate`` FLOP/s, its memory passes and (``moved_s``) the all-to-alls that move a TP
        sub-group's rows, which the runtime waits for before its lockstep and after it."""
        return self.piece_flops / rate + self.memory_s + self.moved_s

    def alone_s(self, rate: float) -> float:
        """Seconds of the piece alone at ``rate`` FLOP/s: its compute and what its own compute
        does not hide of its collectives."""
        return self.compute_s(rate) + self.comm_s - self.hidden_s


def profile_rate(hw: HardwareProfile) -> float:
    """The achieved FLOP/s the sharing decisions time compute at: the profile's bf16 peak (its
    largest without one) times its compute efficiency."""
    return hw.peak_flops.get("bf16", max(hw.peak_flops.values())) * hw.compute_efficiency


def _all_reduce_s(numel: int, e: int, k: int, link: LinkProfile) -> float:
    return link.seconds(2 * (k - 1) / k * numel * e)


def _all_gather_s(numel: int, e: int, k: int, link: LinkProfile) -> float:
    """All-gather of ``numel`` elements in all (each rank contributing numel / k)."""
    return link.seconds((k - 1) / k * numel * e)


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
    flops = shared_ns_flops(rows, n, k, steps=steps, split_polynomial=split)
    if split:  # each rank computes and all-gathers its packed upper parts of the symmetric P
        comm = steps * (reduce_s + _all_gather_s(k * poly_packed_numel(n, k), e, k, link))
    else:
        comm = steps * reduce_s
    if exchange:
        comm += 2 * link.seconds((k - 1) / k * (m * n / k) * e)
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
        return tp_link.seconds((tp - 1) / tp * numel * e)

    comm, hidden = gram_pipeline(rows, n, rate, lambda numel: (
        over_tp(numel), pair_link.seconds(numel / tp * e) + over_tp(numel)))
    flops = shared_ns_flops(rows, n, k, steps=steps, split_polynomial=split)
    if split:
        q = poly_packed_numel(n, k)
        comm += pair_link.seconds(q * e) + _all_gather_s(2 * tp * q, e, tp, tp_link)
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
    strided ranks span the TP group). The two all-to-alls are ``moved_s``: the runtime waits
    for a round's gather before its lockstep batch and for its return after, so nothing hides
    them. ``k = tp`` is the TP group's own piece (nothing gathered)."""
    if k < 1 or tp % k:
        raise ValueError(f"a TP sub-group's size divides tp ({tp}); got {k}")
    piece = shared_piece("tp_sub", k, split, m, n, steps, e, link, rate=rate)
    moved = (tp // k - 1) * -(-m // tp) * n * e  # shards one rank receives (and sends)
    return dataclasses.replace(piece, moved_s=2 * link.seconds(moved) if moved else 0.0)


def _row_stats_s(o: ShareOption, tp_dim: int | None, rows: int, cols: int, tp: int,
                 hw: HardwareProfile) -> float:
    """Seconds of the all-reduce of a shared NorMuon piece's row statistics (fp32,
    ``formulas.row_stats_numel``): the pieces of a DP group or of a column-parallel TP split
    hold whole rows of the rows × cols matrix, a row-parallel split's blocks of columns."""
    whole = o.group == "dp" or tp_dim == 0
    numel = row_stats_numel(rows, cols, whole_rows=whole)
    ranks = {"dp": o.k * tp, "tp_pair": 2 * tp}.get(o.group, tp)
    return _all_reduce_s(numel, 4, o.k, hw.link(ranks))


def share_options(problem: DPProblem, task: int, hw: HardwareProfile, *,
                  ns_bytes: int = 2, groups: tuple[Group, ...] = ("tp", "tp_pair", "dp"),
                  dp_sizes: tuple[int, ...] = DP_GROUP_SIZES) -> list[ShareOption]:
    """Every way ``task`` may be shared over the ``groups`` kinds (none for a non-Muon task or
    one that cannot be). DP groups (``dp_sizes`` DP indices) share a whole parameter cut in its
    buffer between two rows (a wide one's blocks exchanged for column blocks: its cost).

    Kept by what they read (a model's alike matrices have the same options); each caller gets
    its own list."""
    t = problem.tasks[task]
    if not problem.settings.spec.gram_shared or t.optimizer != "matrix" or len(t.shape) != 2:
        return []
    p = problem.spec[t.param]
    key = (t.shape, t.tp_split, t.part, p.is_expert, p.tp_dim, ns_bytes, tuple(groups),
           tuple(dp_sizes), None if problem.seconds_per_load is None else problem.costs[task])
    facts = (problem.settings, problem.sizes, hw)
    got = _OPTIONS.get(facts, key)
    if got is None:
        got = _OPTIONS.put(facts, key, _share_options(problem, task, hw, ns_bytes=ns_bytes,
                                                      groups=groups, dp_sizes=dp_sizes))
    return list(got)  # type: ignore[call-overload]


#: :func:`share_options` by the settings, sizes and hardware and the task's facts they read.
_OPTIONS = Kept(4096)


def _share_options(problem: DPProblem, task: int, hw: HardwareProfile, *, ns_bytes: int,
                   groups: tuple[Group, ...], dp_sizes: tuple[int, ...]) -> list[ShareOption]:
    t = problem.tasks[task]
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
    if problem.settings.spec.row_stats:  # NorMuon: the pieces sum their row statistics
        out = [dataclasses.replace(o, comm_s=o.comm_s + _row_stats_s(o, p.tp_dim, rows, cols,
                                                                     sizes.tp, hw))
               for o in out]
    if problem.seconds_per_load is not None:  # loads in seconds: the passes count, 1/k each
        memory = Roofline.of(hw, "bf16").memory_s(problem.costs[task])
        out = [dataclasses.replace(o, memory_s=memory / o.k) for o in out]
    return out
