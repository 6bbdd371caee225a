"""The DP pair search (tp = 1, Muon): DP indices paired up front, (2s, 2s + 1) — one node, as
``prices.pair_link`` wants — and every matrix whole on one index or shared by a pair, the
pair's matrices in one lockstep (:class:`PairSearch`).

Pieces the DP partition places one by one (``candidates.Candidates``) seldom share a partner,
so every piece carries its Gram exchanges on its critical path and is seldom small enough to
fill a DP index's last gap (qwen3-8b at dp 64 stays at 1.054× the mean that way). Pairs that
share several matrices run them in lockstep (``runtime.pairs``; the model is
``tp.context.lockstep_seconds``): per Newton–Schulz iteration one matrix's exchange runs while
the next one computes, so the exchanges of a bundle hide behind its compute and a shared matrix
costs each partner about half its compute. An index's load is its whole matrices plus its
pair's lockstep (``pairs.pair_waits``: each index is in one pair, so no pair waits for
another). Start: heaviest matrix first, each where the busiest index it touches ends lightest
(whole on the lightest index, or shared by the pair whose lockstep grows least); then moves and
swaps off the busiest index while that lowers it; last, a shared matrix is made whole again
wherever that keeps every index at or under the busiest. A pair's lockstep holds at most
``scratch_cap`` bytes (the candidates: 2 · C_max). A bucket's two pieces of a matrix are
neighbours (the cut between the partners falls inside it), so a pair shares at most one matrix
of each bucket.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..formulas import lockstep_bytes
from ..planning import DPProblem, Item, PairShare
from ..tp.context import Run, lockstep_seconds
from .search import Ops, Place, Search


class PairSearch(Search):
    """tp = 1, Muon: every matrix item whole on a DP index or, for a task of ``pairs``
    (``decision.pair_decision``), shared by a fixed pair, its pieces (``piece``: compute,
    exchanges and hidden seconds per partner, in load units; ``scratch``: bytes in a pair's
    lockstep) in the pair's one lockstep. An index costs its whole items (``own``) and its
    pair's lockstep (``lock``)."""

    def __init__(self, problem: DPProblem, pairs: Mapping[int, PairShare],
                 scratch_cap: int = 0) -> None:
        self.cap = scratch_cap  # a pair's lockstep scratch, bytes (0: unbounded)
        self.steps = problem.settings.ns_steps
        self.pairs = pairs
        self.piece: list[Run | None] = []  # (compute, exchanges, hidden) per partner
        self.scratch: list[int] = []  # bytes its piece holds in a pair's lockstep
        super().__init__(problem)
        self.own = [0.0] * self.dp
        self.whole: list[set[int]] = [set() for _ in range(self.dp)]
        self.lock = [0.0] * self.npairs

    def _item(self, problem: DPProblem, it: Item) -> float:
        x = self.pairs.get(it.tasks[0]) if len(it.tasks) == 1 else None
        piece, scratch = None, 0
        if x is not None and x.alone_s > 0:
            piece = x.run_piece()
            shape = problem.tasks[it.tasks[0]].shape
            m, n = max(shape), min(shape)
            scratch = lockstep_bytes(-(-m // 2), n, 2, x.split_poly, 2)
        self.piece.append(piece)
        self.scratch.append(scratch)
        return it.load

    # -- costs -------------------------------------------------------------------------------
    def lockstep(self, items: list[int]) -> float:
        """A pair's lockstep over ``items`` (summed in item order, so that the same bundle
        always costs the same to the last bit)."""
        if not items:
            return 0.0
        return lockstep_seconds([self.piece[i] for i in sorted(items)],  # type: ignore[misc]
                                self.steps)

    def fits(self, items: list[int]) -> bool:
        """Whether a pair may share ``items``: every one has a piece, no two of one bucket,
        their scratch within the cap."""
        return all(self.piece[i] is not None for i in items) and super().fits(items) \
            and (not self.cap or sum(self.scratch[i] for i in items) <= self.cap)

    def cost(self, d: int) -> float:
        return self.own[d] + (self.lock[d // 2] if d < 2 * self.npairs else 0.0)

    def whole_on(self, d: int) -> list[int]:
        return sorted(self.whole[d])

    def trial(self, ops: Ops) -> dict[int, float] | None:
        own: dict[int, float] = {}
        bundles: dict[int, list[int]] = {}
        for i, new in ops:
            for place, sign in ((self.where[i], -1), (new, 1)):
                if place[0] == "w":
                    own[place[1]] = own.get(place[1], self.own[place[1]]) + sign * self.load[i]
                else:
                    got = bundles.setdefault(place[1], list(self.shared[place[1]]))
                    if sign < 0:
                        got.remove(i)
                    else:
                        got.append(i)
        if not all(self.fits(got) for got in bundles.values()):
            return None
        out = {}
        for d in {d for i, new in ops for p in (self.where[i], new) for d in self.indices(p)}:
            lock = 0.0
            if d < 2 * self.npairs:
                s = d // 2
                lock = self.lockstep(bundles[s]) if s in bundles else self.lock[s]
            out[d] = own.get(d, self.own[d]) + lock
        return out

    def apply(self, ops: Ops) -> None:
        touched = set()
        for i, new in ops:
            for place, add in ((self.where[i], False), (new, True)):
                if place[0] == "w":
                    self.own[place[1]] += self.load[i] if add else -self.load[i]
                    (self.whole[place[1]].add if add else self.whole[place[1]].discard)(i)
                else:
                    (self.shared[place[1]].append if add else self.shared[place[1]].remove)(i)
                    touched.add(place[1])
            self.where[i] = new
        for s in touched:
            self.lock[s] = self.lockstep(self.shared[s])

    # -- construction and search -------------------------------------------------------------
    def start(self) -> None:
        """Heaviest first, each item where :meth:`place` puts it."""
        for i in sorted(range(len(self.load)), key=lambda i: (-self.load[i], i)):
            self.place(i)

    def place(self, i: int) -> None:
        """Item ``i`` where the busiest index it touches ends lightest: whole on the lightest
        index, or shared by the pair whose lockstep grows least (ties: whole)."""
        lightest = min(range(self.dp), key=lambda d: (self.cost(d), d))
        best: tuple[float, int, Place] = (self.cost(lightest) + self.load[i], 0, ("w", lightest))
        if self.piece[i] is not None:
            for s in range(self.npairs):
                if not self.fits(self.shared[s] + [i]):
                    continue
                lock = self.lockstep(self.shared[s] + [i])
                worst = max(self.own[2 * s], self.own[2 * s + 1]) + lock
                if (worst, 1, ("s", s)) < best:
                    best = (worst, 1, ("s", s))
        self.put(i, best[2])

    def put(self, i: int, new: Place) -> None:
        """Item ``i``, not placed yet, at ``new``."""
        if new[0] == "w":
            self.own[new[1]] += self.load[i]
            self.whole[new[1]].add(i)
        else:
            self.shared[new[1]].append(i)
            self.lock[new[1]] = self.lockstep(self.shared[new[1]])
        self.where[i] = new

    def moves(self, top: int) -> list[Ops]:
        """Moves and swaps that take work off DP index ``top``."""
        out: list[Ops] = []
        seen = set()
        for i in self.held(top):
            sig = (self.load[i], self.piece[i], self.where[i][0], self.key[i])
            if sig in seen:
                continue
            seen.add(sig)
            for d in range(self.dp):
                if ("w", d) != self.where[i]:
                    out.append([(i, ("w", d))])
                for j in sorted(self.whole[d]) if d != top else ():
                    if self.load[j] < self.load[i] or self.where[i][0] == "s":
                        out.append([(i, ("w", d)), (j, self.where[i])])
            if self.piece[i] is None:
                continue
            for s in range(self.npairs):
                if ("s", s) != self.where[i]:
                    out.append([(i, ("s", s))])
                    if self.where[i][0] == "s":
                        for j in self.shared[s]:
                            out.append([(i, ("s", s)), (j, self.where[i])])
        return out

    def unshare(self) -> None:
        """Shared matrices made whole again wherever that keeps every DP index at or under the
        busiest one (lightest first, each on the index where it ends lowest): each one fewer
        is a bucket slice and its exchanges fewer, at no cost to the busiest index."""
        ceiling = self.busiest()
        for i in sorted((i for i, w in enumerate(self.where) if w[0] == "s"),
                        key=lambda i: (self.load[i], i)):
            best = None
            s = self.where[i][1]
            lightest = min((d for d in range(self.dp) if d // 2 != s),
                           key=lambda d: (self.cost(d), d), default=None)
            for d in sorted({2 * s, 2 * s + 1} | ({lightest} - {None})):
                got = self.trial([(i, ("w", d))])
                if got is None or max(got.values()) > ceiling:
                    continue
                score = (max(got.values()), d)
                if best is None or score < best[0]:
                    best = (score, d)
            if best is not None:
                self.apply([(i, ("w", best[1]))])

    def step(self, top: int, costs: list[float]) -> Ops | None:
        """The move or swap off ``top`` (:meth:`moves`) that leaves the busiest index it
        touches lowest, then adds least to the loads it changes."""
        return self.best_of(self.moves(top), costs[top], before=costs)
