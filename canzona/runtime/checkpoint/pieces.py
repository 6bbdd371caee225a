"""The boxes of logical tensors a rank saves or loads, as ``torch.distributed.checkpoint`` (DCP)
sees them.

DCP stores every box (:mod:`canzona.runtime.checkpoint.mapping`) as a chunk of one logical tensor
and reads any other set of boxes back (its resharding): that is how a checkpoint saved under one
plan loads under another. :class:`Pieces` implements DCP's write-item protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``) for a set of
boxes, which DTensor placements cannot express (element ranges are not boxes of the 2-D tensor);
:class:`SavePlanner` / :class:`LoadPlanner` find its boxes by offset.
"""

from __future__ import annotations

from collections.abc import Sequence
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

__all__ = ["LoadPlanner", "Pieces", "SavePlanner"]


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
