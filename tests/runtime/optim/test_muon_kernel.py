"""Muon kernel: parity with torch.optim.Muon, float32 path against float64, batching, shards."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from canzona.runtime.optim import Muon, MuonConfig, newton_schulz
from canzona.runtime.optim.muon import LR_SCALINGS, QUINTIC_COEFFICIENTS, adjust_lr
from optim_helpers import rel_err

# Square, tall and wide; repeated shapes make direction() take its batched path.
SHAPES = [(48, 48), (96, 32), (32, 80), (96, 32), (48, 48), (48, 48)]


def _run_pair(config: MuonConfig, shapes, steps: int = 20, seed: int = 0):
    """Run torch.optim.Muon and our kernel side by side; return (reference, ours) params."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone().requires_grad_() for p in init]
    ours = [p.clone() for p in init]
    ref_opt = torch.optim.Muon(
        ref,
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.momentum,
        nesterov=config.nesterov,
        ns_coefficients=config.ns_coefficients,
        eps=config.eps,
        ns_steps=config.ns_steps,
        adjust_lr_fn=config.adjust_lr_fn,
    )
    opt = Muon(config)
    states = [opt.init_state(p.shape, p.dtype) for p in ours]
    for _ in range(steps):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        assert opt.step(ours, grads, states) == []
    return [p.detach() for p in ref], ours


def test_defaults_equal_torch_muon():
    sig = inspect.signature(torch.optim.Muon).parameters
    cfg = MuonConfig()
    for name in (
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "eps",
        "ns_steps",
        "adjust_lr_fn",
    ):
        assert getattr(cfg, name) == sig[name].default, name
    assert cfg.ns_dtype == torch.bfloat16


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_bf16_path_bitwise_equal_to_torch_muon(adjust_lr_fn):
    cfg = MuonConfig(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    ref, ours = _run_pair(cfg, SHAPES)
    for r, p, shape in zip(ref, ours, SHAPES):
        assert rel_err(p, r) <= 1e-6, shape
        assert torch.equal(p, r), f"{shape}: not bitwise equal to torch.optim.Muon"


def test_plain_momentum_no_decay_equal_to_torch_muon():
    cfg = MuonConfig(lr=0.01, weight_decay=0.0, momentum=0.9, nesterov=False, ns_steps=3)
    ref, ours = _run_pair(cfg, [(40, 24), (24, 40)], steps=10, seed=1)
    for r, p in zip(ref, ours):
        assert torch.equal(p, r)


def _ns_float64(x: torch.Tensor, schedule, eps: float) -> torch.Tensor:
    """A plain float64 Newton–Schulz, written independently of the kernel."""
    x = x.double()
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / max(float(x.norm()), eps)
    for a, b, c in schedule:
        A = x @ x.T
        x = a * x + (b * A + c * (A @ A)) @ x
    return x.T if transpose else x


@pytest.mark.parametrize("coefficients", ["default", "quintic"])
@pytest.mark.parametrize("shape", [(64, 64), (96, 40), (40, 96)])
def test_float32_newton_schulz_matches_float64(shape, coefficients):
    kwargs = {} if coefficients == "default" else {"ns_coefficients": "quintic"}
    cfg = MuonConfig(ns_dtype=torch.float32, **kwargs)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen)
    ours = newton_schulz(x, cfg.schedule, eps=cfg.eps, dtype=torch.float32)
    assert ours.dtype == torch.float32
    assert rel_err(ours, _ns_float64(x, cfg.schedule, cfg.eps)) <= 5e-6
    # And the same iteration in float64 through the kernel agrees to round-off.
    ours64 = newton_schulz(x.double(), cfg.schedule, eps=cfg.eps, dtype=torch.float64)
    assert rel_err(ours64, _ns_float64(x, cfg.schedule, cfg.eps)) <= 1e-12


def test_float32_path_20_steps_matches_float64_optimizer():
    cfg = MuonConfig(lr=0.02, ns_dtype=torch.float32)
    shapes = [(48, 48), (96, 32), (32, 80)]
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.double() for p in params]
    bufs = [torch.zeros_like(p) for p in ref]
    opt = Muon(cfg)
    states = [opt.init_state(p.shape) for p in params]
    for _ in range(20):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        opt.step(params, grads, states)
        for p, b, g in zip(ref, bufs, grads):
            g = g.double()
            b.mul_(cfg.momentum).add_(g, alpha=1 - cfg.momentum)
            u = _ns_float64(g + cfg.momentum * (b - g), cfg.schedule, cfg.eps)
            p.mul_(1 - cfg.lr * cfg.weight_decay)
            p.add_(u, alpha=-cfg.lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)
    for p, r in zip(params, ref):
        assert rel_err(p, r) <= 1e-6


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 56), (56, 24)])
def test_batched_direction_equals_per_matrix(shape, ns_dtype):
    opt = Muon(MuonConfig(ns_dtype=ns_dtype))
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(shape, generator=gen) for _ in range(5)]
    batched_states = [opt.init_state(shape) for _ in grads]
    single_states = [opt.init_state(shape) for _ in grads]
    for _ in range(3):
        batched = opt.direction(grads, batched_states)
        single = [opt.direction([g], [s])[0] for g, s in zip(grads, single_states)]
        for b, s in zip(batched, single):
            assert b.shape == shape and b.dtype == ns_dtype
            assert torch.equal(b, s)
        grads = [g.flip(0) for g in grads]
    for b, s in zip(batched_states, single_states):
        assert torch.equal(b["momentum_buffer"], s["momentum_buffer"])


def test_mixed_shapes_are_grouped_in_order():
    opt = Muon(MuonConfig(ns_dtype=torch.float32))
    gen = torch.Generator().manual_seed(5)
    shapes = [(16, 32), (32, 16), (16, 32), (8, 8), (32, 16)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    together = opt.direction(grads, [opt.init_state(s) for s in shapes])
    alone = [opt.direction([g], [opt.init_state(g.shape)])[0] for g in grads]
    for t, a in zip(together, alone):
        assert torch.equal(t, a)


def test_a_per_step_list_repeats_its_last_step_and_a_longer_one_is_cut():
    cfg = MuonConfig(ns_coefficients="quintic", ns_steps=7)
    assert cfg.schedule == QUINTIC_COEFFICIENTS + (QUINTIC_COEFFICIENTS[-1],) * 2
    assert MuonConfig(ns_coefficients="quintic", ns_steps=3).schedule == QUINTIC_COEFFICIENTS[:3]
    assert MuonConfig(ns_coefficients=((1.0, 2.0, 3.0), (4.0, 5.0, 6.0)),
                      ns_steps=4).schedule == ((1.0, 2.0, 3.0),) + ((4.0, 5.0, 6.0),) * 3
    assert MuonConfig(ns_coefficients="simple", ns_steps=4).schedule == (
        MuonConfig().schedule[0],) * 4


def test_an_unknown_schedule_or_scaling_names_the_choices():
    with pytest.raises(ValueError) as e:
        MuonConfig(ns_coefficients="polar")
    assert "simple, quintic, polar_express" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        MuonConfig(adjust_lr_fn="spectral_norm")
    for name in LR_SCALINGS:
        assert name in str(e.value)


@pytest.mark.parametrize("ns_steps", [5, 10])
@pytest.mark.parametrize("name,theirs", [("simple", "original"), ("quintic", "quintic"),
                                         ("polar_express", "polar_express")])
@pytest.mark.parametrize("shape", [(64, 40), (40, 96)])
def test_named_schedules_equal_pytorch_optimizers(name, theirs, ns_steps, shape):
    """pytorch-optimizer's quintic Newton–Schulz with the same named coefficients (its safety
    factor 1: the Frobenius norm, as torch.optim.Muon) and its rule for a short list."""
    matrix = pytest.importorskip("pytorch_optimizer.optimizer.utils.matrix")
    cfg = MuonConfig(ns_coefficients=name, ns_steps=ns_steps, ns_dtype=torch.float32)
    theirs_steps = [tuple(w) for w in matrix.get_newton_schulz_weights(theirs)]
    assert list(cfg.schedule) == [theirs_steps[min(i, len(theirs_steps) - 1)]
                                  for i in range(ns_steps)]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    ours = newton_schulz(x, cfg.schedule, eps=cfg.eps, dtype=torch.float32)
    ref = matrix.zero_power_via_newton_schulz_5(x, num_steps=ns_steps, eps=cfg.eps,
                                                weights=theirs, dtype=torch.float32)
    assert rel_err(ours, ref) <= 1e-5


@pytest.mark.parametrize("name,formula", [
    (None, lambda m, n: max(1, m / n) ** 0.5),
    ("original", lambda m, n: max(1, m / n) ** 0.5),
    ("match_rms_adamw", lambda m, n: 0.2 * max(m, n) ** 0.5),
    ("spectral", lambda m, n: max(m, n) ** 0.5),
    ("shape_scaling", lambda m, n: max(1, m / n) ** 0.5),
    ("unit_rms_norm", lambda m, n: (m / n) ** 0.5),
])
@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (48, 48)])
def test_each_scaling_is_its_formula_and_scales_the_update(name, formula, shape):
    assert adjust_lr(0.02, name, shape) == pytest.approx(0.02 * formula(*shape), rel=1e-12)
    # the kernel applies it: one step from zero momentum and weights, no weight decay, against
    # the same step at lr 1 under unit_rms_norm
    g = torch.randn(shape, generator=torch.Generator().manual_seed(8))

    def step(lr: float, scaling: str | None) -> torch.Tensor:
        opt = Muon(MuonConfig(lr=lr, weight_decay=0.0, adjust_lr_fn=scaling,
                              ns_dtype=torch.float32))
        p = torch.zeros(shape)
        opt.step([p], [g], [opt.init_state(shape)])
        return p

    ratio = float(step(0.02, name).norm() / step(1.0, "unit_rms_norm").norm())
    assert ratio == pytest.approx(0.02 * formula(*shape) / (shape[0] / shape[1]) ** 0.5,
                                  rel=1e-5)


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("shape,dim", [((96, 32), 0), ((96, 32), 1), ((32, 96), 1)])
def test_apply_on_tp_shards_equals_whole(shape, dim, adjust_lr_fn):
    opt = Muon(MuonConfig(adjust_lr_fn=adjust_lr_fn))
    gen = torch.Generator().manual_seed(6)
    param = torch.randn(shape, generator=gen)
    update = opt.direction([torch.randn(shape, generator=gen)], [opt.init_state(shape)])[0]
    whole = param.clone()
    opt.apply(whole, update, lr=0.05, weight_decay=0.1)
    shards = [s.clone() for s in param.chunk(4, dim=dim)]
    for s, u in zip(shards, update.chunk(4, dim=dim)):
        opt.apply(s, u, lr=0.05, weight_decay=0.1, full_shape=shape)
    assert torch.equal(torch.cat(shards, dim=dim), whole)
