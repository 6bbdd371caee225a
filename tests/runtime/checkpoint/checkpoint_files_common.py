"""One-process TinyGPT training (dp 1, no process group) for the checkpoint file tests and the
crash worker."""

from __future__ import annotations

import torch

import dp_helpers as H


def build(*, seed: int = 0, optimizer: str = "muon", dtype: torch.dtype = torch.float32,
          main_params: str | None = None, bucket_size: int = 3000):
    import canzona

    model = H.TinyGPT(seed=seed, spare=False).to(dtype)
    plan = canzona.plan_model(model, dp=1, optimizer=optimizer, bucket_size=bucket_size,
                              **H.plan_settings(optimizer))
    opt = canzona.CanzonaOptimizer(
        model, plan, lr=H.MATRIX_LR[optimizer], ns_dtype=torch.float32, adamw_lr=H.ADAMW_LR,
        adamw_weight_decay=0.01, main_params=main_params,
        matrix_options=H.SHAMPOO_OPTIONS if optimizer == "shampoo" else None)
    return model, opt


def train(model, opt, steps) -> None:
    for step in steps:
        x, y = H.batch(step, 0, 1)
        H.loss_fn(model, x, y).float().backward()
        opt.step()
        opt.zero_grad()


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
