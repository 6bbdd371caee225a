"""The matrices a TP group shares (the plan's ``tp.indices[d].shared``), run before the
micro-groups on every TP rank alike, in plan order.

Muon: momentum on this rank's shard, then the shared Newton–Schulz of the matrices of a lockstep
batch over the TP group (``optim.shared_ns.shared_newton_schulz_many``: one Gram all-reduce per
matrix and iteration, each running while the others compute) — over a ``TPPair`` (k = 2·tp)
for a matrix shared with the partner DP index too — and this shard's rows of each update applied
with the full matrix's learning-rate scale. A batch's scratch fits ``shared_cap``
(``planner.formulas.lockstep_batches``), and the halves shared with a partner index come first.
Shampoo: each rank preconditions the whole blocks of its own shard, with no collective. A
non-finite update leaves its shard untouched on every rank alike.

:class:`SharedLockstep` is the shared half of ``runtime.tp.MicroGroupRunner``, which holds the
attributes it reads.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.planner.formulas import lockstep_batches, lockstep_bytes
from canzona.runtime.optim.orientation import orientation
from canzona.runtime.optim.shared_ns import shared_newton_schulz_many
from canzona.runtime.optim.transports import PeerPair, TPPair, sum_each
from canzona.runtime.storage.buffers import BucketBuffers
from canzona.runtime.tp_tasks import SharedTask

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
    timeout_s: float | None
    flight: Any
    _buffers: Sequence[BucketBuffers]
    _params: list[Tensor]

    def _batches(self, tasks: Sequence[SharedTask], ns_dtype: torch.dtype
                 ) -> list[tuple[list[SharedTask], list[int]]]:
        """``tasks`` in order, in lockstep batches whose scratch fits ``shared_cap``
        (``planner.formulas.lockstep_batches``, what the planner models)."""
        e = torch.empty((), dtype=ns_dtype).element_size()
        sizes = {}
        for x in tasks:
            m, n = max(x.full_shape), min(x.full_shape)
            k = self.tp * (1 if x.pair is None else 2)
            sizes[x.id] = 0 if x.blocks else lockstep_bytes(-(-m // k), n, k, x.split_poly, e)
        out = []
        for batch in lockstep_batches(list(tasks), [sizes[x.id] for x in tasks], self.shared_cap):
            out.append((batch, [sizes[x.id] for x in batch]))
        return out

    def _run_shared(self, group: Any, state: MutableMapping[Tensor, Any], matrix: Any,
                    received: Sequence[int]) -> None:
        """Every shared task, in plan order, on every TP rank alike: Muon's momentum on this
        rank's shard, the shared Newton–Schulz of every matrix over the TP group in lockstep
        (one Gram all-reduce per matrix and iteration, each running while the others compute;
        ``runtime.optim.shared_ns.shared_newton_schulz_many``) returning this shard's rows, and
        each update applied with the full matrix's learning-rate scale. The result is the
        single-device Muon update up to summation order. Shampoo: each rank its shard's blocks
        (:meth:`_run_blocks`)."""
        if not self.shared:
            return
        todo = [x for x in self.shared if received[x.param]]  # alike on every rank
        if any(x.blocks for x in todo):
            self._run_blocks([x for x in todo if x.blocks], state, matrix)
            todo = [x for x in todo if not x.blocks]
        if not todo:
            return
        cfg = matrix.config
        for batch, _ in self._batches(self._halves_first(todo), cfg.ns_dtype):
            self._run_batch(batch, group, state, matrix)

    @staticmethod
    def _halves_first(tasks: Sequence[SharedTask]) -> list[SharedTask]:
        """The halves shared with the partner index first (in plan order), then this TP
        group's own matrices. Both partners hold the same halves in the same order, so the
        batches cut the halves at the same places on both sides (the cuts depend only on what
        comes before: the halves), and within a batch the partners meet each half's exchange
        in the same order, whatever own matrices fill the rest (with the halves interleaved,
        the two sides would batch them differently and pair their exchanges up wrongly)."""
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

    def _run_batch(self, batch: Sequence[SharedTask], group: Any,
                   state: MutableMapping[Tensor, Any], matrix: Any) -> None:
        """One lockstep batch of shared matrices (scratch within ``shared_cap``)."""
        cfg = matrix.config
        todo, blocks, flips, groups = [], [], [], []
        for x in batch:
            if x.pair is None:
                groups.append(group)
            else:  # this TP group and the partner's same TP rank (through the DP group)
                groups.append(TPPair(group, PeerPair(x.pair, x.pair.index(self.rank),
                                                     self.dp_group)))
            buf = self._buffers[x.bucket]
            grad = buf.own[x.lo:x.hi].view(x.local_shape)
            mom = state[self._params[x.param]]["momentum_buffer"]
            g = grad.to(mom.dtype)
            mom.lerp_(g, 1 - cfg.momentum)
            up = g.lerp(mom, cfg.momentum) if cfg.nesterov else mom
            o = orientation(x.full_shape, x.dim)
            todo.append(x)
            blocks.append(up.mT if o.transpose else up)
            flips.append(o.transpose)
        # All of them in lockstep: each one's Gram all-reduce runs while the others compute.
        orthos = shared_newton_schulz_many(
            blocks, group=groups, coefficients=cfg.schedule, steps=cfg.ns_steps, eps=cfg.eps,
            dtype=cfg.ns_dtype, split_polynomial=[x.split_poly for x in todo],
            timeout_s=self.timeout_s,
            what=[f"the shared Newton–Schulz of '{x.name}'" for x in todo],
            flight=self.flight)
        # Kernels that finish the update on the whole matrix (NorMuon's row statistics) sum
        # what they need over each matrix's sharing ranks; a column-parallel shard (and a TP
        # pair's piece of one) holds whole rows, a row-parallel one columns.
        pieces = [ortho.mT if flip else ortho for ortho, flip in zip(orthos, flips)]

        def reduce(items: list[tuple[int, Tensor]]) -> None:
            sum_each([t for _, t in items], [groups[k] for k, _ in items],
                     [f"the row statistics of '{todo[k].name}'" for k, _ in items],
                     timeout_s=self.timeout_s, rank=self.rank, flight=self.flight)

        updates = matrix.finish_shared(
            pieces, [state[self._params[x.param]] for x in todo], [x.full_shape for x in todo],
            [x.dim == 0 for x in todo], reduce)
        # The Grams are all-reduced, so a non-finite matrix makes every rank's rows non-finite
        # alike: every rank leaves its shard untouched (as hosted tasks do).
        self._apply_shards(todo, updates, matrix)
