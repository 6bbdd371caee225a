"""Where parameters and gradients live and how they move: the :class:`Storage` seam and its
implementations (:class:`Zero1Buckets`, the plan's ZeRO-1 buckets), and FSDP2's rows
(:class:`FSDP2Rows`: a ``fully_shard``-ed model's ``Shard(0)`` rows, moved to their owners and
back in an FSDP2 plan's rounds)."""

from canzona.runtime.storage.base import Storage
from canzona.runtime.storage.fsdp2 import FSDP2Rows
from canzona.runtime.storage.zero1 import Zero1Buckets

__all__ = ["FSDP2Rows", "Storage", "Zero1Buckets"]
