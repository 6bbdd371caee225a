"""NaN/Inf gradients: raise naming the parameter, or skip it; never a partial update."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from canzona.runtime.optim import (
    SOAP,
    AdamW,
    AdamWConfig,
    Muon,
    MuonConfig,
    NonFiniteGradientError,
    Shampoo,
    ShampooConfig,
    SOAPConfig,
)

SHAPE = (12, 20)
NAMES = ["layers.0.attn.q", "layers.0.attn.k", "layers.0.mlp.fc1"]


def _make(kind: str, policy: str):
    if kind == "muon":
        return Muon(MuonConfig(nonfinite=policy))
    if kind == "shampoo":
        return Shampoo(ShampooConfig(nonfinite=policy, momentum=0.9))
    if kind == "soap":
        return SOAP(SOAPConfig(nonfinite=policy))
    return AdamW(AdamWConfig(nonfinite=policy))


def _setup(kind: str, policy: str):
    """An optimizer after two clean steps on three same-shape params (state is non-trivial)."""
    opt = _make(kind, policy)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(SHAPE, generator=gen) for _ in NAMES]
    states = [opt.init_state(SHAPE) for _ in NAMES]
    for _ in range(2):
        opt.step(params, [torch.randn(SHAPE, generator=gen) for _ in NAMES], states, names=NAMES)
    grads = [torch.randn(SHAPE, generator=gen) for _ in NAMES]
    return opt, params, states, grads


def _snapshot(params, states):
    return [p.clone() for p in params], [{k: v.clone() for k, v in s.items()} for s in states]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _same_states(a, b) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


KINDS = ["muon", "shampoo", "soap", "adamw"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kind", KINDS)
def test_raise_names_parameter_and_changes_nothing(kind, bad):
    opt, params, states, grads = _setup(kind, "raise")
    grads[1][3, 4] = bad
    p0, s0 = _snapshot(params, states)
    with pytest.raises(NonFiniteGradientError, match=r"layers\.0\.attn\.k") as info:
        opt.step(params, grads, states, names=NAMES)
    assert info.value.names == ["layers.0.attn.k"]
    assert _same(params, p0) and _same_states(states, s0)
    if kind != "adamw":
        with pytest.raises(NonFiniteGradientError):
            opt.direction(grads, states, names=NAMES)
        assert _same_states(states, s0)


@pytest.mark.parametrize("kind", KINDS)
def test_skip_leaves_only_the_bad_parameter_untouched(kind):
    opt, params, states, grads = _setup(kind, "skip")
    clean_params, clean_states = _snapshot(params, states)
    grads[0][0, 0] = float("nan")
    p0, s0 = _snapshot(params, states)
    assert opt.step(params, grads, states, names=NAMES) == [0]
    assert torch.equal(params[0], p0[0]) and _same_states(states[:1], s0[:1])
    # The others are updated exactly as if the bad one had not been there.
    opt.step(clean_params[1:], grads[1:], clean_states[1:], names=NAMES[1:])
    assert _same(params[1:], clean_params[1:]) and _same_states(states[1:], clean_states[1:])
    assert not torch.equal(params[1], p0[1])


def test_error_without_names_uses_positions():
    opt = Muon()
    g = torch.full(SHAPE, float("nan"))
    with pytest.raises(NonFiniteGradientError, match="#0"):
        opt.direction([g], [opt.init_state(SHAPE)])


def test_huge_but_finite_gradients_are_not_flagged():
    from canzona.runtime.optim._base import check_finite

    huge = torch.full((4, 4), 3e38)  # its norm overflows to inf; the elements are finite
    nan = huge.clone()
    nan[2, 3] = float("nan")
    assert check_finite([huge, nan, huge.bfloat16(), torch.zeros(3)]) == [True, False, True, True]
    opt = Muon(MuonConfig(nonfinite="raise"))
    (update,) = opt.direction([huge], [opt.init_state((4, 4))])
    assert bool(torch.isfinite(update).all())
