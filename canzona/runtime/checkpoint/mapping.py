"""Where the pieces a rank holds under its plan sit in the plan-independent (canonical) tensors.

The canonical tensor of a parameter is the one the single-device model holds (Megatron at tp 1):
TP shards concatenated along the partition dim, each rank's shard taken as ``partition_stride``
sub-blocks (fc1's [gate_r; up_r] → [gate; up]), the vocabulary's TP padding left out. Tensors of
more than two dims are viewed as 2-D (leading dims flattened): a stacked expert tensor [E, m, n]
is the canonical [E·m, n] (its tasks are row blocks of it). A rank's piece of a parameter — an
element range of its local shard (ZeRO-1 slices cut flat buffers), or a whole shard — is at most
three rectangles of the local 2-D view (a partial row, whole rows, a partial row), each split at
the shard's sub-block boundaries into boxes of the canonical tensor.

:class:`Axis` and :func:`axis_of` say how a TP shard sits in the canonical tensor,
:class:`ParamView` cuts an element range into canonical boxes, and :class:`RankLayout` holds both
for every parameter of an optimizer (this rank's own slices, its matrix tasks' canonical rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from canzona.runtime.checks import plan_params
from canzona.runtime.errors import CheckpointError
from canzona.runtime.introspect import _is_dtensor, local_tensor
from canzona.runtime.update import task_state

__all__ = ["Axis", "ParamView", "RankLayout", "axis_of", "chunk_axis", "logical_key_shape",
           "megatron_axis", "view_2d"]

#: (local start, length, canonical start) along the split dim; lengths clipped to the logical
#: extent (the vocabulary's padding rows map nowhere).
Block = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Axis:
    """How TP rank ``rank``'s shard sits in the canonical tensor: ``dim`` None (not split: the
    shard is the canonical tensor) or 0/1 of the 2-D view, with its sub-blocks along it."""

    dim: int | None
    blocks: tuple[Block, ...] = ()

    def canonical(self, x: int) -> int | None:
        """The canonical index along ``dim`` of local index ``x`` (None: padding)."""
        for ls, n, cs in self.blocks:
            if ls <= x < ls + n:
                return cs + x - ls
        return None


def view_2d(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view of a shape: (n, 1) for a vector, leading dims flattened beyond two."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return (math.prod(shape[:-1]), shape[-1])


def megatron_axis(dim: int, local_len: int, stride: int, tp: int, rank: int,
                  logical_len: int) -> Axis:
    """Megatron's rule: the shard is ``stride`` sub-blocks; sub-block s of rank r is canonical
    block s·tp + r (padding beyond ``logical_len`` dropped)."""
    if stride < 1 or local_len % stride:
        raise ValueError(f"partition_stride {stride} does not divide the shard's {local_len}")
    b = local_len // stride
    blocks = []
    for s in range(stride):
        cs = (s * tp + rank) * b
        n = max(0, min(b, logical_len - cs))
        if n:
            blocks.append((s * b, n, cs))
    return Axis(dim, tuple(blocks))


def chunk_axis(dim: int, logical_len: int, tp: int, rank: int) -> Axis:
    """DTensor's ``Shard(dim)``: torch.chunk's pieces (ceil-sized, the last ones shorter)."""
    size = -(-logical_len // tp)
    start = min(rank * size, logical_len)
    n = max(0, min(size, logical_len - start))
    return Axis(dim, ((0, n, start),) if n else ())


def axis_of(live: Tensor, logical_shape: Sequence[int], tp: int, rank: int) -> Axis:
    """This rank's (or, with another ``rank``, TP rank ``rank``'s) axis of a live parameter:
    a sharded DTensor's placement, Megatron's ``tensor_model_parallel``/``partition_dim``/
    ``partition_stride``, else not split."""
    logical = view_2d(logical_shape)
    local = view_2d(local_tensor(live).shape)
    if _is_dtensor(live):
        names = live.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
        k = names.index("tp") if "tp" in names else 0
        pl = live.placements[k]  # type: ignore[attr-defined]
        if not pl.is_shard():
            return Axis(None)
        d = 0 if len(live.shape) == 1 else pl.dim  # type: ignore[attr-defined]
        return chunk_axis(d, logical[d], tp, rank)
    if tp == 1 or not getattr(live, "tensor_model_parallel", False):
        if local[0] > logical[0] and local[1] == logical[1]:
            return Axis(0, ((0, logical[0], 0),))  # a padded vocabulary at tp 1: rows dropped
        return Axis(None)
    dim = int(getattr(live, "partition_dim", 0))
    d = 0 if len(live.shape) == 1 else dim
    stride = int(getattr(live, "partition_stride", 1) or 1)
    return megatron_axis(d, local[d], stride, tp, rank, logical[d])


@dataclass(frozen=True, slots=True)
class ParamView:
    """One parameter as this rank holds it: its local 2-D view and where it sits in the
    canonical (logical) tensor."""

    name: str
    logical: tuple[int, ...]  # the key's shape: the parameter's logical shape in 1-D or 2-D
    local: tuple[int, int]  # the local shard's 2-D view
    axis: Axis

    def boxes(self, a: int, b: int) -> list[tuple[tuple[int, int], tuple[int, int, int, int]]]:
        """Elements ``[a, b)`` of the flattened local shard as canonical boxes: per box, its
        canonical (row, column) offset and its local rectangle (row, rows, column, columns)."""
        R, C = self.local
        rects = []
        if a >= b:
            return []
        r, c = divmod(a, C)
        if c:
            n = min(C - c, b - a)
            rects.append((r, 1, c, n))
            a += n
            r += 1
        if b - a >= C:
            rows = (b - a) // C
            rects.append((r, rows, 0, C))
            a += rows * C
            r += rows
        if a < b:
            rects.append((r, 1, 0, b - a))
        out = []
        for r0, nr, c0, nc in rects:
            if self.axis.dim is None:
                out.append(((r0, c0), (r0, nr, c0, nc)))
                continue
            lo, ln = (r0, nr) if self.axis.dim == 0 else (c0, nc)
            for ls, n, cs in self.axis.blocks:
                x0, x1 = max(lo, ls), min(lo + ln, ls + n)
                if x0 >= x1:
                    continue
                if self.axis.dim == 0:
                    out.append(((cs + x0 - ls, c0), (x0, x1 - x0, c0, nc)))
                else:
                    out.append(((r0, cs + x0 - ls), (r0, nr, x0, x1 - x0)))
        return out

    def pieces(self, flat: Tensor, a: int, b: int) -> list[tuple[tuple[int, ...], Tensor]]:
        """The boxes of elements ``[a, b)`` as (canonical offset, view of ``flat``), where
        ``flat`` holds exactly those elements (a 1-D tensor of ``b - a``)."""
        C = self.local[1]
        out = []
        for (orow, ocol), (r0, nr, c0, nc) in self.boxes(a, b):
            start = r0 * C - a
            if nr == 1:
                t = flat[start + c0:start + c0 + nc].view(1, nc)
            else:
                t = flat[start:start + nr * C].view(nr, C)[:, c0:c0 + nc]
            if len(self.logical) == 1:  # a vector: the 2-D view's one column
                out.append(((orow,), t.reshape(-1)))
            else:
                out.append(((orow, ocol), t))
        return out


def logical_key_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a parameter's logical tensor has in a checkpoint: 1-D stays 1-D, 0-D is (1,),
    more dims are viewed as 2-D."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 1:
        return shape or (1,)
    return view_2d(shape)


class RankLayout:
    """Per parameter, this rank's view of it in the canonical tensor (and, for TP-gathered
    tasks, every TP rank's), and what this rank writes."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.tp, self.tp_rank, self.dp_rank = opt._tp, opt._tp_rank, opt._rank
        self.logical = {n: s for n, s, _ in plan_params(opt.plan)}
        # expert TP 1 under tp > 1: this rank's experts are whole here, no TP rank shares them
        self.whole = opt._expert_names if opt._experts.whole else set()
        # a pipeline's last stage: the tied embedding's copy is the embedding's keys (the first
        # stage writes them; the copy reads them, so any pipeline size loads any other's)
        alias = opt._stage.checkpoint_aliases()
        self.copies = {i for i, n in enumerate(opt._names) if n in alias}
        self.views: list[ParamView] = []
        for i, (name, live, local) in enumerate(zip(opt._names, opt._live, opt._params)):
            shape = self.logical.get(name, tuple(live.shape))
            self.views.append(ParamView(alias.get(name, name), logical_key_shape(shape),
                                        view_2d(local.shape), self.axis(i, self.tp_rank)))

    def axis(self, i: int, rank: int) -> Axis:
        name = self.opt._names[i]
        if name in self.whole:
            return Axis(None)
        return axis_of(self.opt._live[i], self.logical.get(name, tuple(self.opt._live[i].shape)),
                       self.tp, rank)

    def first_holder(self, i: int) -> bool:
        """This rank is the first of the group parameter i is sharded over (DP rank 0, or for an
        expert the first of its expert-DP group): it writes the weights of its shard."""
        s = self.opt._schedule
        return s.buckets[s.param_bucket[i]].rank == 0

    def writes(self, i: int) -> bool:
        """This TP rank writes parameter i's pieces (TP rank 0 for what TP replicates; every
        TP rank its own whole experts; none for a tied embedding's copy)."""
        if i in self.copies:
            return False
        return (self.views[i].axis.dim is not None or self.tp_rank == 0
                or self.views[i].name in self.whole)

    def own(self, i: int) -> tuple[int, int, int]:
        """(bucket, a, z): parameter i's elements [a, z) of its local shard in this rank's own
        slice (a == z: none)."""
        s = self.opt._schedule
        b = s.param_bucket[i]
        lo, hi = s.param_range[i]
        c0, c1 = s.own_range(b)
        a, z = max(lo, c0), min(hi, c1)
        return b, a - lo, max(a, z) - lo

    def task_rows(self, t: Any) -> Tensor:
        """Canonical rows (of the parameter's 2-D view) of a matrix task's rows."""
        if hasattr(t, "segments"):  # a TP-gathered task: rows from every TP rank's shard
            rows = []
            if t.dim != 0:  # a row-parallel matrix: the rows are not split
                off = t.segments[0][1] if t.dim is None else 0
                return torch.arange(off, off + t.full_shape[0])
            for r, ls, _, n in t.segments:
                ax = self.axis(t.param, r)
                if ax.dim is None:
                    rows.append(torch.arange(ls, ls + n))
                    continue
                covered = 0
                for bs, bn, cs in ax.blocks:  # the segment's rows, block by block
                    x0, x1 = max(ls, bs), min(ls + n, bs + bn)
                    if x0 < x1:
                        rows.append(torch.arange(cs + x0 - bs, cs + x1 - bs))
                        covered += x1 - x0
                if covered != n:
                    raise CheckpointError(f"'{t.name}': rows of TP rank {r}'s shard are padding "
                                          "in the plan's layout; the plan is inconsistent.")
            return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        ax = self.views[t.param].axis
        if ax.dim is None:
            return torch.arange(t.row0, t.row0 + t.shape[0])
        # a head of a fused QKV split per head: rows of this rank's own shard
        rows = [torch.arange(cs + x0 - bs, cs + x1 - bs) for bs, bn, cs in ax.blocks
                if (x0 := max(t.row0, bs)) < (x1 := min(t.row0 + t.shape[0], bs + bn))]
        if ax.dim != 0 or sum(len(r) for r in rows) != t.shape[0]:
            raise CheckpointError(f"'{t.name}' is a TP shard updated without its TP group; the "
                                  "plan is inconsistent.")
        return torch.cat(rows)

    def matrix_tasks(self) -> list[tuple[Any, dict[str, Tensor], bool]]:
        """(task, its state, this rank writes it) of every task whose state this rank holds
        (whole matrices: TP rank 0, as every TP rank of the owner holds the same state, but for
        this rank's own whole experts)."""
        opt = self.opt
        out = []
        for ts in opt._schedule.mine.matrix:
            for t in ts:  # a head of a TP shard (split per head): its TP rank's alone
                out.append((t, task_state(t, opt._params, opt.state),
                            self.tp_rank == 0 or self.views[t.param].name in self.whole
                            or self.views[t.param].axis.dim is not None))
        for t in opt._micro.hosted:
            st = opt.state[opt._params[t.param]]
            out.append((t, st if t.part is None else st[t.part], True))
        return out
