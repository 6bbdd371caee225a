"""TP sub-groups: k of a TP group's tp ranks share one matrix's Newton–Schulz, tp/k matrices side
by side (issue 18, "where the k ranks are a TP sub-group"; the kernel, standalone — the planner
and the optimizer do not place such pieces yet, ``planner.sharing.tp_sub_piece`` models them).

Over the whole TP group (k = tp) a shared piece carries its Gram's collectives (≈ n²/2 elements
per step) for an eighth of the matrix's work per GPU at tp = 8; the collectives do not shrink
with k, so fewer ranks per matrix spend fewer collective seconds per FLOP. The price is moving
the rows: a TP rank holds one shard (a row block of the oriented matrix) of every TP-split
weight, and a sub-group member needs tp/k of them.

**Layout.** With s = tp/k slots, sub-group j (the one sharing the slot-j matrix) is the strided
set of TP ranks {j, j + s, j + 2s, …}; its member i (TP rank j + i·s) holds the shards
[i·s, (i+1)·s) of that matrix — its own shard among them. So TP rank r sends its shard of every
slot's matrix to the ranks of its own *block* of s consecutive TP ranks [⌊r/s⌋·s, ⌊r/s⌋·s + s)
(the slot-j matrix to rank ⌊r/s⌋·s + j) and receives from that block the shards of its slot's
matrix: one all-to-all over the TP group whose non-zero splits stay within blocks (uneven splits,
zeros outside; ``all_to_all_single``), the update rows returned by the reverse one. Between
them the members run :func:`~canzona.runtime.optim.shared_ns.shared_newton_schulz_many` over
their sub-group — the result is the single-device one up to summation order, like any shared
piece (the Gram does not depend on which rows a rank holds).

Sub-groups are fixed process groups created once (:func:`tp_sub_groups`, every rank calling it
for every TP group alike), not a communicator per matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from canzona.runtime.collectives import wait_for
from canzona.runtime.optim.muon import DEFAULT_COEFFICIENTS, Coefficients
from canzona.runtime.optim.shared_ns import shared_newton_schulz_many

__all__ = ["SubGroups", "sub_group_newton_schulz", "tp_sub_groups"]


@dataclass(frozen=True, slots=True)
class SubGroups:
    """This rank's place among the TP sub-groups of size ``k`` of its TP group: ``tp_group``
    (the TP process group, ``None``: the default group), its size ``tp``, this rank's TP rank
    ``rank``, and ``group``, the process group of this rank's sub-group (its k strided ranks)."""

    tp_group: Any
    tp: int
    k: int
    rank: int
    group: Any

    @property
    def slots(self) -> int:
        """Matrices side by side: one per sub-group (tp / k)."""
        return self.tp // self.k

    @property
    def slot(self) -> int:
        """The matrix this rank shares (its sub-group's index)."""
        return self.rank % self.slots

    @property
    def block(self) -> range:
        """The TP ranks this rank exchanges rows with (s consecutive ranks, itself among them)."""
        first = self.rank // self.slots * self.slots
        return range(first, first + self.slots)


def tp_sub_groups(tp_ranks: Sequence[Sequence[int]], k: int, *, tp_group: Any = None,
                  backend: str | None = None) -> SubGroups:
    """Create the sub-groups of size ``k`` of every TP group (``tp_ranks``: each TP group's
    global ranks in TP-rank order, the same list on every rank) and return this rank's place.
    Collective over the default group: every rank calls it with the same arguments, once.
    ``tp_group``: this rank's TP process group (``None``: the default group)."""
    import torch.distributed as dist

    sizes = {len(g) for g in tp_ranks}
    if len(sizes) != 1:
        raise ValueError(f"tp_sub_groups: TP groups of different sizes {sorted(sizes)}")
    tp = sizes.pop()
    if k < 1 or tp % k:
        raise ValueError(f"tp_sub_groups: k = {k} must divide the TP group's size {tp}")
    me = dist.get_rank()
    mine = [g for g in tp_ranks if me in g]
    if len(mine) != 1:
        raise ValueError(f"tp_sub_groups: global rank {me} is in {len(mine)} of the TP groups "
                         f"given, not one")
    s = tp // k
    subs = [[g[j + i * s] for i in range(k)] for g in tp_ranks for j in range(s)]
    group, _ = dist.new_subgroups_by_enumeration(subs, backend=backend)
    return SubGroups(tp_group, tp, k, list(mine[0]).index(me), group)


def _a2a(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], group: Any,
         what: str, timeout_s: float | None, rank: int) -> None:
    import torch.distributed as dist

    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    wait_for(work, what, timeout_s, rank)


@torch.no_grad()
def sub_group_newton_schulz(
    shards: Sequence[Tensor],
    subs: SubGroups,
    *,
    coefficients: Coefficients | Sequence[Coefficients] | str = DEFAULT_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
    split_polynomial: bool = False,
    timeout_s: float | None = None,
    what: Sequence[str] = (),
) -> list[Tensor]:
    """This TP rank's rows of the orthogonalisation of ``subs.slots`` matrices, each shared by
    one TP sub-group (see the module).

    Args:
        shards: Per slot j, this TP rank's shard of the slot-j matrix, oriented along its long
            dimension (``[rows_j, n_j]``, any view: e.g. ``orientation(...).orient(shard)``),
            with the same shape on every TP rank (Megatron's equal shards); not modified.
        subs: This rank's sub-groups (:func:`tp_sub_groups`).
        coefficients, steps, eps, dtype, split_polynomial, timeout_s: As
            :func:`~canzona.runtime.optim.shared_ns.shared_newton_schulz`; the rows travel in
            ``dtype`` (``None``: the shards' dtype).
        what: Per slot, the matrix's name for timeout errors.

    Returns:
        Per slot, ``[rows_j, n_j]`` in ``dtype``: this rank's rows of that matrix's
        orthogonalised update, equal to ``newton_schulz(whole)`` restricted to them up to
        summation order.
    """
    s = subs.slots
    if len(shards) != s:
        raise ValueError(f"sub_group_newton_schulz: {len(shards)} shards for {s} slots "
                         f"(tp {subs.tp} / k {subs.k}): one per sub-group's matrix")
    if any(x.dim() != 2 for x in shards):
        raise ValueError("sub_group_newton_schulz: each shard is a [rows, n] row block")
    names = list(what) + [""] * (s - len(what))
    mine = shards[subs.slot]
    if s == 1:  # the whole TP group shares the one matrix: nothing moves
        return shared_newton_schulz_many([mine], group=subs.tp_group, coefficients=coefficients,
                                         steps=steps, eps=eps, dtype=dtype,
                                         split_polynomial=split_polynomial,
                                         timeout_s=timeout_s, what=names[:1])
    dt = dtype or mine.dtype
    first = subs.block.start
    zeros = [0] * subs.tp
    send_splits, recv_splits = list(zeros), list(zeros)
    for j in range(s):
        send_splits[first + j] = shards[j].numel()
        recv_splits[first + j] = mine.numel()
    send = torch.cat([x.reshape(-1).to(dt) for x in shards])
    recv = torch.empty(sum(recv_splits), dtype=dt, device=mine.device)
    label = names[subs.slot] or f"slot {subs.slot}"
    _a2a(recv, send, recv_splits, send_splits, subs.tp_group,
         f"the TP sub-group gather of {label}", timeout_s, subs.rank)
    rows, n = mine.shape
    block = recv.view(s * rows, n)  # shards [first, first + s) of this slot's matrix, in order
    (out,) = shared_newton_schulz_many([block], group=subs.group, coefficients=coefficients,
                                       steps=steps, eps=eps, dtype=dtype,
                                       split_polynomial=split_polynomial, timeout_s=timeout_s,
                                       what=[label])
    back = torch.empty(send.numel(), dtype=out.dtype, device=out.device)
    _a2a(back, out.contiguous().view(-1), send_splits, recv_splits, subs.tp_group,
         f"the TP sub-group scatter of {label}", timeout_s, subs.rank)
    result, at = [], 0
    for x in shards:
        result.append(back[at:at + x.numel()].view(x.shape))
        at += x.numel()
    return result
