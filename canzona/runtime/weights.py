"""The DP ranks' weights at construction: checked equal, or broadcast from DP rank 0.

Every DP rank must start from the same weights (under TP: the same shards at the same TP rank):
ZeRO-1 updates each slice on its owner and all-gathers it, so ranks seeded differently train on
different models until the first all-gather overwrites them, without a word. A cheap digest
catches it: per parameter, the float64 sum of its elements and of every seventh one, compared
across the DP group by one MAX all-reduce of the digests and their negatives (max = −max(−x)
holds only where every rank agrees). ``sync_init=True`` broadcasts DP rank 0's weights instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.errors import WeightsDifferError

__all__ = ["agree_weights", "broadcast_weights"]

#: Stands in for a NaN in a digest, so that ranks holding the same NaN weights agree.
_NAN = 1.0e300


@torch.no_grad()
def digests(params: Sequence[Tensor], device: torch.device) -> Tensor:
    """Two float64 numbers per parameter (see the module docstring), on ``device``."""
    out = torch.zeros(2 * len(params), dtype=torch.float64, device=device)
    for i, p in enumerate(params):
        flat = p.detach().reshape(-1)
        out[2 * i] = flat.sum(dtype=torch.float64)
        out[2 * i + 1] = flat[::7].sum(dtype=torch.float64)
    return torch.nan_to_num(out, nan=_NAN)


@torch.no_grad()
def agree_weights(params: Sequence[Tensor], names: Sequence[str], *, size: int, group: Any,
                  device: torch.device) -> None:
    """Raise :class:`WeightsDifferError` on every rank of the DP ``group`` (``size`` ranks) when
    any parameter's digest differs between them; one all-reduce."""
    if size == 1 or not params:
        return
    mine = digests(params, device)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[:mine.numel()], -both[mine.numel():]
    differs = torch.nonzero(high != low).flatten().tolist()
    if differs:
        name = names[differs[0] // 2]
        count = len({k // 2 for k in differs})
        raise WeightsDifferError(
            f"the DP ranks hold different weights: '{name}' differs between them "
            f"({count} parameter(s) in all). Seed every rank alike before building the model "
            "(torch.manual_seed), load the same checkpoint on every rank, or pass "
            "CanzonaOptimizer(..., sync_init=True) to start every rank from DP rank 0's weights.")


@torch.no_grad()
def broadcast_weights(params: Sequence[Tensor], *, size: int, group: Any) -> None:
    """Every parameter from DP rank 0 of ``group`` to the others, in place."""
    if size == 1:
        return
    for p in params:
        dist.broadcast(p.detach(), group=group, group_src=0)
