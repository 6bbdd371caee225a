"""Alike states computed once: the planner's searches cost a DP index (or a run of matrices on
it) from what the index holds, and identical layers make many indices hold the same, so the
cost is kept by that state and reused. The answer is the same either way (the kept value is the
one the computation gives), which :func:`each_anew` lets a test show: inside it, every state is
computed anew, the slow path.

The searches that use it: the TP pair search (``sharing.tp_search``, an index's lockstep and
hosted work by its items' kinds, in the order held and in task order), the joint DP × TP
refinement (``tp.joint``, a run of a bucket's matrices on an index by the index's bins,
lockstep and base load) and the per-bucket DP
(``dp.polish``, a bucket's cut by its units, the other buckets' loads and its options: twin
buckets meet the same ones).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

#: Whether alike states share their cost (False inside :func:`each_anew`).
SHARED = True
#: How many times a kept cost was reused, per search (what a test reads to know the sweep it
#: compares exercised the reuse).
REUSED: dict[str, int] = {}


def reused(search: str) -> None:
    """Count one reuse of a kept cost by ``search``."""
    REUSED[search] = REUSED.get(search, 0) + 1


@contextmanager
def each_anew() -> Iterator[None]:
    """Every state computed anew inside the block (the slow path the kept costs must match)."""
    global SHARED
    was, SHARED = SHARED, False
    try:
        yield
    finally:
        SHARED = was


class Kept:
    """The last ``size`` results of a computation, each by the objects it read (held by identity:
    an entry keeps them alive, so their ids are not reused while it lives) and plain values
    (hashable). The planner asks for the same evaluation of the same frozen problem or plan
    several times; this is where such results wait."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: dict[tuple, tuple[tuple, object]] = {}

    def get(self, objects: tuple, key: Hashable = None) -> object | None:
        """The result kept for ``objects`` (by identity) and ``key``, or None."""
        got = self._entries.get((tuple(map(id, objects)), key))
        return None if got is None else got[1]

    def put(self, objects: tuple, key: Hashable, value: object) -> object:
        """Keep ``value`` for ``objects`` and ``key`` (the oldest entry goes past ``size``);
        returns ``value``."""
        self._entries[(tuple(map(id, objects)), key)] = (objects, value)
        while len(self._entries) > self.size:
            del self._entries[next(iter(self._entries))]
        return value
