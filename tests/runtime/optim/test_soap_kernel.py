"""SOAP kernel against pytorch_optimizer.SOAP (a port of the authors' code).

pytorch-optimizer ≥ 4 is needed: 3.x computes the bias correction and the basis-refresh schedule
from a step count one ahead of the authors' code (github.com/nikhilvyas/SOAP).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from canzona.runtime.optim import SOAP, SOAPConfig
from optim_helpers import rel_err

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

# Square, tall, wide; the last two have one side above max_precond_dim=45 (identity basis).
SHAPES = [(24, 24), (40, 16), (12, 30), (20, 50), (50, 20)]


def _reference(params, cfg: SOAPConfig):
    # Settings that make the port compute the paper's algorithm on 2-D matrices: no dimension
    # merging, no gradient normalisation, bias correction on, shampoo_beta defaulting to beta2.
    return pytorch_optimizer.SOAP(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        shampoo_beta=cfg.shampoo_beta,
        weight_decay=cfg.weight_decay,
        precondition_frequency=cfg.precondition_frequency,
        max_precondition_dim=cfg.max_precond_dim,
        merge_dims=False,
        precondition_1d=False,
        correct_bias=cfg.correct_bias,
        normalize_gradient=False,
        eps=cfg.eps,
    )


@pytest.mark.parametrize(
    "cfg",
    [
        SOAPConfig(precondition_frequency=3, max_precond_dim=45),  # 6 basis refreshes in 20 steps
        SOAPConfig(
            lr=1e-2, betas=(0.9, 0.99), shampoo_beta=0.9, weight_decay=0.1, max_precond_dim=45
        ),
    ],
    ids=["f3", "f10-custom-betas"],
)
def test_20_steps_match_pytorch_optimizer_soap(cfg):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in init]
    ours = [p.clone() for p in init]
    ref_opt = _reference(ref, cfg)
    opt = SOAP(cfg)
    states = [opt.init_state(p.shape) for p in ours]
    for step in range(20):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        untouched = opt.step(ours, grads, states)
        # The first step only builds the preconditioner, as the reference does.
        assert untouched == (list(range(len(SHAPES))) if step == 0 else [])
    for r, p, shape in zip(ref, ours, SHAPES):
        assert rel_err(p, r) <= 1e-5, shape
        # Sharper: the accumulated change itself (≈ 2 % of the parameter) agrees to 1e-4.
        start = init[SHAPES.index(shape)]
        assert rel_err(p - start, r - start) <= 1e-4, shape


def test_first_step_builds_orthonormal_bases_and_leaves_param():
    opt = SOAP(SOAPConfig(max_precond_dim=40))
    param = torch.randn(30, 50)
    before = param.clone()
    state = opt.init_state(param.shape)
    assert set(state) == {"exp_avg", "exp_avg_sq", "GG_L", "Q_L", "step"}
    assert opt.step([param], [torch.randn(30, 50)], [state]) == [0]
    assert torch.equal(param, before)
    q = state["Q_L"]
    assert torch.allclose(q.T @ q, torch.eye(30), atol=1e-5)
    # Columns by decreasing eigenvalue.
    eig = (q * (state["GG_L"] @ q)).sum(0)
    assert bool((eig[:-1] >= eig[1:] - 1e-6).all())
    assert float(state["step"]) == 1.0
