"""Bytes: the optimizer state a plan predicts (``predicted_state_bytes``; with the kernels in
use, ``kernel_state_bytes``), the state an optimizer holds (``measured_state_bytes``) and the
bytes its collectives send (``comm_bytes``)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from canzona.planner import comm as comm_model
from canzona.planner import formulas
from canzona.planner.heads import head_places
from canzona.planner.plan import Plan
from canzona.runtime.checks import check_main_params
from canzona.runtime.introspect import local_tensor

__all__ = ["predicted_state_bytes"]

#: Optimizer state is kept in fp32, step counters included.
STATE_BYTES = 4


def predicted_state_bytes(plan: Plan, dp_rank: int, *, tp_rank: int = 0,
                          main_params: str | None = None) -> int:
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

    Under TP (``tp_rank`` of DP index ``dp_rank``): a TP-split matrix task's (full-matrix) state
    counts on its host only, a shared one's on every TP rank (the state of its shard: Muon's
    momentum by rows, one TP-th; Shampoo's blocks shard by shard), an attention head's (split
    per head) on the TP rank whose shard holds it, a replicated matrix task's whole on every TP
    rank, and the AdamW fragments are those of the rank's own local slices.

    Raises:
        ValueError: ``main_params``, ``dp_rank`` or ``tp_rank`` is not allowed.
    """
    check_main_params(main_params)
    if (isinstance(tp_rank, bool) or not isinstance(tp_rank, numbers.Integral)
            or not 0 <= tp_rank < plan.inputs.tp):
        raise ValueError(f"tp_rank = {tp_rank!r} is not allowed; choose 0 … {plan.inputs.tp - 1}")
    if (isinstance(dp_rank, bool) or not isinstance(dp_rank, numbers.Integral)
            or not 0 <= dp_rank < plan.inputs.dp):
        raise ValueError(f"dp_rank = {dp_rank!r} is not allowed; choose 0 … {plan.inputs.dp - 1}")
    dp_rank = int(dp_rank)
    matrix = {t.param for t in plan.tasks if t.optimizer == "matrix"}
    shared = ({x.id: x for ix in plan.tp.indices for x in ix.shared} if plan.tp is not None
              else {})
    pairs = {x.id: x for x in plan.dp_shared}
    heads = (head_places(plan.tasks, plan.inputs.tp)
             if plan.inputs.optimizer.records_heads and plan.inputs.tp > 1 else {})
    total = sum(_shared_state(plan, t, shared[t.id]) if t.id in shared else t.state_bytes
                for t in plan.tasks if t.optimizer == "matrix" and t.owner == dp_rank
                and (t.host is None or t.host == tp_rank) and t.id not in pairs
                and heads.get(t.id, (tp_rank,))[0] == tp_rank)
    for x in pairs.values():  # split over two DP indices: each holds its piece's state (at
        if dp_rank in x.owners:  # tp > 1 its rows of every shard: one TP-th on each TP rank)
            total += x.state_bytes[x.owners.index(dp_rank)] // plan.inputs.tp
    return total + adamw_and_main_bytes(plan, dp_rank, matrix, main_params)


def _shared_state(plan: Plan, t: Any, x: Any) -> int:
    """One TP rank's state of a task its TP group shares (``x``, its entry in the plan): the
    optimizer's state of its shard (Muon's momentum, one TP-th; NorMuon's adds its rows'
    moments, every row's for a row-parallel shard; Shampoo's blocks, moments and a step counter
    of its own), as the planner's registry counts a matrix's state."""
    assert plan.tp is not None
    m, n = plan.tp.layouts[x.layout].local_shape
    st = plan.inputs.optimizer
    return STATE_BYTES * st.spec.state_numel(m, n, st)


def adamw_and_main_bytes(plan: Plan, d: int, matrix: set[str], main_params: str | None) -> int:
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
                    total += STATE_BYTES * formulas.adamw_state_numel(k)
    return total


def kernel_state_bytes(plan: Plan, rank: int, work: Any, matrix_names: set[str], kernel: Any,
                       micro: Any, main_params: str | None) -> int:
    """:func:`predicted_state_bytes` of DP rank ``rank`` with the state of each matrix task it
    owns (``work``: its work order), hosts or shares over TP (``micro``: its
    ``MicroGroupRunner``) taken from ``kernel``, the matrix kernel in use (exact also when its
    options change Shampoo's state layout)."""
    total = sum(STATE_BYTES * kernel.state_numel(t.shape) for ts in work.matrix for t in ts)
    total += sum(STATE_BYTES * kernel.state_numel(t.full_shape)
                 for t in micro.hosted)  # tp > 1: the full matrices hosted here
    total += sum(STATE_BYTES * kernel.state_numel(x.local_shape)
                 for x in micro.shared)  # and this rank's shard of the shared ones
    return total + adamw_and_main_bytes(plan, rank, matrix_names, main_params)


def measured_state_bytes(state: Mapping[Any, Mapping[str, Any]],
                         main: Iterable[Tensor | None]) -> int:
    """Bytes of every tensor in an optimizer's ``state`` (one level of nested dicts: the parts of
    a split parameter; a DTensor's local tensor) and of the fp32 main copies."""
    total = sum(m.numel() * m.element_size() for m in main if m is not None)
    for st in state.values():
        for v in st.values():
            for t in (v.values() if isinstance(v, dict) else (v,)):
                t = local_tensor(t)
                total += t.numel() * t.element_size()
    return total


def comm_bytes(methods: Sequence[str], sizes: Sequence[tuple[int, ...]],
               rank: int | Sequence[int], *, grad_bytes: Sequence[int],
               param_bytes: Sequence[int], external: bool) -> dict[str, int]:
    """Bytes one rank sends per step: per bucket (its collective method and slice sizes), what
    the planner's communication model has rank ``rank`` send in the reduce
    (:func:`canzona.planner.comm.reduce_traffic`, ring for equal/padded — padding included —,
    chain per root for per_root, ring all-reduce for all_reduce, direct sends for all_to_all)
    and in the gather (:func:`~canzona.planner.comm.gather_traffic`), summed over the buckets.
    ``grad_bytes``/``param_bytes``: element sizes per bucket. ``external``: the gradients are
    reduced outside the optimizer (no reduce). One rank (``local``) sends nothing. ``rank``:
    the rank's place in every bucket's group, or per bucket (an expert bucket's is its
    expert-DP rank)."""
    ranks = [rank] * len(methods) if isinstance(rank, int) else list(rank)
    rs = ag = 0
    for method, s, ge, pe, r in zip(methods, sizes, grad_bytes, param_bytes, ranks):
        if len(s) == 1:  # dp = 1 ("local"): nothing moves
            continue
        if not external:
            rs += comm_model.reduce_traffic(method, s, ge).sent[r]
        ag += comm_model.gather_traffic(method, s, pe).sent[r]
    return {"reduce_scatter": rs, "all_gather": ag}
