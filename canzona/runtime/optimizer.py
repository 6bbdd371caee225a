"""``CanzonaOptimizer``: executes a plan (ZeRO-1 DP, and TP micro-groups for tp > 1) inside
``optimizer.step()``.

ZeRO-1 with whole-matrix ownership (Canzona, arXiv 2602.06079, §3): the planner moved every
bucket's cut points to parameter boundaries, so DP rank r's slice [cuts[r], cuts[r+1]) of a
bucket holds whole matrices (and pieces of AdamW tensors). One reduce-scatter per bucket brings
rank r the averaged gradient of exactly its slice; r updates what it owns; one all-gather per
bucket returns the updated parameters to everyone. Both collectives have variable slice sizes::

    bucket b (flat, plan's slot order)       rank 0            rank 1          rank 2
    grads  ┌──────────┬──────┬─────┬─────────┐
           │ W_q  W_k │ W_o  │norm │ W_fc1   │  backward hooks fill b; when b is complete:
           └──────────┴──────┴─────┴─────────┘
           cuts[0]    cuts[1]      cuts[2]    cuts[3]
              │  reduce-scatter (async, variable sizes, ÷ R)
              ▼
    own    [ W_q W_k ]       [ W_o norm ]      [ W_fc1 ]      step: Muon/Shampoo/SOAP on whole
                                                              matrices (same shapes batched),
              │  all-gather (async, variable sizes)           AdamW on owned AdamW elements
              ▼
    params ┌──────────┬──────┬─────┬─────────┐  every rank holds the updated parameters (the
           │ W_q  W_k │ W_o  │norm │ W_fc1   │  parameters are views into this flat buffer)
           └──────────┴──────┴─────┴─────────┘

The rooms: ``schedule`` (the plan as frozen records and every rank's work order), ``checks``
(everything verified before acting), ``storage`` (where the parameters' bytes and gradients
live and how they are reduced and gathered: the :class:`~canzona.runtime.storage.Storage` seam,
today the plan's ZeRO-1 buckets), ``flags`` (what the ranks agree about the reduced
gradients), ``replicated`` (the ranges of parameters replicated over TP), ``update`` (the owned
updates), ``pairs`` and ``tp`` (matrices shared by DP pairs, TP micro-groups), ``groups``
(param groups), ``accounting`` (bytes), ``checkpoint`` (state dicts). The optimizer composes
the storage with the compute rooms (``docs/architecture.md``, *The storage seam*). This module
owns the ``torch.optim`` surface of
:class:`CanzonaOptimizer`: its ``__init__`` runs the construction phases
(``runtime.construction``) in order and :meth:`CanzonaOptimizer.step` runs the step's labelled
phases: wait for the reductions, the matrix directions, the TP micro-groups, apply and
all-gather bucket by bucket. Its waits and shutdown (``runtime.lifecycle``) and its byte counts
and state dict (``runtime.reporting``) come from mixins.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from canzona.planner.plan import PipelinePlan, Plan
from canzona.runtime import checks, executors, flags, qk_clip, replicated, stages, update
from canzona.runtime.construction import Construction
from canzona.runtime.errors import UnusedParameterWarning
from canzona.runtime.storage.gradients import clip_owned
from canzona.runtime.groups import build_param_groups, synced_kernels
from canzona.runtime.lifecycle import Lifecycle
from canzona.runtime.qk_clip import AttentionHeads
from canzona.runtime.reporting import Reporting

__all__ = ["CanzonaOptimizer"]

class CanzonaOptimizer(Construction, Lifecycle, Reporting, torch.optim.Optimizer):
    """ZeRO-1 data parallelism with whole-matrix ownership, executing a canzona plan.

    Every DP rank builds one with the same plan. The trainer does not wrap the model in DDP
    (``grad_sync="reduce_scatter"``): backward hooks put gradients into the plan's flat buckets and
    reduce-scatter each bucket as soon as it is complete (buckets launch in order, so a parameter
    that gets no gradient holds back its bucket and every later one until ``step()``; a
    :class:`~canzona.runtime.errors.UnusedParameterWarning` names it once). ``step()`` updates
    the matrices and AdamW elements this rank owns and all-gathers the parameters.

    Parameter groups follow ``torch.optim``: group ``"matrix"`` holds every field of the matrix
    kernel's config (Muon: ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``,
    ``ns_coefficients``, ``eps``, ``adjust_lr_fn``, … as ``torch.optim.Muon``; Shampoo and SOAP:
    ``lr``, ``betas``, ``eps``, ``weight_decay``, …), group ``"adamw"`` ``lr``, ``betas``, ``eps``
    and ``weight_decay`` as ``torch.optim.AdamW``; ``defaults`` are the matrix group's. ``step()``
    reads them at every step, so a scheduler's (or the trainer's) change takes effect at the next
    step; a value out of range, a change of a setting the plan records (``ns_steps``, block
    sizes, preconditioning frequency) or of Shampoo's state layout raises before anything is
    updated. Momentum-cycling schedulers (``OneCycleLR``, ``CyclicLR``) drive ``momentum`` in
    every group when ``defaults`` has no ``betas`` (Muon: the matrix group's μ; the AdamW group
    ignores that key and keeps its ``betas``), else ``betas[0]`` of every group (Shampoo, SOAP).
    The parameters are fixed by the plan: ``add_param_group`` raises.

    Call :meth:`finish` (wait for every collective still running) or :meth:`close` (also release
    the hooks and the process group) before ``torch.distributed.destroy_process_group()``; the
    optimizer is a context manager that closes on exit.

    Args:
        model: the ``nn.Module`` (or its ``named_parameters()``) the plan was made for.
        plan: a :class:`~canzona.planner.plan.Plan` (``canzona.plan_model`` or
            ``canzona.load_plan``). An :class:`~canzona.planner.plan.FSDP2Plan` (a
            ``fully_shard``-ed model, ``canzona.plan_model(model, dp=, storage="fsdp2")``)
            builds an :class:`~canzona.runtime.fsdp2.FSDP2Optimizer`, a subclass
            (``runtime.executors``: the class per plan type), whose arguments are these but
            for the ZeRO-1, TP and pipeline ones.

    Every other argument is keyword-only:

    Keyword Args:
        lr, weight_decay, momentum: matrix optimizer hyper-parameters; None takes the kernel's
            default (Muon: ``torch.optim.Muon``'s 1e-3, 0.1, 0.95; Shampoo and SOAP: theirs).
        ns_dtype: Muon's Newton–Schulz dtype (bfloat16 as torch; float32 for exact comparisons).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW for the non-matrix parameters
            (``torch.optim.AdamW``'s defaults).
        adamw_nonfinite: ``"raise"`` (default) or ``"skip"``: what every rank does, alike, with an
            AdamW parameter whose averaged gradient holds NaN or Inf (the matrix kernel's is
            ``matrix_options={"nonfinite": ...}``).
        dp_group: the data-parallel process group (default: the world, looked up at every
            collective so that the optimizer does not keep it alive; none when not initialised
            and the plan has dp = 1).
        tp_group: for plans with tp > 1, the TP group of this rank's DP index (its size the
            plan's tp; TP rank t of the group holds shard t of every split matrix, Megatron's
            layout), and ``dp_group`` the DP group of this TP rank (required unless dp = 1).
            None (default) for tp = 1 plans. DTensor models (``parallelize_module`` with
            ``ColwiseParallel``/``RowwiseParallel``, planned by ``canzona.plan_model(model, dp=,
            tp=)``) work the same way: canzona works on each DTensor's local shard (its buffers
            hold that shard; the DTensor keeps pointing at them), parameters that are not
            DTensors are replicated over TP and updated identically on every TP rank.
        expert_dp_group: plans with ep > 1 (``runtime.experts``): the expert-data-parallel
            group of this rank, the DP ranks that hold the same experts (Megatron's
            ``parallel_state.get_expert_data_parallel_group()``). None (default): derived from
            the DP group in Megatron's rank order (DP rank d holds EP rank d mod ep's experts),
            built once by every rank. The model holds its EP rank's experts numbered from 0
            (``local_experts.{j}``, ``experts.{j}``); the plan names them by global index.
            Expert gradients are summed over this group and divided by the DP size.
        device_mesh: instead of ``dp_group``/``tp_group``: a 2-D ``DeviceMesh`` with dims named
            ``"dp"`` and ``"tp"`` (``init_device_mesh(..., mesh_dim_names=("dp", "tp"))``); for
            a plan with ep > 1 at tp = 1, dims ``"edp"`` and ``"ep"`` in that order (the DP
            group is the whole mesh, the expert-DP group its ``edp`` dim).
        grad_sync: ``"reduce_scatter"`` (canzona reduces the gradients) or ``"external"``
            (gradients are already averaged, e.g. by DDP; the owned parts are read from ``.grad``).
        optimizer, ns_steps: optional; when given they must agree with the plan.
        matrix_options: further fields of the kernel's config (``MuonConfig``, ``ShampooConfig``,
            ``SOAPConfig``); fields the plan also records must agree with it.
        overlap_param_gather: leave the parameter all-gathers running after ``step()`` and wait for
            them in the model's next forward pre-hook (needs an ``nn.Module``).
        main_params: None (default): the owned parts are updated in the parameters' own dtype.
            ``"fp32"``: for bf16/fp16 parameters each rank keeps fp32 main copies of its own slice
            of every bucket (whole owned matrices, its AdamW elements), taken from the parameters
            at construction; the kernels update them and the all-gather sends them cast to the
            parameter dtype. Gradients accumulate in the plan's (fp32) grad buckets either way.
            The copies count in ``state_bytes()`` (see :func:`predicted_state_bytes`) and travel
            in ``state_dict()``; after loading weights into the model call
            ``reload_main_params()``.
        collective: the DP collective method of every bucket instead of the one the plan records
            per bucket: ``padded``, ``per_root`` (one reduce and one broadcast per owner),
            ``all_reduce``, ``all_to_all``, or ``equal`` (equal slices only). The results are
            the same. At dp = 1 a named method runs over the one-rank process group where one
            is initialised (None: a copy, no collective).
        collective_timeout: seconds any one of canzona's collectives may wait before
            ``CollectiveTimeoutError`` names it (its bucket or micro-group) on this rank: a peer
            that died, hangs or stopped calling ``step()`` then fails every other rank early and
            catchably (gloo; on NCCL the process group's timeout and watchdog also apply, and
            a wait with a timeout blocks the host until the collective ends instead of only
            ordering the stream: a debugging setting there). None (the default): the process
            group's own timeout.
        flight_record: a directory: every rank keeps ``canzona-flight-rank{R}.json`` there
            listing canzona's collectives launched and not finished (``runtime.flight``), so
            that after NCCL's watchdog has aborted a hung job each rank's file names the
            collective (bucket, micro-group) it was waiting for. A daemon thread writes it at
            most twice a second; ``close()`` stops it.
        tp_sum_grads: tp > 1: name globs of replicated parameters whose gradient each TP rank
            holds only in part, summed over the TP group before the update (as parameters marked
            ``sequence_parallel`` are). Megatron with ``qk_layernorm``: the q/k norms see only
            the rank's heads: a Megatron-core GPTModel built with ``qk_layernorm`` gets
            ``runtime.megatron.MEGATRON_SUM_GRADS`` added, as Megatron's own
            ``finalize_model_grads`` sums them.
        overlap_tp: tp > 1: gather the next micro-group while this one is computed and scatter
            while the next is (default). False waits for each collective at once (to measure
            what the overlap saves; results are identical).
        sync_init: broadcast DP rank 0's weights to the other DP ranks at construction. False
            (default): check that every DP rank holds the same weights (one all-reduce of a
            digest per parameter) and raise ``WeightsDifferError`` if not.
        pp_group: pipeline parallelism (``runtime.stages``): this rank's pipeline group, one
            rank per stage in stage order (Megatron's
            ``parallel_state.get_pipeline_model_parallel_group()``). ``model`` is then this
            stage's module and ``plan`` the pipeline's plan (``canzona plan --pp``,
            ``canzona.plan_model(model, pp=)``) or this stage's; ``dp_group`` and ``tp_group``
            are the stage's. The gradient norm of ``clip_grad_norm_`` and the non-finite and
            missing-gradient checks span every stage; with tied embeddings the end stages sum
            the weight's gradients and keep its two copies bit-identical.
        stage: the stage this rank runs (default: its ``pp_group`` rank).

    Raises:
        PlanMismatchError: the plan does not match the live parameters (naming the first differing
            parameter), ranks hold different plans, a setting disagrees with the plan, the group
            size differs from the plan's dp, or the plan splits a matrix or needs tp > 1.
        WeightsDifferError: the DP ranks hold different weights (and ``sync_init`` is False).
        ValueError: a ``DistributedDataParallel`` model with ``grad_sync="reduce_scatter"``.
        TypeError: an argument after ``plan`` given by position.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CanzonaOptimizer:
        """The optimizer that executes ``plan``: the subclass ``runtime.executors`` registers
        for its type (an ``FSDP2Plan``: ``runtime.fsdp2.FSDP2Optimizer``), else this class."""
        plan = args[1] if len(args) > 1 else kwargs.get("plan")
        target = executors.executor_for(plan) if plan is not None else None
        if target is not None and not issubclass(cls, target):
            if cls is not CanzonaOptimizer:
                raise TypeError(f"{cls.__name__} cannot execute a {type(plan).__name__}: "
                                f"subclass {target.__name__} for it.")
            cls = target
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module | Iterable[tuple[str, Tensor]],
        plan: Plan | PipelinePlan,
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
        tp_group: Any = None,
        device_mesh: Any = None,
        expert_dp_group: Any = None,
        grad_sync: str = "reduce_scatter",
        optimizer: str | None = None,
        ns_steps: int | None = None,
        matrix_options: dict[str, Any] | None = None,
        overlap_param_gather: bool = False,
        main_params: str | None = None,
        overlap_tp: bool = True,
        tp_sum_grads: Sequence[str] = (),
        collective: str | None = None,
        collective_timeout: float | None = None,
        flight_record: str | os.PathLike | None = None,
        sync_init: bool = False,
        pp_group: Any = None,
        stage: int | None = None,
    ) -> None:
        # -- checks that need no collective ---------------------------------------------------
        plan, self._stage = stages.stage_plan(plan, pp_group, stage)
        dp_group, tp_group, expert_dp_group = self._check_arguments(
            plan, collective_timeout=collective_timeout, device_mesh=device_mesh,
            dp_group=dp_group, tp_group=tp_group, expert_dp_group=expert_dp_group,
            main_params=main_params, grad_sync=grad_sync)
        pairs = self._take_parameters(model, plan, grad_sync)
        distributed = self._join_groups(plan, dp_group, tp_group)
        self._place_experts(plan, distributed)
        checks.check_overlap_target(model, overlap_param_gather)

        # -- every rank agrees before it acts: the plan (hash + fingerprint), then the weights -
        self._agree_on_plan(plan, pairs)
        self._join_expert_group(plan, expert_dp_group)
        self._agree_on_weights(sync_init)

        # -- kernels, schedule, param groups --------------------------------------------------
        self._build_kernels(
            plan, optimizer=optimizer, matrix_options=matrix_options, ns_dtype=ns_dtype,
            explicit={"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                      "ns_steps": ns_steps},
            adamw={"lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps,
                   "weight_decay": adamw_weight_decay, "nonfinite": adamw_nonfinite})
        self._build_schedule(plan)
        self._keep_options(grad_sync=grad_sync, main_params=main_params, overlap_tp=overlap_tp,
                           overlap_param_gather=overlap_param_gather)
        self._build_param_groups()

        # -- buffers, collectives, state, hooks -----------------------------------------------
        self._lay_out_storage(collective=collective, flight_record=flight_record,
                              distributed=distributed)
        self._init_owned_state()
        self._set_up_shared_and_tp(plan)
        self._find_replicated_ranges(model, tp_sum_grads)
        self._register_hooks(model, overlap_param_gather)
        self._tie_end_stages()

    def _build_param_groups(self) -> None:
        """The ``torch.optim`` param groups (``runtime.groups``): ``"matrix"`` and ``"adamw"``,
        then fixed (``add_param_group`` raises)."""
        matrix_set = set(self._schedule.matrix_params)
        groups, defaults = build_param_groups(
            [self._params[i] for i in self._schedule.matrix_params],
            [p for i, p in enumerate(self._params) if i not in matrix_set], self._matrix,
            self._adamw)
        self._groups_fixed = False
        super().__init__(groups, {})
        self._groups_fixed = True
        self.defaults = defaults  # set after the groups so that no group receives the other's keys

    # -- the step, in phases --------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Reduce (if backward has not finished it), update the owned parts, all-gather.

        Raises (on every rank alike, before anything is updated): ``UnevenBackwardError`` when
        some DP ranks produced gradients and others none; ``NonFiniteGradientError`` for a
        NaN/Inf averaged gradient under ``nonfinite="raise"``."""
        self._check_open("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Checked before anything is reduced or updated: the same groups give the same error on
        # every rank.
        self._sync_hyperparameters()
        self.wait_params()  # the previous step's all-gathers, if overlap_param_gather left them
        self._wait_reductions()
        directions = self._compute_matrix_directions()
        self._run_tp_microgroups()
        self._apply_updates_and_gather(directions)
        self._start_next_iteration()
        return loss

    def _wait_reductions(self) -> None:
        """Phases 1-2: every bucket reduced and averaged into its ``own`` slice, and which
        parameters got a gradient on any rank (``GradientCollector.received_anywhere``)."""
        storage = self._storage
        if storage.grads.reduced:
            return
        if self._external:
            storage.read_external()
        else:
            self._warn_if_held_back()
            # Phase 1: launch what backward did not (buckets holding parameters without
            # gradients), in order; phase 2: wait for the reductions (most finished during
            # backward) and average.
            storage.reduce()
        # Then the partial gradients of TP-replicated parameters summed over TP, and one small
        # all-reduce of the "got a gradient" and "non-finite" flags.
        replicated.sum_partial_grads(storage.buffers, self._sp_ranges, self._tp_group)
        self._agree_flags()
        storage.grads.reduced = True

    def _agree_flags(self) -> None:
        """Per parameter, whether any rank got a gradient for it, and which averaged gradients
        hold NaN or Inf on any rank (``runtime.flags``: one MAX all-reduce over the DP group and
        the TP group, a second only when a bucket is non-finite somewhere); then the non-finite
        policy decides the same on every rank."""
        reduce_max = functools.partial(
            flags.all_reduce_max, dp=self._dp, group=self._group, tp=self._tp,
            tp_group=self._tp_group, flight=self._flight, timeout_s=self._timeout, rank=self._rank)
        storage = self._storage
        agreed = flags.agree(storage.grads, storage.buffers, self._schedule.mine, self._params,
                             reduce_max, rank=self._rank, size=self._dp,
                             positions=self._flag_positions)
        stages.agree_over_stages(
            flags.verdict(agreed, matrix_params=self._schedule.matrix_params,
                          matrix=self._matrix, adamw=self._adamw),
            self._stage, device=self._device(), timeout_s=self._timeout, rank=self._rank,
            reset=self._start_next_iteration)
        flags.apply_policy(agreed, grads=storage.grads, buffers=storage.buffers,
                           work=self._schedule.mine, names=self._names,
                           matrix_params=self._schedule.matrix_params, matrix=self._matrix,
                           adamw=self._adamw, reset=self._start_next_iteration)

    def _compute_matrix_directions(self) -> dict[int, Tensor]:
        """Phase 3: the update directions of every matrix this rank owns, in one kernel call."""
        # Matrices shared with another DP rank (plan.dp_shared) first, phase by phase: every
        # rank starts its pairs at once (after its whole matrices, a partner with more of them
        # would keep the other waiting, and the waits would chain along the pairs).
        buffers, received = self._storage.buffers, self._storage.grads.received_anywhere
        out = self._pairs.directions(buffers, self._params, self.state, self._matrix, received)
        out.update(update.matrix_directions(self._schedule.mine, buffers, self._params,
                                            self.state, self._matrix, received))
        return out

    def _run_tp_microgroups(self) -> None:
        """Phase 3b (tp > 1): for each micro-group of this TP group, in plan order, the
        all-to-all gather of the next group's gradient shards overlapping the updates of the
        tasks hosted here, then the scatter of the updates and their application to this rank's
        shards (``runtime.tp``)."""
        self._micro.run(group=self._tp_group, state=self.state, matrix=self._matrix,
                        received=self._storage.grads.received_anywhere,
                        overlap=self._overlap_tp)

    def _apply_updates_and_gather(self, directions: dict[int, Tensor]) -> None:
        """Phase 4, bucket by bucket in order: apply the directions, AdamW on the owned elements,
        launch the bucket's all-gather (it runs while the next bucket is updated). Then, unless
        ``overlap_param_gather``, wait: the parameters are whole again everywhere."""
        storage = self._storage
        mine, received = self._schedule.mine, storage.grads.received_anywhere
        for bi, buf in enumerate(storage.buffers):
            update.apply_bucket(bi, mine, buf, self._params, self.state, self._matrix,
                                self._adamw, directions, received)
            storage.gather(bi)
        if not self._overlap_gather:
            self.wait_params()
        if self._tied is not None:  # the first stage's tied weight, whole, to the last's copy
            storage.collectives[self._tied_bucket].finish_gather()
            self._tied.share_weight(self._params[self._tied.index])

    def _start_next_iteration(self) -> None:
        self._storage.reset()

    # -- gradients ------------------------------------------------------------------------------

    def _on_grad(self, i: int, p: Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i``."""
        self._storage.collect(i, p)

    def _warn_if_held_back(self) -> None:
        """Once per optimizer: a parameter without gradient kept buckets from overlapping."""
        if self._warned_unused:
            return
        held = self._storage.held_back()
        if held is None:
            return
        warnings.warn(held, UnusedParameterWarning, stacklevel=2)
        self._warned_unused = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate locally and reduce nothing; the
        next backward outside completes the buckets and reduces them once."""
        grads = self._storage.grads
        old, grads.sync = grads.sync, False
        try:
            yield
        finally:
            grads.sync = old

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the averaged gradients by their global norm (as ``torch.nn.utils.clip_grad_norm_``).

        Call it after the last backward and before ``step()``. Each rank takes the norm of the
        slices it owns (every element of every parameter lies in exactly one slice), then one
        all-reduce combines them.

        Returns:
            The total norm before clipping.
        """
        self._check_open("clip_grad_norm_")
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type = {norm_type!r} is not supported; use 2.0 or inf")
        self._wait_reductions()
        return clip_owned(self._storage.owned_grads, max_norm, norm_type, dp=self._dp,
                          group=self._storage.group, tp=self._tp, tp_group=self._tp_group,
                          duplicates=self._tp_duplicates, excluded=self._norm_excluded,
                          pp=self._stage.pp, pp_group=self._stage.group)

    def qk_clip_(self, max_logits: Mapping[str, Tensor], *, threshold: float,
                 alpha: float = 0.5, groups: Sequence[Any] = (),
                 attention: Iterable[AttentionHeads] | None = None) -> float:
        """QK-clip (MuonClip): call after ``step()``. Scales the query and key rows of every KV
        group whose largest attention logit exceeds ``threshold`` (τ), so its logits come back
        under τ: η_g = min(1, τ / m_g), query rows × η_g^α, key rows × η_g^(1−α)
        (Megatron-core's ``clip_qk``; ``runtime.qk_clip``).

        Args:
            max_logits: attention layer name → the largest logit of each of this rank's query
                heads (``[q_heads / tp]``) over this rank's batch; every layer, every call
                (``runtime.qk_clip.max_logits`` computes it from queries and keys,
                ``record_max_logits`` records it from Megatron-core's attention).
            threshold: τ. alpha: the query rows' share of the scaling (Megatron's
                ``qk_clip_alpha``, default 0.5).
            groups: process groups the logits are also reduced over with MAX (context
                parallelism); the DP group always is.
            attention: the layers (``AttentionHeads``), when canzona cannot read them from the
                model (a list of named parameters).

        Every rank of a DP group scales alike (the same reduced maxima), each TP rank its own
        heads, the fp32 main copies too (the parameters are then gathered from them). Returns
        the largest logit over every layer after the reduction.

        Raises:
            ValueError: an unknown layer, a missing one, or maxima of the wrong shape (one line,
                before any collective).
        """
        self._check_open("qk_clip_")
        return qk_clip.clip(self, max_logits, threshold=threshold, alpha=alpha, groups=groups,
                            attention=attention)

    def _attention(self) -> list[AttentionHeads]:
        return self._attention_layers

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' ``.grad`` and any gradient collected since the last step."""
        for p in self._live:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        if self._storage.grads.pending:
            self._storage.discard()

    # -- hyper-parameters -----------------------------------------------------------------------

    def _sync_hyperparameters(self) -> None:
        """Rebuild the kernels whose group's hyper-parameters changed since the last step."""
        self._matrix, self._adamw = synced_kernels(self.param_groups, self._matrix, self._adamw,
                                                   self._spec, self._recorded)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the plan fixes the parameters and their groups."""
        if not getattr(self, "_groups_fixed", False):  # torch.optim.Optimizer.__init__
            super().add_param_group(param_group)
            return
        raise RuntimeError(
            "CanzonaOptimizer.add_param_group: the parameters are fixed by the plan (its 'matrix' "
            "and 'adamw' groups hold every parameter the plan was made for); to optimise other "
            "parameters, plan the model that holds them (canzona.plan_model) and build a new "
            "CanzonaOptimizer.")
