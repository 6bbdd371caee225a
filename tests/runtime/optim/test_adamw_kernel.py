"""AdamW kernel against torch.optim.AdamW, whole and in ZeRO-1 slices."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from canzona.runtime.optim import AdamW, AdamWConfig


@pytest.mark.parametrize(
    "cfg",
    [AdamWConfig(), AdamWConfig(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)],
    ids=["default", "custom"],
)
def test_20_steps_bitwise_equal_to_torch_adamw(cfg):
    gen = torch.Generator().manual_seed(0)
    shapes = [(64,), (12, 20), (3, 4, 5)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone().requires_grad_() for p in init]
    ours = [p.clone() for p in init]
    ref_opt = torch.optim.AdamW(
        ref, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    opt = AdamW(cfg)
    states = [opt.init_state(p.shape) for p in ours]
    for _ in range(20):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        assert opt.step(ours, grads, states) == []
    for r, p in zip(ref, ours):
        assert torch.equal(p, r.detach())


def test_defaults_equal_torch_adamw():
    import inspect

    sig = inspect.signature(torch.optim.AdamW).parameters
    cfg = AdamWConfig()
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert getattr(cfg, name) == sig[name].default, name


def test_slices_with_own_state_equal_whole():
    # A ZeRO-1 cut at an arbitrary element: each slice stepped with its own state.
    gen = torch.Generator().manual_seed(1)
    opt = AdamW(AdamWConfig(weight_decay=0.1))
    whole = torch.randn(1000, generator=gen)
    cut = whole.clone()
    parts = [cut[:337], cut[337:]]
    whole_state = [opt.init_state(whole.shape)]
    part_states = [opt.init_state(p.shape) for p in parts]
    for _ in range(5):
        g = torch.randn(1000, generator=gen)
        opt.step([whole], [g], whole_state)
        opt.step(parts, [g[:337], g[337:]], part_states)
    assert torch.equal(whole, cut)
