"""The owned updates of one step (DP phases 3 and 4) and the state they need.

Each rank updates only its work order (``schedule.WorkOrder``): whole matrices with the matrix
kernel (Muon, Shampoo, SOAP; same shapes batched by the kernel across buckets) and its pieces of
AdamW tensors with AdamW. With fp32 main copies (``main_params="fp32"``) the kernels update the
copies and the results are cast into the parameter buffer, which the all-gather then sends.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.runtime.schedule import MatrixTask, WorkOrder
from canzona.runtime.storage.buffers import BucketBuffers


def init_owned_state(work: WorkOrder, params: list[Tensor], state: MutableMapping[Tensor, Any],
                     matrix: Any, adamw: Any, device: torch.device) -> None:
    """fp32 state for every owned matrix task (a split parameter's parts under their keys) and
    AdamW slice; nothing for what other ranks own."""
    for tasks in work.matrix:
        for t in tasks:
            st = matrix.init_state(t.shape, torch.float32, device)
            if t.part is None:
                state[params[t.param]] = st
            else:
                state[params[t.param]][t.part] = st
    for slices in work.adamw:
        for a in slices:
            state[params[a.param]] = adamw.init_state((a.hi - a.lo,), torch.float32, device)


def task_state(t: MatrixTask, params: list[Tensor], state: MutableMapping[Tensor, Any]) -> Any:
    st = state[params[t.param]]
    return st if t.part is None else st[t.part]


@torch.no_grad()
def matrix_directions(work: WorkOrder, buffers: Sequence[BucketBuffers], params: list[Tensor],
                      state: MutableMapping[Tensor, Any], matrix: Any,
                      received: Sequence[int]) -> dict[int, Tensor]:
    """Per owned matrix task id, its update direction from the averaged gradient in
    ``buffers[b].own``; tasks of parameters that no rank received a gradient for
    (``received[i] == 0``) are left out, and so are the pieces DP pairs share
    (``runtime.pairs``). One kernel call for all of them: same shapes are batched
    across buckets (a kernel that overlapped a running all-gather would compete with it for cores
    and memory bandwidth, and lose the batching)."""
    tasks = [t for ts in work.matrix for t in ts if received[t.param] and t.pair is None]
    if not tasks:
        return {}
    grads = [buffers[t.bucket].own[t.lo:t.hi].view(t.shape) for t in tasks]
    states = [task_state(t, params, state) for t in tasks]
    out = matrix.direction(grads, states, names=[t.name for t in tasks])
    return dict(zip((t.id for t in tasks), out))


@torch.no_grad()
def apply_bucket(bucket: int, work: WorkOrder, buf: BucketBuffers, params: list[Tensor],
                 state: MutableMapping[Tensor, Any], matrix: Any, adamw: Any,
                 directions: dict[int, Tensor], received: Sequence[int]) -> None:
    """Finish one bucket's owned updates: apply its matrices' directions and run AdamW on its
    owned AdamW elements; with main copies, cast the results into the parameter buffer (what the
    bucket's all-gather sends)."""
    main, own_params = buf.main, buf.own_params
    for t in work.matrix[bucket]:
        u = directions.get(t.id)
        if u is None:
            continue
        if main is None:
            p = params[t.param].view(-1, t.shape[1])[t.row0:t.row0 + t.shape[0]]
        else:
            p = main[t.lo:t.hi].view(t.shape)
        matrix.apply(p, u, full_shape=t.full_shape)  # lr, wd: the group's (synced)
        if main is not None:
            own_params[t.lo:t.hi].copy_(main[t.lo:t.hi])
    slices = [a for a in work.adamw[bucket] if received[a.param]]
    if slices:
        target = own_params if main is None else main
        adamw.step([target[a.lo:a.hi] for a in slices], [buf.own[a.lo:a.hi] for a in slices],
                   [state[params[a.param]] for a in slices], names=[a.name for a in slices])
        if main is not None:
            for a in slices:
                own_params[a.lo:a.hi].copy_(main[a.lo:a.hi])
