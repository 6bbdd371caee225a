"""Flat per-bucket buffers: the parameters (live parameters become views of them), the gradient
accumulator, this rank's reduced gradient slice and, under ``main_params="fp32"``, the fp32 main
copy of this rank's slice of a bf16/fp16 bucket. All allocated once, at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.schedule import Schedule

GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(eq=False)
class BucketBuffers:
    """One bucket's tensors on this rank."""

    params: Tensor  # bucket.numel elements in the parameters' dtype; parameters are views of it
    grads: Tensor  # bucket.numel elements in the grad dtype (empty under grad_sync="external")
    own: Tensor  # this rank's slice of the averaged gradient
    main: Tensor | None  # fp32 copy of this rank's slice of ``params`` (main_params="fp32")
    own_lo: int  # this rank's slice is [own_lo, own_hi) of the bucket
    own_hi: int

    @property
    def own_params(self) -> Tensor:
        """This rank's slice of the parameter buffer (a view)."""
        return self.params[self.own_lo:self.own_hi]


@torch.no_grad()
def build_buffers(schedule: Schedule, params: list[Tensor], names: list[str], *,
                  external: bool, main_params: str | None) -> list[BucketBuffers]:
    """Allocate every bucket's buffers and turn the parameters into views of them (their values
    are copied in)."""
    out = []
    for b in schedule.buckets:
        p0 = params[b.slots[0].param]
        device = p0.device
        pbuf = torch.zeros(b.numel, dtype=p0.dtype, device=device)
        for sl in b.slots:
            p = params[sl.param]
            if p.dtype != p0.dtype:
                raise PlanMismatchError(f"parameter '{names[sl.param]}' is {p.dtype} but its "
                                        f"bucket holds {p0.dtype}.")
            view = pbuf[sl.lo:sl.hi].view_as(p)
            view.copy_(p)
            p.data = view
        lo, hi = schedule.own_range(b.index)
        low = main_params == "fp32" and pbuf.dtype != torch.float32
        gdtype = GRAD_DTYPES[b.grad_dtype]
        out.append(BucketBuffers(
            params=pbuf,
            grads=torch.zeros(0 if external else b.numel, dtype=gdtype, device=device),
            own=torch.zeros(hi - lo, dtype=gdtype, device=device),
            main=pbuf[lo:hi].float() if low else None,
            own_lo=lo, own_hi=hi))
    return out
