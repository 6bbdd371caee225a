"""A non-finite gradient on one rank is decided the same on every rank: the
"got a gradient" all-reduce also carries per-parameter non-finite flags, so under
``nonfinite="raise"`` every rank raises ``NonFiniteGradientError`` naming the parameter before
anything is updated (no rank is left waiting in an all-gather), and under ``"skip"`` every rank
leaves it alone while the others are updated; training then continues."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

from dp_helpers import (ADAMW_LR, LR, TinyGPT, batch, loss_fn, params_of, results, rows,
                        run_world)

POISONED = "blocks.0.fc2.weight"  # a matrix (Muon) parameter
POISONED_ADAMW = "blocks.0.ln_2.weight"  # an AdamW parameter


def _loss(model, x, y, poison: str | None):
    loss = loss_fn(model, x, y)
    if poison:  # NaN in this one parameter's gradient only: d(0·NaN·ΣW)/dW = NaN
        w = dict(model.named_parameters())[poison]
        loss = loss + 0.0 * float("nan") * w.sum()
    return loss


def case(rank: int, world: int, *, policy: str, clip: bool, target: str = POISONED) -> dict:
    import canzona
    from canzona.runtime.errors import NonFiniteSkipWarning
    from canzona.runtime.optim import NonFiniteGradientError

    model = TinyGPT(spare=False)
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    opt = canzona.CanzonaOptimizer(model, plan, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
                                   matrix_options={"nonfinite": policy},
                                   adamw_nonfinite=policy)
    mine = rows(rank, world)
    out: dict = {"raised": [], "skipped": [], "norms": []}
    for step in range(3):
        x, y = batch(step, 0, world)
        _loss(model, x[mine], y[mine],
              poison=target if (step == 1 and rank == 1) else None).backward()
        before = params_of(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NonFiniteSkipWarning)
            try:
                if clip:
                    out["norms"].append(float(opt.clip_grad_norm_(1.0)))
                opt.step()
            except NonFiniteGradientError as exc:
                out["raised"].append((step, list(exc.names)))
        out["skipped"] += [(step, str(w.message)) for w in caught
                           if issubclass(w.category, NonFiniteSkipWarning)]
        after = params_of(model)
        out[f"changed{step}"] = sorted(n for n in after if not torch.equal(after[n], before[n]))
        opt.zero_grad()
    opt.wait_params()
    out["params"] = params_of(model)
    opt.close()
    return out


CASES = [("raise", False, POISONED), ("skip", False, POISONED), ("skip", True, POISONED),
         ("raise", False, POISONED_ADAMW), ("skip", True, POISONED_ADAMW)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(2, [(f"{p}-{c}-{t}", partial(case, policy=p, clip=c, target=t))
                         for p, c, t in CASES],
                     str(tmp_path_factory.mktemp("nonfinite")))


@pytest.mark.parametrize("policy,clip,target", CASES)
def test_both_ranks_decide_alike_and_training_goes_on(world2, policy, clip, target):
    POISONED = target  # noqa: N806 - the poisoned parameter of this case
    r0, r1 = results(world2, f"{policy}-{clip}-{target}")
    for r in (r0, r1):
        assert all(v.isfinite().all() for v in r["params"].values())
        assert r["changed0"] and r["changed2"]  # the clean steps update, before and after
    if policy == "raise":
        assert r0["raised"] == r1["raised"] == [(1, [POISONED])]
        assert r0["changed1"] == r1["changed1"] == []  # nothing updated anywhere
    else:
        assert r0["raised"] == r1["raised"] == []
        assert len(r0["skipped"]) == len(r1["skipped"]) == 1 and POISONED in r0["skipped"][0][1]
        assert POISONED not in r0["changed1"] and r0["changed1"] == r1["changed1"] != []
        if clip:
            assert all(n == n and n != float("inf") for n in r0["norms"])  # finite: skipped = 0
            assert r0["norms"] == r1["norms"]
    for k in r0["params"]:  # the ranks agree on every parameter
        assert torch.equal(r0["params"][k], r1["params"][k]), k
