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
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.planner.formulas import lockstep_batches, lockstep_bytes
from canzona.planner.plan import Plan
from canzona.runtime.buffers import BucketBuffers
from canzona.runtime.collectives import wait_for
from canzona.runtime.errors import PlanMismatchError

__all__ = ["TPGroup", "TPTask", "MicroGroupRunner", "SharedTask", "build_shared_tasks",
           "build_tp_groups", "COMM_DTYPES"]

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class TPTask:
    """A TP-split matrix task of this DP index.

    ``lo``/``hi``: the parameter's elements in its owner's own slice of bucket ``bucket`` (the
    whole local shard, every part); ``segments``: (rank, local_start, full_start, length) along
    ``dim``, in full_start order."""

    id: int
    param: int
    name: str
    part: str | None
    host: int
    bucket: int
    lo: int
    hi: int
    dim: int
    local_shape: tuple[int, int]
    full_shape: tuple[int, int]
    segments: tuple[tuple[int, int, int, int], ...]

    def of(self, rank: int) -> tuple[tuple[int, int, int, int], ...]:
        """The segments TP rank ``rank`` holds, in wire order."""
        return tuple(s for s in self.segments if s[0] == rank)

    def numel(self, rank: int) -> int:
        other = self.full_shape[1 - self.dim]
        return sum(s[3] for s in self.of(rank)) * other


@dataclass(frozen=True, slots=True)
class TPGroup:
    """One micro-group as this TP rank sees it."""

    index: int
    tasks: tuple[TPTask, ...]  # wire order
    hosted: tuple[TPTask, ...]  # the tasks this rank computes, wire order
    send: tuple[int, ...]  # gather: elements this rank sends to each TP rank
    recv: tuple[int, ...]  # gather: elements this rank receives from each TP rank


def build_tp_groups(plan: Plan, names: list[str], param_bucket: Sequence[int],
                    param_range: Sequence[tuple[int, int]], own_start: Sequence[int],
                    dp_rank: int, tp_rank: int) -> tuple[TPGroup, ...]:
    """This rank's micro-groups (DP index ``dp_rank``, TP rank ``tp_rank``), checked against the
    plan's split sizes. ``own_start[b]``: where this DP rank's own slice of bucket b starts."""
    T = plan.tp
    if T is None:
        return ()
    index = {n: i for i, n in enumerate(names)}
    tasks = {t.id: t for t in plan.tasks}
    tp = plan.inputs.tp
    mine = next((ix for ix in T.indices if ix.dp_index == dp_rank), None)
    if mine is None:
        raise PlanMismatchError(f"the plan's TP section has no schedule for DP index {dp_rank}.")
    groups = []
    for g in mine.groups:
        built = []
        for gt in g.tasks:
            t = tasks[gt.id]
            lay = T.layouts[gt.layout]
            i = index[t.param]
            bi = param_bucket[i]
            lo, hi = param_range[i]
            if lay.dim is None or len(lay.local_shape) != 2:
                raise PlanMismatchError(f"the plan's TP layout of '{t.param}' is not a split "
                                        "matrix; the plan is inconsistent.")
            name = t.param if t.part is None else f"{t.param}#{t.part}"
            built.append(TPTask(
                t.id, i, name, t.part, gt.host, bi, lo - own_start[bi], hi - own_start[bi],
                lay.dim, tuple(lay.local_shape),  # type: ignore[arg-type]
                tuple(lay.full_shape), tuple(lay.segments)))  # type: ignore[arg-type]
        send = tuple(sum(t.numel(tp_rank) for t in built if t.host == h) for h in range(tp))
        recv = tuple(sum(t.numel(r) for t in built if t.host == tp_rank) for r in range(tp))
        if send != tuple(g.gather_send[tp_rank]) or recv != tuple(g.gather_recv[tp_rank]):
            raise PlanMismatchError(f"micro-group {g.index} of DP index {dp_rank}: the split "
                                    f"sizes of TP rank {tp_rank} ({send}, {recv}) are not the "
                                    "plan's; the plan is inconsistent.")
        groups.append(TPGroup(g.index, tuple(built),
                              tuple(t for t in built if t.host == tp_rank), send, recv))
    return tuple(groups)


@dataclass(frozen=True, slots=True)
class SharedTask:
    """A TP-split Muon matrix its TP group shares (the plan's ``tp.indices[d].shared``): this
    rank's shard is ``[lo, hi)`` of its own slice of bucket ``bucket``, viewed ``local_shape``;
    ``dim`` the split dimension (the long one: the shard is a row block of the oriented matrix)."""

    id: int
    param: int
    name: str
    bucket: int
    lo: int
    hi: int
    dim: int
    local_shape: tuple[int, int]
    full_shape: tuple[int, int]
    split_poly: bool
    #: Shampoo: this rank preconditions the blocks of its own shard (whole blocks of the
    #: matrix), no collective; else Muon's shared Newton–Schulz over the TP group
    blocks: bool = False
    #: shared with the same TP ranks at a partner DP index (k = 2·tp): the two DP indices,
    #: ascending; this rank holds rows [row0, row0 + local_shape[0]) of its shard
    pair: tuple[int, int] | None = None
    row0: int = 0


def build_shared_tasks(plan: Plan, names: list[str], param_bucket: Sequence[int],
                       param_range: Sequence[tuple[int, int]], own_start: Sequence[int],
                       dp_rank: int) -> tuple[SharedTask, ...]:
    """The tasks DP index ``dp_rank``'s TP group shares, in plan order (every TP rank runs them
    in that order: their collectives must match)."""
    T = plan.tp
    if T is None:
        return ()
    mine = next((ix for ix in T.indices if ix.dp_index == dp_rank), None)
    if mine is None or not (mine.shared or plan.dp_shared):
        return ()
    name, spec = plan.inputs.optimizer.name, plan.inputs.optimizer.spec
    if mine.shared and not spec.shareable:
        raise PlanMismatchError(f"the plan shares matrices over TP but its optimizer {name} "
                                f"updates every matrix whole; the plan is inconsistent.")
    index = {n: i for i, n in enumerate(names)}
    tasks = {t.id: t for t in plan.tasks}
    pairs = {x.id: x for x in plan.dp_shared}
    out = []
    for x in mine.shared:
        t, lay = tasks[x.id], T.layouts[x.layout]
        i = index[t.param]
        bi = param_bucket[i]
        lo, hi = param_range[i]
        if lay.dim is None or len(lay.local_shape) != 2 or t.part is not None:
            raise PlanMismatchError(f"the plan shares '{t.param}' over TP but its layout is not "
                                    "a split matrix; the plan is inconsistent.")
        shape = tuple(lay.local_shape)
        pair, row0 = None, 0
        if x.partner is None and x.id in pairs:
            raise PlanMismatchError(f"the plan shares '{t.param}' by DP indices "
                                    f"{list(pairs[x.id].owners)} but DP index {dp_rank}'s TP "
                                    f"group lists it without its partner; the plan is "
                                    f"inconsistent.")
        if x.partner is not None:  # this index's rows of every shard (the cut inside them)
            p = pairs.get(x.id)
            if p is None or sorted((dp_rank, x.partner)) != list(p.owners) or lay.dim != 0 \
                    or not spec.gram_shared:
                raise PlanMismatchError(f"the plan shares '{t.param}' with DP index "
                                        f"{x.partner} but its dp_shared entry or layout does "
                                        f"not say so; the plan is inconsistent.")
            pair = tuple(p.owners)
            first = dp_rank == p.owners[0]
            row0, rows = (0, p.row) if first else (p.row, shape[0] - p.row)
            lo += row0 * shape[1]
            hi = lo + rows * shape[1]
            shape = (rows, shape[1])
        out.append(SharedTask(
            t.id, i, t.param, bi, lo - own_start[bi], hi - own_start[bi],
            lay.dim, shape, tuple(lay.full_shape),  # type: ignore[arg-type]
            x.split_poly, spec.block_hosted, pair, row0))  # type: ignore[arg-type]
    listed = {x.id for x in out if x.pair is not None}
    for p in pairs.values():
        if plan.inputs.tp > 1 and dp_rank in p.owners and p.id not in listed:
            raise PlanMismatchError(f"the plan shares '{tasks[p.id].param}' by DP indices "
                                    f"{list(p.owners)} but DP index {dp_rank}'s TP group does "
                                    f"not list its half; the plan is inconsistent.")
    return tuple(out)


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


class MicroGroupRunner:
    """Runs this TP rank's micro-groups for one step (see the module docstring)."""

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
        self.flight: Any = None  # CanzonaOptimizer(flight_record=)
        self.rank = 0  # this process's DP rank, for messages
        self.tp_rank, self.tp = tp_rank, tp
        self.comm_dtype = COMM_DTYPES[comm_dtype]
        self._buffers = buffers
        self._params = params
        #: The largest gathered (received) buffer of a group, in elements: with two groups in
        #: flight the runtime's scratch peaks at about twice this (``peak_scratch_bytes``).
        self.max_recv = max((sum(g.recv) for g in self.groups), default=0)

    @property
    def tasks(self) -> tuple[TPTask, ...]:
        return tuple(t for g in self.groups for t in g.tasks)

    @property
    def hosted(self) -> tuple[TPTask, ...]:
        return tuple(t for g in self.groups for t in g.hosted)

    def peak_scratch_bytes(self, ns_dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of gathered full matrices held at once by this rank's pipeline, at most, or of
        the largest lockstep batch of shared matrices (the two phases do not overlap)."""
        size = torch.empty((), dtype=self.comm_dtype).element_size()
        recv = sorted((sum(g.recv) for g in self.groups), reverse=True)
        batches = self._batches(self._halves_first(self.shared), ns_dtype)
        shared = max((sum(b) for _, b in batches), default=0)
        return max(sum(recv[:2]) * size, shared)

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

    def init_state(self, state: MutableMapping[Tensor, Any], matrix: Any,
                   device: torch.device) -> None:
        """fp32 state of every task hosted here (full shape), under its parameter (and part),
        and of this rank's shard of every shared task (its rows of the momentum)."""
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
        from canzona.runtime.optim.orientation import orientation
        from canzona.runtime.optim.shared_ns import shared_newton_schulz_many
        from canzona.runtime.optim.transports import PeerPair, TPPair

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
        updates = [(ortho.mT if flip else ortho).to(torch.float32)
                   for ortho, flip in zip(orthos, flips)]
        # The Grams are all-reduced, so a non-finite matrix makes every rank's rows non-finite
        # alike: every rank leaves its shard untouched (as hosted tasks do).
        self._apply_shards(todo, updates, matrix)

    def _raise_together(self, error: Exception | None, matrix: Any, group: Any) -> None:
        """Under ``nonfinite="raise"``: every TP rank raises when a host did."""
        if getattr(getattr(matrix, "config", None), "nonfinite", None) == "raise" and self.tp > 1:
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int32,
                                device=self._buffers[0].own.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if error is None and int(flag.item()):
                from canzona.runtime.optim import NonFiniteGradientError

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
