"""FSDP2's storage (``torch.distributed.fsdp.fully_shard``): where each parameter's rows live,
and how the rows of a matrix reach the ranks computing it and the rows of its update come back.

Under ``fully_shard`` every parameter is a DTensor placed ``Shard(0)`` over the 1-D DP mesh: DP
rank r holds rows ``formulas.fsdp2_rows(rows, W)[r]`` (``torch.chunk``'s rule: the last ranks
may hold fewer rows, or none) in its local tensor. FSDP2 itself reduce-scatters (and averages)
the gradients into the same rows and all-gathers the parameters before the next forward, so
this storage reduces and gathers nothing: it reads each rank's gradient rows where FSDP2 leaves
them and the optimizer writes the updated rows in place, into the local tensor of the sharded
parameter, which FSDP2's next all-gather reads. (Where a module kept its unsharded parameters,
``set_reshard_after_backward(False)``, :meth:`FSDP2Rows.reshard` drops them at ``step()``: the
next forward gathers the updated rows.)

A matrix's update needs the whole matrix on its owner (``plan.tasks[i].owner``). The plan's
rounds (``plan.fsdp2.rounds``) move them, each with two ``all_to_all_single`` calls over the DP
group (uneven and zero split sizes; gloo and NCCL)::

    round k, W = 3: A (10 rows, owner 0), B (6 rows, owner 2); rows per rank A 4/4/2, B 2/2/2

    gather   rank r sends   to 0: [A rows of r, status]   to 2: [B rows of r, status]   (none to 1)
             rank 0 receives from s = 0, 1, 2: A's rows of s → A whole
    compute  the owner's kernel: the directions of its matrices of the round, in one call
    return   rank 0 sends to s: [A's update rows of s, status]; rank 2 likewise for B
             rank r applies its rows of A's and B's updates to its rows of A and B

A matrix the plan shares (``plan.fsdp2.shared``) is computed by an adjacent pair (2s, 2s + 1),
each member a :class:`Block` of its long dimension (``blocks``): of a tall matrix (rows ≥
columns) rows [b0, b1), all columns, so each rank sends its rows ∩ [b0, b1) to that member; of
a wide one columns [b0, b1), all rows, so each rank sends every member its rows restricted to
the member's columns. The return sends each rank its rows of each member's block of the
update, which it assembles into its rows (``canzona.planner.fsdp2.gather_bytes`` is the
planner's count of these bytes)::

    A (10 × 8, tall) shared by 0 and 1, blocks [0, 5, 10]; rows per rank 3/3/3/1 (W = 4)

    gather   rank 1 (rows 3–5) sends rows 3–4 to 0 and row 5 to 1; rank 2 (6–8) all to 1
    return   0 sends rank 1 its update rows 3–4, 1 sends it row 5

What a rank sends of a matrix are its rows of the kernel's input: the gradient's rows, or, for
a kernel with ``local_state`` (Muon), the Newton–Schulz input of its rows, made from the
momentum it keeps for them (the owner then only orthogonalises). Within a send buffer the rows
go to each destination in the round's task order, each block's followed by one status element
(:data:`APPLY`, or :data:`ROWS_FAILED`: the sender's kernel raised making them); a receive
buffer holds each source's block in rank order. The return is the gather reversed, each
block's status now its fate (:data:`APPLY`, :data:`LEAVE` — the kernel left the matrix alone:
SOAP's first step —, :data:`FAILED`, the kernel raised where the block was computed, or
:data:`ROWS_FAILED`), so that every rank learns each matrix's fate, a rank that holds none of
its rows too.

With TP (a dp × tp mesh named ("dp", "tp"), ranks d·tp + t) each rank holds one rectangle of
a parameter (``formulas.fsdp2_block``: TP's chunk t of its split dimension, then FSDP's chunk
d of the rows), and everything above reads "this rank's rows" as that rectangle: a rank sends
a computing rank the rectangle's intersection with its block (of a matrix TP replicates, only
the copy on the computing rank's TP rank: :meth:`RowTask.sends`), and the return sends every
rank, every TP copy included, its intersection of the update.

The rows travel in the plan's ``fsdp2.comm_dtype``, or in bfloat16 where the kernel has local
state and iterates Newton–Schulz in bfloat16 (:meth:`FSDP2Rows.wire_for`): the owner casts the
input to bfloat16 before anything else and the update it returns is bfloat16, so the result is
the same and the bytes are half of fp32's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from canzona.planner.formulas import fsdp2_block
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.introspect import fsdp2_modules, local_grad, local_tensor
from canzona.runtime.waits import wait_for

__all__ = ["APPLY", "COMM_DTYPES", "FAILED", "FSDP2Rows", "LEAVE", "ROWS_FAILED", "Block",
           "Round", "RowTask", "build_rounds", "check_mixed_precision", "sharded_parameters",
           "task_blocks"]

#: The plan's ``fsdp2.comm_dtype`` → the dtype the rows travel in.
COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: A matrix's fate in a status element: its rows (or update rows) apply; the kernel left it
#: alone this step (``None``); the owner's kernel raised; a sender's kernel raised making its
#: rows of the input (the gather's status, passed on by the return).
APPLY, LEAVE, FAILED, ROWS_FAILED = 0, 1, 2, 3


# --- the model -----------------------------------------------------------------------------------


def sharded_parameters(model: Any) -> tuple[list[tuple[str, Tensor]], list[nn.Module]]:
    """A ``fully_shard``-ed model's ``(name, sharded parameter)`` pairs in registration order,
    and its ``FSDPModule``\\ s. Every module is resharded first (a no-op unless it kept its
    unsharded parameters), so that the model holds the sharded DTensors, whose local tensors
    FSDP2's all-gather reads. Refuses, in one line, a model that is not ``fully_shard``-ed or a
    parameter that is not a DTensor placed ``Shard(0)`` over one 1-D mesh — or, with TP, over
    a 2-D mesh named ("dp", "tp"): ``Shard(0)`` (``_StridedShard`` of rows) on "dp" and
    ``Shard(0)``, ``Shard(1)`` or ``Replicate`` on "tp", the parameters TP leaves whole on its
    "dp" sub-mesh."""
    if not isinstance(model, nn.Module):
        raise PlanMismatchError(
            "the plan is an FSDP2 plan: give CanzonaOptimizer the fully_shard-ed nn.Module, not "
            "its named parameters (the optimizer reads FSDP2's modules).")
    modules = fsdp2_modules(model)
    if not modules:
        raise PlanMismatchError(
            f"the plan is an FSDP2 plan but the model ({type(model).__name__}) is not "
            "fully_shard-ed: apply torch.distributed.fsdp.fully_shard over the DP mesh first, or "
            "plan the model for ZeRO-1 (storage='zero1').")
    for _, m in modules:
        m.reshard()  # type: ignore[operator]
    pairs = list(model.named_parameters())
    meshes: dict[int, Any] = {}  # per mesh dimension count, the first parameter's
    for name, p in pairs:
        placements = tuple(getattr(p, "placements", ()))
        pmesh = getattr(p, "device_mesh", None)
        problem = _placement_problem(p, pmesh, placements)
        if problem:
            raise PlanMismatchError(
                f"the plan is an FSDP2 plan but parameter '{name}' is {problem}; fully_shard "
                "every module that holds parameters (the root last) over one 1-D DP mesh (with "
                "TP: its \"dp\" dimension), with the default Shard(0) placement.")
        held = meshes.setdefault(pmesh.ndim, pmesh)
        if pmesh != held:
            raise PlanMismatchError(
                f"parameter '{name}' is sharded over another mesh than "
                f"'{next(n for n, q in pairs if q.device_mesh is held)}'; fully_shard the whole "
                "model over one DP mesh.")
    if len(meshes) == 2 and meshes[2]["dp"] != meshes[1]:
        raise PlanMismatchError("the parameters TP leaves whole are fully_shard-ed over another "
                                "mesh than the (\"dp\", \"tp\") mesh's \"dp\" dimension; "
                                "fully_shard the whole model over mesh[\"dp\"].")
    return pairs, [m for _, m in modules]


def _placement_problem(p: Tensor, mesh: Any, placements: tuple) -> str | None:
    """What is wrong with a parameter's placement under FSDP2 (see :func:`sharded_parameters`),
    or None."""
    if local_tensor(p) is p or mesh is None:
        return "not a DTensor"
    what = f"a DTensor placed {list(placements)} over a {mesh.ndim}-D mesh"
    if mesh.ndim == 1:
        return None if len(placements) == 1 and placements[0].is_shard(0) else what
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != ("dp", "tp"):
        return f"{what} with dims {names or '(unnamed)'} (a 2-D mesh is read as ('dp', 'tp'))"
    dp, tp = placements
    strided = type(dp).__name__ == "_StridedShard"  # FSDP's rows of TP's row chunks
    if getattr(dp, "dim", None) != 0 or not (dp.is_shard() or strided) \
            or not (tp.is_replicate() or (tp.is_shard() and tp.dim in (0, 1))):
        return what
    return None


def check_mixed_precision(model: nn.Module) -> None:
    """Each ``fully_shard``'s ``MixedPrecisionPolicy`` keeps fp32 parameters and an fp32
    gradient reduction (``param_dtype`` and ``reduce_dtype`` None or ``torch.float32``), and no
    ``CPUOffloadPolicy`` moves the sharded parameters to the host (the rounds run where the
    parameters are)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    for name, m in fsdp2_modules(model):
        state = m._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None) or ()
        for g in groups:
            if isinstance(getattr(g, "offload_policy", None), CPUOffloadPolicy):
                where = f"module '{name}'" if name else "the root module"
                raise PlanMismatchError(
                    f"fully_shard on {where} has a CPUOffloadPolicy; canzona's FSDP2 storage "
                    "does not run with the parameters offloaded to the host yet: leave "
                    "offload_policy out.")
        policies = [g.mp_policy for g in groups] or [getattr(state, "_mp_policy", None)]
        for mp in policies:
            for field in ("param_dtype", "reduce_dtype"):
                value = getattr(mp, field, None)
                if value not in (None, torch.float32):
                    where = f"module '{name}'" if name else "the root module"
                    raise PlanMismatchError(
                        f"fully_shard's MixedPrecisionPolicy on {where} has {field}={value}; "
                        "canzona's FSDP2 storage runs fp32 parameters with an fp32 gradient "
                        "reduction (param_dtype and reduce_dtype None or torch.float32).")


# --- the rounds ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowTask:
    """A matrix task as the rounds move it: its parameter (index and name), owner, global
    shape (m, n), each rank's block of it ``(r0, r1, c0, c1)`` (``held``: rows [r0, r1) ×
    columns [c0, c1); at tp = 1 its ``Shard(0)`` rows, all columns; with TP
    ``formulas.fsdp2_block`` of rank d·tp + t), the ranks that compute it (``owners``: the owner
    alone, or the adjacent pair sharing it, ``owners[0]`` the owner) with the boundaries of
    their blocks along its long dimension (``blocks``: owners[j] computes [blocks[j],
    blocks[j + 1]) of the rows of a tall matrix, rows ≥ columns, or of the columns of a wide
    one), and ``tp`` with ``replicated``: whether every TP rank holds a copy of its block
    (then only the copy on a computing rank's TP rank is sent there)."""

    id: int
    param: int
    name: str
    owner: int
    shape: tuple[int, int]
    held: tuple[tuple[int, int, int, int], ...]
    owners: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    tp: int = 1
    replicated: bool = False

    @property
    def shared(self) -> bool:
        """Whether several ranks compute it, each a block."""
        return len(self.owners) > 1

    @property
    def tall(self) -> bool:
        """Its long dimension is its rows (rows ≥ columns)."""
        return self.shape[0] >= self.shape[1]

    def numel(self, rank: int) -> int:
        """Elements of rank ``rank``'s block."""
        r0, r1, c0, c1 = self.held[rank]
        return (r1 - r0) * (c1 - c0)

    def sends(self, rank: int, to: int) -> bool:
        """Whether rank ``rank`` sends its part to rank ``to`` computing a block: always, but
        of a matrix replicated over TP only the copy on ``to``'s TP rank."""
        return not self.replicated or rank % self.tp == to % self.tp


@dataclass(frozen=True, slots=True)
class Block:
    """What DP rank ``rank`` computes of ``task``: rows [r0, r1) × columns [c0, c1) of the
    matrix — all of it, or member ``member``'s block of a shared task (rows of a tall
    matrix, columns of a wide one)."""

    task: RowTask
    rank: int
    member: int
    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.r1 - self.r0, self.c1 - self.c0)

    def part(self, rank: int) -> tuple[int, int, int, int]:
        """Rank ``rank``'s part of the block, ``(r0, r1, c0, c1)`` in the matrix's numbers (ends
        excluded; empty where r0 == r1 or c0 == c1)."""
        h0, h1, g0, g1 = self.task.held[rank]
        r0, c0 = max(h0, self.r0), max(g0, self.c0)
        return r0, max(r0, min(h1, self.r1)), c0, max(c0, min(g1, self.c1))

    def numel(self, rank: int) -> int:
        """Elements of rank ``rank``'s part of the block."""
        r0, r1, c0, c1 = self.part(rank)
        return (r1 - r0) * (c1 - c0)

    def sent(self, rank: int) -> int:
        """Elements rank ``rank`` sends of the block in the gather (none from a TP copy of a
        replicated matrix on another TP rank than the block's)."""
        return self.numel(rank) if self.task.sends(rank, self.rank) else 0


def task_blocks(t: RowTask) -> tuple[Block, ...]:
    """The blocks of task ``t``, one per rank computing it."""
    m, n = t.shape
    if not t.shared:
        return (Block(t, t.owner, 0, 0, m, 0, n),)
    b = t.blocks
    if t.tall:
        return tuple(Block(t, o, j, b[j], b[j + 1], 0, n) for j, o in enumerate(t.owners))
    return tuple(Block(t, o, j, 0, m, b[j], b[j + 1]) for j, o in enumerate(t.owners))


@dataclass(frozen=True, slots=True)
class Round:
    """One round as rank ``rank`` runs it (see the module docstring): ``tasks`` in plan order,
    ``blocks`` per DP rank the blocks it computes (task order), ``mine`` this rank's and
    ``owned`` the tasks it computes whole; ``send`` (elements to each rank: this rank's parts
    of that rank's blocks, :meth:`Block.sent`) and ``recv`` (from each rank: its parts of this
    rank's blocks). The gather moves them plus a status element per block
    (:attr:`gather_send`, :attr:`gather_recv`); the return sends every rank its part of each
    block computed here (``back``: to each rank; ``back_recv``: from each rank), each with a
    status element (:attr:`return_send`, :attr:`return_recv`)."""

    index: int
    tasks: tuple[RowTask, ...]
    blocks: tuple[tuple[Block, ...], ...]
    mine: tuple[Block, ...]
    owned: tuple[RowTask, ...]
    send: tuple[int, ...]
    recv: tuple[int, ...]
    back: tuple[int, ...]
    back_recv: tuple[int, ...]

    @property
    def gather_send(self) -> tuple[int, ...]:
        return tuple(n + len(bs) for n, bs in zip(self.send, self.blocks))

    @property
    def gather_recv(self) -> tuple[int, ...]:
        return tuple(n + len(self.mine) for n in self.recv)

    @property
    def return_send(self) -> tuple[int, ...]:
        return tuple(n + len(self.mine) for n in self.back)

    @property
    def return_recv(self) -> tuple[int, ...]:
        return tuple(n + len(bs) for n, bs in zip(self.back_recv, self.blocks))


def build_rounds(plan: Any, names: Sequence[str], rank: int, size: int, tp: int = 1
                 ) -> tuple[Round, ...]:
    """The plan's rounds as rank ``rank`` of ``size`` (dp · tp, rank d·tp + t) runs them,
    checked: every matrix task whole (no part), 2-D, with an owner in ``[0, size)``, in
    exactly one round; each shared task (``plan.fsdp2.shared``) a matrix task of a kernel whose
    Newton–Schulz is shared by its Gram, on an adjacent pair (2s, 2s + 1) whose first member
    is its owner, its blocks from 0 to its long dimension, ascending. With ``tp`` > 1 each
    task's blocks are ``formulas.fsdp2_block`` of its ``plan.fsdp2.split_dims`` entry."""
    index = {n: i for i, n in enumerate(names)}
    dp = size // tp
    dims = split_dims(plan, tp)
    tasks: dict[int, RowTask] = {}
    for t in plan.tasks:
        if t.optimizer != "matrix":
            continue
        if t.part is not None:
            raise PlanMismatchError(f"the FSDP2 plan splits '{t.param}' (task {t.id}, part "
                                    f"{t.part!r}); FSDP2 plans update whole matrices.")
        if len(t.shape) != 2 or t.owner is None or not 0 <= t.owner < size:
            raise PlanMismatchError(f"the FSDP2 plan's matrix task {t.id} ('{t.param}', shape "
                                    f"{list(t.shape)}) has owner {t.owner}; a 2-D matrix with "
                                    f"an owner in 0 … {size - 1} is needed; regenerate it.")
        m, n = (int(x) for x in t.shape)
        split = dims[t.id]
        held = tuple(fsdp2_block((m, n), split, dp, tp, *divmod(r, tp)) for r in range(size))
        tasks[t.id] = RowTask(t.id, index[t.param], t.param, t.owner, (m, n), held,
                              (t.owner,), (0, max(m, n)), tp, tp > 1 and split is None)
    for x in getattr(plan.fsdp2, "shared", ()):
        t = _shared_task(plan, x, tasks, size)
        tasks[t.id] = t
    seen: set[int] = set()
    rounds = []
    for r in plan.fsdp2.rounds:
        bad = [i for i in r.tasks if i not in tasks or i in seen]
        if bad:
            why = "twice" if bad[0] in seen else "and it is no matrix task"
            raise PlanMismatchError(f"the FSDP2 plan's round {r.index} lists task {bad[0]} "
                                    f"{why}; regenerate the plan.")
        seen.update(r.tasks)
        ts = tuple(tasks[i] for i in r.tasks)
        made = [b for t in ts for b in task_blocks(t)]
        blocks = tuple(tuple(b for b in made if b.rank == o) for o in range(size))
        rounds.append(Round(
            index=len(rounds), tasks=ts, blocks=blocks, mine=blocks[rank],
            owned=tuple(b.task for b in blocks[rank] if not b.task.shared),
            send=tuple(sum(b.sent(rank) for b in blocks[o]) for o in range(size)),
            recv=tuple(sum(b.sent(s) for b in blocks[rank]) for s in range(size)),
            back=tuple(sum(b.numel(s) for b in blocks[rank]) for s in range(size)),
            back_recv=tuple(sum(b.numel(rank) for b in blocks[o]) for o in range(size))))
    missing = sorted(set(tasks) - seen)
    if missing:
        raise PlanMismatchError(f"the FSDP2 plan's matrix task {missing[0]} "
                                f"('{tasks[missing[0]].name}') is in no round; regenerate it.")
    return tuple(rounds)


def split_dims(plan: Any, tp: int) -> dict[int, int | None]:
    """Per task id, the dimension TP shards (``plan.fsdp2.split_dims``; None: replicated over
    TP, and every task at tp = 1), checked: one entry per task, each 0, 1 or None."""
    dims = tuple(getattr(plan.fsdp2, "split_dims", ()) or ())
    if tp == 1:
        return {t.id: None for t in plan.tasks}
    if len(dims) != len(plan.tasks) or any(d not in (0, 1, None) for d in dims):
        raise PlanMismatchError(f"the FSDP2 plan has tp={tp} but {len(dims)} split_dims for its "
                                f"{len(plan.tasks)} tasks (one of 0, 1 or null each is needed); "
                                "regenerate the plan.")
    return {t.id: d for t, d in zip(plan.tasks, dims)}


def _shared_task(plan: Any, x: Any, tasks: dict[int, RowTask], size: int) -> RowTask:
    """Shared entry ``x`` of the plan as its task, checked (each problem one line)."""
    where = f"the FSDP2 plan's shared task {x.id}"
    t = tasks.get(x.id)
    if t is None:
        raise PlanMismatchError(f"{where} is no matrix task; regenerate the plan.")
    spec = plan.inputs.optimizer.spec
    if not spec.gram_shared:
        raise PlanMismatchError(f"{where} ('{t.name}') is shared by DP ranks {list(x.owners)}, "
                                f"but {plan.inputs.optimizer.name}'s update is not shared by its "
                                "Gram (no shared Newton–Schulz); regenerate the plan.")
    owners, blocks = tuple(x.owners), tuple(x.blocks)
    a = owners[0] if owners else -1
    if len(owners) != 2 or a % 2 or owners[1] != a + 1 or owners[1] >= size:
        raise PlanMismatchError(f"{where} ('{t.name}') is shared by DP ranks {list(owners)}; "
                                f"a pair is (2s, 2s + 1) of the {size}; regenerate the plan.")
    if t.owner != a:
        raise PlanMismatchError(f"{where} ('{t.name}') has owner {t.owner} but is shared by DP "
                                f"ranks {list(owners)}; its owner is the first; regenerate it.")
    long = max(t.shape)
    if len(blocks) != 3 or blocks[0] != 0 or blocks[-1] != long \
            or any(lo > hi for lo, hi in zip(blocks, blocks[1:])):
        raise PlanMismatchError(f"{where} ('{t.name}', shape {list(t.shape)}) has blocks "
                                f"{list(blocks)}; 3 ascending boundaries from 0 to {long} are "
                                "needed; regenerate the plan.")
    if t.shared:
        raise PlanMismatchError(f"{where} ('{t.name}') is shared twice; regenerate the plan.")
    return RowTask(t.id, t.param, t.name, t.owner, t.shape, t.held, owners, blocks, t.tp,
                   t.replicated)


# --- the storage ---------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _InFlight:
    """An all-to-all in flight: its output, its work handle and its send buffer (kept alive
    until the collective completes: on NCCL it runs on the communicator's stream)."""

    out: Tensor
    work: Any
    send: Tensor | None
    what: str
    owner: FSDP2Rows

    def wait(self) -> Tensor:
        if self.work is not None:  # on CUDA: the current stream waits for the collective
            work, self.work = self.work, None
            wait_for(work, self.what, self.owner.timeout_s, self.owner.rank)
        self.send = None
        if self in self.owner.in_flight:
            self.owner.in_flight.remove(self)
        return self.out


class FSDP2Rows:
    """Where a ``fully_shard``-ed model's rows live and how the rounds move them (see the
    module docstring). ``params`` are the sharded DTensors taken at construction; the local
    tensor and gradient of each are read at every use (FSDP2 may re-point them, e.g. after
    ``load_state_dict(assign=True)``).

    ``comm`` is the plan's comm dtype, ``wire`` the one the rounds use (set by the optimizer
    from its kernel at every step, :meth:`wire_for`).

    The attributes the optimizer's lifecycle and reports read of a storage: ``buffers`` (none:
    no flat buckets), ``main_copies`` (none), ``methods``, ``wait_gathers`` (nothing: FSDP2
    gathers), ``reset`` (before the next iteration), ``finish`` (every all-to-all still in
    flight waited for) and ``release``."""

    buffers: tuple = ()

    def __init__(self, params: Sequence[Tensor], rounds: Sequence[Round],
                 modules: Sequence[nn.Module], *, rank: int, size: int, group: Any,
                 comm_dtype: str, timeout_s: float | None = None, flight: Any = None) -> None:
        if comm_dtype not in COMM_DTYPES:
            raise PlanMismatchError(f"the FSDP2 plan's comm_dtype {comm_dtype!r} is not one of "
                                    f"{', '.join(COMM_DTYPES)}; regenerate the plan.")
        self.params = list(params)
        self.rounds = tuple(rounds)
        self.modules = list(modules)
        self.rank, self.size, self.group = rank, size, group
        self.comm = self.wire = COMM_DTYPES[comm_dtype]
        self.timeout_s, self.flight = timeout_s, flight
        self.in_flight: list[_InFlight] = []

    # -- where the rows are -----------------------------------------------------------------------

    def local(self, i: int) -> Tensor:
        """This rank's rows of parameter ``i`` (the sharded DTensor's local tensor)."""
        return local_tensor(self.params[i])

    def grad(self, i: int) -> Tensor | None:
        """This rank's rows of parameter ``i``'s averaged gradient (None: no gradient)."""
        return local_grad(self.params[i])

    def reshard(self) -> None:
        """Every module drops unsharded parameters it kept (``reshard_after_backward=False``),
        so that the next forward all-gathers the rows the step updates."""
        for m in self.modules:
            m.reshard()  # type: ignore[operator]

    def reset(self) -> None:
        """Before the next iteration (after a checkpoint's load): the next forward gathers the
        rows as they are now."""
        self.reshard()

    def wire_for(self, kernel: Any) -> torch.dtype:
        """The dtype the rounds' rows travel in under ``kernel``: where the kernel has local
        state, the dtype it iterates Newton–Schulz in (what its owner reads of the input is
        that cast, and the update it returns is in it: the result is the same; the plan
        records bf16, the default); else the plan's comm dtype (FSDP2's fp32 gradients)."""
        config = getattr(kernel, "config", None)
        ns = getattr(config, "ns_dtype", None)
        if getattr(kernel, "local_state", False) and ns is not None:
            return ns
        return self.comm

    @property
    def methods(self) -> tuple[str, ...]:
        """Per round, the collective that moves it."""
        return ("all_to_all",) * len(self.rounds)

    @property
    def main_copies(self) -> list[Tensor | None]:
        return []

    # -- moving rows -------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        return self.local(0).device if self.params else torch.device("cpu")

    def _all_to_all(self, send: Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    what: str) -> _InFlight:
        out = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
        if self.size == 1:
            out.copy_(send)
            return _InFlight(out, None, None, what, self)
        work = dist.all_to_all_single(out, send, list(out_splits), list(in_splits),
                                      group=self.group, async_op=True)
        if self.flight is not None:
            self.flight.add(what, work)
        job = _InFlight(out, work, send, what, self)
        self.in_flight.append(job)
        return job

    def start_gather(self, k: int, rows: Mapping[int, Tensor | None],
                     failed: Collection[int] = ()) -> _InFlight:
        """Launch round ``k``'s gather: to each rank computing a block of a matrix, this rank's
        part of the block (:meth:`Block.sent`) — of ``rows[param]``, its block of the kernel's
        input (zeros where None) — and a status (:data:`ROWS_FAILED` for the parameters in
        ``failed``, else :data:`APPLY`), in the wire dtype."""
        rnd = self.rounds[k]
        send = torch.empty(sum(rnd.gather_send), dtype=self.wire, device=self._device())
        at = 0
        for blocks in rnd.blocks:
            for b in blocks:
                n = b.sent(self.rank)
                x = rows.get(b.task.param)
                if n and x is None:
                    send[at:at + n].zero_()
                elif n:
                    r0, r1, c0, c1 = b.part(self.rank)
                    h0, _, g0, _ = b.task.held[self.rank]
                    send[at:at + n].view(r1 - r0, c1 - c0).copy_(
                        x[r0 - h0:r1 - h0, c0 - g0:c1 - g0])
                send[at + n] = ROWS_FAILED if b.task.param in failed else APPLY
                at += n + 1
        return self._all_to_all(send, rnd.gather_recv, rnd.gather_send,
                                f"the FSDP2 gather (all-to-all) of round {k}")

    def whole(self, k: int, recv: Tensor, dtype: torch.dtype = torch.float32
              ) -> tuple[list[Tensor], list[bool]]:
        """This rank's blocks of round ``k`` (``Round.mine``: whole matrices, or its block of a
        shared one, as rows × columns of the matrix) in ``dtype`` from the gather's output, and
        per block whether a sender's rows failed (:data:`ROWS_FAILED`)."""
        rnd = self.rounds[k]
        fulls = [torch.empty(b.shape, dtype=dtype, device=recv.device) for b in rnd.mine]
        statuses = []
        at = 0
        for s in range(self.size):
            for b, full in zip(rnd.mine, fulls):
                n = b.sent(s)
                if n:
                    r0, r1, c0, c1 = b.part(s)
                    full[r0 - b.r0:r1 - b.r0, c0 - b.c0:c1 - b.c0].copy_(
                        recv[at:at + n].view(r1 - r0, c1 - c0))
                statuses.append(at + n)
                at += n + 1
        bad = [False] * len(fulls)
        if statuses:
            codes = recv[torch.tensor(statuses, dtype=torch.long, device=recv.device)].tolist()
            for j, code in enumerate(codes):
                if code == ROWS_FAILED:
                    bad[j % len(fulls)] = True
        return fulls, bad

    def start_return(self, k: int, updates: Sequence[Tensor | None],
                     status: Sequence[int]) -> _InFlight:
        """Launch round ``k``'s return: to each rank, its part of every update block computed
        here (per block of ``Round.mine``, shaped as the block; every TP copy of a replicated
        matrix its own), each followed by the block's status, in the wire dtype."""
        rnd = self.rounds[k]
        send = torch.empty(sum(rnd.return_send), dtype=self.wire, device=self._device())
        at = 0
        for s in range(self.size):
            for b, u, st in zip(rnd.mine, updates, status):
                r0, r1, c0, c1 = b.part(s)
                n = (r1 - r0) * (c1 - c0)
                if n:
                    if st == APPLY and u is not None:
                        send[at:at + n].view(r1 - r0, c1 - c0).copy_(
                            u[r0 - b.r0:r1 - b.r0, c0 - b.c0:c1 - b.c0])
                    else:
                        send[at:at + n].zero_()
                send[at + n] = st
                at += n + 1
        return self._all_to_all(send, rnd.return_recv, rnd.return_send,
                                f"the FSDP2 return (all-to-all) of round {k}")

    def returned(self, k: int, recv: Tensor) -> list[tuple[RowTask, Tensor, int, int]]:
        """Every task of round ``k``: this rank's block of its update (in the wire dtype, shaped
        like the block; a shared task's assembled from its members' blocks), its status and the
        rank whose block gave it (a failure's: :data:`FAILED` or :data:`ROWS_FAILED` where a
        block has it, else :data:`LEAVE` where one has it, else :data:`APPLY`)."""
        rnd = self.rounds[k]
        got: list[tuple[Block, Tensor]] = []
        statuses = []
        at = 0
        for blocks in rnd.blocks:
            for b in blocks:
                r0, r1, c0, c1 = b.part(self.rank)
                n = (r1 - r0) * (c1 - c0)
                got.append((b, recv[at:at + n].view(r1 - r0, c1 - c0)))
                statuses.append(at + n)
                at += n + 1
        codes = recv[torch.tensor(statuses, dtype=torch.long, device=recv.device)].tolist() \
            if statuses else []
        parts: dict[int, list[tuple[Block, Tensor, int]]] = {}
        for (b, piece), code in zip(got, codes):
            parts.setdefault(b.task.id, []).append((b, piece, int(code)))
        out = []
        for t in rnd.tasks:
            mine = parts[t.id]
            code, who = _fate([(c, b.rank) for b, _, c in mine])
            if len(mine) == 1:
                rows = mine[0][1]
            else:  # a shared task: its members' parts of this rank's block
                h0, h1, g0, g1 = t.held[self.rank]
                rows = torch.empty((h1 - h0, g1 - g0), dtype=recv.dtype, device=recv.device)
                for b, piece, _ in mine:
                    r0, r1, c0, c1 = b.part(self.rank)
                    rows[r0 - h0:r1 - h0, c0 - g0:c1 - g0].copy_(piece)
            out.append((t, rows, code, who))
        return out

    # -- lifecycle ---------------------------------------------------------------------------------

    def wait_gathers(self) -> None:
        """Nothing: FSDP2 gathers the parameters in the next forward."""

    def finish(self) -> None:
        """Wait for every all-to-all still in flight (a step that raised may leave some)."""
        while self.in_flight:
            self.in_flight[0].wait()

    def release(self) -> None:
        """Forget the work handles, the process group and the modules."""
        self.in_flight = []
        self.group = None
        self.modules = []

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per step in the rounds' gathers and returns (the status
        elements included), in the wire dtype."""
        size = torch.empty((), dtype=self.wire).element_size()
        mine = lambda splits: sum(n for s, n in enumerate(splits) if s != self.rank)  # noqa: E731
        return {"gather": size * sum(mine(r.gather_send) for r in self.rounds),
                "return": size * sum(mine(r.return_send) for r in self.rounds)}


def _fate(codes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """A task's status from its blocks' ``(status, rank)``: a failure where one failed, else
    :data:`LEAVE` where one was left alone, else :data:`APPLY`; with the rank that gave it."""
    for want in ((FAILED, ROWS_FAILED), (LEAVE,)):
        for code, rank in codes:
            if code in want:
                return code, rank
    return APPLY, codes[0][1]
