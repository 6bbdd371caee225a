"""Logical tensors: where the pieces a rank holds sit in the plan-independent (canonical) tensors,
and the ``torch.distributed.checkpoint`` objects that save and load them.

The canonical tensor of a parameter is the one the single-device model holds (Megatron at tp 1):
TP shards concatenated along the partition dim, each rank's shard taken as ``partition_stride``
sub-blocks (fc1's [gate_r; up_r] → [gate; up]), the vocabulary's TP padding left out. Tensors of
more than two dims are viewed as 2-D (leading dims flattened): a stacked expert tensor [E, m, n]
is the canonical [E·m, n] (its tasks are row blocks of it). A rank's piece of a parameter — an
element range of its local shard (ZeRO-1 slices cut flat buffers), or a whole shard — is at most
three rectangles of the local 2-D view (a partial row, whole rows, a partial row), each split at
the shard's sub-block boundaries into boxes of the canonical tensor. DCP stores every box as a
chunk of one logical tensor and reads any other set of boxes back (its resharding): that is how
a checkpoint saved under one plan loads under another.

``Pieces`` implements DCP's write-item protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) for a set of boxes, which DTensor placements
cannot express (element ranges are not boxes of the 2-D tensor); ``SavePlanner``/``LoadPlanner``
find its boxes by offset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["Axis", "LoadPlanner", "ParamView", "Pieces", "SavePlanner", "axis_of", "view_2d"]

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
    from canzona.runtime.introspect import _is_dtensor, local_tensor

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


class Pieces:
    """Boxes of one logical tensor held by this rank, for DCP (save: their data; load: views
    that DCP fills in place)."""

    def __init__(self, size: Sequence[int], boxes: Sequence[tuple[Sequence[int], Tensor]]) -> None:
        self._size = torch.Size(size)
        self.boxes = [(torch.Size(o), t) for o, t in boxes]
        for o, t in self.boxes:
            if len(o) != len(self._size) or t.dim() != len(self._size) or any(
                    x < 0 or x + n > s for x, n, s in zip(o, t.shape, self._size)):
                raise ValueError(f"box at {tuple(o)} of shape {tuple(t.shape)} is outside the "
                                 f"logical tensor {tuple(self._size)}")

    def size(self) -> torch.Size:
        return self._size

    @property
    def dtype(self) -> torch.dtype:
        return self.boxes[0][1].dtype

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self._size))
                for o, t in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for o, t in self.boxes:
            if o == index.offset:
                return t
        raise ValueError(f"no box at {index.offset} of '{index.fqn}'")


def _find(state_dict: dict[str, Any], index: MetadataIndex, fallback: Any) -> Any:
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else fallback(index)


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, finding :class:`Pieces` boxes by offset."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _find(self.state_dict, index, super().lookup_object)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading into :class:`Pieces` boxes (views of the live tensors)."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.state_dict.update(pieces)  # the default planner's tensor walk drops unknown objects

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        return _find(self.state_dict, index, super().lookup_tensor)
