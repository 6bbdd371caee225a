"""Per-task FLOPs and optimizer-state sizes of the runtime's optimizer kernels (torch-free).

These are exact integer counts of what ``canzona.runtime.optim`` executes for one logical matrix
(or one AdamW tensor) in one optimizer step. This is a public module of the planner: its cost
model (``canzona.planner.cost``) and the runtime's kernels and DP step (``canzona.runtime``) both
import it, so it must import nothing (of ours or torch) beyond the standard library.
``tests/runtime/optim`` checks every formula against the matmuls the kernels perform
(``torch.utils.flop_counter.FlopCounterMode``) and against the state they allocate.

Conventions:

* Matrix optimizers count **matmul FLOPs only** (2·m·n·k for an m×k by k×n product); their
  elementwise work is O(m·n) and is ignored, as in §4.
* Decompositions that FLOP counters do not see are charged with §4's approximations:
  a k×k symmetric eigendecomposition (``eigh``) ≈ 9k³, a k×k QR ≈ 8/3·k³ (Householder R plus
  forming Q; with the 2k³ power-iteration matmul this is §4's ≈ 4.7k³ per side for SOAP).
* ``amortised=True`` spreads the work done every ``precondition_frequency`` steps evenly over
  the steps (integer floor); ``amortised=False`` gives the matmuls of an ordinary step, one
  that neither recomputes roots (Shampoo) nor updates the eigenbasis (SOAP).
* State sizes are element counts of every tensor the kernel keeps per task, including the
  one-element ``step`` counter that Shampoo, SOAP and AdamW store (as ``torch.optim`` does).
* Memory traffic (``*_traffic_bytes``, ``muon_matmul_bytes``) is what the roofline cost model
  (``canzona.planner.cost.Roofline``) charges at the memory bandwidth: the bytes the
  element-wise passes of one step read and write (fp32 gradient, state and main weight, a bf16
  iterate), per element of the matrix. They are estimates by pass, listed in the ``*_PASSES``
  tables, not counts of a profiler.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = [
    "ADAMW_BYTES_PER_ELEMENT",
    "ADAMW_FLOPS_PER_ELEMENT",
    "MUON_PASSES",
    "SHAMPOO_PASSES",
    "SOAP_PASSES",
    "GRAM_BLOCKS",
    "GRAM_CHUNKS",
    "LOCKSTEP_CMAX",
    "SHAMPOO_DEFAULT_PRECONDITION_FREQUENCY",
    "adamw_flops",
    "adamw_state_numel",
    "adamw_traffic_bytes",
    "block_sizes",
    "gram_blocks",
    "gram_chunks",
    "gram_packed_numel",
    "lockstep_batches",
    "lockstep_bytes",
    "muon_flops",
    "muon_matmul_bytes",
    "muon_state_numel",
    "muon_traffic_bytes",
    "NORMUON_PASSES",
    "normuon_state_numel",
    "normuon_traffic_bytes",
    "row_stats_numel",
    "sub_round_bytes",
    "sub_round_rows",
    "poly_blocks",
    "poly_flops",
    "poly_packed_numel",
    "shared_ns_bytes",
    "shared_ns_flops",
    "shampoo_flops",
    "shampoo_state_numel",
    "shampoo_traffic_bytes",
    "soap_flops",
    "soap_state_numel",
    "soap_traffic_bytes",
]

#: Elementwise FLOPs per element of one AdamW step as the kernel runs it (torch.optim.AdamW's
#: single-tensor path): decay 1, first-moment lerp 3, second moment mul + addcmul 4,
#: sqrt / bias-correction / +eps 3, addcdiv 3. The
#: kernels' non-finite guard (``isfinite``: about 3 comparisons per element) is not counted.
ADAMW_FLOPS_PER_ELEMENT = 14

#: AdamW's memory traffic per element: fp32 main weight read and written (8), fp32 gradient
#: read (4), two fp32 moments read and written (16), the bf16 parameter written (2).
ADAMW_BYTES_PER_ELEMENT = 30

#: The element-wise passes of one Muon step, (what it does, bytes per element of the matrix):
#: fp32 gradient and momentum, the iterate in bf16, fp32 main weights.
MUON_PASSES: tuple[tuple[str, int], ...] = (
    ("momentum: gradient and momentum read, momentum written", 12),
    ("Nesterov blend: gradient and momentum read, blend written", 12),
    ("cast to the iteration dtype: fp32 read, bf16 written", 6),
    ("Frobenius norm and scaling: bf16 read, read and written", 6),
    ("update applied: weight decay and step on the fp32 weight, the update read", 18),
)
#: NorMuon's element-wise passes: Muon's, then the row normalisation of the fp32 update.
NORMUON_PASSES: tuple[tuple[str, int], ...] = MUON_PASSES + (
    ("cast of the update to fp32: bf16 read, fp32 written", 6),
    ("row statistics: the update read (squares summed per row)", 4),
    ("row normalisation: the update read and written", 8),
    ("norm-preserving rescale: the update read, read and written", 12),
)
#: Shampoo's element-wise passes (its statistics and roots are matmuls, in the FLOPs).
SHAMPOO_PASSES: tuple[tuple[str, int], ...] = (
    ("filtered gradient: gradient read, first moment read and written", 12),
    ("grafting: Adam's second moment read and written, its direction written", 12),
    ("grafting norm and scaling: both directions read, the scaled one written", 12),
    ("update applied: weight decay and step on the fp32 weight, the update read", 18),
)
#: SOAP's element-wise passes (the projections into and out of the eigenbasis are matmuls).
SOAP_PASSES: tuple[tuple[str, int], ...] = (
    ("projected gradient: written, then read by the moments", 8),
    ("Adam in the eigenbasis: two moments read and written, the direction written", 20),
    ("projected-back update: written, then read", 8),
    ("update applied: weight decay and step on the fp32 weight, the update read", 18),
)

#: Shampoo's default ``precondition_frequency`` in ``canzona.runtime.optim.ShampooConfig``.
SHAMPOO_DEFAULT_PRECONDITION_FREQUENCY = 10

# Approximate FLOPs of k×k decompositions, in units of k³: eigh ≈ 9k³;
# QR with explicit Q ≈ (4/3 + 4/3)k³ = 8/3·k³, kept as a fraction to stay in integers.
_EIGH_K3 = 9
_QR_K3_NUM, _QR_K3_DEN = 8, 3


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def block_sizes(dim: int, max_block: int) -> list[int]:
    """Sizes of the chunks a dimension is cut into: ``max_block`` each, the remainder last.

    This is how Shampoo blocks the logical matrix (``torch.split(dim_size, max_block)``).
    """
    _check_positive("dim", dim)
    _check_positive("max_block", max_block)
    full, rest = divmod(dim, max_block)
    return [max_block] * full + ([rest] if rest else [])


@lru_cache(maxsize=1 << 12)
def fsdp2_rows(rows: int, ranks: int) -> tuple[tuple[int, int], ...]:
    """Per DP rank, (first row, rows) of a parameter's ``Shard(0)`` under FSDP2's
    ``fully_shard``: ``torch.chunk``'s rule, ``ceil(rows / ranks)`` rows each from the top, so
    the last ranks may hold fewer rows or none (FSDP2 pads them in its own buffer). Computed
    once per size."""
    _check_positive("ranks", ranks)
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    each = -(-rows // ranks)
    return tuple((min(r * each, rows), max(0, min(each, rows - r * each))) for r in range(ranks))


def fsdp2_block(shape: tuple[int, ...], split_dim: int | None, dp: int, tp: int, d: int,
                t: int) -> tuple[int, int, int, int]:
    """(first row, end row, first column, end column) of the block of a 2-D view of a
    parameter (a vector: one column) that rank (d, t) of a dp × tp mesh holds under FSDP2 with
    tensor parallelism (torchtitan's ``parallelize_module``, then ``fully_shard`` over the dp
    dimension): TP's ``Shard(split_dim)`` takes chunk t of that dimension (None: replicated,
    every t the whole), then FSDP takes chunk d of the TP-local rows, both ``torch.chunk``'s
    rule (:func:`fsdp2_rows`). Always one rectangle; the last ranks' may be empty."""
    rows = shape[0] if shape else 1
    cols = 1
    for x in shape[1:]:
        cols *= x
    r0, r1, c0, c1 = 0, rows, 0, cols
    if split_dim == 0:
        start, n = fsdp2_rows(rows, tp)[t]
        r0, r1 = start, start + n
    elif split_dim == 1:
        start, n = fsdp2_rows(cols, tp)[t]
        c0, c1 = start, start + n
    start, n = fsdp2_rows(r1 - r0, dp)[d]
    return r0 + start, r0 + start + n, c0, c1


@lru_cache(maxsize=1 << 12)
def fsdp2_blocks(shape: tuple[int, ...], split_dim: int | None, dp: int, tp: int
                 ) -> tuple[tuple[int, int, int, int], ...]:
    """:func:`fsdp2_block` of every rank d·tp + t, in rank order (computed once per size)."""
    return tuple(fsdp2_block(shape, split_dim, dp, tp, d, t)
                 for d in range(dp) for t in range(tp))


def muon_flops(m: int, n: int, *, ns_steps: int = 5) -> int:
    """Matmul FLOPs of Muon's Newton–Schulz orthogonalisation of an m×n matrix.

    With a = min(m, n), b = max(m, n) (tall matrices are transposed first), each of the
    ``ns_steps`` iterations computes A = X Xᵀ (2a²b), B = bA + cA·A (2a³) and X = aX + B X (2a²b):
    ``ns_steps · (4a²b + 2a³)``.
    Momentum and the norm are elementwise and not counted.
    """
    _check_positive("m", m)
    _check_positive("n", n)
    _check_positive("ns_steps", ns_steps)
    a, b = min(m, n), max(m, n)
    return ns_steps * (4 * a * a * b + 2 * a * a * a)


def muon_matmul_bytes(m: int, n: int, *, ns_steps: int = 5, elem_bytes: int = 2) -> int:
    """Bytes the Newton–Schulz products of an m×n matrix read and write (a = min, b = max): per
    iteration A = X Xᵀ reads X and writes A (ab + a²), B = bA + cA·A reads A three times and
    writes B (4a²), X' = aX + B X reads B and X twice and writes X' (a² + 3ab)."""
    _check_positive("m", m)
    _check_positive("n", n)
    a, b = min(m, n), max(m, n)
    return ns_steps * elem_bytes * (4 * a * b + 6 * a * a)


def _traffic(passes: tuple[tuple[str, int], ...], m: int, n: int) -> int:
    _check_positive("m", m)
    _check_positive("n", n)
    return sum(b for _, b in passes) * m * n


def muon_traffic_bytes(m: int, n: int) -> int:
    """Bytes Muon's element-wise passes of an m×n matrix move (:data:`MUON_PASSES`)."""
    return _traffic(MUON_PASSES, m, n)


def normuon_traffic_bytes(m: int, n: int) -> int:
    """Bytes NorMuon's element-wise passes of an m×n matrix move (:data:`NORMUON_PASSES`)."""
    return _traffic(NORMUON_PASSES, m, n)


def normuon_state_numel(m: int, n: int) -> int:
    """Optimizer-state elements of NorMuon for an m×n matrix: Muon's momentum (m·n) and the
    second moment of each row of the orthogonalised update (m)."""
    return muon_state_numel(m, n) + m


def row_stats_numel(m: int, n: int, *, whole_rows: bool) -> int:
    """Elements a rank of a shared NorMuon matrix (m × n, m its output rows) sums with the
    others after the orthogonalisation: its partial squared sums of all m rows when the pieces
    are blocks of columns, or when they are blocks of whole rows the two Frobenius norms (the
    orthogonalised update's and the row-normalised one's)."""
    _check_positive("m", m)
    _check_positive("n", n)
    return 2 if whole_rows else m


def shampoo_traffic_bytes(m: int, n: int) -> int:
    """Bytes Shampoo's element-wise passes of an m×n matrix move (:data:`SHAMPOO_PASSES`)."""
    return _traffic(SHAMPOO_PASSES, m, n)


def soap_traffic_bytes(m: int, n: int) -> int:
    """Bytes SOAP's element-wise passes of an m×n matrix move (:data:`SOAP_PASSES`)."""
    return _traffic(SOAP_PASSES, m, n)


def muon_state_numel(m: int, n: int) -> int:
    """Optimizer-state elements of Muon for an m×n matrix: the momentum buffer, m·n (§4)."""
    _check_positive("m", m)
    _check_positive("n", n)
    return m * n


def shampoo_flops(
    m: int,
    n: int,
    *,
    max_preconditioner_dim: int = 1024,
    precondition_frequency: int = SHAMPOO_DEFAULT_PRECONDITION_FREQUENCY,
    amortised: bool = True,
) -> int:
    """FLOPs of one Shampoo step of an m×n matrix, summed over its blocks.

    The matrix is cut into blocks of at most ``max_preconditioner_dim`` per side. A k1×k2 block
    costs per step: statistics L += G Gᵀ and R += GᵀG (2k1²k2 + 2k1k2²) and the
    preconditioned gradient L^{-1/4} G R^{-1/4} (2k1²k2 + 2k1k2²). Every ``precondition_frequency``
    steps each side's inverse 4th root is recomputed: eigh (≈ 9k³) and Q·diag·Qᵀ (2k³), i.e. §4's
    "≈ 9k³ + 2k³ per side"; ``amortised=True`` adds that cost divided by the frequency.
    """
    _check_positive("m", m)
    _check_positive("n", n)
    _check_positive("max_preconditioner_dim", max_preconditioner_dim)
    _check_positive("precondition_frequency", precondition_frequency)
    per_step = 0
    roots = 0
    for k1 in block_sizes(m, max_preconditioner_dim):
        for k2 in block_sizes(n, max_preconditioner_dim):
            per_step += 4 * k1 * k1 * k2 + 4 * k1 * k2 * k2
            roots += (_EIGH_K3 + 2) * (k1**3 + k2**3)
    if not amortised:
        return per_step
    return per_step + roots // precondition_frequency


def shampoo_state_numel(
    m: int,
    n: int,
    *,
    max_preconditioner_dim: int = 1024,
    grafting: bool = True,
    first_moment: bool = True,
    momentum: bool = False,
) -> int:
    """Optimizer-state elements of Shampoo for an m×n matrix.

    Per k1×k2 block: L and its inverse root (2k1²), R and its inverse root (2k2²). Per matrix:
    the filtered gradient (m·n, when ``betas[0] > 0``: ``first_moment``), Adam grafting's second
    moment (m·n, ``grafting``), the momentum buffer (m·n, ``momentum``), and the step counter (1).
    The keyword defaults match ``ShampooConfig``'s defaults.
    """
    _check_positive("m", m)
    _check_positive("n", n)
    _check_positive("max_preconditioner_dim", max_preconditioner_dim)
    total = 1
    for k1 in block_sizes(m, max_preconditioner_dim):
        for k2 in block_sizes(n, max_preconditioner_dim):
            total += 2 * k1 * k1 + 2 * k2 * k2
    total += m * n * (int(bool(grafting)) + int(bool(first_moment)) + int(bool(momentum)))
    return total


def soap_flops(
    m: int,
    n: int,
    *,
    max_precond_dim: int = 10000,
    precondition_frequency: int = 10,
    amortised: bool = True,
) -> int:
    """FLOPs of one SOAP step of an m×n matrix.

    Each preconditioned side (size ≤ ``max_precond_dim``; larger sides use the identity) costs
    per step four products with the k×k factor: project the gradient and the first moment into
    the eigenbasis, project the update back, and update the statistic (G Gᵀ or GᵀG) — 8m²n for
    the left side and 8mn² for the right, §4's "≈ 8(m²n + mn²)". Every ``precondition_frequency``
    steps each side's basis is refreshed by one power iteration (2k³ matmul) and a QR
    (≈ 8/3·k³): §4's "≈ 4.7k³ per side"; ``amortised=True`` adds that divided by the frequency.
    The one-off first eigh basis is not amortised.
    """
    _check_positive("m", m)
    _check_positive("n", n)
    _check_positive("max_precond_dim", max_precond_dim)
    _check_positive("precondition_frequency", precondition_frequency)
    per_step = 0
    refresh_num = 0  # in units of 1/3 FLOP
    if m <= max_precond_dim:
        per_step += 8 * m * m * n
        refresh_num += (3 * 2 + _QR_K3_NUM) * m**3
    if n <= max_precond_dim:
        per_step += 8 * m * n * n
        refresh_num += (3 * 2 + _QR_K3_NUM) * n**3
    if not amortised:
        return per_step
    return per_step + refresh_num // (_QR_K3_DEN * precondition_frequency)


def soap_state_numel(m: int, n: int, *, max_precond_dim: int = 10000) -> int:
    """Optimizer-state elements of SOAP for an m×n matrix.

    Adam's two moments (2·m·n), per preconditioned side its statistic and eigenbasis (2k²), and the
    step counter (1): §4's "m² + n² + Q_L + Q_R + 2·m·n".
    """
    _check_positive("m", m)
    _check_positive("n", n)
    _check_positive("max_precond_dim", max_precond_dim)
    total = 2 * m * n + 1
    for k in (m, n):
        if k <= max_precond_dim:
            total += 2 * k * k
    return total


def adamw_flops(numel: int) -> int:
    """Elementwise FLOPs of one AdamW step over ``numel`` elements (§4: O(numel))."""
    _check_positive("numel", numel)
    return ADAMW_FLOPS_PER_ELEMENT * numel


def adamw_traffic_bytes(numel: int) -> int:
    """Bytes one AdamW step over ``numel`` elements moves (:data:`ADAMW_BYTES_PER_ELEMENT`)."""
    _check_positive("numel", numel)
    return ADAMW_BYTES_PER_ELEMENT * numel


def adamw_state_numel(numel: int) -> int:
    """Optimizer-state elements of AdamW: two moments (2·numel, §4) and the step counter (1)."""
    _check_positive("numel", numel)
    return 2 * numel + 1


# --- shared Newton–Schulz in lockstep ----------------------------------------------------------

#: The Gram of a shared Newton–Schulz is symmetric, so its all-reduce carries only its upper
#: part, cut in this many block rows (each block row ``[r0, r1)`` sends ``G[r0:r1, r0:]``; the
#: rest is its mirror): about n²/2·(1 + 1/GRAM_BLOCKS) elements instead of n².
GRAM_BLOCKS = 16


def gram_blocks(n: int) -> list[tuple[int, int]]:
    """The block rows ``[r0, r1)`` of an n × n Gram whose upper parts ``G[r0:r1, r0:]`` are
    all-reduced: ⌈n/GRAM_BLOCKS⌉ rows each, the last shorter, so at most :data:`GRAM_BLOCKS`
    of them (fewer when GRAM_BLOCKS does not divide n, e.g. 9 for n = 17; n for n < 16)."""
    _check_positive("n", n)
    return list(_gram_blocks(n))


@lru_cache(maxsize=1024)
def _gram_blocks(n: int) -> tuple[tuple[int, int], ...]:
    size = -(-n // GRAM_BLOCKS)
    return tuple((r, min(n, r + size)) for r in range(0, n, size))


def gram_packed_numel(n: int) -> int:
    """Elements of an n × n Gram's all-reduce: its block rows' upper parts (:func:`gram_blocks`)."""
    _check_positive("n", n)
    return _gram_packed(n)


@lru_cache(maxsize=1024)
def _gram_packed(n: int) -> int:
    return sum((r1 - r0) * (n - r0) for r0, r1 in _gram_blocks(n))


#: The Gram's block rows are computed and all-reduced in this many chunks of consecutive block
#: rows, each chunk's all-reduce launched as soon as its rows are computed, so the all-reduce
#: runs beside the rest of the Gram's products (:func:`gram_chunks`).
GRAM_CHUNKS = 4


def gram_chunks(n: int) -> list[tuple[int, int, int, int]]:
    """The chunks in which a shared Newton–Schulz computes and all-reduces an n × n Gram:
    ``(r0, r1, p0, p1)`` per chunk — rows ``[r0, r1)`` of G (whole :func:`gram_blocks` block
    rows, ⌈blocks/GRAM_CHUNKS⌉ of them, the last chunk shorter) and the range ``[p0, p1)`` of
    the packed buffer that holds their upper parts (block rows are packed in order). Each chunk
    costs 2·rows·(r1−r0)·n FLOPs on a rank with ``rows`` rows (its rows of G in full) and sends
    p1 − p0 elements; the packed sizes fall chunk by chunk (upper parts shorten), so the largest
    all-reduce starts first."""
    _check_positive("n", n)
    return list(_gram_chunks(n))


@lru_cache(maxsize=1024)
def _gram_chunks(n: int) -> tuple[tuple[int, int, int, int], ...]:
    blocks = _gram_blocks(n)
    per = -(-len(blocks) // GRAM_CHUNKS)
    out, at = [], 0
    for i in range(0, len(blocks), per):
        part = blocks[i:i + per]
        size = sum((r1 - r0) * (n - r0) for r0, r1 in part)
        out.append((part[0][0], part[-1][1], at, at + size))
        at += size
    return tuple(out)


def poly_blocks(n: int, k: int) -> list[list[tuple[int, int]]]:
    """The split polynomial P = bG + cG² (symmetric, n × n) over ``k`` ranks: per rank, the
    block rows ``[r0, r1)`` whose upper parts ``P[r0:r1, r0:]`` it computes and all-gathers.
    P is cut in 2k block rows of ⌈n/2k⌉ rows; rank r takes blocks r and 2k−1−r, a long upper
    part and a short one, so every rank computes and sends about as much (exactly when 2k
    divides n): n²(2k+1)/(4k²) elements."""
    _check_positive("n", n)
    _check_positive("k", k)
    size = -(-n // (2 * k))
    cut = [(min(n, i * size), min(n, (i + 1) * size)) for i in range(2 * k)]
    return [[cut[r], cut[2 * k - 1 - r]] for r in range(k)]


@lru_cache(maxsize=1024)
def poly_packed_numel(n: int, k: int) -> int:
    """Elements each rank contributes to the split polynomial's all-gather: the largest of the
    ranks' upper parts (:func:`poly_blocks`; the others are zero-padded to it; computed once per
    size: the planner's lockstep model asks for it in its inner loops)."""
    return max(sum((r1 - r0) * (n - r0) for r0, r1 in mine) for mine in poly_blocks(n, k))


def poly_flops(n: int, k: int) -> int:
    """FLOPs of one step's split polynomial on the busiest rank: its upper parts,
    b·G[r0:r1, r0:] + c·G[r0:r1, :]·G[:, r0:], 2·(r1−r0)·n·(n−r0) each."""
    return 2 * n * poly_packed_numel(n, k)


def shared_ns_flops(rows: int, n: int, k: int, *, steps: int = 5,
                    split_polynomial: bool = False) -> int:
    """Matmul FLOPs one rank spends in the shared Newton–Schulz
    (``canzona.runtime.optim.shared_ns.shared_newton_schulz``) on ``rows`` × ``n``:
    ``steps · (4n²·rows + 2n³)``, or with the split ``steps · (4n²·rows + poly_flops(n, k))``
    (the busiest rank's upper parts of P, :func:`poly_flops`). With k = 1 it is the
    single-device count (:func:`muon_flops` for rows ≥ n)."""
    poly = poly_flops(n, k) if split_polynomial and k > 1 else 2 * n ** 3
    return steps * (4 * n * n * rows + poly)


def shared_ns_bytes(n: int, k: int, *, steps: int = 5, split_polynomial: bool = False,
                    element_size: int = 4, tp_pair: bool = False) -> int:
    """Bytes one rank sends per call under ring algorithms: per step the all-reduce of the
    Gram's packed upper part, 2(k−1)/k·g elements (g = :func:`gram_packed_numel`),
    plus with the split the all-gather of its padded packed parts of P, (k−1)·q elements
    (q = :func:`poly_packed_numel`; the rare overflow guard's extra all-reduces not
    counted).

    ``tp_pair`` (the runtime's ``TPPair``, k = 2·t over t TP ranks): a reduce-scatter and an
    all-gather over the TP group, 2(t−1)/t·g, and a 1/t chunk of g to the partner DP index; with
    the split, this rank's q to the partner, then the all-gather of both over the TP group,
    (t−1)·2q. Only g/t (+ q) per rank and step crosses between the DP indices."""
    if k <= 1:
        return 0
    g = gram_packed_numel(n)
    if tp_pair:
        if k % 2:
            raise ValueError(f"shared_ns_bytes: a TP group and its DP partner are k = 2·tp "
                             f"ranks, not k = {k}")
        t = k // 2
        per_step = 2 * (t - 1) * g / t + g / t
        if split_polynomial:
            q = poly_packed_numel(n, k)
            per_step += q + (t - 1) * 2 * q
        return int(round(steps * per_step * element_size))
    per_step = 2 * (k - 1) * g / k
    if split_polynomial:
        per_step += (k - 1) * poly_packed_numel(n, k)
    return int(round(steps * per_step * element_size))


def lockstep_bytes(rows: int, n: int, k: int, split: bool, e: int) -> int:
    """Scratch bytes one matrix holds while shared in lockstep: its iterate twice (rows × n), the
    Gram (n × n) and its packed upper part (:func:`gram_packed_numel`), the polynomial (n × n;
    with the split, unpacked into the Gram's buffer, the gathered k packed parts and its own
    instead, :func:`poly_packed_numel`) and the momentum direction handed in (rows × n, fp32)."""
    poly = (k + 1) * poly_packed_numel(n, k) if split else n * n
    return (2 * rows * n + n * n + gram_packed_numel(n) + poly) * e + 4 * rows * n


def sub_round_rows(m: int, tp: int, k: int) -> int:
    """Rows of the oriented m-row matrix one member of a TP sub-group of ``k`` holds in a round
    (``runtime.optim.sub_groups``): tp/k TP shards of ⌈m/tp⌉ rows."""
    return tp // k * -(-m // tp)


def sub_round_bytes(m: int, n: int, tp: int, k: int, split: bool, e: int) -> int:
    """Scratch bytes one round of TP sub-groups holds on a rank in a lockstep batch (tp/k alike
    m × n matrices, m ≥ n, each TP rank one piece): its rows' :func:`lockstep_bytes` over the
    ``k`` sharing ranks, plus the all-to-all buffers that gather them and return the update
    rows (each :func:`sub_round_rows` × n in ``e`` bytes)."""
    rows = sub_round_rows(m, tp, k)
    return lockstep_bytes(rows, n, k, split, e) + 2 * rows * n * e


#: A lockstep batch of shared matrices holds at most this many C_max of scratch: what the
#: micro-groups hold at most too (two groups in flight).
LOCKSTEP_CMAX = 2


def lockstep_batches(items: list, sizes: list[int], cap: int) -> list[list]:
    """``items`` in order, cut into consecutive batches whose ``sizes`` sum to at most ``cap``
    (a larger single item alone): how the runtime bounds the lockstep's scratch
    (``cap`` = :data:`LOCKSTEP_CMAX` · C_max)."""
    out: list[list] = []
    total = cap + 1
    for x, b in zip(items, sizes):
        if out and total + b <= cap:
            out[-1].append(x)
            total += b
        else:
            out.append([x])
            total = b
    return out
