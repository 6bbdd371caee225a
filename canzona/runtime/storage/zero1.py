"""ZeRO-1 buckets, the first :class:`~canzona.runtime.storage.base.Storage`: the plan's flat
buckets over the DP group (Megatron's layout, or canzona's own order where the plan reorders).

Every rank holds every bucket's parameters (the live parameters are views of them) and gradient
accumulator, and its own slice ``[cuts[r], cuts[r+1])`` of each: the reduce-scatter brings it
the averaged gradient of exactly that slice, the all-gather returns the updated slice to every
rank. Its parts: ``buffers`` (the flat tensors), ``gradients`` (hooks, completion in bucket
order, ``no_sync``), ``collectives`` (one object per bucket with its method and scratch).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from canzona.runtime.schedule import Schedule
from canzona.runtime.storage.base import Storage
from canzona.runtime.storage.buffers import build_buffers
from canzona.runtime.storage.collectives import BucketCollective, make_collective
from canzona.runtime.storage.gradients import GradientCollector, held_back_message

__all__ = ["Zero1Buckets"]


class Zero1Buckets(Storage):
    """The plan's ZeRO-1 buckets on this rank (see the module docstring).

    Args:
        schedule: the plan as frozen records (``runtime.schedule``): buckets, slots, cuts.
        params: the tensors canzona works on, in plan order (a DTensor's local shard); they
            become views of the parameter buffers.
        live: the model's parameters (hooks and ``.grad``), in the same order.
        names: their names, for messages.
        rank, size: this rank's place in the DP group and its size.
        group: the DP group (None: the default group).
        expert_group, expert_rank, expert_size: the expert-DP group that expert buckets are
            sharded over (``runtime.experts``), this rank's place in it and its size; their
            summed gradients are divided by the DP size ``size``.
        external: ``grad_sync="external"``: gradients arrive averaged in ``.grad``; no
            accumulator, no reduction.
        main_params: ``"fp32"``: fp32 main copies of this rank's slices of low-precision buckets.
        method: every bucket's collective method instead of the plan's (at dp = 1 it runs over
            the one-rank group when ``distributed``).
        distributed: a process group is in use.
        timeout_s, flight: each collective's wait limit and the in-flight recorder (or None).
    """

    def __init__(self, schedule: Schedule, params: list[Tensor], live: list[Tensor],
                 names: list[str], *, rank: int, size: int, group: Any, external: bool,
                 main_params: str | None, method: str | None, distributed: bool,
                 timeout_s: float | None, flight: Any, expert_group: Any = None,
                 expert_rank: int = 0, expert_size: int = 1) -> None:
        self._schedule = schedule
        self.rank, self.size, self.group = rank, size, group
        self.expert_group = expert_group
        self.external = external
        self.buffers = build_buffers(schedule, params, names, external=external,
                                     main_params=main_params)
        self.collectives: list[BucketCollective] = []
        for b, buf in zip(schedule.buckets, self.buffers):
            place, n = (expert_rank, expert_size) if b.expert else (rank, size)
            c = make_collective(b, place, n, buf, reduce=not external, method=method,
                                distributed=distributed)
            c.timeout_s, c.flight, c.average_over = timeout_s, flight, size
            self.collectives.append(c)
        self.grads = GradientCollector(schedule, live, names, self.buffers)

    # -- gradients ---------------------------------------------------------------------------------

    def collect(self, i: int, p: Tensor) -> None:
        if self.grads.accumulate(i, p):
            self._launch_ready()

    def _launch_ready(self) -> None:
        for bi in self.grads.take_ready():
            self.collectives[bi].launch_reduce(self._group_of(bi))

    def _group_of(self, bucket: int) -> Any:
        """The group bucket ``bucket`` is sharded over: the DP group, or the expert-DP group."""
        return self.expert_group if self._schedule.buckets[bucket].expert else self.group

    def defer(self, buckets: set[int], before: Any) -> None:
        """Reduce ``buckets`` only at ``step()``, after ``before()`` (called with no argument)
        has worked on their accumulated gradients: the tied embedding's buckets of a
        pipeline's end stages (``runtime.stages``), whose gradients the two ends sum first."""
        self.grads.deferred = frozenset(buckets)
        self._before_deferred = before

    def reduce(self) -> None:
        self.grads.complete_all()
        self._launch_ready()
        deferred = self.grads.take_deferred()
        if deferred:
            self._before_deferred()
            for bi in deferred:
                self.collectives[bi].launch_reduce(self._group_of(bi))
        for c in self.collectives:
            c.finish_reduce()

    def read_external(self) -> None:
        self.grads.read_external()

    def held_back(self) -> str | None:
        if self.size == 1:
            return None
        held = self.grads.held_back()
        return None if held is None else held_back_message(self._schedule, self.buffers, *held)

    def reset(self) -> None:
        for buf in self.buffers:
            buf.grads.zero_()
        self.grads.reset()

    def discard(self) -> None:
        for c in self.collectives:
            c.wait_reduce()
        self.reset()

    # -- parameters ------------------------------------------------------------------------------

    def gather(self, bucket: int) -> None:
        self.collectives[bucket].launch_gather(self._group_of(bucket))

    def wait_gathers(self) -> None:
        for c in self.collectives:
            c.finish_gather()

    # -- shutdown and reporting ------------------------------------------------------------------

    def finish(self) -> None:
        self.wait_gathers()
        for c in self.collectives:
            c.wait_reduce()  # the reduced slice is unpacked by the next finish_reduce

    def release(self) -> None:
        for c in self.collectives:
            c.drop()
        self.group = self.expert_group = None  # explicit groups are no longer kept alive here

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(c.method for c in self.collectives)
