"""The construction phases of :class:`~canzona.runtime.optimizer.CanzonaOptimizer`, a mixin:
each phase checks what it needs, builds its room's objects (``checks``, ``schedule``,
``storage``, ``update``, ``pairs``, ``tp``, ``replicated``) and
sets the attributes that later phases and ``step()`` read. ``CanzonaOptimizer.__init__`` runs
them in order; the one collective (every rank agrees on the plan) comes after every check that
needs none, so that all ranks fail together."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from canzona.planner.formulas import LOCKSTEP_CMAX
from canzona.planner.plan import Plan
from canzona.runtime import checks, experts, flags, replicated, stages, update, weights
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.flight import FlightRecorder
from canzona.runtime.introspect import local_tensor, named_params
from canzona.runtime.qk_clip import attention_heads
from canzona.runtime.megatron import check_megatron_model, megatron_sum_grads
from canzona.runtime.optim import AdamW, AdamWConfig
from canzona.runtime.optim._base import SettingError
from canzona.runtime.optim.sub_groups import SubGroups, tp_sub_groups
from canzona.runtime.pairs import PairRunner
from canzona.runtime.schedule import build_schedule
from canzona.runtime.storage import Zero1Buckets
from canzona.runtime.tp import MicroGroupRunner
from canzona.runtime.tp_tasks import (build_shared_tasks, build_tp_groups, check_sub_rounds,
                                      sub_group_sizes)

__all__ = ["Construction"]


def _named(where: str, exc: SettingError) -> ValueError:
    """``exc`` naming the constructor argument ``where`` (``lr=``, ``adamw_betas[0]``, …)."""
    sep = "" if where.endswith("=") else " = "
    return ValueError(f"{where}{sep}{exc.detail} ({exc.owner}.{exc.field})")


def _check_sub_groups(plan: Plan) -> None:
    """The plan's rounds of TP sub-groups, every DP index's (``tp_tasks.check_sub_rounds``),
    and the world they are created over: its ranks are the plan's dp × tp (the sub-groups of
    every TP group are created by every rank of the world, ``optim.sub_groups.tp_sub_groups``),
    checked on every rank alike before any collective."""
    check_sub_rounds(plan)
    if not sub_group_sizes(plan):
        return
    world = dist.get_world_size()
    if world != plan.inputs.dp * plan.inputs.tp:
        raise PlanMismatchError(
            f"the plan shares matrices over TP sub-groups, which every rank of the world creates "
            f"for every TP group, but the world has {world} ranks, not the plan's dp × tp = "
            f"{plan.inputs.dp} × {plan.inputs.tp} (a pipeline's stages, or ranks outside the "
            f"plan); plan without sub-groups.")


class Construction:
    """``CanzonaOptimizer``'s construction phases, in the order its ``__init__`` runs them."""

    state: Any  # torch.optim.Optimizer's, set by _build_param_groups

    def _check_arguments(self, plan: Plan, *, collective_timeout: float | None,
                         device_mesh: Any, dp_group: Any, tp_group: Any,
                         expert_dp_group: Any, main_params: str | None,
                         grad_sync: str) -> tuple[Any, Any, Any]:
        """The arguments, the plan's sizes and its rounds of TP sub-groups, checked without a
        collective. Returns ``(dp_group, tp_group, expert_dp_group)``, the ``device_mesh``'s
        when one is given."""
        self._timeout = checks.checked_timeout(collective_timeout)
        if device_mesh is not None:
            dp_group, tp_group, expert_dp_group = checks.mesh_groups(
                device_mesh, dp_group, tp_group, expert_dp_group)
        checks.check_main_params(main_params)
        checks.check_plan_sizes(plan, grad_sync=grad_sync, tp_group=tp_group)
        _check_sub_groups(plan)
        return dp_group, tp_group, expert_dp_group

    def _take_parameters(self, model: nn.Module | Any, plan: Plan,
                         grad_sync: str) -> list[tuple[str, Tensor]]:
        """The model's named parameters (checked against the parts the plan splits; a DDP
        wrapper only with ``grad_sync="external"``), and the tensors canzona works on. Returns
        the ``(name, parameter)`` pairs."""
        checks.check_not_ddp(model, grad_sync)
        check_megatron_model(model)  # FSDP storage, legacy GroupedMLP: before any collective
        pairs = named_params(model)
        checks.check_not_fully_sharded(model, pairs)  # FSDP2: an FSDP2Plan's optimizer runs it
        if self._stage.pp > 1:  # decoder layers by their global number, as the plan has them
            names = stages.global_names([n for n, _ in pairs], self._stage,
                                        {t.param for t in plan.tasks})
            pairs = [(n, p) for n, (_, p) in zip(names, pairs)]
        checks.check_split_parts(plan, pairs)
        checks.check_experts(plan, [n for n, _ in pairs], model)
        self._names = [n for n, _ in pairs]
        #: The model's parameters (hooks, ``.grad``, TP attributes) and the tensors canzona works
        #: on: the same, except a DTensor's local shard for each DTensor parameter.
        self._live: list[Tensor] = [p for _, p in pairs]
        self._params: list[Tensor] = [local_tensor(p) for p in self._live]
        #: The attention layers QK-clip finds in the module (``runtime.qk_clip``).
        self._attention_layers = attention_heads(model) if isinstance(model, nn.Module) else []
        return pairs

    def _join_groups(self, plan: Plan, dp_group: Any, tp_group: Any) -> bool:
        """This rank's DP and TP groups, their sizes and its ranks, checked against the plan.
        Returns whether a DP process group is in use (False: one rank, or tp > 1 with dp = 1,
        where the world is the TP group)."""
        # None stands for the default group and is resolved by every collective: holding the
        # default ProcessGroup object would keep it (and its backend's worker threads) alive
        # after dist.destroy_process_group(), into interpreter shutdown.
        self._group = dp_group
        distributed = dp_group is not None or (dist.is_available() and dist.is_initialized())
        if plan.inputs.tp > 1 and dp_group is None:
            if plan.inputs.dp != 1:
                raise PlanMismatchError(f"the plan is for dp={plan.inputs.dp} × tp="
                                        f"{plan.inputs.tp}: pass dp_group= (the ranks with this "
                                        "rank's TP rank) as well as tp_group=.")
            distributed = False  # dp = 1: no DP collective; the world is the TP group
        self._dp = dist.get_world_size(dp_group) if distributed else 1
        self._rank = dist.get_rank(dp_group) if distributed else 0
        self._closed = False
        checks.check_group_size(plan, self._dp)
        self._tp = plan.inputs.tp
        self._tp_group = tp_group if self._tp > 1 else None
        self._tp_rank = dist.get_rank(tp_group) if self._tp > 1 else 0
        return distributed

    def _place_experts(self, plan: Plan, distributed: bool) -> None:
        """Under expert parallelism (``runtime.experts``): this rank's EP and expert-DP ranks
        and the parameter names as the plan has them (experts by their global index)."""
        self._experts = experts.expert_layout(plan, self._rank, self._tp_rank)
        self._expert_group = None
        self._flag_positions: tuple[list[int], int] | None = None
        self._local_names = list(self._names)  # as the model names them
        self._names = self._experts.plan_names(self._names)  # messages, schedule, checkpoints
        self._expert_names = self._experts.held(plan, experts_only=True) or set()
        if self._experts.ep == 1:
            return
        if not distributed:
            raise PlanMismatchError(f"the plan is for ep={plan.inputs.ep}: initialise "
                                    "torch.distributed (every EP rank holds other experts).")
        # The gradient flags are all-reduced over the DP group, where every EP rank holds other
        # experts at the same local index: they are laid out by the plan's parameters.
        order = {n: i for i, n in enumerate(dict.fromkeys(t.param for t in plan.tasks))}
        self._flag_positions = ([order[n] for n in self._names], len(order))

    def _join_expert_group(self, plan: Plan, expert_dp_group: Any) -> None:
        """The expert-DP group (given, or derived from Megatron's rank order: the first
        collective of its own, after the ranks agreed on the plan), checked against the plan's
        expert-DP size."""
        if self._experts.ep == 1:  # Megatron's expert-DP group at ep 1 is the DP group
            if expert_dp_group is not None and dist.get_world_size(expert_dp_group) != self._dp:
                raise PlanMismatchError(
                    f"expert_dp_group has {dist.get_world_size(expert_dp_group)} ranks but the "
                    f"plan is for ep=1, where the experts are sharded over the DP group "
                    f"({self._dp} ranks); leave expert_dp_group out.")
            return
        group = (expert_dp_group if expert_dp_group is not None
                 else experts.expert_dp_group(self._experts, self._group, self._tp))
        size = dist.get_world_size(group)
        if size != self._experts.edp:
            raise PlanMismatchError(
                f"expert_dp_group has {size} ranks but the plan's expert-data-parallel size is "
                f"dp·tp/(ep·etp) = {plan.inputs.dp}·{plan.inputs.tp}/({plan.inputs.ep}·"
                f"{plan.inputs.etp}) = {self._experts.edp}.")
        self._expert_group = group

    def _agree_on_plan(self, plan: Plan, pairs: list[tuple[str, Tensor]]) -> None:
        """Every rank agrees before it acts: the plan's hash and the model's fingerprint (and,
        for DTensors, their local shards), in one collective over DP (and TP), so that a rank
        that finds a problem and its peers all raise."""
        held = self._experts.held(plan)
        pairs = list(zip(self._names, (p for _, p in pairs)))  # experts by global index
        local_pairs = list(zip(self._names, self._params))
        global_check = functools.partial(checks.fingerprint_problem, plan, pairs, held)
        local_check = functools.partial(checks.local_layout_problem, plan, local_pairs, held)
        problem = global_check() if self._tp == 1 else local_check()
        if problem is None and any(p is not q for p, q in zip(self._live, self._params)):
            # DTensors: global shapes and layouts (fingerprint) and local shards, both checked
            problem = local_check() if self._tp == 1 else global_check()
        if self._tp == 1:
            checks.agree(plan, problem, dp=self._dp, group=self._group, device=self._device())
        else:
            checks.agree_grid(plan, problem, dp=self._dp, dp_group=self._group, tp=self._tp,
                              tp_group=self._tp_group, device=self._device())

    def _agree_on_weights(self, sync_init: bool) -> None:
        """Every DP rank starts from the same weights: checked (one all-reduce of a digest per
        parameter), or DP rank 0's broadcast to the others with ``sync_init``
        (``runtime.weights``)."""
        dense, expert = self._dense_and_expert_params()
        for ids, size, group in ((dense, self._dp, self._group),
                                 (expert, self._experts.edp, self._expert_group)):
            if not ids:
                continue
            params = [self._params[i] for i in ids]
            if sync_init:
                weights.broadcast_weights(params, size=size, group=group)
            else:
                weights.agree_weights(params, [self._names[i] for i in ids], size=size,
                                      group=group, device=self._device())

    def _dense_and_expert_params(self) -> tuple[list[int], list[int]]:
        """The parameter indices every DP rank holds, and those of this EP rank's experts (the
        expert-DP group holds them alike); all dense at ep = 1."""
        if self._experts.ep == 1:
            return list(range(len(self._params))), []
        expert = self._expert_names
        return ([i for i, n in enumerate(self._names) if n not in expert],
                [i for i, n in enumerate(self._names) if n in expert])

    def _build_kernels(self, plan: Plan, *, optimizer: str | None,
                       matrix_options: dict[str, Any] | None, ns_dtype: torch.dtype,
                       explicit: dict[str, Any], adamw: dict[str, Any]) -> None:
        """The matrix kernel (its settings checked against the plan's) and AdamW's. A setting
        out of range names the argument it came from (``lr=``, ``matrix_options['eps']``,
        ``adamw_betas[0]``, …)."""
        try:
            self._spec, self._matrix, self._recorded = checks.build_matrix_kernel(
                plan, optimizer=optimizer, options=matrix_options or {}, ns_dtype=ns_dtype,
                explicit=explicit)
        except SettingError as exc:
            name, _, index = exc.field.partition("[")
            given = explicit.get(name) is not None
            where = (f"{name}=" if given and not index else f"{name}[{index}" if given
                     else f"matrix_options[{name!r}]" + (f"[{index}" if index else ""))
            raise _named(where, exc) from None
        try:
            self._adamw = AdamW(AdamWConfig(lr=adamw["lr"], betas=tuple(adamw["betas"]),
                                            eps=adamw["eps"], weight_decay=adamw["weight_decay"],
                                            nonfinite=adamw["nonfinite"]))
        except SettingError as exc:
            name, _, index = exc.field.partition("[")
            where = f"adamw_{name}" + (f"[{index}" if index else "=")
            raise _named(where, exc) from None

    def _build_schedule(self, plan: Plan) -> None:
        """The plan, its digest and this rank's schedule, whose work order is checked to update
        every element of every parameter exactly once."""
        self.plan = plan
        self._digest = checks.plan_digest(plan)
        self._schedule = build_schedule(plan, self._names, self._rank, self._experts,
                                        self._tp_rank)
        checks.check_work_order(self._schedule, self._names)

    def _keep_options(self, *, grad_sync: str, main_params: str | None, overlap_tp: bool,
                      overlap_param_gather: bool) -> None:
        self._external = grad_sync == "external"
        self._main_params = main_params
        self._overlap_tp = bool(overlap_tp)
        self._overlap_gather = overlap_param_gather
        self._warned_unused = False

    def _lay_out_storage(self, *, collective: str | None,
                         flight_record: str | os.PathLike | None, distributed: bool) -> None:
        """The flight recorder every collective reports to, and the storage: where the
        parameters' bytes and gradients live and how they move (``runtime.storage``; the plan's
        ZeRO-1 buckets over the DP group, the parameters become views of their buffers)."""
        self._flight = None
        if flight_record is not None:
            self._flight = FlightRecorder(
                flight_record, dist.get_rank() if distributed else 0,
                labels={"dp_rank": self._rank, "tp_rank": self._tp_rank})
        self._storage = Zero1Buckets(
            self._schedule, self._params, self._live, self._names, rank=self._rank,
            size=self._dp, group=self._group, external=self._external,
            main_params=self._main_params, method=collective, distributed=distributed,
            timeout_s=self._timeout, flight=self._flight, expert_group=self._expert_group,
            expert_rank=self._experts.edp_rank, expert_size=self._experts.edp)

    def _init_owned_state(self) -> None:
        """fp32 state for every matrix task and AdamW slice this rank owns."""
        update.init_owned_state(self._schedule.mine, self._params, self.state, self._matrix,
                                self._adamw, self._device())

    def _set_up_shared_and_tp(self, plan: Plan) -> None:
        """The runners of the matrices this rank shares with a DP partner (``plan.dp_shared``)
        and of its TP micro-groups and TP-shared matrices (tp > 1; with the TP sub-groups the
        plan's rounds use), with their state."""
        self._pairs = PairRunner(self._schedule.mine, dp_group=self._group, dp_rank=self._rank,
                                 timeout_s=self._timeout, flight=self._flight)
        own_start = [self._schedule.own_range(b.index)[0] for b in self._schedule.buckets]
        self._micro = MicroGroupRunner(
            build_tp_groups(plan, self._names, self._schedule.param_bucket,
                            self._schedule.param_range, own_start, self._rank, self._tp_rank),
            tp_rank=self._tp_rank, tp=self._tp, comm_dtype=plan.inputs.comm_dtype,
            buffers=self._storage.buffers, params=self._params,
            shared=build_shared_tasks(plan, self._names, self._schedule.param_bucket,
                                      self._schedule.param_range, own_start, self._rank),
            shared_cap=LOCKSTEP_CMAX * plan.tp.cmax_bytes if plan.tp is not None else 0)
        self._micro.timeout_s, self._micro.rank = self._timeout, self._rank
        self._micro.dp_group = self._group
        self._micro.subs = self._join_sub_groups(plan)
        self._micro.flight = self._flight
        self._micro.init_state(self.state, self._matrix, self._device())

    def _join_sub_groups(self, plan: Plan) -> dict[int, SubGroups]:
        """This rank's TP sub-groups of every size k the plan uses at any DP index, created
        once, by every rank alike (k ascending; ``optim.sub_groups.tp_sub_groups``, collective
        over the world, which ``_check_sub_groups`` found to be the plan's dp × tp ranks): each
        TP group's global ranks gathered from every rank first. Empty without them."""
        sizes = sub_group_sizes(plan)
        if not sizes:
            return {}
        held: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(held, dist.get_process_group_ranks(self._tp_group))
        tp_ranks = [list(g) for g in sorted({tuple(g) for g in held})]
        try:
            return {k: tp_sub_groups(tp_ranks, k, tp_group=self._tp_group) for k in sizes}
        except ValueError as exc:
            raise PlanMismatchError(f"the plan's TP sub-groups: {exc}") from None

    def _find_replicated_ranges(self, model: Any, tp_sum_grads: Sequence[str]) -> None:
        """tp > 1: the ranges of this rank's own slices that hold parameters replicated over TP
        (``runtime.replicated``): all of them, counted once by clipping, and those whose
        gradients are partial per TP rank, summed over TP before the update."""
        self._tp_duplicates = (replicated.duplicate_ranges(
            self._schedule, self._live, (t.param for t in self._micro.tasks),
            whole_experts=self._experts.whole) if self._tp > 1 else ())
        self._sum_globs = tuple(tp_sum_grads) + megatron_sum_grads(model)
        self._sp_ranges = (replicated.partial_grad_ranges(
            self._schedule, self._names, self._live, self._sum_globs) if self._tp > 1 else [])

    def _register_hooks(self, model: Any, overlap_param_gather: bool) -> None:
        """A post-accumulate-grad hook per parameter that requires a gradient (unless the
        gradients are reduced outside), and the forward pre-hook that waits for the parameters
        under ``overlap_param_gather``."""
        self._hooks: list[Any] = []
        if not self._external:
            for i, p in enumerate(self._live):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad, i)))  # type: ignore[attr-defined]
        if overlap_param_gather:
            self._hooks.append(model.register_forward_pre_hook(
                lambda *_: self.wait_params()))  # type: ignore[attr-defined]

    def _tie_end_stages(self) -> None:
        """A pipeline's end stages with tied embeddings (``runtime.stages``): the tied weight's
        bucket is reduced at ``step()``, after the two ends summed its gradients; on the last
        stage its own slices are left out of the gradient norm (the weight counts once)."""
        self._tied: stages.TiedWeights | None = None
        self._norm_excluded: list[list[tuple[int, int]]] = []
        name = self._stage.tied
        if name is None:
            return
        if self._external:
            raise PlanMismatchError(
                "tied embeddings across pipeline stages need canzona to reduce the gradients "
                "(grad_sync='reduce_scatter'): the end stages sum the tied weight's gradients "
                "before the DP reduction.")
        i = self._names.index(name)
        s = self._schedule
        bi = s.param_bucket[i]
        lo, hi = s.param_range[i]
        grads = self._storage.buffers[bi].grads
        self._tied = stages.TiedWeights(self._stage, i, timeout_s=self._timeout, rank=self._rank)
        tied = self._tied
        self._storage.defer({bi}, lambda: tied.sum_grads(grads[lo:hi]))
        self._tied_bucket = bi
        if self._stage.last:
            c0, c1 = s.own_range(bi)
            self._norm_excluded = [[] for _ in s.buckets]
            a, z = max(lo, c0), min(hi, c1)
            if a < z:
                self._norm_excluded[bi].append((a - c0, z - c0))

    def _device(self) -> torch.device:
        """Where this rank's parameters, and so its state, live."""
        return self._params[0].device if self._params else flags.device_of_group(self._group)
