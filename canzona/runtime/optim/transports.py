"""How the ranks of a shared Newton–Schulz reach each other: the asynchronous sum and all-gather
over each kind of sharing group, each returned as one async handle (``wait(timeout)``,
``is_completed()``) that :func:`canzona.runtime.waits.wait_for` waits for.

* A process group (the k ranks, created once by the caller): the stock ``all_reduce`` and tensor
  all-gather.
* A :class:`PeerPair`, two ranks of a larger group (a DP pair): point-to-point messages, posted
  together (:func:`pair_exchange`); a sum is an exchange and an addition, the same bits on both
  sides. No communicator per pair.
* A :class:`TPPair`, a TP group and the same TP ranks at a partner DP index (k = 2·tp):
  hierarchical stages over the TP group and the pair, each launched once the one before it is
  waited for (:class:`_Then`).

:func:`group_size` and :func:`group_rank` give k and this rank's place among the k ranks,
:func:`gather_slot` where a rank's block lies in what :func:`all_gather` gathers. On CUDA/NCCL
the collectives run on the communicator's stream and waiting for a handle orders the current
stream after it, so the same code runs on CPU (gloo) and GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.waits import wait_for, wait_within

__all__ = ["PeerPair", "TPPair", "all_gather", "all_reduce", "gather_slot", "group_rank",
           "group_size", "pair_exchange", "sum_each"]

# torch ≥ 2.10 renamed the tensor collectives (the old names warn).
_dist_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True, slots=True)
class PeerPair:
    """Two ranks of ``group`` sharing matrices through point-to-point messages instead of a
    communicator of their own (DP pairs, ``runtime.pairs``): the all-reduce of a Gram is an
    exchange and a sum, lower rank's block first on both sides (the same bits on both); the
    all-gather of the split polynomial an exchange of blocks. ``ranks``: the two ranks in
    ``group`` (None: the default group), ascending; ``me``: 0 or 1, which of them this is."""

    ranks: tuple[int, int]
    me: int
    group: Any = None

    @property
    def peer(self) -> int:
        return self.ranks[1 - self.me]


@dataclass(frozen=True, slots=True)
class TPPair:
    """k = 2·tp ranks sharing a TP-split matrix: this rank's TP group (``tp``, a process group
    of the tp ranks at one DP index) and the same TP rank at the partner DP index (``pair``, a
    :class:`PeerPair` on the DP group). Each rank holds a row block of its TP shard (the shard's
    ZeRO-1 range cut at a row boundary between the two DP indices). A sum over the k ranks is
    hierarchical: a reduce-scatter over the TP group, each TP rank's 1/tp chunk exchanged with
    the partner and summed, an all-gather over the TP group — only 1/tp of the Gram crosses
    between the DP indices, on every TP rank's own link, and every rank ends with the same bits
    (the pair's sum commutes). An all-gather (the split polynomial) swaps this rank's block
    with the partner, then gathers both over the TP group. Rank order: DP index (``pair.me``)
    first, then TP rank.

    No communicator beyond the TP groups the trainer has and the DP group: the partner is
    reached point to point. Each stage starts once the one before it is waited for (the
    lockstep waits matrix by matrix, so a matrix's later stages overlap the other matrices'
    collectives and compute, not its own). Both DP indices must run the same matrices in the
    same order."""

    tp: Any
    pair: PeerPair


class _Then:
    """An async handle ``first`` whose follow-up ``then()`` (another handle) is launched once
    ``first`` is done, and waited for with it: the two stages of a :class:`TPPair` sum."""

    def __init__(self, first: Any, then: Any) -> None:
        self.first, self.then, self.second = first, then, None

    def wait(self, timeout: Any = None) -> bool:
        """Both stages within one ``timeout`` (a timedelta; the second gets what the first
        left)."""
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if self.second is None:
            wait_within([self.first], timeout)
            self.second = self.then()
        left = None if end is None else timedelta(seconds=max(end - time.monotonic(), 1e-3))
        wait_within([self.second], left)
        return True

    def is_completed(self) -> bool:
        return self.second is not None and self.second.is_completed()


class _Exchange:
    """The two messages of a pair exchange as one async handle; ``finish`` runs once both are
    done (the sum, or nothing for a gather)."""

    def __init__(self, works: list[Any], finish: Any = None) -> None:
        self.works, self.finish = works, finish

    def wait(self, timeout: Any = None) -> bool:
        wait_within(self.works, timeout)
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def group_size(group: Any) -> int:
    """k, the ranks sharing through ``group`` (1 without an initialised process group)."""
    if isinstance(group, PeerPair):
        return 2
    if isinstance(group, TPPair):
        return 2 * dist.get_world_size(group.tp)
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group: Any) -> int:
    """This rank's place among the ranks of ``group`` (a :class:`TPPair`: DP index first, then
    TP rank), or -1 where it is not a member."""
    if isinstance(group, PeerPair):
        return group.me
    if isinstance(group, TPPair):
        r = dist.get_rank(group.tp)
        return -1 if r < 0 else group.pair.me * dist.get_world_size(group.tp) + r
    return dist.get_rank(group)


def pair_exchange(messages: Sequence[tuple[Tensor, Tensor]], pair: PeerPair) -> list[Any]:
    """Send each message's first tensor to the partner and receive its second from it, in
    order, as one batch (on NCCL the sends and receives must be posted together, or both ranks
    would wait in their sends). Returns the async handles."""
    ops = []
    for send, recv in messages:
        ops.append(dist.P2POp(dist.isend, send, group=pair.group, group_peer=pair.peer))
        ops.append(dist.P2POp(dist.irecv, recv, group=pair.group, group_peer=pair.peer))
    return dist.batch_isend_irecv(ops)


def gather_slot(group: Any, rank: int) -> int:
    """Where rank ``rank``'s block lies in what :func:`all_gather` gathers, in blocks: rank order,
    except for a :class:`TPPair` (rank = DP index · tp + TP rank), whose gather holds per TP
    rank both DP indices' blocks."""
    if not isinstance(group, TPPair):
        return rank
    tp = dist.get_world_size(group.tp)
    d, t = divmod(rank, tp)
    return 2 * t + d


def _reduce_scatter(out: Tensor, t: Tensor, group: Any) -> Any:
    return _dist_reduce_scatter(out, t, group=group, async_op=True)


def all_reduce(t: Tensor, group: Any) -> Any:
    """An async sum of ``t`` over ``group`` (a process group, a :class:`PeerPair` or a
    :class:`TPPair`)."""
    if isinstance(group, TPPair):
        # hierarchical: reduce-scatter over the TP group, each TP rank sums its 1/tp chunk with
        # the partner's (1/tp of the bytes cross to the other DP index), all-gather over TP
        tp = dist.get_world_size(group.tp)
        if t.dim() != 1 or t.numel() % tp:  # the guard's scalar and whole Gram: two stages
            return _Then(dist.all_reduce(t, group=group.tp, async_op=True),
                         lambda: all_reduce(t, group.pair))
        chunk = torch.empty(t.numel() // tp, dtype=t.dtype, device=t.device)
        return _Then(_reduce_scatter(chunk, t, group.tp),
                     lambda: _Then(all_reduce(chunk, group.pair),
                                   lambda: _dist_all_gather(t, chunk, group=group.tp,
                                                            async_op=True)))
    if not isinstance(group, PeerPair):
        return dist.all_reduce(t, group=group, async_op=True)
    other = torch.empty_like(t)
    # t is the message (untouched until the exchange is waited for), then receives the sum:
    # the same on both sides, as IEEE addition commutes
    return _Exchange(pair_exchange([(t, other)], group), lambda: t.add_(other))


def sum_each(tensors: Sequence[Tensor], groups: Sequence[Any], what: Sequence[str], *,
             timeout_s: float | None, rank: int, flight: Any = None) -> None:
    """Each tensor summed in place over its group (a process group, :class:`PeerPair` or
    :class:`TPPair`): every sum launched, then each waited for (``what``: its name for a
    timeout, ``rank`` this rank's, ``flight`` the flight recorder)."""
    works = [all_reduce(t, g) for t, g in zip(tensors, groups)]
    if flight is not None:
        for w, name in zip(works, what):
            flight.add(name, w)
    for w, name in zip(works, what):
        wait_for(w, name, timeout_s, rank)


def all_gather(out: Tensor, block: Tensor, group: Any) -> Any:
    """An async all-gather of equal ``block``s into ``out`` (rank order)."""
    if isinstance(group, TPPair):
        # the block swapped with the partner (one block crosses to the other DP index), then
        # both DP indices' blocks gathered over the TP group: ``out`` holds, per TP rank, DP
        # index 0's block then 1's (:func:`gather_slot`)
        size = block.shape[0]
        two = torch.empty(2 * size, dtype=block.dtype, device=block.device)
        me = group.pair.me
        two[me * size:(me + 1) * size].copy_(block)
        theirs = two[(1 - me) * size:(2 - me) * size]
        return _Then(_Exchange(pair_exchange([(block, theirs)], group.pair)),
                     lambda: _dist_all_gather(out, two, group=group.tp, async_op=True))
    if not isinstance(group, PeerPair):
        return _dist_all_gather(out, block, group=group, async_op=True)
    size = block.shape[0]
    mine, theirs = (out[:size], out[size:]) if group.me == 0 else (out[size:], out[:size])
    mine.copy_(block)
    return _Exchange(pair_exchange([(block, theirs)], group))

