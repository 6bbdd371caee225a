"""TP sub-groups: k of a TP group's tp ranks share one matrix's Newton–Schulz, tp/k matrices side
by side (the kernel: a plan's rounds, ``SharedTaskPlan.sub``, run it inside the TP index's shared
lockstep, ``runtime.tp_shared``; ``planner.sharing.tp_sub_piece`` models it).

Over the whole TP group (k = tp) a shared piece carries its Gram's collectives (≈ n²/2 elements
per step) for an eighth of the matrix's work per GPU at tp = 8. Per rank the compute grows as
1/k while the collectives stay about the same (2(k−1)/k of the Gram), so fewer ranks per matrix
spend fewer collective seconds per FLOP. The price is moving the rows: a TP rank holds one
shard (a row block of the oriented matrix) of every TP-split weight, and a sub-group member
needs tp/k of them.

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

from canzona.runtime.optim.muon import DEFAULT_COEFFICIENTS, Coefficients
from canzona.runtime.optim.shared_ns import shared_newton_schulz_many
from canzona.runtime.waits import wait_for

__all__ = ["SubGroups", "sub_group_newton_schulz", "sub_group_return", "sub_group_rows",
           "tp_sub_groups"]


@dataclass(frozen=True, slots=True)
class SubGroups:
    """This rank's place among the TP sub-groups of size ``k`` of its TP group: ``tp_group``
    (the TP process group), its size ``tp``, this rank's TP rank ``rank`` (its rank in
    ``tp_group``), ``group``, the process group of this rank's sub-group (its k strided ranks;
    with k = tp the TP group's ranks), and ``me``, this rank's global rank (for errors)."""

    tp_group: Any
    tp: int
    k: int
    rank: int
    group: Any
    me: int = 0

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
    """Create the sub-groups of size ``k`` of every TP group and return this rank's place.

    ``tp_ranks``: every TP group's global ranks, ascending (a process group orders its ranks
    so), the same list on every rank, together every rank of the world once; ``tp_group``: this
    rank's TP process group (``None``: the default group, then the one TP group is the world).
    Collective over the default group: every rank calls it with the same arguments, once. Bad
    arguments raise ``ValueError`` on every rank alike, before any collective."""
    import torch.distributed as dist

    world = dist.get_world_size()
    groups = [list(map(int, g)) for g in tp_ranks]
    if sorted(r for g in groups for r in g) != list(range(world)):
        raise ValueError(f"tp_sub_groups: the TP groups {groups} must hold every rank of the "
                         f"world (0..{world - 1}) once")
    if any(g != sorted(g) for g in groups):
        raise ValueError(f"tp_sub_groups: list each TP group's ranks ascending, as its process "
                         f"group orders them: {groups}")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"tp_sub_groups: TP groups of different sizes {sorted(sizes)}")
    tp = sizes.pop()
    if k < 1 or tp % k:
        raise ValueError(f"tp_sub_groups: k = {k} must divide the TP group's size {tp}")
    me = dist.get_rank()
    mine = next(g for g in groups if me in g)
    held = dist.get_process_group_ranks(tp_group if tp_group is not None
                                        else dist.group.WORLD)
    if list(held) != mine:
        # differs between ranks, so this rank must not enter the collective below alone:
        # every rank checks, and a wrong tp_group is a bug on every rank of a TP group alike
        raise ValueError(f"tp_sub_groups: rank {me}'s tp_group holds ranks {list(held)}, but "
                         f"its TP group in tp_ranks is {mine}: pass the rank's TP process group")
    s = tp // k
    subs = [[g[j + i * s] for i in range(k)] for g in groups for j in range(s)]
    group, _ = dist.new_subgroups_by_enumeration(subs, backend=backend)
    return SubGroups(tp_group, tp, k, mine.index(me), group, me)


def sub_group_rows(shards: Sequence[Tensor], subs: SubGroups, *,
                   dtype: torch.dtype | None = torch.bfloat16, async_op: bool = False
                   ) -> tuple[Tensor, Any]:
    """Start gathering this rank's row block of its slot's matrix (see the module): shards
    [b, b + s) of it from its block's ranks, in order, as ``[s·rows, n]`` in ``dtype``.
    Returns (the block, the all-to-all's work, or None once done when not ``async_op``); the
    block is valid once the work is waited for, and ``shards`` may not change before."""
    import torch.distributed as dist

    s = subs.slots
    _check(shards, subs, dtype)
    mine = shards[subs.slot]
    rows, n = mine.shape
    dt = dtype or mine.dtype
    if s == 1:  # the whole TP group shares the one matrix: each rank has its rows already
        return mine.to(dt), None
    send_splits, recv_splits = _splits(shards, subs)
    send = torch.cat([x.reshape(-1).to(dt) for x in shards])
    recv = torch.empty(sum(recv_splits), dtype=dt, device=mine.device)
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=subs.tp_group,
                                  async_op=async_op)
    return recv.view(s * rows, n), _Keep(work, send) if async_op else None


def sub_group_return(out: Tensor, shards: Sequence[Tensor], subs: SubGroups, *,
                     async_op: bool = False) -> tuple[list[Tensor], Any]:
    """Return each row of ``out`` (this rank's rows of its slot's result, as
    :func:`sub_group_rows` gathered them) to the rank whose shard it is, and receive this
    rank's rows of every slot's result: per slot ``[rows_j, n_j]`` in ``out``'s dtype. Returns
    (them, the all-to-all's work or None); valid once the work is waited for."""
    import torch.distributed as dist

    if subs.slots == 1:
        return [out], None
    send_splits, recv_splits = _splits(shards, subs)
    back = torch.empty(sum(send_splits), dtype=out.dtype, device=out.device)
    flat = out.contiguous().view(-1)
    work = dist.all_to_all_single(back, flat, send_splits, recv_splits, group=subs.tp_group,
                                  async_op=async_op)
    work = _Keep(work, flat) if async_op else None
    result, at = [], 0
    for x in shards:
        result.append(back[at:at + x.numel()].view(x.shape))
        at += x.numel()
    return result, work


class _Keep:
    """A collective's work holding its send buffer until it is waited for (the caller keeps
    only the work; the buffer must outlive the transfer on any backend)."""

    def __init__(self, work: Any, *tensors: Tensor) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, timeout: Any = None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        self.tensors = ()
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _check(shards: Sequence[Tensor], subs: SubGroups, dtype: torch.dtype | None) -> None:
    if len(shards) != subs.slots:
        raise ValueError(f"sub_group_newton_schulz: {len(shards)} shards for {subs.slots} slots "
                         f"(tp {subs.tp} / k {subs.k}): one per sub-group's matrix")
    if any(x.dim() != 2 for x in shards):
        raise ValueError("sub_group_newton_schulz: each shard is a [rows, n] row block")
    if dtype is None and len({x.dtype for x in shards}) > 1:
        raise ValueError(f"sub_group_newton_schulz: shards of dtypes "
                         f"{sorted(str(x.dtype) for x in shards)} travel in one buffer: pass "
                         f"dtype (the iteration dtype) or give them one dtype")


def _splits(shards: Sequence[Tensor], subs: SubGroups) -> tuple[list[int], list[int]]:
    """(elements this rank sends to, receives from, each TP rank) in the gather: slot j's
    shard to rank b + j of its block, its own slot's shard from every rank of the block."""
    first = subs.block.start
    send, recv = [0] * subs.tp, [0] * subs.tp
    for j in range(subs.slots):
        send[first + j] = shards[j].numel()
        recv[first + j] = shards[subs.slot].numel()
    return send, recv


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
    one TP sub-group (see the module): :func:`sub_group_rows`, the shared Newton–Schulz over
    the sub-group, :func:`sub_group_return`, each waited for in turn. (In a lockstep with
    other matrices the gather and the return would run beside their work: start
    :func:`sub_group_rows` with ``async_op``, pass the block with ``subs.group`` to
    ``shared_newton_schulz_many``.)

    Args:
        shards: Per slot j, this TP rank's shard of the slot-j matrix, oriented along its long
            dimension (``[rows_j, n_j]``, any view: e.g. ``orientation(...).orient(shard)``),
            with the same shape and dtype on every TP rank (Megatron's equal shards; a
            mismatch between ranks is not detected and corrupts or hangs the exchange); not
            modified.
        subs: This rank's sub-groups (:func:`tp_sub_groups`).
        coefficients, steps, eps, dtype, split_polynomial, timeout_s: As
            :func:`~canzona.runtime.optim.shared_ns.shared_newton_schulz`; the rows travel in
            ``dtype`` (``None``: the shards' common dtype).
        what: Per slot, the matrix's name for timeout errors.

    Returns:
        Per slot, ``[rows_j, n_j]`` in ``dtype``: this rank's rows of that matrix's
        orthogonalised update, equal to ``newton_schulz(whole)`` restricted to them up to
        summation order.
    """
    names = list(what) + [""] * (subs.slots - len(what))
    label = names[subs.slot] or f"slot {subs.slot}"
    block, work = sub_group_rows(shards, subs, dtype=dtype, async_op=True)
    if work is not None:
        wait_for(work, f"the TP sub-group gather of {label}", timeout_s, subs.me)
    (out,) = shared_newton_schulz_many([block], group=subs.group, coefficients=coefficients,
                                       steps=steps, eps=eps, dtype=dtype,
                                       split_polynomial=split_polynomial, timeout_s=timeout_s,
                                       what=[label])
    del block
    result, work = sub_group_return(out, shards, subs, async_op=True)
    if work is not None:
        wait_for(work, f"the TP sub-group return of {label}", timeout_s, subs.me)
    return result
