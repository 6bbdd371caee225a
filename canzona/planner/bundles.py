"""DP pairs chosen as bundles (tp = 1, Muon): partners fixed first, each pair of DP indices
sharing several matrices in one lockstep run.

The pair stage of the pipeline (``pipeline._solve_pairs``) cuts candidate matrices into two
pieces and lets the DP partition place the pieces like any matrix. Partners then rarely share a
second matrix, so every piece carries its Gram exchanges on its critical path, and a piece's
load (compute + exchanges) is seldom small enough to fill a DP index's last gap: qwen3-8b at
dp 64 stays at 1.054× the mean (fc1 0.856 + proj 0.198), which is also the best any placement
of independently priced pieces reaches.

Pairs that share several matrices run them in lockstep (``runtime.pairs``; the model is
:func:`~canzona.planner.sharing.lockstep_seconds`): per Newton–Schulz iteration one matrix's
exchange runs while the next one computes, so the exchanges of a bundle hide behind its compute
and a shared matrix costs each partner about half its compute. Here the DP indices are paired
up front, (2s, 2s + 1) — one node, as ``pair_link`` wants — and a search decides, for every
matrix, whether one DP index holds it whole or a pair shares it. An index's load is its whole
matrices plus its pair's lockstep (``sharing.pair_waits``: each index is in one pair, so no
pair waits for another). Start: heaviest matrix first, each where the busiest index it touches
ends lightest (whole on the lightest index, or shared by the pair whose lockstep grows least);
then moves and swaps off the busiest index while that lowers it. A second start takes the
patterns of a class-level CP-SAT model (how many pairs share which alike matrices, which whole
ones sit beside each partner) and gives them real matrices; the lower of the two is kept. Last,
a shared matrix is made whole again wherever that keeps every index at or under the busiest. A
pair's lockstep holds at most ``scratch_cap`` bytes (the pipeline: 2 · C_max).

A bucket's two pieces of a matrix are neighbours (the cut between the partners falls inside
it), so a pair shares at most one matrix of each bucket. The result is laid out with
``dp.reorder`` (each bucket's parameters sorted by DP index, the shared one at the boundary
between its partners); a trainer whose buffers keep Megatron's order cannot use it
(``DPOptions.reorder`` off skips this stage).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from . import comm
from .dp.reorder import state_heavy, reorder_problem
from .dp.units import spread_cuts
from .hardware import HardwareProfile
from .planning import (BucketProblem, Cuts, DPProblem, PairShare, evaluate, pair_owners,
                       with_pairs)
from .formulas import lockstep_bytes
from .sharing import Run, lockstep_seconds, pair_link

__all__ = ["bundle_candidates", "bundle_pairs"]

Place = tuple[str, int]  # ("w", DP index): whole there; ("s", pair): shared by that pair


class _Search:
    """The placement of every matrix item: whole on a DP index or shared by a fixed pair."""

    def __init__(self, problem: DPProblem, pairs: Mapping[int, PairShare],
                 scratch_cap: int = 0) -> None:
        self.dp = problem.dp
        self.cap = scratch_cap  # a pair's lockstep scratch, bytes (0: unbounded)
        self.npairs = problem.dp // 2
        self.steps = problem.settings.ns_steps
        self.load: list[int] = []  # per item, whole
        self.piece: list[Run | None] = []  # (compute, exchanges, hidden) per partner
        self.key: list[tuple[int, int]] = []  # its bucket
        self.ref: list[tuple[tuple[int, int], int]] = []  # (bucket, item index in the bucket)
        self.task: list[int] = []  # its (first) task
        self.scratch: list[int] = []  # bytes its piece holds in a pair's lockstep
        for b in problem.buckets:
            for k, it in enumerate(b.items):
                if not it.atomic:
                    continue
                x = pairs.get(it.tasks[0]) if len(it.tasks) == 1 else None
                piece, scratch = None, 0
                if x is not None and x.alone_s > 0:
                    piece = x.run_piece()
                    m, n = max(problem.tasks[it.tasks[0]].shape), min(problem.tasks[it.tasks[0]].shape)
                    scratch = lockstep_bytes(-(-m // 2), n, 2, x.split_poly, 2)
                self.task.append(it.tasks[0])
                self.scratch.append(scratch)
                self.load.append(it.load)
                self.piece.append(piece)
                self.key.append((b.buffer, b.bucket))
                self.ref.append(((b.buffer, b.bucket), k))
        self.where: list[Place] = [("w", 0)] * len(self.load)
        self.own = [0.0] * self.dp
        self.whole: list[set[int]] = [set() for _ in range(self.dp)]
        self.shared: list[list[int]] = [[] for _ in range(self.npairs)]
        self.lock = [0.0] * self.npairs

    # -- costs -------------------------------------------------------------------------------
    def lockstep(self, items: list[int]) -> float:
        """A pair's lockstep over ``items`` (summed in item order, so that the same bundle
        always costs the same to the last bit)."""
        if not items:
            return 0.0
        return lockstep_seconds([self.piece[i] for i in sorted(items)],  # type: ignore[misc]
                                self.steps)

    def fits(self, items: list[int]) -> bool:
        """Whether a pair may share ``items``: every one has a piece, no two of one bucket (its
        two pieces are neighbours in the bucket), their scratch within the cap."""
        return all(self.piece[i] is not None for i in items) \
            and len({self.key[i] for i in items}) == len(items) \
            and (not self.cap or sum(self.scratch[i] for i in items) <= self.cap)

    def busiest(self) -> float:
        return max(self.cost(d) for d in range(self.dp))

    def cost(self, d: int) -> float:
        return self.own[d] + (self.lock[d // 2] if d < 2 * self.npairs else 0.0)

    def indices(self, place: Place) -> tuple[int, ...]:
        return (place[1],) if place[0] == "w" else (2 * place[1], 2 * place[1] + 1)

    def trial(self, ops: list[tuple[int, Place]]) -> dict[int, float] | None:
        """New loads of the DP indices ``ops`` touch (item → new place), or None when a pair
        could not share what it would hold (:meth:`fits`)."""
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

    def apply(self, ops: list[tuple[int, Place]]) -> None:
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

    def moves(self, top: int) -> list[list[tuple[int, Place]]]:
        """Moves and swaps that take work off DP index ``top``."""
        out: list[list[tuple[int, Place]]] = []
        here: list[int] = sorted(self.whole[top])
        if top < 2 * self.npairs:
            here += self.shared[top // 2]
        seen = set()
        for i in here:
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

    def improve(self, max_moves: int) -> None:
        for _ in range(max_moves):
            costs = [self.cost(d) for d in range(self.dp)]
            top = max(range(self.dp), key=lambda d: (costs[d], -d))
            ceiling = costs[top]
            best: tuple[float, float] | None = None
            chosen = None
            for ops in self.moves(top):
                got = self.trial(ops)
                if got is None:
                    continue
                worst = max(got.values())
                if worst >= ceiling * (1 - 1e-9):  # a real gain, not a rounding
                    continue
                score = (worst, sum(got.values()) - sum(costs[d] for d in got))
                if best is None or score < best:
                    best, chosen = score, ops
            if chosen is None:
                return
            self.apply(chosen)


def bundle_pairs(problem: DPProblem, pairs: Mapping[int, PairShare], hw: HardwareProfile, *,
                 scratch_cap: int = 0, max_moves: int = 5000,
                 pattern: bool = True) -> tuple[DPProblem, Cuts] | None:
    """A partition with DP pairs as bundles: (the reordered problem with the pairs it uses,
    its cuts), or None where it does not apply (not Muon, tp > 1, expert buffers, fewer than
    two DP indices, no candidate, partners (2s, 2s + 1) on two nodes) or shares nothing: of
    :func:`bundle_candidates`, the one whose busiest index is lightest (the heaviest-first
    start on a tie; None if that one shares nothing). ``scratch_cap``: bytes a pair's lockstep may hold (0: unbounded);
    ``pattern``: also start from the class-level ILP's patterns (``_pattern_start``)."""
    got = bundle_candidates(problem, pairs, hw, scratch_cap=scratch_cap, max_moves=max_moves,
                            pattern=pattern)
    best = None
    for busiest, layout in got:
        if best is None or busiest < best[0] * (1 - 1e-9):
            best = (busiest, layout)
    return None if best is None else best[1]


def bundle_candidates(problem: DPProblem, pairs: Mapping[int, PairShare], hw: HardwareProfile,
                      *, scratch_cap: int = 0, max_moves: int = 5000, pattern: bool = True
                      ) -> list[tuple[float, tuple[DPProblem, Cuts] | None]]:
    """Both starts of the bundle search, each searched, made whole where it may and laid out:
    heaviest first where the busiest index it touches ends lightest, and (``pattern``) the
    patterns of a class-level ILP. Per start (busiest index's load, (problem, cuts) or None
    where it shares nothing); an empty list where bundles do not apply (see
    :func:`bundle_pairs`). The caller judges them (``pipeline._solve_pairs`` by its
    objective: a start with a heavier busiest index may move fewer bytes)."""
    if problem.settings.name != "muon" or problem.sizes.tp != 1 or problem.dp < 2 or not pairs \
            or any(buf.expert for buf in problem.layout.buffers) \
            or pair_link(hw, (0, 1)) is not hw.intra_node or hw.gpus_per_node % 2:
        return []
    search = _Search(problem, pairs, scratch_cap)
    for i in sorted(range(len(search.load)), key=lambda i: (-search.load[i], i)):
        search.place(i)
    search.improve(max_moves)
    search.unshare()
    out = [(search.busiest(), _layout(problem, pairs, search, hw))]
    other = _pattern_start(problem, pairs, scratch_cap, search.busiest()) if pattern else None
    if other is not None:
        other.improve(max_moves)
        other.unshare()
        if other.where != search.where:
            out.append((other.busiest(), _layout(problem, pairs, other, hw)))
    return out


def _layout(problem: DPProblem, pairs: Mapping[int, PairShare], search: _Search,
            hw: HardwareProfile) -> tuple[DPProblem, Cuts] | None:
    """A search's placement laid out: each bucket's parameters by DP index, a shared one last
    among its first partner's (its second piece then opens the second partner's range); None
    where it shares nothing."""
    rank = {(b.buffer, b.bucket): [0] * len(b.items) for b in problem.buckets}
    last: dict[tuple[int, int], set[int]] = {}
    used: dict[int, PairShare] = {}
    for i, (key, k) in enumerate(search.ref):
        kind, at = search.where[i]
        rank[key][k] = at if kind == "w" else 2 * at
        if kind == "s":
            last.setdefault(key, set()).add(k)
            used[search.task[i]] = pairs[search.task[i]]
    if not used:
        return None
    rp, owners = reorder_problem(problem, rank, last=last)
    paired = with_pairs(rp, used)
    expanded: dict[tuple[int, int], list[int]] = {}
    for b, pb in zip(rp.buckets, paired.buckets):
        key = (b.buffer, b.bucket)
        ranks = iter(owners[key])
        out: list[int] = []
        for it in b.items:
            if not it.atomic:
                continue
            d = next(ranks)
            out += [d, d + 1] if len(it.tasks) == 1 and it.tasks[0] in used else [d]
        expanded[key] = out
    # the optimizer state's target of the plan without pairs (``solve.state_target``: its
    # largest whole matrix, not a piece, or 1.1 × the mean)
    from .solve import state_target

    cuts = _cheaper_cuts(paired, expanded, hw, state_target(problem))
    got = pair_owners(paired, cuts)
    for i, (kind, at) in enumerate(search.where):
        if kind == "s" and got[search.task[i]] != (2 * at, 2 * at + 1):
            raise RuntimeError(f"planner bug: task {search.task[i]}'s pieces are on DP indices "
                               f"{got[search.task[i]]}, not its partners {(2 * at, 2 * at + 1)}")
    return paired, cuts


def _compact_cuts(b: BucketProblem, owners: list[int]) -> tuple[int, ...]:
    """Cut points of bucket ``b`` given its matrices' ranks, the AdamW elements after a matrix
    on its rank (those before the first matrix on the first one's): the fewest non-empty
    slices, so the fewest per-root calls."""
    atomic = [it for it in b.items if it.atomic]
    cuts = [b.start]
    for r in range(1, b.ranks):
        if r <= owners[0]:
            cuts.append(b.start)
        else:
            cuts.append(next((it.start for it, d in zip(atomic, owners) if d >= r), b.end))
    return tuple(cuts) + (b.end,)


def _spread_over(b: BucketProblem, owners: list[int], width: int) -> tuple[int, ...]:
    """:func:`~canzona.planner.dp.units.spread_cuts` with the AdamW elements between two
    matrices (or a bucket end) shared by at most ``width`` ranks, the first of the range."""
    atomic = [it for it in b.items if it.atomic]
    cuts = [b.start] + [0] * (b.ranks - 1) + [b.end]
    prev_end, prev = b.start, 0
    for k in range(len(atomic) + 1):
        lo, hi = prev_end, atomic[k].start if k < len(atomic) else b.end
        nxt = owners[k] if k < len(atomic) else b.ranks - 1
        share = min(nxt - prev + 1, width)
        for r in range(prev + 1, nxt + 1):
            cuts[r] = lo + (hi - lo) * (r - prev) // share if r - prev < share else hi
        if k < len(atomic):
            prev_end, prev = atomic[k].end, nxt
    return tuple(cuts)


def _cheaper_cuts(problem: DPProblem, owners: dict[tuple[int, int], list[int]],
                  hw: HardwareProfile, cap: float) -> Cuts:
    """Per bucket, where its AdamW elements go given its matrices' owners, whichever the
    bucket's collectives take least time with (``comm.choose`` on the plan's DP link): spread
    over the ranks between their neighbours (as ZeRO-1 shares them: ``dp.units.spread_cuts``)
    or kept with a neighbouring matrix (fewest non-empty slices, so fewest per-root calls). A
    bucket holding a state-heavy AdamW tensor (an embedding) shares it among the first w ranks
    its neighbours leave (w a power of two, or all of them), the w whose collectives are
    shortest among those keeping every index's optimizer state under max(``cap``, what
    spreading it over all gives); such buckets in bucket order. The matrices' owners are the
    same either way. The choice is by the collectives alone: AdamW's compute is tiny beside
    the matrices' (the search does not count it either)."""
    _, link = comm.plan_link(hw, problem.sizes.dp, problem.sizes.tp)
    heavy = {(b.buffer, b.bucket) for b in state_heavy(problem)}

    def seconds(b: BucketProblem, c: tuple[int, ...]) -> float:
        buf = problem.layout.buffers[b.buffer]
        return comm.choose([y - x for x, y in zip(c, c[1:])],
                           grad_bytes=comm.ELEMENT_BYTES[buf.grad_dtype],
                           param_bytes=comm.ELEMENT_BYTES[buf.dtype], link=link).seconds

    out: Cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        spread = spread_cuts(b, owners[key])
        if not owners[key] or key in heavy:
            out[key] = spread  # heavy ones are narrowed below, given the others' state
            continue
        compact = _compact_cuts(b, owners[key])
        out[key] = compact if seconds(b, compact) < seconds(b, spread) else spread
    if not heavy:
        return out
    state = list(evaluate(problem, out).state_bytes)
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        if key not in heavy:
            continue
        alone = dataclasses.replace(problem, buckets=(b,))
        mine = evaluate(alone, {key: out[key]}).state_bytes
        rest = [x - y for x, y in zip(state, mine)]
        ceiling = max(cap, max(x + y for x, y in zip(rest, mine)))
        best = (seconds(b, out[key]), out[key], mine)
        width = 1
        while width < b.ranks:
            c = _spread_over(b, owners[key], width) if owners[key] else \
                tuple(min(b.start + (b.end - b.start) * r // width, b.end)
                      for r in range(b.ranks)) + (b.end,)
            got = evaluate(alone, {key: c}).state_bytes
            if max(x + y for x, y in zip(rest, got)) <= ceiling and seconds(b, c) < best[0]:
                best = (seconds(b, c), c, got)
            width *= 2
        out[key] = best[1]
        state = [x + y for x, y in zip(rest, best[2])]
    return out


#: The class-level ILP start runs for at most this many classes of alike matrices (bundles of
#: up to PATTERN_MOST of a class are enumerated: (PATTERN_MOST + 1) ** classes of them).
PATTERN_CLASSES = 6
PATTERN_MOST = 3
#: CP-SAT's deterministic time per ceiling tried (its own work units; 0.1–2 s of wall time
#: each here).
PATTERN_DETERMINISTIC_S = 2.0
#: A ceiling whose multisets of whole matrices per index outnumber this, or whose model would
#: have more (bundle, side) variables than PATTERN_VARIABLES, counts as undecided.
PATTERN_SIDES = 5_000
PATTERN_VARIABLES = 200_000


def _pattern_start(problem: DPProblem, pairs: Mapping[int, PairShare],
                   scratch_cap: int, ceiling: float | None = None) -> _Search | None:
    """A start from the patterns of a class-level ILP (alike matrices are one class): CP-SAT
    decides, for a ceiling, how many pairs hold each bundle (≤ PATTERN_MOST of a class, its
    scratch within the cap) and each partner which whole matrices beside it, every index under
    the ceiling (matrices only: AdamW, bucket order and the one-matrix-per-bucket rule aside);
    a bisection lowers the ceiling from ``ceiling`` (the other start's busiest index: only a
    lower one can win; None: twice the mean or the heaviest matrix). The patterns are then given real matrices, each bundle's
    from distinct buckets; what does not fit goes where ``_Search.place`` puts it. None where
    the classes are too many, dp is odd, or CP-SAT finds no pattern within its budget (a
    ceiling it does not decide in time counts as infeasible)."""
    import itertools

    from ortools.sat.python import cp_model

    search = _Search(problem, pairs, scratch_cap)
    if problem.dp % 2:
        return None
    classes: dict[tuple, list[int]] = {}
    for i in range(len(search.load)):
        classes.setdefault((search.load[i], search.piece[i], search.scratch[i]), []).append(i)
    keys = sorted(classes, key=lambda c: (-c[0], str(c[1:])))
    if len(keys) > PATTERN_CLASSES:
        return None
    count = [len(classes[k]) for k in keys]
    weight = [float(k[0]) for k in keys]
    shareable = [k[1] is not None for k in keys]
    bundles: list[tuple[tuple[int, ...], float]] = []
    for cnt in itertools.product(*(range(min(PATTERN_MOST, n) + 1) if sh else (0,)
                                   for n, sh in zip(count, shareable))):
        if scratch_cap and sum(c * k[2] for c, k in zip(cnt, keys)) > scratch_cap:
            continue
        pieces = [k[1] for c, k in zip(cnt, keys) for _ in range(c)]
        bundles.append((cnt, lockstep_seconds(pieces, search.steps) if pieces else 0.0))

    def sides(cap: float) -> list[tuple[tuple[int, ...], float]] | None:
        """Every multiset of whole matrices within ``cap`` (None: more than PATTERN_SIDES)."""
        out: list[tuple[tuple[int, ...], float]] = []

        def rec(j: int, cur: tuple[int, ...], load: float) -> None:
            if len(out) > PATTERN_SIDES:
                return
            if j == len(keys):
                out.append((cur, load))
                return
            n = 0
            while n <= count[j] and load + n * weight[j] <= cap:
                rec(j + 1, cur + (n,), load + n * weight[j])
                n += 1

        rec(0, (), 0.0)
        return out if len(out) <= PATTERN_SIDES else None

    def solve(cap: float) -> dict[tuple[int, int], int] | None:
        sd = sides(cap)
        if sd is None or len(sd) * len(bundles) > PATTERN_VARIABLES:
            return None
        m = cp_model.CpModel()
        n = {(b, x): m.NewIntVar(0, problem.dp, "") for b, (_, lock) in enumerate(bundles)
             for x, (_, w) in enumerate(sd) if lock + w <= cap}
        per = [m.NewIntVar(0, problem.dp // 2, "") for _ in bundles]
        of_bundle: list[list] = [[] for _ in bundles]
        for (b, _), v in n.items():
            of_bundle[b].append(v)
        for b in range(len(bundles)):
            m.Add(sum(of_bundle[b]) == 2 * per[b])
        m.Add(sum(n.values()) == problem.dp)
        for j in range(len(keys)):
            m.Add(sum(v * sd[x][0][j] for (_, x), v in n.items())
                  + sum(c * bundles[b][0][j] for b, c in enumerate(per)) == count[j])
        solver = cp_model.CpSolver()
        # one worker, a fixed seed and a deterministic time budget: the same plan on any
        # machine with the same OR-Tools (the wall-clock limit only guards against a
        # pathological case)
        solver.parameters.max_deterministic_time = PATTERN_DETERMINISTIC_S
        solver.parameters.max_time_in_seconds = 10.0
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        if solver.Solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return {(b, x): solver.Value(v) for (b, x), v in n.items() if solver.Value(v)}

    mean = problem.total / problem.dp
    lo = mean * 0.5
    hi = ceiling if ceiling is not None else max(mean * 2.0, 2.0 * max(weight, default=0.0))
    best = solve(hi)
    if best is None:
        return None
    for _ in range(10):
        mid = (lo + hi) / 2
        got = solve(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    # Materialise: each pair a bundle and two sides; the classes' matrices handed out in order.
    left = {k: list(classes[k]) for k in keys}
    slots: list[tuple[int, tuple[int, ...]]] = []  # (bundle, side) per index, pairs adjacent
    for (b, x), v in sorted(best.items()):
        slots += [(b, x)] * v
    by_bundle: dict[int, list[int]] = {}
    for b, x in slots:
        by_bundle.setdefault(b, []).append(x)
    sd = sides(hi)  # the sides ``best`` was solved with (best and hi change together)
    if sd is None:
        return None
    pair = 0
    for b in sorted(by_bundle):
        xs = by_bundle[b]
        for a in range(0, len(xs), 2):
            s_ = pair
            pair += 1
            for j, c in enumerate(bundles[b][0]):  # the bundle: matrices of distinct buckets
                for _ in range(c):
                    pick = next((i for i in left[keys[j]]
                                 if search.fits(search.shared[s_] + [i])), None)
                    if pick is None:
                        continue
                    left[keys[j]].remove(pick)
                    search.put(pick, ("s", s_))
            for d, x in ((2 * s_, xs[a]), (2 * s_ + 1, xs[a + 1])):
                for j, c in enumerate(sd[x][0]):
                    for _ in range(c):
                        if left[keys[j]]:
                            search.put(left[keys[j]].pop(0), ("w", d))
    rest = sorted((i for k in keys for i in left[k]), key=lambda i: (-search.load[i], i))
    for i in rest:
        search.place(i)
    return search


# -- tp > 1: a TP group's matrices, and halves shared with the partner index (k = 2·tp) --------


class _TPSearch:
    """tp > 1, Muon: every matrix item whole on a DP index — a piece of the index's lockstep
    where its TP group shares it (``problem.shared``), a micro-group task where a TP rank hosts
    it, every rank's where TP replicates it — or, for a task of ``pairs``
    (``sharing.tp_pair_decision``), shared by the fixed pair (2s, 2s + 1): a half in each
    partner's lockstep (k = 2·tp). An index costs its lockstep (its shared pieces and its
    pair's halves, halves first, in batches of ``cap`` scratch bytes as the runtime runs them:
    ``tp.context.Lockstep``; partners end the batches holding halves together), plus its
    hosted tasks packed on its TP ranks and its replicated ones; AdamW is left out (the layout
    spreads it). Same interface as :class:`_Search` for :func:`_layout` (``ref``, ``task``,
    ``where``)."""

    def __init__(self, problem: DPProblem, pairs: Mapping[int, PairShare], cap: int = 0,
                 force: bool = False) -> None:
        from .tp.context import TPContext, lockstep_piece

        self.force = force  # every task of ``pairs`` shared by a pair
        ctx = TPContext.build(problem, problem.comm_dtype)
        self.dp, self.npairs, self.tp, self.cap = problem.dp, problem.dp // 2, \
            problem.sizes.tp, cap
        k = 2 * self.tp
        self.ref: list[tuple[tuple[int, int], int]] = []
        self.task: list[int] = []
        self.key: list[tuple[int, int]] = []
        self.kind: list[str] = []  # "lock", "host" or "base"
        self.load: list[float] = []  # alone: a lock piece's recorded load, or the task's
        self.piece: list[tuple | None] = []  # its lockstep piece (whole, over the TP group)
        self.half: list[tuple | None] = []  # its half's piece (shared by a pair)
        for b in problem.buckets:
            for j, it in enumerate(b.items):
                if not it.atomic:
                    continue
                i = it.tasks[0]
                piece = half = None
                if len(it.tasks) == 1 and i in problem.shared:
                    kind, piece = "lock", lockstep_piece(problem, i)
                    load = piece[3]
                elif len(it.tasks) == 1 and ctx.split[i]:
                    kind, load = "host", float(problem.loads[i])
                else:
                    kind, load = "base", float(sum(problem.loads[t] for t in it.tasks))
                x = pairs.get(i) if len(it.tasks) == 1 else None
                if x is not None and x.alone_s > 0:
                    comp, comm, hidden = x.run_piece()
                    m, n = max(problem.tasks[i].shape), min(problem.tasks[i].shape)
                    half = (i, comp, comm, float(x.loads[0]),
                            lockstep_bytes(-(-m // k), n, k, x.split_poly, 2), hidden)
                self.ref.append(((b.buffer, b.bucket), j))
                self.task.append(i)
                self.key.append((b.buffer, b.bucket))
                self.kind.append(kind)
                self.load.append(load)
                self.piece.append(piece)
                self.half.append(half)
        self.where: list[Place] = [("w", 0)] * len(self.load)
        self.whole: list[list[int]] = [[] for _ in range(self.dp)]
        self.shared: list[list[int]] = [[] for _ in range(self.npairs)]
        self.costs = [0.0] * self.dp

    # -- costs -------------------------------------------------------------------------------
    def _lock(self, whole: list[int], halves: list[int]) -> tuple[float, float]:
        """An index's lockstep: its pair's halves first, then its own shared pieces, in task
        order (``runtime.tp``): (the batches holding a half, the others)."""
        from .tp.context import HALF, Lockstep

        lock = Lockstep(self.cap)
        for i in halves:
            x = self.half[i]
            lock.add((x[0] - HALF, *x[1:]))  # type: ignore[index]
        for i in whole:
            if self.kind[i] == "lock":
                lock.add(self.piece[i])  # type: ignore[arg-type]
        return lock.split()

    def _rest(self, whole: list[int]) -> float:
        from .tp.context import lpt_makespan

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
        for d in ds:
            w = whole.get(d, self.whole[d])
            s = d // 2
            h = shared.get(s, self.shared[s]) if s < self.npairs else []
            lock[d] = (*self._lock(w, h), self._rest(w))
        for d in ds:
            halves, own, rest = lock[d]
            if halves and (d ^ 1) in lock:  # partners end the batches holding halves together
                halves = max(halves, lock[d ^ 1][0])
            out[d] = halves + own + rest
        return out

    def busiest(self) -> float:
        return max(self.costs)

    def fits(self, s: int, items: list[int]) -> bool:
        """A pair shares at most one matrix of a bucket (its pieces are neighbours there)."""
        return len({self.key[i] for i in items}) == len(items)

    def trial(self, ops: list[tuple[int, Place]]) -> dict[int, float] | None:
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
        if not all(self.fits(s, got) for s, got in shared.items()):
            return None
        return self._costs(whole, shared, touched)

    def apply(self, ops: list[tuple[int, Place]]) -> None:
        got = self.trial(ops)
        assert got is not None
        for i, new in ops:
            old = self.where[i]
            (self.whole[old[1]] if old[0] == "w" else self.shared[old[1]]).remove(i)
            (self.whole[new[1]] if new[0] == "w" else self.shared[new[1]]).append(i)
            self.where[i] = new
        for d, c in got.items():
            self.costs[d] = c

    # -- construction and search -------------------------------------------------------------
    def start(self) -> None:
        """Heaviest first, each where the busiest index it touches ends lightest (whole on an
        index, or shared by a pair; ties: whole, the lower index)."""
        order = sorted(range(len(self.load)), key=lambda i: (-self.load[i], i))
        self.where = [("w", -1)] * len(self.load)
        for i in order:
            best = None
            options: list[Place] = [] if self.force and self.half[i] is not None else \
                [("w", d) for d in range(self.dp)]
            if self.half[i] is not None:
                options += [("s", s) for s in range(self.npairs)
                            if self.fits(s, self.shared[s] + [i])]
            if not options:  # forced, but every pair shares a matrix of its bucket already
                options = [("w", d) for d in range(self.dp)]
            for place in options:
                if place[0] == "w":
                    got = self._costs({place[1]: self.whole[place[1]] + [i]}, {}, {place[1]})
                else:
                    got = self._costs({}, {place[1]: self.shared[place[1]] + [i]},
                                      {2 * place[1], 2 * place[1] + 1})
                score = (max(got.values()), place[0] == "s", place[1])
                if best is None or score < best[0]:
                    best = (score, place, got)
            _, place, got = best  # type: ignore[misc]
            (self.whole[place[1]] if place[0] == "w" else self.shared[place[1]]).append(i)
            self.where[i] = place
            for d, c in got.items():
                self.costs[d] = c

    def improve(self, max_moves: int) -> None:
        """Moves off the busiest index while they lower it (alike items and alike indices
        tried once), and where none does, exchanges (:meth:`_swap`)."""
        for _ in range(max_moves):
            top = max(range(self.dp), key=lambda d: (self.costs[d], -d))
            ceiling = self.costs[top]
            here = list(self.whole[top])
            if top < 2 * self.npairs:
                here += self.shared[top // 2]
            best = None
            tried = set()
            for i in here:
                sig = (self.kind[i], self.load[i], self.half[i] is not None, self.where[i][0])
                if sig in tried:
                    continue
                tried.add(sig)
                places: list[Place] = []
                seen = set()
                for d in range(0 if self.force and self.half[i] is not None else self.dp):
                    alike = (tuple(sorted((self.kind[j], self.load[j]) for j in self.whole[d])),
                             tuple(sorted(self.load[j] for j in self.shared[d // 2]))
                             if d < 2 * self.npairs else (), round(self.costs[d], 6))
                    if ("w", d) != self.where[i] and alike not in seen:
                        seen.add(alike)
                        places.append(("w", d))
                if self.half[i] is not None:
                    seen = set()
                    for s in range(self.npairs):
                        alike = (tuple(sorted((self.kind[j], self.load[j])
                                              for d in (2 * s, 2 * s + 1) for j in self.whole[d])),
                                 tuple(sorted(self.load[j] for j in self.shared[s])))
                        if ("s", s) != self.where[i] and alike not in seen:
                            seen.add(alike)
                            places.append(("s", s))
                for place in places:
                    got = self.trial([(i, place)])
                    if got is None:
                        continue
                    worst = max(got.values())
                    if worst >= ceiling * (1 - 1e-9):
                        continue
                    score = (worst, sum(got.values()))
                    if best is None or score < best[0]:
                        best = (score, [(i, place)])
            if best is None:
                best = self._swap(top, here, ceiling)
            if best is None:
                return
            self.apply(best[1])

    def _swaps(self, items: list[int], ceiling: float, strict: bool, onto: int | None = None,
               near: tuple[int, ...] = ()
               ) -> list[tuple[tuple[float, float], list[tuple[int, Place]], set[int]]]:
        """Exchanges of one of ``items`` with an unlike item elsewhere, and (``onto``) moves of
        an item elsewhere onto that index (a piece beside a pair's half hides its exchanges),
        that leave every index they touch under ``ceiling`` (``strict``) or not above it:
        (score, the ops, the indices they touch), best first. Alike items and alike places
        are tried once (a place on one of the ``near`` indices is never alike one elsewhere);
        a forced task stays shared, a task without a half whole."""
        def allowed(i: int, place: Place) -> bool:
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

        def consider(ops: list[tuple[int, Place]]) -> None:
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

    def _swap(self, top: int, here: list[int], ceiling: float
              ) -> tuple[tuple[float, float], list[tuple[int, Place]]] | None:
        """Where no move off the busiest index lowers it: the best exchange of one of its items
        with an unlike one elsewhere (a QKV beside a pair's half for a lighter proj: what
        moves alone cannot reach). Where partners end their halves together, both may have
        to change: an exchange, or an item brought beside the half, that leaves every index it
        touches no heavier, then one on the partner after which every index either touches
        is under the ceiling (the first few of each tried; the first is undone otherwise)."""
        partner = top ^ 1
        got = self._swaps(here, ceiling, strict=True, near=(top, partner))
        if got:
            return got[0][:2]
        if top >= 2 * self.npairs or not self.shared[top // 2]:
            return None
        limit = ceiling * (1 - 1e-9)
        for _, first, touched in self._swaps(list(self.whole[top]), ceiling, False, onto=top,
                                             near=(top, partner))[:4]:
            back = [(i, self.where[i]) for i, _ in first]
            self.apply(first)
            for score, second, also in self._swaps(list(self.whole[partner]), ceiling, True,
                                                   onto=partner, near=(top, partner)):
                if all(self.costs[d] < limit for d in touched - also):
                    return score, second  # the first stays; the caller applies the second
            self.apply(back)
        return None


def tp_bundle_candidate(problem: DPProblem, pairs: Mapping[int, PairShare],
                        hw: HardwareProfile, *, scratch_cap: int = 0, max_moves: int = 2000,
                        force: bool = False) -> tuple[float, tuple[DPProblem, Cuts] | None]:
    """tp > 1, Muon (``problem.shared``: the tasks TP groups share): a placement with the
    ``pairs`` (``sharing.tp_pair_decision``) shared by fixed partner indices (:class:`_TPSearch`,
    heaviest first, then moves and exchanges off the busiest index; ``force``: every one of
    them shared, which needs a bucket per pair and task: more pairs than that are left whole),
    laid out as :func:`_layout` does (each bucket by DP index, a shared matrix's TP shards cut
    between its partners). Returns (the
    search's busiest index, (the reordered problem with the pairs used, its cuts) or None
    where it shares nothing). ``pipeline.tp_pair_candidates`` offers it to the pipeline."""
    if problem.settings.name != "muon" or problem.sizes.tp == 1 or problem.dp < 2 or not pairs \
            or any(buf.expert for buf in problem.layout.buffers):
        return 0.0, None
    search = _TPSearch(problem, pairs, scratch_cap, force)
    search.start()
    search.improve(max_moves)
    return search.busiest(), _layout(problem, pairs, search, hw)  # type: ignore[arg-type]
