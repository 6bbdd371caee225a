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
(everything verified before acting), ``buffers`` (flat per-bucket tensors), ``gradients``
(hooks, completion, ``no_sync``, clipping), ``collectives`` (one object per bucket, its method
and scratch), ``update`` (the owned updates), ``groups`` (param groups), ``accounting``
(bytes), ``checkpoint`` (state dicts). This class wires them and runs
:meth:`CanzonaOptimizer.step` as labelled phases: wait for the reductions, the matrix
directions, the TP micro-groups (``tp``), apply and all-gather bucket by bucket.

Why this module is longer than 400 lines: about 200 of them are the user-facing documentation
(this diagram, the class's arguments for DP and TP, ``finish``/``close``), and the
``torch.optim`` surface (``step``, ``zero_grad``, ``state_dict``, ``no_sync``,
``clip_grad_norm_``, ``finish``, ``close``, the byte counts) and the construction-time wiring of
the rooms (TP groups, duplicated and sequence-parallel ranges) must live on the class; each
public method delegates to a room in a few lines.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from canzona.planner.formulas import LOCKSTEP_CMAX
from canzona.planner.plan import Plan
from canzona.runtime import accounting, checkpoint, checks, update
from canzona.runtime.buffers import build_buffers
from canzona.runtime.collectives import make_collective, wait_for
from canzona.runtime.errors import NonFiniteSkipWarning, PlanMismatchError, UnusedParameterWarning
from canzona.runtime.flight import FlightRecorder
from canzona.runtime.groups import build_param_groups, synced_kernels
from canzona.runtime.gradients import GradientCollector, clip_owned, held_back_message
from canzona.runtime.introspect import is_tp_split, local_tensor, named_params
from canzona.runtime.megatron import MEGATRON_SUM_GRADS, find_gpt
from canzona.runtime.optim import AdamW, AdamWConfig
from canzona.runtime.optim._base import NonFiniteGradientError
from canzona.runtime.pairs import PairRunner
from canzona.runtime.schedule import build_schedule
from canzona.runtime.tp import MicroGroupRunner
from canzona.runtime.tp_tasks import build_shared_tasks, build_tp_groups

__all__ = ["CanzonaOptimizer"]

#: Seconds ``finish()`` sleeps (GIL and core released) after the last wait, so that the backend's
#: threads finish freeing the completed works (issue 9, see ``finish``).
_BACKEND_GRACE_S = 0.005


class CanzonaOptimizer(torch.optim.Optimizer):
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
            ``canzona.load_plan``).

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
        device_mesh: instead of ``dp_group``/``tp_group``: a 2-D ``DeviceMesh`` with dims named
            ``"dp"`` and ``"tp"`` (``init_device_mesh(..., mesh_dim_names=("dp", "tp"))``).
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
            the same.
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

    Raises:
        PlanMismatchError: the plan does not match the live parameters (naming the first differing
            parameter), ranks hold different plans, a setting disagrees with the plan, the group
            size differs from the plan's dp, or the plan splits a matrix or needs tp > 1.
        TypeError: an argument after ``plan`` given by position.
    """

    def __init__(
        self,
        model: nn.Module | Iterable[tuple[str, Tensor]],
        plan: Plan,
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
    ) -> None:
        # -- checks that need no collective ---------------------------------------------------
        if collective_timeout is not None and (isinstance(collective_timeout, bool) or not (
                isinstance(collective_timeout, (int, float)) and collective_timeout > 0)):
            raise ValueError(f"collective_timeout must be a number of seconds > 0 (or None), "
                             f"got {collective_timeout!r}")
        self._timeout = None if collective_timeout is None else float(collective_timeout)
        if device_mesh is not None:
            dp_group, tp_group = checks.mesh_groups(device_mesh, dp_group, tp_group)
        checks.check_main_params(main_params)
        checks.check_plan_sizes(plan, grad_sync=grad_sync, tp_group=tp_group)
        pairs = named_params(model)
        checks.check_split_parts(plan, pairs)
        self._names = [n for n, _ in pairs]
        #: The model's parameters (hooks, ``.grad``, TP attributes) and the tensors canzona works
        #: on: the same, except a DTensor's local shard for each DTensor parameter.
        self._live: list[Tensor] = [p for _, p in pairs]
        self._params: list[Tensor] = [local_tensor(p) for p in self._live]
        local_pairs = list(zip(self._names, self._params))
        # None stands for the default group and is resolved by every collective: holding the
        # default ProcessGroup object would keep it (and its backend's worker threads) alive
        # after dist.destroy_process_group(), into interpreter shutdown (issue 9).
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
        if overlap_param_gather and not isinstance(model, nn.Module):
            raise ValueError("overlap_param_gather=True needs the nn.Module (its forward pre-hook "
                             "waits for the parameters)")

        # -- every rank agrees before it acts (plan hash + fingerprint, one collective) --------
        device = self._params[0].device if self._params else torch.device("cpu")
        global_check = functools.partial(checks.fingerprint_problem, plan, pairs)
        local_check = functools.partial(checks.local_layout_problem, plan, local_pairs)
        problem = global_check() if self._tp == 1 else local_check()
        if problem is None and any(p is not q for p, q in zip(self._live, self._params)):
            # DTensors: global shapes and layouts (fingerprint) and local shards, both checked
            problem = local_check() if self._tp == 1 else global_check()
        if self._tp == 1:
            checks.agree(plan, problem, dp=self._dp, group=self._group, device=device)
        else:
            checks.agree_grid(plan, problem, dp=self._dp, dp_group=self._group, tp=self._tp,
                              tp_group=self._tp_group, device=device)
        self._spec, self._matrix, self._recorded = checks.build_matrix_kernel(
            plan, optimizer=optimizer, options=matrix_options or {}, ns_dtype=ns_dtype,
            explicit={"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                      "ns_steps": ns_steps})
        self._adamw = AdamW(AdamWConfig(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                        weight_decay=adamw_weight_decay,
                                        nonfinite=adamw_nonfinite))
        self.plan = plan
        self._digest = checks.plan_digest(plan)
        self._schedule = build_schedule(plan, self._names, self._rank)
        checks.check_work_order(self._schedule, self._names)
        self._external = grad_sync == "external"
        self._main_params = main_params
        self._overlap_tp = bool(overlap_tp)
        self._overlap_gather = overlap_param_gather
        self._warned_unused = False
        matrix_set = set(self._schedule.matrix_params)
        groups, defaults = build_param_groups(
            [self._params[i] for i in self._schedule.matrix_params],
            [p for i, p in enumerate(self._params) if i not in matrix_set], self._matrix,
            self._adamw)
        self._groups_fixed = False
        super().__init__(groups, {})
        self._groups_fixed = True
        self.defaults = defaults  # set after the groups so that no group receives the other's keys

        # -- buffers, collectives, state, hooks -----------------------------------------------
        self._buffers = build_buffers(self._schedule, self._params, self._names,
                                      external=self._external, main_params=main_params)
        self._collectives = [make_collective(b, self._rank, self._dp, buf,
                                             reduce=not self._external, method=collective)
                             for b, buf in zip(self._schedule.buckets, self._buffers)]
        self._flight = None
        if flight_record is not None:
            self._flight = FlightRecorder(
                flight_record, dist.get_rank() if distributed else 0,
                labels={"dp_rank": self._rank, "tp_rank": self._tp_rank})
        for c in self._collectives:
            c.timeout_s, c.flight = self._timeout, self._flight
        self._grads = GradientCollector(self._schedule, self._live, self._names, self._buffers)
        update.init_owned_state(self._schedule.mine, self._params, self.state, self._matrix,
                                self._adamw, device)
        self._pairs = PairRunner(self._schedule.mine, dp_group=self._group, dp_rank=self._rank,
                                 timeout_s=self._timeout, flight=self._flight)
        self._micro = MicroGroupRunner(
            build_tp_groups(plan, self._names, self._schedule.param_bucket,
                            self._schedule.param_range,
                            [b.cuts[self._rank] for b in self._schedule.buckets],
                            self._rank, self._tp_rank),
            tp_rank=self._tp_rank, tp=self._tp, comm_dtype=plan.inputs.comm_dtype,
            buffers=self._buffers, params=self._params,
            shared=build_shared_tasks(plan, self._names, self._schedule.param_bucket,
                                      self._schedule.param_range,
                                      [b.cuts[self._rank] for b in self._schedule.buckets],
                                      self._rank),
            shared_cap=LOCKSTEP_CMAX * plan.tp.cmax_bytes if plan.tp is not None else 0)
        self._micro.timeout_s, self._micro.rank = self._timeout, self._rank
        self._micro.dp_group = self._group
        self._micro.flight = self._flight
        self._micro.init_state(self.state, self._matrix, device)
        self._tp_duplicates = self._duplicate_ranges() if self._tp > 1 else ()
        self._sum_globs = tuple(tp_sum_grads) + _megatron_sum_grads(model)
        self._sp_ranges = self._sequence_parallel_ranges() if self._tp > 1 else []
        self._hooks: list[Any] = []
        if not self._external:
            for i, p in enumerate(self._live):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad, i)))
        if overlap_param_gather:
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self.wait_params()))

    def _sequence_parallel_ranges(self) -> list[tuple[int, int, int]]:
        """(bucket, lo, hi) of this rank's own slices holding parameters marked
        ``sequence_parallel`` or named by ``tp_sum_grads`` (replicated over TP, gradients
        partial per TP rank)."""
        out = []
        for b in self._schedule.buckets:
            c0, c1 = self._schedule.own_range(b.index)
            for sl in b.slots:
                name = self._names[sl.param]
                if (getattr(self._live[sl.param], "sequence_parallel", False)
                        or any(fnmatch.fnmatchcase(name, g) for g in self._sum_globs)):
                    lo, hi = max(sl.lo, c0), min(sl.hi, c1)
                    if lo < hi:
                        out.append((b.index, lo - c0, hi - c0))
        return out

    def _duplicate_ranges(self) -> list[list[tuple[int, int]]]:
        """Per bucket, the ranges of this rank's own slice holding parameters replicated over TP:
        neither a TP-split matrix of the plan nor a TP shard (Megatron's ``tensor_model_parallel``,
        a sharded DTensor)."""
        split = {t.param for t in self._micro.tasks}
        split |= {x.param for order in self._schedule.work for xs in order.split for x in xs}
        out = []
        for b in self._schedule.buckets:
            c0, c1 = self._schedule.own_range(b.index)
            ranges = []
            for sl in b.slots:
                if sl.param in split or is_tp_split(self._live[sl.param]):
                    continue
                lo, hi = max(sl.lo, c0), min(sl.hi, c1)
                if lo < hi:
                    ranges.append((lo - c0, hi - c0))
            out.append(ranges)
        return out

    # -- the step, in phases --------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Reduce (if backward has not finished it), update the owned parts, all-gather."""
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
        grads = self._grads
        if grads.reduced:
            return
        if self._external:
            grads.read_external()
            self._sum_sequence_parallel_grads()
            self._agree_flags()
            grads.reduced = True
            return
        self._warn_if_held_back()
        # Phase 1: launch what backward did not (buckets holding parameters without gradients),
        # in order.
        grads.complete_all()
        self._launch_ready_reductions()
        # Phase 2: wait for the reduce-scatters (most finished during backward) and average;
        # then one small all-reduce of the "got a gradient" and "non-finite" flags.
        for c in self._collectives:
            c.finish_reduce()
        self._sum_sequence_parallel_grads()
        self._agree_flags()
        grads.reduced = True

    def _agree_flags(self) -> None:
        """Per parameter, whether any rank got a gradient for it, and per bucket whether any
        rank's averaged slice holds NaN or Inf: one MAX all-reduce over the DP group (and the TP
        group) and one copy to the host, as before. Only when a bucket is non-finite somewhere,
        a second all-reduce names the parameters, so the non-finite policy decides the same on
        every rank (``_apply_nonfinite_policy``)."""
        grads = self._grads
        n = len(self._params)
        device = self._params[0].device
        finite = [torch.isfinite(b.own).all() for b in self._buffers if b.own.numel()]
        bad_bucket = (~torch.stack(finite)).any().to(torch.int32).reshape(1) if finite else \
            torch.zeros(1, dtype=torch.int32, device=device)
        flags = torch.cat([grads.received.to(device), bad_bucket.to(device)])
        self._all_reduce_max(flags)
        flags = flags.cpu().tolist()
        grads.received_anywhere = flags[:n]
        if not flags[n]:
            return
        bad = torch.zeros(n, dtype=torch.int32)
        for bi, buf in enumerate(self._buffers):
            for x in self._own_pieces(bi):
                if not bool(torch.isfinite(buf.own[x.lo:x.hi]).all()):
                    bad[x.param] = 1
        bad = bad.to(device)
        self._all_reduce_max(bad)
        self._apply_nonfinite_policy([i for i, f in enumerate(bad.cpu().tolist()) if f])

    def _all_reduce_max(self, t: Tensor) -> None:
        for size, group, name in ((self._dp, self._group, "DP"), (self._tp, self._tp_group, "TP")):
            if size > 1:
                work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
                what = (f"the {name} all-reduce of the per-parameter gradient flags (after the "
                        "reduce-scatters)")
                if self._flight is not None:
                    self._flight.add(what, work)
                wait_for(work, what, self._timeout, self._rank)

    def _apply_nonfinite_policy(self, bad: list[int]) -> None:
        """The same decision on every rank for the parameters whose averaged gradient holds NaN
        or Inf anywhere: under ``nonfinite="raise"`` (the kernels' default) every rank raises
        ``NonFiniteGradientError`` naming them, before anything is updated (gradients dropped:
        the next step starts clean); under ``"skip"`` every rank leaves them alone this step
        (their owners do not update them; the all-gathers send them unchanged)."""
        if not bad:
            return
        matrix = set(self._schedule.matrix_params)

        def policy(i: int) -> str:
            kernel = self._matrix if i in matrix else self._adamw
            return getattr(getattr(kernel, "config", None), "nonfinite", "raise")

        raise_on = [i for i in bad if policy(i) == "raise"]
        if raise_on:
            self._start_next_iteration()
            raise NonFiniteGradientError([self._names[i] for i in raise_on])
        received = list(self._grads.received_anywhere)
        skipped = set(bad)
        for i in bad:
            received[i] = 0  # as if no rank had a gradient for it: nobody updates it
        self._grads.received_anywhere = received
        # Their slices count as zero (a global norm for clipping stays finite).
        for bi, buf in enumerate(self._buffers):
            for x in self._own_pieces(bi):
                if x.param in skipped:
                    buf.own[x.lo:x.hi].zero_()
        warnings.warn(f"skipped {len(bad)} parameter(s) with a non-finite gradient this step "
                      f"(nonfinite='skip'): " + ", ".join(self._names[i] for i in bad),
                      NonFiniteSkipWarning, stacklevel=3)

    def _own_pieces(self, bucket: int) -> list:
        """This rank's pieces of bucket ``bucket``'s own slice: matrix tasks, AdamW slices and
        TP-split shards (each with ``param``, ``lo``, ``hi``)."""
        mine = self._schedule.mine
        return [*(mine.matrix[bucket] if bucket < len(mine.matrix) else ()),
                *(mine.adamw[bucket] if bucket < len(mine.adamw) else ()),
                *(mine.split[bucket] if bucket < len(mine.split) else ())]

    def _sum_sequence_parallel_grads(self) -> None:
        """Sequence parallelism (tp > 1): each TP rank's gradient of a parameter marked
        ``sequence_parallel`` (Megatron's norms) covers its part of the sequence only; sum them
        over the TP group, as Megatron does, in one all-reduce of this rank's own slices."""
        if not self._sp_ranges:
            return
        pieces = [self._buffers[b].own[lo:hi] for b, lo, hi in self._sp_ranges]
        flat = torch.cat(pieces)
        dist.all_reduce(flat, group=self._tp_group)
        k = 0
        for piece in pieces:
            piece.copy_(flat[k:k + piece.numel()])
            k += piece.numel()

    def _compute_matrix_directions(self) -> dict[int, Tensor]:
        """Phase 3: the update directions of every matrix this rank owns, in one kernel call."""
        # Matrices shared with another DP rank (plan.dp_shared) first, phase by phase: every
        # rank starts its pairs at once (after its whole matrices, a partner with more of them
        # would keep the other waiting, and the waits would chain along the pairs).
        out = self._pairs.directions(self._buffers, self._params, self.state, self._matrix,
                                     self._grads.received_anywhere)
        out.update(update.matrix_directions(self._schedule.mine, self._buffers, self._params,
                                            self.state, self._matrix,
                                            self._grads.received_anywhere))
        return out

    def _run_tp_microgroups(self) -> None:
        """Phase 3b (tp > 1): for each micro-group of this TP group, in plan order, the
        all-to-all gather of the next group's gradient shards overlapping the updates of the
        tasks hosted here, then the scatter of the updates and their application to this rank's
        shards (``runtime.tp``)."""
        self._micro.run(group=self._tp_group, state=self.state, matrix=self._matrix,
                        received=self._grads.received_anywhere, overlap=self._overlap_tp)

    def tp_scratch_bytes(self) -> int:
        """Most bytes of gathered full matrices this rank's TP pipeline holds at once (two
        micro-groups in flight; 0 for tp = 1). The plan bounds one group by C_max."""
        return self._micro.peak_scratch_bytes(getattr(self._matrix.config, "ns_dtype",
                                                      torch.bfloat16))

    def _apply_updates_and_gather(self, directions: dict[int, Tensor]) -> None:
        """Phase 4, bucket by bucket in order: apply the directions, AdamW on the owned elements,
        launch the bucket's all-gather (it runs while the next bucket is updated). Then, unless
        ``overlap_param_gather``, wait: the parameters are whole again everywhere."""
        mine, received = self._schedule.mine, self._grads.received_anywhere
        for bi, (buf, c) in enumerate(zip(self._buffers, self._collectives)):
            update.apply_bucket(bi, mine, buf, self._params, self.state, self._matrix,
                                self._adamw, directions, received)
            c.launch_gather(self._group)
        if not self._overlap_gather:
            self.wait_params()

    def _start_next_iteration(self) -> None:
        for buf in self._buffers:
            buf.grads.zero_()
        self._grads.reset()

    # -- gradients ------------------------------------------------------------------------------

    def _on_grad(self, i: int, p: Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i``."""
        if self._grads.accumulate(i, p):
            self._launch_ready_reductions()

    def _launch_ready_reductions(self) -> None:
        for bi in self._grads.take_ready():
            self._collectives[bi].launch_reduce(self._group)

    def _warn_if_held_back(self) -> None:
        """Once per optimizer: a parameter without gradient kept buckets from overlapping."""
        if self._warned_unused or self._dp == 1:
            return
        held = self._grads.held_back()
        if held is None:
            return
        warnings.warn(held_back_message(self._schedule, self._buffers, *held),
                      UnusedParameterWarning, stacklevel=2)
        self._warned_unused = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate locally and reduce nothing; the
        next backward outside completes the buckets and reduces them once."""
        old, self._grads.sync = self._grads.sync, False
        try:
            yield
        finally:
            self._grads.sync = old

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
        return clip_owned([b.own for b in self._buffers], max_norm, norm_type, dp=self._dp,
                          group=self._group, tp=self._tp, tp_group=self._tp_group,
                          duplicates=self._tp_duplicates)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' ``.grad`` and any gradient collected since the last step."""
        for p in self._live:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        if self._grads.pending:
            for c in self._collectives:
                c.wait_reduce()
            self._start_next_iteration()

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

    # -- waiting and shutting down --------------------------------------------------------------

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers of the last step (a no-op when none is running)."""
        for c in self._collectives:
            c.finish_gather()

    def finish(self) -> None:
        """Wait for every collective this optimizer has started and drop their handles.

        The parameter all-gathers of the last step (left running by
        ``overlap_param_gather=True``) complete into the parameters; reduce-scatters that
        backward started complete into this rank's gradient slices, which the next ``step()``
        (or ``clip_grad_norm_``) uses as usual. On CUDA the current stream is then synchronised,
        so the host knows the results are in memory. Last, with dp > 1, it sleeps a few
        milliseconds (GIL and core released): a backend thread may still be letting go of a
        finished work, which frees tensors and takes the GIL; gloo's threads outlive
        ``destroy_process_group()`` when the group object stays alive (torch 2.13 keeps the
        default group's), and one still doing so at interpreter shutdown aborts the process
        ("terminate called without an active exception", issue 9).

        Idempotent, and training may go on after it; call it (or :meth:`close`) before
        ``torch.distributed.destroy_process_group()``.
        """
        self.wait_params()
        for c in self._collectives:
            c.wait_reduce()  # the reduced slice is unpacked by the next finish_reduce
        device = self._params[0].device if self._params else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        if self._dp > 1:
            time.sleep(_BACKEND_GRACE_S)

    def close(self) -> None:
        """:meth:`finish`, then release the gradient and forward hooks and the process group.

        After it the model is a plain module again (its parameters keep their values; backward
        leaves gradients in ``.grad``), and ``step()`` / ``clip_grad_norm_()`` raise; the state,
        ``state_dict()`` and the byte counts stay available. Idempotent. The optimizer is also a
        context manager that closes on exit (without waiting for collectives when the block
        raised, as a failed rank's peers may never complete them).
        """
        if self._closed:
            return
        self.finish()
        self._release()

    def _release(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for c in self._collectives:
            c.drop()
        self._group = None  # an explicit dp_group is no longer kept alive by this optimizer
        self._pairs.groups = {}  # nor by the DP pairs' peers
        self._micro.dp_group = None  # nor by the TP pairs' (tp > 1)
        if self._flight is not None:
            self._flight.close()
        self._closed = True

    def __enter__(self) -> CanzonaOptimizer:
        self._check_open("__enter__")
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            self._release()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"CanzonaOptimizer.{what}: the optimizer is closed (close() or the "
                               "end of its with-block); build a new one to train again.")

    # -- introspection and checkpoints ----------------------------------------------------------

    @property
    def collective_methods(self) -> tuple[str, ...]:
        """Per bucket, in launch order, the collective method it uses (``equal``, ``padded``,
        ``all_to_all``, ``per_root``, ``all_reduce``; ``local`` when dp = 1)."""
        return tuple(c.method for c in self._collectives)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (every tensor, step counters included, and the
        fp32 main copies under ``main_params="fp32"``): :func:`predicted_state_bytes` of the plan.
        """
        return accounting.measured_state_bytes(self.state, (b.main for b in self._buffers))

    def predicted_state_bytes(self) -> int:
        """``state_bytes()`` predicted from the plan's geometry and this optimizer's kernels:
        :func:`predicted_state_bytes`, with each owned matrix task's state taken from the matrix
        kernel in use (exact also when ``matrix_options`` change Shampoo's state layout)."""
        matrix = {self._names[i] for i in self._schedule.matrix_params}
        total = sum(accounting.STATE_BYTES * self._matrix.state_numel(t.shape)
                    for ts in self._schedule.mine.matrix for t in ts)
        total += sum(accounting.STATE_BYTES * self._matrix.state_numel(t.full_shape)
                     for t in self._micro.hosted)  # tp > 1: the full matrices hosted here
        total += sum(accounting.STATE_BYTES * self._matrix.state_numel(x.local_shape)
                     for x in self._micro.shared)  # and this rank's shard of the shared ones
        return total + accounting.adamw_and_main_bytes(self.plan, self._rank, matrix,
                                                       self._main_params)

    @torch.no_grad()
    def reload_main_params(self) -> None:
        """Take the fp32 main copies again from the (bf16/fp16) parameters, e.g. after
        ``model.load_state_dict`` (a no-op without ``main_params="fp32"``)."""
        self.wait_params()
        for buf in self._buffers:
            if buf.main is not None:
                buf.main.copy_(buf.own_params)

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per step in the reduce-scatters and all-gathers (the methods the
        constructor chose; padding included)."""
        buckets = self._schedule.buckets
        return accounting.comm_bytes(
            [c.method for c in self._collectives], [b.sizes for b in buckets], self._rank,
            grad_bytes=[4 if self._external else buf.grads.element_size() for buf in self._buffers],
            param_bytes=[buf.params.element_size() for buf in self._buffers],
            external=self._external)

    def state_dict(self) -> dict[str, Any]:
        """This rank's (sharded) state: per parameter index its owned task or slice state, the
        param groups' hyper-parameters, and the plan it belongs to."""
        self.wait_params()
        main = [b.main for b in self._buffers] if self._main_params is not None else None
        return checkpoint.build_state_dict(self._params, self.state, self.param_groups,
                                           digest=self._digest, rank=self._rank, main=main)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved by this DP rank under this plan."""
        checkpoint.check_owner(state_dict, digest=self._digest, rank=self._rank)
        # fp32 main copies: the saved ones, else (saved without them) from the parameters.
        if not checkpoint.load_into(state_dict, self._params, self.state, self.param_groups,
                                    [b.main for b in self._buffers]):
            self.reload_main_params()


def _megatron_sum_grads(model: Any) -> tuple[str, ...]:
    """The QK-layernorm globs (any name prefix) for a Megatron-core GPTModel built with
    ``qk_layernorm``, else none."""
    found = find_gpt(model)
    if found is None or not getattr(found[1].config, "qk_layernorm", False):
        return ()
    return MEGATRON_SUM_GRADS
