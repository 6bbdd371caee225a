"""Shampoo kernel: blocks against a float64 dense computation, blocked against unblocked."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from canzona.runtime.optim import Shampoo, ShampooConfig
from canzona.runtime.optim.shampoo import inverse_root
from optim_helpers import rel_err


def _root_by_svd(a: torch.Tensor, eps: float) -> torch.Tensor:
    """(a + eps·I)^{-1/4} of a symmetric PSD float64 matrix via the SVD (not eigh)."""
    u, s, _ = torch.linalg.svd(a)
    return (u * (s + eps) ** -0.25) @ u.T


def test_inverse_root_is_a_fourth_root_of_the_inverse():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(20, 30, generator=gen, dtype=torch.float64)
    stat = g @ g.T
    x = inverse_root(stat, root=4, eps=1e-12)
    eye = torch.eye(20, dtype=torch.float64)
    assert torch.allclose(torch.linalg.matrix_power(x, 4) @ (stat + 1e-12 * eye), eye, atol=1e-9)
    assert rel_err(x, _root_by_svd(stat, 1e-12)) <= 1e-10


@pytest.mark.parametrize("betas", [(0.0, 1.0), (0.9, 0.99)], ids=["sum", "ema"])
def test_each_block_equals_dense_float64_preconditioned_grad(betas):
    # 80×48 with blocks ≤ 32: rows 32, 32, 16 × columns 32, 16 (remainder blocks included).
    shape, dim, eps = (80, 48), 32, 1e-12
    cfg = ShampooConfig(
        betas=betas, eps=eps, max_preconditioner_dim=dim, precondition_frequency=1, grafting=None
    )
    opt = Shampoo(cfg)
    state = opt.init_state(shape, torch.float64)
    gen = torch.Generator().manual_seed(1)
    beta1, beta2 = betas
    history = []
    for t in range(1, 6):
        grad = torch.randn(shape, generator=gen, dtype=torch.float64)
        history.append(grad)
        (direction,) = opt.direction([grad], [state])
        for _, _, rows, cols in opt.blocks(shape):
            gs = [h[rows, cols] for h in history]
            # Dense float64 reference, from the gradient history alone.
            w2 = [(1.0 if beta2 == 1.0 else (1 - beta2) * beta2 ** (t - 1 - s)) for s in range(t)]
            c2 = 1.0 if beta2 == 1.0 else 1 - beta2**t
            L = sum(w * g @ g.T for w, g in zip(w2, gs)) / c2
            R = sum(w * g.T @ g for w, g in zip(w2, gs)) / c2
            if beta1 > 0:
                m = sum((1 - beta1) * beta1 ** (t - 1 - s) * g for s, g in enumerate(gs)) / (
                    1 - beta1**t
                )
            else:
                m = gs[-1]
            expected = _root_by_svd(L, eps) @ m @ _root_by_svd(R, eps)
            assert rel_err(direction[rows, cols], expected) <= 1e-8, (t, rows, cols)


@pytest.mark.parametrize(
    "cfg",
    [
        ShampooConfig(
            max_preconditioner_dim=16,
            precondition_frequency=2,
            momentum=0.5,
            nesterov=True,
            weight_decay=0.1,
        ),
        ShampooConfig(max_preconditioner_dim=16, betas=(0.0, 0.95), grafting=None),
    ],
    ids=["grafted-momentum", "plain-ema"],
)
def test_blocked_equals_unblocked_on_every_block(cfg):
    # 40×28 with blocks ≤ 16: rows 16, 16, 8 × columns 16, 12.
    shape = (40, 28)
    blocked = Shampoo(cfg)
    whole_param = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    whole_state = blocked.init_state(shape)
    tiles = blocked.blocks(shape)
    assert len(tiles) == 6
    unblocked = Shampoo(ShampooConfig(**{**_fields(cfg), "max_preconditioner_dim": 1024}))
    parts = [whole_param[r, c].clone() for _, _, r, c in tiles]
    part_states = [unblocked.init_state(p.shape) for p in parts]
    gen = torch.Generator().manual_seed(3)
    start = whole_param.clone()
    for _ in range(7):
        grad = torch.randn(shape, generator=gen)
        blocked.step([whole_param], [grad], [whole_state], lr=0.01)
        unblocked.step(
            parts, [grad[r, c].contiguous() for _, _, r, c in tiles], part_states, lr=0.01
        )
    for (_, _, r, c), part in zip(tiles, parts):
        assert rel_err(whole_param[r, c] - start[r, c], part - start[r, c]) <= 2e-6
    assert rel_err(whole_param, start) > 1e-3


def _fields(cfg: ShampooConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if not f.startswith("_")}


def test_roots_recomputed_only_every_precondition_frequency_steps():
    opt = Shampoo(ShampooConfig(precondition_frequency=3, max_preconditioner_dim=8))
    state = opt.init_state((8, 8))
    gen = torch.Generator().manual_seed(4)
    seen = []
    for _ in range(7):
        opt.direction([torch.randn(8, 8, generator=gen)], [state])
        seen.append(state["L_root.0.0"].clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    # Roots are computed at steps 1, 4, 7: they change going into steps 4 and 7 only.
    assert changed == [False, False, True, False, False, True]


def test_block_rows_apart_are_the_whole_kernel_bit_for_bit():
    """A matrix's runs of whole block rows preconditioned as matrices of their
    own (what two DP ranks do when the plan hosts a Shampoo matrix's blocks apart) give exactly
    the whole matrix's update: blocks, their statistics and grafting are independent."""
    import torch

    from canzona.runtime.optim import Shampoo, ShampooConfig

    k = Shampoo(ShampooConfig(lr=0.01, precondition_frequency=3, eps=1e-4, momentum=0.5,
                              max_preconditioner_dim=32))
    g = torch.Generator().manual_seed(0)
    whole, top, bottom = k.init_state((112, 40)), k.init_state((64, 40)), k.init_state((48, 40))
    for _ in range(7):
        grad = torch.randn(112, 40, generator=g)
        want = k.direction([grad], [whole])[0]
        a, b = k.direction([grad[:64].clone(), grad[64:].clone()], [top, bottom])
        assert torch.equal(torch.cat([a, b]), want)
