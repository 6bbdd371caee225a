"""Shampoo's blocks as pieces: where a matrix is cut between two runs of whole block rows (two DP
indices at tp = 1, :func:`block_row`, :func:`block_pieces`) and which TP shards are whole
blocks, each preconditioned by its own TP rank (:func:`shard_blocks_aligned`,
:func:`shard_block_decision`). A piece is the kernel on its own blocks: exactly the whole
matrix's update there, with no exchange."""

from __future__ import annotations

from .. import optimizers
from ..cost import STATE_BYTES
from ..hardware import HardwareProfile, load_hardware
from ..planning import DPProblem
from ..settings import OptimizerSettings
from ..shards import ShardMap, shard_map
from .pieces import profile_rate


def block_row(rows: int, max_block: int) -> int | None:
    """Where a Shampoo matrix with ``rows`` rows is cut into two runs of whole block rows
    (blocks of ``max_block``, the remainder last): after ⌈blocks/2⌉ of them; None for one."""
    blocks = -(-rows // max_block)
    return None if blocks < 2 else -(-blocks // 2) * max_block


def block_pieces(settings: OptimizerSettings, rows: int, cols: int, row: int
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(FLOPs, state bytes) of the two pieces of a Shampoo matrix cut before block row ``row``:
    each is the kernel on its own rows (blocks are preconditioned independently)."""
    spec = optimizers.get(settings.name)
    parts = ((row, cols), (rows - row, cols))
    return (tuple(spec.flops(m, n, settings) for m, n in parts),  # type: ignore[return-value]
            tuple(spec.state_numel(m, n, settings) * STATE_BYTES for m, n in parts))


def piece_loads(load: int, flops: int, piece_flops: tuple[int, int]) -> tuple[int, int]:
    """A task's load split over its pieces in proportion to their FLOPs."""
    return tuple(load * f // flops if flops else 0  # type: ignore[return-value]
                 for f in piece_flops)


def shard_blocks_aligned(smap: ShardMap, block: int) -> bool:
    """Whether every TP rank's shard of a matrix is whole blocks of the matrix's Shampoo block
    grid (``block`` per side, the remainder last), laid out so that the shard's own grid is
    those blocks: every segment starts on a block boundary, in the shard and in the matrix, and
    is whole blocks long (or ends both at the matrix's end and the shard's). Then each TP rank
    preconditions its own blocks and gets the whole matrix's update on them."""
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
    """Shampoo at tp > 1: the TP-split matrices whose shards are whole
    blocks (:func:`shard_blocks_aligned`), each preconditioned by its TP group shard by shard —
    every TP rank its own blocks, nothing gathered, no host, no collective; exactly the whole
    matrix's update (Shampoo's statistics, roots, grafting and momentum are per block or per
    element). Task id → (load per TP rank, False, compute seconds, 0.0, 0.0), what
    ``DPProblem.shared`` holds; the load is the task's load in proportion to its shard's FLOPs.
    Every eligible matrix: on the GPUs it is never heavier than hosting (the same FLOPs over tp
    ranks, no gather); whether the plan keeps them is the objective's call
    (``candidates.Candidates``: ``share="auto"`` compares with hosting)."""
    st, sizes = problem.settings, problem.sizes
    if not st.spec.block_hosted or sizes.tp == 1:
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
