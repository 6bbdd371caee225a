"""Shared Newton–Schulz: one matrix's Muon orthogonalisation computed by k ranks, exactly
(issue 18, item 1: the runtime kernel, standalone).

Whole-matrix ownership has a floor: no rank finishes before the largest single task. This kernel
lets k ranks share one matrix's Newton–Schulz without changing the update rule.

**The iteration in right-multiplied form.** Orient the matrix along its long dimension (transpose
a wide one): X is m × n with m ≥ n, split into row blocks Xᵢ (mᵢ × n, Σ mᵢ = m) over the k ranks of
``group``. Muon's quintic step ``A = YYᵀ; Y ← aY + (bA + cA²)Y`` on the wide Y = Xᵀ reads, on X,

    G = XᵀX = Σᵢ XᵢᵀXᵢ          (n × n: one all-reduce of the partial Grams)
    P = bG + cG²                 (n × n, identical on every rank)
    Xᵢ ← aXᵢ + XᵢP               (each rank its own rows, no communication)

so one n × n all-reduce per step is all the ranks exchange — of half of it, as G is symmetric:
its upper block rows ``G[r0:r1, r0:]`` (``formulas.gram_blocks``: up to 16 of them, about
n²/2·(1 + 1/16) elements) are packed, reduced and mirrored back (a diagonal block keeps both
triangles as reduced, so G is what the whole all-reduce gives). The first step's Gram also gives the
Frobenius norm, ‖X‖²_F = trace(G), so the normalisation ``X / max(‖X‖_F, eps)`` costs no extra
collective: X and G are rescaled after that all-reduce (G by 1/norm²). Nothing depends on the
order of the rows: (ΠX)ᵀ(ΠX) = XᵀX for any row permutation Π, so a rank's block may be any set
of rows of the oriented matrix — Megatron's fused gate/up shard ``[gate_r; up_r]`` included —
only the partition matters. The result equals :func:`canzona.runtime.optim.muon.newton_schulz`
on the whole matrix (same coefficient schedule, normalisation, ``eps`` and iteration dtype) up
to summation order: the partial Grams are summed across ranks, G is rescaled instead of
recomputed from the normalised X, and a square matrix may be iterated as XᵀX where the
single-device kernel uses XXᵀ (the same polynomial, aX + bX(XᵀX) + cX(XᵀX)² = aX + b(XXᵀ)X +
c(XXᵀ)²X). With k = 1 the single-device kernel itself runs: bitwise its result.

The norm is trace(G) summed in float64 from the reduced float32 Gram (2e-9 relative off on a
4096 × 1024 Gaussian matrix), whereas the single-device ``X.norm()`` is torch's float32
reduction over all m·n elements, which on the CPU is 8e-5 relative off on that matrix;
Newton–Schulz carries a normalisation error into its result at about the same relative size.
On large float32 matrices the shared result is therefore *closer* to a float64 Newton–Schulz
than the single-device one, and differs from it by that norm rounding
(``benchmarks/bench_shared_ns.py`` prints both distances); on the tests' sizes the two agree
within 1e-5.

**``split_polynomial``.** P costs 2n³ on every rank. With ``split_polynomial=True`` the ranks
share it, using its symmetry: P is cut in 2k block rows (``formulas.poly_blocks``), rank r takes
blocks r and 2k−1−r (a long upper part and a short one) and computes only their upper parts
``P[r0:r1, r0:] = bG[r0:r1, r0:] + cG[r0:r1, :]·G[:, r0:]``, about n²(2k+1)/(4k²) elements; one
``all_gather_into_tensor`` of the packed parts, zero-padded to equal size (the stock call: gloo
has no uneven all-gather, NCCL no AllGatherV), and P is unpacked and mirrored below its
diagonal blocks, identical on every rank again. Compute and bytes are about half of whole
row blocks of P (``formulas.poly_flops``, ``formulas.poly_packed_numel``).

**Cost per rank and call** (s = ``steps``, mᵢ = this rank's rows, e = bytes per element of the
iteration dtype, ring algorithms; ``formulas.shared_ns_flops``, ``formulas.shared_ns_bytes``):

==================  =======================  =======================================
                    FLOPs                    bytes sent
==================  =======================  =======================================
single device       s·(4n²m + 2n³)           —
shared              s·(4n²mᵢ + 2n³)          s·2(k−1)/k·g·e  (the all-reduce of G)
shared, split poly  s·(4n²mᵢ + 2n·q)          s·(2(k−1)/k·g + (k−1)·q)·e
==================  =======================  =======================================

(g = ``formulas.gram_packed_numel(n)`` ≈ 0.53·n², the packed upper part of G; q =
``formulas.poly_packed_numel(n, k)`` ≈ n²(2k+1)/(4k²), a rank's packed upper parts of P.)

With even blocks (mᵢ = m/k) that is 4n²m/k + 2n³ per step, and about 4n²m/k + n³/k with the
split (half of P's 2n³ over k ranks).
**The Gram in chunks.** The step's compute depends on the reduced Gram, so its all-reduce is
on the critical path; to run it beside the Gram's own products, G is computed and reduced in
``formulas.gram_chunks`` (up to ``GRAM_CHUNKS`` = 4 chunks of consecutive block rows): a chunk's
rows ``G[r0:r1, :] = X[:, r0:r1]ᵀX`` are computed (the same FLOPs as the whole product), their
upper parts packed, and the chunk's all-reduce launched before the next chunk's rows are
computed — a two-stage pipeline whose largest message goes first. Alone, a step's Gram phase
then takes max over chunks j of (compute of chunks ≤ j + all-reduces of chunks ≥ j), not their
sum (``planner.sharing.gram_pipeline``); the price is one collective latency per extra chunk
(three for a :class:`TPPair`: its reduce-scatter, the partner's sum, its all-gather).
A :class:`TPPair`'s chunks (padded to a multiple of tp) start with their reduce-scatter over
the TP group; the partner's sum and the all-gather of each follow when it is waited for. With
the split the polynomial's all-gather follows on the critical path.
Memory per rank: the block twice (iterate and
ping-pong buffer), two n × n matrices (G, P; one with the split, whose P is unpacked into G's
buffer), the packed Gram (g) and with the split the gathered parts ((k+1)·q:
``formulas.lockstep_bytes``).
The norm check (below) reads one scalar on the host per call (a device sync on CUDA).

**Guard.** The Gram of the *unnormalised* block can overflow or lose its small entries to
underflow, where the single-device kernel normalises first. When the reduced G is not finite,
or its trace is below ``finfo.tiny / finfo.eps²`` or beyond what ``X.norm()`` can hold, every
rank (they hold the same reduced G, so they decide alike) takes the slow path: ‖X‖²_F as
``X.norm()`` computes it on one device (squares summed in the iteration dtype, float32 for
bfloat16; one scalar all-reduce), X normalised, G recomputed and all-reduced again. It agrees
with the single-device kernel there too: where ‖X‖²_F overflows float32 that kernel's norm is
inf and its result zero, and where the squares are subnormal its norm carries their rounding.
Non-finite input gives non-finite output, as on one device.

**Contract.** Every rank of ``group`` calls with the same n, dtype, coefficients, steps, eps and
``split_polynomial`` (a mismatch fails in gloo or hangs in NCCL, as any collective does); any
number of rows ≥ 0 per rank. The collectives are asynchronous and waited for through
:func:`canzona.runtime.collectives.wait_for` (``timeout_s`` → ``CollectiveTimeoutError`` naming
``what``), so on CUDA/NCCL the current stream is ordered after the communicator's stream and the
same code runs on CPU (gloo) and GPU. The process group is the k sharing ranks; groups are
created once by the caller (adjacent DP indices in pairs or quads, or a TP sub-group), never
per call. Two DP ranks may instead share through point-to-point messages (:class:`PeerPair`),
and a TP-split matrix may be shared by its TP group and the partner DP index's (:class:`TPPair`,
k = 2·tp: each rank a row block of its TP shard, the ZeRO-1 cut inside the shard) — more ranks
than the TP group, for a matrix whose TP piece alone outweighs a GPU's share.

**Orientation and where row blocks come from** (:func:`orientation`, :func:`tp_row_blocks`,
:func:`dp_row_block`). A torch weight is ``[out, in]``. The sharing cut must run along the long
dimension (then G is the small n × n Gram); a cut along the short one would make G the large
Gram (m × m) and is refused.

* *Column-parallel* weights (Megatron ``partition_dim`` 0: QKV, fused gate/up ``linear_fc1``,
  vocabulary-parallel embeddings and heads) are tall: their TP shards are row blocks of the
  stored matrix, **no transpose** (gate/up's ``partition_stride`` 2 gives each shard two row
  ranges, which is fine: row order does not matter).
* *Row-parallel* weights (``partition_dim`` 1: ``linear_proj``/o_proj, ``linear_fc2``/down_proj)
  are split along ``in``, which is their long dimension (heads·head_dim ≥ hidden, ffn > hidden):
  the matrix is wide, its TP shards are column blocks, and **after the transpose** they are row
  blocks of the oriented matrix: pass ``shard.mT`` and transpose the result back. A square
  row-parallel weight (o_proj with heads·head_dim = hidden) is transposed too, so that its split
  dimension becomes the rows.
* *DP (ZeRO-1) cuts* are element ranges of the row-major flat buffer; moved to row boundaries of
  a **tall or square** weight they are row blocks, no transpose. A wide weight's contiguous cut
  is a block of its short dimension (its long-dimension blocks are strided column blocks), which
  this kernel cannot share: :func:`dp_row_block` refuses it, and such a matrix is shared over a
  TP sub-group (where its shards are long-dimension blocks) or exchanged first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.planner.formulas import gram_blocks, gram_chunks, poly_blocks, poly_packed_numel
from canzona.runtime.collectives import _Works, wait_for, wait_within
from canzona.runtime.optim.muon import (
    DEFAULT_COEFFICIENTS,
    Coefficients,
    _coefficient_schedule,
    newton_schulz,
)

__all__ = [
    "Orientation",
    "PeerPair",
    "TPPair",
    "pair_exchange",
    "dp_row_block",
    "orientation",
    "shared_newton_schulz",
    "shared_newton_schulz_many",
    "tp_row_blocks",
]

# torch ≥ 2.10 renamed the tensor collectives (the old names warn).
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def shared_newton_schulz(
    block: Tensor,
    *,
    group: Any = None,
    coefficients: Coefficients | Sequence[Coefficients] | str = DEFAULT_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
    split_polynomial: bool = False,
    timeout_s: float | None = None,
    what: str = "",
) -> Tensor:
    """This rank's rows of the Newton–Schulz orthogonalisation of a matrix shared by ``group``.

    Args:
        block: This rank's row block ``[rows, n]`` (rows ≥ 0) of the matrix oriented along its
            long dimension (see :func:`orientation`); not modified. Any view (e.g. ``shard.mT``).
        group: The k sharing ranks (``None``: the default group): a process group, a
            :class:`PeerPair` (two DP ranks) or a :class:`TPPair` (a TP group and its partner
            DP index, k = 2·tp). Without an initialised process group, or with k = 1, the
            single-device kernel runs on ``block``.
        coefficients: As ``MuonConfig.ns_coefficients``: one (a, b, c), a tuple of triples
            cycled step by step, or ``"quintic"``; ``MuonConfig.schedule`` works too.
        steps: Newton–Schulz steps (``MuonConfig.ns_steps``).
        eps: Floor of the Frobenius norm (``MuonConfig.eps``).
        dtype: Iteration dtype (``MuonConfig.ns_dtype``); ``None`` keeps ``block.dtype``. The
            Gram is all-reduced (and P gathered) in this dtype.
        split_polynomial: Compute P = bG + cG² in row blocks and all-gather it (see module).
        timeout_s: Seconds a collective may take before ``CollectiveTimeoutError``
            (``None``: the group's own timeout).
        what: Names the matrix in timeout errors.

    Returns:
        ``[rows, n]`` in ``dtype`` (contiguous): this rank's rows of the orthogonalised matrix,
        equal to ``newton_schulz(whole)`` restricted to these rows up to summation order.
    """
    schedule = _checked("shared_newton_schulz", [block], coefficients, steps, eps)
    k = _size(group)
    if k == 1:
        return newton_schulz(block, schedule, eps=eps, dtype=dtype)
    if _rank(group) < 0:
        raise ValueError("shared_newton_schulz: this rank is not a member of `group`")
    # One implementation: the lockstep loop of shared_newton_schulz_many with one matrix.
    return shared_newton_schulz_many([block], group=group, coefficients=schedule, steps=steps,
                                     eps=eps, dtype=dtype, split_polynomial=split_polynomial,
                                     timeout_s=timeout_s, what=[what])[0]


@dataclass(slots=True)
class _Task:
    """One matrix of :func:`shared_newton_schulz_many`: its iterate, buffers and label."""

    X: Tensor
    spare: Tensor
    gram: Tensor
    packed: Tensor  # the Gram's upper block rows, what is all-reduced
    poly: Tensor
    send: Tensor | None  # split: this rank's upper parts of P, packed
    gathered: Tensor | None  # split: every rank's, in rank order
    split: bool
    label: str
    group: Any = None  # the ranks sharing this matrix
    work: Any = None
    #: views of ``packed``, ``send`` and ``gathered`` per block row, made once per call
    gram_views: list = field(default_factory=list)
    #: the Gram's chunks (r0, r1, q0, q1): rows and where in ``packed`` (:func:`_chunk_layout`)
    chunks: list = field(default_factory=list)
    send_views: list = field(default_factory=list)
    gathered_views: list = field(default_factory=list)


def shared_newton_schulz_many(
    blocks: Sequence[Tensor],
    *,
    group: Any = None,
    coefficients: Coefficients | Sequence[Coefficients] | str = DEFAULT_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
    split_polynomial: bool | Sequence[bool] = False,
    timeout_s: float | None = None,
    what: Sequence[str] = (),
    flight: Any = None,
) -> list[Tensor]:
    """:func:`shared_newton_schulz` of several matrices shared by the same ``group``, in lockstep,
    so that each one's collectives run while the others compute.

    Per iteration every matrix's partial Gram is computed and all-reduced asynchronously, in order,
    chunk by chunk (each chunk's all-reduce launched once its rows are computed, beside the next
    chunk's products; see the module docstring); then, matrix by matrix, the reduced Gram is waited
    for and the polynomial formed (with ``split_polynomial`` its all-gather launched), and finally
    each matrix's rows are updated. The all-reduce of matrix j thus overlaps the Gram products of
    the matrices after it and the updates before it (on NCCL the collectives run on the
    communicator's stream beside the compute). Each matrix goes through the same operations in the
    same order as alone (:func:`shared_newton_schulz` is this loop with one matrix), so every result
    is bitwise the one it gets alone.

    Args:
        blocks: This rank's row block of each matrix (oriented along its long dimension).
        split_polynomial: One flag for all, or one per matrix.
        what: Names of the matrices for timeout errors (one per matrix, or none).
        flight: a ``runtime.flight.FlightRecorder`` told of every collective launched (so a
            hang on NCCL names the matrix and step), or None.
        group: As :func:`shared_newton_schulz`, one for all matrices, or a list with one per
            matrix (matrices shared by different ranks in one lockstep: a TP group's own and
            those it shares with a partner DP index, :class:`TPPair`). The ranks of each group
            pass its matrices in the same relative order.
        coefficients, steps, eps, dtype, timeout_s: As :func:`shared_newton_schulz`;
            every rank of ``group`` passes the same matrices (same n, in the same order).

    Returns:
        This rank's rows of each orthogonalised matrix, in ``dtype``, in the order given.
    """
    blocks = list(blocks)
    splits = ([bool(split_polynomial)] * len(blocks) if isinstance(split_polynomial, bool)
              else [bool(x) for x in split_polynomial])
    names = list(what) or [""] * len(blocks)
    if len(splits) != len(blocks) or len(names) != len(blocks):
        raise ValueError(f"shared_newton_schulz_many: {len(blocks)} blocks but "
                         f"{len(splits)} split flags and {len(names)} names")
    groups = list(group) if isinstance(group, (list, tuple)) else [group] * len(blocks)
    if len(groups) != len(blocks):
        raise ValueError(f"shared_newton_schulz_many: {len(blocks)} blocks but {len(groups)} "
                         f"groups")
    if not blocks:
        return []
    schedule = _checked("shared_newton_schulz_many", blocks, coefficients, steps, eps)
    ks = [_size(g) for g in groups]
    out: list[Tensor | None] = [None] * len(blocks)
    for j, k in enumerate(ks):
        if k == 1:  # the single-device kernel (no collective)
            out[j] = newton_schulz(blocks[j], schedule, eps=eps, dtype=dtype)
    me = dist.get_rank() if any(k > 1 for k in ks) else 0
    tasks = []
    for b, sp, w, grp, k in zip(blocks, splits, names, groups, ks):
        if k == 1:
            continue
        r = _rank(grp)
        if r < 0:
            raise ValueError("shared_newton_schulz_many: this rank is not a member of `group`")
        rows, n = b.shape
        dt = b.dtype if dtype is None else dtype
        X = torch.empty((rows, n), dtype=dt, device=b.device)
        X.copy_(b)
        gram = torch.empty((n, n), dtype=dt, device=b.device)
        send = gathered = None
        if sp:
            size = poly_packed_numel(n, k)
            send = torch.zeros(size, dtype=dt, device=b.device)  # the tail stays zero padding
            gathered = torch.empty(k * size, dtype=dt, device=b.device)
        # with the split, P is unpacked into G's buffer (G is not needed once this rank's
        # parts of P are formed)
        poly = gram if sp else torch.empty((n, n), dtype=dt, device=b.device)
        # the packed Gram chunk by chunk (a TPPair's chunks padded to a multiple of tp for its
        # reduce-scatter: the padding, zeros, is summed and never read)
        chunks = _chunk_layout(n, grp)
        packed = torch.zeros(chunks[-1][3], dtype=dt, device=b.device)
        t = _Task(X, torch.empty_like(X), gram, packed, poly, send, gathered, sp,
                  w or "a shared Newton–Schulz", grp,
                  gram_views=_gram_views(packed, n, chunks), chunks=chunks)
        if sp:
            t.send_views = _poly_views(send, n, k, r)
            at = [_gather_slot(grp, q) * size for q in range(k)]
            t.gathered_views = [v for q in range(k)
                                for v in _poly_views(gathered[at[q]:at[q] + size], n, k, q)]
        tasks.append(t)

    def launch(work: Any, name: str) -> tuple[Any, str]:
        if flight is not None:
            flight.add(name, work)
        return work, name

    def launch_gram(t: _Task, step: int) -> None:
        # chunk by chunk (formulas.gram_chunks): a chunk's rows of G, their upper parts packed,
        # and its all-reduce launched while the next chunk's rows are computed (a TPPair's: its
        # reduce-scatter over TP; the partner's sum and the all-gather when waited for)
        works = []
        for c, (r0, r1, p0, p1) in enumerate(t.chunks):
            torch.mm(t.X[:, r0:r1].mT, t.X, out=t.gram[r0:r1])
            _pack_gram(t.gram, t.packed, [v for v in t.gram_views if r0 <= v[0] < r1])
            works.append(launch(_all_reduce(t.packed[p0:p1], t.group),
                                f"the Gram all-reduce (step {step}, chunk {c + 1} of "
                                f"{len(t.chunks)}) of {t.label}")[0])
        t.work = (_Works(works), f"the Gram all-reduce (step {step}) of {t.label}")

    def wait(t: _Task) -> None:
        work, name = t.work
        t.work = None
        wait_for(work, name, timeout_s, me)

    for step, (a, b, c) in enumerate(schedule):
        for t in tasks:
            launch_gram(t, step)
        for t in tasks:
            wait(t)
            _unpack_gram(t.packed, t.gram, t.gram_views)
            if step == 0:
                _normalise_first(t, t.group, eps, timeout_s, me)
            if t.split:
                for r0, r1, v in t.send_views:
                    torch.addmm(t.gram[r0:r1, r0:], t.gram[r0:r1], t.gram[:, r0:], beta=b,
                                alpha=c, out=v)
                t.work = launch(_gather(t.gathered, t.send, t.group),
                                f"the polynomial all-gather (step {step}) of {t.label}")
            else:
                torch.addmm(t.gram, t.gram, t.gram, beta=b, alpha=c, out=t.poly)
        for t in tasks:
            if t.split:
                wait(t)
                _mirror_into(t.poly, t.gathered_views)
            torch.addmm(t.X, t.X, t.poly, beta=a, out=t.spare)
            t.X, t.spare = t.spare, t.X
    shared = iter(tasks)
    return [x if x is not None else next(shared).X for x in out]


def _chunk_layout(n: int, group: Any = None) -> list[tuple[int, int, int, int]]:
    """The Gram's chunks ``(r0, r1, q0, q1)``: rows ``[r0, r1)`` (``formulas.gram_chunks``) and
    their packed upper parts at ``[q0, q1)`` of the packed buffer — back to back, except for a
    :class:`TPPair`, whose chunks are each padded to a multiple of the TP size (its sum
    reduce-scatters a chunk over the TP group in equal parts)."""
    tp = dist.get_world_size(group.tp) if isinstance(group, TPPair) else 1
    out, at = [], 0
    for r0, r1, p0, p1 in gram_chunks(n):
        size = -(-(p1 - p0) // tp) * tp
        out.append((r0, r1, at, at + size))
        at += size
    return out


def _gram_views(packed: Tensor, n: int, chunks: list | None = None
                ) -> list[tuple[int, int, Tensor]]:
    """(r0, r1, view) of each block row's upper part ``G[r0:r1, r0:]`` in ``packed``: block rows
    in order, each chunk's from its start (``chunks``: :func:`_chunk_layout`; None: back to
    back)."""
    starts = {r0: q0 for r0, _, q0, _ in chunks or ()}
    out, at = [], 0
    for r0, r1 in gram_blocks(n):
        at = starts.get(r0, at)
        size = (r1 - r0) * (n - r0)
        out.append((r0, r1, packed[at:at + size].view(r1 - r0, n - r0)))
        at += size
    return out


def _pack_gram(gram: Tensor, packed: Tensor, views: list | None = None) -> None:
    """The upper block rows of a symmetric ``gram`` into ``packed`` (``formulas.gram_blocks``;
    ``views``: :func:`_gram_views` of ``packed``, made once, or those of one chunk): the
    all-reduce carries about half the Gram."""
    for r0, r1, v in views if views is not None else _gram_views(packed, gram.shape[0]):
        v.copy_(gram[r0:r1, r0:])


def _unpack_gram(packed: Tensor, gram: Tensor, views: list | None = None) -> None:
    """The reduced ``packed`` back into ``gram``: each block row's upper part, and its mirror
    below the diagonal block (a diagonal block keeps both of its triangles as reduced)."""
    _mirror_into(gram, views if views is not None else _gram_views(packed, gram.shape[0]))


def _mirror_into(out: Tensor, views: list) -> None:
    """Each block row's upper part ``(r0, r1, view)`` into ``out[r0:r1, r0:]`` and its mirror
    below the diagonal block."""
    for r0, r1, v in views:
        out[r0:r1, r0:].copy_(v)
        out[r1:, r0:r1].copy_(v[:, r1 - r0:].mT)


def _poly_views(send: Tensor, n: int, k: int, rank: int) -> list[tuple[int, int, Tensor]]:
    """(r0, r1, view) of each of ``rank``'s block rows' upper parts ``P[r0:r1, r0:]`` of the split
    polynomial in its packed ``send`` (``formulas.poly_blocks``; the rest is padding)."""
    out, at = [], 0
    for r0, r1 in poly_blocks(n, k)[rank]:
        size = (r1 - r0) * (n - r0)
        out.append((r0, r1, send[at:at + size].view(r1 - r0, n - r0)))
        at += size
    return out


def _unpack_poly(gathered: Tensor, poly: Tensor, k: int) -> None:
    """Every rank's packed upper parts of P (gathered in rank order) into ``poly``, mirrored
    below the diagonal blocks (each diagonal block is whole, computed by one rank)."""
    n = poly.shape[0]
    size = gathered.numel() // k
    _mirror_into(poly, [v for rank in range(k)
                        for v in _poly_views(gathered[rank * size:(rank + 1) * size], n, k, rank)])


def _normalise_first(t: _Task, group: Any, eps: float, timeout_s: float | None, me: int) -> None:
    """Step 0 of :func:`shared_newton_schulz_many` for one matrix, once its (unnormalised) Gram
    is reduced: the norm from its trace, or the guarded slow path (see the module docstring),
    exactly as :func:`shared_newton_schulz` does it."""
    dt = t.X.dtype
    sq = t.gram.diagonal().sum(dtype=torch.float64)
    finfo = torch.finfo(dt)
    acc = torch.float32 if finfo.bits < 32 else dt
    ok = (torch.isfinite(t.gram).all() & (sq >= finfo.tiny / finfo.eps ** 2)
          & (sq <= torch.finfo(acc).max))
    if bool(ok):
        norm = sq.sqrt().to(dt).clamp(min=eps)
        t.X.div_(norm)
        t.gram.div_(norm).div_(norm)
        return
    sq = t.X.to(acc).square().sum().reshape(1)
    wait_for(_all_reduce(sq, group),
             f"the norm all-reduce of {t.label}", timeout_s, me)
    t.X.div_(sq.sqrt().to(dt).clamp(min=eps))
    torch.mm(t.X.mT, t.X, out=t.gram)
    wait_for(_all_reduce(t.gram, group),
             f"the Gram all-reduce (step 0) of {t.label}", timeout_s, me)


@dataclass(frozen=True, slots=True)
class PeerPair:
    """Two ranks of ``group`` sharing matrices through point-to-point messages instead of a
    communicator of their own (DP pairs, ``runtime.pairs``): the all-reduce of a Gram is an
    exchange and a sum, lower rank's block first on both sides (the same bits on both); the
    all-gather of the split polynomial an exchange of blocks. ``ranks``: the two ranks in
    ``group`` (None: the default group), ascending; ``me``: 0 or 1, which of them this is."""

    ranks: tuple[int, int]
    me: int
    group: Any = None

    @property
    def peer(self) -> int:
        return self.ranks[1 - self.me]


@dataclass(frozen=True, slots=True)
class TPPair:
    """k = 2·tp ranks sharing a TP-split matrix: this rank's TP group (``tp``, a process group
    of the tp ranks at one DP index) and the same TP rank at the partner DP index (``pair``, a
    :class:`PeerPair` on the DP group). Each rank holds a row block of its TP shard (the shard's
    ZeRO-1 range cut at a row boundary between the two DP indices). A sum over the k ranks is
    hierarchical: a reduce-scatter over the TP group, each TP rank's 1/tp chunk exchanged with
    the partner and summed, an all-gather over the TP group — only 1/tp of the Gram crosses
    between the DP indices, on every TP rank's own link, and every rank ends with the same bits
    (the pair's sum commutes). An all-gather (the split polynomial) swaps this rank's block
    with the partner, then gathers both over the TP group. Rank order: DP index (``pair.me``)
    first, then TP rank.

    No communicator beyond the TP groups the trainer has and the DP group: the partner is
    reached point to point. Each stage starts once the one before it is waited for (the
    lockstep waits matrix by matrix, so a matrix's later stages overlap the other matrices'
    collectives and compute, not its own). Both DP indices must run the same matrices in the
    same order."""

    tp: Any
    pair: PeerPair


class _Then:
    """An async handle ``first`` whose follow-up ``then()`` (another handle) is launched once
    ``first`` is done, and waited for with it: the two stages of a :class:`TPPair` sum."""

    def __init__(self, first: Any, then: Any) -> None:
        self.first, self.then, self.second = first, then, None

    def wait(self, timeout: Any = None) -> bool:
        """Both stages within one ``timeout`` (a timedelta; the second gets what the first
        left)."""
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if self.second is None:
            wait_within([self.first], timeout)
            self.second = self.then()
        left = None if end is None else timedelta(seconds=max(end - time.monotonic(), 1e-3))
        wait_within([self.second], left)
        return True

    def is_completed(self) -> bool:
        return self.second is not None and self.second.is_completed()


class _Exchange:
    """The two messages of a pair exchange as one async handle; ``finish`` runs once both are
    done (the sum, or nothing for a gather)."""

    def __init__(self, works: list[Any], finish: Any = None) -> None:
        self.works, self.finish = works, finish

    def wait(self, timeout: Any = None) -> bool:
        wait_within(self.works, timeout)
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _size(group: Any) -> int:
    if isinstance(group, PeerPair):
        return 2
    if isinstance(group, TPPair):
        return 2 * dist.get_world_size(group.tp)
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _rank(group: Any) -> int:
    if isinstance(group, PeerPair):
        return group.me
    if isinstance(group, TPPair):
        r = dist.get_rank(group.tp)
        return -1 if r < 0 else group.pair.me * dist.get_world_size(group.tp) + r
    return dist.get_rank(group)


def pair_exchange(messages: Sequence[tuple[Tensor, Tensor]], pair: PeerPair) -> list[Any]:
    """Send each message's first tensor to the partner and receive its second from it, in
    order, as one batch (on NCCL the sends and receives must be posted together, or both ranks
    would wait in their sends). Returns the async handles."""
    ops = []
    for send, recv in messages:
        ops.append(dist.P2POp(dist.isend, send, group=pair.group, group_peer=pair.peer))
        ops.append(dist.P2POp(dist.irecv, recv, group=pair.group, group_peer=pair.peer))
    return dist.batch_isend_irecv(ops)


def _gather_slot(group: Any, rank: int) -> int:
    """Where rank ``rank``'s block lies in what :func:`_gather` gathers, in blocks: rank order,
    except for a :class:`TPPair` (rank = DP index · tp + TP rank), whose gather holds per TP
    rank both DP indices' blocks."""
    if not isinstance(group, TPPair):
        return rank
    tp = dist.get_world_size(group.tp)
    d, t = divmod(rank, tp)
    return 2 * t + d


def _reduce_scatter(out: Tensor, t: Tensor, group: Any) -> Any:
    return _reduce_scatter_tensor(out, t, group=group, async_op=True)


def _all_reduce(t: Tensor, group: Any) -> Any:
    """An async sum of ``t`` over ``group`` (a process group, or a :class:`PeerPair`)."""
    if isinstance(group, TPPair):
        # hierarchical: reduce-scatter over the TP group, each TP rank sums its 1/tp chunk with
        # the partner's (1/tp of the bytes cross to the other DP index), all-gather over TP
        tp = dist.get_world_size(group.tp)
        if t.dim() != 1 or t.numel() % tp:  # the guard's scalar and whole Gram: two stages
            return _Then(dist.all_reduce(t, group=group.tp, async_op=True),
                         lambda: _all_reduce(t, group.pair))
        chunk = torch.empty(t.numel() // tp, dtype=t.dtype, device=t.device)
        return _Then(_reduce_scatter(chunk, t, group.tp),
                     lambda: _Then(_all_reduce(chunk, group.pair),
                                   lambda: _all_gather(t, chunk, group=group.tp, async_op=True)))
    if not isinstance(group, PeerPair):
        return dist.all_reduce(t, group=group, async_op=True)
    other = torch.empty_like(t)
    # t is the message (untouched until the exchange is waited for), then receives the sum:
    # the same on both sides, as IEEE addition commutes
    return _Exchange(pair_exchange([(t, other)], group), lambda: t.add_(other))


def _gather(out: Tensor, block: Tensor, group: Any) -> Any:
    """An async all-gather of equal ``block``s into ``out`` (rank order)."""
    if isinstance(group, TPPair):
        # the block swapped with the partner (one block crosses to the other DP index), then
        # both DP indices' blocks gathered over the TP group: ``out`` holds, per TP rank, DP
        # index 0's block then 1's (:func:`_gather_slot`)
        size = block.shape[0]
        two = torch.empty(2 * size, dtype=block.dtype, device=block.device)
        me = group.pair.me
        two[me * size:(me + 1) * size].copy_(block)
        theirs = two[(1 - me) * size:(2 - me) * size]
        return _Then(_Exchange(pair_exchange([(block, theirs)], group.pair)),
                     lambda: _all_gather(out, two, group=group.tp, async_op=True))
    if not isinstance(group, PeerPair):
        return _all_gather(out, block, group=group, async_op=True)
    size = block.shape[0]
    mine, theirs = (out[:size], out[size:]) if group.me == 0 else (out[size:], out[:size])
    mine.copy_(block)
    return _Exchange(pair_exchange([(block, theirs)], group))


def _checked(who: str, blocks: Sequence[Tensor], coefficients: Any, steps: object,
             eps: object) -> tuple[Coefficients, ...]:
    """The coefficient schedule, after the arguments every rank must get right alike."""
    for b in blocks:
        if b.ndim != 2:
            raise ValueError(f"{who} expects a row block [rows, n], got {tuple(b.shape)}")
    schedule = _coefficient_schedule(coefficients, _check_steps(steps))
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"{who}: eps = {eps!r} must be a finite number > 0")
    return schedule


def _check_steps(steps: object) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 99:
        raise ValueError(f"shared_newton_schulz: steps = {steps!r} must be an integer in [1, 99]")
    return steps


# -- orientation -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Orientation:
    """How a stored matrix ``shape`` (rows × cols, a torch weight's ``[out, in]``) is iterated:
    ``transpose`` or not, so that the oriented matrix is m × n with its rows along the dimension
    the sharing ranks split (the long one, or either for a square matrix)."""

    shape: tuple[int, int]
    transpose: bool

    @property
    def row_dim(self) -> int:
        """The stored dimension that becomes the oriented rows (1 when transposed)."""
        return 1 if self.transpose else 0

    @property
    def oriented_shape(self) -> tuple[int, int]:
        """(m, n) of the oriented matrix."""
        rows, cols = self.shape
        return (cols, rows) if self.transpose else (rows, cols)

    def orient(self, t: Tensor) -> Tensor:
        """A stored matrix or a block of it along ``row_dim`` → oriented (a view)."""
        return t.mT if self.transpose else t

    def restore(self, t: Tensor) -> Tensor:
        """An oriented result (block) → the stored layout (a view)."""
        return t.mT if self.transpose else t


def orientation(shape: Sequence[int], split_dim: int | None = None) -> Orientation:
    """The orientation of a stored matrix ``shape`` for a shared Newton–Schulz.

    Without ``split_dim``: wide matrices (rows < cols) are transposed. With ``split_dim`` (the
    stored dimension the sharing ranks split: Megatron's ``partition_dim``, 0 for a DP row cut)
    the split dimension becomes the rows: transpose iff ``split_dim`` is 1. Raises ``ValueError``
    if the split dimension is the short one (the shared Gram would be the large one)."""
    if len(shape) != 2 or any(int(s) < 1 for s in shape):
        raise ValueError(f"orientation: {tuple(shape)} is not a matrix shape")
    rows, cols = int(shape[0]), int(shape[1])
    if split_dim is None:
        return Orientation((rows, cols), rows < cols)
    if split_dim not in (0, 1):
        raise ValueError(f"orientation: split_dim = {split_dim!r} must be 0 or 1")
    split, other = (rows, cols) if split_dim == 0 else (cols, rows)
    if split < other:
        raise ValueError(
            f"orientation: a {rows}×{cols} matrix split along dim {split_dim} ({split}) is split "
            f"along its short dimension; a shared Newton–Schulz needs row blocks of the long "
            f"one ({other}), else its Gram is {other}×{other} instead of {split}×{split}")
    return Orientation((rows, cols), split_dim == 1)


def tp_row_blocks(shape: Sequence[int], split_dim: int, tp: int, *,
                  stride: int = 1) -> tuple[Orientation, list[list[tuple[int, int]]]]:
    """The orientation of a TP-split weight (canonical ``shape``) and, per TP rank, the rows
    ``[start, stop)`` of the oriented canonical matrix its shard holds, in shard order.

    Megatron's rule (``canzona.runtime.logical.megatron_axis``): the split dimension is cut in
    ``stride``·tp equal sub-blocks, sub-block s of rank r is canonical block s·tp + r (fused
    gate/up: ``stride`` 2, rank r holds ``[gate_r; up_r]``, two row ranges). ``orient(shard)``
    is then exactly those rows, in that order — the block to pass to the kernel."""
    o = orientation(shape, split_dim)
    length = o.oriented_shape[0]
    if tp < 1 or stride < 1 or length % (tp * stride):
        raise ValueError(f"tp_row_blocks: {length} rows do not split in {tp}×{stride} sub-blocks")
    b = length // (tp * stride)
    return o, [[((s * tp + r) * b, (s * tp + r + 1) * b) for s in range(stride)]
               for r in range(tp)]


def dp_row_block(shape: Sequence[int], start: int, stop: int) -> tuple[int, int]:
    """The oriented rows ``[start, stop)`` that a ZeRO-1 element range ``[start, stop)`` of a
    matrix (offsets in its row-major flat storage) holds: the range must begin and end on row
    boundaries, and the matrix must be tall or square (no transpose; a wide matrix's contiguous
    range is a block of its short dimension: ``ValueError``)."""
    o = orientation(shape, 0)  # raises for a wide matrix
    rows, cols = o.shape
    if not 0 <= start <= stop <= rows * cols or start % cols or stop % cols:
        raise ValueError(f"dp_row_block: elements [{start}, {stop}) of a {rows}×{cols} matrix "
                         f"are not whole rows (multiples of {cols} within {rows * cols})")
    return start // cols, stop // cols
