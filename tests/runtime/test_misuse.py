"""Misuse fails loudly, on every rank: a rank that skips backward, a DDP-wrapped model under
canzona's own reduction, and ranks that start from different weights (or their broadcast with
``sync_init=True``). Every case runs in ONE 2-rank gloo spawn."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import canzona
import dp_helpers as H
from canzona.runtime.errors import UnevenBackwardError, WeightsDifferError
from canzona.runtime.optimizer import CanzonaOptimizer

pytestmark = pytest.mark.slow


def _opt(model, world, **kw):
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    return CanzonaOptimizer(model, plan, lr=H.LR, ns_dtype=torch.float32, **kw)


def _skipped_backward(rank: int, world: int) -> dict:
    """Rank 1 calls step() without backward, twice; rank 0 backpropagates. Every rank raises,
    nothing is updated, and a later step with both ranks' gradients trains as usual."""
    model = H.TinyGPT()
    opt = _opt(model, world)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = H.batch(0, 0, world)
    errors = []
    for _ in range(2):
        if rank == 0:
            H.loss_fn(model, x, y).backward()
        try:
            opt.step()
        except UnevenBackwardError as exc:
            errors.append(str(exc))
        opt.zero_grad()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    H.loss_fn(model, x, y).backward()
    opt.step()
    moved = not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.close()
    return {"errors": errors, "unchanged": unchanged, "moved": moved}


def _ddp_refused(rank: int, world: int) -> dict:
    """A DDP-wrapped model: refused with the default grad_sync, accepted with 'external'."""
    model = torch.nn.parallel.DistributedDataParallel(H.TinyGPT())
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    try:
        CanzonaOptimizer(model, plan)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    opt = CanzonaOptimizer(model, plan, grad_sync="external")
    opt.close()
    return {"refused": refused}


def _different_seeds(rank: int, world: int, *, sync_init: bool) -> dict:
    """Each rank seeds its model differently; without sync_init every rank raises naming a
    parameter, with it every rank ends up with rank 0's weights."""
    model = H.TinyGPT(seed=rank)
    try:
        opt = _opt(model, world, sync_init=sync_init)
    except WeightsDifferError as exc:
        return {"error": str(exc)}
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], t) for t in everyone)
    rank0 = torch.equal(flat, torch.cat([p.detach().reshape(-1)
                                         for p in H.TinyGPT(seed=0).parameters()]))
    opt.close()
    return {"error": "", "same": same, "rank0": rank0}


CASES = [("skipped_backward", _skipped_backward), ("ddp", _ddp_refused),
         ("seeds", functools.partial(_different_seeds, sync_init=False)),
         ("seeds_synced", functools.partial(_different_seeds, sync_init=True))]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return H.run_world(2, CASES, str(tmp_path_factory.mktemp("misuse")))


def test_a_rank_that_skips_backward_makes_every_rank_raise(world2):
    for res in H.results(world2, "skipped_backward"):
        assert len(res["errors"]) == 2, res
        assert "DP rank(s) 1 produced no gradient" in res["errors"][0]
        assert res["unchanged"] and res["moved"]


def test_a_ddp_model_needs_grad_sync_external(world2):
    for res in H.results(world2, "ddp"):
        assert "DistributedDataParallel" in res["refused"]
        assert "grad_sync='external'" in res["refused"]


def test_ranks_with_different_weights_raise_or_sync(world2):
    for res in H.results(world2, "seeds"):
        assert "the DP ranks hold different weights" in res["error"]
        assert "sync_init=True" in res["error"]
    for res in H.results(world2, "seeds_synced"):
        assert res["error"] == "" and res["same"] and res["rank0"]


@pytest.mark.parametrize(("kw", "named"), [
    ({"lr": -0.02}, "lr=-0.02 is out of range"),
    ({"momentum": 1.5}, "momentum=1.5 is out of range"),
    ({"adamw_lr": -1.0}, "adamw_lr=-1.0 is out of range"),
    ({"adamw_betas": (1.5, 0.9)}, "adamw_betas[0] = 1.5 is out of range"),
    ({"matrix_options": {"eps": -1.0}}, "matrix_options['eps'] = -1.0 is out of range"),
    ({"adamw_nonfinite": "ignore"}, "adamw_nonfinite='ignore' is not allowed"),
])
def test_a_setting_out_of_range_names_the_argument(kw, named):
    """The error names the constructor's argument, not only the kernel config's field."""
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=1, bucket_size=3000)
    with pytest.raises(ValueError) as info:
        CanzonaOptimizer(model, plan, **kw)
    assert str(info.value).startswith(named), str(info.value)
