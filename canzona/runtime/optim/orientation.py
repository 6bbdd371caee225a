"""Orientation for a shared Newton–Schulz: which way a stored matrix is iterated, and which
rows of the oriented matrix a TP shard or a ZeRO-1 cut holds (:func:`orientation`,
:func:`tp_row_blocks`, :func:`dp_row_block`).

A torch weight is ``[out, in]``. The sharing cut must run along the long dimension (then the
shared Gram G is the small n × n one); a cut along the short one would make G the large Gram
(m × m) and is refused.

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
  the shared kernel cannot share: :func:`dp_row_block` refuses it, and such a matrix is shared
  over a TP sub-group (where its shards are long-dimension blocks) or exchanged first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = ["Orientation", "dp_row_block", "orientation", "tp_row_blocks"]


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
