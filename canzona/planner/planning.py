"""From a model and sizes to the DP problem the solvers cut.

:func:`make_problem` joins the physical layout with the tasks and the cost model into a
:class:`DPProblem`: per bucket, the items (parameters) in buffer order with their element ranges
and loads, matrix-optimizer items *atomic* (they must not be cut) and AdamW items divisible.
A strategy chooses cut points per bucket; :func:`evaluate` turns cuts into owners and loads, and
:func:`canzona.planner.plan.build.build_plan` into the plan file.

DP indices: dense buffers are sharded over the DP group (index d); expert buffers of EP rank k over
the expert-data-parallel group (index j). With expert TP = TP, Megatron's rank order makes that
expert group the TP group of DP index d = j·ep + k; with expert TP 1 it is one GPU, TP rank
g mod tp of DP index g div tp for g = j·ep + k (``settings.expert_place``). Every load is
reported per DP index, and a GPU's own experts per TP rank (``tp.context.index_work``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

from .alike import Kept
from .cost import CostModel, Task, TaskCost, build_tasks, make_cost_model, task_cost
from .errors import SizeError
from .hardware import HardwareProfile
from .inventory import ModelSpec
from .layout import ParallelSizes, PhysicalLayout, build_layout
from .options import DEFAULT_COST
from .settings import OptimizerSettings

GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Cut points per bucket: (buffer, bucket) → (s_0 = start, s_1, …, s_R = end).
Cuts = dict[tuple[int, int], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Item:
    """A parameter in a bucket: element range, load, and whether it must stay whole."""

    slot: int  # index in the bucket's slots
    start: int
    end: int
    load: int
    flops: int
    state_bytes: int
    atomic: bool
    tasks: tuple[int, ...]  # task ids


@dataclass(frozen=True, slots=True)
class BucketProblem:
    buffer: int
    bucket: int
    start: int
    end: int
    ranks: int  # size of the group the bucket is sharded over
    items: tuple[Item, ...]

    @property
    def load(self) -> int:
        return sum(i.load for i in self.items)


@dataclass(frozen=True, slots=True)
class PairShare:
    """A matrix task two DP indices split between them: rows [0, ``row``) are one piece,
    [``row``, m) the other (at tp > 1 rows of every TP shard, ``sharing.tp_pair_decision``:
    the two TP groups share its Newton–Schulz, k = 2·tp). Muon
    (``sharing.pair_decision``, tp = 1): the two share its Newton–Schulz; Shampoo
    (``sharing.block_decision``): each preconditions its own blocks.
    Per piece: ``loads`` in cost units (a shared piece's compute and collectives), ``flops``
    per step, ``states`` bytes (None: the task's state split by rows);
    ``compute_s``/``comm_s``: seconds per piece (modelled), ``hidden_s`` of the exchanges
    beside the piece's own Gram products (``sharing.ShareOption.hidden_s``)."""

    row: int
    split_poly: bool
    loads: tuple[int, int]
    flops: tuple[int, int]
    compute_s: float
    comm_s: float
    states: tuple[int, int] | None = None
    hidden_s: float = 0.0

    @property
    def alone_s(self) -> float:
        """Seconds of a piece alone: its compute and the exchanges it does not hide."""
        return self.compute_s + self.comm_s - self.hidden_s

    def run_piece(self) -> tuple[float, float, float]:
        """One piece's (compute, exchanges, hidden) in load units, as a pair's lockstep meets
        them (``tp.context.lockstep_seconds``): its load is its seconds alone, converted."""
        total = self.alone_s
        per = self.loads[0] / total if total else 0.0  # load units per second
        return self.compute_s * per, self.comm_s * per, self.hidden_s * per

    def state_bytes(self, whole: int, rows: int) -> tuple[int, int]:
        """The two pieces' state bytes, given the whole task's and its rows."""
        if self.states is not None:
            return self.states
        first = whole * self.row // rows
        return first, whole - first


@dataclass(frozen=True, slots=True)
class SubRound:
    """tp/k alike Muon matrix tasks of one DP index shared by TP sub-groups of ``k`` strided TP
    ranks, one matrix per sub-group (``tasks`` in slot order), run as one piece of the index's
    lockstep: every TP rank computes one piece of one of them (``sharing.tp_sub_piece``), so
    the round's per-rank ``load`` (cost units: its seconds alone, converted), ``compute_s``
    (with the all-to-alls that gather and return its rows, which nothing hides), ``comm_s``
    (the Gram's collectives over k ranks) and ``hidden_s`` (of those, beside its own Gram
    products) are one piece's. Each
    member is also in ``DPProblem.shared``, with 1/s of the round's load (what
    ``tp.context.index_work`` sums per TP rank)."""

    k: int
    tasks: tuple[int, ...]
    split_poly: bool
    load: float
    compute_s: float
    comm_s: float
    hidden_s: float = 0.0

    @property
    def slots(self) -> int:
        """Matrices side by side (tp / k)."""
        return len(self.tasks)

    @property
    def alone_s(self) -> float:
        """Seconds of the round alone: its compute and the collectives it does not hide."""
        return self.compute_s + self.comm_s - self.hidden_s

    def run_piece(self) -> tuple[float, float, float]:
        """The round's (compute, collectives, hidden) in load units, as a lockstep meets them
        (``tp.context.lockstep_seconds``): its load is its seconds alone, converted."""
        total = self.alone_s
        per = self.load / total if total else 0.0
        return self.compute_s * per, self.comm_s * per, self.hidden_s * per


@dataclass(frozen=True, slots=True)
class DPProblem:
    """The α-balanced partitioning problem of one model at one set of sizes."""

    spec: ModelSpec
    sizes: ParallelSizes
    settings: OptimizerSettings
    layout: PhysicalLayout
    tasks: tuple[Task, ...]
    costs: tuple[TaskCost, ...]
    loads: tuple[int, ...]  # per task, under the cost model
    cost_model: str
    buckets: tuple[BucketProblem, ...]
    total: int = 0  # Σ loads, computed once by make_problem
    comm_dtype: str = "bf16"  # dtype of the TP gather/scatter (the tasks' tp_comm_bytes)
    #: Tasks the TP group of their DP index shares (``TPOptions.share``,
    #: ``sharing.share_decision``): task id → (load per TP rank, polynomial split, compute
    #: seconds, collective seconds per TP rank, of those the seconds beside its own Gram
    #: products). Every TP rank of the owner computes its piece;
    #: nothing is hosted. The load is max(compute, collectives) at the profile's rate (what the
    #: piece adds to its group's lockstep phase when others hide its collectives).
    shared: Mapping[int, tuple[float, bool, float, float, float]] = field(default_factory=dict)
    #: Scratch bytes one lockstep batch of shared tasks may hold (``formulas.LOCKSTEP_CMAX`` ·
    #: C_max, set with ``shared``; 0: unbounded, every piece of an index in one lockstep).
    lockstep_cap: int = 0
    #: Tasks two DP indices share: task id → its two pieces. ``sharing.with_pairs`` cuts each
    #: such task's bucket item into two atomic items at the row boundary.
    pairs: Mapping[int, PairShare] = field(default_factory=dict)
    #: Tasks TP sub-groups share (tp > 1): task id → its round (every member of a round maps
    #: to the same :class:`SubRound`; the members lie on one DP index and are in ``shared``).
    rounds: Mapping[int, SubRound] = field(default_factory=dict)
    #: Seconds per unit of load when the cost model is in seconds (``roofline``: 1e-9); None
    #: when loads are FLOPs or elements (timelines then take FLOPs at the profile's rate).
    seconds_per_load: float | None = None

    @property
    def dp(self) -> int:
        return self.sizes.dp

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element of the buckets."""
        return GRAD_BYTES[self.layout.buffers[0].grad_dtype] if self.layout.buffers else 4

    def dp_index(self, bucket: BucketProblem, r: int) -> int:
        """DP index of rank ``r`` of ``bucket``'s sharding group."""
        buf = self.layout.buffers[bucket.buffer]
        if not buf.expert:
            return r
        return self.sizes.expert_place(buf.ep_rank, r)[0]  # type: ignore[arg-type]

    def dp_indices(self, bucket: BucketProblem) -> tuple[int, ...]:
        """The DP index of every rank of ``bucket``'s sharding group (:meth:`dp_index`, once per
        group: the solvers' inner loops read it)."""
        buf = self.layout.buffers[bucket.buffer]
        return _dp_indices(self.sizes, buf.ep_rank if buf.expert else None, bucket.ranks)

    def tp_rank(self, bucket: BucketProblem, r: int) -> int | None:
        """The one TP rank that holds rank ``r``'s part of ``bucket`` (expert buckets at expert
        TP 1 under tp > 1), or None when every TP rank of its DP index holds a shard."""
        buf = self.layout.buffers[bucket.buffer]
        if not buf.expert:
            return None
        return self.sizes.expert_place(buf.ep_rank, r)[1]  # type: ignore[arg-type]

    def total_load(self) -> int:
        return self.total

    def largest_atomic(self) -> int:
        return max((it.load for b in self.buckets for it in b.items if it.atomic), default=0)

    def lower_bound(self) -> int:
        """LB = max(⌈total / dp⌉, largest atomic item)."""
        return max(-(-self.total_load() // self.dp), self.largest_atomic())


class Partition(Protocol):
    """What :func:`evaluate` and :func:`pair_owners` read of a problem: the DP size, the buckets
    (items in buffer order), the DP index of each bucket rank, the gradient bytes per element and
    the tasks DP pairs split. A :class:`DPProblem` is one; so is a plan read back without its
    model (:class:`canzona.planner.plan.inverse.PlanProblem`)."""

    @property
    def dp(self) -> int: ...

    @property
    def buckets(self) -> tuple[BucketProblem, ...]: ...

    @property
    def pairs(self) -> Mapping[int, object]: ...

    @property
    def grad_bytes(self) -> int: ...

    def dp_index(self, bucket: BucketProblem, r: int) -> int: ...

    def dp_indices(self, bucket: BucketProblem) -> tuple[int, ...]: ...

    def tp_rank(self, bucket: BucketProblem, r: int) -> int | None: ...


def make_problem(
    spec: ModelSpec,
    sizes: ParallelSizes,
    settings: OptimizerSettings | None = None,
    *,
    cost: str | CostModel = DEFAULT_COST,
    bucket_size: int | None = None,
    overlap_grad_reduce: bool = True,
    comm_dtype: str = "bf16",
    hardware: str | HardwareProfile | None = None,
) -> DPProblem:
    """Build the layout, the tasks and their costs, and group them per bucket. ``hardware``:
    the profile a cost model in seconds (``roofline``) prices the tasks under."""
    settings = settings or OptimizerSettings()
    layout = build_layout(spec, sizes, bucket_size=bucket_size,
                          overlap_grad_reduce=overlap_grad_reduce)
    model = make_cost_model(cost, settings, sizes, hardware) if isinstance(cost, str) else cost
    tasks = build_tasks(spec, settings, sizes)
    costs = tuple(task_cost(t, settings, sizes, comm_dtype) for t in tasks)
    loads = tuple(model.cost(t) for t in tasks)
    by_param: dict[str, list[int]] = {}
    for t in tasks:
        by_param.setdefault(t.param, []).append(t.id)
    buckets = []
    for bi, buf in enumerate(layout.buffers):
        for b in buf.buckets:
            items = []
            for si, s in enumerate(b.slots):
                ids = tuple(by_param[s.name])
                if len(ids) == 1:  # (most parameters: one task)
                    c = costs[ids[0]]
                    items.append(Item(si, s.start, s.end, loads[ids[0]], c.flops, c.state_bytes,
                                      s.optimizer == "matrix", ids))
                    continue
                items.append(Item(si, s.start, s.end, sum(loads[i] for i in ids),
                                  sum(costs[i].flops for i in ids),
                                  sum(costs[i].state_bytes for i in ids),
                                  s.optimizer == "matrix", ids))
            buckets.append(BucketProblem(bi, b.index, b.start, b.end, buf.dp_size, tuple(items)))
    return DPProblem(spec, sizes, settings, layout, tuple(tasks), costs, loads,
                     getattr(model, "name", "custom"), tuple(buckets), sum(loads), comm_dtype,
                     seconds_per_load=getattr(model, "seconds_per_load", None))


def pair_items(it: Item, shape: tuple[int, ...], row: int, loads: tuple[int, int],
               flops: tuple[int, int], states: tuple[int, int],
               slot: int) -> tuple[Item, Item]:
    """The two pieces of a whole-matrix item (``shape`` rows × cols) cut before ``row``, with
    their loads, FLOPs and state bytes."""
    mid = it.start + row * shape[1]
    return (Item(slot, it.start, mid, loads[0], flops[0], states[0], True, it.tasks),
            Item(slot + 1, mid, it.end, loads[1], flops[1], states[1], True, it.tasks))


def pair_owners(problem: Partition, cuts: Cuts) -> dict[int, tuple[int, int]]:
    """Task id → the DP indices of its two pieces, for every task of ``problem.pairs``."""
    out: dict[int, list[int]] = {}
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        for it in b.items:
            if len(it.tasks) == 1 and it.tasks[0] in problem.pairs:
                out.setdefault(it.tasks[0], []).append(problem.dp_index(b, owner_of(c, it.start)))
    return {t: (d[0], d[1]) for t, d in out.items()}


def coupled(loads: Sequence[float], partners: Sequence[set[int]]) -> list[float]:
    """Each DP index's lockstep as its partners meet it: indices that share a task exchange
    every iteration, so they finish together, at the slowest of those connected through
    shared tasks (``loads``: each index's own lockstep)."""
    out = list(loads)
    seen = [False] * len(out)
    for d in range(len(out)):
        if seen[d] or not partners[d]:
            continue
        group, todo = [], [d]
        seen[d] = True
        while todo:
            e = todo.pop()
            group.append(e)
            for f in partners[e]:
                if not seen[f]:
                    seen[f] = True
                    todo.append(f)
        top = max(out[e] for e in group)
        for e in group:
            out[e] = top
    return out


def pair_phases(owners: Mapping[int, tuple[int, int]]) -> dict[tuple[int, int], int]:
    """A phase per distinct pair of DP indices such that no index is in two pairs of one phase
    (greedy edge colouring in (d0, d1) order: deterministic, at most 2Δ − 1 phases for Δ pairs
    per index). The tasks of one pair share its phase (one lockstep run)."""
    used: dict[int, set[int]] = {}
    out: dict[tuple[int, int], int] = {}
    for a, b in sorted(set(owners.values())):
        busy = used.setdefault(a, set()) | used.setdefault(b, set())
        ph = next(k for k in range(len(busy) + 1) if k not in busy)
        used[a].add(ph)
        used[b].add(ph)
        out[(a, b)] = ph
    return out


def equal_cuts(b: BucketProblem) -> tuple[int, ...]:
    """ZeRO-1's equal chunks."""
    size = (b.end - b.start) // b.ranks
    return tuple(b.start + r * size for r in range(b.ranks)) + (b.end,)


@lru_cache(maxsize=256)
def _dp_indices(sizes: ParallelSizes, ep_rank: int | None, ranks: int) -> tuple[int, ...]:
    if ep_rank is None:
        return tuple(range(ranks))
    return tuple(sizes.expert_place(ep_rank, r)[0] for r in range(ranks))


def owner_of(cuts: Sequence[int], pos: int) -> int:
    """Rank whose range [cuts[r], cuts[r+1]) contains ``pos`` (the last rank for pos == end):
    the last r < len(cuts) - 1 with cuts[r] <= pos, or 0."""
    return min(max(bisect_right(cuts, pos) - 1, 0), len(cuts) - 2)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Loads per DP index for given cuts. ``owners`` maps task id → DP index (atomic tasks)."""

    load: tuple[int, ...]
    flops: tuple[int, ...]
    state_bytes: tuple[int, ...]
    rs_bytes: tuple[int, ...]
    owners: dict[int, int]
    split_matrices: int


def evaluate(problem: Partition, cuts: Cuts,
             *, split_mode: str = "owner") -> Evaluation:
    """Loads per DP index.

    Args:
        cuts: per (buffer, bucket) the cut points.
        split_mode: how an atomic item that the cuts split is charged: ``owner`` — wholly to the
            rank holding its start (the ``asc`` baseline); ``fragments`` — by element share to every
            rank holding a piece (ZeRO-1 applying the optimizer to fragments).

    The last few evaluations are kept (the solvers score the same cuts of a problem several
    times); each caller gets its own ``owners``.
    """
    key = (split_mode, tuple(cuts.items()))
    try:
        ev = _EVALUATED.get((problem,), key)
    except TypeError:  # cut points in lists: not kept
        return _evaluate(problem, cuts, split_mode)
    if ev is None:
        ev = _EVALUATED.put((problem,), key, _evaluate(problem, cuts, split_mode))
    return Evaluation(ev.load, ev.flops, ev.state_bytes, ev.rs_bytes, dict(ev.owners),
                      ev.split_matrices)


#: A problem's evaluations by split mode and cuts.
_EVALUATED = Kept(16)


def _evaluate(problem: Partition, cuts: Cuts, split_mode: str) -> Evaluation:
    dp = problem.dp
    load = [0] * dp
    flops = [0] * dp
    state = [0] * dp
    rs = [0] * dp
    owners: dict[int, int] = {}
    split = 0
    grad_bytes = problem.grad_bytes
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        ix = problem.dp_indices(b)
        key = (tuple(c), ix, split_mode)
        part = _PARTS.get((b,), key)
        if part is None:
            part = _PARTS.put((b,), key, _bucket_part(b, c, ix, split_mode))
        for r in range(b.ranks):
            rs[ix[r]] += (c[r + 1] - c[r]) * grad_bytes
        ranks, mine, assigned, n_split = part  # type: ignore[misc]
        for d, x, f, s in ranks:
            load[d] += x
            flops[d] += f
            state[d] += s
        if owners.keys().isdisjoint(mine):
            owners.update(mine)
        else:  # a task met in an earlier bucket: its first owner stays, unless assigned here
            for t, d in mine.items():
                if t in assigned or t not in owners:
                    owners[t] = d
        split += n_split
    return Evaluation(tuple(load), tuple(flops), tuple(state), tuple(rs), owners, split)


#: A bucket's share of an evaluation (:func:`_bucket_part`), by the bucket (identity), its cut
#: points, its ranks' DP indices and the split mode: most buckets keep their cuts from one
#: evaluation to the next.
_PARTS = Kept(8192)


def _bucket_part(b: BucketProblem, c: Sequence[int], ix: tuple[int, ...], split_mode: str
                 ) -> tuple[tuple[tuple[int, int, int, int], ...], dict[int, int],
                            frozenset[int], int]:
    """What bucket ``b`` cut at ``c`` adds to an evaluation: per DP index its items touch, their
    load, FLOPs and state bytes; its tasks' owners (in the order met: a task charged whole
    keeps the owner of its first piece, one split by fragments takes its first rank's); the
    tasks of the latter kind; and how many atomic items the cuts split."""
    acc: dict[int, list[int]] = {}  # the DP indices its items touch
    owners: dict[int, int] = {}
    assigned = set()
    split = 0
    top = len(c) - 2
    for it in b.items:
        first = min(max(bisect_right(c, it.start) - 1, 0), top)  # owner_of, inlined
        last = min(max(bisect_right(c, it.end - 1) - 1, 0), top)
        if it.atomic and first != last:
            split += 1
        if it.atomic and (first == last or split_mode == "owner"):
            a = acc.get(ix[first]) or acc.setdefault(ix[first], [0, 0, 0])
            a[0] += it.load
            a[1] += it.flops
            a[2] += it.state_bytes
            for t in it.tasks:
                owners.setdefault(t, ix[first])  # a pair's task: the owner of its first piece
            continue
        # Divisible (AdamW) item, or a split matrix charged by fragments: share by elements.
        n = it.end - it.start
        for r in range(first, last + 1):
            lo, hi = max(it.start, c[r]), min(it.end, c[r + 1])
            if hi <= lo:
                continue
            a = acc.get(ix[r]) or acc.setdefault(ix[r], [0, 0, 0])
            # Cumulative rounding: the shares of an item add up to the item exactly.
            lo, hi = lo - it.start, hi - it.start
            a[0] += it.load * hi // n - it.load * lo // n
            a[1] += it.flops * hi // n - it.flops * lo // n
            a[2] += it.state_bytes * hi // n - it.state_bytes * lo // n
        if it.atomic:
            for t in it.tasks:
                owners[t] = ix[first]
                assigned.add(t)
    return tuple((d, *v) for d, v in acc.items()), owners, frozenset(assigned), split


def default_plan_name(model: str, sizes: ParallelSizes, optimizer: str, *, pp: int = 1,
                      storage: str = "zero1") -> str:
    ep = f"-ep{sizes.ep}" if sizes.ep > 1 else ""
    if sizes.expert_tp != sizes.tp:
        ep += f"-etp{sizes.expert_tp}"
    if pp > 1:
        ep += f"-pp{pp}"
    if storage != "zero1":
        ep += f"-{storage}"
    return f"{model}-dp{sizes.dp}-tp{sizes.tp}{ep}-{optimizer}.plan.json"


