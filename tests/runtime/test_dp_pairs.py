"""Muon matrices shared by two DP ranks (DP pairs; gloo, tp = 1, dp = 4), against
one process updating the whole matrices.

A shared matrix's bucket is cut inside it at a row boundary: each of the two DP ranks holds a
row block of its gradient and momentum, both run shared Newton–Schulz over the pair's process
group and apply their rows. The plans come from ``canzona plan --share all/all-split`` (the
planner keeps a pair where the polished cuts separate the pieces: QKV and the square output
projection here) and from :func:`forced_plan`, which moves cuts between the pieces of the fused
gate/up (``linear_fc1``), QKV (tall) and ``linear_fc2`` (wide: its row blocks are swapped for
column blocks around the iteration) by hand and checks the result is a valid plan. Newton–Schulz
runs in fp32 on both sides, so the only differences are summation order.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dp_helpers as H
import tp_helpers as T

pytestmark = pytest.mark.slow

DP = 4


FORCED = ("linear_fc1", "linear_qkv", "linear_fc2")  # fused gate/up and QKV (tall), fc2 (wide)


def forced_plan(kinds: tuple[str, ...] = FORCED, split: bool = True,
                bf16: bool = False, optimizer: str = "muon"):
    """A valid dp-4 plan in which every task of ``kinds`` is shared by two adjacent DP
    indices: the planner's own cuts (each task's pieces on one index), then, per task, the cut
    after its owner moved to the row boundary between its pieces (the next index takes the
    second piece and what followed it in the owner's range)."""
    from canzona import load_plan
    from canzona.planner import DPOptions, OptimizerSettings, ParallelSizes
    from canzona.planner.solve import solve
    from canzona.planner.hardware import load_hardware
    from canzona.planner.inventory import build_inventory
    from canzona.planner.plan import SolverOptions
    from canzona.planner.plan.build import build_plan
    from canzona.planner.planning import make_problem, owner_of, pair_owners
    from canzona.planner.sharing import pair_decision, with_pairs

    cfg = T.CFG.model_copy(update={"dtype": "bf16" if bf16 else "fp32"})
    problem = make_problem(build_inventory(cfg), ParallelSizes(dp=DP, tp=1),
                           OptimizerSettings(name=optimizer), bucket_size=20_000,
                           comm_dtype="fp32")
    sol = solve(problem, DPOptions(bucket_size=20_000))
    hw = load_hardware("h100")
    pairs = {i: x for i, x in pair_decision(sol.problem, hw, "all-split" if split else "all")
             .items() if problem.tasks[i].param.split(".")[-2] in kinds}
    shared = with_pairs(sol.problem, pairs)
    cuts = {k: list(c) for k, c in sol.cuts.items()}
    for b in shared.buckets:
        c = cuts[(b.buffer, b.bucket)]
        for first, second in zip(b.items, b.items[1:]):
            if first.tasks != second.tasks or first.tasks[0] not in pairs:
                continue
            d = owner_of(c, first.start)
            if owner_of(c, second.start) != d:
                continue
            if d + 1 < DP and c[d + 2] >= second.end:  # d + 1 takes the second piece on
                c[d + 1] = second.start
            elif d > 0 and c[d - 1] <= first.start:  # d − 1 takes what precedes it
                c[d] = second.start
    cuts = {k: tuple(c) for k, c in cuts.items()}
    owners = pair_owners(shared, cuts)
    kept = {i: x for i, x in pairs.items() if owners[i][0] != owners[i][1]}
    plan = build_plan(with_pairs(sol.problem, kept), cuts,
                      solver=SolverOptions(strategy="canzona", solver="none"))
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # written and read back: a valid plan
        path = os.path.join(tmp, "forced.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        return load_plan(path)


def bundle_plan(split: bool = True):
    """A dp-4 plan from the bundle stage (``planner.sharing``: the DP pair search): DP indices
    paired (0, 1) and (2, 3) up front, each pair sharing several matrices in one lockstep, the
    buckets' parameters reordered by DP index (the shared one at the boundary between the
    partners)."""
    import os
    import tempfile

    from canzona import load_plan
    from canzona.planner import OptimizerSettings, ParallelSizes
    from canzona.planner.hardware import LinkProfile, load_hardware
    from canzona.planner.inventory import build_inventory
    from canzona.planner.plan import SolverOptions
    from canzona.planner.plan.build import build_plan
    from canzona.planner.planning import make_problem
    from canzona.planner.sharing import bundle_pairs, pair_decision

    problem = make_problem(build_inventory(T.CFG), ParallelSizes(dp=DP, tp=1),
                           OptimizerSettings(name="muon"), bucket_size=20_000,
                           comm_dtype="fp32")
    # exchanges nearly free (this model's matrices are tiny beside an NVLink latency), so
    # the search shares what evens the loads out
    h100 = load_hardware("h100")
    hw = h100.model_copy(update={"intra_node": LinkProfile(busbw=1e15, latency_s=0.0)})
    # (without the split the ILP start finds whole matrices lighter here: the moves' start)
    got = bundle_pairs(problem, pair_decision(problem, hw, "all-split" if split else "all"), hw,
                       pattern=split)
    assert got is not None
    plan = build_plan(*got, solver=SolverOptions(strategy="canzona", solver="none",
                                                 reorder=True))
    with tempfile.TemporaryDirectory() as tmp:  # written and read back: a valid plan
        path = os.path.join(tmp, "bundles.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        return load_plan(path)


BLOCK = 32  # Shampoo's max_preconditioner_dim here: every matrix has two block rows or more


def shampoo_plan(share: str = "all"):
    """Shampoo at dp 4 with ``--share all``: each matrix's block rows hosted by two DP ranks
    (the cut between two block rows), each piece preconditioned alone (``off``: whole)."""
    from canzona.planner import DPOptions, OptimizerSettings, ParallelSizes, TPOptions
    from canzona.planner.pipeline import plan as make_plan

    settings = OptimizerSettings(name="shampoo", max_preconditioner_dim=BLOCK,
                                 shampoo_precondition_frequency=3)
    return make_plan(T.CFG, ParallelSizes(dp=DP, tp=1), settings,
                     dp_options=DPOptions(bucket_size=20_000),
                     tp_options=TPOptions(share=share, comm_dtype="fp32"))


CASES = {
    # the planner's plans: every eligible matrix shared where the cuts separate its pieces
    "all": dict(share="all"),
    "all_split_roundtrip": dict(share="all-split", roundtrip=True),
    # fused gate/up and QKV shared by construction, with and without the polynomial split
    "forced_split": dict(plan=functools.partial(forced_plan, split=True)),
    "forced": dict(plan=functools.partial(forced_plan, split=False), accum=2, clip=0.05),
    "forced_bf16": dict(plan=functools.partial(forced_plan, bf16=True), bf16=True, steps=5),
    # NorMuon: each partner's rows normalised by their own moments, the two norms summed
    "normuon_forced": dict(optimizer="normuon", roundtrip=True, steps=5,
                           plan=functools.partial(forced_plan, optimizer="normuon")),
    # pairs as bundles: several matrices per pair in one lockstep, on a reordered layout
    "bundles": dict(plan=bundle_plan, roundtrip=True),
    "bundles_nosplit": dict(plan=functools.partial(bundle_plan, split=False), accum=2),
    # Shampoo (item 3): block rows hosted apart, against the same blocks hosted whole
    "shampoo_blocks": dict(optimizer="shampoo", plan=shampoo_plan, roundtrip=True),
    "shampoo_whole": dict(optimizer="shampoo", plan=functools.partial(shampoo_plan, "off")),
}
#: Megatron's fused QKV is stored grouped per KV group; with several block rows Shampoo's
#: blocks of the stored matrix are not the canonical matrix's (Muon does not care: it is
#: equivariant under row permutations), so the one-process reference differs there.
LAYOUT = "linear_qkv"
SAME_MATH = ("roundtrip", "share", "plan")


def _case(rank, world, **kw):
    out = T.train_tp(rank, world, dp=DP, tp=1, **kw)
    plan = out.pop("plan")
    out["pairs"] = [(plan.tasks[x.id].param, tuple(x.owners), x.split_poly)
                    for x in plan.dp_shared]
    return out


def _nonfinite(rank, world):
    """A NaN in one piece's gradient: both partners skip the matrix (nonfinite='skip' agreed
    over DP) and the other matrices still update."""
    import warnings

    import canzona
    import dp_helpers  # noqa: F401

    plan = forced_plan()
    ps = T.spec().params
    start = T.initial_full()
    local = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 1, 0), 1)) for p in ps]
    dp_group, _ = T.groups(DP, 1)
    opt = canzona.CanzonaOptimizer(local, plan, lr=0.02, ns_dtype=torch.float32,
                                   dp_group=dp_group, matrix_options={"nonfinite": "skip"})
    x = plan.dp_shared[0]
    name = plan.tasks[x.id].param
    grads = []
    for p, (n, w) in zip(ps, local):
        g = torch.full_like(w, 0.01)
        if n == name and rank == x.owners[1]:
            g[-1, -1] = float("nan")  # in the second piece's rows, on its holder only
        grads.append(g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.autograd.backward([w for _, w in local], grads)
        opt.step()
    out = {p.name: bool(torch.equal(w.detach(), T.local_of(p, start[p.name], 1, 0)))
           for p, (_, w) in zip(ps, local)}
    opt.close()
    return {"name": name, "unchanged": out}


def _checkpoint(rank, world, *, folder):
    """Logical checkpoints across DP pairs: a momentum saved by the forced plan (the pair's two
    ranks each hold their rows) loads into the plan without pairs (owners hold whole
    matrices), and back; each rank then holds exactly the canonical rows it owns."""
    import canzona

    dp_group, _ = T.groups(DP, 1)
    ps = T.spec().params
    start = T.initial_full()
    g = torch.Generator().manual_seed(5)
    moment = {p.name: torch.randn(p.shape, generator=g) for p in ps if p.optimizer == "matrix"}
    local = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 1, 0), 1)) for p in ps]

    def build(plan):
        return canzona.CanzonaOptimizer(local, plan, dp_group=dp_group)

    def momenta(opt):  # (name, first row, its momentum rows) of every task this rank owns
        return [(t.name, t.row0, opt.state[opt._params[t.param]]["momentum_buffer"])
                for ts in opt._schedule.mine.matrix for t in ts]

    def holds(opt, scale):
        return {f"{n}@{r0}": bool(torch.equal(m, scale * moment[n][r0:r0 + m.shape[0]]))
                for n, r0, m in momenta(opt)}

    def fill(opt, scale):
        for n, r0, m in momenta(opt):
            m.copy_(scale * moment[n][r0:r0 + m.shape[0]])

    def pieces(opt):
        return sum(1 for ts in opt._schedule.mine.matrix for t in ts if t.pair)

    return _across(lambda: build(forced_plan()), lambda: build(T.plan_for(DP, 1)), fill, holds,
                   pieces, f"{folder}/pairs")


def _across(split, whole, fill, check, pieces, folder) -> dict:
    """Save under the plan that splits matrices over DP pairs, load under the one that keeps
    them whole (``to_whole``: what each rank holds), change the values, and back (``to_split``)."""
    import canzona

    out = {}
    opt = split()
    out["pieces"] = pieces(opt)
    fill(opt, 1)
    for scale, then, key in ((1, whole, "to_whole"), (2, split, "to_split")):
        canzona.save_checkpoint(f"{folder}-{key}", None, opt)
        opt.close()
        opt = then()
        canzona.load_checkpoint(f"{folder}-{key}", None, opt)
        out[key] = check(opt, scale)
        fill(opt, 2)  # (what the way back saves)
    opt.close()
    return out


def _shampoo_checkpoint(rank, world, *, folder):
    """Logical checkpoints across Shampoo's hosting: state saved with a matrix's block rows on
    two ranks loads into the plan that keeps it whole, and back, key for key."""
    import canzona

    dp_group, _ = T.groups(DP, 1)
    ps = T.spec().params
    start = T.initial_full()
    local = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 1, 0), 1)) for p in ps]

    def build(share):
        return canzona.CanzonaOptimizer(local, shampoo_plan(share), dp_group=dp_group,
                                        matrix_options=T.SHAMPOO_OPTIONS)

    def state(opt):
        return [(t, opt.state[opt._params[t.param]]) for ts in opt._schedule.mine.matrix
                for t in ts]

    def fill(opt, scale):
        for t, st in state(opt):
            full = want_of(t.name)
            for key, x in st.items():
                x.copy_(scale * _value(full, key, t, x))

    def check(opt, scale):
        return {f"{t.name}@{t.row0}.{key}": bool(torch.equal(x, scale * _value(
            want_of(t.name), key, t, x))) for t, st in state(opt) for key, x in st.items()}

    cache = {}

    def want_of(name):
        """The whole matrix's state (as stored: QKV in Megatron's row order), seeded."""
        if name not in cache:
            from canzona.runtime.optim import Shampoo, ShampooConfig

            k = Shampoo(ShampooConfig(max_preconditioner_dim=BLOCK, **T.SHAMPOO_OPTIONS))
            p = next(p for p in ps if p.name == name)
            import zlib

            seed = zlib.crc32(name.encode())
            g = torch.Generator().manual_seed(seed)
            cache[name] = {key: torch.randn(v.shape, generator=g) if v.dim()
                           else torch.tensor(float(seed % 97 + 1))
                           for key, v in k.init_state(tuple(p.shape)).items()}
        return cache[name]

    def pieces(opt):
        return sum(1 for t, _ in state(opt) if t.shape[0] < want_of(t.name)["exp_avg"].shape[0])

    return _across(lambda: build("all"), lambda: build("off"), fill, check, pieces,
                   f"{folder}/blocks")


def _value(full: dict, key: str, t, x):
    """What a task holds of the whole matrix's state ``full`` under ``key``."""
    parts = key.split(".")
    if len(parts) == 3:
        return full[f"{parts[0]}.{int(parts[1]) + t.row0 // BLOCK}.{parts[2]}"]
    if key == "step":
        return full["step"]
    return full[key][t.row0:t.row0 + t.shape[0]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cases = [(k, functools.partial(_case, **v)) for k, v in CASES.items()]
    folder = str(tmp_path_factory.mktemp("pairs-ck"))
    cases += [("nonfinite", _nonfinite),
              ("checkpoint", functools.partial(_checkpoint, folder=folder)),
              ("shampoo_checkpoint", functools.partial(_shampoo_checkpoint, folder=folder))]
    return H.run_world(DP, cases, str(tmp_path_factory.mktemp("pairs")))


def test_logical_checkpoints_across_pairs(world):
    got = H.results(world, "checkpoint")
    assert sum(res["pieces"] for res in got) >= 4  # the forced plan has pairs
    for res in got:
        assert all(res["to_whole"].values()), res["to_whole"]
        assert all(res["to_split"].values()), res["to_split"]
    assert sum(len(res["to_split"]) for res in got) > 0


def test_bundle_plan_pairs_fixed_partners_with_several_matrices():
    plan = bundle_plan()
    per_pair: dict[tuple[int, int], int] = {}
    for x in plan.dp_shared:
        per_pair[tuple(x.owners)] = per_pair.get(tuple(x.owners), 0) + 1
    assert set(per_pair) <= {(0, 1), (2, 3)} and max(per_pair.values()) >= 2, per_pair
    assert plan.inputs.solver.reorder and {x.phase for x in plan.dp_shared} == {0}


def test_forced_plan_shares_gate_up_and_qkv():
    plan = forced_plan()
    kinds = {plan.tasks[x.id].param.split(".")[-2] for x in plan.dp_shared}
    assert kinds == set(FORCED)
    assert plan.schema_version == 4
    for x in plan.dp_shared:
        assert x.owners[1] == x.owners[0] + 1 and x.split_poly


@pytest.mark.parametrize("case", list(CASES))
def test_dp_pairs_equal_one_process(world, case):
    kw = {k: v for k, v in CASES[case].items() if k not in SAME_MATH}
    got = H.results(world, case)
    shampoo = kw.get("optimizer") == "shampoo"
    assert bool(got[0]["pairs"]) == (case != "shampoo_whole"), got[0]["pairs"]
    if case.startswith("forced"):
        assert {p.split(".")[-2] for p, _, _ in got[0]["pairs"]} == set(FORCED)
    ref = T.reference(DP, **kw, block=BLOCK if kw.get("optimizer") == "shampoo" else None)
    tol = 2e-4 if kw.get("bf16") else 1e-5
    start = T.initial_full()
    for res in got:
        for name, want in ref["params"].items():
            if shampoo and LAYOUT in name:
                continue  # the stored rows are not the canonical ones (checked below)
            err = ((res["params"][name] - want).norm() / want.norm()).item()
            assert err <= tol, f"{name}: relative error {err:.3g}"
        # the optimizer state each rank holds is what the plan predicts (pieces: their rows)
        assert res["state"]["measured"] == res["state"]["predicted"] == res["state"]["from_plan"]
    for name in ref["params"]:
        assert not torch.equal(got[0]["params"][name], start[name]), name
    if kw.get("clip"):
        for res in got:
            assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)


def test_a_nonfinite_piece_skips_the_matrix_on_both_partners(world):
    got = H.results(world, "nonfinite")
    for res in got:
        unchanged = res["unchanged"]
        assert unchanged[res["name"]]  # skipped on every rank (both partners included)
        assert sum(unchanged.values()) == 1  # every other parameter moved


def test_shampoo_blocks_hosted_apart_equal_the_whole_kernel(world):
    """Blocks are preconditioned independently: the pieces give the whole matrix's update (QKV
    included, in its stored row order; the two plans' reduce-scatters sum the gradients in
    other orders, so not bit for bit)."""
    apart, whole = H.results(world, "shampoo_blocks"), H.results(world, "shampoo_whole")
    assert any(LAYOUT in p for p, _, _ in apart[0]["pairs"])
    for a, w in zip(apart, whole):
        for name, x in w["params"].items():
            err = ((a["params"][name] - x).norm() / x.norm()).item()
            assert err <= 1e-5, f"{name}: relative error {err:.3g}"


def test_logical_checkpoints_across_shampoo_hosting(world):
    got = H.results(world, "shampoo_checkpoint")
    assert sum(res["pieces"] for res in got) >= 4
    for res in got:
        assert res["to_whole"] and all(res["to_whole"].values()), \
            [k for k, v in res["to_whole"].items() if not v]
        assert res["to_split"] and all(res["to_split"].values()), \
            [k for k, v in res["to_split"].items() if not v]
