"""``FSDP2Optimizer``: an FSDP2 plan (:class:`~canzona.planner.plan.FSDP2Plan`) executed inside
``optimizer.step()`` on a ``fully_shard``-ed model.

``CanzonaOptimizer(model, plan)`` builds one when ``plan`` is an FSDP2 plan
(``runtime.executors``). FSDP2 keeps every parameter as ``Shard(0)`` rows over the DP mesh,
averages the gradients into the same rows (its reduce-scatter) and all-gathers the parameters
before the next forward; the storage, :class:`~canzona.runtime.storage.fsdp2.FSDP2Rows`, says
where the rows are and moves them. A step on DP rank r of W:

1. **agree** — one MAX all-reduce over the DP group of, per parameter, "got a gradient" and
   "holds NaN/Inf in my rows" (and per rank "got any gradient"): every rank raises alike
   (``NonFiniteGradientError``, ``UnevenBackwardError``) or skips alike (``nonfinite="skip"``)
   before anything is updated (``runtime.flags``' policy);
2. **AdamW** on this rank's rows of every AdamW parameter (state of the rows' shape), while
   round 0's rows travel;
3. **rounds** (``plan.fsdp2.rounds``): one ``all_to_all_single`` gathers each matrix of the round
   whole on its owner — or, for a matrix an adjacent pair shares (``plan.fsdp2.shared``), each
   member's block of its long dimension on that member —, the owner's kernel computes the
   round's directions in one call (alike shapes batched), a second ``all_to_all_single``
   returns each rank its rows of every update, and each rank applies them to its rows
   (``kernel.apply(..., full_shape=)``). Round k + 1's gather is launched before round k is
   computed, and round k's return runs while round k + 1 is; every handle is waited for before
   ``step()`` returns.

**Matrices shared by pairs.** Each member holds its block oriented along the long dimension (a
wide matrix's column block transposed) and the pair orthogonalises the round's shared matrices
(in plan order, both members alike) with the shared Newton–Schulz
(``optim.shared_ns.shared_newton_schulz_many``: the Gram summed over the pair, exact up to
summation order), before the round's whole matrices; the kernel finishes the blocks
(``finish_shared``: NorMuon's row statistics summed over the pair). The pair's process group is
created once at construction (:meth:`FSDP2Optimizer._join_pairs`). A kernel without
``local_state`` (NorMuon) keeps each member's state of its block (a wide block's row statistics
whole, alike on both members). A plan that shares matrices of a kernel whose update is not
shared by its Gram (Shampoo, SOAP) is refused.

Where a matrix's state lives depends on the kernel. A kernel with ``local_state`` (Muon) keeps
it in the parameters' layout: each rank holds the momentum of its own rows of every matrix,
updates it before the round's gather (``kernel.momentum_inputs``) and sends the Newton–Schulz
input of its rows; the owner only orthogonalises the whole inputs (``kernel.orthogonalise``).
Under bfloat16 Newton–Schulz the rows then travel in bfloat16 whatever the plan's comm dtype
(``FSDP2Rows.wire_for``: the same result). Any other kernel (Shampoo, SOAP, NorMuon) gets the
gradient's rows (fp32 on the owner) and keeps each matrix's state on its owner, full-matrix
shaped (``kernel.direction``; a shared matrix's on its members, block-shaped).

**With TP** (``plan.inputs.tp`` > 1; torchtitan's order: ``parallelize_module`` over
``mesh["tp"]``, then ``fully_shard`` over ``mesh["dp"]`` of a mesh named ("dp", "tp")) rank
d·tp + t of the mesh holds one rectangle of each parameter (``formulas.fsdp2_block`` of its
``plan.fsdp2.split_dims`` entry: TP's chunk t, then FSDP's chunk d of its rows); the owners are
ranks of the whole mesh, the all-to-alls, the agreement and the clipping run over all its ranks
(the world, or the flattened mesh's group). A rank sends each computing rank the intersection
of its rectangle with that rank's block; of a parameter TP replicates only the copy on the
computing rank's TP rank is sent, and every copy receives its update rows (all copies stay
alike: Muon's momentum is stepped on each). The 1-D path is the case tp = 1.

``clip_grad_norm_`` sums the squares of each rank's gradient rows (every element lies in
exactly one rank's rows; with TP a replicated parameter's counts on TP rank 0) with one
all-reduce over the mesh. The launch order of the last step is kept
in ``_fsdp2_trace`` (``("gather", k)``, ``("compute", k)``, ``("return", k)``, ``("apply", k)``).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from canzona.planner import formulas
from canzona.planner.plan import FSDP2Plan
from canzona.runtime import checks, flags
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.flight import FlightRecorder
from canzona.runtime.groups import build_param_groups
from canzona.runtime.introspect import inventory, local_tensor
from canzona.runtime.optim._base import check_finite
from canzona.runtime.optim.shared_ns import shared_newton_schulz_many
from canzona.runtime.optim.transports import PeerPair, sum_each
from canzona.runtime.optimizer import CanzonaOptimizer
from canzona.runtime.storage.fsdp2 import (APPLY, FAILED, LEAVE, ROWS_FAILED, Block,
                                           FSDP2Rows, build_rounds, check_mixed_precision,
                                           sharded_parameters, split_dims)
from canzona.runtime.storage.gradients import clip_owned

__all__ = ["NOT_UNDER_FSDP2", "FSDP2Optimizer"]

#: ``CanzonaOptimizer``'s keyword arguments that do not apply to an FSDP2 plan: the one value
#: accepted (the default) and why.
NOT_UNDER_FSDP2: dict[str, tuple[Any, str]] = {
    "tp_group": (None, "with TP the mesh's \"tp\" dimension is read"),
    "expert_dp_group": (None, "FSDP2 plans have ep = 1"),
    "tp_sum_grads": ((), "FSDP2 reduces the gradients"),
    "overlap_tp": (True, "FSDP2 plans have no TP micro-groups"),
    "grad_sync": ("reduce_scatter", "FSDP2 reduces the gradients itself"),
    "collective": (None, "the rounds move rows with all_to_all_single"),
    "overlap_param_gather": (False, "FSDP2 all-gathers the parameters in the next forward"),
    "main_params": (None, "the sharded parameters are the fp32 copies; fully_shard's "
                          "MixedPrecisionPolicy casts them for compute"),
    "sync_init": (False, "each rank holds its own rows, which fully_shard took from its module"),
    "pp_group": (None, "FSDP2 plans have no pipeline stages"),
    "stage": (None, "FSDP2 plans have no pipeline stages"),
}


def _refuse(given: dict[str, Any]) -> None:
    """One line for the first argument that does not apply to an FSDP2 plan."""
    for key, value in given.items():
        if key not in NOT_UNDER_FSDP2:
            raise TypeError(f"CanzonaOptimizer() got an unexpected keyword argument {key!r}")
        default, why = NOT_UNDER_FSDP2[key]
        same = value is default or (isinstance(default, tuple) and not value) or (
            not isinstance(value, (tuple, list)) and value == default)
        if not same:
            raise ValueError(f"{key}={value!r} does not apply to an FSDP2 plan ({why}); leave it "
                             "out.")


class FSDP2Optimizer(CanzonaOptimizer):
    """:class:`CanzonaOptimizer` for an FSDP2 plan (see the module docstring); build it as
    ``CanzonaOptimizer(model, plan, ...)``.

    ``model`` is the ``fully_shard``-ed ``nn.Module`` (every parameter a DTensor placed
    ``Shard(0)`` over one 1-D DP mesh, or with TP over the ("dp", "tp") mesh as the module
    docstring says; ``reshard_after_forward`` either way; the ``MixedPrecisionPolicy`` with
    fp32 ``param_dtype`` and ``reduce_dtype``, or None). The keyword arguments are
    :class:`CanzonaOptimizer`'s but for those of :data:`NOT_UNDER_FSDP2` (refused unless left
    at their default); ``device_mesh`` is the 1-D DP mesh or the 2-D ("dp", "tp") mesh
    (default: the parameters'), ``dp_group`` the process group of all its ranks in the mesh's
    order (default: the mesh's).

    The parameter groups hold the sharded parameters (``"matrix"`` and ``"adamw"``, read at
    every step); ``state`` has an entry per parameter, made at construction: an AdamW
    parameter's state and, for a kernel with ``local_state``, a matrix's as DTensors placed as
    the parameter (this rank's rows, possibly none: ``Shard(0)`` over the same mesh); else a
    matrix's full-matrix state on its owner, or a shared matrix's state of each member's block
    on that member (empty elsewhere). ``state_dict()`` is this rank's
    (it loads under the same plan and rank); ``canzona.save_checkpoint`` /
    ``load_checkpoint`` save and load under any plan of the same model, FSDP2's or ZeRO-1's.
    Gradient accumulation is FSDP2's (``model.set_requires_gradient_sync``): ``no_sync()``
    refuses, as do ``qk_clip_`` and ``add_param_group``.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: FSDP2Plan,
        *,
        lr: float | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        adamw_nonfinite: str = "raise",
        dp_group: Any = None,
        device_mesh: Any = None,
        optimizer: str | None = None,
        ns_steps: int | None = None,
        matrix_options: dict[str, Any] | None = None,
        collective_timeout: float | None = None,
        flight_record: str | os.PathLike | None = None,
        **others: Any,
    ) -> None:
        # -- checks that need no collective ---------------------------------------------------
        _refuse(others)
        if not isinstance(plan, FSDP2Plan):
            raise TypeError(f"plan must be an FSDP2Plan here, got {type(plan).__name__}")
        self._timeout = checks.checked_timeout(collective_timeout)
        pairs, modules = sharded_parameters(model)
        check_mixed_precision(model)
        mesh = self._join_mesh(plan, pairs, device_mesh, dp_group)
        self._names = [n for n, _ in pairs]
        self._splits = self._split(plan)
        #: The sharded DTensor parameters (what the param groups and the state hold); their
        #: local tensors are the rows this rank updates.
        self._live = [p for _, p in pairs]
        self._params = list(self._live)
        rounds = build_rounds(plan, self._names, self._rank, self._ranks, self._tp)

        # -- every rank agrees before it acts: the plan (hash + fingerprint) and the rows -----
        problem = (checks.fsdp2_fingerprint_problem(plan, inventory(model))
                   or self._rows_problem(mesh, dp_group))
        checks.agree(plan, problem, dp=self._ranks, group=self._group, device=self._device())

        # -- kernels, param groups, storage, state ----------------------------------------------
        self._build_kernels(
            plan, optimizer=optimizer, matrix_options=matrix_options, ns_dtype=ns_dtype,
            explicit={"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                      "ns_steps": ns_steps},
            adamw={"lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps,
                   "weight_decay": adamw_weight_decay, "nonfinite": adamw_nonfinite})
        self.plan = plan
        self._digest = checks.plan_digest(plan)
        route = {t.param: t.optimizer for t in plan.tasks}
        self._matrix_ids = [i for i, n in enumerate(self._names) if route[n] == "matrix"]
        self._adamw_ids = [i for i, n in enumerate(self._names) if route[n] != "matrix"]
        self._main_params = None
        self._hooks: list[Any] = []
        self._received: list[int] | None = None  # the flags agreed this iteration
        self._fsdp2_trace: list[tuple[str, int]] = []
        self._flight = None
        if flight_record is not None:
            self._flight = FlightRecorder(flight_record, dist.get_rank(),
                                          labels={"dp_rank": self._rank})
        self._storage = FSDP2Rows(self._params, rounds, modules, rank=self._rank, size=self._ranks,
                                  group=self._group, comm_dtype=plan.fsdp2.comm_dtype,
                                  timeout_s=self._timeout, flight=self._flight)
        self._storage.wire = self._storage.wire_for(self._matrix)
        #: The ranks this rank shares matrices with (its pair's process group), or None.
        self._pair_group = self._join_pairs()
        self._build_fsdp2_groups()
        self._init_fsdp2_state()
        self._closed = False

    # -- construction -----------------------------------------------------------------------------

    def _join_mesh(self, plan: FSDP2Plan, pairs: list[tuple[str, Tensor]], device_mesh: Any,
                   dp_group: Any) -> Any:
        """The mesh (given, or the parameters': with TP the 2-D ("dp", "tp") one), the process
        group of all its ranks and this rank's place in it (d·tp + t), checked against the
        plan's dp and tp. Returns the mesh."""
        meshes = {p.device_mesh.ndim: p.device_mesh for _, p in pairs}  # type: ignore[attr-defined]
        mesh = meshes.get(2, meshes.get(1))
        if device_mesh is not None:
            if dp_group is not None:
                raise ValueError("pass either device_mesh= or dp_group=, not both")
            ndim = getattr(device_mesh, "ndim", None)
            names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
            if ndim != 1 and (ndim != 2 or names != ("dp", "tp")):
                raise ValueError(f"device_mesh must be the 1-D DP mesh the model is "
                                 f"fully_shard-ed over, or with TP the 2-D mesh with dims named "
                                 f"('dp', 'tp'), got a {ndim or '?'}-D mesh with dims "
                                 f"{names or '(unnamed)'}")
            if mesh is not None and device_mesh != mesh and not (
                    ndim == 2 and mesh.ndim == 1 and device_mesh["dp"] == mesh):
                raise PlanMismatchError("device_mesh is not the mesh the model is fully_shard-ed "
                                        "over; leave it out (the parameters' mesh is used).")
            mesh = device_mesh
        if mesh is None:
            raise PlanMismatchError("the model has no parameters to optimise.")
        tp = plan.inputs.tp
        if mesh.ndim == 1 and tp > 1:
            root = mesh._get_root_mesh()  # TP left every parameter whole: mesh["dp"]'s root
            if root.ndim == 2 and tuple(root.mesh_dim_names or ()) == ("dp", "tp") \
                    and root["dp"] == mesh:
                mesh = root
        if mesh.ndim == 2:
            dp, mesh_tp = mesh["dp"].size(), mesh["tp"].size()
            if tp != mesh_tp:
                raise PlanMismatchError(f"the plan is for tp={tp} but the model's mesh has "
                                        f"{mesh_tp} TP ranks (its \"tp\" dimension); plan it "
                                        f"with tp={mesh_tp}.")
        elif tp > 1:
            raise PlanMismatchError(f"the plan is for tp={tp} but the model is fully_shard-ed "
                                    "over a 1-D mesh without TP; plan it with tp=1, or pass the "
                                    "(\"dp\", \"tp\") mesh as device_mesh=.")
        else:
            dp = mesh.size()
        size = dp * tp
        if dp_group is not None and dist.get_world_size(dp_group) != size:
            raise PlanMismatchError(f"dp_group has {dist.get_world_size(dp_group)} ranks but the "
                                    f"model is fully_shard-ed over a mesh of {size}.")
        if dp != plan.inputs.dp:
            raise PlanMismatchError(f"the plan is for dp={plan.inputs.dp} but the model is "
                                    f"fully_shard-ed over a mesh of {dp} ranks.")
        # The mesh's group stays alive with the DTensors anyway; close() drops this reference.
        self._group = dp_group if dp_group is not None else _mesh_group(mesh)
        self._dp, self._ranks = dp, size
        self._tp, self._tp_group = tp, None
        if mesh.ndim == 2:
            self._tp_rank = mesh.get_local_rank("tp")
            self._rank = mesh.get_local_rank("dp") * tp + self._tp_rank
        else:
            self._rank, self._tp_rank = mesh.get_local_rank(), 0
        return mesh

    def _split(self, plan: FSDP2Plan) -> dict[str, int | None]:
        """Per parameter, the dimension TP shards (None: replicated over TP, or tp = 1)."""
        dims = split_dims(plan, self._tp)
        return {t.param: dims[t.id] for t in plan.tasks}

    def _rows_problem(self, mesh: Any, dp_group: Any) -> str | None:
        """One line if this rank's block of a parameter is not FSDP2's ``torch.chunk`` rows of
        its place in the mesh (``formulas.fsdp2_block``: with TP, of its TP chunk), or
        ``dp_group`` orders the ranks otherwise; else None."""
        if dp_group is not None and dist.get_rank(dp_group) != self._rank:
            return (f"dp_group puts this rank at {dist.get_rank(dp_group)} but the model's mesh "
                    f"at {self._rank}; pass the mesh's group (or leave dp_group out).")
        d, t = divmod(self._rank, self._tp)
        for name, p in zip(self._names, self._params):
            shape = tuple(p.shape)
            if not shape:
                return f"parameter '{name}' is a scalar, which Shard(0) cannot hold."
            split = self._splits.get(name)
            r0, r1, c0, c1 = formulas.fsdp2_block(shape, split, self._dp, self._tp, d, t)
            want = (r1 - r0, c1 - c0) if split == 1 and len(shape) == 2 else \
                (r1 - r0, *shape[1:])
            local = tuple(p._local_tensor.shape)  # type: ignore[attr-defined]
            if local != want:
                where = f"DP rank {d}, TP rank {t}" if self._tp > 1 else f"DP rank {d}"
                return (f"parameter '{name}' holds {list(local)} on {where}, not its block "
                        f"{list(want)} of {list(shape)} (torch.chunk's rule over the mesh; "
                        f"TP split {split}).")
        return None

    def _join_pairs(self) -> Any:
        """The process group of every pair (2s, 2s + 1) of DP ranks that shares matrices in the
        plan, created once, in ascending order, by every DP rank; returns this rank's (None:
        it shares none). Where the DP group is the world, every rank takes part in every
        ``new_group``; else only each pair's members synchronise
        (``use_local_synchronization``), or, where the default group's communicators are
        created eagerly (NCCL with a bound device, whose ``new_group`` splits the world's
        communicator and needs every rank of the world), the pair exchanges point to point on
        the DP group (:class:`PeerPair`)."""
        pairs = sorted({t.owners for r in self._storage.rounds for t in r.tasks if t.shared})
        if not pairs:
            return None
        ranks = dist.get_process_group_ranks(self._group)
        world = len(ranks) == dist.get_world_size()
        peer = not world and _eager_communicators()
        mine = None
        for a, b in pairs:
            if peer:
                group: Any = PeerPair((a, b), self._rank - a, self._group) \
                    if self._rank in (a, b) else None
            else:
                group = dist.new_group([ranks[a], ranks[b]], use_local_synchronization=not world)
            if self._rank in (a, b):
                mine = group
        return mine

    def _build_fsdp2_groups(self) -> None:
        """``"matrix"`` and ``"adamw"`` groups of the sharded parameters, then fixed."""
        groups, defaults = build_param_groups(
            [self._params[i] for i in self._matrix_ids],
            [self._params[i] for i in self._adamw_ids], self._matrix, self._adamw)
        self._groups_fixed = False
        torch.optim.Optimizer.__init__(self, groups, {})
        self._groups_fixed = True
        self.defaults = defaults

    def _init_fsdp2_state(self) -> None:
        """fp32 state made now (``torch.distributed.checkpoint``'s ``get_state_dict`` steps an
        optimizer without state to make it): each AdamW parameter's of this rank's rows and,
        for a kernel with ``local_state``, each matrix's of this rank's rows (DTensors placed as
        the parameter, :meth:`_as_rows`); else each owned matrix's (full shape); an empty entry
        for every other parameter."""
        device = self._device()
        storage = self._storage
        if self._matrix.local_state:
            for i in self._matrix_ids:  # with TP of this rank's block's columns
                rows, cols = storage.local(i).shape
                made = self._matrix.init_row_state(rows, (self._params[i].shape[0], cols),
                                                   torch.float32, device)
                self.state[self._params[i]] = self._as_rows(i, made)
        else:
            for rnd in storage.rounds:
                for b in rnd.mine:
                    self.state[self._params[b.task.param]] = self._matrix.init_state(
                        b.shape, torch.float32, device)
        for i in self._adamw_ids:
            made = self._adamw.init_state(storage.local(i).shape, torch.float32, device)
            self.state[self._params[i]] = self._as_rows(i, made)
        for p in self._params:
            if p not in self.state:
                self.state[p] = {}

    def _as_rows(self, i: int, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` of this rank's rows of parameter ``i``: each tensor of the rank's block's
        shape, and at tp = 1 each with as many rows as the rank's, as a DTensor placed as the
        parameter (its global shape: the parameter's rows, the tensor's other dims); the rest
        (``step``; with TP per-row statistics) as it is."""
        p = self._params[i]
        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        local = self._storage.local(i).shape
        out = {}
        for key, x in state.items():
            if x.shape == local:
                shape = p.shape
            elif x.dim() and x.shape[0] == local[0] and self._tp == 1:
                shape = torch.Size((p.shape[0], *x.shape[1:]))
            else:
                out[key] = x
                continue
            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            out[key] = DTensor.from_local(x, mesh, placements, run_check=False, shape=shape,
                                          stride=stride)
        return out

    def _local_state(self, i: int) -> dict[str, Tensor]:
        """Parameter ``i``'s state as this rank's kernels read it: DTensors' local rows."""
        return {k: local_tensor(v) for k, v in self.state[self._params[i]].items()}

    # -- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Agree on the gradients, AdamW on this rank's rows, the matrices round by round.

        Raises (on every rank alike, before anything is updated): ``UnevenBackwardError`` when
        some DP ranks produced gradients and others none; ``NonFiniteGradientError`` for a
        NaN/Inf gradient under ``nonfinite="raise"``."""
        self._check_open("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self._storage.reshard()
        received = self._agree_gradients()
        try:
            self._run(received)
        finally:
            self._received = None
        return loss

    def _agree_gradients(self) -> list[int]:
        """Per parameter whether any rank got a gradient for it, after the non-finite policy
        (``runtime.flags``): one MAX all-reduce over all the mesh's ranks, once per
        iteration."""
        if self._received is not None:
            return self._received
        storage, n, size = self._storage, len(self._params), self._ranks
        grads = [storage.grad(i) for i in range(n)]
        held = [i for i, g in enumerate(grads) if g is not None]
        finite = check_finite([grads[i] for i in held])
        bad = [0] * n
        for i, ok in zip(held, finite):
            bad[i] = 0 if ok else 1
        had = [0] * size
        had[self._rank] = 1 if held else 0
        got = [1 if g is not None else 0 for g in grads]
        t = torch.tensor(got + had + bad, dtype=torch.int32, device=self._device())
        flags.all_reduce_max(t, dp=size, group=self._group, tp=1, tp_group=None,
                             flight=self._flight, timeout_s=self._timeout, rank=self._rank)
        values = t.cpu().tolist()
        ranks = values[n:n + size]
        missing = [r for r, x in enumerate(ranks) if not x] if any(ranks) else []
        nonfinite = [i for i, f in enumerate(values[n + size:]) if f]
        agreed = SimpleNamespace(received_anywhere=values[:n])
        flags.apply_policy((nonfinite, missing), grads=agreed, buffers=(), work=None,
                           names=self._names, matrix_params=self._matrix_ids,
                           matrix=self._matrix, adamw=self._adamw, reset=self._drop_grads)
        for i in nonfinite:  # skipped alike: their rows count as zero (a finite global norm)
            g = grads[i]
            if g is not None:
                g.zero_()
        self._received = list(agreed.received_anywhere)
        return self._received

    def _drop_grads(self) -> None:
        for p in self._params:
            p.grad = None
        self._received = None

    def _run(self, received: list[int]) -> None:
        """AdamW, then the rounds, pipelined (see the module docstring); a kernel that raised
        (on an owner, or on a rank making its rows of the input) raises there after every
        round, and the other ranks raise with it."""
        storage = self._storage
        storage.wire = storage.wire_for(self._matrix)
        count = len(storage.rounds)
        trace = self._fsdp2_trace = []
        gathers: dict[int, Any] = {}
        error: Exception | None = None
        if count:
            gathers[0], error = self._start_gather(0, received)
            trace.append(("gather", 0))
        self._step_adamw(received)  # while round 0's rows travel
        failed: list[Any] = []
        pending = None  # (round, its return in flight)
        for k in range(count):
            recv = gathers.pop(k).wait()
            if k + 1 < count:
                gathers[k + 1], raised = self._start_gather(k + 1, received)
                error = error or raised
                trace.append(("gather", k + 1))
            trace.append(("compute", k))
            updates, status, raised = self._compute_round(k, recv, received)
            error = error or raised
            returning = storage.start_return(k, updates, status)
            trace.append(("return", k))
            if pending is not None:
                failed += self._apply_round(*pending, received)
            pending = (k, returning)
        if pending is not None:
            failed += self._apply_round(*pending, received)
        if error is not None:
            raise error
        if failed:
            t, code, who = failed[0]
            where = (f"on DP rank {who} for '{t.name}'" if code == FAILED else
                     f"on a DP rank making its rows of '{t.name}'")
            raise RuntimeError(f"the matrix kernel raised {where} (see that rank's error); the "
                               "step's other updates were applied.")

    def _start_gather(self, k: int, received: list[int]) -> tuple[Any, Exception | None]:
        """Launch round ``k``'s gather of this rank's rows of the kernel's input: for a kernel
        with ``local_state`` the Newton–Schulz inputs of its rows (their momentum stepped now),
        else the gradient's rows. Returns the gather in flight and what the kernel raised."""
        storage = self._storage
        rnd = storage.rounds[k]
        kernel = self._matrix
        rows: dict[int, Tensor | None] = {}
        if not kernel.local_state:
            rows.update((t.param, storage.grad(t.param)) for t in rnd.tasks)
            return storage.start_gather(k, rows), None
        ids = [t.param for t in rnd.tasks if received[t.param] and t.numel(self._rank)]
        try:
            grads = [storage.grad(i) for i in ids]
            grads = [torch.zeros_like(storage.local(i)) if g is None else g
                     for i, g in zip(ids, grads)]
            made = kernel.momentum_inputs(grads, [self._local_state(i) for i in ids],
                                          names=[self._names[i] for i in ids])
        except Exception as exc:  # noqa: BLE001 - the owners hear of it with the rows
            return storage.start_gather(k, rows, failed=set(ids)), exc
        rows.update(zip(ids, made))
        return storage.start_gather(k, rows), None

    def _step_adamw(self, received: list[int]) -> None:
        """AdamW on this rank's rows of every AdamW parameter that got a gradient."""
        ids = [i for i in self._adamw_ids if received[i]]
        if not ids:
            return
        storage = self._storage
        rows = [storage.local(i) for i in ids]
        grads = [storage.grad(i) for i in ids]
        grads = [torch.zeros_like(r) if g is None else g for r, g in zip(rows, grads)]
        self._adamw.step(rows, grads, [self._local_state(i) for i in ids],
                         names=[self._names[i] for i in ids])

    def _compute_round(self, k: int, recv: Tensor, received: list[int]
                       ) -> tuple[list[Tensor | None], list[int], Exception | None]:
        """The computing side of round ``k``: this rank's blocks (``Round.mine``) — first those
        of the matrices it shares with its pair, together with it (:meth:`_shared_directions`),
        then its whole matrices' directions in one kernel call (:meth:`_whole_directions`); per
        block its update (or None) and status, and what a kernel raised."""
        rnd = self._storage.rounds[k]
        mine = rnd.mine
        updates: list[Tensor | None] = [None] * len(mine)
        status = [LEAVE] * len(mine)
        todo = [j for j, b in enumerate(mine) if received[b.task.param]]
        if not todo:
            return updates, status, None
        fulls, bad = self._storage.whole(k, recv, self._whole_dtype())
        for j in [j for j in todo if bad[j]]:
            status[j] = ROWS_FAILED
        todo = [j for j in todo if not bad[j]]
        error: Exception | None = None
        for run, js in ((self._shared_directions, [j for j in todo if mine[j].task.shared]),
                        (self._whole_directions, [j for j in todo if not mine[j].task.shared])):
            if not js:
                continue
            try:
                out = run([mine[j] for j in js], [fulls[j] for j in js])
            except Exception as exc:  # noqa: BLE001 - raised after the rounds, on every rank
                for j in js:
                    status[j] = FAILED
                error = error or exc
                continue
            for j, u in zip(js, out):
                if u is not None:
                    updates[j], status[j] = u, APPLY
        return updates, status, error

    def _whole_directions(self, blocks: list[Block], fulls: list[Tensor]
                          ) -> list[Tensor | None]:
        """Whole matrices' directions in one kernel call: ``orthogonalise`` of the inputs for a
        kernel with ``local_state``, else ``direction`` of the gradients with the owner's
        state."""
        kernel = self._matrix
        names = [b.task.name for b in blocks]
        if kernel.local_state:
            return kernel.orthogonalise(fulls, names=names)
        return kernel.direction(fulls, [self.state[self._params[b.task.param]] for b in blocks],
                                names=names)

    def _shared_directions(self, blocks: list[Block], fulls: list[Tensor]) -> list[Tensor]:
        """This rank's blocks of the matrices it shares with its pair (the round's, in plan
        order; the partner passes its blocks of the same matrices): the Newton–Schulz inputs
        (for a kernel with ``local_state`` what arrived; else momentum on the gradient's block
        with this member's state of it), oriented along the long dimension (a wide matrix's
        column block transposed), orthogonalised together over the pair
        (``shared_newton_schulz_many``: the Gram summed over both), oriented back and finished
        by the kernel (``finish_shared``: NorMuon's row statistics summed over the pair)."""
        kernel = self._matrix
        cfg = kernel.config
        names = [b.task.name for b in blocks]
        pair = list(blocks[0].task.owners)
        states = ([{} for _ in blocks] if kernel.local_state else
                  [self.state[self._params[b.task.param]] for b in blocks])
        inputs = fulls if kernel.local_state else kernel.momentum_inputs(fulls, states,
                                                                          names=names)
        orthos = shared_newton_schulz_many(
            [x if b.task.tall else x.mT for x, b in zip(inputs, blocks)],
            group=self._pair_group, coefficients=cfg.schedule, steps=cfg.ns_steps, eps=cfg.eps,
            dtype=cfg.ns_dtype, timeout_s=self._timeout, flight=self._flight,
            what=[f"the shared Newton–Schulz of '{n}' (DP ranks {pair})" for n in names])
        pieces = [o if b.task.tall else o.mT for o, b in zip(orthos, blocks)]

        def reduce(items: list[tuple[int, Tensor]]) -> None:
            sum_each([x for _, x in items], [self._pair_group] * len(items),
                     [f"the row statistics of '{names[j]}' (DP ranks {pair})" for j, _ in items],
                     timeout_s=self._timeout, rank=self._rank, flight=self._flight)

        return kernel.finish_shared(pieces, states, [b.task.shape for b in blocks],
                                    [b.task.tall for b in blocks], reduce)

    def _apply_round(self, k: int, returning: Any, received: list[int]) -> list[Any]:
        """This rank's rows of round ``k``'s updates applied to its rows; returns the tasks
        whose kernel raised (on a rank computing it, or on a rank making its rows), with the
        code and the rank."""
        recv = returning.wait()
        self._fsdp2_trace.append(("apply", k))
        failed = []
        for t, rows, code, who in self._storage.returned(k, recv):
            if not received[t.param]:
                continue
            if code in (FAILED, ROWS_FAILED):
                failed.append((t, code, who))
            elif code == APPLY and rows.shape[0]:
                self._matrix.apply(self._storage.local(t.param), rows.to(torch.float32),
                                   full_shape=t.shape)
        return failed

    # -- gradients --------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradients by their global norm (as
        ``torch.nn.utils.clip_grad_norm_``): each rank's rows, one all-reduce over DP. Call it
        after the last backward and before ``step()``. Under TP the all-reduce runs over the
        whole mesh and a parameter replicated over TP counts on TP rank 0 only. Returns the
        total norm before clipping."""
        self._check_open("clip_grad_norm_")
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type = {norm_type!r} is not supported; use 2.0 or inf")
        self._agree_gradients()
        counted, copies = [], []
        for i, name in enumerate(self._names):
            g = self._storage.grad(i)
            if g is not None:  # a TP copy counts on TP rank 0 only
                copy = self._tp > 1 and self._splits[name] is None and self._tp_rank
                (copies if copy else counted).append(g)
        total = clip_owned(counted, max_norm, norm_type, dp=self._ranks, group=self._group)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in copies:
            g.mul_(coef.to(g.dtype))
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the sharded parameters' ``.grad``."""
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self._received = None

    def _start_next_iteration(self) -> None:
        """After a checkpoint's load: the next forward gathers the loaded rows; the gradients'
        agreement is made anew."""
        self._storage.reset()
        self._received = None

    def no_sync(self) -> Any:
        raise RuntimeError("CanzonaOptimizer.no_sync: under an FSDP2 plan FSDP2 reduces the "
                           "gradients; accumulate with model.set_requires_gradient_sync(False) "
                           "on the fully_shard-ed model instead.")

    def qk_clip_(self, *args: Any, **kwargs: Any) -> float:
        raise RuntimeError("CanzonaOptimizer.qk_clip_ is not supported under an FSDP2 plan yet.")

    # -- reports and lifecycle --------------------------------------------------------------------

    def tp_scratch_bytes(self) -> int:
        """0: FSDP2 plans have no TP micro-groups (:meth:`round_scratch_bytes` is the rounds')."""
        return 0

    def _whole_dtype(self) -> torch.dtype:
        """The dtype of the whole matrices an owner assembles: the wire's for a kernel with
        ``local_state`` (its input travels as the kernel reads it), else fp32."""
        return self._storage.wire if self._matrix.local_state else torch.float32

    def round_scratch_bytes(self) -> int:
        """Most bytes of whole matrices and shared blocks (:meth:`_whole_dtype`) this rank
        holds at once: its blocks of two consecutive rounds (one computed while the previous
        one's return runs)."""
        size = torch.empty((), dtype=self._whole_dtype()).element_size()
        held = [size * sum(b.shape[0] * b.shape[1] for b in r.mine)
                for r in self._storage.rounds]
        return max((a + b for a, b in zip(held, held[1:] + [0])), default=0)

    def predicted_state_bytes(self) -> int:
        """``state_bytes()`` predicted from the plan and the kernels: for a kernel with
        ``local_state`` the state of this rank's rows of every matrix (the state is elementwise
        in the rows), else the state of each matrix this rank owns and of its block of each
        matrix it shares; AdamW's of its rows (two moments and a step counter per
        parameter)."""
        if self._matrix.local_state:
            total = 0
            for i in self._matrix_ids:
                rows, cols = self._storage.local(i).shape
                if rows and cols:
                    total += 4 * self._matrix.state_numel((rows, cols))
        else:
            total = sum(4 * self._matrix.state_numel(b.shape) for r in self._storage.rounds
                        for b in r.mine)
        return total + sum(4 * formulas.adamw_state_numel(self._storage.local(i).numel())
                           for i in self._adamw_ids)

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per step in the rounds' gathers and returns."""
        return self._storage.comm_bytes()

    def _release(self) -> None:
        self._hooks = []
        self._storage.release()
        self._group = None  # the mesh keeps its group; this optimizer no longer does
        # nor its pair's: a subgroup stays in torch's registry, as every subgroup does, until
        # torch.distributed.destroy_process_group()
        self._pair_group = None
        if self._flight is not None:
            self._flight.close()
        self._closed = True


def _mesh_group(mesh: Any) -> Any:
    """The process group of all of ``mesh``'s ranks in its order (d·tp + t): the mesh's own
    for a 1-D mesh, the world where the mesh is the world in rank order, else the flattened
    mesh's."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.mesh.flatten().tolist() == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return mesh._flatten().get_group()


def _eager_communicators() -> bool:
    """Whether the default group creates its communicators eagerly (bound to a device: NCCL's
    ``new_group`` then splits the world's communicator, which every rank of the world must
    join)."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None
