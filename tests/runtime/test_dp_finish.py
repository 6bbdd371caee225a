"""``finish()`` / ``close()`` / the with-block, and what the optimizer keeps alive.

The example trainer aborted at exit ("terminate called without an active exception") because
gloo's worker threads outlived ``destroy_process_group()`` (torch 2.13 keeps the default group
alive, and so did the optimizer) and one of them was still freeing a finished all-gather when
the interpreter shut down. ``tests/test_example_train.py`` runs the example end to end; here:
the optimizer holds no process group it was not given (and drops a given one on close),
``finish()`` completes the all-gathers that ``overlap_param_gather`` leaves running, and both
calls are idempotent. The distributed cases run inside ONE gloo spawn at DP = 2.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import canzona
import dp_helpers as H
from canzona.runtime.optimizer import CanzonaOptimizer

pytestmark = pytest.mark.slow


def _groups_held(opt) -> list[str]:
    return [k for k, v in vars(opt).items() if isinstance(v, dist.ProcessGroup)]


def _train(model, opt, rank: int, world: int, steps: int, sched=None, start: int = 0) -> None:
    mine = H.rows(rank, world)
    for step in range(start, start + steps):
        x, y = H.batch(step, 0, world)
        H.loss_fn(model, x[mine], y[mine]).backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()


def _overlap(rank: int, world: int) -> dict:
    """overlap_param_gather=True leaves the all-gathers running; finish() completes them."""
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    opt = CanzonaOptimizer(model, plan, lr=H.LR, ns_dtype=torch.float32, adamw_lr=H.ADAMW_LR,
                           overlap_param_gather=True)
    held_default = _groups_held(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)  # as H.train_reference
    _train(model, opt, rank, world, steps=3, sched=sched)
    pending = sum(c.gathering for c in opt._storage.collectives)
    opt.finish()
    after = sum(c.gathering for c in opt._storage.collectives)
    opt.finish()  # idempotent
    params = H.params_of(model)
    # training goes on after finish()
    _train(model, opt, rank, world, steps=1, sched=sched, start=3)
    opt.finish()
    opt.close()
    opt.close()  # idempotent
    try:
        opt.step()
        step_after_close = "no error"
    except RuntimeError as exc:
        step_after_close = str(exc)
    # hooks are gone: backward leaves the gradients in .grad, the buckets see nothing
    x, y = H.batch(9, 0, world)
    H.loss_fn(model, x, y).backward()
    grads_in_dot_grad = all(p.grad is not None for n, p in model.named_parameters()
                            if n != "spare.weight")
    return {"held_default": held_default, "pending": pending, "after": after, "params": params,
            "step_after_close": step_after_close, "grads": grads_in_dot_grad,
            "state_dict_ok": bool(opt.state_dict()["state"]),
            "bytes_ok": opt.state_bytes() == opt.predicted_state_bytes()}


def _explicit_group(rank: int, world: int) -> dict:
    """A dp_group the caller gives is held until close(), then released; the with-block closes."""
    group = dist.new_group(list(range(world)))
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    with CanzonaOptimizer(model, plan, lr=H.LR, dp_group=group) as opt:
        held = _groups_held(opt)
        _train(model, opt, rank, world, steps=2)
    closed = opt._closed
    released = _groups_held(opt)
    # an exception inside the block closes without waiting, and propagates
    model2 = H.TinyGPT()
    try:
        with CanzonaOptimizer(model2, plan, lr=H.LR, dp_group=group) as opt2:
            _train(model2, opt2, rank, world, steps=1)
            raise KeyError("boom")
    except KeyError:
        propagated = True
    else:
        propagated = False
    dist.destroy_process_group(group)
    return {"held": held, "closed": closed, "released": released, "propagated": propagated,
            "closed2": opt2._closed, "hooks2": len(opt2._hooks)}


CASES = {"overlap": _overlap, "explicit_group": _explicit_group}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return H.run_world(2, list(CASES.items()), str(tmp_path_factory.mktemp("finish")))


@functools.cache
def _reference() -> dict:
    torch.set_num_threads(1)
    return H.train_reference(2, steps=3)


def test_finish_completes_the_overlapped_all_gathers(world2):
    got = H.results(world2, "overlap")
    for res in got:
        assert res["pending"] > 0 and res["after"] == 0
        assert H.max_rel_err(res["params"], _reference()["params"]) <= 1e-5
    assert all(torch.equal(got[0]["params"][k], got[1]["params"][k]) for k in got[0]["params"])


def test_the_default_group_is_not_held(world2):
    for res in H.results(world2, "overlap"):
        assert res["held_default"] == []


def test_close(world2):
    for res in H.results(world2, "overlap"):
        assert "the optimizer is closed" in res["step_after_close"]
        assert res["grads"] and res["state_dict_ok"] and res["bytes_ok"]


def test_explicit_group_released_on_close_and_with_block(world2):
    for res in H.results(world2, "explicit_group"):
        assert res["held"] == ["_group"]
        assert res["closed"] and res["released"] == []
        assert res["propagated"] and res["closed2"] and res["hooks2"] == 0


def test_single_process_close_and_context_manager():
    torch.set_num_threads(1)
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=1, bucket_size=3000)
    with CanzonaOptimizer(model, plan, lr=H.LR) as opt:
        _train(model, opt, 0, 1, steps=1)
        opt.finish()
        opt.finish()
    assert opt._closed and opt._hooks == []
    with pytest.raises(RuntimeError, match="the optimizer is closed"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="the optimizer is closed"):
        with opt:
            pass
    opt.close()
