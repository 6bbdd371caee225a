"""``CanzonaOptimizer``: executes a DP plan (tp = 1) inside ``optimizer.step()``.

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

Variable sizes have no stock primitive (DESIGN.md "Runtime"). Per bucket, from the plan's slice
sizes, the constructor picks: equal slices → ``reduce_scatter_tensor`` / ``all_gather_into_tensor``
on the buffers themselves; nearly equal (R·max ≤ 1.125·size) → the same calls on slices padded to
the largest; otherwise ``all_to_all_single`` with split sizes (reduce: a local sum of the R
received copies of the own slice; gather: the own slice sent to every rank, received straight
into the parameter buffer). All of them run asynchronously and work on gloo and NCCL.

The plan is converted once into frozen records of tuples (``_Schedule``); the step loop never
touches pydantic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import numbers
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from canzona.planner import formulas
from canzona.planner.plan import Plan
from canzona.runtime.introspect import inventory, named_params
from canzona.runtime.optim import AdamW, AdamWConfig, registry

__all__ = ["CanzonaOptimizer", "PlanMismatchError", "predicted_state_bytes"]

_GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Values of the constructor's ``main_params``.
_MAIN_PARAMS = (None, "fp32")
# torch ≥ 2.10 renamed the tensor collectives (the old names warn).
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

#: Pad slices to the largest when that costs at most this factor over the bucket's size.
_PAD_SLACK = 1.125
#: Seconds ``finish()`` sleeps (GIL and core released) after the last wait, so that the backend's
#: threads finish freeing the completed works (issue 9, see ``finish``).
_BACKEND_GRACE_S = 0.005


class PlanMismatchError(ValueError):
    """The plan does not fit the model, the process group, the other ranks or the settings."""


# --- the plan as frozen records ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Slot:
    param: int  # index into the optimizer's parameter list (registration order)
    lo: int  # [lo, hi) relative to the bucket start
    hi: int


@dataclass(frozen=True, slots=True)
class _Bucket:
    index: int  # position over all buffers, the launch order
    numel: int  # padded size
    cuts: tuple[int, ...]  # dp + 1 offsets relative to the bucket start
    slots: tuple[_Slot, ...]
    grad_dtype: str
    reduce: str  # "equal" | "padded" | "all_to_all"
    gather: str

    def slice_sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.cuts, self.cuts[1:]))


@dataclass(frozen=True, slots=True)
class _MatrixTask:
    """An owned matrix task: rows [row0, row0 + shape[0]) of parameter ``param``."""

    id: int
    param: int
    name: str
    bucket: int
    lo: int  # element range relative to the own slice of the bucket
    hi: int
    row0: int
    shape: tuple[int, int]


@dataclass(frozen=True, slots=True)
class _AdamSlice:
    """Owned elements [offset, offset + hi - lo) of an AdamW parameter (flattened)."""

    param: int
    name: str
    bucket: int
    lo: int  # relative to the own slice of the bucket
    hi: int
    offset: int


@dataclass(frozen=True, slots=True)
class _Schedule:
    dp: int
    rank: int
    buckets: tuple[_Bucket, ...]
    matrix: tuple[tuple[_MatrixTask, ...], ...]  # per bucket, the owned tasks in plan order
    adamw: tuple[tuple[_AdamSlice, ...], ...]  # per bucket, the owned AdamW slices
    param_bucket: tuple[int, ...]  # per parameter
    param_range: tuple[tuple[int, int], ...]  # per parameter, [lo, hi) in its bucket
    matrix_params: tuple[int, ...]  # parameters the plan gives the matrix optimizer


def _method(sizes: tuple[int, ...]) -> str:
    if len(set(sizes)) == 1:
        return "equal"
    if len(sizes) * max(sizes) <= _PAD_SLACK * sum(sizes):
        return "padded"
    return "all_to_all"


def _schedule(plan: Plan, names: list[str], rank: int) -> _Schedule:
    """Convert the plan (already checked against the model) into this rank's records."""
    index = {n: i for i, n in enumerate(names)}
    buckets: list[_Bucket] = []
    param_bucket = [-1] * len(names)
    param_range = [(0, 0)] * len(names)
    for buf in plan.buffers:
        for b in buf.buckets:
            slots = []
            for s in b.slots:
                i = index[s.name]
                slots.append(_Slot(i, s.start - b.start, s.end - b.start))
                param_bucket[i] = len(buckets)
                param_range[i] = (s.start - b.start, s.end - b.start)
            cuts = tuple(c - b.start for c in b.cuts)
            sizes = tuple(y - x for x, y in zip(cuts, cuts[1:]))
            m = _method(sizes)
            buckets.append(_Bucket(len(buckets), b.end - b.start, cuts, tuple(slots),
                                   buf.grad_dtype, m, m))
    matrix: list[list[_MatrixTask]] = [[] for _ in buckets]
    adamw: list[list[_AdamSlice]] = [[] for _ in buckets]
    rows_done: dict[str, int] = defaultdict(int)
    matrix_params: list[int] = []
    for t in plan.tasks:
        i = index[t.param]
        bi = param_bucket[i]
        b = buckets[bi]
        own_lo, own_hi = b.cuts[rank], b.cuts[rank + 1]
        lo, hi = param_range[i]
        if t.optimizer == "matrix":
            rows, cols = t.shape
            row0 = rows_done[t.param]
            rows_done[t.param] += rows
            if i not in matrix_params:
                matrix_params.append(i)
            a, z = lo + row0 * cols, lo + (row0 + rows) * cols
            holders = [r for r in range(len(b.cuts) - 1) if b.cuts[r] < z and a < b.cuts[r + 1]]
            if holders != [t.owner]:
                raise PlanMismatchError(
                    f"the plan cuts matrix '{t.param}' across DP ranks {holders} (owner "
                    f"{t.owner}); the runtime needs whole-matrix ownership (strategy "
                    f"'{plan.inputs.solver.strategy}'; plan with 'canzona plan' or plan_model).")
            if t.owner == rank:
                matrix[bi].append(_MatrixTask(t.id, i, t.param if t.part is None else
                                              f"{t.param}#{t.part}", bi, a - own_lo, z - own_lo,
                                              row0, (rows, cols)))
        else:
            a, z = max(lo, own_lo), min(hi, own_hi)
            if a < z:
                adamw[bi].append(_AdamSlice(i, t.param, bi, a - own_lo, z - own_lo, a - lo))
    return _Schedule(plan.inputs.dp, rank, tuple(buckets), tuple(tuple(x) for x in matrix),
                     tuple(tuple(x) for x in adamw), tuple(param_bucket), tuple(param_range),
                     tuple(matrix_params))


# --- checks ---------------------------------------------------------------------------------------


def _plan_params(plan: Plan) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, logical shape, dtype) per parameter, in registration (task) order."""
    dtype = {s.name: buf.dtype for buf in plan.buffers for b in buf.buckets for s in b.slots}
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for t in plan.tasks:
        shapes.setdefault(t.param, []).append(tuple(t.shape))
    out = []
    for name, parts in shapes.items():
        shape = parts[0] if len(parts) == 1 else (sum(p[0] for p in parts), *parts[0][1:])
        out.append((name, shape, dtype.get(name, "?")))
    return out


def _fingerprint_problem(plan: Plan, pairs: list[tuple[str, Tensor]]) -> str | None:
    """None if the plan's fingerprint matches the live parameters, else one line naming the first
    parameter that differs."""
    spec = inventory(pairs)
    if spec.fingerprint() == plan.fingerprint:
        return None
    planned = _plan_params(plan)
    live = [(p.name, tuple(p.shape), p.dtype) for p in spec.params]
    for k, (a, b) in enumerate(zip(planned, live)):
        if a[0] != b[0]:
            return (f"the plan does not match the model: parameter #{k} is '{a[0]}' in the plan "
                    f"but '{b[0]}' in the model.")
        if a[1] != b[1]:
            return (f"the plan does not match the model: parameter '{a[0]}' has shape "
                    f"{list(a[1])} in the plan but {list(b[1])} in the model.")
        if a[2] != b[2]:
            return (f"the plan does not match the model: parameter '{a[0]}' is {a[2]} in the plan "
                    f"but {b[2]} in the model.")
    if len(planned) != len(live):
        longer, other = (planned, "model") if len(planned) > len(live) else (live, "plan")
        first = longer[min(len(planned), len(live))][0]
        return (f"the plan does not match the model: {len(planned)} parameters in the plan, "
                f"{len(live)} in the model; the {other} lacks '{first}'.")
    return (f"the plan does not match the model: names, shapes and dtypes agree but the TP "
            f"attributes differ (fingerprint {plan.fingerprint[:19]}… vs {spec.fingerprint()[:19]}…).")


def _plan_digest(plan: Plan) -> bytes:
    return hashlib.sha256(plan.model_dump_json().encode()).digest()


def _check_main_params(main_params: Any) -> None:
    if main_params not in _MAIN_PARAMS:
        raise ValueError(f"main_params = {main_params!r} is not allowed; choose None (update the "
                         "parameters in their own dtype) or 'fp32' (fp32 main copies of the owned "
                         "parts of bf16/fp16 parameters)")


#: Optimizer state is kept in fp32 (``_init_state``), step counters included.
_STATE_BYTES = 4


def predicted_state_bytes(plan: Plan, dp_rank: int, *, main_params: str | None = None) -> int:
    """Optimizer bytes DP rank ``dp_rank`` holds under ``plan``: exactly what ``state_bytes()``
    measures when the matrix kernel keeps the state layout the plan records (always for Muon and
    SOAP; for Shampoo unless ``momentum > 0`` or ``betas[0] = 0``, which add or drop an m×n
    buffer — :meth:`CanzonaOptimizer.predicted_state_bytes` accounts for those too).

    The sum, over what the rank owns, of

    * every owned matrix task's ``state_bytes`` (the plan's per-task kernel state);
    * per AdamW fragment of k elements (the rank's piece of an AdamW tensor in its own slice of
      a bucket): two fp32 moments and the fp32 step counter, ``4 · (2k + 1)`` bytes — a tensor
      cut across ranks has a step counter on each of them;
    * with ``main_params="fp32"``: 4 bytes per element of the rank's own slice of every bucket
      whose buffer is bf16 or fp16 (the fp32 main copies; fp32 buffers need none).

    This equals ``plan.metrics.dp_state_bytes[dp_rank]`` (+ the main copies) except that the
    planner shares the step counter of a cut AdamW tensor among its pieces by element count: per
    cut tensor, ``dp_state_bytes`` is short by up to 4 bytes on each rank holding a piece.

    Raises:
        ValueError: ``main_params`` or ``dp_rank`` is not allowed, or the plan has tp > 1.
    """
    _check_main_params(main_params)
    if plan.inputs.tp != 1:
        raise ValueError(f"predicted_state_bytes predicts the runtime's state, and the runtime "
                         f"executes tp = 1 plans; this plan is for tp={plan.inputs.tp} (its "
                         f"planned state per DP index is plan.metrics.dp_state_bytes).")
    if (isinstance(dp_rank, bool) or not isinstance(dp_rank, numbers.Integral)
            or not 0 <= dp_rank < plan.inputs.dp):
        raise ValueError(f"dp_rank = {dp_rank!r} is not allowed; choose 0 … {plan.inputs.dp - 1}")
    dp_rank = int(dp_rank)
    matrix = {t.param for t in plan.tasks if t.optimizer == "matrix"}
    total = sum(t.state_bytes for t in plan.tasks if t.optimizer == "matrix" and t.owner == dp_rank)
    return total + _adamw_and_main_bytes(plan, dp_rank, matrix, main_params)


def _adamw_and_main_bytes(plan: Plan, d: int, matrix: set[str], main_params: str | None) -> int:
    """The AdamW fragments' state and the fp32 main copies of DP rank ``d`` (see
    :func:`predicted_state_bytes`)."""
    total = 0
    for buf in plan.buffers:
        r = d  # the rank of the buffer's sharding group that is DP index d (planning.dp_index)
        if buf.expert:
            r, rest = divmod(d - (buf.ep_rank or 0), plan.inputs.ep)
            if rest or not 0 <= r < buf.dp_size:
                continue
        for b in buf.buckets:
            lo, hi = b.cuts[r], b.cuts[r + 1]
            if main_params == "fp32" and buf.dtype != "fp32":
                total += 4 * (hi - lo)
            for s in b.slots:
                k = min(s.end, hi) - max(s.start, lo)
                if k > 0 and s.name not in matrix:
                    total += _STATE_BYTES * formulas.adamw_state_numel(k)
    return total


def _config_fields(config: Any) -> dict[str, Any]:
    """A kernel config's hyper-parameters (its init fields) as a dict."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


def _tuplify(value: Any) -> Any:
    """Lists (e.g. betas set as a list) become the tuples the kernel configs hold."""
    return tuple(_tuplify(v) for v in value) if isinstance(value, (list, tuple)) else value


# --- the optimizer --------------------------------------------------------------------------------


class CanzonaOptimizer(torch.optim.Optimizer):
    """ZeRO-1 data parallelism with whole-matrix ownership, executing a canzona plan.

    Every DP rank builds one with the same plan. The trainer does not wrap the model in DDP
    (``grad_sync="reduce_scatter"``): backward hooks put gradients into the plan's flat buckets and
    reduce-scatter each bucket as soon as it is complete. ``step()`` updates the matrices and AdamW
    elements this rank owns and all-gathers the parameters.

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
        plan: a :class:`~canzona.planner.plan.Plan` (``canzona.plan_model`` or ``canzona.load_plan``).
        lr, weight_decay, momentum: matrix optimizer hyper-parameters; None takes the kernel's
            default (Muon: ``torch.optim.Muon``'s 1e-3, 0.1, 0.95; Shampoo and SOAP: theirs).
        ns_dtype: Muon's Newton–Schulz dtype (bfloat16 as torch; float32 for exact comparisons).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW for the non-matrix parameters
            (``torch.optim.AdamW``'s defaults).
        dp_group: the data-parallel process group (default: the world, looked up at every
            collective so that the optimizer does not keep it alive; none when not initialised
            and the plan has dp = 1).
        tp_group: must be None or of size 1: the runtime executes tp = 1 plans.
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

    Raises:
        PlanMismatchError: the plan does not match the live parameters (naming the first differing
            parameter), ranks hold different plans, a setting disagrees with the plan, the group
            size differs from the plan's dp, or the plan splits a matrix or needs tp > 1.
    """

    def __init__(
        self,
        model: nn.Module | Iterable[tuple[str, Tensor]],
        plan: Plan,
        lr: float | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        dp_group: Any = None,
        tp_group: Any = None,
        grad_sync: str = "reduce_scatter",
        *,
        optimizer: str | None = None,
        ns_steps: int | None = None,
        matrix_options: dict[str, Any] | None = None,
        overlap_param_gather: bool = False,
        main_params: str | None = None,
    ) -> None:
        _check_main_params(main_params)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a canzona Plan (canzona.load_plan), got {type(plan).__name__}")
        if grad_sync not in ("reduce_scatter", "external"):
            raise ValueError(f"grad_sync = {grad_sync!r} is not allowed; choose 'reduce_scatter' or "
                             "'external'")
        if plan.inputs.tp != 1 or plan.rank_layout.tp != 1:
            raise PlanMismatchError(f"the plan is for tp={plan.inputs.tp}; this runtime executes "
                                    "tp=1 (data-parallel) plans only.")
        if plan.inputs.ep != 1:
            raise PlanMismatchError(f"the plan is for ep={plan.inputs.ep}; this runtime executes "
                                    "ep=1 plans only (expert parallelism is not supported yet).")
        if tp_group is not None and dist.get_world_size(tp_group) != 1:
            raise PlanMismatchError("tp_group has more than one rank; this runtime executes tp=1 "
                                    "plans only.")
        pairs = named_params(model)
        self._names = [n for n, _ in pairs]
        self._params: list[Tensor] = [p for _, p in pairs]
        # None stands for the default group and is resolved by every collective: holding the
        # default ProcessGroup object would keep it (and its backend's worker threads) alive
        # after dist.destroy_process_group(), into interpreter shutdown (issue 9).
        self._group = dp_group
        distributed = dp_group is not None or (dist.is_available() and dist.is_initialized())
        self._dp = dist.get_world_size(dp_group) if distributed else 1
        self._rank = dist.get_rank(dp_group) if distributed else 0
        self._closed = False
        self._gather_work: list[Any] = []
        self._rs_out: dict[int, Tensor] = {}
        if self._dp != plan.inputs.dp:
            raise PlanMismatchError(f"the plan is for dp={plan.inputs.dp} but the data-parallel "
                                    f"group has {self._dp} ranks.")
        if overlap_param_gather and not isinstance(model, nn.Module):
            raise ValueError("overlap_param_gather=True needs the nn.Module (its forward pre-hook "
                             "waits for the parameters)")

        # -- safety: every rank agrees before it acts (plan hash + fingerprint, one collective) --
        problem = _fingerprint_problem(plan, pairs)
        self._agree(plan, problem)
        self._spec, self._matrix, self._recorded = self._make_kernel(
            plan, lr, weight_decay, momentum, ns_dtype, optimizer, ns_steps, matrix_options or {})
        self._adamw = AdamW(AdamWConfig(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                        weight_decay=adamw_weight_decay))
        self.plan = plan
        self._digest = _plan_digest(plan)
        self._s = _schedule(plan, self._names, self._rank)
        self._external = grad_sync == "external"
        self._main_params = main_params

        # Parameter groups as torch.optim keeps them: the "matrix" group holds every field of
        # the matrix kernel's config (torch.optim.Muon's lr, momentum, nesterov, weight_decay,
        # ns_steps, …; Shampoo's and SOAP's betas, eps, …), the "adamw" group torch.optim.AdamW's
        # lr, betas, eps, weight_decay. step() reads them at every step (_sync_hyperparameters).
        matrix_set = set(self._s.matrix_params)
        groups = []
        mp = [self._params[i] for i in self._s.matrix_params]
        ap = [p for i, p in enumerate(self._params) if i not in matrix_set]
        mhp = _config_fields(self._matrix.config)
        acfg = self._adamw.config
        ahp = {"lr": acfg.lr, "betas": acfg.betas, "eps": acfg.eps,
               "weight_decay": acfg.weight_decay}
        if mp:
            groups.append({"params": mp, "name": "matrix", **mhp})
        if ap:
            groups.append({"params": ap, "name": "adamw", **ahp})
        self._groups_fixed = False
        super().__init__(groups, {})
        self._groups_fixed = True
        # What a scheduler reads to pick its convention (OneCycleLR, CyclicLR: 'betas' if present,
        # else 'momentum'): the matrix optimizer's hyper-parameters, as torch.optim.Muon's
        # defaults (set after the groups so that no group receives the other's keys).
        self.defaults = dict(mhp if mp else ahp)

        self._build_buffers()
        self._init_state()
        self._hooks: list[Any] = []
        if not self._external:
            for i, p in enumerate(self._params):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(i)))
        if overlap_param_gather:
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self.wait_params()))
        self._overlap_gather = overlap_param_gather
        self._sync = True
        self._reset_iteration()

    # -- construction helpers -------------------------------------------------------------------

    def _agree(self, plan: Plan, problem: str | None) -> None:
        if self._dp == 1:
            if problem:
                raise PlanMismatchError(problem)
            return
        device = self._params[0].device
        mine = torch.tensor(list(_plan_digest(plan)) + [0 if problem else 1], dtype=torch.int64,
                            device=device)
        everyone = torch.empty(self._dp * mine.numel(), dtype=torch.int64, device=device)
        _all_gather(everyone, mine, group=self._group)
        rows = everyone.view(self._dp, -1).cpu().tolist()
        digests = [bytes(r[:-1]).hex()[:12] for r in rows]
        if len(set(digests)) > 1:
            listed = ", ".join(f"rank {r}: {d}" for r, d in enumerate(digests))
            raise PlanMismatchError(f"the DP ranks hold different plans (sha256 {listed}); load the "
                                    "same plan file on every rank.")
        if problem:
            raise PlanMismatchError(problem)
        bad = [r for r, row in enumerate(rows) if row[-1] == 0]
        if bad:
            raise PlanMismatchError(f"the plan does not match the model on DP rank(s) {bad} (see "
                                    "their error for the first differing parameter).")

    @staticmethod
    def _make_kernel(plan, lr, weight_decay, momentum, ns_dtype, optimizer, ns_steps, options):
        """The matrix kernel's spec (``canzona.runtime.optim.registry``), the kernel, and the
        config fields the plan records (they must not change)."""
        s = plan.inputs.optimizer
        if optimizer is not None and optimizer != s.name:
            raise PlanMismatchError(f"optimizer={optimizer!r} disagrees with the plan, which was "
                                    f"made for {s.name!r}.")
        spec = registry.get(s.name)
        if spec is None:
            raise PlanMismatchError(f"the plan is for optimizer {s.name!r}, which has no runtime "
                                    f"kernel (registered: {', '.join(registry.names())}).")
        recorded = spec.recorded(s)
        fields = {f.name for f in dataclasses.fields(spec.config) if f.init}
        given = dict(options)
        explicit = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                    "ns_steps": ns_steps}
        for key, value in explicit.items():
            if value is None:
                continue
            if key not in fields:
                hint = spec.hints.get(key)
                raise PlanMismatchError(f"{spec.kernel.name} has no {key} setting (the plan is for "
                                        f"{s.name!r}){'; ' + hint if hint else ''}.")
            given[key] = value
        for key, value in given.items():
            if key in recorded and value != recorded[key]:
                raise PlanMismatchError(f"{key}={value!r} disagrees with the plan, which was made "
                                        f"with {key}={recorded[key]!r}.")
        cfg = {**recorded, **given}
        if "ns_dtype" in fields:
            cfg.setdefault("ns_dtype", ns_dtype)
        return spec, spec.build(spec.config(**cfg)), recorded

    def _build_buffers(self) -> None:
        """Flat parameter and gradient buffers per bucket; parameters become views of them."""
        s = self._s
        self._pbuf: list[Tensor] = []
        self._gbuf: list[Tensor] = []
        self._own: list[Tensor] = []
        #: per bucket, fp32 main copies of the own slice (main_params="fp32", bf16/fp16 buckets)
        self._main: list[Tensor | None] = []
        self._scratch: list[tuple[Tensor | None, Tensor | None]] = []
        R, r = s.dp, s.rank
        for b in s.buckets:
            p0 = self._params[b.slots[0].param]
            device = p0.device
            pbuf = torch.zeros(b.numel, dtype=p0.dtype, device=device)
            with torch.no_grad():
                for sl in b.slots:
                    p = self._params[sl.param]
                    if p.dtype != p0.dtype:
                        raise PlanMismatchError(f"parameter '{self._names[sl.param]}' is {p.dtype} "
                                                f"but its bucket holds {p0.dtype}.")
                    view = pbuf[sl.lo:sl.hi].view_as(p)
                    view.copy_(p)
                    p.data = view
            self._pbuf.append(pbuf)
            low = self._main_params == "fp32" and pbuf.dtype != torch.float32
            self._main.append(pbuf[b.cuts[r]:b.cuts[r + 1]].float() if low else None)
            gdtype = _GRAD_DTYPES[b.grad_dtype]
            self._gbuf.append(torch.zeros(b.numel if not self._external else 0, dtype=gdtype,
                                          device=device))
            sizes = b.slice_sizes()
            big = max(sizes)
            own = torch.zeros(sizes[r], dtype=gdtype, device=device)
            rs_tmp = ag_tmp = None
            if not self._external and b.reduce == "padded":
                rs_tmp = torch.zeros(R * big, dtype=gdtype, device=device)
            elif not self._external and b.reduce == "all_to_all":
                rs_tmp = torch.empty(R * sizes[r], dtype=gdtype, device=device)
            if b.gather == "padded":
                ag_tmp = torch.empty(R * big, dtype=p0.dtype, device=device)
            self._own.append(own)
            self._scratch.append((rs_tmp, ag_tmp))

    def _init_state(self) -> None:
        s = self._s
        device = self._params[0].device
        for tasks in s.matrix:
            for t in tasks:
                p = self._params[t.param]
                st = self._matrix.init_state(t.shape, torch.float32, device)
                if t.name == self._names[t.param]:
                    self.state[p] = st
                else:
                    self.state[p][t.name.rsplit("#", 1)[1]] = st
        for slices in s.adamw:
            for a in slices:
                self.state[self._params[a.param]] = self._adamw.init_state((a.hi - a.lo,),
                                                                           torch.float32, device)

    # -- gradient collection ----------------------------------------------------------------------

    def _grad_hook(self, i: int):
        bi = self._s.param_bucket[i]
        lo, hi = self._s.param_range[i]

        def hook(p: Tensor) -> None:
            if self._launched[bi]:
                raise RuntimeError(
                    f"the gradient of '{self._names[i]}' arrived after its bucket was reduced; run "
                    "all but the last backward of an accumulation under opt.no_sync().")
            g = p.grad
            if g is not None:
                self._gbuf[bi][lo:hi].add_(g.reshape(-1))
                p.grad = None
                self._got[i] = 1
            self._dirty = True
            if self._sync and not self._seen[i]:
                self._seen[i] = True
                self._count[bi] += 1
                if self._count[bi] == self._expected[bi]:
                    self._launch_ready()

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate locally and reduce nothing; the
        next backward outside completes the buckets and reduces them once."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def _reset_iteration(self) -> None:
        s = self._s
        self._expected = [sum(1 for sl in b.slots if self._params[sl.param].requires_grad)
                          for b in s.buckets]
        self._count = [0] * len(s.buckets)
        self._seen = [False] * len(self._params)
        self._got = torch.zeros(len(self._params), dtype=torch.int32)
        self._launched = [False] * len(s.buckets)
        self._next = 0  # buckets launch strictly in order, so every rank issues the same sequence
        self._rs_work: list[Any] = [None] * len(s.buckets)
        self._flag_work = None
        self._flags: Tensor | None = None
        self._reduced = False
        self._clip_coef: Tensor | None = None
        self._dirty = False

    def _launch_ready(self) -> None:
        while self._next < len(self._s.buckets) and self._count[self._next] >= self._expected[self._next]:
            self._launch_reduce(self._next)
            self._next += 1

    def _launch_reduce(self, bi: int) -> None:
        b = self._s.buckets[bi]
        self._launched[bi] = True
        if self._dp == 1:
            self._own[bi].copy_(self._gbuf[bi])
            return
        g, own = self._gbuf[bi], self._own[bi]
        tmp = self._scratch[bi][0]
        sizes = b.slice_sizes()
        if b.reduce == "equal":
            work = _reduce_scatter(own, g, group=self._group, async_op=True)
        elif b.reduce == "padded":
            big = max(sizes)
            out = torch.empty(big, dtype=g.dtype, device=g.device)
            for r in range(self._dp):
                tmp[r * big:r * big + sizes[r]].copy_(g[b.cuts[r]:b.cuts[r + 1]])
            work = _reduce_scatter(out, tmp, group=self._group, async_op=True)
            self._rs_out[bi] = out
        else:
            work = dist.all_to_all_single(tmp, g, output_split_sizes=[sizes[self._rank]] * self._dp,
                                          input_split_sizes=list(sizes), group=self._group,
                                          async_op=True)
        self._rs_work[bi] = work

    def _finish_reduce(self, bi: int) -> None:
        b = self._s.buckets[bi]
        work = self._rs_work[bi]
        if work is not None:
            work.wait()
            self._rs_work[bi] = None
        own = self._own[bi]
        if self._dp > 1:
            if b.reduce == "padded":
                own.copy_(self._rs_out.pop(bi)[:own.numel()])
            elif b.reduce == "all_to_all":
                torch.sum(self._scratch[bi][0].view(self._dp, -1), dim=0, out=own)
            own.div_(self._dp)

    def _reduce(self) -> None:
        """Phases 1-2: every bucket reduced and averaged into ``self._own``; the flags of which
        parameters got a gradient on any rank."""
        if self._reduced:
            return
        s = self._s
        if self._external:
            got = self._got
            for bi, b in enumerate(s.buckets):
                own, c0 = self._own[bi], b.cuts[s.rank]
                own.zero_()
                for sl in b.slots:
                    p = self._params[sl.param]
                    a, z = max(sl.lo, c0), min(sl.hi, b.cuts[s.rank + 1])
                    if p.grad is not None:
                        got[sl.param] = 1
                        if a < z:
                            own[a - c0:z - c0].copy_(p.grad.reshape(-1)[a - sl.lo:z - sl.lo])
            self._flags = got.tolist()
            self._reduced = True
            return
        # Phase 1: launch what backward did not (buckets holding params without gradients), in
        # order, then one small all-reduce of the "got a gradient" flags.
        self._count = [max(c, e) for c, e in zip(self._count, self._expected)]
        self._launch_ready()
        flags = self._got.to(self._params[0].device)
        if self._dp > 1:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        # Phase 2: wait for the reduce-scatters (most finished during backward) and average.
        for bi in range(len(s.buckets)):
            self._finish_reduce(bi)
        if self._dp > 1:
            work.wait()
        self._flags = flags.cpu().tolist()
        self._reduced = True

    # -- public API -----------------------------------------------------------------------------

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
        self._reduce()
        device = self._own[0].device if self._own else torch.device("cpu")
        if norm_type == 2.0:
            parts = [o.float().pow(2).sum() for o in self._own]
            total = torch.stack(parts).sum() if parts else torch.zeros((), device=device)
            op = dist.ReduceOp.SUM if dist.is_available() else None
        else:
            parts = [o.abs().max() if o.numel() else torch.zeros((), device=device) for o in self._own]
            total = torch.stack(parts).max().float() if parts else torch.zeros((), device=device)
            op = dist.ReduceOp.MAX
        if self._dp > 1:
            dist.all_reduce(total, op=op, group=self._group)
        if norm_type == 2.0:
            total = total.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for o in self._own:
            o.mul_(coef.to(o.dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Reduce (if backward has not finished it), update the owned parts, all-gather."""
        self._check_open("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The groups' hyper-parameters (a scheduler may have changed them), checked before
        # anything is reduced or updated: the same groups give the same error on every rank.
        self._sync_hyperparameters()
        self.wait_params()
        s = self._s
        self._reduce()  # phases 1-2
        flags = self._flags
        self._gather_work = []
        # Phase 3: the directions of every owned matrix in one kernel call (same shapes batched
        # across buckets; a kernel that overlaps a running all-gather competes with it for cores
        # and memory bandwidth, and loses the batching).
        tasks = [t for ts in s.matrix for t in ts if flags[t.param]]
        updates: list[Tensor | None] = []
        if tasks:
            grads = [self._own[t.bucket][t.lo:t.hi].view(t.shape) for t in tasks]
            states = [self._task_state(t) for t in tasks]
            updates = self._matrix.direction(grads, states, names=[t.name for t in tasks])
        done = dict(zip((t.id for t in tasks), updates))
        # Phase 4: bucket by bucket (plan order): apply the updates, AdamW on the owned elements,
        # start the bucket's all-gather.
        for bi in range(len(s.buckets)):
            main = self._main[bi]
            c0 = s.buckets[bi].cuts[s.rank]
            for t in s.matrix[bi]:
                u = done.get(t.id)
                if u is None:
                    continue
                if main is None:
                    p = self._params[t.param].view(-1, t.shape[1])[t.row0:t.row0 + t.shape[0]]
                else:
                    p = main[t.lo:t.hi].view(t.shape)
                self._matrix.apply(p, u, full_shape=t.shape)  # lr, wd: the group's (synced)
                if main is not None:
                    self._pbuf[bi][c0 + t.lo:c0 + t.hi].copy_(main[t.lo:t.hi])
            slices = [a for a in s.adamw[bi] if flags[a.param]]
            if slices:
                self._adamw_step(bi, slices)
                if main is not None:
                    for a in slices:
                        self._pbuf[bi][c0 + a.lo:c0 + a.hi].copy_(main[a.lo:a.hi])
            self._launch_gather(bi)
        # Phase 5: the parameters are whole again everywhere (or at the next forward).
        if not self._overlap_gather:
            self.wait_params()
        for g in self._gbuf:
            g.zero_()
        self._reset_iteration()
        return loss

    def _task_state(self, t: _MatrixTask) -> dict[str, Tensor]:
        st = self.state[self._params[t.param]]
        return st if t.name == self._names[t.param] else st[t.name.rsplit("#", 1)[1]]

    def _adamw_step(self, bi: int, slices: list[_AdamSlice]) -> None:
        own = self._own[bi]
        c0 = self._s.buckets[bi].cuts[self._s.rank]
        pbuf = self._pbuf[bi]
        main = self._main[bi]

        def target(a: _AdamSlice) -> Tensor:  # the fp32 main copy, else the parameter
            return pbuf[c0 + a.lo:c0 + a.hi] if main is None else main[a.lo:a.hi]

        # One AdamW group (its kernel's config is the group's, see _sync_hyperparameters).
        self._adamw.step([target(a) for a in slices], [own[a.lo:a.hi] for a in slices],
                         [self.state[self._params[a.param]] for a in slices],
                         names=[a.name for a in slices])

    def _sync_hyperparameters(self) -> None:
        """Rebuild the kernels whose group's hyper-parameters changed since the last step.

        The new configs are validated (ranges, plan-recorded settings, the state layout) before
        either kernel is replaced, so a bad value raises and changes nothing.
        """
        matrix = adamw = None
        for g in self.param_groups:
            if g.get("name") == "matrix":
                matrix = self._matrix_from_group(g)
            elif g.get("name") == "adamw":
                adamw = self._adamw_from_group(g)
        if matrix is not None:
            self._matrix = matrix
        if adamw is not None:
            self._adamw = adamw

    def _matrix_from_group(self, g: dict[str, Any]) -> Any:
        kernel = self._matrix
        old = _config_fields(kernel.config)
        new = {k: _tuplify(g.get(k, v)) for k, v in old.items()}
        if new == old:
            return None
        for key, value in self._recorded.items():
            if new[key] != value:
                raise PlanMismatchError(
                    f"param group 'matrix': {key}={new[key]!r} disagrees with the plan, which was "
                    f"made with {key}={value!r}; the plan fixes it (make a new plan to change it).")
        try:
            fresh = type(kernel)(dataclasses.replace(kernel.config, **new))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"param group 'matrix': {exc}") from None
        layout = self._spec.state_layout
        for (what, before), (_, after) in zip(layout(kernel.config), layout(fresh.config)):
            if before != after:
                raise ValueError(
                    f"param group 'matrix': {kernel.name}'s state was allocated with {what} = "
                    f"{before}; the group now asks for {after}, which needs another state layout "
                    f"(build the optimizer with such a value to change it during training).")
        return fresh

    def _adamw_from_group(self, g: dict[str, Any]) -> Any:
        cfg = self._adamw.config
        new = {k: _tuplify(g.get(k, getattr(cfg, k)))
               for k in ("lr", "betas", "eps", "weight_decay")}
        if all(new[k] == getattr(cfg, k) for k in new):
            return None
        try:
            return AdamW(dataclasses.replace(cfg, **new))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"param group 'adamw': {exc}") from None

    def _launch_gather(self, bi: int) -> None:
        if self._dp == 1:
            return
        b = self._s.buckets[bi]
        pbuf, r = self._pbuf[bi], self._rank
        sizes = b.slice_sizes()
        mine = pbuf[b.cuts[r]:b.cuts[r + 1]]
        # Pending: (work, the bucket to copy out of the padded scratch, else None, the input).
        if b.gather == "equal":
            src = mine.clone()
            work = _all_gather(pbuf, src, group=self._group, async_op=True)
            self._gather_work.append((work, None, src))
        elif b.gather == "padded":
            big, tmp = max(sizes), self._scratch[bi][1]
            src = torch.zeros(big, dtype=pbuf.dtype, device=pbuf.device)
            src[:sizes[r]].copy_(mine)
            work = _all_gather(tmp, src, group=self._group, async_op=True)
            self._gather_work.append((work, bi, src))
        else:
            src = mine.repeat(self._dp)
            work = dist.all_to_all_single(pbuf, src, output_split_sizes=list(sizes),
                                          input_split_sizes=[sizes[r]] * self._dp,
                                          group=self._group, async_op=True)
            self._gather_work.append((work, None, src))

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers of the last step (a no-op when none is running)."""
        pending = self._gather_work
        if not pending:
            return
        for work, bi, src in pending:
            work.wait()
            if bi is not None:
                b = self._s.buckets[bi]
                big, tmp = max(b.slice_sizes()), self._scratch[bi][1]
                for r, n in enumerate(b.slice_sizes()):
                    if r != self._rank:
                        self._pbuf[bi][b.cuts[r]:b.cuts[r] + n].copy_(tmp[r * big:r * big + n])
        self._gather_work = []

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
        for bi, work in enumerate(self._rs_work):
            if work is not None:
                work.wait()  # the reduced slice is consumed by the next _finish_reduce
                self._rs_work[bi] = None
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
        self._gather_work = []
        self._rs_work = [None] * len(self._s.buckets)
        self._group = None  # an explicit dp_group is no longer kept alive by this optimizer
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the parameters' ``.grad`` and any gradient collected since the last step."""
        for p in self._params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        if self._dirty or self._reduced or any(self._launched):
            for w in self._rs_work:
                if w is not None:
                    w.wait()
            self._rs_out.clear()
            for g in self._gbuf:
                g.zero_()
            self._reset_iteration()

    # -- introspection and checkpoints -------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (every tensor, step counters included, and the
        fp32 main copies under ``main_params="fp32"``): :func:`predicted_state_bytes` of the plan.
        """
        total = sum(m.numel() * m.element_size() for m in self._main if m is not None)
        for st in self.state.values():
            for v in st.values():
                for t in (v.values() if isinstance(v, dict) else (v,)):
                    total += t.numel() * t.element_size()
        return total

    def predicted_state_bytes(self) -> int:
        """``state_bytes()`` predicted from the plan's geometry and this optimizer's kernels:
        :func:`predicted_state_bytes`, with each owned matrix task's state taken from the matrix
        kernel in use (exact also when ``matrix_options`` change Shampoo's state layout)."""
        matrix = {self._names[i] for i in self._s.matrix_params}
        total = sum(_STATE_BYTES * self._matrix.state_numel(t.shape)
                    for ts in self._s.matrix for t in ts)
        return total + _adamw_and_main_bytes(self.plan, self._rank, matrix, self._main_params)

    @torch.no_grad()
    def reload_main_params(self) -> None:
        """Take the fp32 main copies again from the (bf16/fp16) parameters, e.g. after
        ``model.load_state_dict`` (a no-op without ``main_params="fp32"``)."""
        self.wait_params()
        for bi, main in enumerate(self._main):
            if main is not None:
                b = self._s.buckets[bi]
                main.copy_(self._pbuf[bi][b.cuts[self._rank]:b.cuts[self._rank + 1]])

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sends per step in the reduce-scatters and all-gathers (the methods the
        constructor chose; padding included)."""
        R, r = self._dp, self._rank
        rs = ag = 0
        if R == 1:
            return {"reduce_scatter": 0, "all_gather": 0}
        for bi, b in enumerate(self._s.buckets):
            sizes = b.slice_sizes()
            ge = self._gbuf[bi].element_size() if not self._external else 4
            pe = self._pbuf[bi].element_size()
            if b.reduce in ("equal", "padded"):
                rs += (R - 1) * max(sizes) * ge
            elif not self._external:
                rs += (sum(sizes) - sizes[r]) * ge
            ag += (R - 1) * (max(sizes) if b.gather in ("equal", "padded") else sizes[r]) * pe
        return {"reduce_scatter": 0 if self._external else rs, "all_gather": ag}

    def state_dict(self) -> dict[str, Any]:
        """This rank's (sharded) state: per parameter index its owned task or slice state, the
        param groups' hyper-parameters, and the plan it belongs to."""
        self.wait_params()
        index = {id(p): i for i, p in enumerate(self._params)}
        state = {index[id(p)]: {k: (v.clone() if isinstance(v, Tensor) else
                                    {kk: vv.clone() for kk, vv in v.items()})
                                for k, v in st.items()} for p, st in self.state.items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        meta: dict[str, Any] = {"plan_sha256": self._digest.hex(), "dp_rank": self._rank}
        if self._main_params is not None:
            meta["main_params"] = [None if m is None else m.clone() for m in self._main]
        return {"state": state, "param_groups": groups, "canzona": meta}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict.get("canzona", {})
        if meta.get("plan_sha256") != self._digest.hex() or meta.get("dp_rank") != self._rank:
            raise PlanMismatchError(
                f"this optimizer state was saved by DP rank {meta.get('dp_rank')} under plan "
                f"{str(meta.get('plan_sha256'))[:12]}; this is rank {self._rank} under plan "
                f"{self._digest.hex()[:12]} (sharded state loads under the same plan and rank).")
        saved = state_dict["state"]
        for i, p in enumerate(self._params):
            if p not in self.state:
                continue
            mine, theirs = self.state[p], saved[i]
            for k, v in mine.items():
                if isinstance(v, dict):
                    for kk, vv in v.items():
                        vv.copy_(theirs[k][kk])
                else:
                    v.copy_(theirs[k])
        for g, sg in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        # fp32 main copies: the saved ones, else (saved without them) from the parameters.
        saved_main = meta.get("main_params")
        if saved_main is None:
            self.reload_main_params()
        else:
            with torch.no_grad():
                for m, sm in zip(self._main, saved_main):
                    if m is not None and sm is not None:
                        m.copy_(sm)
