"""The TP pair search (tp > 1, Muon): every matrix whole on a DP index, or a tall column-parallel
one shared by the TP groups of fixed partner indices (2s, 2s + 1), a half in each partner's
lockstep (k = 2·tp; :class:`TPPairSearch`)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping

from .. import alike
from ..planning import DPProblem, Item, PairShare
from ..tp.context import HALF, Lockstep, TPContext, half_piece, lockstep_piece, lpt_makespan
from .search import Ops, Place, Search


class TPPairSearch(Search):
    """tp > 1, Muon: every matrix item whole on a DP index — a piece of the index's lockstep
    where its TP group shares it (``problem.shared``), a micro-group task where a TP rank hosts
    it, every rank's where TP replicates it — or, for a task of ``pairs``
    (``decision.tp_pair_decision``), shared by the fixed pair (2s, 2s + 1): a half in each
    partner's lockstep (k = 2·tp). An index costs its lockstep (its shared pieces and its
    pair's halves, halves first, in batches of ``cap`` scratch bytes as the runtime runs them:
    ``tp.context.Lockstep``; partners end the batches holding halves together), plus its
    hosted tasks packed on its TP ranks and its replicated ones; AdamW is left out (the layout
    spreads it). A round of TP sub-groups (``problem.rounds``) is one piece of its index's
    lockstep: its first task's item carries its members, which move with it and nowhere
    alone."""

    def __init__(self, problem: DPProblem, pairs: Mapping[int, PairShare], cap: int = 0,
                 force: bool = False) -> None:
        self.force = force  # every task of ``pairs`` shared by a pair
        self.tp, self.cap = problem.sizes.tp, cap
        self.pairs = pairs
        self._ctx = TPContext.build(problem, problem.comm_dtype)
        self.kind: list[str] = []  # "lock", "host" or "base"
        self.piece: list[tuple | None] = []  # its lockstep piece (whole, over the TP group)
        self.half: list[tuple | None] = []  # its half's piece (shared by a pair)
        super().__init__(problem)  # ``load``: a lock piece's recorded load, or the task's
        #: per item, the items that move with it: a round's first task carries its members
        #: (one lockstep piece for the round, ``planning.SubRound``), every other item itself
        self.unit: list[tuple[int, ...]] = [(i,) for i in range(len(self.load))]
        if problem.rounds:
            item_of = {t: i for i, t in enumerate(self.task)}
            for i, t in enumerate(self.task):
                r = problem.rounds.get(t)
                if r is not None and r.tasks[0] == t:
                    self.unit[i] = tuple(item_of[x] for x in r.tasks)
        self.whole: list[list[int]] = [[] for _ in range(self.dp)]
        self.costs = [0.0] * self.dp
        #: an item's class: items alike in all but their task id cost an index alike
        classes: dict[tuple, int] = {}
        self._cls = [classes.setdefault((k, x, p and p[1:], h and h[1:]), len(classes))
                     for k, x, p, h in zip(self.kind, self.load, self.piece, self.half)]
        #: an index's items as classes (in the order held, and in task order: the lockstep's
        #: sums run in the one, its batches in the other) → (batches holding a half, the
        #: others, the rest)
        self._memo: dict[tuple, tuple[float, float, float]] = {}
        #: every index as placed (:meth:`_placed`; dropped when what it holds changes)
        self._keys: dict[int, tuple] = {}
        self._seeded = False  # :meth:`seed` placed some items

    def _item(self, problem: DPProblem, it: Item) -> float:
        i = it.tasks[0]
        piece = half = None
        r = problem.rounds.get(i) if len(it.tasks) == 1 else None
        if r is not None and r.tasks[0] != i:  # placed with its round's first task
            kind, load = "member", 0.0
        elif len(it.tasks) == 1 and i in problem.shared:
            kind, piece = "lock", lockstep_piece(problem, i)
            load = piece[3]
        elif len(it.tasks) == 1 and self._ctx.split[i]:
            kind, load = "host", float(problem.loads[i])
        else:
            kind, load = "base", float(sum(self._ctx.each_rank(t, problem.loads[t])
                                           for t in it.tasks))
        x = self.pairs.get(i) if len(it.tasks) == 1 else None
        if x is not None and x.alone_s > 0:
            half = half_piece(problem, i, x)
        self.kind.append(kind)
        self.piece.append(piece)
        self.half.append(half)
        return load

    # -- costs -------------------------------------------------------------------------------
    def _lock(self, whole: list[int], halves: list[int]) -> tuple[float, float]:
        """An index's lockstep: its pair's halves first, then its own shared pieces, in task
        order (``runtime.tp_shared``): (the batches holding a half, the others)."""
        lock = Lockstep(self.cap)
        for i in halves:
            x = self.half[i]
            lock.add((x[0] - HALF, *x[1:]))  # type: ignore[index]
        for i in whole:
            if self.kind[i] == "lock":
                lock.add(self.piece[i])  # type: ignore[arg-type]
        return lock.split()

    def _rest(self, whole: list[int]) -> float:
        hosted = [self.load[i] for i in whole if self.kind[i] == "host"]
        return sum(self.load[i] for i in whole if self.kind[i] == "base") + \
            (lpt_makespan(hosted, self.tp) if hosted else 0.0)

    def _costs(self, whole: dict[int, list[int]], shared: dict[int, list[int]],
               indices: set[int]) -> dict[int, float]:
        """The costs of ``indices`` (and their partners) given per-index whole items and
        per-pair shared ones (those not given: as now)."""
        ds = set(indices)
        ds |= {d ^ 1 for d in indices if d ^ 1 < 2 * self.npairs}
        lock, out = {}, {}
        memo, cls, task = self._memo, self._cls, self.task.__getitem__
        if len(memo) > 200_000:
            memo.clear()
        for d in ds:
            s = d // 2
            w = whole.get(d, self.whole[d])
            h = shared.get(s, self.shared[s]) if s < self.npairs else []
            if alike.SHARED and d not in whole and s not in shared:
                key = self._placed(d)[0]
            else:
                key = (tuple([cls[i] for i in w]), tuple([cls[i] for i in sorted(w, key=task)]),
                       tuple([cls[i] for i in h]), tuple([cls[i] for i in sorted(h, key=task)]))
            got = memo.get(key) if alike.SHARED else None
            if got is None:  # an index's cost is its items' alone: alike indices share it
                got = memo[key] = (*self._lock(w, h), self._rest(w))
            else:
                alike.reused("tp pairs")
            lock[d] = got
        for d in ds:
            halves, own, rest = lock[d]
            if halves and (d ^ 1) in lock:  # partners end the batches holding halves together
                halves = max(halves, lock[d ^ 1][0])
            out[d] = halves + own + rest
        return out

    def _placed(self, d: int) -> tuple[tuple, list[int], list[int]]:
        """Index ``d`` as placed, kept while what it holds is unchanged: its key into the costs
        (its items' classes in the order held and in task order, its pair's shared ones
        likewise), its whole items' tasks and its pair's shared items' tasks, ascending."""
        got = self._keys.get(d)
        if got is None:
            cls, task = self._cls, self.task
            w = self.whole[d]
            h = self.shared[d // 2] if d < 2 * self.npairs else []
            tw, th = sorted(w, key=task.__getitem__), sorted(h, key=task.__getitem__)
            got = self._keys[d] = (
                (tuple([cls[i] for i in w]), tuple([cls[i] for i in tw]),
                 tuple([cls[i] for i in h]), tuple([cls[i] for i in th])),
                [task[i] for i in tw], [task[i] for i in th])
        return got

    def _alike(self, place: Place, i: int) -> tuple:
        """What item ``i`` at ``place`` costs depends on alone (the touched indices as placed
        and where ``i``'s task falls among theirs): options alike in it cost alike."""
        t = self.task[i]
        if place[0] == "w":
            d = place[1]
            key, tasks, _ = self._placed(d)
            partner = self._placed(d ^ 1)[0] if d ^ 1 < 2 * self.npairs else None
            return ("w", key, bisect_left(tasks, t), partner)
        a, b = self._placed(2 * place[1]), self._placed(2 * place[1] + 1)
        return ("s", a[0], b[0], bisect_left(a[2], t))

    def cost(self, d: int) -> float:
        return self.costs[d]

    def whole_on(self, d: int) -> list[int]:
        return list(self.whole[d])

    def _expand(self, ops: Ops) -> Ops:
        """``ops`` with each round's members moved with its first task."""
        if all(len(self.unit[i]) == 1 for i, _ in ops):
            return ops
        return [(j, new) for i, new in ops for j in self.unit[i]]

    def trial(self, ops: Ops) -> dict[int, float] | None:
        ops = self._expand(ops)
        whole: dict[int, list[int]] = {}
        shared: dict[int, list[int]] = {}
        touched: set[int] = set()
        for i, new in ops:
            for place, add in ((self.where[i], False), (new, True)):
                if place[0] == "w":
                    got = whole.setdefault(place[1], list(self.whole[place[1]]))
                    touched.add(place[1])
                else:
                    got = shared.setdefault(place[1], list(self.shared[place[1]]))
                    touched |= {2 * place[1], 2 * place[1] + 1}
                if add:
                    got.append(i)
                else:
                    got.remove(i)
        if not all(self.fits(got) for got in shared.values()):
            return None
        return self._costs(whole, shared, touched)

    def apply(self, ops: Ops) -> None:
        got = self.trial(ops)
        assert got is not None
        for i, new in self._expand(ops):
            old = self.where[i]
            (self.whole[old[1]] if old[0] == "w" else self.shared[old[1]]).remove(i)
            (self.whole[new[1]] if new[0] == "w" else self.shared[new[1]]).append(i)
            self.where[i] = new
            self._changed(old)
            self._changed(new)
        for d, c in got.items():
            self.costs[d] = c

    # -- construction and search -------------------------------------------------------------
    def seed(self, placed: dict[int, Place]) -> None:
        """Items placed as given (a round's first task with its members), before
        :meth:`start` places the rest."""
        self.where = [("w", -1)] * len(self.load)
        for i, place in placed.items():
            self._put(i, place)
        self._keys.clear()
        self._seeded = True
        got = self._costs({}, {}, set(range(self.dp)))
        for d, c in got.items():
            self.costs[d] = c

    def start(self) -> None:
        """Heaviest first, each where the busiest index it touches ends lightest (whole on an
        index, or shared by a pair; ties: whole, the lower index); the items :meth:`seed`
        placed stay."""
        order = sorted(range(len(self.load)), key=lambda i: (-self.load[i], i))
        if not self._seeded:
            self.where = [("w", -1)] * len(self.load)
        for i in order:
            if self.kind[i] == "member" or self.where[i] != ("w", -1):
                continue  # placed with its round, or seeded
            best = None
            options: list[Place] = [] if self.force and self.half[i] is not None else \
                [("w", d) for d in range(self.dp)]
            if self.half[i] is not None:
                options += [("s", s) for s in range(self.npairs)
                            if self.fits(self.shared[s] + [i])]
            if not options:  # forced, but every pair shares a matrix of its bucket already
                options = [("w", d) for d in range(self.dp)]
            tried = set()
            for place in options:
                if alike.SHARED:  # an option alike an earlier one ties with it: the earlier wins
                    sig = self._alike(place, i)
                    if sig in tried:
                        alike.reused("tp pairs")
                        continue
                    tried.add(sig)
                if place[0] == "w":
                    got = self._costs({place[1]: self.whole[place[1]] + list(self.unit[i])}, {},
                                      {place[1]})
                else:
                    got = self._costs({}, {place[1]: self.shared[place[1]] + [i]},
                                      {2 * place[1], 2 * place[1] + 1})
                score = (max(got.values()), place[0] == "s", place[1])
                if best is None or score < best[0]:
                    best = (score, place, got)
            _, place, got = best  # type: ignore[misc]
            self._put(i, place)
            self._changed(place)
            for d, c in got.items():
                self.costs[d] = c

    def _put(self, i: int, place: Place) -> None:
        """Item ``i`` (with its round's members) at ``place``; its costs are the caller's."""
        for j in self.unit[i]:
            (self.whole[place[1]] if place[0] == "w" else self.shared[place[1]]).append(j)
            self.where[j] = place

    def _changed(self, place: Place) -> None:
        """What ``place`` holds changed: its indices' keys go."""
        for d in self.indices(place):
            self._keys.pop(d, None)

    def moves(self, here: list[int]) -> list[Ops]:
        """Moves of one of ``here`` (the busiest index's items) to another place: whole on an
        index or, with a half, shared by a pair (alike items, and alike places for an item,
        tried once; a forced task stays shared)."""
        out: list[Ops] = []
        tried = set()
        for i in here:
            if self.kind[i] == "member":
                continue
            sig = (self.kind[i], self.load[i], self.half[i] is not None, self.where[i][0])
            if sig in tried:
                continue
            tried.add(sig)
            seen = set()
            for d in range(0 if self.force and self.half[i] is not None else self.dp):
                alike = (tuple(sorted((self.kind[j], self.load[j]) for j in self.whole[d])),
                         tuple(sorted(self.load[j] for j in self.shared[d // 2]))
                         if d < 2 * self.npairs else (), round(self.costs[d], 6))
                if ("w", d) != self.where[i] and alike not in seen:
                    seen.add(alike)
                    out.append([(i, ("w", d))])
            if self.half[i] is not None:
                seen = set()
                for s in range(self.npairs):
                    alike = (tuple(sorted((self.kind[j], self.load[j])
                                          for d in (2 * s, 2 * s + 1) for j in self.whole[d])),
                             tuple(sorted(self.load[j] for j in self.shared[s])))
                    if ("s", s) != self.where[i] and alike not in seen:
                        seen.add(alike)
                        out.append([(i, ("s", s))])
        return out

    def step(self, top: int, costs: list[float]) -> Ops | None:
        """The move off ``top`` (:meth:`moves`) that leaves the busiest index it touches lowest,
        then the lowest sum of their loads; where none lowers it, an exchange
        (:meth:`_swap`)."""
        here = self.held(top)
        return self.best_of(self.moves(here), costs[top]) or self._swap(top, here, costs[top])

    def _swaps(self, items: list[int], ceiling: float, strict: bool, onto: int | None = None,
               near: tuple[int, ...] = ()
               ) -> list[tuple[tuple[float, float], Ops, set[int]]]:
        """Exchanges of one of ``items`` with an unlike item elsewhere, and (``onto``) moves of
        an item elsewhere onto that index (a piece beside a pair's half hides its exchanges),
        that leave every index they touch under ``ceiling`` (``strict``) or not above it:
        (score, the ops, the indices they touch), best first. Alike items and alike places
        are tried once (a place on one of the ``near`` indices is never alike one elsewhere);
        a forced task stays shared, a task without a half whole."""
        def allowed(i: int, place: Place) -> bool:
            if self.kind[i] == "member":  # moves with its round's first task
                return False
            if place[0] == "s":
                return self.half[i] is not None
            return not (self.force and self.half[i] is not None)

        def sig(i: int) -> tuple:
            return (self.kind[i], self.load[i], self.piece[i] and self.piece[i][1:],
                    self.half[i] is not None)

        def alike(j: int) -> tuple:
            wj = self.where[j]
            if wj[0] == "w" and wj[1] in near:
                return sig(j), wj
            return sig(j), wj[0], round(self.costs[wj[1]] if wj[0] == "w" else
                                        max(self.costs[2 * wj[1]], self.costs[2 * wj[1] + 1]), 6)

        limit = ceiling * (1 - 1e-9) if strict else ceiling
        out = []

        def consider(ops: Ops) -> None:
            got = self.trial(ops)
            if got is None:
                return
            worst = max(got.values())
            if worst < limit or not strict and worst <= limit:
                out.append(((worst, sum(got.values())), ops, set(got)))

        mine = set(items)
        if onto is not None:
            mine |= set(self.whole[onto])
            seen = set()
            for j in range(len(self.load)):
                if j not in mine and self.where[j][0] == "w" and allowed(j, ("w", onto)) \
                        and alike(j) not in seen:
                    seen.add(alike(j))
                    consider([(j, ("w", onto))])
        tried = set()
        for i in items:
            if (sig(i), self.where[i]) in tried:
                continue
            tried.add((sig(i), self.where[i]))
            seen = set()
            for j in range(len(self.load)):
                wj = self.where[j]
                if j in mine or sig(j)[:3] == sig(i)[:3] or wj == self.where[i] or not (
                        allowed(i, wj) and allowed(j, self.where[i])) or alike(j) in seen:
                    continue
                seen.add(alike(j))
                consider([(i, wj), (j, self.where[i])])
        out.sort(key=lambda x: x[0])
        return out

    def _swap(self, top: int, here: list[int], ceiling: float) -> Ops | None:
        """Where no move off the busiest index lowers it: the best exchange of one of its items
        with an unlike one elsewhere (a QKV beside a pair's half for a lighter proj: what
        moves alone cannot reach). Where partners end their halves together, both may have
        to change: an exchange, or an item brought beside the half, that leaves every index it
        touches no heavier, then one on the partner after which every index either touches
        is under the ceiling (the first few of each tried; the first is undone otherwise)."""
        partner = top ^ 1
        got = self._swaps(here, ceiling, strict=True, near=(top, partner))
        if got:
            return got[0][1]
        if top >= 2 * self.npairs or not self.shared[top // 2]:
            return None
        limit = ceiling * (1 - 1e-9)
        for _, first, touched in self._swaps(list(self.whole[top]), ceiling, False, onto=top,
                                             near=(top, partner))[:4]:
            back = [(i, self.where[i]) for i, _ in first]
            self.apply(first)
            for _, second, also in self._swaps(list(self.whole[partner]), ceiling, True,
                                               onto=partner, near=(top, partner)):
                if all(self.costs[d] < limit for d in touched - also):
                    return second  # the first stays; the caller applies the second
            self.apply(back)
        return None
