"""CanzonaOptimizer with bf16 parameters: fp32 main parameters (``main_params="fp32"``) and without.

The distributed cases run inside ONE gloo spawn at DP = 2 (module fixture ``world2``); the
references run here, one process, one thread.

Why the references can be tight: each rank's bf16 backward on its half batch is bitwise the
reference's backward on the same half (same parameters, same ops, one thread); the runtime adds
the bf16 gradient into a zeroed fp32 bucket (exact), the reduce-scatter sums two fp32 terms (one
order) and divides by 2 — the reference does exactly that. The updates then run the same canzona
kernels on fp32 main copies, so the main copies differ only by what batching and slicing change
in the last bits (Newton–Schulz stacks same shapes per rank); the bf16 parameters are the main
copies rounded, so they agree bitwise except where a last-bit difference crosses a rounding
boundary — then by one bf16 ulp. (Measured on this machine: bitwise equal, main copies and
parameters, with and without the option.)
"""

from __future__ import annotations

import functools

import pytest
import torch

import canzona
import dp_helpers as H
from canzona.runtime.accounting import predicted_state_bytes
from canzona.runtime.optimizer import CanzonaOptimizer
from canzona.runtime.optim import AdamW, AdamWConfig, Muon, MuonConfig

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16
STEPS = 10
WD, ADAMW_WD = 0.1, 0.01


def _bf16_model() -> torch.nn.Module:
    return H.TinyGPT().to(BF16)


def _train(rank: int, world: int, *, main_params: str | None) -> dict:
    """TinyGPT in bf16 at DP = world: 10 steps, each rank on its half of every batch."""
    model = _bf16_model()
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    opt = CanzonaOptimizer(model, plan, lr=H.LR, weight_decay=WD, ns_dtype=torch.float32,
                           adamw_lr=H.ADAMW_LR, adamw_weight_decay=ADAMW_WD,
                           main_params=main_params)
    mine = H.rows(rank, world)
    losses = []
    for step in range(STEPS):
        x, y = H.batch(step, 0, world)
        loss = H.loss_fn(model, x[mine], y[mine])
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    opt.wait_params()
    # this rank's fp32 main copies, as {name: (flat start, flat end, values)}
    main = {}
    for b, buf in zip(opt._schedule.buckets, opt._storage.buffers):
        if buf.main is None:
            continue
        c0, c1 = b.cuts[rank], b.cuts[rank + 1]
        for sl in b.slots:
            a, z = max(sl.lo, c0), min(sl.hi, c1)
            if a < z:
                values = buf.main[a - c0:z - c0].clone()
                main[opt._names[sl.param]] = (a - sl.lo, z - sl.lo, values)
    sd = opt.state_dict()
    return {"params": H.params_of(model), "main": main, "losses": losses,
            "state_bytes": opt.state_bytes(), "predicted": opt.predicted_state_bytes(),
            "plan": plan,
            "sd_main": sd["canzona"].get("main_params")}


CASES = {
    "main_fp32": functools.partial(_train, main_params="fp32"),
    "plain": functools.partial(_train, main_params=None),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return H.run_world(2, list(CASES.items()), str(tmp_path_factory.mktemp("bf16")))


@functools.cache
def reference(world: int = 2, main_fp32: bool = True) -> dict:
    """One process: bf16 model, fp32 main copies (``main_fp32``; else the kernels update the bf16
    parameters), the canzona kernels (Newton–Schulz in fp32), the gradient as the fp32 average of
    the per-rank halves' bf16 gradients."""
    torch.set_num_threads(1)
    from canzona.runtime.introspect import inventory

    model = _bf16_model()
    route = {p.name: p.optimizer for p in inventory(model).params}
    named = list(model.named_parameters())
    main = {n: p.detach().float().clone() if main_fp32 else p.detach() for n, p in named}
    muon = Muon(MuonConfig(lr=H.LR, weight_decay=WD, ns_dtype=torch.float32))
    adamw = AdamW(AdamWConfig(lr=H.ADAMW_LR, weight_decay=ADAMW_WD))
    state = {n: (muon if route[n] == "matrix" else adamw).init_state(p.shape) for n, p in named}
    for step in range(STEPS):
        x, y = H.batch(step, 0, world)
        grads: dict[str, torch.Tensor] = {}
        for r in range(world):
            model.zero_grad()
            H.loss_fn(model, x[H.rows(r, world)], y[H.rows(r, world)]).backward()
            for n, p in named:
                if p.grad is not None:
                    grads[n] = grads.get(n, torch.zeros_like(main[n])) + p.grad.float()
        grads = {n: g / world for n, g in grads.items()}
        mats = [n for n in grads if route[n] == "matrix"]
        ups = muon.direction([grads[n] for n in mats], [state[n] for n in mats], names=mats)
        with torch.no_grad():
            for n, u in zip(mats, ups):
                muon.apply(main[n], u, full_shape=tuple(main[n].shape))
            for n in grads:
                if route[n] != "matrix":
                    adamw.step([main[n]], [grads[n]], [state[n]], names=[n])
            if main_fp32:
                for n, p in named:
                    p.copy_(main[n])
        model.zero_grad()
    return {"params": H.params_of(model), "main": main}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 ulps between two bf16 tensors of the same signs."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max()) if a.numel() else 0


# --- fp32 main parameters ----------------------------------------------------------------------


def test_main_fp32_matches_one_process(world2):
    got = H.results(world2, "main_fp32")
    ref = reference()
    seen = set()
    for r, res in enumerate(got):
        for name, (a, z, values) in res["main"].items():
            want = ref["main"][name].reshape(-1)[a:z]
            err = ((values - want).norm() / want.norm().clamp(min=1e-12)).item()
            assert err <= 1e-5, f"rank {r}, main copy of {name}[{a}:{z}]: relative error {err:.3g}"
            seen.update((name, i) for i in range(a, z))
        for name, p in res["params"].items():
            assert p.dtype == BF16
            assert _ulps(p, ref["params"][name]) <= 1, f"rank {r}, {name}"
    # the main copies of the ranks together cover every element once
    assert len(seen) == sum(p.numel() for p in ref["params"].values())
    for res in got[1:]:
        assert all(torch.equal(res["params"][k], got[0]["params"][k]) for k in got[0]["params"])


def test_main_fp32_params_are_rounded_main_copies(world2):
    for res in H.results(world2, "main_fp32"):
        for name, (a, z, values) in res["main"].items():
            assert torch.equal(res["params"][name].reshape(-1)[a:z], values.to(BF16)), name


def test_main_fp32_state_bytes_match_plan(world2):
    for r, res in enumerate(H.results(world2, "main_fp32")):
        plan = res["plan"]
        own = sum(b.cuts[r + 1] - b.cuts[r] for buf in plan.buffers for b in buf.buckets)
        assert all(buf.dtype == "bf16" for buf in plan.buffers)
        assert res["state_bytes"] == res["predicted"] == plan.metrics.dp_state_bytes[r] + 4 * own
        assert res["predicted"] == predicted_state_bytes(plan, r, main_params="fp32")
        assert [m.dtype for m in res["sd_main"]] == [torch.float32] * len(res["sd_main"])


# --- without the option: updated in bf16 -------------------------------------------------------


def test_bf16_without_main_params_trains(world2):
    got = H.results(world2, "plain")
    init = H.params_of(_bf16_model())
    for r, res in enumerate(got):
        assert res["state_bytes"] == res["predicted"] == res["plan"].metrics.dp_state_bytes[r]
        assert res["sd_main"] is None
        for name, p in res["params"].items():
            assert p.dtype == BF16 and torch.isfinite(p.float()).all()
            assert torch.equal(p, init[name]) == (name == "spare.weight"), name
    for res in got[1:]:
        assert all(torch.equal(res["params"][k], got[0]["params"][k]) for k in got[0]["params"])
    # the same computation in one process (kernels on the bf16 parameters): as tight as above
    ref = reference(main_fp32=False)
    for r, res in enumerate(got):
        for name, p in res["params"].items():
            assert _ulps(p, ref["params"][name]) <= 1, f"rank {r}, {name}"
    # and not the fp32-main result: every update rounded to bf16 drifts (about 2% after 10
    # steps), far more than the fp32-main run's rounding of its parameters to bf16
    fp32_ref = {k: v.float() for k, v in reference()["params"].items()}
    drift = H.max_rel_err({k: v.float() for k, v in got[0]["params"].items()}, fp32_ref)
    main_fp32 = H.results(world2, "main_fp32")[0]["params"]
    rounding = H.max_rel_err({k: v.float() for k, v in main_fp32.items()}, fp32_ref)
    assert drift > 10 * rounding and drift < 0.1, (drift, rounding)


# --- option errors and single process -----------------------------------------------------------


@pytest.mark.parametrize("bad", ["bf16", "FP32", True, torch.float32])
def test_main_params_bad_value(bad):
    model = _bf16_model()
    plan = canzona.plan_model(model, dp=1)
    with pytest.raises(ValueError,
                       match=r"main_params = .* is not allowed; choose None .* or 'fp32'"):
        CanzonaOptimizer(model, plan, main_params=bad)
    with pytest.raises(ValueError, match="main_params"):
        predicted_state_bytes(plan, 0, main_params=bad)


def test_single_process_state_dict_and_reload():
    """DP = 1: the main copies round-trip through state_dict; fp32 models get none."""
    torch.set_num_threads(1)
    model = _bf16_model()
    plan = canzona.plan_model(model, dp=1)
    opt = CanzonaOptimizer(model, plan, lr=H.LR, ns_dtype=torch.float32, main_params="fp32")
    for step in range(2):
        x, y = H.batch(step, 0, 1)
        H.loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    model2 = _bf16_model()
    model2.load_state_dict(model.state_dict())
    opt2 = CanzonaOptimizer(model2, plan, lr=H.LR, ns_dtype=torch.float32, main_params="fp32")
    opt2.load_state_dict(sd)
    assert all(torch.equal(a.main, b.main)
               for a, b in zip(opt._storage.buffers, opt2._storage.buffers))
    assert opt2.state_bytes() == opt2.predicted_state_bytes() == opt.state_bytes()
    # reload takes the (rounded) parameters: the main copies then equal them exactly
    opt2.reload_main_params()
    assert all(torch.equal(b.main, b.params.float()) for b in opt2._storage.buffers)
    # an fp32 model needs no main copies
    m32 = H.TinyGPT()
    p32 = canzona.plan_model(m32, dp=1)
    o32 = CanzonaOptimizer(m32, p32, main_params="fp32")
    assert all(b.main is None for b in o32._storage.buffers)
    assert o32.state_bytes() == o32.predicted_state_bytes() == p32.metrics.dp_state_bytes[0]
