"""The communication model: what each bucket collective method moves and how long it takes.

A bucket of S elements over a group of R ranks is cut into slices s_0 … s_{R-1} (rank r owns
s_r). Its reduce (gradients, in the grad dtype) leaves each owner the sum of its slice; its
gather (parameters, in the parameter dtype) gives every rank every slice. The methods (the
runtime's :mod:`canzona.runtime.storage.collectives`, one spelling everywhere)::

    equal       one ring reduce-scatter / all-gather; every slice is S/R
    padded      the same on slices padded to the largest, m = max s_r: R·m elements
    per_root    one chain reduce to, and one chain broadcast from, every owner of a non-empty
                slice (k of them): NCCL's own uneven reduce_scatter / all_gather
    all_reduce  a ring all-reduce of the whole bucket (each rank keeps its slice); the gather per
                root, as per_root
    all_to_all  all_to_all_single with split sizes: every rank sends each owner its slice (the
                owner receives R-1 copies: an incast); the gather sends the own slice to all

Bytes are counted per rank under ring/chain algorithms (:func:`reduce_traffic`,
:func:`gather_traffic`): a ring reduce-scatter moves (R-1)·m elements through every rank; a
chain reduce to root r runs r+1 → r+2 → … → r, so every rank but r sends s_r and every rank but
the head r+1 receives it; a chain broadcast from r runs r → r+1 → … → r-1, so every rank but the
tail r-1 sends s_r and every rank but r receives it; a ring all-reduce moves 2(R-1)/R·S.

``all_to_all`` is never faster than ``padded`` here: its busiest rank, the owner of the largest
slice, receives (R-1)·max — padded's bytes, in one call too — and the incast on that owner makes
it slower in practice, which this model does not charge; it stays for the runtime's comparisons.

Time is α–β: ``calls · α + busiest rank's bytes / busbw``, where the busiest
rank is the one that sends or receives the most, and the link is NVLink when the group's ranks
fit in one node, InfiniBand otherwise (:meth:`HardwareProfile.link`). For the stock collectives
this is NCCL's ``α + S/algbw`` exactly. Per-root calls each pay α (conservative: on NCCL they are
coalesced into one launch).

Torch-free and one of the planner's leaves (it reads only the hardware profile), so the planner's
objective, the plan's assembly and converters, ``inspect`` and the simulator share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .hardware import HardwareProfile, LinkProfile
from .settings import expert_place

#: The bucket collective methods, by the names plans, the plan schema and the runtime's
#: collectives (``canzona.runtime.storage.collectives``) use; this is their one spelling.
EQUAL, PADDED, PER_ROOT, ALL_REDUCE, ALL_TO_ALL = (
    "equal", "padded", "per_root", "all_reduce", "all_to_all")
#: Every method, in the order ties are broken (the stock collectives first).
METHODS = (EQUAL, PADDED, PER_ROOT, ALL_REDUCE, ALL_TO_ALL)

#: Bytes per element of the plan's dtype names.
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, slots=True)
class Traffic:
    """One collective (a bucket's reduce or its gather): calls issued, bytes per rank."""

    calls: int
    sent: tuple[int, ...]
    received: tuple[int, ...]

    @property
    def busiest(self) -> int:
        """Bytes through the busiest rank (the larger of what it sends and receives)."""
        return max(max(self.sent, default=0), max(self.received, default=0))

    def seconds(self, link: LinkProfile) -> float:
        """α–β time: ``calls · α + busiest / busbw`` (:meth:`LinkProfile.seconds`)."""
        return link.seconds(self.busiest, self.calls)


@dataclass(frozen=True, slots=True)
class BucketComm:
    """A bucket's reduce and gather under one method, and their predicted time."""

    method: str
    reduce: Traffic
    gather: Traffic
    seconds: float

    @property
    def sent(self) -> tuple[int, ...]:
        """Bytes each rank sends per iteration (reduce + gather)."""
        return tuple(a + b for a, b in zip(self.reduce.sent, self.gather.sent))

    @property
    def calls(self) -> int:
        return self.reduce.calls + self.gather.calls


def _check(method: str, sizes: Sequence[int]) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of: {', '.join(METHODS)}; got {method!r}")
    if method == EQUAL and len(set(sizes)) > 1:
        raise ValueError(f"'equal' needs equal slices, got {list(sizes)}")


def _ring(sizes: Sequence[int], e: int) -> Traffic:
    """Ring reduce-scatter or all-gather of R blocks of max(sizes) (equal and padded)."""
    R = len(sizes)
    b = (R - 1) * max(sizes) * e
    return Traffic(1, (b,) * R, (b,) * R)


def _chain(sizes: Sequence[int], e: int, *, broadcast: bool) -> Traffic:
    """One chain reduce (or broadcast) per non-empty slice."""
    R = len(sizes)
    roots = [r for r, s in enumerate(sizes) if s > 0]
    # every rank sends and receives every root's slice once, but one of each chain
    total = sum(sizes[r] * e for r in roots)
    sent, recv = [total] * R, [total] * R
    for r in roots:
        b = sizes[r] * e
        sent[(r - 1) % R if broadcast else r] -= b  # broadcast: the tail; reduce: the root
        recv[r if broadcast else (r + 1) % R] -= b  # broadcast: the root; reduce: the head
    return Traffic(len(roots), tuple(sent), tuple(recv))


def reduce_traffic(method: str, sizes: Sequence[int], elem_bytes: int) -> Traffic:
    """The reduce of a bucket with slices ``sizes`` (elements) under ``method``."""
    _check(method, sizes)
    R, e = len(sizes), elem_bytes
    if R == 1:
        return Traffic(0, (0,), (0,))
    if method in (EQUAL, PADDED):
        return _ring(sizes, e)
    if method == PER_ROOT:
        return _chain(sizes, e, broadcast=False)
    S = sum(sizes)
    if method == ALL_REDUCE:
        b = 2 * (R - 1) * S * e // R
        return Traffic(1, (b,) * R, (b,) * R)
    # all_to_all: rank m sends every other owner its slice and receives R-1 copies of its own.
    return Traffic(1, tuple((S - s) * e for s in sizes), tuple((R - 1) * s * e for s in sizes))


def gather_traffic(method: str, sizes: Sequence[int], elem_bytes: int) -> Traffic:
    """The gather of a bucket with slices ``sizes`` (elements) under ``method``."""
    _check(method, sizes)
    R, e = len(sizes), elem_bytes
    if R == 1:
        return Traffic(0, (0,), (0,))
    if method in (EQUAL, PADDED):
        return _ring(sizes, e)
    if method in (PER_ROOT, ALL_REDUCE):
        return _chain(sizes, e, broadcast=True)
    S = sum(sizes)
    return Traffic(1, tuple((R - 1) * s * e for s in sizes), tuple((S - s) * e for s in sizes))


def bucket_comm(method: str, sizes: Sequence[int], *, grad_bytes: int, param_bytes: int,
                link: LinkProfile) -> BucketComm:
    """The reduce (grad dtype) and gather (param dtype) of one bucket under ``method`` (kept
    by its inputs: the plans a planner judges, and the stages that cut them, meet the same
    buckets again)."""
    return _bucket_comm(method, tuple(sizes), grad_bytes, param_bytes, link)


@lru_cache(maxsize=1 << 15)
def _bucket_comm(method: str, sizes: tuple[int, ...], grad_bytes: int, param_bytes: int,
                 link: LinkProfile) -> BucketComm:
    red = reduce_traffic(method, sizes, grad_bytes)
    gat = gather_traffic(method, sizes, param_bytes)
    return BucketComm(method, red, gat, red.seconds(link) + gat.seconds(link))


def methods_for(sizes: Sequence[int]) -> tuple[str, ...]:
    """The methods that can move these slices (``equal`` only when they are equal; ``padded``
    then makes the same calls and loses the tie)."""
    return METHODS if len(set(sizes)) == 1 else METHODS[1:]


def choose(sizes: Sequence[int], *, grad_bytes: int, param_bytes: int, link: LinkProfile,
           methods: Sequence[str] | None = None) -> BucketComm:
    """The fastest method for these slices (ties: the earlier in :data:`METHODS`)."""
    best: BucketComm | None = None
    for m in methods_for(sizes):
        if methods is not None and m not in methods:
            continue
        c = bucket_comm(m, sizes, grad_bytes=grad_bytes, param_bytes=param_bytes, link=link)
        if best is None or c.seconds < best.seconds:
            best = c
    if best is None:
        raise ValueError(f"none of the methods {list(methods or [])} can move slices "
                         f"{list(sizes)}")
    return best


def all_to_all_busiest(matrix: Sequence[Sequence[int]]) -> int:
    """The off-rank elements through the busiest rank of an all-to-all that moves
    ``matrix[src][dst]`` elements: the larger of what a rank sends and receives, local copies
    (``src == dst``) free."""
    n = len(matrix)
    worst = 0
    for t in range(n):
        sent = sum(matrix[t][h] for h in range(n) if h != t)
        recv = sum(matrix[s][t] for s in range(n) if s != t)
        worst = max(worst, sent, recv)
    return worst


def even_sizes(numel: int, ranks: int) -> tuple[int, ...]:
    """ZeRO-1's equal chunks of a bucket (its end is padded to a multiple of the ranks)."""
    q, r = divmod(numel, ranks)
    return (q + 1,) * r + (q,) * (ranks - r)


def zero1(numel: int, ranks: int, *, grad_bytes: int, param_bytes: int,
          link: LinkProfile) -> BucketComm:
    """The reference: ZeRO-1's even reduce-scatter and all-gather of the same bucket."""
    sizes = even_sizes(numel, ranks)
    method = EQUAL if len(set(sizes)) == 1 else PADDED
    return bucket_comm(method, sizes, grad_bytes=grad_bytes, param_bytes=param_bytes, link=link)


def plan_link(hw: HardwareProfile, dp: int, tp: int) -> tuple[str, LinkProfile]:
    """The link of a plan's DP groups and its name (``intra_node`` | ``inter_node``).

    A DP group of ``dp`` ranks at stride ``tp`` (Megatron's order, TP fastest) spans dp·tp
    global ranks; an expert DP group (dp·tp/(ep·etp) ranks at stride ep·etp) spans the same."""
    link = hw.link(dp * tp)
    return ("intra_node" if link is hw.intra_node else "inter_node"), link


@dataclass(frozen=True, slots=True)
class BucketSlices:
    """What the model needs of one bucket: its slices, dtypes and the DP index of each rank.
    ``share``: the part of its collectives' time and bytes a DP index bears per rank; 1/tp for
    expert buckets at expert TP 1 under tp > 1, whose TP ranks each join their own EP rank's
    buckets side by side (alike buckets: Megatron lays every EP rank's experts out alike)."""

    sizes: tuple[int, ...]
    grad_bytes: int
    param_bytes: int
    dp_indices: tuple[int, ...]
    share: float = 1.0


@dataclass(frozen=True, slots=True)
class BucketLine:
    """One bucket: the method used and its cost, and ZeRO-1's even collectives' cost."""

    slices: BucketSlices
    comm: BucketComm
    zero1: BucketComm


@dataclass(frozen=True, slots=True)
class CommSummary:
    """Every bucket's collectives, and per DP index the seconds and bytes of those it joins
    (buckets are reduced one after another; a DP index joins its dense buckets and the expert
    buckets of its EP rank)."""

    lines: tuple[BucketLine, ...]
    dp: int

    def _per_index(self, attr: str, what: str) -> tuple[float, ...]:
        out = [0.0] * self.dp
        for line in self.lines:
            c = getattr(line, attr)
            per_rank = ((c.seconds,) * len(line.slices.dp_indices) if what == "seconds"
                        else c.sent)  # one tuple per line: ``sent`` builds it anew each time
            share = line.slices.share
            for r, d in enumerate(line.slices.dp_indices):
                out[d] += per_rank[r] * share if share != 1 else per_rank[r]
        return tuple(out)

    @property
    def index_seconds(self) -> tuple[float, ...]:
        return self._per_index("comm", "seconds")

    @property
    def index_sent(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self._per_index("comm", "sent"))

    @property
    def seconds(self) -> float:
        """Predicted collective time per iteration: the busiest DP index's."""
        return max(self.index_seconds, default=0.0)

    @property
    def zero1_seconds(self) -> float:
        return max(self._per_index("zero1", "seconds"), default=0.0)

    @property
    def max_sent(self) -> int:
        """The most bytes any rank sends per iteration (reduce + gather)."""
        return max(self.index_sent, default=0)

    @property
    def zero1_max_sent(self) -> int:
        return int(max(self._per_index("zero1", "sent"), default=0))


def summarise(buckets: Sequence[BucketSlices], dp: int, link: LinkProfile,
              methods: Sequence[str] | None = None) -> CommSummary:
    """The collectives of ``buckets`` under ``methods`` (one per bucket; None: the fastest)."""
    lines = []
    for k, b in enumerate(buckets):
        kw = {"grad_bytes": b.grad_bytes, "param_bytes": b.param_bytes, "link": link}
        c = (choose(b.sizes, **kw) if methods is None
             else bucket_comm(methods[k], b.sizes, **kw))
        lines.append(BucketLine(b, c, zero1(sum(b.sizes), len(b.sizes), **kw)))
    return CommSummary(tuple(lines), dp)


def bucket_places(buf, ranks: int, *, ep: int, tp: int = 1, etp: int | None = None  # noqa: ANN001
                  ) -> tuple[tuple[int, ...], float]:
    """The DP index of each of a buffer's ``ranks`` bucket ranks (an expert buffer's by
    ``layout.expert_place``) and the :attr:`BucketSlices.share` of its collectives."""
    if not buf.expert:
        return tuple(range(ranks)), 1.0
    places = [expert_place(r, buf.ep_rank, ep=ep, tp=tp, etp=etp) for r in range(ranks)]
    return tuple(d for d, _ in places), (1.0 / tp if places and places[0][1] is not None else 1.0)


def buffer_slices(buffers: Sequence, ep: int, *, tp: int = 1,
                  etp: int | None = None) -> list[BucketSlices]:
    """Every bucket of a plan's ``buffers`` (``BufferPlan``s, or anything with their fields) as
    :class:`BucketSlices`, in plan order (the places of an expert buffer's ranks:
    :func:`bucket_places`)."""
    out = []
    for buf in buffers:
        for b in buf.buckets:
            sizes = tuple(y - x for x, y in zip(b.cuts, b.cuts[1:]))
            idx, share = bucket_places(buf, len(sizes), ep=ep, tp=tp, etp=etp)
            out.append(BucketSlices(sizes, ELEMENT_BYTES[buf.grad_dtype],
                                    ELEMENT_BYTES[buf.dtype], idx, share))
    return out
