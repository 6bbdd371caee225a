"""The packed layouts of what a shared Newton–Schulz all-reduces and gathers, and their unpacking.

* The Gram G is symmetric: its upper block rows ``G[r0:r1, r0:]`` (``formulas.gram_blocks``)
  are packed back to back (:func:`pack_gram`), reduced, and mirrored back below the diagonal
  blocks (:func:`unpack_gram`; a diagonal block keeps both triangles as reduced).
* The packed Gram is all-reduced in chunks of consecutive block rows (``formulas.gram_chunks``,
  :func:`chunk_layout`); a :class:`~canzona.runtime.optim.transports.TPPair`'s chunks are each
  padded to a multiple of the TP size, for its reduce-scatter.
* With the split polynomial, each rank packs the upper parts of its block rows of P
  (``formulas.poly_blocks``, :func:`poly_views`, zero-padded to equal size); the gathered parts
  are unpacked into P and mirrored (:func:`unpack_poly`).

Views into the packed buffers are made once per call (:func:`gram_views`, :func:`poly_views`)
and reused every step.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from canzona.planner.formulas import gram_blocks, gram_chunks, poly_blocks
from canzona.runtime.optim.transports import TPPair

__all__ = ["chunk_layout", "gram_views", "mirror_into", "pack_gram", "poly_views", "unpack_gram",
           "unpack_poly"]


def chunk_layout(n: int, group: Any = None) -> list[tuple[int, int, int, int]]:
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


def gram_views(packed: Tensor, n: int, chunks: list | None = None
               ) -> list[tuple[int, int, Tensor]]:
    """(r0, r1, view) of each block row's upper part ``G[r0:r1, r0:]`` in ``packed``: block rows
    in order, each chunk's from its start (``chunks``: :func:`chunk_layout`; None: back to
    back)."""
    starts = {r0: q0 for r0, _, q0, _ in chunks or ()}
    out, at = [], 0
    for r0, r1 in gram_blocks(n):
        at = starts.get(r0, at)
        size = (r1 - r0) * (n - r0)
        out.append((r0, r1, packed[at:at + size].view(r1 - r0, n - r0)))
        at += size
    return out


def pack_gram(gram: Tensor, packed: Tensor, views: list | None = None) -> None:
    """The upper block rows of a symmetric ``gram`` into ``packed`` (``formulas.gram_blocks``;
    ``views``: :func:`gram_views` of ``packed``, made once, or those of one chunk): the
    all-reduce carries about half the Gram."""
    for r0, r1, v in views if views is not None else gram_views(packed, gram.shape[0]):
        v.copy_(gram[r0:r1, r0:])


def unpack_gram(packed: Tensor, gram: Tensor, views: list | None = None) -> None:
    """The reduced ``packed`` back into ``gram``: each block row's upper part, and its mirror
    below the diagonal block (a diagonal block keeps both of its triangles as reduced)."""
    mirror_into(gram, views if views is not None else gram_views(packed, gram.shape[0]))


def mirror_into(out: Tensor, views: list) -> None:
    """Each block row's upper part ``(r0, r1, view)`` into ``out[r0:r1, r0:]`` and its mirror
    below the diagonal block."""
    for r0, r1, v in views:
        out[r0:r1, r0:].copy_(v)
        out[r1:, r0:r1].copy_(v[:, r1 - r0:].mT)


def poly_views(send: Tensor, n: int, k: int, rank: int) -> list[tuple[int, int, Tensor]]:
    """(r0, r1, view) of each of ``rank``'s block rows' upper parts ``P[r0:r1, r0:]`` of the split
    polynomial in its packed ``send`` (``formulas.poly_blocks``; the rest is padding)."""
    out, at = [], 0
    for r0, r1 in poly_blocks(n, k)[rank]:
        size = (r1 - r0) * (n - r0)
        out.append((r0, r1, send[at:at + size].view(r1 - r0, n - r0)))
        at += size
    return out


def unpack_poly(gathered: Tensor, poly: Tensor, k: int) -> None:
    """Every rank's packed upper parts of P (gathered in rank order) into ``poly``, mirrored
    below the diagonal blocks (each diagonal block is whole, computed by one rank)."""
    n = poly.shape[0]
    size = gathered.numel() // k
    mirror_into(poly, [v for rank in range(k)
                       for v in poly_views(gathered[rank * size:(rank + 1) * size], n, k, rank)])
