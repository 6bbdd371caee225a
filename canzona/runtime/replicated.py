"""Parameters replicated over TP (tp > 1) in this rank's own slices: the ranges whose gradient
each TP rank holds only in part (parameters marked ``sequence_parallel``, or named by
``tp_sum_grads``), summed over the TP group before the update, and the ranges every TP rank holds
identically, which clipping counts once."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.introspect import is_tp_split
from canzona.runtime.schedule import Schedule
from canzona.runtime.storage.buffers import BucketBuffers


def partial_grad_ranges(schedule: Schedule, names: list[str], live: list[Tensor],
                        sum_globs: Sequence[str]) -> list[tuple[int, int, int]]:
    """(bucket, lo, hi) of this rank's own slices holding parameters marked
    ``sequence_parallel`` or named by ``sum_globs`` (replicated over TP, gradients partial per
    TP rank)."""
    out = []
    for b in schedule.buckets:
        c0, c1 = schedule.own_range(b.index)
        for sl in b.slots:
            name = names[sl.param]
            if (getattr(live[sl.param], "sequence_parallel", False)
                    or any(fnmatch.fnmatchcase(name, g) for g in sum_globs)):
                lo, hi = max(sl.lo, c0), min(sl.hi, c1)
                if lo < hi:
                    out.append((b.index, lo - c0, hi - c0))
    return out


def duplicate_ranges(schedule: Schedule, live: list[Tensor], tp_split: Iterable[int], *,
                     whole_experts: bool = False) -> list[list[tuple[int, int]]]:
    """Per bucket, the ranges of this rank's own slice holding parameters replicated over TP:
    neither a TP-split matrix of the plan (``tp_split``: the micro-groups' parameters) nor a TP
    shard (Megatron's ``tensor_model_parallel``, a sharded DTensor), nor, with
    ``whole_experts`` (expert TP 1), an expert bucket's: each TP rank holds other experts."""
    split = set(tp_split)
    split |= {x.param for order in schedule.work for xs in order.split for x in xs}
    out = []
    for b in schedule.buckets:
        c0, c1 = schedule.own_range(b.index)
        ranges: list[tuple[int, int]] = []
        out.append(ranges)
        if whole_experts and b.expert:
            continue
        for sl in b.slots:
            if sl.param in split or is_tp_split(live[sl.param]):
                continue
            lo, hi = max(sl.lo, c0), min(sl.hi, c1)
            if lo < hi:
                ranges.append((lo - c0, hi - c0))
    return out


def sum_partial_grads(buffers: Sequence[BucketBuffers], ranges: Sequence[tuple[int, int, int]],
                      tp_group: object) -> None:
    """Sequence parallelism (tp > 1): each TP rank's gradient of a parameter marked
    ``sequence_parallel`` (Megatron's norms) covers its part of the sequence only; sum them
    over the TP group, as Megatron does, in one all-reduce of this rank's own slices."""
    if not ranges:
        return
    pieces = [buffers[b].own[lo:hi] for b, lo, hi in ranges]
    flat = torch.cat(pieces)
    dist.all_reduce(flat, group=tp_group)
    k = 0
    for piece in pieces:
        piece.copy_(flat[k:k + piece.numel()])
        k += piece.numel()
