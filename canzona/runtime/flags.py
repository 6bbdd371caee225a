"""What every rank agrees about the averaged gradients of a step, after the reductions: which
parameters got a gradient on any rank (``GradientCollector.received_anywhere``), which DP ranks
produced no gradient at all while others did (a skipped backward: every rank raises), which
hold NaN or Inf on any rank, and what the non-finite policy then does with those, alike on
every rank."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.errors import NonFiniteSkipWarning, UnevenBackwardError
from canzona.runtime.optim._base import NonFiniteGradientError
from canzona.runtime.schedule import WorkOrder
from canzona.runtime.storage.buffers import BucketBuffers
from canzona.runtime.storage.gradients import GradientCollector
from canzona.runtime.waits import wait_for


def device_of_group(group: Any) -> torch.device:
    """Where a rank without parameters (a pipeline stage holding none) keeps the tensors of its
    collectives: the current CUDA device under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and torch.cuda.is_available() \
            and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(t: Tensor, *, dp: int, group: Any, tp: int, tp_group: Any, flight: Any,
                   timeout_s: float | None, rank: int) -> None:
    """MAX all-reduce of ``t`` over the DP group, then the TP group (each only when it has more
    than one rank), each recorded in the flight table and waited for under ``timeout_s``."""
    for size, g, name in ((dp, group, "DP"), (tp, tp_group, "TP")):
        if size > 1:
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g, async_op=True)
            what = (f"the {name} all-reduce of the per-parameter gradient flags (after the "
                    "reduce-scatters)")
            if flight is not None:
                flight.add(what, work)
            wait_for(work, what, timeout_s, rank)


def agree(grads: GradientCollector, buffers: Sequence[BucketBuffers], work: WorkOrder,
          params: list[Tensor], reduce_max: Callable[[Tensor], None], *, rank: int,
          size: int, positions: tuple[Sequence[int], int] | None = None
          ) -> tuple[list[int], list[int]]:
    """Per parameter, whether any rank got a gradient for it (into ``grads.received_anywhere``),
    per DP rank whether it got any gradient (this rank ``rank`` of ``size``), and per bucket
    whether any rank's averaged slice holds NaN or Inf: one MAX all-reduce (``reduce_max``) and
    one copy to the host. Only when a bucket is non-finite somewhere, a second all-reduce names
    the parameters. Returns (the non-finite parameters, the DP ranks that got no gradient while
    others did), the same on every rank.

    ``positions``: under expert parallelism, each parameter's place among the plan's ``total``
    parameters, ``(places, total)``: the flags are laid out so, so that another EP rank's
    experts never stand in for this rank's."""
    n = len(params)
    device = params[0].device if params else device_of_group(None)
    if positions is not None:
        places, total = positions
        where = torch.tensor(list(places), dtype=torch.long)

        def spread(x: Tensor) -> Tensor:
            out = torch.zeros(total, dtype=x.dtype)
            out[where] = x.cpu()
            return out.to(x.device)

        def gather(x: list[int]) -> list[int]:
            return [x[k] for k in places]
    else:
        def spread(x: Tensor) -> Tensor:
            return x

        def gather(x: list[int]) -> list[int]:
            return x
        total = n
    finite = [torch.isfinite(b.own).all() for b in buffers if b.own.numel()]
    bad_bucket = (~torch.stack(finite)).any().to(torch.int32).reshape(1) if finite else \
        torch.zeros(1, dtype=torch.int32, device=device)
    had = torch.zeros(size, dtype=torch.int32)
    had[rank] = int(bool(grads.received.any()))
    flags = torch.cat([spread(grads.received), had]).to(device)
    flags = torch.cat([flags, bad_bucket.to(device)])
    reduce_max(flags)
    flags = flags.cpu().tolist()
    grads.received_anywhere = gather(flags[:total])
    ranks = flags[total:total + size]
    missing = [r for r, x in enumerate(ranks) if not x] if any(ranks) else []
    if missing or not flags[total + size]:
        return [], missing
    bad = torch.zeros(n, dtype=torch.int32)
    for bi, buf in enumerate(buffers):
        for x in own_pieces(work, bi):
            if not bool(torch.isfinite(buf.own[x.lo:x.hi]).all()):
                bad[x.param] = 1
    bad = spread(bad).to(device)
    reduce_max(bad)
    return [i for i, f in enumerate(gather(bad.cpu().tolist())) if f], []


def apply_policy(agreed: tuple[list[int], list[int]], *, grads: GradientCollector,
                 buffers: Sequence[BucketBuffers], work: WorkOrder, names: list[str],
                 matrix_params: Collection[int], matrix: Any, adamw: Any,
                 reset: Callable[[], None]) -> None:
    """The same decision on every rank from what :func:`agree` found. DP ranks without any
    gradient while others had some: every rank raises ``UnevenBackwardError`` naming them.
    Parameters whose averaged gradient holds NaN or Inf anywhere: under ``nonfinite="raise"``
    (the kernels' default) every rank raises ``NonFiniteGradientError`` naming them; under
    ``"skip"`` every rank leaves them alone this step (their owners do not update them; the
    all-gathers send them unchanged). Both raise before anything is updated, after ``reset``
    drops the gradients, so the next step starts clean."""
    bad, missing = agreed
    if missing:
        reset()
        shown = ", ".join(map(str, missing[:16])) + (", …" if len(missing) > 16 else "")
        raise UnevenBackwardError(
            f"DP rank(s) {shown} produced no gradient this step while the others did, so the "
            "average would scale every gradient down: call loss.backward() on every rank before "
            "step() (a rank without data backpropagates a zero loss, e.g. "
            "(model(x).sum() * 0).backward()). The step's gradients were dropped.")
    if not bad:
        return
    matrix_set = set(matrix_params)

    def policy(i: int) -> str:
        kernel = matrix if i in matrix_set else adamw
        return getattr(getattr(kernel, "config", None), "nonfinite", "raise")

    raise_on = [i for i in bad if policy(i) == "raise"]
    if raise_on:
        reset()
        raise NonFiniteGradientError([names[i] for i in raise_on])
    received = list(grads.received_anywhere)
    skipped = set(bad)
    for i in bad:
        received[i] = 0  # as if no rank had a gradient for it: nobody updates it
    grads.received_anywhere = received
    # Their slices count as zero (a global norm for clipping stays finite).
    for bi, buf in enumerate(buffers):
        for x in own_pieces(work, bi):
            if x.param in skipped:
                buf.own[x.lo:x.hi].zero_()
    warnings.warn(f"skipped {len(bad)} parameter(s) with a non-finite gradient this step "
                  f"(nonfinite='skip'): " + ", ".join(names[i] for i in bad),
                  NonFiniteSkipWarning, stacklevel=3)


def verdict(agreed: tuple[list[int], list[int]], *, matrix_params: Collection[int],
            matrix: Any, adamw: Any) -> int:
    """What :func:`apply_policy` will do with ``agreed``, as a number the pipeline stages agree
    on (``runtime.stages``): 2 it raises for DP ranks without gradients, 1 for a non-finite
    gradient under ``nonfinite="raise"``, 0 it goes on (skipping what it skips)."""
    bad, missing = agreed
    if missing:
        return 2
    matrix_set = set(matrix_params)
    for i in bad:
        kernel = matrix if i in matrix_set else adamw
        if getattr(getattr(kernel, "config", None), "nonfinite", "raise") == "raise":
            return 1
    return 0


def own_pieces(work: WorkOrder, bucket: int) -> list:
    """This rank's pieces of bucket ``bucket``'s own slice: matrix tasks, AdamW slices and
    TP-split shards (each with ``param``, ``lo``, ``hi``)."""
    return [*(work.matrix[bucket] if bucket < len(work.matrix) else ()),
            *(work.adamw[bucket] if bucket < len(work.adamw) else ()),
            *(work.split[bucket] if bucket < len(work.split) else ())]
