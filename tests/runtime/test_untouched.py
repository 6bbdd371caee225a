"""A parameter no rank produced a gradient for is left alone, as the single-device optimizer
leaves a parameter whose ``grad`` is None: no update and no weight decay, for a matrix (Muon)
and an AdamW parameter alike."""

from __future__ import annotations

import torch

import canzona
import dp_helpers as H
from canzona.runtime.optimizer import CanzonaOptimizer


class _WithUnused(H.TinyGPT):
    def __init__(self) -> None:
        super().__init__(spare=True)  # ``spare``: a matrix the forward never uses
        self.unused_scale = torch.nn.Parameter(torch.ones(H.DIM))  # an AdamW one, unused too


def test_parameters_without_gradient_are_not_updated_nor_decayed():
    model = _WithUnused()
    opt = CanzonaOptimizer(model, canzona.plan_model(model, dp=1, bucket_size=3000),
                           weight_decay=0.1, adamw_weight_decay=0.1, ns_dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        x, y = H.batch(step, 0, 1)
        H.loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    after = dict(model.named_parameters())
    for name in ("spare.weight", "unused_scale"):
        assert torch.equal(after[name], before[name]), name
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    opt.close()
