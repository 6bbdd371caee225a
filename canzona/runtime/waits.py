"""Waiting for asynchronous collectives: one handle with a timeout that names what it waits for
(:class:`~canzona.runtime.errors.CollectiveTimeoutError`), several handles as one, NCCL's
coalesced launches. On CUDA ``work.wait()`` makes the current stream wait for the communicator's
stream; every room that launches collectives (the storage's buckets, the TP micro-groups, the
shared Newton–Schulz kernel, the DP pairs) waits through here."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from canzona.runtime.errors import CollectiveTimeoutError

__all__ = ["CoalescedWork", "Works", "wait_for", "wait_within"]


def wait_for(work: Any, what: str, timeout_s: float | None, rank: int) -> None:
    """``work.wait()``; with ``timeout_s``, a :class:`CollectiveTimeoutError` naming ``what``
    once that many seconds pass (gloo and NCCL work handles take a timeout; NCCL's coalesced
    per-root calls wait on the process group's own timeout and watchdog)."""
    if timeout_s is None or isinstance(work, CoalescedWork):
        work.wait()
        return
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        if isinstance(exc, CollectiveTimeoutError) or "time" not in str(exc).lower():
            raise
        raise CollectiveTimeoutError(
            f"rank {rank}: {what} did not finish within {timeout_s:g} s (collective_timeout): "
            f"a peer rank died, hangs, or stopped calling step() [{exc}]") from None


class CoalescedWork:
    """NCCL's coalesced per-root calls: waited for without a timeout of ours."""

    def __init__(self, cm: Any) -> None:
        self.cm = cm
        self.waited = False

    def wait(self) -> None:
        self.cm.wait()
        self.waited = True

    def is_completed(self) -> bool:
        works = getattr(self.cm, "works", None)
        return all(w.is_completed() for w in works) if works else self.waited


class Works:
    """Several async handles waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)

    def wait(self, timeout: timedelta | None = None) -> None:
        wait_within([w for w in self.works if w is not None], timeout)


def wait_within(works: list[Any], timeout: timedelta | None) -> None:
    """Wait for ``works`` one after another within one ``timeout`` for them all (each gets
    what the ones before it left), not a full timeout each."""
    if timeout is None:
        for w in works:
            w.wait()
        return
    end = time.monotonic() + timeout.total_seconds()
    for w in works:
        # a floor of 1 ms: a work already done returns at once, one still running times out
        w.wait(timeout=timedelta(seconds=max(end - time.monotonic(), 1e-3)))
