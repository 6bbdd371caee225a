"""Configs are keyword-only and validated: errors name the field, the value and the range."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from canzona.runtime.optim import AdamWConfig, Muon, MuonConfig, Shampoo, ShampooConfig, SOAPConfig

BAD = [
    (
        MuonConfig,
        {"momentum": 1.0},
        r"MuonConfig\.momentum = 1\.0 is out of range; allowed \[0\.0, 1\.0\)",
    ),
    (MuonConfig, {"lr": -1e-3}, r"MuonConfig\.lr = -0\.001 is out of range; allowed \[0\.0, inf\]"),
    (MuonConfig, {"eps": 0.0}, r"MuonConfig\.eps = 0\.0 is out of range; allowed \(0\.0, inf\]"),
    (
        MuonConfig,
        {"ns_steps": 100},
        r"MuonConfig\.ns_steps = 100 is out of range; allowed \[1, 99\]",
    ),
    (MuonConfig, {"ns_steps": 5.0}, r"MuonConfig\.ns_steps = 5\.0 must be an int"),
    (MuonConfig, {"adjust_lr_fn": "rms"}, r"MuonConfig\.adjust_lr_fn = 'rms' is not allowed"),
    (
        MuonConfig,
        {"ns_dtype": torch.float16},
        r"MuonConfig\.ns_dtype = torch\.float16 is not allowed",
    ),
    (
        MuonConfig,
        {"ns_coefficients": (1.0, 2.0)},
        r"MuonConfig\.ns_coefficients: \(1\.0, 2\.0\) is not a triple",
    ),
    (MuonConfig, {"nonfinite": "ignore"}, r"MuonConfig\.nonfinite = 'ignore' is not allowed"),
    (
        ShampooConfig,
        {"betas": (0.9, 0.0)},
        r"ShampooConfig\.betas\[1\] = 0\.0 is out of range; allowed \(0\.0, 1\.0\]",
    ),
    (
        ShampooConfig,
        {"max_preconditioner_dim": 0},
        r"ShampooConfig\.max_preconditioner_dim = 0 is out of range",
    ),
    (ShampooConfig, {"grafting": "sgd"}, r"ShampooConfig\.grafting = 'sgd' is not allowed"),
    (ShampooConfig, {"eps": float("nan")}, r"ShampooConfig\.eps = nan must be a finite number"),
    (
        SOAPConfig,
        {"betas": (0.95, 1.0)},
        r"SOAPConfig\.betas\[1\] = 1\.0 is out of range; allowed \[0\.0, 1\.0\)",
    ),
    (
        SOAPConfig,
        {"precondition_frequency": 0},
        r"SOAPConfig\.precondition_frequency = 0 is out of range",
    ),
    (SOAPConfig, {"betas": [0.9, 0.9]}, r"SOAPConfig\.betas = \[0\.9, 0\.9\] must be a pair"),
    (AdamWConfig, {"weight_decay": -0.1}, r"AdamWConfig\.weight_decay = -0\.1 is out of range"),
    (AdamWConfig, {"betas": (1.0, 0.999)}, r"AdamWConfig\.betas\[0\] = 1\.0 is out of range"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"), BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _ in BAD]
)
def test_invalid_values_are_rejected_with_a_clear_message(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [MuonConfig, ShampooConfig, SOAPConfig, AdamWConfig])
def test_configs_are_keyword_only_and_frozen(cls):
    with pytest.raises(TypeError):
        cls(0.1)
    cfg = cls()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]


def test_paper_defaults_of_soap_and_documented_defaults_of_shampoo():
    soap = SOAPConfig()
    assert (
        soap.lr,
        soap.betas,
        soap.weight_decay,
        soap.precondition_frequency,
        soap.max_precond_dim,
        soap.eps,
    ) == (
        3e-3,
        (0.95, 0.95),
        0.01,
        10,
        10000,
        1e-8,
    )
    sh = ShampooConfig()
    assert (sh.betas, sh.eps, sh.max_preconditioner_dim, sh.grafting) == (
        (0.9, 1.0),
        1e-12,
        1024,
        "adam",
    )


def test_state_and_shape_mismatches_are_reported_before_any_change():
    opt = Muon()
    state = opt.init_state((8, 4))
    before = state["momentum_buffer"].clone()
    with pytest.raises(ValueError, match="momentum_buffer.*shape \\(8, 4\\), expected \\(4, 8\\)"):
        opt.direction([torch.randn(4, 8)], [state], names=["w"])
    with pytest.raises(ValueError, match="gradient of w has shape \\(8,\\); expected 2-D"):
        opt.direction([torch.randn(8)], [state], names=["w"])
    with pytest.raises(ValueError, match="state of parameter #0 lacks 'step'"):
        Shampoo().direction([torch.randn(8, 4)], [state])
    assert torch.equal(state["momentum_buffer"], before)
