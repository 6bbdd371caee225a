"""Where parameters and gradients live and how they move: the :class:`Storage` seam and its
implementations (today :class:`Zero1Buckets`, the plan's ZeRO-1 buckets)."""

from canzona.runtime.storage.base import Storage
from canzona.runtime.storage.zero1 import Zero1Buckets

__all__ = ["Storage", "Zero1Buckets"]
