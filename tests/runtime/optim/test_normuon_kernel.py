"""NorMuon's kernel against ``pytorch-optimizer``'s NorMuon on one device, its state against the
planner's formula, and its shared finish (pieces of rows or of columns, summed) against the
whole matrix's."""

from __future__ import annotations

import functools

import pytest
import torch

from canzona.planner import formulas
from canzona.runtime.optim import NorMuon, NorMuonConfig

normuon_mod = pytest.importorskip("pytorch_optimizer.optimizer.muon.normuon")

SHAPES = [(12, 7), (7, 12), (9, 9)]


def _theirs(monkeypatch, dtype):
    """pytorch-optimizer's NorMuon, its Newton–Schulz iterating in ``dtype``."""
    ns = normuon_mod.zero_power_via_newton_schulz_5
    monkeypatch.setattr(normuon_mod, "zero_power_via_newton_schulz_5",
                        functools.partial(ns, dtype=dtype))
    return normuon_mod.NorMuon


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,scale,tol", [
    (torch.float32, "preserve_norm", 1e-6), (torch.float32, "match_rms", 1e-6),
    (torch.bfloat16, "preserve_norm", 1e-6)])
def test_normuon_equals_pytorch_optimizers(monkeypatch, shape, dtype, scale, tol):
    Ref = _theirs(monkeypatch, dtype)
    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(shape, generator=g)
    theirs = w0.clone().requires_grad_(True)
    ours = w0.clone()
    ref = Ref([dict(params=[theirs], use_muon=True, lr=0.02, weight_decay=0.1,
                    update_scale=scale)], foreach=False)
    kernel = NorMuon(NorMuonConfig(lr=0.02, weight_decay=0.1, ns_dtype=dtype,
                                   update_scale=scale))
    state = kernel.init_state(shape)
    for _ in range(4):
        grad = torch.randn(shape, generator=g)
        theirs.grad = grad.clone()
        ref.step()
        kernel.step([ours], [grad.clone()], [state])
    assert (ours - theirs.detach()).abs().max().item() <= tol
    v = ref.state[theirs]["second_momentum_buffer"]
    assert (state["second_momentum_buffer"] - v).abs().max().item() <= max(tol, 1e-9) * v.max()


def test_state_and_flops_are_the_planners():
    kernel = NorMuon()
    for m, n in SHAPES:
        state = kernel.init_state((m, n))
        assert sum(t.numel() for t in state.values()) == formulas.normuon_state_numel(m, n)
        assert kernel.state_numel((m, n)) == formulas.normuon_state_numel(m, n)
        assert kernel.flops((m, n)) == formulas.muon_flops(m, n)


@pytest.mark.parametrize("whole_rows", [True, False])
def test_the_shared_finish_of_pieces_equals_the_whole_matrix(whole_rows):
    """Three pieces of one matrix (blocks of rows, or of columns with every row's moments),
    summed across them as the runtime's sharing ranks do: the whole matrix's update and
    moments."""
    m, n = 9, 12
    kernel = NorMuon(NorMuonConfig(ns_dtype=torch.float32))
    o = torch.randn(m, n, generator=torch.Generator().manual_seed(5))
    whole = kernel.init_state((m, n))
    whole["second_momentum_buffer"].fill_(0.3)
    (want,) = kernel.finish_shared([o.clone()], [whole], [(m, n)], [True], None)
    cuts = [slice(0, 4), slice(4, 7), slice(7, None)]
    pieces = [o[c] if whole_rows else o[:, c] for c in cuts]
    states = [kernel.init_state(tuple(p.shape)) for p in pieces]
    for s in states:
        s["second_momentum_buffer"].fill_(0.3)
    # each "rank" (a thread) finishes its own piece; its sums are summed over the three, as
    # the runtime's all-reduce over the sharing ranks does
    import threading

    sent: list[list[tuple[int, torch.Tensor]]] = []  # rank 0's sums, one entry per round
    outs = [None] * 3
    barrier = threading.Barrier(3)
    totals: dict[int, torch.Tensor] = {}
    lock = threading.Lock()

    def run(r):
        def summed(items):
            for _, t in items:
                with lock:
                    totals.setdefault(len(sent), torch.zeros_like(t)).add_(t)
                barrier.wait()
                t.copy_(totals[len(sent)])
                barrier.wait()
                if r == 0:
                    sent.append(items)
                barrier.wait()

        outs[r] = kernel.finish_shared([pieces[r].clone()], [states[r]], [(m, n)],
                                       [whole_rows], summed)[0]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = torch.cat(outs, 0 if whole_rows else 1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    moments = (torch.cat([s["second_momentum_buffer"] for s in states]) if whole_rows
               else states[1]["second_momentum_buffer"])
    assert torch.allclose(moments, whole["second_momentum_buffer"], rtol=1e-6)
    assert len(sent) == 1  # one sum per matrix and step


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="NorMuonConfig.beta2"):
        NorMuonConfig(beta2=1.0)
    with pytest.raises(ValueError, match="update_scale"):
        NorMuonConfig(update_scale="rms")
    with pytest.raises(ValueError, match="leave adjust_lr_fn None"):
        NorMuonConfig(update_scale="match_rms", adjust_lr_fn="spectral")
