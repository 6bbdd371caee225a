"""The direction/apply contract shared by the matrix optimizers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from canzona.runtime.optim import SOAP, AdamW, Muon, Shampoo, ShampooConfig, SOAPConfig

MATRIX = {
    "muon": lambda: Muon(),
    "shampoo": lambda: Shampoo(
        ShampooConfig(max_preconditioner_dim=16, momentum=0.9, weight_decay=0.1)
    ),
    "soap": lambda: SOAP(SOAPConfig(max_precond_dim=30)),
}


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("kind", sorted(MATRIX))
def test_apply_on_tp_shards_equals_apply_on_whole(kind, dim):
    opt = MATRIX[kind]()
    shape = (24, 40)
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(shape, generator=gen)
    state = opt.init_state(shape)
    for _ in range(2):  # SOAP's first direction is None
        (update,) = opt.direction([torch.randn(shape, generator=gen)], [state])
    whole = param.clone()
    opt.apply(whole, update, lr=0.03)
    shards = [s.clone() for s in param.chunk(4, dim=dim)]
    for s, u in zip(shards, update.chunk(4, dim=dim)):
        opt.apply(s, u, lr=0.03, full_shape=shape)
    assert torch.equal(torch.cat(shards, dim=dim), whole)
    assert not torch.equal(whole, param)


@pytest.mark.parametrize("kind", [*sorted(MATRIX), "adamw"])
def test_low_precision_grads_are_upcast_to_the_state_dtype(kind):
    opt = AdamW() if kind == "adamw" else MATRIX[kind]()
    shape = (24, 40)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(shape, generator=gen)
    b = a.clone()
    sa, sb = opt.init_state(shape), opt.init_state(shape)
    for _ in range(3):
        g = torch.randn(shape, generator=gen).bfloat16()
        opt.step([a], [g], [sa])
        opt.step([b], [g.float()], [sb])
    assert torch.equal(a, b)
    assert all(t.dtype == torch.float32 for t in sa.values())


def test_state_on_another_device_is_rejected():
    opt = Muon()
    state = {"momentum_buffer": torch.zeros(4, 4, device="meta")}
    with pytest.raises(ValueError, match="is on meta, its gradient on cpu"):
        opt.direction([torch.randn(4, 4)], [state])


def test_muon_update_is_in_the_newton_schulz_dtype():
    (update,) = Muon().direction([torch.randn(8, 16)], [Muon().init_state((8, 16))])
    assert update.dtype == torch.bfloat16 and update.shape == (8, 16)
