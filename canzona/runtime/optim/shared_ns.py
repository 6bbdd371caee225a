"""Shared Newton–Schulz: one matrix's Muon orthogonalisation computed by k ranks, exactly — the
kernel and its lockstep over several matrices. The packed layouts of what it all-reduces and
gathers live in ``optim.gram_packing``; how the ranks reach each other (a process group, a
:class:`PeerPair`, a :class:`TPPair`) in ``optim.transports``; which way a matrix is oriented
and which rows a TP shard or a ZeRO-1 cut holds in ``optim.orientation``.

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
:func:`canzona.runtime.waits.wait_for` (``timeout_s`` → ``CollectiveTimeoutError`` naming
``what``), so on CUDA/NCCL the current stream is ordered after the communicator's stream and the
same code runs on CPU (gloo) and GPU. The process group is the k sharing ranks; groups are
created once by the caller (adjacent DP indices in pairs or quads, or a TP sub-group), never
per call. Two DP ranks may instead share through point-to-point messages (:class:`PeerPair`),
and a TP-split matrix may be shared by its TP group and the partner DP index's (:class:`TPPair`,
k = 2·tp: each rank a row block of its TP shard, the ZeRO-1 cut inside the shard) — more ranks
than the TP group, for a matrix whose TP piece alone outweighs a GPU's share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.planner.formulas import poly_packed_numel
from canzona.runtime.optim.gram_packing import (
    chunk_layout,
    gram_views,
    mirror_into,
    pack_gram,
    poly_views,
    unpack_gram,
)
from canzona.runtime.optim.muon import (
    DEFAULT_COEFFICIENTS,
    Coefficients,
    _coefficient_schedule,
    newton_schulz,
)
from canzona.runtime.optim.transports import (
    all_gather,
    all_reduce,
    gather_slot,
    group_rank,
    group_size,
)
from canzona.runtime.waits import Works, wait_for

__all__ = ["shared_newton_schulz", "shared_newton_schulz_many"]


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
    gram_at_one: bool = False,
) -> Tensor:
    """This rank's rows of the Newton–Schulz orthogonalisation of a matrix shared by ``group``.

    Args:
        block: This rank's row block ``[rows, n]`` (rows ≥ 0) of the matrix oriented along its
            long dimension (see ``optim.orientation``); not modified. Any view (e.g. ``shard.mT``).
        group: The k sharing ranks (``None``: the default group): a process group, a
            :class:`PeerPair` (two DP ranks) or a :class:`TPPair` (a TP group and its partner
            DP index, k = 2·tp). Without an initialised process group, or with k = 1, the
            single-device kernel runs on ``block``.
        coefficients: As ``MuonConfig.ns_coefficients``: a schedule's name, one (a, b, c) or a
            per-step tuple of triples; ``MuonConfig.schedule`` works too.
        steps: Newton–Schulz steps (``MuonConfig.ns_steps``).
        eps: Floor of the Frobenius norm (``MuonConfig.eps``).
        dtype: Iteration dtype (``MuonConfig.ns_dtype``); ``None`` keeps ``block.dtype``. The
            Gram is all-reduced (and P gathered) in this dtype.
        split_polynomial: Compute P = bG + cG² in row blocks and all-gather it (see module).
        timeout_s: Seconds a collective may take before ``CollectiveTimeoutError``
            (``None``: the group's own timeout).
        what: Names the matrix in timeout errors.
        gram_at_one: With k = 1, run the shared form anyway (the one rank all-reduces its own
            Gram over ``group``, which must be an initialised process group): how one device
            measures this kernel and runs its collectives (``benchmarks/gpu_check.py``).

    Returns:
        ``[rows, n]`` in ``dtype`` (contiguous): this rank's rows of the orthogonalised matrix,
        equal to ``newton_schulz(whole)`` restricted to these rows up to summation order.
    """
    schedule = _checked("shared_newton_schulz", [block], coefficients, steps, eps)
    k = group_size(group)
    if k == 1 and not gram_at_one:
        return newton_schulz(block, schedule, eps=eps, dtype=dtype)
    if group_rank(group) < 0:
        raise ValueError("shared_newton_schulz: this rank is not a member of `group`")
    # One implementation: the lockstep loop of shared_newton_schulz_many with one matrix.
    return shared_newton_schulz_many([block], group=group, coefficients=schedule, steps=steps,
                                     eps=eps, dtype=dtype, split_polynomial=split_polynomial,
                                     timeout_s=timeout_s, what=[what],
                                     gram_at_one=gram_at_one)[0]


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
    #: the Gram's chunks (r0, r1, q0, q1): rows and where in ``packed`` (:func:`chunk_layout`)
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
    gram_at_one: bool = False,
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
        coefficients, steps, eps, dtype, timeout_s, gram_at_one: As
            :func:`shared_newton_schulz`;
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
    ks = [group_size(g) for g in groups]
    alone = [k == 1 and not gram_at_one for k in ks]
    out: list[Tensor | None] = [None] * len(blocks)
    for j, direct in enumerate(alone):
        if direct:  # the single-device kernel (no collective)
            out[j] = newton_schulz(blocks[j], schedule, eps=eps, dtype=dtype)
    me = dist.get_rank() if not all(alone) else 0
    tasks = []
    for b, sp, w, grp, k, direct in zip(blocks, splits, names, groups, ks, alone):
        if direct:
            continue
        r = group_rank(grp)
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
        chunks = chunk_layout(n, grp)
        packed = torch.zeros(chunks[-1][3], dtype=dt, device=b.device)
        t = _Task(X, torch.empty_like(X), gram, packed, poly, send, gathered, sp,
                  w or "a shared Newton–Schulz", grp,
                  gram_views=gram_views(packed, n, chunks), chunks=chunks)
        if sp:
            t.send_views = poly_views(send, n, k, r)
            at = [gather_slot(grp, q) * size for q in range(k)]
            t.gathered_views = [v for q in range(k)
                                for v in poly_views(gathered[at[q]:at[q] + size], n, k, q)]
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
            pack_gram(t.gram, t.packed, [v for v in t.gram_views if r0 <= v[0] < r1])
            works.append(launch(all_reduce(t.packed[p0:p1], t.group),
                                f"the Gram all-reduce (step {step}, chunk {c + 1} of "
                                f"{len(t.chunks)}) of {t.label}")[0])
        t.work = (Works(works), f"the Gram all-reduce (step {step}) of {t.label}")

    def wait(t: _Task) -> None:
        work, name = t.work
        t.work = None
        wait_for(work, name, timeout_s, me)

    for step, (a, b, c) in enumerate(schedule):
        for t in tasks:
            launch_gram(t, step)
        for t in tasks:
            wait(t)
            unpack_gram(t.packed, t.gram, t.gram_views)
            if step == 0:
                _normalise_first(t, t.group, eps, timeout_s, me)
            if t.split:
                for r0, r1, v in t.send_views:
                    torch.addmm(t.gram[r0:r1, r0:], t.gram[r0:r1], t.gram[:, r0:], beta=b,
                                alpha=c, out=v)
                t.work = launch(all_gather(t.gathered, t.send, t.group),
                                f"the polynomial all-gather (step {step}) of {t.label}")
            else:
                torch.addmm(t.gram, t.gram, t.gram, beta=b, alpha=c, out=t.poly)
        for t in tasks:
            if t.split:
                wait(t)
                mirror_into(t.poly, t.gathered_views)
            torch.addmm(t.X, t.X, t.poly, beta=a, out=t.spare)
            t.X, t.spare = t.spare, t.X
    shared = iter(tasks)
    return [x if x is not None else next(shared).X for x in out]


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
    wait_for(all_reduce(sq, group),
             f"the norm all-reduce of {t.label}", timeout_s, me)
    t.X.div_(sq.sqrt().to(dt).clamp(min=eps))
    torch.mm(t.X.mT, t.X, out=t.gram)
    wait_for(all_reduce(t.gram, group),
             f"the Gram all-reduce (step 0) of {t.label}", timeout_s, me)


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


