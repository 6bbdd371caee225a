"""TP execution: the plan's micro-groups, gathered, computed by their host and scattered back.

Under tensor parallelism every matrix is split over the TP group. After the DP reduce-scatter,
each TP rank of DP index d holds, in its own slice of the bucket, *its shard* of the averaged
gradient of every TP-split matrix task d owns. For each micro-group of d's TP schedule, in the
plan's order:

1. **gather** — one ``all_to_all_single`` over the TP group: rank t sends, for each task of the
   group in wire order (by host, then id), its segments of the gradient (``ShardLayoutPlan``) to
   the task's host; split sizes are the plan's ``gather_send``/``gather_recv``;
2. **compute** — the host rebuilds each full (logical) gradient from the segments and runs the
   matrix kernel on all of them in one call (same shapes batched); only the host holds a task's
   optimizer state, which never moves;
3. **scatter** — the reverse ``all_to_all_single``: each rank receives its segments of every
   update;
4. **apply** — each rank applies its shard of every update to its shard of the parameter
   (``kernel.apply(..., full_shape=...)``: the learning-rate scale of the full matrix).

The gather of group i+1 is started before group i is computed, and the scatter of group i runs
while group i+1 is computed (two groups in flight: up to 2·C_max of gathered bytes). The
collectives are async work handles on every backend: on CUDA/NCCL the collective runs on the
communicator's stream and ``wait()`` makes the current stream wait for it, so the code is the same
on CPU (gloo) and GPU.

A task whose parameter received no gradient on any rank is skipped by every rank alike (its
host sends zeros, which nobody applies). Where the kernel leaves a matrix untouched (``None``:
SOAP's first step, a non-finite gradient under ``nonfinite="skip"``) the host sends NaN and
every rank leaves its shard untouched. Under ``nonfinite="raise"`` the host raises after the
scatter, and one small all-reduce over the TP group makes every TP rank raise with it.

The runner's records come from the plan (``runtime.tp_tasks``); the matrices the TP group
shares (whole, with a partner DP index, or a round of them by TP sub-groups) run before the
micro-groups, in lockstep (``runtime.tp_shared``).
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.optim import NonFiniteGradientError
from canzona.runtime.optim.sub_groups import SubGroups
from canzona.runtime.storage.buffers import BucketBuffers
from canzona.runtime.tp_shared import SharedLockstep
from canzona.runtime.tp_tasks import SharedTask, TPGroup, TPTask
from canzona.runtime.waits import wait_for

__all__ = ["COMM_DTYPES", "MicroGroupRunner"]

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class _InFlight:
    """An all-to-all in flight: its output, its work handle and its send buffer, kept alive
    until the collective completes (on NCCL it runs on the communicator's stream)."""

    out: Tensor
    work: Any
    send: Tensor | None
    what: str = ""
    timeout_s: float | None = None
    rank: int = 0

    def wait(self) -> Tensor:
        if self.work is not None:  # on CUDA: the current stream waits for the collective
            wait_for(self.work, self.what, self.timeout_s, self.rank)
        self.work = self.send = None
        return self.out


def _piece(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    return x[start:start + length] if dim == 0 else x[:, start:start + length]


class MicroGroupRunner(SharedLockstep):
    """Runs this TP rank's micro-groups for one step (see the module docstring), after the
    matrices its TP group shares (:class:`~canzona.runtime.tp_shared.SharedLockstep`)."""

    def __init__(self, groups: Sequence[TPGroup], *, tp_rank: int, tp: int, comm_dtype: str,
                 buffers: Sequence[BucketBuffers], params: list[Tensor],
                 shared: Sequence[SharedTask] = (), shared_cap: int = 0) -> None:
        self.groups = tuple(groups)
        self.shared = tuple(shared)
        #: scratch bytes one lockstep batch of shared matrices may hold (2 · the plan's C_max,
        #: as two micro-groups in flight)
        self.shared_cap = shared_cap
        self.timeout_s: float | None = None  # CanzonaOptimizer(collective_timeout=)
        #: the DP group of this TP rank (a pair's partner is reached through it)
        self.dp_group: Any = None
        #: this rank's TP sub-groups by k, for the plan's rounds (created once at construction,
        #: ``optim.sub_groups.tp_sub_groups``)
        self.subs: dict[int, SubGroups] = {}
        self.flight: Any = None  # CanzonaOptimizer(flight_record=)
        self.rank = 0  # this process's DP rank, for messages
        self.tp_rank, self.tp = tp_rank, tp
        self.comm_dtype = COMM_DTYPES[comm_dtype]
        self._buffers = buffers
        self._params = params
        #: The largest gathered (received) buffer of a group, in elements: with two groups in
        #: flight the runtime's scratch peaks at about twice this (``peak_scratch_bytes``).
        self.max_recv = max((sum(g.recv) for g in self.groups), default=0)

    def release(self) -> None:
        """Let go of the process groups this runner holds (the DP group a TP pair's partner is
        reached through, the TP sub-groups): the optimizer no longer keeps them alive."""
        self.dp_group = None
        self.subs = {}

    @property
    def tasks(self) -> tuple[TPTask, ...]:
        return tuple(t for g in self.groups for t in g.tasks)

    @property
    def hosted(self) -> tuple[TPTask, ...]:
        return tuple(t for g in self.groups for t in g.hosted)

    def peak_scratch_bytes(self, ns_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of gathered full matrices held at once by this rank's pipeline, at most, or of
        the largest lockstep batch of shared matrices, rounds of TP sub-groups with their
        all-to-all buffers (the two phases do not overlap)."""
        size = torch.empty((), dtype=self.comm_dtype).element_size()
        recv = sorted((sum(g.recv) for g in self.groups), reverse=True)
        batches = self._batches(self._halves_first(self.shared), ns_dtype)
        shared = max((sum(b) for _, b in batches), default=0)
        return max(sum(recv[:2]) * size, shared)

    def init_state(self, state: MutableMapping[Tensor, Any], matrix: Any,
                   device: torch.device) -> None:
        """fp32 state of every task hosted here (full shape), under its parameter (and part),
        and of this rank's shard of every shared task (its rows of the momentum; a TP
        sub-group's matrix too: its rows travel, its state stays on the shard)."""
        for x in self.shared:
            state[self._params[x.param]] = matrix.init_state(x.local_shape, torch.float32, device)
        for t in self.hosted:
            st = matrix.init_state(t.full_shape, torch.float32, device)
            if t.part is None:
                state[self._params[t.param]] = st
            else:
                state[self._params[t.param]][t.part] = st

    # -- one step -------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, *, group: Any, state: MutableMapping[Tensor, Any], matrix: Any,
            received: Sequence[int], overlap: bool = True) -> None:
        """The shared tasks, then gather → compute → scatter → apply, every group in order;
        pipelined unless ``overlap`` is False (each collective waited for at once: for
        measuring the overlap)."""
        self._run_shared(group, state, matrix, received)
        if not self.groups:
            return
        if not overlap:
            error = None
            for g in self.groups:
                recv = self._start_gather(g, group).wait()
                updates, failed = self._compute(g, recv, state, matrix, received)
                error = error or failed
                self._apply(g, self._start_scatter(g, updates, group), matrix, received)
            self._raise_together(error, matrix, group)
            return
        gathers: list[Any] = [None] * len(self.groups)
        gathers[0] = self._start_gather(self.groups[0], group)
        pending = None  # (group, its scatter)
        error: Exception | None = None
        for k, g in enumerate(self.groups):
            recv = gathers[k].wait()
            gathers[k] = None
            if k + 1 < len(self.groups):
                gathers[k + 1] = self._start_gather(self.groups[k + 1], group)
            updates, failed = self._compute(g, recv, state, matrix, received)
            error = error or failed
            scatter = self._start_scatter(g, updates, group)
            if pending is not None:
                self._apply(*pending, matrix, received)
            pending = (g, scatter)
        self._apply(*pending, matrix, received)
        self._raise_together(error, matrix, group)

    def _raise_together(self, error: Exception | None, matrix: Any, group: Any) -> None:
        """Under ``nonfinite="raise"``: every TP rank raises when a host did."""
        if getattr(getattr(matrix, "config", None), "nonfinite", None) == "raise" and self.tp > 1:
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int32,
                                device=self._buffers[0].own.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if error is None and int(flag.item()):
                error = NonFiniteGradientError(["a matrix hosted on another TP rank"])
        if error is not None:
            raise error

    def _all_to_all(self, send: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    group: Any, what: str = "") -> _InFlight:
        out = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
        if self.tp == 1:
            out.copy_(send)
            return _InFlight(out, None, None)
        work = dist.all_to_all_single(out, send, list(out_splits), list(in_splits), group=group,
                                      async_op=True)
        if self.flight is not None:
            self.flight.add(what, work)
        return _InFlight(out, work, send, what, self.timeout_s, self.rank)

    def _start_gather(self, g: TPGroup, group: Any) -> _InFlight:
        """Launch the gather of group ``g``: this rank's segments of each task's gradient."""
        pieces = []
        for t in g.tasks:
            grad = self._buffers[t.bucket].own[t.lo:t.hi].view(t.local_shape)
            for _, ls, _, n in t.of(self.tp_rank):
                pieces.append(_piece(grad, t.dim, ls, n).reshape(-1))
        device = self._buffers[g.tasks[0].bucket].own.device
        send = (torch.cat(pieces) if pieces else torch.empty(0, device=device)).to(self.comm_dtype)
        return self._all_to_all(send, g.recv, g.send, group,
                                f"the TP gather (all-to-all) of micro-group {g.index}")

    def _compute(self, g: TPGroup, recv: Tensor, state: MutableMapping[Tensor, Any], matrix: Any,
                 received: Sequence[int]) -> tuple[dict[int, Tensor], Exception | None]:
        """The host's full gradients from the received segments, and their updates (fp32)."""
        offsets = [0]
        for n in g.recv:
            offsets.append(offsets[-1] + n)
        ptr = list(offsets[:-1])  # per source rank, the next element of its chunk
        fulls: dict[int, Tensor] = {}
        for t in g.hosted:
            full = torch.empty(t.full_shape, dtype=torch.float32, device=recv.device)
            for r in range(self.tp):
                for _, _, fs, n in t.of(r):
                    shape = (n, t.full_shape[1]) if t.dim == 0 else (t.full_shape[0], n)
                    size = shape[0] * shape[1]
                    _piece(full, t.dim, fs, n).copy_(recv[ptr[r]:ptr[r] + size].view(shape))
                    ptr[r] += size
            fulls[t.id] = full
        todo = [t for t in g.hosted if received[t.param]]
        updates: dict[int, Tensor] = {t.id: torch.zeros_like(fulls[t.id]) for t in g.hosted}
        error = None
        if todo:
            states = [_task_state(t, self._params, state) for t in todo]
            try:
                out = matrix.direction([fulls[t.id] for t in todo], states,
                                       names=[t.name for t in todo])
            except (ArithmeticError, ValueError) as exc:  # nonfinite="raise": after the scatter
                out, error = [None] * len(todo), exc
            for t, u in zip(todo, out):
                updates[t.id] = u.float() if u is not None else torch.full_like(fulls[t.id],
                                                                                float("nan"))
        return updates, error

    def _start_scatter(self, g: TPGroup, updates: dict[int, Tensor],
                       group: Any) -> _InFlight:
        """Launch the scatter of group ``g``: to each rank, its segments of every update."""
        pieces = []
        for r in range(self.tp):
            for t in g.hosted:
                for _, _, fs, n in t.of(r):
                    pieces.append(_piece(updates[t.id], t.dim, fs, n).reshape(-1))
        device = self._buffers[g.tasks[0].bucket].own.device
        send = (torch.cat(pieces) if pieces else torch.empty(0, device=device)).to(self.comm_dtype)
        return self._all_to_all(send, g.send, g.recv, group,
                                f"the TP scatter (all-to-all) of micro-group {g.index}")

    def _apply(self, g: TPGroup, scatter: _InFlight, matrix: Any,
               received: Sequence[int]) -> None:
        """This rank's shard of every update of group ``g`` onto its shard of the parameter."""
        recv = scatter.wait()
        offsets = [0]
        for n in g.send:
            offsets.append(offsets[-1] + n)
        ptr = list(offsets[:-1])  # per host, the next element of its chunk
        todo = []  # (task, its chunks: (local start, length, update segment))
        for t in g.tasks:
            chunks = []
            for _, ls, _, n in t.of(self.tp_rank):
                shape = (n, t.full_shape[1]) if t.dim == 0 else (t.full_shape[0], n)
                size = shape[0] * shape[1]
                chunks.append((ls, n, recv[ptr[t.host]:ptr[t.host] + size].view(shape)))
                ptr[t.host] += size
            if received[t.param] and chunks:
                todo.append((t, chunks))
        if not todo:
            return
        # NaN marks what the host's kernel left untouched (see the module docstring): one
        # device-to-host read for the whole group.
        finite = torch.stack([torch.stack([torch.isfinite(u).all() for *_, u in chunks]).all()
                              for _, chunks in todo]).tolist()
        for (t, chunks), ok in zip(todo, finite):
            if not ok:
                continue
            buf = self._buffers[t.bucket]
            # With fp32 main copies (main_params="fp32") the update goes to the main copy of the
            # shard, then into the parameter buffer (what the DP all-gather sends).
            p = (self._params[t.param] if buf.main is None
                 else buf.main[t.lo:t.hi].view(t.local_shape))
            for ls, n, u in chunks:
                matrix.apply(_piece(p, t.dim, ls, n), u.to(torch.float32),
                             full_shape=t.full_shape)
            if buf.main is not None:
                buf.own_params[t.lo:t.hi].copy_(buf.main[t.lo:t.hi])


def _task_state(t: TPTask, params: list[Tensor], state: MutableMapping[Tensor, Any]) -> Any:
    st = state[params[t.param]]
    return st if t.part is None else st[t.part]
