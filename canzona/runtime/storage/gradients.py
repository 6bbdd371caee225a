"""Gradient collection between two steps: which parameters reported, which buckets are complete
and may be reduced (strictly in bucket order, so every rank issues the same sequence of
collectives), gradient accumulation under ``no_sync``, ``grad_sync="external"``, and clipping.

A bucket is complete when every parameter of it that requires a gradient has reported through
its post-accumulate-grad hook. Buckets launch in order: one parameter that never receives a
gradient (unused in the forward) keeps its bucket, and every later one, from launching during
backward; they launch at ``step()``, after backward, and the overlap is lost
(:meth:`GradientCollector.held_back` names it, the optimizer warns once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.introspect import local_grad
from canzona.runtime.schedule import Schedule
from canzona.runtime.storage.buffers import BucketBuffers


class GradientCollector:
    """This rank's gradient bookkeeping for one iteration (reset by every step and zero_grad).

    Attributes:
        sync: False inside ``no_sync()``: gradients accumulate, nothing is counted or launched.
        launched: per bucket, its reduce-scatter was launched (or, dp = 1, its copy made).
        received: per parameter, 1 if a gradient reached this rank's buffers (int32 on the CPU,
            all-reduced with MAX so that every rank skips the same parameters).
        received_anywhere: ``received`` after that all-reduce (``reduced`` is then True).
    """

    def __init__(self, schedule: Schedule, params: list[Tensor], names: list[str],
                 buffers: list[BucketBuffers]) -> None:
        self._schedule = schedule
        self._params = params
        self._names = names
        self._buffers = buffers
        self.sync = True
        #: Buckets reduced only at ``step()`` (``Zero1Buckets.defer``): the others launch in
        #: order without them.
        self.deferred: frozenset[int] = frozenset()
        self.reset()

    def reset(self) -> None:
        """Start a new iteration (the buffers are zeroed by the caller)."""
        nb = len(self._schedule.buckets)
        self.expected = [sum(1 for sl in b.slots if self._params[sl.param].requires_grad)
                         for b in self._schedule.buckets]
        self.reported = [0] * nb  # per bucket, parameters counted towards completion
        self.counted = [False] * len(self._params)
        self.received = torch.zeros(len(self._params), dtype=torch.int32)
        self.launched = [False] * nb
        self.next_bucket = 0  # the first bucket not launched yet
        self.accumulated = False  # a gradient hook ran since the reset
        self.reduced = False
        self.received_anywhere: list[int] = []

    @property
    def pending(self) -> bool:
        """Something was collected or launched since the reset."""
        return self.accumulated or self.reduced or self.next_bucket > 0

    def accumulate(self, i: int, p: Tensor) -> bool:
        """The post-accumulate-grad hook of parameter ``i``: add ``p.grad`` to its bucket and
        drop it. True when the bucket may have become complete (the caller launches
        :meth:`take_ready`)."""
        bi = self._schedule.param_bucket[i]
        if self.launched[bi]:
            raise RuntimeError(
                f"the gradient of '{self._names[i]}' arrived after its bucket was reduced; run "
                "all but the last backward of an accumulation under opt.no_sync().")
        g = local_grad(p)
        if g is not None:
            lo, hi = self._schedule.param_range[i]
            self._buffers[bi].grads[lo:hi].add_(g.reshape(-1))
            p.grad = None
            self.received[i] = 1
        self.accumulated = True
        if self.sync and not self.counted[i]:
            self.counted[i] = True
            self.reported[bi] += 1
            return self.reported[bi] == self.expected[bi]
        return False

    def take_ready(self) -> list[int]:
        """The complete buckets from ``next_bucket`` on, in order, passing over the deferred
        ones (every rank passes over the same); they count as launched."""
        out = []
        nb = len(self._schedule.buckets)
        while self.next_bucket < nb:
            b = self.next_bucket
            if b not in self.deferred:
                if self.reported[b] < self.expected[b]:
                    break
                out.append(b)
                self.launched[b] = True
            self.next_bucket += 1
        return out

    def take_deferred(self) -> list[int]:
        """The deferred buckets, in order (at ``step()``, once every bucket is complete); they
        count as launched."""
        out = [b for b in sorted(self.deferred) if not self.launched[b]]
        for b in out:
            self.launched[b] = True
        return out

    def complete_all(self) -> None:
        """Count every bucket complete (the step launches what backward did not)."""
        self.reported = [max(c, e) for c, e in zip(self.reported, self.expected)]

    def held_back(self) -> tuple[int, str] | None:
        """(bucket, parameter) when backward reported in sync mode but a parameter that requires
        a gradient never did, keeping its bucket and all later ones from launching; else None."""
        if not any(self.counted) or self.next_bucket >= len(self._schedule.buckets):
            return None
        bi = self.next_bucket
        for sl in self._schedule.buckets[bi].slots:
            if self._params[sl.param].requires_grad and not self.counted[sl.param]:
                return bi, self._names[sl.param]
        return None

    def read_external(self) -> None:
        """``grad_sync="external"``: copy this rank's slices of the (already averaged) ``.grad``
        into the buckets' ``own`` buffers."""
        s = self._schedule
        for bi, b in enumerate(s.buckets):
            own = self._buffers[bi].own
            c0, c1 = s.own_range(bi)
            own.zero_()
            for sl in b.slots:
                p = self._params[sl.param]
                a, z = max(sl.lo, c0), min(sl.hi, c1)
                g = local_grad(p)
                if g is not None:
                    self.received[sl.param] = 1
                    if a < z:
                        own[a - c0:z - c0].copy_(g.reshape(-1)[a - sl.lo:z - sl.lo])


def held_back_message(schedule: Schedule, buffers: Sequence[BucketBuffers], bucket: int,
                      name: str) -> str:
    """What :meth:`GradientCollector.held_back` costs, and how to avoid it, in one line."""
    later = schedule.buckets[bucket:]
    mib = sum(b.numel * buffers[b.index].grads.element_size() for b in later) / 2**20
    return (f"'{name}' received no gradient, so its bucket {bucket} and every later one "
            f"({len(later)} of {len(schedule.buckets)} buckets, {mib:.1f} MiB of gradients) were "
            "reduce-scattered at step() instead of during backward (buckets launch in order); "
            "freeze it (requires_grad_(False)) or remove it before building the optimizer to "
            "keep the overlap.")


@torch.no_grad()
def clip_owned(owns: Sequence[Tensor], max_norm: float, norm_type: float, *, dp: int,
               group: object, tp: int = 1, tp_group: object = None,
               duplicates: Sequence[Sequence[tuple[int, int]]] = (),
               excluded: Sequence[Sequence[tuple[int, int]]] = (), pp: int = 1,
               pp_group: object = None) -> Tensor:
    """Clip the averaged gradient slices by their global norm; each rank takes the norm of the
    slices it owns (every element lies in exactly one slice of its TP rank), all-reduces combine
    them over DP (and TP). Returns the total norm before clipping. ``norm_type``: 2.0 or inf
    (checked by the caller, before the reduction).

    Under TP (``tp > 1``) every TP rank owns the same slices of its own shards; ``duplicates[b]``
    lists the ranges of bucket b's own slice that hold parameters replicated over TP (identical
    on every TP rank): they count 1/tp on each, so every element counts once (Megatron counts
    them on TP rank 0 only).

    Under pipeline parallelism (``pp > 1``) the stages' norms combine over ``pp_group``;
    ``excluded[b]`` lists ranges of bucket b's own slice that do not count (a tied weight's copy
    on the last stage: the first stage counts it; with the inf norm the copy's equal gradient
    changes no maximum)."""
    device = owns[0].device if owns else torch.device("cpu")
    if norm_type == 2.0:
        parts = [o.float().pow(2).sum() for o in owns]
        if tp > 1:
            for o, ranges in zip(owns, duplicates):
                for lo, hi in ranges:
                    parts.append(o[lo:hi].float().pow(2).sum() * (1.0 / tp - 1.0))
        for o, ranges in zip(owns, excluded):
            for lo, hi in ranges:
                parts.append(-o[lo:hi].float().pow(2).sum())
        total = torch.stack(parts).sum() if parts else torch.zeros((), device=device)
        op = dist.ReduceOp.SUM if dist.is_available() else None
    else:
        parts = [o.abs().max() if o.numel() else torch.zeros((), device=device) for o in owns]
        total = torch.stack(parts).max().float() if parts else torch.zeros((), device=device)
        op = dist.ReduceOp.MAX
    if dp > 1:
        dist.all_reduce(total, op=op, group=group)
    if tp > 1:
        dist.all_reduce(total, op=op, group=tp_group)
    if pp > 1:
        dist.all_reduce(total, op=op, group=pp_group)
    if norm_type == 2.0:
        total = total.clamp(min=0).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for o in owns:
        o.mul_(coef.to(o.dtype))
    return total
