"""CanzonaOptimizer with TP sub-groups (gloo, dp 2 × tp 4, k = 2): rounds of two alike matrices
of one DP index, each computed by the two strided TP ranks of its slot (``SharedTaskPlan.sub``)
inside the index's shared lockstep, beside matrices the whole TP group shares, against one
process updating the logical matrices.

The tiny model of ``tp_helpers`` with four KV groups (tp 4 divides them) and four layers (each DP
index holds two alike matrices of every kind). The plans: the planner's ``share="sub-groups"``,
and its ``share="all"`` plan with alike matrices paired into rounds beside matrices the whole
TP group shares (:func:`with_rounds`). Every case runs in one 8-rank spawn.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import dp_helpers as H
import tp_helpers as T

pytestmark = pytest.mark.slow

DP, TP, K = 2, 4, 2
#: the tiny model with four KV groups (tp 4 divides them) and four layers
CFG4 = T.CFG.model_copy(update=dict(q_heads=8, kv_heads=4, head_dim=8, layers=4))
#: (optimizer, C_max in MiB, steps, plan): under 1 MiB all of a DP index's shared matrices run
#: as one lockstep batch; under 0.05 MiB every unit (a round, a matrix) alone. The planner's
#: plan (:func:`sub_plan`), and rounds beside matrices the whole TP group shares
#: (:func:`mixed_plan`: in one batch, one round's slots the reverse of plan order)
RUNS = {"muon_sub": ("muon", 1.0, 10, "sub"), "normuon_sub": ("normuon", 0.05, 5, "sub"),
        "muon_mixed": ("muon", 1.0, 5, "mixed")}
#: a matrix of a round without gradient at step 1 of 3 (its round runs for the other one)
UNTOUCHED = ("decoder.layers.2.mlp.linear_fc1.weight", 1)


@contextlib.contextmanager
def tiny4():
    """``tp_helpers`` on :data:`CFG4` (its functions read ``T.CFG`` when called)."""
    real = T.CFG
    T.CFG = CFG4
    try:
        yield
    finally:
        T.CFG = real


def with_rounds(plan):
    """``plan`` (every matrix shared by its TP group) with, per DP index, the two alike
    matrices of every kind but the last made a round of sub-groups of K (slots in plan order,
    reversed for the first round of DP index 1) and the last kind's two left to the TP group,
    one between the first two rounds and one at the end."""
    from canzona.planner.plan import SUB_GROUP_VERSION, SubGroupPlan

    indices = []
    for d, ix in enumerate(plan.tp.indices):
        kinds: dict[int, list] = {}
        for x in ix.shared:
            kinds.setdefault(x.layout, []).append(x)
        assert len(kinds) >= 3 and all(len(v) == TP // K for v in kinds.values()), kinds
        *paired, single = [kinds[lay] for lay in sorted(kinds)]
        if d == 1:
            paired[0] = paired[0][::-1]
        rounds = [[x.model_copy(update={"sub": SubGroupPlan(k=K, round=r, slot=j)})
                   for j, x in enumerate(members)] for r, members in enumerate(paired)]
        shared = rounds[0] + single[:1] + [x for r in rounds[1:] for x in r] + single[1:]
        indices.append(ix.model_copy(update={"shared": tuple(shared)}))
    out = plan.model_copy(update={"schema_version": SUB_GROUP_VERSION,
                                  "tp": plan.tp.model_copy(update={"indices": tuple(indices)})})
    return type(plan).model_validate(out.model_dump())  # a valid plan, as a file would give


def mixed_plan(optimizer: str = "muon", *, cmax_mib: float = 0.05, block: int | None = None):
    """A dp 2 × tp 4 plan of :data:`CFG4` with rounds of TP sub-groups beside matrices the
    whole TP group shares: :func:`with_rounds` of the planner's ``share="all"``."""
    with tiny4():
        plan = T.plan_for(DP, TP, optimizer, share="all", cmax_mib=cmax_mib, block=block)
    assert all(ix.shared for ix in plan.tp.indices), "share='all' shares over the TP group"
    return with_rounds(plan)


def sub_plan(optimizer: str = "muon", *, cmax_mib: float = 0.05):
    """A dp 2 × tp 4 plan of :data:`CFG4` with rounds of TP sub-groups: the planner's
    ``share="sub-groups"`` (every class of alike matrices in rounds of k = 2)."""
    with tiny4():
        plan = T.plan_for(DP, TP, optimizer, share="sub-groups", cmax_mib=cmax_mib)
    assert any(x.sub is not None for ix in plan.tp.indices for x in ix.shared)
    return plan


def rounds_of(plan) -> list[list[tuple[str, tuple[int, int, int]]]]:
    """Per DP index, the (parameter, (k, round, slot)) of its tasks TP sub-groups share."""
    return [[(plan.tasks[x.id].param, (x.sub.k, x.sub.round, x.sub.slot)) for x in ix.shared
             if x.sub is not None] for ix in plan.tp.indices]


# --- the cases, on every rank of the 8-rank world ---------------------------------------------


def _given(plan):
    """``plan`` itself (``train_tp`` takes a callable making its plan)."""
    return plan


def _train(rank, world, *, optimizer, steps, plan, untouched=None):
    """``train_tp`` under ``plan`` (made once, in the parent: :func:`sub_plan` or
    :func:`mixed_plan`), recording the first 16 lockstep batches (per batch, its tasks' names
    and ``sub``)."""
    import warnings

    from canzona.runtime.errors import UnusedParameterWarning
    from canzona.runtime.tp_shared import SharedLockstep

    batches, real = [], SharedLockstep._run_batch

    def spy(self, batch, *args, **kwargs):
        if len(batches) < 16:
            batches.append([(x.name, x.sub) for x in batch])
        return real(self, batch, *args, **kwargs)

    SharedLockstep._run_batch = spy
    try:
        with tiny4(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UnusedParameterWarning)  # untouched: on purpose
            res = T.train_tp(rank, world, dp=DP, tp=TP, optimizer=optimizer, steps=steps,
                             untouched=untouched, plan=functools.partial(_given, plan))
    finally:
        SharedLockstep._run_batch = real
    return {**res, "batches": batches}


def _checkpoint(rank, world, *, folder, plans):
    """Logical checkpoints across TP sub-groups: a momentum saved by the plan whose rounds
    TP sub-groups compute (each rank its own shard of every matrix) loads into the plan that
    hosts every matrix (the host's full matrix), and back; each side holds exactly the
    canonical momentum it was given."""
    import canzona

    with tiny4():
        dp_group, tp_group = T.groups(DP, TP)
        t = rank % TP
        start = T.initial_full()
        ps = T.spec().params
        by_name = {p.name: p for p in ps}
        g = torch.Generator().manual_seed(12)
        moment = {p.name: torch.randn(p.shape, generator=g) for p in ps
                  if p.optimizer == "matrix"}
        shards = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], TP, t), TP))
                  for p in ps]

        def build(which):
            return canzona.CanzonaOptimizer(shards, plans[which], tp_group=tp_group,
                                            dp_group=dp_group, collective_timeout=30)

        def mine(name, full):  # this rank's shard of a shared matrix
            return T.local_of(by_name[name], full, TP, t)

        def momentum(opt, x):
            return opt.state[opt._params[x.param]]["momentum_buffer"]

        out = {}
        opt = build("sub")
        out["subs"] = sorted(opt._micro.subs)
        out["sub_tasks"] = sorted(x.name for x in opt._micro.shared if x.sub is not None)
        for x in opt._micro.shared:
            momentum(opt, x).copy_(mine(x.name, moment[x.name]))
        canzona.save_checkpoint(f"{folder}/sub", None, opt)
        opt.close()
        opt = build("off")
        canzona.load_checkpoint(f"{folder}/sub", None, opt)
        out["to_hosted"] = {x.name: bool(torch.equal(momentum(opt, x), moment[x.name]))
                            for x in opt._micro.hosted if x.part is None}
        for x in opt._micro.hosted:
            if x.part is None:
                momentum(opt, x).copy_(moment[x.name] * 2)
        canzona.save_checkpoint(f"{folder}/hosted", None, opt)
        opt.close()
        opt = build("sub")
        canzona.load_checkpoint(f"{folder}/hosted", None, opt)
        out["to_sub"] = {x.name: bool(torch.equal(momentum(opt, x),
                                                  mine(x.name, moment[x.name] * 2)))
                         for x in opt._micro.shared}
        opt.close()
    return out


#: DP index 1's first round broken in each way (every rank refuses, DP index 0's too)
MALFORMED = {
    "slot": ("sub.slot", lambda xs: [_sub(xs[0], slot=1), _sub(xs[1], slot=0)] + xs[2:]),
    "not_consecutive": ("consecutive in the shared list", lambda xs: xs[:1] + xs[2:] + xs[1:2]),
    "k_is_tp": (".sub.k is 4", lambda xs: [_sub(x, k=4) if x.sub and x.sub.round == 0 else x
                                          for x in xs]),
    "mixed_k": (".sub.k is 3", lambda xs: xs[:1] + [_sub(xs[1], k=3)] + xs[2:]),
    "round_number": (".sub.round is 1", lambda xs: [_sub(x, round=1) if x.sub and
                                                   x.sub.round == 0 else x for x in xs]),
    "partner": (".partner is 0", lambda xs: xs[:1] + [xs[1].model_copy(update={"partner": 0})]
                + xs[2:]),
    "shapes": ("a round's matrices are alike", lambda xs: xs[:1] + [xs[1].model_copy(
        update={"layout": next(y.layout for y in xs if y.layout != xs[0].layout)})] + xs[2:]),
}


def _sub(x, **update):
    return x.model_copy(update={"sub": x.sub.model_copy(update=update)})


def _broken(plan, how):
    ix = plan.tp.indices[1]
    assert ix.shared[0].sub is not None and ix.shared[1].sub is not None
    shared = tuple(MALFORMED[how][1](list(ix.shared)))
    indices = plan.tp.indices[:1] + (ix.model_copy(update={"shared": shared}),)
    return plan.model_copy(update={"tp": plan.tp.model_copy(update={"indices": indices})})


def _refusals(rank, world, *, good, shampoo):
    """Each malformed plan refused on every rank alike, before any collective (every
    collective of ``torch.distributed`` spied on); a Shampoo plan with rounds too."""
    import torch.distributed as dist

    import canzona
    from canzona.runtime.errors import PlanMismatchError

    names = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
             "broadcast", "broadcast_object_list", "all_to_all_single", "reduce_scatter_tensor",
             "barrier", "new_group", "new_subgroups_by_enumeration", "send", "recv")
    with tiny4():
        dp_group, tp_group = T.groups(DP, TP)
        start = T.initial_full()
        shards = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], TP, rank % TP), TP))
                  for p in T.spec().params]
        plans = {how: _broken(good, how) for how in MALFORMED}
        plans["shampoo"] = shampoo
    called, real = [], {n: getattr(dist, n) for n in names}

    def spy(name):
        def call(*args, **kwargs):
            called.append(name)
            return real[name](*args, **kwargs)
        return call

    out = {}
    for n in names:
        setattr(dist, n, spy(n))
    try:
        for how, plan in plans.items():  # (the error, the collectives called before it)
            called.clear()
            try:
                canzona.CanzonaOptimizer(shards, plan, tp_group=tp_group,
                                         dp_group=dp_group).close()
                out[how] = ("no error", list(called))
            except PlanMismatchError as exc:
                out[how] = (str(exc), list(called))
    finally:
        for n in names:
            setattr(dist, n, real[n])
    return out


def cases(folder: str) -> list:
    """Every case, its plans made here once (not on each of the 8 ranks)."""
    make = {"sub": sub_plan, "mixed": mixed_plan}
    out = [(name, functools.partial(_train, optimizer=o, steps=s,
                                    plan=make[p](o, cmax_mib=c)))
           for name, (o, c, s, p) in RUNS.items()]
    out.append(("untouched", functools.partial(_train, optimizer="muon", steps=3,
                                               plan=sub_plan(), untouched=UNTOUCHED)))
    with tiny4():
        off = T.plan_for(DP, TP, share="off")
    out.append(("checkpoint", functools.partial(_checkpoint, folder=folder,
                                                plans={"sub": sub_plan(), "off": off})))
    out.append(("refusals", functools.partial(_refusals, good=mixed_plan(),
                                              shampoo=mixed_plan("shampoo", block=8))))
    return out


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    """Every case in ONE 8-rank spawn."""
    folder = str(tmp_path_factory.mktemp("sub-ck"))
    return H.run_world(DP * TP, cases(folder), str(tmp_path_factory.mktemp("sub")))


# --- the tests ---------------------------------------------------------------------------------


def _max_error(got, ref) -> float:
    """The largest relative error of any rank's logical parameters against the reference, and
    every parameter moved."""
    start = T.initial_full()
    err = max(H.max_rel_err(res["params"], ref["params"]) for res in got)
    for name in ref["params"]:
        assert not torch.equal(got[0]["params"][name], start[name]), name
    return err


@pytest.mark.parametrize("make", [sub_plan, mixed_plan])
def test_the_plans_have_rounds_of_sub_groups(make):
    plan = make()
    rounds = rounds_of(plan)
    assert all(len(r) >= TP // K for r in rounds), rounds
    for members in rounds:
        assert all(sub[0] == K for _, sub in members)
        assert [sub[2] for _, sub in members] == [j % (TP // K) for j in range(len(members))]
    if make is mixed_plan:  # rounds beside TP-group matrices, one's slots reversed
        assert all(len(r) < len(ix.shared) for r, ix in zip(rounds, plan.tp.indices))
        assert rounds[1][0][0] == "decoder.layers.1.self_attention.linear_proj.weight"


@pytest.mark.parametrize("case", list(RUNS))
def test_sub_groups_equal_one_process(world8, case):
    optimizer, _, steps, _ = RUNS[case]
    got = H.results(world8, case)
    with tiny4():
        ref = T.reference(DP, optimizer, steps=steps)
        err = _max_error(got, ref)
    print(f"{case}: max relative error {err:.3g}")
    assert err <= 1e-5, f"{case}: relative error {err:.3g}"
    plan = got[0]["plan"]
    assert any(rounds_of(plan)), "the run's plan has rounds"
    for res in got:  # the lockstep ran every round whole, in one batch
        subs = [[s for _, s in b if s is not None] for b in res["batches"]]
        assert any(subs)
        for b in subs:
            assert len(b) % (TP // K) == 0 and [s[2] for s in b] == \
                [j % (TP // K) for j in range(len(b))], b
        if case == "muon_mixed":  # rounds beside TP-group matrices in one batch
            assert any(any(s is None for _, s in b) and any(s for _, s in b)
                       for b in res["batches"]), res["batches"]
        st = res["state"]  # a matrix's state stays on its shards, as the plan counts it
        assert st["measured"] == st["predicted"] == st["from_plan"], st
        ix = plan.tp.indices[res["dp_rank"]]
        if RUNS[case][1] == 1.0 and not ix.groups:  # one batch: the scratch of every unit
            assert res["scratch"] == _scratch(plan, ix) <= 2 * plan.tp.cmax_bytes


def _scratch(plan, ix) -> int:
    """The fp32 scratch of all of a DP index's shared matrices in one lockstep batch: each
    round's ``sub_round_bytes`` (once per round), each other matrix's ``lockstep_bytes``."""
    from canzona.planner.formulas import lockstep_bytes, sub_round_bytes

    total = 0
    for x in ix.shared:
        m, n = max(plan.tasks[x.id].shape), min(plan.tasks[x.id].shape)
        if x.sub is None:
            total += lockstep_bytes(-(-m // TP), n, TP, x.split_poly, 4)
        elif x.sub.slot == 0:
            total += sub_round_bytes(m, n, TP, x.sub.k, x.split_poly, 4)
    return total


def test_a_round_with_one_matrix_without_gradient(world8):
    """A matrix of a round that no rank has a gradient for at a step is neither updated nor has
    its momentum moved, while the other matrix of its round is updated: equal to the
    reference through the following step."""
    got = H.results(world8, "untouched")
    assert any(UNTOUCHED[0] in [n for n, s in b if s is not None]
               for res in got for b in res["batches"]), "the matrix is in a round"
    with tiny4():
        err = _max_error(got, T.reference(DP, "muon", steps=3, untouched=UNTOUCHED))
    assert err <= 1e-5, f"relative error {err:.3g}"


def test_logical_checkpoints_cross_sub_groups(world8):
    got = H.results(world8, "checkpoint")
    hosted = set()
    for res in got:
        assert res["subs"] == [K] and res["sub_tasks"], res
        assert res["to_hosted"] and all(res["to_hosted"].values()), res["to_hosted"]
        assert res["to_sub"] and all(res["to_sub"].values()), res["to_sub"]
        hosted |= set(res["to_hosted"])
    assert len(hosted) == 16  # the hosts of the eight ranks hold every matrix between them


@pytest.mark.parametrize("how", [*MALFORMED, "shampoo"])
def test_a_malformed_round_is_refused_before_any_collective(world8, how):
    """DP index 1's first round broken (DP index 0's ranks refuse too: a rank checks every
    index's rounds), or a Shampoo plan listing rounds (DP index 0's first)."""
    want, where = ((MALFORMED[how][0], "tp.indices[1].shared[") if how in MALFORMED
                   else ("but shampoo shares no Newton", "tp.indices[0].shared[0].sub"))
    for res in H.results(world8, "refusals"):
        error, collectives = res[how]
        assert want in error and where in error and not collectives, (error, collectives)
