"""Muon matrices shared by two DP ranks (the plan's ``dp_shared``; tp = 1).

A shared task's bucket is cut inside the parameter at a row boundary (rows are its long
dimension), so each of the two DP ranks holds a row block of the parameter, of its averaged
gradient and of its momentum (``schedule.MatrixTask`` with ``pair`` set). Each rank applies
Muon's momentum to its rows, then the two orthogonalise the matrix together with
:func:`~canzona.runtime.optim.shared_ns.shared_newton_schulz_many` over the pair's process
group (one all-reduce of the Gram's upper block rows per iteration) and each applies its rows of
the update with the whole matrix's learning-rate scale. The result is the single-device Muon
update up to summation order.

No process group is created for a pair: the two ranks exchange their partial Grams (and
polynomial blocks) with point-to-point messages on the DP group
(:class:`~canzona.runtime.optim.transports.PeerPair`; an exchange and a sum is a two-rank
all-reduce), so there is no communicator per pair on any rank, and any two DP indices can pair.
A rank runs its pairs in the plan's phase order; the plan gives no rank two pairs in one phase,
so partners meet in the same order and the pairs of a phase run side by side.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.optim.shared_ns import shared_newton_schulz_many
from canzona.runtime.optim.transports import PeerPair, pair_exchange, sum_each
from canzona.runtime.schedule import MatrixTask, WorkOrder
from canzona.runtime.storage.buffers import BucketBuffers
from canzona.runtime.waits import wait_for

__all__ = ["PairRunner", "pair_tasks"]


def pair_tasks(work: WorkOrder) -> list[MatrixTask]:
    """This rank's pieces of shared matrices, in run order: by phase, then task id."""
    return sorted((t for ts in work.matrix for t in ts if t.pair is not None),
                  key=lambda t: (t.phase, t.id))


class PairRunner:
    """This rank's shared pieces and, per pair, how to reach its partner."""

    def __init__(self, work: WorkOrder, *, dp_group: Any, dp_rank: int,
                 timeout_s: float | None = None, flight: Any = None) -> None:
        self.tasks = pair_tasks(work)
        self.timeout_s = timeout_s
        self.flight = flight
        self.rank = dp_rank
        self.groups: dict[tuple[int, int], PeerPair] = {}
        for t in self.tasks:
            pair = t.pair
            assert pair is not None
            if dp_rank not in pair:
                raise PlanMismatchError(f"the plan gives DP rank {dp_rank} a piece of "
                                        f"'{t.name}' shared by DP indices {list(pair)}")
            self.groups.setdefault(pair, PeerPair(pair, pair.index(dp_rank), dp_group))

    @torch.no_grad()
    def directions(self, buffers: Sequence[BucketBuffers], params: list[Tensor],
                   state: MutableMapping[Tensor, Any], matrix: Any,
                   received: Sequence[int]) -> dict[int, Tensor]:
        """Per shared task id, this rank's rows of its Muon update (float32). Tasks whose
        parameter got no gradient, or a non-finite one that ``nonfinite="skip"`` skips
        (``received[i] == 0`` on every rank alike), are left out by both partners."""
        todo = [t for t in self.tasks if received[t.param]]
        if not todo:
            return {}
        cfg = matrix.config
        out: dict[int, Tensor] = {}
        by_pair: dict[tuple[int, int], list[MatrixTask]] = {}
        for t in todo:  # in phase order; one pair per phase on this rank
            by_pair.setdefault(t.pair, []).append(t)  # type: ignore[arg-type]
        for pair, tasks in by_pair.items():
            peer = self.groups[pair]
            ups = []
            for t in tasks:
                grad = buffers[t.bucket].own[t.lo:t.hi].view(t.shape)
                mom = state[params[t.param]]["momentum_buffer"]
                g = grad.to(mom.dtype)
                mom.lerp_(g, 1 - cfg.momentum)
                ups.append(g.lerp(mom, cfg.momentum) if cfg.nesterov else mom)
            # A wide matrix: this rank's rows are a block of its short dimension; swap them for
            # a block of columns (rows of the transposed, tall matrix), and back after.
            wide = [t.full_shape[0] < t.full_shape[1] for t in tasks]
            cols = [_columns(t, peer.me) for t in tasks]
            blocks = [u for u in ups]
            swapped = self._swap([(u[:, c[1]] if w else None, _recv_shape(t, peer.me, True),
                                   u.dtype) for u, c, w, t in zip(ups, cols, wide, tasks)],
                                 peer, "columns")
            for k, (u, c, w) in enumerate(zip(ups, cols, wide)):
                if w:  # rows in order: the lower rank's first
                    parts = [u[:, c[0]], swapped[k]] if peer.me == 0 else [swapped[k], u[:, c[0]]]
                    blocks[k] = torch.cat(parts, 0).mT
            orthos = shared_newton_schulz_many(
                blocks, group=peer, coefficients=cfg.schedule, steps=cfg.ns_steps,
                eps=cfg.eps, dtype=cfg.ns_dtype, split_polynomial=[t.split_poly for t in tasks],
                timeout_s=self.timeout_s, flight=self.flight,
                what=[f"the shared Newton–Schulz of '{t.name}' (DP pair {list(pair)})"
                      for t in tasks])
            rows = [t.shape[0] for t in tasks]
            back = self._swap([(_not_mine_rows(o.mT, t, peer.me) if w else None,
                                _recv_shape(t, peer.me, False), o.dtype)
                               for o, w, t in zip(orthos, wide, tasks)], peer, "rows")
            pieces = []
            for k, (t, o, w) in enumerate(zip(tasks, orthos, wide)):
                if w:
                    mine = _mine_rows(o.mT, t, peer.me)
                    parts = [mine, back[k]] if peer.me == 0 else [back[k], mine]
                    o = torch.cat(parts, 1)
                assert o.shape[0] == rows[k]
                pieces.append(o)
            # Each rank holds whole rows of the update now; a kernel that finishes it on the
            # whole matrix (NorMuon's norms) sums what it needs with the partner.
            finished = matrix.finish_shared(
                pieces, [state[params[t.param]] for t in tasks], [t.full_shape for t in tasks],
                [True] * len(tasks), self._reduce(peer, tasks))
            for t, u in zip(tasks, finished):
                out[t.id] = u
        return out

    def _reduce(self, peer: PeerPair, tasks: Sequence[MatrixTask]) -> Any:
        """Sums ``(k, tensor)`` items with the partner (task k's), for ``finish_shared``."""

        def reduce(items: list[tuple[int, Tensor]]) -> None:
            sum_each([x for _, x in items], [peer] * len(items),
                     [f"the row statistics of '{tasks[k].name}' (DP pair {list(peer.ranks)})"
                      for k, _ in items], timeout_s=self.timeout_s, rank=self.rank,
                     flight=self.flight)
        return reduce

    def _swap(self, sends: list[tuple[Tensor | None, tuple[int, int], torch.dtype]],
              peer: PeerPair, what: str) -> list[Tensor | None]:
        """One exchange with the partner of every given block (None: nothing for that task):
        each block sent, one of ``shape`` received, in task order (both sides alike)."""
        todo = [(k, send.contiguous(), torch.empty(shape, dtype=dtype, device=send.device))
                for k, (send, shape, dtype) in enumerate(sends) if send is not None]
        out: list[Tensor | None] = [None] * len(sends)
        if not todo:
            return out
        works = pair_exchange([(s, r) for _, s, r in todo], peer)
        name = f"the {what} exchange of DP pair {list(peer.ranks)}"
        if self.flight is not None:
            for w in works:
                self.flight.add(name, w)
        for w in works:
            wait_for(w, name, self.timeout_s, self.rank)
        for k, _, r in todo:
            out[k] = r
        return out


def _columns(t: MatrixTask, me: int) -> tuple[slice, slice]:
    """(the columns this rank keeps, the columns it sends) of a wide piece: the lower rank
    keeps the first ⌈cols/2⌉ (the planner's split of the long dimension)."""
    c = -(-t.full_shape[1] // 2)
    first, second = slice(0, c), slice(c, t.full_shape[1])
    return (first, second) if me == 0 else (second, first)


def _recv_shape(t: MatrixTask, me: int, before: bool) -> tuple[int, int]:
    """The block a wide piece receives: before the iteration, the partner's rows of this
    rank's columns; after, the partner's columns of this rank's rows."""
    m, n = t.full_shape
    c = -(-n // 2)
    mine_cols = c if me == 0 else n - c
    other_rows = m - t.shape[0]
    return (other_rows, mine_cols) if before else (t.shape[0], n - mine_cols)


def _mine_rows(update_cols: Tensor, t: MatrixTask, me: int) -> Tensor:
    """This rank's rows of its column block of the update."""
    return update_cols[t.row0:t.row0 + t.shape[0]]


def _not_mine_rows(update_cols: Tensor, t: MatrixTask, me: int) -> Tensor:
    """The partner's rows of this rank's column block of the update (what it sends back)."""
    return update_cols[:t.row0] if me == 1 else update_cols[t.shape[0]:]
