"""torch.optim conventions of CanzonaOptimizer: stock schedulers drive it.

``defaults`` and the param groups hold the hyper-parameters the kernels use (the matrix group:
every field of the kernel's config, as torch.optim.Muon; the AdamW group: lr, betas, eps,
weight_decay) and ``step()`` reads them at every step. Each test runs the optimizer (dp = 1, no
process group) under a scheduler, records the groups' values before every step, and replays
them on the bare kernels (a fresh config per step, the state carried over): the parameters must
agree, so the values a scheduler sets are the values the step uses. A run with the values frozen
at construction must not agree, so the schedule really changed something.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

import canzona
import dp_helpers as H
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.introspect import inventory
from canzona.runtime.optim import (
    SOAP,
    AdamW,
    AdamWConfig,
    Muon,
    MuonConfig,
    SOAPConfig,
    Shampoo,
    ShampooConfig,
)
from canzona.runtime.optimizer import CanzonaOptimizer

STEPS = 8
LR = {"muon": 0.02, "shampoo": 0.01, "soap": 3e-3}
KERNEL = {"muon": (Muon, MuonConfig), "shampoo": (Shampoo, ShampooConfig),
          "soap": (SOAP, SOAPConfig)}
OPTIONS = {"shampoo": {"eps": 1e-4, "precondition_frequency": 3},
           "soap": {"precondition_frequency": 3}}
PLAN_SETTINGS = {"shampoo": {"shampoo_precondition_frequency": 3},
                 "soap": {"soap_precondition_frequency": 3}}


def _setup(optimizer: str = "muon", **kw):
    torch.set_num_threads(1)
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=1, optimizer=optimizer, bucket_size=3000,
                              **PLAN_SETTINGS.get(optimizer, {}))
    opt = CanzonaOptimizer(model, plan, lr=LR[optimizer], ns_dtype=torch.float32,
                           adamw_lr=H.ADAMW_LR, matrix_options=OPTIONS.get(optimizer), **kw)
    return model, plan, opt


def _hparams(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _train(model, opt, sched=None, steps: int = STEPS, metric=None,
           start: int = 0) -> list[list[dict]]:
    """Train; return the groups' hyper-parameters as they were before each step."""
    used = []
    for step in range(start, start + steps):
        x, y = H.batch(step, 0, 1)
        loss = H.loss_fn(model, x, y)
        loss.backward()
        used.append(_hparams(opt))
        opt.step()
        if metric is not None:
            sched.step(metric(step, float(loss.detach())))
        elif sched is not None:
            sched.step()
        opt.zero_grad()
    return used


def _replay(optimizer: str, used: list[list[dict]]) -> dict[str, torch.Tensor]:
    """The same training on the bare kernels, with each step's recorded hyper-parameters."""
    torch.set_num_threads(1)
    model = H.TinyGPT()
    route = {p.name: p.optimizer for p in inventory(model).params}
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if route[n] == "matrix"]
    rest = [(n, p) for n, p in named if route[n] != "matrix"]
    kind, config = KERNEL[optimizer]
    fields = set(config.__dataclass_fields__) - {"_schedule"}
    mstate = {n: kind(config(**OPTIONS.get(optimizer, {}))).init_state(p.shape) for n, p in mats}
    astate = {n: AdamW().init_state(p.shape) for n, p in rest}
    for step, groups in enumerate(used):
        mg, ag = groups
        x, y = H.batch(step, 0, 1)
        H.loss_fn(model, x, y).backward()
        mk = kind(config(**{k: v for k, v in mg.items() if k in fields}))
        ak = AdamW(AdamWConfig(lr=ag["lr"], betas=tuple(ag["betas"]), eps=ag["eps"],
                               weight_decay=ag["weight_decay"]))
        with torch.no_grad():
            live = [(n, p) for n, p in mats if p.grad is not None]
            ups = mk.direction([p.grad for _, p in live], [mstate[n] for n, _ in live],
                               names=[n for n, _ in live])
            for (n, p), u in zip(live, ups):
                if u is not None:
                    mk.apply(p, u, full_shape=tuple(p.shape))
            for n, p in rest:
                if p.grad is not None:
                    ak.step([p], [p.grad], [astate[n]], names=[n])
        model.zero_grad()
    return H.params_of(model)


def _check_replay(optimizer: str, model, used) -> None:
    got = H.params_of(model)
    assert H.max_rel_err(got, _replay(optimizer, used)) <= 1e-5
    frozen = [used[0]] * len(used)  # the construction-time values at every step
    assert H.max_rel_err(got, _replay(optimizer, frozen)) > 1e-4


# --- the conventions ------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
def test_groups_and_defaults_hold_the_kernel_hyperparameters(optimizer):
    _, _, opt = _setup(optimizer)
    matrix, adamw = opt.param_groups
    assert matrix["name"] == "matrix" and adamw["name"] == "adamw"
    assert opt.defaults == {k: v for k, v in matrix.items() if k not in ("params", "name")}
    assert {"lr", "betas", "eps", "weight_decay"} <= set(adamw) and "momentum" not in adamw
    assert adamw["lr"] == H.ADAMW_LR and adamw["betas"] == (0.9, 0.999)
    assert matrix["lr"] == LR[optimizer]
    if optimizer == "muon":  # torch.optim.Muon's keys
        assert {"lr", "momentum", "nesterov", "weight_decay", "ns_steps", "ns_coefficients", "eps",
                "adjust_lr_fn"} <= set(matrix)
        assert matrix["momentum"] == 0.95 and "betas" not in opt.defaults
    elif optimizer == "shampoo":
        assert {"betas", "momentum", "eps", "max_preconditioner_dim"} <= set(matrix)
        assert matrix["eps"] == 1e-4
    else:
        assert matrix["betas"] == (0.95, 0.95) and "momentum" not in matrix


def test_add_param_group_is_refused():
    _, _, opt = _setup()
    with pytest.raises(RuntimeError, match="parameters are fixed by the plan"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1})
    assert len(opt.param_groups) == 2


# --- schedulers -----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "soap"])
def test_one_cycle_with_momentum_cycling(optimizer):
    """OneCycleLR (cycle_momentum=True): Muon's matrix group has 'momentum' (its μ is cycled);
    Shampoo's and SOAP's defaults have 'betas', so β1 of both groups is cycled."""
    model, _, opt = _setup(optimizer)
    base = LR[optimizer]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2 * base, 2 * H.ADAMW_LR],
                                                total_steps=STEPS, pct_start=0.5)
    used = _train(model, opt, sched)
    key = (lambda g: g["momentum"]) if optimizer == "muon" else (lambda g: g["betas"][0])
    momenta = [key(u[0]) for u in used]
    assert len(set(momenta)) > 3 and min(momenta) == pytest.approx(0.85, abs=0.02)
    assert len({u[0]["lr"] for u in used}) == STEPS
    # Muon: the AdamW group keeps its β1 (OneCycleLR writes a 'momentum' key there, unused)
    assert [u[1]["betas"][0] for u in used] == ([0.9] * STEPS if optimizer == "muon" else momenta)
    _check_replay(optimizer, model, used)


@pytest.mark.parametrize("name", ["cosine", "lambda", "sequential", "plateau"])
def test_lr_schedulers(name):
    model, _, opt = _setup("muon")
    sch = torch.optim.lr_scheduler
    metric = None
    if name == "cosine":
        sched = sch.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4)
    elif name == "lambda":
        sched = sch.LambdaLR(opt, [lambda s: 1.0 / (1 + s), lambda s: 0.5 ** s])
    elif name == "sequential":
        sched = sch.SequentialLR(opt, [sch.LinearLR(opt, start_factor=0.1, total_iters=3),
                                       sch.CosineAnnealingLR(opt, T_max=STEPS - 3)], milestones=[3])
    else:
        sched = sch.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        metric = lambda step, loss: 1.0  # noqa: E731 - never improves: halve after every step
    used = _train(model, opt, sched, metric=metric)
    lrs = [u[0]["lr"] for u in used]
    assert len(set(lrs)) >= STEPS - 1, lrs
    if name == "plateau":
        assert lrs[-1] == pytest.approx(LR["muon"] * 0.5 ** (STEPS - 2))
    _check_replay("muon", model, used)


def test_a_change_by_hand_takes_effect_at_the_next_step():
    model, _, opt = _setup("muon")
    used = _train(model, opt, steps=3)
    matrix, adamw = opt.param_groups
    matrix.update(momentum=0.5, nesterov=False, weight_decay=0.0, lr=0.05)
    adamw.update(betas=[0.8, 0.99], eps=1e-6, lr=1e-2)  # a list is accepted as torch's is
    used += _train(model, opt, steps=3, start=3)
    assert opt._matrix.config.momentum == 0.5 and opt._adamw.config.betas == (0.8, 0.99)
    assert H.max_rel_err(H.params_of(model), _replay("muon", used)) <= 1e-5


@pytest.mark.parametrize(("optimizer", "change", "error", "message"), [
    ("muon", {"momentum": 1.5}, ValueError, r"param group 'matrix': MuonConfig.momentum = 1.5"),
    ("muon", {"lr": float("nan")}, ValueError, r"param group 'matrix': MuonConfig.lr = nan"),
    ("muon", {"ns_steps": 3}, PlanMismatchError, r"ns_steps=3 disagrees with the plan, which was "
                                                  r"made with ns_steps=5"),
    ("shampoo", {"momentum": 0.9}, ValueError, r"state was allocated with momentum > 0 = False"),
    ("shampoo", {"max_preconditioner_dim": 8}, PlanMismatchError, "max_preconditioner_dim=8"),
    ("soap", {"betas": (0.9,)}, ValueError, r"SOAPConfig.betas = \(0.9,\) must be a pair"),
])
def test_bad_group_values_raise_before_anything_changes(optimizer, change, error, message):
    model, _, opt = _setup(optimizer)
    _train(model, opt, steps=1)
    before = H.params_of(model)
    state = {id(p): {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
             for p, st in opt.state.items()}
    opt.param_groups[0].update(change)
    x, y = H.batch(5, 0, 1)
    H.loss_fn(model, x, y).backward()
    with pytest.raises(error, match=message):
        opt.step()
    after = H.params_of(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for p, st in opt.state.items():
        for k, v in state[id(p)].items():
            assert torch.equal(st[k], v)


def test_adamw_group_bad_betas():
    model, _, opt = _setup("muon")
    opt.param_groups[1]["betas"] = (0.9, 1.0)
    H.loss_fn(model, *H.batch(0, 0, 1)).backward()
    with pytest.raises(ValueError, match=r"param group 'adamw': AdamWConfig.betas\[1\] = 1.0"):
        opt.step()


# --- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["muon", "shampoo"])
def test_state_dict_round_trip_weights_only(optimizer, tmp_path):
    """torch.save / torch.load(weights_only=True) of state_dict() (and the scheduler's) after 3
    OneCycleLR steps; a fresh model and optimizer then take bitwise the same 3 further steps."""

    def schedule(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2 * LR[optimizer], 1e-2],
                                                   total_steps=2 * STEPS)

    model, _, opt = _setup(optimizer)
    sched = schedule(opt)
    _train(model, opt, sched, steps=3)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
               path)
    _train(model, opt, sched, steps=3, start=3)
    want = H.params_of(model)

    ckpt = torch.load(path, weights_only=True)
    model2, _, opt2 = _setup(optimizer)
    opt2.param_groups[0]["lr"] = 123.0  # overwritten by the checkpoint
    sched2 = schedule(opt2)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    saved = [{k: v for k, v in g.items() if k != "params"} for g in ckpt["opt"]["param_groups"]]
    assert _hparams(opt2) == saved and saved[0]["lr"] != 123.0
    _train(model2, opt2, sched2, steps=3, start=3)
    got = H.params_of(model2)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_state_dict_holds_only_weights_only_types():
    model, _, opt = _setup("muon", main_params="fp32")
    _train(model, opt, steps=1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd["param_groups"][0]["ns_dtype"] == torch.float32
    assert math.isclose(sd["param_groups"][0]["lr"], LR["muon"])
