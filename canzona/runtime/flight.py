"""What canzona's collectives are in flight on this rank, kept on disk for after a crash.

On NCCL a collective that a peer never joins ends in the process group's watchdog, which aborts
the process: no exception reaches Python, and ``wait()`` only orders streams, so the host has long
moved on. ``CanzonaOptimizer(flight_record=DIR)`` keeps a table of canzona's launched and
unfinished collectives (the reduce or all-gather of bucket k, the TP gather or scatter of
micro-group g, the flags all-reduce) and a daemon thread rewrites
``DIR/canzona-flight-rank{R}.json`` (atomically, only when it changed, at most every
``interval_s``) with them and how long each has been running. After the watchdog has ended the
job, each rank's file names what it was waiting for. Per collective the cost is a dict insert; a
finished collective is dropped by the thread (``work.is_completed()``, which polls a CUDA event
on NCCL without blocking).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["FlightRecorder"]


class FlightRecorder:
    """The in-flight table of one optimizer (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, rank: int, *, interval_s: float = 0.5,
                 labels: dict[str, Any] | None = None) -> None:
        self.path = Path(directory) / f"canzona-flight-rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval_s = float(interval_s)
        self._labels = {"rank": rank, **(labels or {})}
        self._lock = threading.Lock()
        self._works: dict[int, tuple[str, float, Any]] = {}
        self._changed = True
        self._written = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="canzona-flight", daemon=True)
        self._thread.start()

    def add(self, what: str, work: Any) -> None:
        """A collective was launched (``work``: its handle; None for one that ran inline)."""
        if work is None:
            return
        with self._lock:
            self._works[id(work)] = (what, time.monotonic(), work)
            self._changed = True

    def table(self) -> list[dict[str, Any]]:
        """The unfinished collectives, oldest first (finished ones are dropped)."""
        now = time.monotonic()
        with self._lock:
            done = [k for k, (_, _, w) in self._works.items() if _completed(w)]
            for k in done:
                del self._works[k]
            if done:
                self._changed = True
            rows = sorted(self._works.values(), key=lambda x: x[1])
        return [{"what": what, "running_s": round(now - t0, 3)} for what, t0, _ in rows]

    def write(self) -> None:
        """Rewrite the file now if the table changed (what the thread does)."""
        rows = self.table()
        text = json.dumps({**self._labels, "in_flight": [r["what"] for r in rows],
                           "running_s": [r["running_s"] for r in rows]}, indent=1)
        if text == self._written and not rows:
            return
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, self.path)
        self._written = text

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write()
            except OSError:  # a full or vanished disk must not take the training down
                pass

    def close(self) -> None:
        """Stop the thread after a last write."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.write()
        except OSError:
            pass


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except (AttributeError, RuntimeError):
        return False
