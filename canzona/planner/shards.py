"""How Megatron's TP shards concatenate into a parameter's logical matrix (torch-free).

A host rank that computes a whole-matrix update receives every TP rank's shard and must rebuild the
*logical* matrix: the Hugging Face view the plan's task shape refers to (``[q; k; v]`` for the fused
QKV, ``[gate; up]`` for fc1, the unpadded vocabulary). Megatron-core's shards are not simply the
logical matrix cut in ``tp`` pieces (megatron/core/tensor_parallel/layers.py and
the HF↔Megatron checkpoint converters):

* column parallel (``partition_dim=0``): rank r holds rows [r·m/t, (r+1)·m/t);
* row parallel (``partition_dim=1``): rank r holds columns [r·n/t, (r+1)·n/t);
* ``linear_qkv``: rows are grouped per KV group g as [q heads of g; k_g; v_g] and rank r holds the
  groups [r·G/t, (r+1)·G/t) — so q, k and v rows interleave across ranks;
* ``linear_fc1`` (``partition_stride=2``): rank r holds [gate rows of r; up rows of r], so the
  plain concatenation of the shards is [g0; u0; g1; u1; …], not [gate; up];
* vocabulary-parallel (embedding, output layer): the vocabulary is padded to Vpad (a multiple of
  128·t), rank r holds padded rows [r·Vpad/t, (r+1)·Vpad/t); rows ≥ V are padding and are dropped.

A :class:`ShardMap` describes this as segments along the partition dimension: ``local[ls:ls+n]``
of rank ``rank`` is ``full[fs:fs+n]``. Segments are sorted by ``full_start`` and tile the logical
view exactly. For a split part (Q, K, V, gate or up as separate matrices, Megatron's ``split_qkv``)
the full view is that part alone and only the rows of that part appear.

Wire order used by the plan's all-to-all split sizes: rank r sends, for each task, its segments'
local slices in ``full_start`` order (flattened row-major, each slice ``n`` rows × cols, or for
``dim=1`` rows × ``n`` columns); the host places them back with the same segments.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CanzonaError
from .inventory import ParamSpec
from .layout import padded_vocab


@dataclass(frozen=True, slots=True)
class Segment:
    """``local[local_start : local_start + length]`` of TP rank ``rank`` is
    ``full[full_start : full_start + length]`` along the partition dimension."""

    rank: int
    local_start: int
    full_start: int
    length: int


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Where every slice of the logical matrix (or of one part of it) lives under TP.

    Attributes:
        dim: partition dimension (0 rows, 1 columns); None for replicated parameters (one
            segment: the view's rows inside the local, logical tensor; nothing is gathered).
        tp: TP size.
        local_shape: one rank's shard of the whole parameter (padded vocabulary included).
        full_shape: logical shape of the view (the parameter, or the part).
        segments: sorted by ``full_start``; they tile [0, full_shape[dim]).
    """

    dim: int | None
    tp: int
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    segments: tuple[Segment, ...]

    def rank_segments(self, rank: int) -> tuple[Segment, ...]:
        """The segments rank ``rank`` holds, in wire order (``full_start`` order)."""
        return tuple(s for s in self.segments if s.rank == rank)

    def sent_numel(self, rank: int) -> int:
        """Elements rank ``rank`` contributes to the gather of this view."""
        if self.dim is None:
            return 0
        other = 1
        for k, s in enumerate(self.full_shape):
            if k != self.dim:
                other *= s
        return sum(s.length for s in self.rank_segments(rank)) * other

    @property
    def full_numel(self) -> int:
        n = 1
        for s in self.full_shape:
            n *= s
        return n

    def row_sources(self) -> list[tuple[int, int]]:
        """For every index along ``dim`` of the full view: (rank, local index)."""
        out: list[tuple[int, int]] = []
        for s in self.segments:
            out.extend((s.rank, s.local_start + i) for i in range(s.length))
        return out


def _even(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise CanzonaError(f"{what} ({n}) is not divisible by tp={tp}.")
    return n // tp


def shard_map(p: ParamSpec, tp: int, *, kv_groups: int | None = None,
              part: str | None = None) -> ShardMap:
    """The :class:`ShardMap` of ``p`` (or of its part ``part``) at TP size ``tp``.

    Args:
        p: the parameter (logical shape, TP layout, parts).
        tp: tensor-parallel size of the parameter (the expert TP size for experts).
        kv_groups: number of KV heads; required for ``qkv`` layouts.
        part: ``q``/``k``/``v`` or ``gate``/``up`` for the split-part view, else None.
    """
    if part is not None and part not in {x.name for x in p.parts}:
        raise CanzonaError(f"{p.name} has no part '{part}' (parts: "
                           f"{', '.join(x.name for x in p.parts) or 'none'}).")
    rows = p.shape[0]
    rest = tuple(p.shape[1:])
    layout = p.tp_layout
    if layout == "replicated":
        # Every rank holds the logical tensor: nothing to gather (a part is a row range of it).
        full = p.shape if part is None else _part_shape(p, part)
        off = 0 if part is None else _part_offset(p, part)
        return ShardMap(None, tp, p.shape, full, (Segment(0, off, 0, full[0]),))
    if layout == "row":
        cols = _even(p.shape[1], tp, f"{p.name} columns")
        segs = tuple(Segment(r, 0, r * cols, cols) for r in range(tp))
        return ShardMap(1, tp, (rows, cols), p.shape, segs)
    if layout == "column":
        loc = _even(rows, tp, f"{p.name} rows")
        segs = tuple(Segment(r, 0, r * loc, loc) for r in range(tp))
        return ShardMap(0, tp, (loc, *rest), p.shape, segs)
    if layout == "vocab":
        vpad = padded_vocab(rows, tp)
        loc = vpad // tp
        segs = tuple(Segment(r, 0, r * loc, min(loc, rows - r * loc))
                     for r in range(tp) if rows > r * loc)
        return ShardMap(0, tp, (loc, *rest), p.shape, segs)
    if layout == "gate_up":
        (g, gr), (u, ur) = [(x.name, x.rows) for x in p.parts]
        f = _even(gr, tp, f"{p.name} gate rows")
        _even(ur, tp, f"{p.name} up rows")
        segs: list[Segment] = []
        for r in range(tp):
            if part in (None, g):
                segs.append(Segment(r, 0, r * f, f))
            if part in (None, u):
                segs.append(Segment(r, f, (gr if part is None else 0) + r * f, f))
        full = p.shape if part is None else _part_shape(p, part)
        return ShardMap(0, tp, (2 * f, *rest), full,
                        tuple(sorted(segs, key=lambda s: s.full_start)))
    if layout == "qkv":
        if kv_groups is None:
            raise CanzonaError(f"{p.name}: the QKV shard map needs the number of KV groups.")
        q_rows, k_rows, v_rows = (x.rows for x in p.parts)
        G = kv_groups
        hd = _even(k_rows, G, f"{p.name} k rows per KV group")
        qg = _even(q_rows, G, f"{p.name} q rows per KV group")
        per_rank = _even(G, tp, f"{p.name} KV groups")
        block = qg + 2 * hd  # one KV group's rows in Megatron's fused layout
        base = {"q": 0, "k": q_rows, "v": q_rows + k_rows}
        size = {"q": qg, "k": hd, "v": hd}
        local_off = {"q": 0, "k": qg, "v": qg + hd}
        segs = []
        for r in range(tp):
            for j in range(per_rank):
                grp = r * per_rank + j
                for x in ("q", "k", "v"):
                    if part not in (None, x):
                        continue
                    full_start = (base[x] if part is None else 0) + grp * size[x]
                    segs.append(Segment(r, j * block + local_off[x], full_start, size[x]))
        full = p.shape if part is None else _part_shape(p, part)
        return ShardMap(0, tp, (per_rank * block, *rest), full,
                        tuple(sorted(segs, key=lambda s: s.full_start)))
    raise CanzonaError(f"{p.name}: unknown TP layout '{layout}'.")


def _part_shape(p: ParamSpec, part: str) -> tuple[int, ...]:
    rows = next(x.rows for x in p.parts if x.name == part)
    return (rows, *p.shape[1:])


def _part_offset(p: ParamSpec, part: str) -> int:
    off = 0
    for x in p.parts:
        if x.name == part:
            return off
        off += x.rows
    raise CanzonaError(f"{p.name} has no part '{part}'.")


def concat_shards(m: ShardMap, shards: list, cat) -> object:
    """Rebuild the full view from per-rank shards with any array library.

    Args:
        m: the shard map.
        shards: one array per TP rank (the whole local shard of the parameter).
        cat: ``cat(list_of_arrays, dim)``, e.g. ``lambda xs, d: torch.cat(xs, d)``.

    The slices are taken in ``full_start`` order, so concatenating them is the full view.
    """
    if m.dim is None:
        (s,) = m.segments
        return shards[0][s.local_start:s.local_start + s.length]
    pieces = []
    for s in m.segments:
        sl = [slice(None)] * len(m.local_shape)
        sl[m.dim] = slice(s.local_start, s.local_start + s.length)
        pieces.append(shards[s.rank][tuple(sl)])
    return cat(pieces, m.dim)


def split_full(m: ShardMap, full, rank: int) -> list:
    """The slices of the full view that belong to ``rank``'s shard, in its local order.

    Returns (local_start, array) pairs: writing each array at ``local_start`` along ``dim`` of the
    rank's shard scatters an update back.
    """
    out = []
    for s in m.rank_segments(rank):
        sl = [slice(None)] * len(m.full_shape)
        sl[m.dim] = slice(s.full_start, s.full_start + s.length)  # type: ignore[index]
        out.append((s.local_start, full[tuple(sl)]))
    return out
