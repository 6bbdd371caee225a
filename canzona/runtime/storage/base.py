"""The storage seam: where a parameter's bytes and gradient live, how gradients reach the ranks
that update them and updated parameters return to every rank, and over which process group.

The plan says *who computes* each update: its owners, shared pieces and micro-groups
(``runtime.schedule``'s work order, run by ``update``, ``pairs`` and ``tp``). A storage says
*where the bytes are*. :class:`~canzona.runtime.optimizer.CanzonaOptimizer` composes one storage
with those compute rooms; they meet at the storage's per-bucket buffers
(:class:`~canzona.runtime.storage.buffers.BucketBuffers`), laid out by the plan's buckets:

* ``own`` — this rank's slice of the reduced, averaged gradient, which the compute rooms read;
* ``own_params`` and ``main`` — the same slice of the parameters (and their fp32 main copies),
  which they write before :meth:`Storage.gather` returns it to every rank.

A step runs ``collect`` (from backward's hooks) → :meth:`Storage.reduce` → the compute rooms →
:meth:`Storage.gather` per bucket → :meth:`Storage.wait_gathers`. One implementation exists,
:class:`~canzona.runtime.storage.zero1.Zero1Buckets`: Megatron's (or canzona's own) ZeRO-1
buckets over the DP group (an expert bucket over its expert-DP group). The layouts to come plug
in here as storages, or groups of storages, of their own (``docs/architecture.md``, *The
storage seam*).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from canzona.runtime.storage.buffers import BucketBuffers
from canzona.runtime.storage.gradients import GradientCollector

__all__ = ["Storage"]


class Storage(ABC):
    """Where the parameters and gradients of one optimizer live, and how they move.

    Attributes:
        buffers: per bucket of the plan, this rank's tensors (see the module docstring).
        grads: the gradient bookkeeping of the iteration: which parameters reported, which
            buckets are launched, ``received_anywhere`` after :meth:`reduce` (with the flags'
            agreement), ``sync`` (False inside ``no_sync()``).
        group: the process group that reduces and gathers (None: the default group, looked up
            by every collective), released by :meth:`release`.
        size, rank: that group's size and this rank's place in it.
    """

    buffers: Sequence[BucketBuffers]
    grads: GradientCollector
    group: Any
    size: int
    rank: int

    # -- gradients ---------------------------------------------------------------------------------

    @abstractmethod
    def collect(self, i: int, p: Tensor) -> None:
        """Parameter ``i``'s gradient is ready (its post-accumulate-grad hook): take it, and
        start the reductions it completes."""

    @abstractmethod
    def reduce(self) -> None:
        """Every bucket's averaged gradient slice in its ``own`` buffer: what backward did not
        launch is launched now, then every reduction is waited for."""

    @abstractmethod
    def read_external(self) -> None:
        """``grad_sync="external"``: this rank's slices of the (already averaged) ``.grad``
        into the ``own`` buffers."""

    @abstractmethod
    def held_back(self) -> str | None:
        """One line naming a parameter that got no gradient and so held its bucket, and every
        later one, back from reducing during backward; None when nothing was held back."""

    @abstractmethod
    def reset(self) -> None:
        """Start the next iteration: gradients zeroed, bookkeeping cleared."""

    @abstractmethod
    def discard(self) -> None:
        """Drop what was collected since the last step (``zero_grad``): wait for reductions in
        flight, then :meth:`reset`."""

    # -- parameters ------------------------------------------------------------------------------

    @abstractmethod
    def gather(self, bucket: int) -> None:
        """Start returning bucket ``bucket``'s updated owned slice to every rank."""

    @abstractmethod
    def wait_gathers(self) -> None:
        """Wait for the gathers started: the parameters are whole again everywhere."""

    # -- shutdown and reporting ------------------------------------------------------------------

    @abstractmethod
    def finish(self) -> None:
        """Wait for every collective started (gathers and reductions)."""

    @abstractmethod
    def release(self) -> None:
        """Forget the work handles and the process group."""

    @property
    @abstractmethod
    def methods(self) -> tuple[str, ...]:
        """Per bucket, in launch order, how it is reduced and gathered."""

    @property
    def owned_grads(self) -> list[Tensor]:
        """This rank's reduced gradient slices (every element of every parameter lies in exactly
        one rank's slice: what clipping sums)."""
        return [b.own for b in self.buffers]

    @property
    def main_copies(self) -> list[Tensor | None]:
        """Per bucket, the fp32 main copy of this rank's slice, or None."""
        return [b.main for b in self.buffers]
