"""The matrices a TP group shares (the plan's ``tp.indices[d].shared``), run before the
micro-groups on every TP rank alike, in plan order.

Muon: momentum on this rank's shard, then the shared Newton–Schulz of the matrices of a lockstep
batch (``optim.shared_ns.shared_newton_schulz_many``: one Gram all-reduce per matrix and
iteration, each running while the others compute) — over the TP group, over a ``TPPair``
(k = 2·tp) for a matrix shared with the partner DP index too, or over a TP sub-group (k < tp)
for a round of tp/k alike matrices (``optim.sub_groups``: each rank's rows of its slot's matrix
gathered from its block of TP ranks before the lockstep, asynchronously while the batch's other
matrices are prepared, and the update rows returned to the shards' ranks after it) — and this
shard's rows of each update applied with the full matrix's learning-rate scale. A batch's
scratch fits ``shared_cap`` (``planner.formulas.lockstep_batches``; a round is one unit of it,
never cut, sized by ``formulas.sub_round_bytes``), and the halves shared with a partner index
come first. Shampoo: each rank preconditions the whole blocks of its own shard, with no
collective. A non-finite update leaves its shard untouched on every rank alike.

:class:`SharedLockstep` is the shared half of ``runtime.tp.MicroGroupRunner``, which holds the
attributes it reads.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.planner.formulas import lockstep_batches, lockstep_bytes, sub_round_bytes
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.optim.orientation import orientation
from canzona.runtime.optim.shared_ns import shared_newton_schulz_many
from canzona.runtime.optim.sub_groups import SubGroups, sub_group_return, sub_group_rows
from canzona.runtime.optim.transports import PeerPair, TPPair, sum_each
from canzona.runtime.storage.buffers import BucketBuffers
from canzona.runtime.tp_tasks import SharedTask
from canzona.runtime.waits import wait_for

__all__ = ["SharedLockstep"]


class SharedLockstep:
    """The shared tasks of one TP rank's step (see the module docstring), a base of
    ``runtime.tp.MicroGroupRunner``."""

    shared: tuple[SharedTask, ...]
    #: scratch bytes one lockstep batch of shared matrices may hold
    shared_cap: int
    tp: int
    rank: int  # this process's DP rank: its place in a pair
    dp_group: Any  # the DP group of this TP rank (a pair's partner is reached through it)
    #: this rank's TP sub-groups by k (``optim.sub_groups.tp_sub_groups``, created once)
    subs: dict[int, SubGroups]
    timeout_s: float | None
    flight: Any
    _buffers: Sequence[BucketBuffers]
    _params: list[Tensor]

    @staticmethod
    def _units(tasks: Sequence[SharedTask]) -> list[list[SharedTask]]:
        """``tasks`` in order as the lockstep's units: each round of TP sub-groups (its members
        are consecutive) one unit, every other task one of its own."""
        units: list[list[SharedTask]] = []
        for x in tasks:
            last = units[-1][0] if units else None
            if x.sub is not None and last is not None and last.sub is not None \
                    and last.sub[1] == x.sub[1]:
                units[-1].append(x)
            else:
                units.append([x])
        return units

    def _unit_bytes(self, unit: Sequence[SharedTask], e: int) -> int:
        """The scratch one unit holds on this rank in a lockstep batch, with ``e`` bytes per
        element of the Newton–Schulz dtype (what the planner models)."""
        x = unit[0]
        if x.blocks:
            return 0
        m, n = max(x.full_shape), min(x.full_shape)
        if x.sub is not None:  # a round: the sub-group's rows and the all-to-all buffers
            return sub_round_bytes(m, n, self.tp, x.sub[0], x.split_poly, e)
        k = self.tp * (1 if x.pair is None else 2)
        return lockstep_bytes(-(-m // k), n, k, x.split_poly, e)

    def _batches(self, tasks: Sequence[SharedTask], ns_dtype: torch.dtype
                 ) -> list[tuple[list[SharedTask], list[int]]]:
        """``tasks`` in order, in lockstep batches whose scratch fits ``shared_cap``
        (``planner.formulas.lockstep_batches``, what the planner models), each round of TP
        sub-groups one unit, never cut: (the batch's tasks, each unit's scratch bytes)."""
        e = torch.empty((), dtype=ns_dtype).element_size()
        units = self._units(tasks)
        sizes = [self._unit_bytes(u, e) for u in units]
        out = []
        for batch in lockstep_batches(list(range(len(units))), sizes, self.shared_cap):
            out.append(([x for i in batch for x in units[i]], [sizes[i] for i in batch]))
        return out

    def _run_shared(self, group: Any, state: MutableMapping[Tensor, Any], matrix: Any,
                    received: Sequence[int]) -> None:
        """Every shared task, in plan order, on every TP rank alike: Muon's momentum on this
        rank's shard, the shared Newton–Schulz of every matrix over its sharing ranks in
        lockstep (one Gram all-reduce per matrix and iteration, each running while the others
        compute; ``runtime.optim.shared_ns.shared_newton_schulz_many``) returning this shard's
        rows, and each update applied with the full matrix's learning-rate scale. The result is
        the single-device Muon update up to summation order. A round of TP sub-groups runs
        whole where any of its matrices received a gradient (the others' rows travel as zeros
        and nothing of them is updated). Shampoo: each rank its shard's blocks
        (:meth:`_run_blocks`)."""
        if not self.shared:
            return
        live = {x.id for x in self.shared if received[x.param]}  # alike on every rank
        rounds = {x.sub[1] for x in self.shared if x.sub is not None and x.id in live}
        todo = [x for x in self.shared
                if x.id in live or (x.sub is not None and x.sub[1] in rounds)]
        if any(x.blocks for x in todo):
            self._run_blocks([x for x in todo if x.blocks], state, matrix)
            todo = [x for x in todo if not x.blocks]
        if not todo:
            return
        cfg = matrix.config
        for batch, _ in self._batches(self._halves_first(todo), cfg.ns_dtype):
            self._run_batch(batch, group, state, matrix, live)

    @staticmethod
    def _halves_first(tasks: Sequence[SharedTask]) -> list[SharedTask]:
        """The halves shared with the partner index first (in plan order), then this TP
        group's own matrices and rounds of TP sub-groups (in plan order: a round's members stay
        consecutive). Both partners hold the same halves in the same order, so the batches cut
        the halves at the same places on both sides (the cuts depend only on what comes before:
        the halves), and within a batch the partners meet each half's exchange in the same
        order, whatever own matrices fill the rest (with the halves interleaved, the two sides
        would batch them differently and pair their exchanges up wrongly)."""
        return [x for x in tasks if x.pair is not None] + [x for x in tasks if x.pair is None]

    def _run_blocks(self, tasks: Sequence[SharedTask], state: MutableMapping[Tensor, Any],
                    matrix: Any) -> None:
        """Shampoo's blocks of this rank's shard of each matrix (whole blocks of the matrix,
        so its statistics, roots, grafting and momentum are the whole matrix's on them): the
        kernel on the shard, in one call, and the update applied to the shard. No collective.
        A shard whose update the kernel leaves out (``None``) or makes non-finite is left
        untouched (gradients are checked before the step on every rank alike; the kernel's own
        roots could still fail on one shard)."""
        grads, states = [], []
        for x in tasks:
            grads.append(self._buffers[x.bucket].own[x.lo:x.hi].view(x.local_shape))
            states.append(state[self._params[x.param]])
        updates = matrix.direction(grads, states, names=[x.name for x in tasks])
        kept = [(x, u.to(torch.float32)) for x, u in zip(tasks, updates) if u is not None]
        self._apply_shards([x for x, _ in kept], [u for _, u in kept], matrix)

    def _apply_shards(self, tasks: Sequence[SharedTask], updates: Sequence[Tensor],
                      matrix: Any) -> None:
        """Each finite update to its shard (with fp32 main copies, to the main copy, then into
        the parameter buffer the DP all-gather sends), with the full matrix's learning-rate
        scale; a non-finite one leaves its shard untouched. One host read for all."""
        finite = torch.stack([torch.isfinite(u).all() for u in updates]).tolist() if updates \
            else []
        for x, update, ok in zip(tasks, updates, finite):
            if not ok:
                continue
            buf = self._buffers[x.bucket]
            if buf.main is not None:
                p = buf.main[x.lo:x.hi].view(x.local_shape)
            else:  # the shard (this rank's rows of it where a partner holds the others)
                p = self._params[x.param]
                if getattr(x, "pair", None) is not None:
                    p = p.narrow(0, x.row0, x.local_shape[0])
            matrix.apply(p, update, full_shape=x.full_shape)
            if buf.main is not None:
                buf.own_params[x.lo:x.hi].copy_(buf.main[x.lo:x.hi])

    def _direction(self, x: SharedTask, state: MutableMapping[Tensor, Any], cfg: Any,
                   live: bool) -> tuple[Tensor, bool]:
        """Muon's momentum step on this rank's shard of ``x`` and the direction it
        orthogonalises, oriented along the long dimension (a view; rows of the oriented
        matrix), with whether it is transposed. ``live`` False (a round's matrix without a
        gradient this step): zeros, the momentum left as it was."""
        o = orientation(x.full_shape, x.dim)
        mom = state[self._params[x.param]]["momentum_buffer"]
        if not live:
            return o.orient(torch.zeros_like(mom)), o.transpose
        grad = self._buffers[x.bucket].own[x.lo:x.hi].view(x.local_shape)
        g = grad.to(mom.dtype)
        mom.lerp_(g, 1 - cfg.momentum)
        up = g.lerp(mom, cfg.momentum) if cfg.nesterov else mom
        return o.orient(up), o.transpose

    def _sub_groups(self, k: int) -> SubGroups:
        """This rank's TP sub-groups of ``k`` (created at construction, for every k the plan
        uses)."""
        subs = getattr(self, "subs", None) or {}
        if k not in subs:
            raise PlanMismatchError(f"the plan shares matrices over TP sub-groups of {k} ranks, "
                                    f"but none were created (the optimizer creates them at "
                                    f"construction from the plan).")
        return subs[k]

    def _run_batch(self, batch: Sequence[SharedTask], group: Any,
                   state: MutableMapping[Tensor, Any], matrix: Any,
                   live: set[int] | None = None) -> None:
        """One lockstep batch of shared matrices (scratch within ``shared_cap``). Each round of
        TP sub-groups in it: the momenta of its matrices first and the gather of this rank's
        rows of its slot's matrix started (``sub_group_rows``), running while the batch's other
        matrices are prepared; its rows join the lockstep with the sub-group; after it the
        update rows go back to the shards' ranks (``sub_group_return``), each rank receiving
        its shard's rows of every matrix of the round, as for a matrix its TP group shares.
        ``live``: the tasks that received a gradient (None: all)."""
        cfg = matrix.config
        alive = [live is None or x.id in live for x in batch]
        # The rounds first: their gathers run while the other matrices are prepared.
        rounds: dict[int, _Round] = {}
        for x, ok in zip(batch, alive):
            if x.sub is None:
                continue
            k, number, _ = x.sub
            if number not in rounds:
                rounds[number] = _Round(self._sub_groups(k))
            rounds[number].add(x, *self._direction(x, state, cfg, ok))
        for r in rounds.values():
            r.block, r.work = sub_group_rows(r.shards, r.subs, dtype=cfg.ns_dtype, async_op=True)
            r.name = r.tasks[r.subs.slot].name
            self._record(f"the TP sub-group gather of '{r.name}'", r.work)
        # The lockstep's matrices in batch order: one per task, one per round (this rank's
        # slot's rows); each with the group that shares it.
        blocks: list[Tensor | None] = []
        groups, splits, names = [], [], []
        flips: dict[int, bool] = {}
        directions: dict[int, int] = {}  # task id → its place in the lockstep (not rounds)
        for x, ok in zip(batch, alive):
            if x.sub is not None:
                r = rounds[x.sub[1]]
                if x.sub[2] == 0:  # the round's place: where its first matrix is
                    r.at = len(blocks)
                    blocks.append(None)  # its rows, once gathered
                    groups.append(r.subs.group)
                    splits.append(r.tasks[r.subs.slot].split_poly)
                    names.append(f"the shared Newton–Schulz of '{r.name}' (TP sub-group of "
                                 f"{r.subs.k})")
                continue
            up, flips[x.id] = self._direction(x, state, cfg, ok)
            directions[x.id] = len(blocks)
            blocks.append(up)
            if x.pair is None:
                groups.append(group)
            else:  # this TP group and the partner's same TP rank (through the DP group)
                groups.append(TPPair(group, PeerPair(x.pair, x.pair.index(self.rank),
                                                     self.dp_group)))
            splits.append(x.split_poly)
            names.append(f"the shared Newton–Schulz of '{x.name}'")
        for r in rounds.values():
            self._wait(r.work, f"the TP sub-group gather of '{r.name}'")
            blocks[r.at], r.work, r.block = r.block, None, None
        # All of them in lockstep: each one's Gram all-reduce runs while the others compute.
        orthos = shared_newton_schulz_many(
            blocks, group=groups, coefficients=cfg.schedule, steps=cfg.ns_steps, eps=cfg.eps,
            dtype=cfg.ns_dtype, split_polynomial=splits, timeout_s=self.timeout_s, what=names,
            flight=self.flight)
        del blocks
        for r in rounds.values():  # every round's rows on their way back, then each waited for
            r.back, r.work = sub_group_return(orthos[r.at], r.shards, r.subs, async_op=True)
            self._record(f"the TP sub-group return of '{r.name}'", r.work)
        for r in rounds.values():
            self._wait(r.work, f"the TP sub-group return of '{r.name}'")
            r.work = None
        # This shard's rows of each update, in the stored layout. Kernels that finish the
        # update on the whole matrix (NorMuon's row statistics) sum what they need over each
        # matrix's sharing ranks; a column-parallel shard (and a TP pair's piece of one) holds
        # whole rows, a row-parallel one columns. A round's matrices come back as the shards of
        # a matrix the TP group shares: their sums run over the TP group.
        todo, pieces, sums = [], [], []
        for x, ok in zip(batch, alive):
            if not ok:
                continue
            if x.sub is not None:
                r = rounds[x.sub[1]]
                piece, flip, over = r.back[x.sub[2]], r.flips[x.sub[2]], group
            else:
                j = directions[x.id]
                piece, flip, over = orthos[j], flips[x.id], groups[j]
            todo.append(x)
            pieces.append(piece.mT if flip else piece)
            sums.append(over)

        def reduce(items: list[tuple[int, Tensor]]) -> None:
            sum_each([t for _, t in items], [sums[k] for k, _ in items],
                     [f"the row statistics of '{todo[k].name}'" for k, _ in items],
                     timeout_s=self.timeout_s, rank=self.rank, flight=self.flight)

        updates = matrix.finish_shared(
            pieces, [state[self._params[x.param]] for x in todo], [x.full_shape for x in todo],
            [x.dim == 0 for x in todo], reduce)
        # The Grams are all-reduced, so a non-finite matrix makes every rank's rows non-finite
        # alike (a round's too: every member's rows, returned to every shard): every rank
        # leaves its shard untouched (as hosted tasks do).
        self._apply_shards(todo, updates, matrix)

    def _record(self, what: str, work: Any) -> None:
        if self.flight is not None and work is not None:
            self.flight.add(what, work)

    def _wait(self, work: Any, what: str) -> None:
        if work is not None:  # on CUDA: the current stream waits for the collective
            wait_for(work, what, self.timeout_s, self.rank)


class _Round:
    """A round of TP sub-groups in one lockstep batch, as this rank runs it: its matrices in
    slot order with this rank's oriented shard of each (``shards``, the gather's input and the
    return's shapes) and whether each is transposed; the gathered ``block`` of this rank's
    slot's matrix and the collective in flight (``work``: the gather, then the return); its
    place in the lockstep (``at``) and the returned rows of this rank's shard of each matrix
    (``back``)."""

    def __init__(self, subs: SubGroups) -> None:
        self.subs = subs
        self.tasks: list[SharedTask] = []
        self.shards: list[Tensor] = []
        self.flips: list[bool] = []
        self.block: Tensor | None = None
        self.work: Any = None
        self.at = 0
        self.back: list[Tensor] = []
        self.name = ""

    def add(self, x: SharedTask, shard: Tensor, flip: bool) -> None:
        self.tasks.append(x)
        self.shards.append(shard)
        self.flips.append(flip)
