"""One object per bucket that owns the bucket's collective method and its scratch buffers.

A bucket's reduce-scatter and all-gather have variable slice sizes, which no stock primitive
takes. The plan fixes the method per bucket (the fastest under the planner's
communication model, ``canzona.planner.comm``, which counts each method's bytes and time)::

    equal       reduce_scatter_tensor / all_gather_into_tensor on the buffers themselves
    padded      the same calls on slices padded to the largest (R·max elements); the reduce
                packs the slices into ``R·max`` scratch, the gather unpacks from it
    all_to_all  all_to_all_single with split sizes; reduce: every rank sends rank r its slice r
                and r sums the R copies it received; gather: the own slice sent to every rank,
                received straight into the parameter buffer
    per_root    one reduce to each owner of its slice and one broadcast from it (NCCL has no
                ReduceScatterV/AllGatherV); owners with an empty slice are skipped by every rank
    all_reduce  the reduce: one all-reduce of the whole bucket, each rank keeps its slice; the
                gather: per root, as per_root
    local       dp = 1: the reduce is a copy, the gather nothing

``per_root`` calls are issued per backend: on NCCL inside ``_coalescing_manager`` (one fused
launch; ``benchmarks/gpu_check.py`` runs it at one rank), on gloo as async calls, one handle each.

Every call is asynchronous (``async_op=True``) and works on gloo and NCCL. Scratch is allocated
once at construction and reused: a bucket's next launch always follows the wait of its previous
one (the step waits for the reduces before it gathers and for the gathers before it reduces
again), which is also what makes reuse safe on CUDA, where ``work.wait()`` orders the current
stream after the communication stream. The process group is an argument of every launch, never
kept here (``None`` is the default group, looked up by each call; see ``CanzonaOptimizer``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from canzona.planner import comm
from canzona.runtime.schedule import Bucket
from canzona.runtime.storage.buffers import BucketBuffers
from canzona.runtime.waits import CoalescedWork, Works, wait_for

__all__ = ["METHODS", "BucketCollective", "make_collective"]

# torch ≥ 2.10 renamed the tensor collectives (the old names warn).
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class BucketCollective:
    """A bucket's reduce-scatter (grads → this rank's averaged slice ``buffers.own``) and
    all-gather (this rank's updated slice → everyone's parameter buffer), each launched
    asynchronously and finished later. Subclasses implement one method."""

    method = ""

    def __init__(self, bucket: Bucket, rank: int, dp: int, buffers: BucketBuffers, *,
                 reduce: bool) -> None:
        self.bucket = bucket
        self.rank = rank
        self.dp = dp
        #: what the summed gradient is divided by: the group's size, or for an expert bucket
        #: the DP size (the expert-DP sum of gradients that each cover an EP group's tokens)
        self.average_over = dp
        self.buffers = buffers
        self.reduces = reduce  # False under grad_sync="external": no reduce scratch
        self.reduce_work: Any = None
        self.gather_work: Any = None
        #: seconds a wait may take before CollectiveTimeoutError (None: the group's own timeout)
        self.timeout_s: float | None = None
        #: ``runtime.flight.FlightRecorder`` (CanzonaOptimizer(flight_record=)) or None
        self.flight: Any = None

    def _what(self, kind: str) -> str:
        """How messages and the flight record name this bucket's ``kind`` collective."""
        return f"the {kind} of bucket {self.bucket.index} ({type(self).__name__})"

    @property
    def gathering(self) -> bool:
        """An all-gather was launched and not finished yet."""
        return self.gather_work is not None

    # -- reduce-scatter ----------------------------------------------------------------------------

    def launch_reduce(self, group: Any) -> None:
        self.reduce_work = self._start_reduce(group)
        if self.flight is not None:
            self.flight.add(self._what("reduce"), self.reduce_work)

    def wait_reduce(self) -> None:
        """Wait for a running reduce-scatter; its result stays in scratch for
        :meth:`finish_reduce`."""
        if self.reduce_work is not None:
            wait_for(self.reduce_work, self._what("reduce"), self.timeout_s, self.rank)
            self.reduce_work = None

    def finish_reduce(self) -> None:
        """Wait, then leave the averaged gradient of this rank's slice in ``buffers.own``."""
        self.wait_reduce()
        self._unpack_reduce()
        if self.average_over > 1:
            self.buffers.own.div_(self.average_over)

    # -- all-gather --------------------------------------------------------------------------------

    def launch_gather(self, group: Any) -> None:
        self.gather_work = self._start_gather(group)
        if self.flight is not None:
            self.flight.add(self._what("all-gather"), self.gather_work)

    def finish_gather(self) -> None:
        """Wait, then every rank's slice is in ``buffers.params``."""
        if self.gather_work is not None:
            wait_for(self.gather_work, self._what("all-gather"), self.timeout_s, self.rank)
            self.gather_work = None
            self._unpack_gather()

    def drop(self) -> None:
        """Forget the handles (after a failure, or once the group is released)."""
        self.reduce_work = self.gather_work = None

    # -- one method --------------------------------------------------------------------------------

    def _start_reduce(self, group: Any) -> Any:
        raise NotImplementedError

    def _unpack_reduce(self) -> None:
        pass

    def _start_gather(self, group: Any) -> Any:
        raise NotImplementedError

    def _unpack_gather(self) -> None:
        pass


class LocalCollective(BucketCollective):
    """dp = 1: this rank's slice is the whole bucket."""

    method = "local"

    def _start_reduce(self, group: Any) -> Any:
        self.buffers.own.copy_(self.buffers.grads)
        return None

    def _start_gather(self, group: Any) -> Any:
        return None


class EqualCollective(BucketCollective):
    """Equal slices: the stock collectives on the buffers themselves."""

    method = comm.EQUAL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        own = self.buffers.own_params
        self._send = torch.empty_like(own)  # the gather's input may not alias its output

    def _start_reduce(self, group: Any) -> Any:
        b = self.buffers
        return _reduce_scatter(b.own, b.grads, group=group, async_op=True)

    def _start_gather(self, group: Any) -> Any:
        self._send.copy_(self.buffers.own_params)
        return _all_gather(self.buffers.params, self._send, group=group, async_op=True)


class PaddedCollective(BucketCollective):
    """Nearly equal slices: the stock collectives on slices padded to the largest."""

    method = comm.PADDED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        b, R = self.buffers, self.dp
        big = max(self.bucket.sizes)
        self._big = big
        # Padding stays zero: only the first sizes[r] elements of each block are ever written.
        self._reduce_in = (torch.zeros(R * big, dtype=b.grads.dtype, device=b.grads.device)
                           if self.reduces else None)
        self._reduce_out = (torch.empty(big, dtype=b.grads.dtype, device=b.grads.device)
                            if self.reduces else None)
        self._gather_in = torch.zeros(big, dtype=b.params.dtype, device=b.params.device)
        self._gather_out = torch.empty(R * big, dtype=b.params.dtype, device=b.params.device)

    def _start_reduce(self, group: Any) -> Any:
        g, cuts, big = self.buffers.grads, self.bucket.cuts, self._big
        for r, n in enumerate(self.bucket.sizes):
            self._reduce_in[r * big:r * big + n].copy_(g[cuts[r]:cuts[r + 1]])
        return _reduce_scatter(self._reduce_out, self._reduce_in, group=group, async_op=True)

    def _unpack_reduce(self) -> None:
        own = self.buffers.own
        own.copy_(self._reduce_out[:own.numel()])

    def _start_gather(self, group: Any) -> Any:
        own = self.buffers.own_params
        self._gather_in[:own.numel()].copy_(own)
        return _all_gather(self._gather_out, self._gather_in, group=group, async_op=True)

    def _unpack_gather(self) -> None:
        params, cuts, big = self.buffers.params, self.bucket.cuts, self._big
        for r, n in enumerate(self.bucket.sizes):
            if r != self.rank:
                params[cuts[r]:cuts[r] + n].copy_(self._gather_out[r * big:r * big + n])


class AllToAllCollective(BucketCollective):
    """Unequal slices: ``all_to_all_single`` with the exact split sizes."""

    method = comm.ALL_TO_ALL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        b, R = self.buffers, self.dp
        n = self.bucket.sizes[self.rank]
        # reduce: the R copies of this rank's slice, one from every rank, summed on arrival
        self._received = (torch.empty(R * n, dtype=b.grads.dtype, device=b.grads.device)
                          if self.reduces else None)
        # gather: this rank's slice once for every rank
        self._send = torch.empty(R * n, dtype=b.params.dtype, device=b.params.device)

    def _start_reduce(self, group: Any) -> Any:
        n = self.bucket.sizes[self.rank]
        return dist.all_to_all_single(self._received, self.buffers.grads,
                                      output_split_sizes=[n] * self.dp,
                                      input_split_sizes=list(self.bucket.sizes), group=group,
                                      async_op=True)

    def _unpack_reduce(self) -> None:
        n = self.bucket.sizes[self.rank]
        torch.sum(self._received.view(self.dp, n), dim=0, out=self.buffers.own)

    def _start_gather(self, group: Any) -> Any:
        n = self.bucket.sizes[self.rank]
        self._send.view(self.dp, n).copy_(self.buffers.own_params.expand(self.dp, n))
        return dist.all_to_all_single(self.buffers.params, self._send,
                                      output_split_sizes=list(self.bucket.sizes),
                                      input_split_sizes=[n] * self.dp, group=group,
                                      async_op=True)


def _per_root(group: Any, device: torch.device, calls: list) -> Any:
    """Issue ``calls`` (functions taking ``async_op``) as one unit: coalesced on NCCL, async
    handles on gloo (its coalescing manager runs the calls synchronously)."""
    if device.type == "cuda" and dist.get_backend(group) == "nccl":
        with dist._coalescing_manager(group, device=device, async_ops=True) as cm:
            for call in calls:
                call(async_op=True)
        return CoalescedWork(cm)
    return Works([call(async_op=True) for call in calls])


class PerRootCollective(BucketCollective):
    """Unequal slices: one reduce to, and one broadcast from, every owner of a non-empty slice."""

    method = comm.PER_ROOT

    def _owners(self) -> list[int]:
        return [r for r, n in enumerate(self.bucket.sizes) if n > 0]

    def _start_reduce(self, group: Any) -> Any:
        g, cuts = self.buffers.grads, self.bucket.cuts
        calls = [lambda async_op, r=r: dist.reduce(g[cuts[r]:cuts[r + 1]], group=group,
                                                   group_dst=r, async_op=async_op)
                 for r in self._owners()]
        return _per_root(group, g.device, calls)

    def _unpack_reduce(self) -> None:
        c = self.bucket.cuts
        self.buffers.own.copy_(self.buffers.grads[c[self.rank]:c[self.rank + 1]])

    def _start_gather(self, group: Any) -> Any:
        p, cuts = self.buffers.params, self.bucket.cuts
        calls = [lambda async_op, r=r: dist.broadcast(p[cuts[r]:cuts[r + 1]], group=group,
                                                      group_src=r, async_op=async_op)
                 for r in self._owners()]
        return _per_root(group, p.device, calls)


class AllReduceCollective(PerRootCollective):
    """The reduce as one all-reduce of the whole bucket (each rank keeps its slice); the gather
    per root."""

    method = comm.ALL_REDUCE

    def _start_reduce(self, group: Any) -> Any:
        return dist.all_reduce(self.buffers.grads, group=group, async_op=True)


#: Every method (``canzona.planner.comm.METHODS``, their one spelling), by its name in plans and
#: in ``CanzonaOptimizer(collective=...)``.
METHODS = comm.METHODS
_METHODS = {c.method: c for c in (EqualCollective, PaddedCollective, PerRootCollective,
                                  AllReduceCollective, AllToAllCollective)}


def make_collective(bucket: Bucket, rank: int, dp: int, buffers: BucketBuffers, *,
                    reduce: bool, method: str | None = None,
                    distributed: bool = True) -> BucketCollective:
    """The bucket's collective object: ``method`` if given (``equal`` only for equal slices),
    else the schedule's. At dp = 1 ``local`` (a copy), unless ``method`` is named and a process
    group exists (``distributed``): the named method then runs over the one-rank group, which
    is how one device exercises a collective path (``benchmarks/gpu_check.py``)."""
    name = method or bucket.method
    if name not in _METHODS:
        raise ValueError(f"collective = {method!r} is not a method; choose one of: "
                         f"{', '.join(METHODS)}")
    if name == comm.EQUAL and len(set(bucket.sizes)) > 1:
        raise ValueError(f"collective = '{comm.EQUAL}' cannot move bucket {bucket.index}'s "
                         f"unequal slices {list(bucket.sizes)}; choose one of: "
                         f"{', '.join(m for m in METHODS if m != comm.EQUAL)}")
    one_rank = dp == 1 and (method is None or not distributed)
    cls = LocalCollective if one_rank else _METHODS[name]
    return cls(bucket, rank, dp, buffers, reduce=reduce)
