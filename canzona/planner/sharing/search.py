"""The search both pair searches are (:class:`Search`): every matrix item of a problem whole on
one DP index or shared by a fixed pair of partners (2s, 2s + 1), changed off the busiest index
while that lowers it. A subclass prices the indices (:meth:`Search.cost`, :meth:`Search.trial`,
:meth:`Search.apply`) and says what to try off the busiest one (:meth:`Search.step`); the items,
their places and the verbs the two searches share are here."""

from __future__ import annotations

from collections.abc import Iterable

from ..planning import DPProblem, Item

#: Where an item is: ("w", DP index), whole there; ("s", pair s), shared by DP indices 2s and
#: 2s + 1.
Place = tuple[str, int]
#: A change: items and their new places, applied together.
Ops = list[tuple[int, Place]]


class Search:
    """The placement of every matrix item (an atomic bucket item; ``ref``: its bucket and
    index there, ``key``: its bucket, ``task``: its first task, ``load``: its load alone) at a
    :data:`Place` (``where``); ``shared[s]``: the items pair s shares. What
    ``layout.lay_out`` reads: ``ref``, ``task``, ``where``."""

    def __init__(self, problem: DPProblem) -> None:
        self.dp = problem.dp
        self.npairs = problem.dp // 2
        atomic = [(b, k, it) for b in problem.buckets for k, it in enumerate(b.items)
                  if it.atomic]
        self.ref: list[tuple[tuple[int, int], int]] = [((b.buffer, b.bucket), k)
                                                       for b, k, _ in atomic]
        self.key: list[tuple[int, int]] = [key for key, _ in self.ref]
        self.task: list[int] = [it.tasks[0] for _, _, it in atomic]
        self.load: list[float] = [self._item(problem, it) for _, _, it in atomic]
        self.where: list[Place] = [("w", 0)] * len(self.load)
        self.shared: list[list[int]] = [[] for _ in range(self.npairs)]

    def _item(self, problem: DPProblem, it: Item) -> float:
        """Records what the subclass needs of item ``it`` (the items in order); its load."""
        raise NotImplementedError

    # -- costs -------------------------------------------------------------------------------
    def cost(self, d: int) -> float:
        """DP index ``d``'s load as placed."""
        raise NotImplementedError

    def busiest(self) -> float:
        """The busiest DP index's load."""
        return max(self.cost(d) for d in range(self.dp))

    def indices(self, place: Place) -> tuple[int, ...]:
        """The DP indices an item at ``place`` loads."""
        return (place[1],) if place[0] == "w" else (2 * place[1], 2 * place[1] + 1)

    def whole_on(self, d: int) -> list[int]:
        """The items DP index ``d`` holds whole, in the order the search tries them."""
        raise NotImplementedError

    def held(self, d: int) -> list[int]:
        """The items DP index ``d`` holds: its whole ones, then its pair's shared ones."""
        here = self.whole_on(d)
        if d < 2 * self.npairs:
            here += self.shared[d // 2]
        return here

    def fits(self, items: list[int]) -> bool:
        """Whether a pair may share ``items``: no two of one bucket (a matrix's two pieces are
        neighbours in its bucket, the cut between the partners inside it)."""
        return len({self.key[i] for i in items}) == len(items)

    def trial(self, ops: Ops) -> dict[int, float] | None:
        """The new loads of the DP indices ``ops`` touch, or None where a pair could not share
        what it would hold (:meth:`fits`); nothing changes."""
        raise NotImplementedError

    def apply(self, ops: Ops) -> None:
        """``ops`` made."""
        raise NotImplementedError

    # -- the search --------------------------------------------------------------------------
    def best_of(self, options: Iterable[Ops], ceiling: float,
                before: list[float] | None = None) -> Ops | None:
        """Of ``options``, the one whose busiest touched index ends lowest, below ``ceiling``
        by more than a rounding; on a tie the lower sum of the touched indices' new loads
        (less their loads ``before``, where given); None where none is below."""
        best: tuple[float, float] | None = None
        chosen = None
        for ops in options:
            got = self.trial(ops)
            if got is None:
                continue
            worst = max(got.values())
            if worst >= ceiling * (1 - 1e-9):  # a real gain, not a rounding
                continue
            total = sum(got.values())
            if before is not None:
                total -= sum(before[d] for d in got)
            if best is None or (worst, total) < best:
                best, chosen = (worst, total), ops
        return chosen

    def step(self, top: int, costs: list[float]) -> Ops | None:
        """The change to make off the busiest DP index ``top`` (``costs``: every index's
        load), or None where none lowers it."""
        raise NotImplementedError

    def improve(self, max_moves: int) -> None:
        """Changes off the busiest index (the lowest of equals) while one lowers it
        (:meth:`step`), ``max_moves`` at most."""
        for _ in range(max_moves):
            costs = [self.cost(d) for d in range(self.dp)]
            top = max(range(self.dp), key=lambda d: (costs[d], -d))
            ops = self.step(top, costs)
            if ops is None:
                return
            self.apply(ops)
