"""``clip_grad_norm_`` as ``torch.nn.utils.clip_grad_norm_``: it returns the global norm, scales
the gradients down to ``max_norm`` when they are above it and never scales them up."""

from __future__ import annotations

import pytest
import torch

import canzona
import dp_helpers as H
from canzona.runtime.optimizer import CanzonaOptimizer


def _backward(model: torch.nn.Module) -> None:
    x, y = H.batch(0, 0, 1)
    H.loss_fn(model, x, y).backward()


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clipping_returns_the_norm_scales_down_and_never_up(norm_type):
    ref = H.TinyGPT(spare=False)
    _backward(ref)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"), norm_type=norm_type)
    model = H.TinyGPT(spare=False)
    opt = CanzonaOptimizer(model, canzona.plan_model(model, dp=1, bucket_size=3000))
    _backward(model)
    first = opt.clip_grad_norm_(1e6, norm_type)  # far above the norm: nothing changes
    assert float(first) == pytest.approx(float(want), rel=1e-6)
    again = opt.clip_grad_norm_(1e6, norm_type)
    assert float(again) == pytest.approx(float(first), rel=1e-6), "scaled up below max_norm"
    opt.clip_grad_norm_(float(first) / 2, norm_type)  # above max_norm: down to it
    halved = float(opt.clip_grad_norm_(1e6, norm_type))
    # max_norm / (norm + 1e-6), as torch: the 1e-6 shows at this small norm
    assert halved == pytest.approx(float(first) / 2, rel=1e-4)
    opt.close()
