"""Reduce-scatters overlap backward, ``no_sync`` holds them back, late gradients are refused, and
an unused parameter is reported once.

The other runtime tests train ``TinyGPT`` with an unused parameter (``spare``) in the first
bucket, so no bucket ever completes during backward and everything is reduced at ``step()``:
those tests cannot see whether buckets launch during backward, whether ``no_sync`` stops them,
or whether a gradient arriving after its bucket was reduced is refused. Here every parameter
gets a gradient (``spare=False``). One gloo spawn at DP = 2.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import canzona
import dp_helpers as H
from canzona.runtime.errors import UnusedParameterWarning
from canzona.runtime.optimizer import CanzonaOptimizer

pytestmark = pytest.mark.slow

STEPS = 3


def _launched(opt) -> list[bool]:
    """Per bucket: its reduce-scatter was launched since the last step (or is running)."""
    return [done or c.reduce_work is not None
            for done, c in zip(opt._storage.grads.launched, opt._storage.collectives)]


def _unused_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UnusedParameterWarning)]


def _accumulate(rank: int, world: int) -> dict:
    """Two micro-batches per step, the first under no_sync; what is launched after each."""
    model = H.TinyGPT(spare=False)
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    opt = CanzonaOptimizer(model, plan, lr=H.LR, ns_dtype=torch.float32, adamw_lr=H.ADAMW_LR,
                           adamw_weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    mine = H.rows(rank, world)
    inside, after = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = H.batch(step, 0, world)
            with opt.no_sync():
                (H.loss_fn(model, x[mine], y[mine]) / 2).backward()
            inside.append(_launched(opt))
            x, y = H.batch(step, 1, world)
            (H.loss_fn(model, x[mine], y[mine]) / 2).backward()
            after.append(_launched(opt))
            opt.step()
            sched.step()
            opt.zero_grad()
    params = H.params_of(model)
    # A second backward after every bucket was reduced: the first gradient is refused.
    x, y = H.batch(STEPS, 0, world)
    H.loss_fn(model, x[mine], y[mine]).backward()
    try:
        H.loss_fn(model, x[mine], y[mine]).backward()
        late = "no error"
    except RuntimeError as exc:
        late = str(exc)
    opt.zero_grad()
    opt.close()
    return {"params": params, "inside": inside, "after": after, "late": late,
            "methods": opt.collective_methods, "warnings": _unused_warnings(caught)}


def _unused(rank: int, world: int) -> dict:
    """TinyGPT's spare parameter: one warning over several steps, naming it."""
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    opt = CanzonaOptimizer(model, plan, lr=H.LR)
    mine = H.rows(rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = H.batch(step, 0, world)
            H.loss_fn(model, x[mine], y[mine]).backward()
            launched_in_backward = any(_launched(opt))
            opt.step()
            opt.zero_grad()
    opt.close()
    return {"warnings": _unused_warnings(caught), "launched_in_backward": launched_in_backward,
            "buckets": len(opt.collective_methods)}


CASES = {"accumulate": _accumulate, "unused": _unused}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return H.run_world(2, list(CASES.items()), str(tmp_path_factory.mktemp("overlap")))


@functools.cache
def _reference() -> dict:
    torch.set_num_threads(1)
    return H.train_reference(2, accum=2, steps=STEPS, spare=False)


def test_no_sync_launches_nothing(world2):
    for res in H.results(world2, "accumulate"):
        assert len(res["methods"]) > 1
        assert res["inside"] == [[False] * len(res["methods"])] * STEPS


def test_every_bucket_reduces_during_backward(world2):
    for res in H.results(world2, "accumulate"):
        assert res["after"] == [[True] * len(res["methods"])] * STEPS


def test_accumulation_with_overlap_matches_one_process(world2):
    got = H.results(world2, "accumulate")
    for r, res in enumerate(got):
        err = H.max_rel_err(res["params"], _reference()["params"])
        assert err <= 1e-5, f"rank {r}: relative error {err:.3g}"


def test_a_gradient_after_its_bucket_was_reduced_is_refused(world2):
    for res in H.results(world2, "accumulate"):
        assert "arrived after its bucket was reduced" in res["late"]
        assert "opt.no_sync()" in res["late"]


def test_no_warning_when_every_parameter_gets_a_gradient(world2):
    for res in H.results(world2, "accumulate"):
        assert res["warnings"] == []


def test_an_unused_parameter_is_reported_once(world2):
    for res in H.results(world2, "unused"):
        assert not res["launched_in_backward"]  # spare sits in the first bucket
        assert len(res["warnings"]) == 1
        message = res["warnings"][0]
        assert "'spare.weight' received no gradient" in message
        assert (f"bucket 0 and every later one ({res['buckets']} of {res['buckets']} buckets"
                in message)
        assert "requires_grad_(False)" in message
