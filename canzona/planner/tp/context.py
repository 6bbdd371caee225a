"""Per-task TP facts (:class:`TPContext`) and the per-GPU objective the DP side
reads: each DP index's work (:func:`index_work`), its busiest GPU after LPT packing
(:func:`index_gpu_max`) and the bound LB_gpu (:func:`lb_gpu`)."""

from __future__ import annotations

from bisect import bisect_right

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..alike import Kept
from ..cost import DTYPE_BYTES
from ..dp.bounds import bin_packing_bound
from ..errors import CanzonaError
from ..formulas import lockstep_bytes, sub_round_bytes
from ..planning import (BucketProblem, Cuts, DPProblem, PairShare, SubRound, coupled,
                        equal_cuts, owner_of)
from ..shards import ShardMap, shard_map


# --- per-task TP facts ----------------------------------------------------------------------------


@dataclass(slots=True)
class TPContext:
    """Per-task facts the TP schedule needs, computed once per problem.

    ``split[i]``: task i is a matrix task whose parameter TP splits (it needs a host);
    ``one_rank[i]``: task i is a matrix lying whole on one TP rank of a parameter TP splits (a
    head of a fused QKV, ``heads``): computed there, nothing gathered, and every TP rank of an
    index holds as many of a weight's heads as the others;
    ``gathered[i]``: bytes of its full matrix in the comm dtype; ``layout[i]``: index into
    ``maps`` (distinct shard maps), so ``maps[layout[i]].sent_numel(t)`` is what rank t sends
    (:meth:`sent`: every rank's, kept per map).
    """

    problem: DPProblem
    comm_dtype: str
    split: list[bool]
    gathered: list[int]
    layout: list[int]
    maps: list[ShardMap]
    tp_of: list[int]
    one_rank: list[bool] = field(default_factory=list)
    _map_index: dict = field(default_factory=dict)
    _sent: dict = field(default_factory=dict)

    def sent(self, i: int, tp: int) -> tuple[int, ...]:
        """What each of ``tp`` ranks sends to gather task i's matrix (``ShardMap.sent_numel``),
        computed once per shard map."""
        k = self.layout[i]
        got = self._sent.get((k, tp))
        if got is None:
            m = self.maps[k]
            got = self._sent[(k, tp)] = tuple(m.sent_numel(t) for t in range(tp))
        return got

    def each_rank(self, i: int, x: float) -> float:
        """What each TP rank of its owner carries of ``x`` (task i's load, FLOPs or seconds) when
        task i is not hosted: all of it for a replicated matrix, 1/tp of a weight's heads."""
        return x / self.tp_of[i] if self.one_rank[i] else x

    @classmethod
    def build(cls, problem: DPProblem, comm_dtype: str = "bf16") -> TPContext:
        if comm_dtype not in DTYPE_BYTES:
            raise CanzonaError(f"unknown comm dtype '{comm_dtype}'; choose one of: "
                               f"{', '.join(DTYPE_BYTES)}.")
        spec, sizes = problem.spec, problem.sizes
        c = _BUILT.get((problem.tasks, spec), (sizes, comm_dtype))
        if c is not None:  # the same tasks of the same model: the facts are theirs (read only)
            return cls(problem, comm_dtype, c.split, c.gathered, c.layout, c.maps, c.tp_of,
                       c.one_rank, c._map_index)
        ctx = cls(problem, comm_dtype, [], [], [], [], [])
        kv = spec.config.kv_heads if spec.config is not None else None  # qkv layouts only
        for t in problem.tasks:
            p = spec[t.param]
            tp = sizes.expert_tp if p.is_expert else sizes.tp
            ctx.tp_of.append(tp)
            is_split = t.optimizer == "matrix" and t.tp_split
            ctx.split.append(is_split)
            ctx.one_rank.append(t.optimizer == "matrix" and not t.tp_split and tp > 1
                                and p.tp_layout != "replicated")
            if not is_split:
                ctx.gathered.append(0)
                ctx.layout.append(-1)
                continue
            key = (p.shape, p.tp_layout, p.parts, t.part, tp)
            k = ctx._map_index.get(key)
            if k is None:
                k = len(ctx.maps)
                ctx._map_index[key] = k
                ctx.maps.append(shard_map(p, tp, kv_groups=kv, part=t.part))
            ctx.layout.append(k)
            ctx.gathered.append(ctx.maps[k].full_numel * DTYPE_BYTES[comm_dtype])
        return _BUILT.put((problem.tasks, spec), (sizes, comm_dtype), ctx)


#: Contexts by the tasks and spec they read, sizes and comm dtype: the candidates of one plan
#: are problems with the same tasks (what they share differs).
_BUILT = Kept(8)


def _item_gpu_load(problem: DPProblem, item_task: int, load: int, tp: int) -> float:
    """Per-GPU share of an element-wise (AdamW) load: split parameters are sharded over TP,
    replicated ones are computed by every rank."""
    return load / tp if problem.tasks[item_task].tp_split else float(load)


def index_work(problem: DPProblem, cuts: Cuts, ctx: TPContext | None = None
               ) -> tuple[list[float], list[list[int]], list[list[float]] | None]:
    """Per DP index: the load every TP rank carries anyway (AdamW shards, replicated matrices,
    its piece of every task the TP group shares, alone or with a partner index:
    ``problem.pairs`` at tp > 1, its share of the heads of a fused QKV it owns), the TP-split
    matrix tasks it owns and must host (ids,
    ascending), and the load pinned to one TP rank (per index, per TP rank: expert weights at
    expert TP 1 under tp > 1, whole on the one GPU that holds them), None when there is none.

    The last few results are kept (the stages ask for the same cuts again); each caller gets its
    own lists."""
    ctx = ctx or TPContext.build(problem)
    key = tuple(cuts.items())
    facts = (problem, ctx.split, ctx.one_rank, ctx.tp_of)  # what it reads (contexts share them)
    try:
        got = _WORK.get(facts, key)
    except TypeError:  # cut points in lists: not kept
        got = _index_work(problem, cuts, ctx)
    else:
        if got is None:
            got = _WORK.put(facts, key, _index_work(problem, cuts, ctx))
    base, owned, pinned = got  # type: ignore[misc]
    return (list(base), [list(x) for x in owned],
            None if pinned is None else [list(x) for x in pinned])


#: :func:`index_work`'s results by problem, context and cuts.
_WORK = Kept(16)


def _index_work(problem: DPProblem, cuts: Cuts, ctx: TPContext
                ) -> tuple[list[float], list[list[int]], list[list[float]] | None]:
    dp = problem.dp
    base = [0.0] * dp
    owned: list[list[int]] = [[] for _ in range(dp)]
    pinned: list[list[float]] | None = None
    facts = (problem, ctx.split, ctx.one_rank, ctx.tp_of)
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        key = tuple(c)
        got = _BUCKET_WORK.get((*facts, b), key)
        if got is None:
            got = _BUCKET_WORK.put((*facts, b), key, _bucket_work(problem, b, c, ctx))
        adds, hosts, pins = got  # type: ignore[misc]
        for d, x in adds:  # in the order met: the sums are the same floats
            base[d] += x
        for d, i in hosts:
            owned[d].append(i)
        if pins is not None:
            if pinned is None:
                pinned = [[0.0] * problem.sizes.tp for _ in range(dp)]
            for d, t, x in pins:
                pinned[d][t] += x
    for ids in owned:
        ids.sort()
    return base, owned, pinned


#: A bucket's part of :func:`index_work` (:func:`_bucket_work`) by the facts it reads, the bucket
#: and its cut points: most buckets keep their cuts from one stage to the next.
_BUCKET_WORK = Kept(8192)


def _bucket_work(problem: DPProblem, b: BucketProblem, c: Sequence[int], ctx: TPContext
                 ) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, int], ...],
                            tuple[tuple[int, int, float], ...] | None]:
    """What bucket ``b`` cut at ``c`` adds to :func:`index_work`, in the order met: (DP index,
    load every TP rank carries), (DP index, task it hosts), and (DP index, TP rank, load pinned
    there) for an expert bucket at expert TP 1 (else None)."""
    ix = problem.dp_indices(b)
    top = len(c) - 2
    pin = problem.tp_rank(b, 0) is not None
    adds: list[tuple[int, float]] = []
    hosts: list[tuple[int, int]] = []
    pins: list[tuple[int, int, float]] = []
    for it in b.items:
        first = min(max(bisect_right(c, it.start) - 1, 0), top)  # owner_of, inlined
        if it.atomic:
            d = ix[first]
            for i in it.tasks:
                if pin:  # whole on the one GPU that holds it
                    pins.append((d, problem.tp_rank(b, first), problem.loads[i]))  # type: ignore
                elif i in problem.pairs and ctx.split[i]:  # its half, every TP rank
                    adds.append((d, it.load))
                elif i in problem.shared:  # every TP rank of d computes its piece
                    adds.append((d, problem.shared[i][0]))
                elif ctx.split[i]:
                    hosts.append((d, i))
                elif ctx.one_rank[i]:  # whole on one rank; each rank holds 1/tp of them
                    adds.append((d, ctx.each_rank(i, problem.loads[i])))
                else:  # replicated (or tp = 1): the whole matrix on every rank of d
                    adds.append((d, problem.loads[i]))
            continue
        last = owner_of(c, it.end - 1)
        n = it.end - it.start
        tp = ctx.tp_of[it.tasks[0]]
        for r in range(first, last + 1):
            lo, hi = max(it.start, c[r]), min(it.end, c[r + 1])
            if hi > lo:
                share = it.load * (hi - lo) // n
                if pin:
                    pins.append((ix[r], problem.tp_rank(b, r), share))  # type: ignore[arg-type]
                else:
                    adds.append((ix[r], _item_gpu_load(problem, it.tasks[0], share, tp)))
    return tuple(adds), tuple(hosts), tuple(pins) if pin else None


def has_pinned(problem: DPProblem) -> bool:
    """Whether any load is pinned to one TP rank (:func:`index_work`): expert buckets at expert
    TP 1 under tp > 1."""
    return any(problem.tp_rank(b, 0) is not None for b in problem.buckets)


def pinned_at(pinned: list[list[float]] | None, d: int, tp: int) -> list[float]:
    """DP index ``d``'s pinned load per TP rank (:func:`index_work`), zeros when none."""
    return list(pinned[d]) if pinned is not None else [0.0] * tp


# --- shared tasks in lockstep ---------------------------------------------------------------------


#: One shared piece as its DP index's lockstep sees it: (order key: the task id, compute,
#: collectives, recorded load, scratch bytes, collectives beside its own Gram products), in
#: cost units but for the bytes. A half shared with a partner index is keyed task − HALF (the
#: runtime runs the halves first).
Piece = tuple[int, float, float, float, int, float]
HALF = 1 << 40


def lockstep_scratch(problem: DPProblem, task: int) -> int:
    """Scratch bytes a task its TP group shares holds in a lockstep batch
    (``formulas.lockstep_bytes`` of its piece: its rows of the oriented matrix, bf16): what the
    TP schedule batches by and what :class:`Lockstep` models."""
    if not problem.settings.spec.gram_shared:  # blocks apart, shard by shard: state only
        return 0
    t = problem.tasks[task]
    tp = problem.sizes.tp
    m, n = max(t.shape), min(t.shape)
    return lockstep_bytes(-(-m // tp), n, tp, problem.shared[task][1], 2)


def round_piece(problem: DPProblem, r: SubRound) -> Piece:
    """A round of TP sub-groups (``problem.rounds``) as its DP index's lockstep sees it: one
    piece on every TP rank, keyed by its first task, its scratch the sub-group's rows and the
    buffers that gather and return them (``formulas.sub_round_bytes``)."""
    t = problem.tasks[r.tasks[0]]
    m, n = max(t.shape), min(t.shape)
    comp, comm, hidden = r.run_piece()
    nbytes = sub_round_bytes(m, n, problem.sizes.tp, r.k, r.split_poly, 2) \
        if problem.settings.spec.gram_shared else 0
    return (r.tasks[0], comp, comm, r.load, nbytes, hidden)


def lockstep_piece(problem: DPProblem, task: int) -> Piece:
    """A task its TP group shares (``problem.shared``): its piece on every TP rank, as the
    lockstep phase sees it (compute and collectives in cost units: its recorded load is the
    longer of the two; the scratch it holds, ``formulas.lockstep_bytes``); a task of a round
    of TP sub-groups: the round's (:func:`round_piece`)."""
    r = problem.rounds.get(task)
    if r is not None:
        return round_piece(problem, r)
    load, _, comp, comm, hidden = problem.shared[task]
    longest = max(comp, comm)
    per_s = load / longest if longest > 0 else 0.0
    return (task, comp * per_s, comm * per_s, load, lockstep_scratch(problem, task),
            hidden * per_s)


#: A shared piece as a lockstep meets it: seconds of its compute, of its collectives, and of
#: those that run beside its own Gram products (``sharing.ShareOption.hidden_s``), all steps.
Run = tuple[float, float, float]


def lockstep_seconds(pieces: list[Run], steps: int) -> float:
    """Seconds of the shared matrices of one group run in lockstep
    (``runtime.optim.shared_ns.shared_newton_schulz_many``), from each one's (compute,
    collectives, hidden) seconds per rank over all ``steps`` (:data:`Run`): per iteration the
    collectives run one after another beside the compute, so an iteration takes
    max(Σ compute, Σ collectives + the least compute any piece does outside its own
    collectives, the longest piece's own chain) — a piece's chain is its compute plus what its
    Gram products do not hide of its collectives: the others' compute fills its waits but
    cannot shorten it (its next iteration needs its reduced Gram). With one matrix that is the
    whole of it. With several it is a model, as the shortest compute was before the chunks:
    what cannot overlap in the runtime's fixed order is the first matrix's first chunk and the
    last one's work after its Gram, which the least over the pieces may understate."""
    if not pieces:
        return 0.0
    comp = sum(c for c, _, _ in pieces) / steps
    comm = sum(a for _, a, _ in pieces) / steps
    first = min(c - h for c, _, h in pieces) / steps
    chain = max(c + a - h for c, a, h in pieces) / steps
    return steps * max(comp, comm + first, chain)


@dataclass(slots=True)
class Lockstep:
    """The shared pieces of one DP index, as the runtime runs them: in task order, cut into
    batches whose scratch fits ``cap`` (``formulas.lockstep_batches``; 0: one batch), each batch
    in lockstep, each piece's collectives beside the others' compute
    (:func:`lockstep_seconds`: per iteration the longest of Σ compute, Σ collectives + the
    least compute a piece does outside its own collectives, and each piece's own chain, its
    compute and what its Gram products do not hide of its collectives). ``pieces``: Σ of their
    recorded loads (what :func:`index_work` counts)."""

    cap: int = 0
    items: list[Piece] = field(default_factory=list)
    pieces: float = 0.0
    compute: float = 0.0  # Σ over the items, and the least compute: one batch in O(1)
    comm: float = 0.0
    shortest: float = math.inf
    nbytes: int = 0
    chain: float = 0.0  # the longest piece's own chain, compute + unhidden collectives

    def add(self, piece: Piece) -> None:
        self.items.append(piece)
        self.pieces += piece[3]
        self.compute += piece[1]
        self.comm += piece[2]
        self.shortest = min(self.shortest, piece[1] - piece[5])
        self.nbytes += piece[4]
        self.chain = max(self.chain, piece[1] + piece[2] - piece[5])

    def split(self) -> tuple[float, float]:
        """The phase's load in the batches holding a half shared with a partner (keyed below
        0: they come first; the partners run them together) and in the others."""
        if not self.items:
            return 0.0, 0.0
        if not any(x[0] < 0 for x in self.items):
            return 0.0, self.load()
        first = rest = 0.0
        comp = comm = chain = 0.0
        least = math.inf
        held = self.cap + 1 if self.cap and self.nbytes > self.cap else -math.inf
        halves = False
        for key, c, a, _, b, h in sorted(self.items):
            if held == -math.inf or held + b <= self.cap:
                comp, comm, least = comp + c, comm + a, min(least, c - h)
                chain = max(chain, c + a - h)
                held = held + b if held != -math.inf else held
                halves = halves or key < 0
                continue
            if least != math.inf:
                t = max(comp, comm + least, chain)
                first, rest = (first + t, rest) if halves else (first, rest + t)
            comp, comm, least, chain, held, halves = c, a, c - h, c + a - h, b, key < 0
        t = max(comp, comm + least, chain)
        return (first + t, rest) if halves else (first, rest + t)

    def load(self) -> float:
        """The phase's load (0 without pieces)."""
        if not self.items:
            return 0.0
        return _phase(self.cap, self.items, self.compute, self.comm, self.shortest,
                      self.nbytes, self.chain)

    def loads_with(self, runs: Sequence[Sequence[Piece]]) -> list[float]:
        """The phase's load as it is and after each of ``runs`` joins it in turn: what
        :meth:`add` and :meth:`load` give on a copy, without one (the joint refinement's
        columns)."""
        out = [self.load()]
        items = list(self.items)
        compute, comm, shortest = self.compute, self.comm, self.shortest
        nbytes, chain = self.nbytes, self.chain
        for run in runs:
            if run:
                for x in run:  # (as add)
                    items.append(x)
                    compute += x[1]
                    comm += x[2]
                    shortest = min(shortest, x[1] - x[5])
                    nbytes += x[4]
                    chain = max(chain, x[1] + x[2] - x[5])
                out.append(_phase(self.cap, items, compute, comm, shortest, nbytes, chain))
            else:
                out.append(out[-1])
        return out


def _phase(cap: int, items: list[Piece], compute: float, comm: float, shortest: float,
           nbytes: int, chain: float) -> float:
    """:meth:`Lockstep.load` of pieces ``items`` (at least one) with these sums."""
    if not cap or nbytes <= cap:  # one batch
        return max(compute, comm + shortest, chain)
    # several batches: kept by the pieces (the joint refinement meets the same ones often)
    key = (cap, tuple(items))
    got = _BATCHED.get(key)
    if got is None:
        if len(_BATCHED) > 200_000:
            _BATCHED.clear()
        got = _BATCHED[key] = _batched(cap, items)
    return got


def _batched(cap: int, items: list[Piece]) -> float:
    # formulas.lockstep_batches over the pieces in task order, each batch's phase summed
    # (written out: the joint refinement calls this in its innermost loop)
    out = 0.0
    comp = comm = chain = 0.0
    least = math.inf
    held = cap + 1  # the first piece opens a batch
    for _, c, a, _, b, h in sorted(items):
        if held + b <= cap:
            comp += c
            comm += a
            least = min(least, c - h)
            chain = max(chain, c + a - h)
            held += b
        else:
            if least != math.inf:
                out += max(comp, comm + least, chain)
            comp, comm, least, chain, held = c, a, c - h, c + a - h, b
    return out + max(comp, comm + least, chain)


#: :meth:`Lockstep.load` of several batches, by cap and pieces.
_BATCHED: dict[tuple, float] = {}


def shared_by_index(problem: DPProblem, cuts: Cuts) -> list[list[int]]:
    """Per DP index, the ids of the tasks its TP group shares (``problem.shared``); the last few
    are kept, and each caller gets its own lists."""
    if not problem.shared:
        return [[] for _ in range(problem.dp)]
    key = tuple(cuts.items())
    try:
        got = _SHARED.get((problem,), key)
    except TypeError:  # cut points in lists: not kept
        got = _shared_by_index(problem, cuts)
    else:
        if got is None:
            got = _SHARED.put((problem,), key, _shared_by_index(problem, cuts))
    return [list(x) for x in got]  # type: ignore[union-attr]


#: :func:`shared_by_index`'s results by problem and cuts.
_SHARED = Kept(16)


def _shared_by_index(problem: DPProblem, cuts: Cuts) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(problem.dp)]
    shared, pairs, paired = problem.shared, problem.pairs, problem.sizes.tp > 1
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        ix = problem.dp_indices(b)
        for it in b.items:
            if it.atomic:  # (a task two indices share is in their pair pieces instead)
                got = [i for i in it.tasks if i in shared and not (i in pairs and paired)]
                if got:
                    out[ix[owner_of(c, it.start)]] += got
    return out


def half_bytes(problem: DPProblem, task: int, split: bool) -> int:
    """Scratch bytes a half of ``task`` shared with a partner index holds in a lockstep batch
    (its rows over k = 2·tp, ``formulas.lockstep_bytes``, bf16)."""
    t = problem.tasks[task]
    m, n = max(t.shape), min(t.shape)
    k = 2 * problem.sizes.tp
    return lockstep_bytes(-(-m // k), n, k, split, 2)


def half_piece(problem: DPProblem, task: int, x: PairShare) -> Piece:
    """A half of ``task`` that two TP groups share (``x``) as a lockstep sees it, keyed by the
    task (the caller keys it below 0 where halves come first)."""
    comp, comm, hidden = x.run_piece()
    return (task, comp, comm, float(x.loads[0]), half_bytes(problem, task, x.split_poly),
            hidden)


def pair_pieces(problem: DPProblem, cuts: Cuts) -> tuple[list[list[Piece]], list[set[int]]]:
    """At tp > 1, the halves of the tasks two TP groups share (``problem.pairs``, k = 2·tp):
    per DP index its halves as its lockstep sees them (keyed task − :data:`HALF`: first; the
    recorded load is the piece's, its compute, collectives and hidden seconds converted at
    load / seconds alone), and per DP index the indices it shares a task with (its pieces'
    owners but itself)."""
    out: list[list[Piece]] = [[] for _ in range(problem.dp)]
    partners: list[set[int]] = [set() for _ in range(problem.dp)]
    if not problem.pairs or problem.sizes.tp == 1:
        return out, partners
    where: dict[int, list[int]] = {}
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        for it in b.items:
            if not it.atomic or len(it.tasks) != 1 or it.tasks[0] not in problem.pairs:
                continue
            i = it.tasks[0]
            x = problem.pairs[i]
            d = problem.dp_index(b, owner_of(c, it.start))
            comp, comm, hidden = x.run_piece()
            out[d].append((i - HALF, comp, comm, it.load, half_bytes(problem, i, x.split_poly),
                           hidden))
            where.setdefault(i, []).append(d)
    for ds in where.values():
        for d in ds:
            partners[d].update(e for e in ds if e != d)
    return out, partners


def index_lockstep(problem: DPProblem, cuts: Cuts) -> list[Lockstep]:
    """Per DP index, the tasks its TP group shares, in lockstep (:class:`Lockstep`); a round of
    TP sub-groups one piece (its first task's)."""
    out = [Lockstep(problem.lockstep_cap) for _ in range(problem.dp)]
    rounds = problem.rounds
    for d, ids in enumerate(shared_by_index(problem, cuts)):
        for i in ids:
            if i in rounds and rounds[i].tasks[0] != i:
                continue
            out[d].add(lockstep_piece(problem, i))
    return out


def index_halves(problem: DPProblem, cuts: Cuts) -> tuple[list[Lockstep], list[set[int]]]:
    """At tp > 1, per DP index its whole lockstep: its halves of the tasks it shares with a
    partner index first (``runtime.tp_shared``), then the tasks its TP group shares; and its
    partners (:func:`pair_pieces`)."""
    pieces, partners = pair_pieces(problem, cuts)
    out = index_lockstep(problem, cuts)
    for d, xs in enumerate(pieces):
        for x in xs:
            out[d].add(x)
    return out, partners


def lpt_bins(loads: Sequence[int], tp: int) -> list[int]:
    """Longest-processing-time packing of ``loads`` on ``tp`` ranks: every rank's load."""
    heap = [0] * max(1, tp)
    for x in sorted(loads, reverse=True):
        heapq.heapreplace(heap, heap[0] + x)
    return heap


def lpt_makespan(loads: Sequence[int], tp: int, start: Sequence[float] | None = None) -> float:
    """Longest-processing-time packing of ``loads`` on ``tp`` ranks that already carry
    ``start`` (default: nothing): the busiest rank's load."""
    if tp <= 1:
        return sum(loads) + (start[0] if start else 0)
    heap = list(start) if start else [0] * tp
    heapq.heapify(heap)
    for x in sorted(loads, reverse=True):
        heapq.heapreplace(heap, heap[0] + x)
    return max(heap)


# --- the per-GPU objective and bounds -------------------------------------------------------------


def lb_gpu(problem: DPProblem, grid: list[list[int]] | None = None,
           ctx: TPContext | None = None) -> int:
    """LB_gpu = max(⌈total per-GPU work / (dp·tp)⌉, largest task).

    The per-GPU total counts AdamW on shards and replicated matrices on every TP rank (work any
    schedule must do); without a ``grid`` it is computed from ZeRO-1's equal cuts (the total does
    not depend on the cuts). A task the TP group shares (``problem.shared``) counts its piece on
    every TP rank in the total (the FLOPs sharing adds included) and its piece as its size.
    """
    total = gpu_total(problem, grid, ctx)
    largest = _LARGEST.get((problem,))
    if largest is None:
        pairs = problem.pairs if problem.sizes.tp > 1 else {}
        # a TP pair's half: its load alone, its own chain (compute and the exchanges its Gram
        # products do not hide), which no piece beside it in a lockstep shortens
        largest = _LARGEST.put((problem,), None, max(
            (_round_load(problem.rounds[t.id]) if t.id in problem.rounds
             else int(round(problem.shared[t.id][0])) if t.id in problem.shared
             else max(pairs[t.id].loads) if t.id in pairs
             else problem.loads[t.id] for t in problem.tasks if t.optimizer == "matrix"),
            default=0))  # a piece's load as the plan records it (rounded)
    return max(math.ceil(total / (problem.dp * problem.sizes.tp)), largest)  # type: ignore


def _round_load(r: SubRound) -> int:
    """A round's load as the plan records it: its members' 1/s shares, each rounded."""
    return r.slots * int(round(r.load / r.slots))


#: :func:`lb_gpu`'s largest piece, by problem.
_LARGEST = Kept(8)


def gpu_total(problem: DPProblem, grid: list[list[int]] | None = None,
              ctx: TPContext | None = None) -> float:
    """The work every schedule puts on the dp·tp GPUs together (:func:`lb_gpu`'s total): the
    ``grid``'s sum, or without one, from ZeRO-1's equal cuts (the total does not depend on the
    cuts)."""
    if grid is not None:
        return sum(sum(r) for r in grid)
    ctx = ctx or TPContext.build(problem)
    base, owned, pinned = index_work(problem, {(b.buffer, b.bucket): equal_cuts(b)
                                               for b in problem.buckets}, ctx)
    return (sum(base) * problem.sizes.tp + sum(problem.loads[i] for ids in owned for i in ids)
            + sum(map(sum, pinned or ())))


def gpu_packing_bound(problem: DPProblem, upper: float, ctx: TPContext | None = None) -> int:
    """A certified lower bound on the busiest GPU at tp > 1, at least :func:`lb_gpu`: the matrices
    a TP rank hosts whole (the TP-split ones no group shares) packed onto the dp·tp GPUs
    (``dp.bounds.bin_packing_bound``), every other load divisible. A relaxation — which DP
    index owns what, the buckets and the replicated matrices' place on every TP rank of their
    index are dropped — so no plan's busiest GPU can be below it. ``upper``: a plan's busiest
    GPU (the search's start)."""
    ctx = ctx or TPContext.build(problem)
    lb = lb_gpu(problem, ctx=ctx)
    hosted = [problem.loads[t.id] for t in problem.tasks
              if t.optimizer == "matrix" and ctx.split[t.id] and t.id not in problem.shared
              and t.id not in problem.pairs]
    total = gpu_total(problem, ctx=ctx)
    rest = max(0.0, total - sum(hosted))
    bins = problem.dp * problem.sizes.tp
    return max(lb, bin_packing_bound(hosted, rest, bins, lb, upper,
                                     divisible_items=len(problem.tasks) - len(hosted)))


def index_gpu_max(problem: DPProblem, cuts: Cuts, ctx: TPContext | None = None) -> list[float]:
    """The DP side's TP-aware load: per DP index, its busiest GPU after LPT packing, its shared
    pieces counted as their lockstep phase (:class:`Lockstep`) rather than one by one; at
    tp > 1 the halves it shares with a partner index (``problem.pairs``) first in that phase,
    the batches holding them as long as the partner's (:func:`coupled`).

    Use in place of the DP load (``evaluate(...).load``) when judging cuts under TP.
    """
    ctx = ctx or TPContext.build(problem)
    base, owned, pinned = index_work(problem, cuts, ctx)
    tp = problem.sizes.tp
    if problem.pairs and tp > 1:  # the halves first: partners end those batches together
        whole, partners = index_halves(problem, cuts)
        parts = [w.split() for w in whole]
        ends = coupled([h for h, _ in parts], partners)
        lock = [e + rest - w.pieces for e, (_, rest), w in zip(ends, parts, whole)]
    else:
        lock = [s.load() - s.pieces for s in index_lockstep(problem, cuts)]
    return [base[d] + lock[d] + lpt_makespan([problem.loads[i] for i in owned[d]], tp,
                                             pinned[d] if pinned else None)
            for d in range(problem.dp)]
