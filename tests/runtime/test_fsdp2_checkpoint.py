"""Logical checkpoints of an FSDP2 plan's optimizer (``canzona.save_checkpoint`` /
``load_checkpoint``): a run saved at dp 2 resumes at dp 4 under another plan (other owners,
other rows) and the reverse, Muon and Shampoo, equal to the uninterrupted run within 1e-5
(float32 Newton–Schulz), and NorMuon's state of matrices shared by pairs (each member's block)
saved at dp 4 resumes at dp 2; a ZeRO-1 checkpoint loads into an FSDP2 optimizer and the reverse
(the same logical keys); a checkpoint of another model or kernel is refused on every rank in one
line and changes nothing; torch's ``get_state_dict`` changes neither the parameters nor the
state. With TP (``test_fsdp2``'s TP model on the world as a 2 × 2 ("dp", "tp") mesh: uneven TP
chunks, matrices and a bias TP replicates) a Muon run saved at dp 2 × tp 2 resumes at dp 4
without TP and at dp 2 × tp 2 under other owners, and a dp-4 checkpoint of it at dp 2 × tp 2.

ONE 4-rank spawn with the training module (``conftest.fsdp2_world4``): a 2-D mesh ("rep", "dp") of
shape (2, 2) runs two dp-2 runs side by side (Muon on one half, Shampoo on the other, each saving or
loading its own checkpoint), the whole world the dp-4 ones. The model is ``test_fsdp2``'s (rows that
do not divide by 4: some ranks hold fewer rows, one none)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import dp_helpers as H
import test_fsdp2 as F

pytestmark = pytest.mark.slow

WORLD = 4
SAVE_AT = 6  # of F.STEPS = 10
HALVES = ("muon", "shampoo")  # what each "rep" half of the (2, 2) mesh runs at dp 2


def _steps(model, opt, sched, steps, d: int, dp: int) -> None:
    """Train ``steps`` on DP rank ``d`` of ``dp`` as ``test_fsdp2.train`` does (clipping)."""
    for step in steps:
        x, y = F.batch(step)
        F.loss_fn(model, x[F.rows(d, dp)], y[F.rows(d, dp)]).backward()
        opt.clip_grad_norm_(F.CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.wait_params()


def _fsdp2(dp: int, optimizer: str, *, seed: int = 0, other: bool = False, wide: bool = False,
           shares: dict | None = None):
    """A ``fully_shard``-ed model (init ``seed``) at ``dp`` with its optimizer and scheduler:
    the planner's plan, or (``other``) random owners over 3 rounds; ``shares``: matrices
    shared by pairs (``test_fsdp2.paired``)."""
    model = F.Model(seed, wide=wide)
    plan = F.planned(model, dp, optimizer)
    if other:
        plan = F.scrambled(plan, seed=dp)
    if shares:
        plan = F.paired(plan, shares)
    F.shard(model, F.dp_mesh(dp))
    opt = F.build(model, plan, optimizer)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)


def _zero1(dp: int, optimizer: str, group, *, seed: int = 0):
    """The unsharded model at ``dp`` under a ZeRO-1 plan over ``group``."""
    import canzona

    model = F.Model(seed)
    plan = canzona.plan_model(model, dp=dp, optimizer=optimizer, bucket_size=400,
                              **H.plan_settings(optimizer))
    opt = F.build(model, plan, optimizer, dp_group=group)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)


def _state(opt) -> dict:
    """This rank's optimizer state, local tensors cloned."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return {i: {k: local(v).clone() for k, v in opt.state[p].items()}
            for i, p in enumerate(opt._params)}


def save_halves(rank: int, world: int, *, ck: str, zero1: bool = False) -> dict:
    """dp 2: each half trains its optimizer SAVE_AT steps (FSDP2, or ZeRO-1) and saves over its
    DP group. Under FSDP2 torch's ``get_state_dict`` is called first: it must change neither
    the parameters nor the state."""
    import canzona
    from torch.distributed.checkpoint.state_dict import get_state_dict

    half, d = divmod(rank, 2)
    optimizer = HALVES[half]
    mesh = F.dp_mesh(2)
    group = mesh.get_group()
    if zero1:
        model, opt, sched = _zero1(2, optimizer, group)
    else:
        model, opt, sched = _fsdp2(2, optimizer)
    _steps(model, opt, sched, range(SAVE_AT), d, 2)
    out: dict = {}
    if not zero1:
        params, state = F.full(model), _state(opt)
        get_state_dict(model, opt)
        after = _state(opt)
        out["get_state_dict unchanged"] = (
            all(torch.equal(a, b) for a, b in zip(params.values(), F.full(model).values()))
            and all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i]))
        out["momentum rows"] = {n: tuple(v.to_local().shape) for n, p in
                                zip(opt._names, opt._params) for k, v in opt.state[p].items()
                                if k == "momentum_buffer" and hasattr(v, "to_local")}
    canzona.save_checkpoint(os.path.join(ck, f"{optimizer}-dp2"), model, opt,
                            extra={"sched": sched}, process_group=group)
    opt.close()
    return out


def save_world(rank: int, world: int, *, ck: str) -> None:
    """dp 4: Muon, then Shampoo (other owners), SAVE_AT steps each, saved by the world."""
    import canzona

    for optimizer in HALVES:
        model, opt, sched = _fsdp2(WORLD, optimizer, other=optimizer == "shampoo")
        _steps(model, opt, sched, range(SAVE_AT), rank, WORLD)
        canzona.save_checkpoint(os.path.join(ck, f"{optimizer}-dp4"), model, opt,
                                extra={"sched": sched})
        opt.close()


def load_world(rank: int, world: int, *, ck: str, source: str) -> dict:
    """dp 4: a fresh model (another init) and optimizer under another plan load each half's
    dp-2 checkpoint (``source``: saved under FSDP2 or ZeRO-1) and train to the end."""
    import canzona

    out = {}
    for optimizer in HALVES:
        model, opt, sched = _fsdp2(WORLD, optimizer, seed=7, other=optimizer == "muon")
        meta = canzona.load_checkpoint(os.path.join(ck, f"{optimizer}-dp2"), model, opt,
                                       extra={"sched": sched})
        _steps(model, opt, sched, range(SAVE_AT, F.STEPS), rank, WORLD)
        out[optimizer] = {"params": F.full(model), "storage": meta["storage"],
                          "lr": [g["lr"] for g in opt.param_groups]}
        opt.close()
    return out


def load_halves(rank: int, world: int, *, ck: str, zero1: bool = False) -> dict:
    """dp 2: each half loads the dp-4 checkpoint of its optimizer into a fresh model (another
    init) under FSDP2 (other owners) or ZeRO-1 and trains to the end."""
    import canzona

    half, d = divmod(rank, 2)
    optimizer = HALVES[half]
    group = F.dp_mesh(2).get_group()
    if zero1:
        model, opt, sched = _zero1(2, optimizer, group, seed=7)
    else:
        model, opt, sched = _fsdp2(2, optimizer, seed=7, other=True)
    canzona.load_checkpoint(os.path.join(ck, f"{optimizer}-dp4"), model, opt,
                            extra={"sched": sched}, process_group=group)
    _steps(model, opt, sched, range(SAVE_AT, F.STEPS), d, 2)
    params = F.full(model) if not zero1 else H.params_of(model)
    opt.close()
    return {"optimizer": optimizer, "params": params}


def save_pairs(rank: int, world: int, *, ck: str) -> None:
    """dp 4: NorMuon with matrices shared by both pairs (``test_fsdp2.SHARES4``: each member
    keeps its block's state), random owners over 3 rounds, SAVE_AT steps, saved by the
    world."""
    import canzona

    model, opt, sched = _fsdp2(WORLD, "normuon", other=True, shares=F.SHARES4)
    _steps(model, opt, sched, range(SAVE_AT), rank, WORLD)
    canzona.save_checkpoint(os.path.join(ck, "normuon-pairs-dp4"), model, opt,
                            extra={"sched": sched})
    opt.close()


def load_pairs(rank: int, world: int, *, ck: str) -> dict:
    """dp 2: each half loads that checkpoint into a fresh model (another init), one under the
    planner's plan (every matrix whole on its owner), the other with matrices shared by the
    whole group (``test_fsdp2.SHARES2``: other blocks), and trains to the end."""
    import canzona

    half, d = divmod(rank, 2)
    model, opt, sched = _fsdp2(2, "normuon", seed=7, shares=F.SHARES2 if half else None)
    canzona.load_checkpoint(os.path.join(ck, "normuon-pairs-dp4"), model, opt,
                            extra={"sched": sched}, process_group=F.dp_mesh(2).get_group())
    _steps(model, opt, sched, range(SAVE_AT, F.STEPS), d, 2)
    params = F.full(model)
    opt.close()
    return {"params": params, "shared": bool(half)}


def _tp_run(rank: int, seed: int, *, tp: bool, other: bool = False):
    """Muon on ``test_fsdp2``'s TP model (init ``seed``): with TP over the world's 2 × 2
    ("dp", "tp") mesh (``other``: random owners over 3 rounds), or ``fully_shard``-ed over the
    world at dp 4 without TP; the model, optimizer, scheduler, and this rank's DP rank and
    size."""
    import canzona

    if tp:
        model = F.tp_sharded(F.TPModel(seed), F.tp_mesh())
        plan = canzona.plan_model(model, dp=WORLD // F.TP, tp=F.TP, storage="fsdp2",
                                  comm_dtype="fp32", optimizer="muon",
                                  **H.plan_settings("muon"))
        plan = F.scrambled(plan, seed=5) if other else plan
        where = (rank // F.TP, WORLD // F.TP)
    else:
        model = F.TPModel(seed)
        plan = F.planned(model, WORLD, "muon")
        F.shard(model, F.dp_mesh(WORLD))
        where = (rank, WORLD)
    opt = F.build(model, plan, "muon")
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor), *where


def save_tp(rank: int, world: int, *, ck: str) -> None:
    """dp 2 × tp 2: Muon trains SAVE_AT steps and the world saves."""
    import canzona

    model, opt, sched, d, dp = _tp_run(rank, 0, tp=True)
    _steps(model, opt, sched, range(SAVE_AT), d, dp)
    canzona.save_checkpoint(os.path.join(ck, "muon-tp"), model, opt, extra={"sched": sched})
    opt.close()


def load_tp(rank: int, world: int, *, ck: str, source: str, tp: bool,
            resave: str | None = None) -> dict:
    """A fresh TP model (another init) at dp 2 × tp 2 under other owners (``tp``) or at dp 4
    loads checkpoint ``source``, saves it again as ``resave`` (if given) and trains to the
    end."""
    import canzona

    model, opt, sched, d, dp = _tp_run(rank, 7, tp=tp, other=True)
    meta = canzona.load_checkpoint(os.path.join(ck, source), model, opt, extra={"sched": sched})
    if resave:
        canzona.save_checkpoint(os.path.join(ck, resave), model, opt, extra={"sched": sched})
    _steps(model, opt, sched, range(SAVE_AT, F.STEPS), d, dp)
    out = {"params": F.full(model), "saved at": (meta["dp"], meta["tp"])}
    opt.close()
    return out


def refusals(rank: int, world: int, *, ck: str) -> dict:
    """Checkpoints this optimizer cannot take, refused on every rank before anything
    changes: another model's, another kernel's."""
    import canzona

    out = {}
    for what, (optimizer, wide) in {"model": ("muon", True), "kernel": ("shampoo", False)}.items():
        model, opt, sched = _fsdp2(WORLD, optimizer, seed=3, wide=wide)
        before, state = F.full(model), _state(opt)
        out[what] = F._message(lambda: canzona.load_checkpoint(
            os.path.join(ck, "muon-dp4"), model, opt))
        after = _state(opt)
        out[f"{what} unchanged"] = (
            all(torch.equal(a, b) for a, b in zip(before.values(), F.full(model).values()))
            and all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i]))
        opt.close()
    return out


def cases(ck: str) -> list:
    fs, z1 = os.path.join(ck, "fsdp2"), os.path.join(ck, "zero1")
    return [
        ("save dp2", functools.partial(save_halves, ck=fs)),
        ("save dp4", functools.partial(save_world, ck=fs)),
        ("dp2 -> dp4", functools.partial(load_world, ck=fs, source="fsdp2")),
        ("dp4 -> dp2", functools.partial(load_halves, ck=fs)),
        ("zero1 save dp2", functools.partial(save_halves, ck=z1, zero1=True)),
        ("zero1 dp2 -> fsdp2 dp4", functools.partial(load_world, ck=z1, source="zero1")),
        ("fsdp2 dp4 -> zero1 dp2", functools.partial(load_halves, ck=fs, zero1=True)),
        ("save dp4 pairs", functools.partial(save_pairs, ck=fs)),
        ("dp4 pairs -> dp2", functools.partial(load_pairs, ck=fs)),
        ("checkpoint refusals", functools.partial(refusals, ck=fs)),
        ("save tp", functools.partial(save_tp, ck=fs)),
        ("tp -> dp4", functools.partial(load_tp, ck=fs, source="muon-tp", tp=False,
                                        resave="muon-tp-dp4")),
        ("tp -> tp", functools.partial(load_tp, ck=fs, source="muon-tp", tp=True)),
        ("dp4 -> tp", functools.partial(load_tp, ck=fs, source="muon-tp-dp4", tp=True)),
    ]


@pytest.fixture(scope="module")
def world(fsdp2_world4):
    """The cases' results, run in one spawn with the training module's
    (``conftest.fsdp2_world4``)."""
    return fsdp2_world4


def _assert_uninterrupted(params: dict, optimizer: str, what: str) -> None:
    err = H.max_rel_err(params, F.reference(optimizer, 2)["params"])
    assert H.is_close_rel(err), f"{what}, {optimizer}: {err:.2e}"


@pytest.mark.parametrize("case", ["dp2 -> dp4", "zero1 dp2 -> fsdp2 dp4"])
def test_saved_at_dp2_resumes_at_dp4_as_uninterrupted(world, case):
    """A fresh model and optimizer at dp 4 under another plan (other owners and rows) load the
    dp-2 checkpoint (FSDP2's, or ZeRO-1's) and train to 10 steps: every parameter within 1e-5
    of 10 uninterrupted steps, on every rank."""
    for r, got in enumerate(H.results(world, case)):
        for optimizer in HALVES:
            assert got[optimizer]["storage"] == ("zero1" if "zero1" in case else "fsdp2")
            _assert_uninterrupted(got[optimizer]["params"], optimizer, f"{case}, rank {r}")


@pytest.mark.parametrize("case", ["dp4 -> dp2", "fsdp2 dp4 -> zero1 dp2"])
def test_saved_at_dp4_resumes_at_dp2_as_uninterrupted(world, case):
    for r, got in enumerate(H.results(world, case)):
        _assert_uninterrupted(got["params"], got["optimizer"], f"{case}, rank {r}")


def test_state_of_matrices_shared_by_pairs_resumes_as_uninterrupted(world):
    """NorMuon saved at dp 4 with matrices shared by pairs (each member saves its block's
    state: rows of a tall matrix, columns of a wide one) resumes at dp 2 with every matrix
    whole, and with other pairs' blocks: within 1e-5 of 10 uninterrupted steps."""
    got = H.results(world, "dp4 pairs -> dp2")
    assert [g["shared"] for g in got] == [False, False, True, True]
    for r, g in enumerate(got):
        _assert_uninterrupted(g["params"], "normuon", f"dp4 pairs -> dp2, rank {r}")


def test_muon_momentum_is_saved_from_each_ranks_rows(world):
    """Muon's momentum is a DTensor of each rank's rows (at dp 2: 10 rows as 5 and 5, 5 rows
    as 3 and 2)."""
    muon = H.results(world, "save dp2")[:2]
    assert [got["momentum rows"]["blocks.0.fc1.weight"] for got in muon] == [(5, 8), (5, 8)]
    assert [got["momentum rows"]["blocks.0.gate.weight"] for got in muon] == [(3, 8), (2, 8)]


def test_get_state_dict_changes_nothing(world):
    for got in H.results(world, "save dp2"):
        assert got["get_state_dict unchanged"]


def test_another_models_or_kernels_checkpoint_is_refused_everywhere(world):
    for got in H.results(world, "checkpoint refusals"):
        for what in ("model", "kernel"):
            assert got[what].startswith("CheckpointError") and "\n" not in got[what], got[what]
            assert got[f"{what} unchanged"]
        assert "blocks.1.fc1.weight" in got["model"] and "[10, 8]" in got["model"] \
            and "[12, 8]" in got["model"], got["model"]
        assert "Muon" in got["kernel"] and "Shampoo" in got["kernel"], got["kernel"]


@pytest.mark.parametrize("case", ["tp -> dp4", "tp -> tp", "dp4 -> tp"])
def test_a_tp_run_resumes_at_another_dp_and_tp_as_uninterrupted(world, case):
    """Muon saved at dp 2 × tp 2 (each rank its block of every parameter and momentum; TP
    rank 0 alone the blocks TP replicates) resumes at dp 4 without TP, and at dp 2 × tp 2
    under other owners; the dp-4 run's checkpoint at the load resumes at dp 2 × tp 2: every
    parameter within 1e-5 of 10 uninterrupted steps, on every rank."""
    ref = F.reference("muon", 2, tp=True)["params"]
    for r, got in enumerate(H.results(world, case)):
        assert got["saved at"] == ((4, 1) if case == "dp4 -> tp" else (2, 2))
        err = H.max_rel_err(got["params"], ref)
        assert H.is_close_rel(err), f"{case}, rank {r}: {err:.2e}"
