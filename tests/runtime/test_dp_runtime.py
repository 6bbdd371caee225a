"""CanzonaOptimizer on gloo: exactness against one process, real-loop features, error paths.

Every distributed case of a world size runs inside ONE spawn (module-scoped fixtures ``world2``
and ``world4``); the single-process references run here. Newton–Schulz runs in float32 on both
sides (REFERENCE.md §4: torch's bf16 cast makes the summation order visible).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import canzona
import dp_helpers as H
from canzona.runtime.dp import CanzonaOptimizer, PlanMismatchError

pytestmark = pytest.mark.slow


# --- distributed cases (run inside the spawned ranks) ------------------------------------------


def _errors(rank: int, world: int) -> dict:
    """Each error path, in an order every rank follows (each check is collective or local)."""
    out = {}
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)

    def attempt(key, fn):
        try:
            fn()
            out[key] = "no error"
        except PlanMismatchError as exc:
            out[key] = str(exc)

    # fingerprint: a wider fc1 on every rank, then on rank 1 only
    def wider(all_ranks: bool):
        m = H.TinyGPT()
        if all_ranks or rank == 1:
            m.blocks[1].fc1 = torch.nn.Linear(H.DIM, 3 * H.DIM)
        CanzonaOptimizer(m, plan)

    attempt("fingerprint", functools.partial(wider, True))
    attempt("fingerprint_one_rank", functools.partial(wider, False))
    # differing plans across ranks
    other = canzona.plan_model(H.TinyGPT(), dp=world, bucket_size=3000 if rank == 0 else 2000)
    attempt("plans", lambda: CanzonaOptimizer(H.TinyGPT(), other))
    # settings disagreeing with the plan (local checks, after the collective agreement)
    attempt("optimizer", lambda: CanzonaOptimizer(H.TinyGPT(), plan, optimizer="shampoo"))
    attempt("ns_steps", lambda: CanzonaOptimizer(H.TinyGPT(), plan, ns_steps=4))
    # a baseline plan that splits matrices
    from canzona.planner.layout import ParallelSizes
    from canzona.planner.planning import baseline_plan, make_problem
    from canzona.runtime.introspect import inventory

    asc = baseline_plan(make_problem(inventory(H.TinyGPT()), ParallelSizes(world, 1),
                                     bucket_size=3000), "asc", model_source="module")
    attempt("split", lambda: CanzonaOptimizer(H.TinyGPT(), asc))
    return out


def _state_dict(rank: int, world: int) -> dict:
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=world, bucket_size=3000)
    opt = CanzonaOptimizer(model, plan, lr=0.02, ns_dtype=torch.float32)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, H.lr_factor)
    mine = H.rows(rank, world)
    for step in range(3):
        x, y = H.batch(step, 0, world)
        H.loss_fn(model, x[mine], y[mine]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    sd = opt.state_dict()
    fresh = CanzonaOptimizer(H.TinyGPT(), plan, lr=0.5)
    fresh.load_state_dict(sd)
    sd2 = fresh.state_dict()
    same = sd2["param_groups"] == sd["param_groups"] and sd2["state"].keys() == sd["state"].keys()
    for k, st in sd["state"].items():
        for key, v in st.items():
            same = same and torch.equal(v, sd2["state"][k][key])
    # another rank's shard is refused
    sd["canzona"]["dp_rank"] = (rank + 1) % world
    try:
        fresh.load_state_dict(sd)
        wrong = "no error"
    except PlanMismatchError as exc:
        wrong = str(exc)
    return {"same": same, "nonempty": len(sd["state"]) > 0, "lr": opt.param_groups[0]["lr"],
            "wrong_rank": wrong}


CASES = {
    "muon": H.train_canzona,
    "accum": functools.partial(H.train_canzona, accum=2),
    "clip": functools.partial(H.train_canzona, clip=0.2),
    "shampoo": functools.partial(H.train_canzona, optimizer="shampoo"),
    "soap": functools.partial(H.train_canzona, optimizer="soap"),
    "external": functools.partial(H.train_canzona, grad_sync="external"),
    "overlap": functools.partial(H.train_canzona, overlap_param_gather=True),
    "errors": _errors,
    "state_dict": _state_dict,
}
#: Every collective method forced on every bucket (the default picks per bucket).
METHODS = ("padded", "per_root", "all_reduce", "all_to_all")
METHOD_RUN = {"accum": 2, "clip": 0.2, "steps": 4}
CASES.update({f"method_{m}": functools.partial(H.train_canzona, collective=m, **METHOD_RUN)
              for m in METHODS})
CASES4 = {
    "muon": H.train_canzona,
    "accum_clip": functools.partial(H.train_canzona, accum=2, clip=0.2),
    "shampoo": functools.partial(H.train_canzona, optimizer="shampoo"),
}
#: At dp 4 the methods the default rule does not pick for this model (it picks all_to_all for
#: every bucket; padded runs at dp 2).
METHODS4 = ("per_root", "all_reduce", "padded")
CASES4.update({f"method_{m}": functools.partial(H.train_canzona, collective=m, **METHOD_RUN)
               for m in METHODS4})
REFERENCE = {
    "muon": {}, "accum": {"accum": 2}, "clip": {"clip": 0.2}, "shampoo": {"optimizer": "shampoo"},
    "soap": {"optimizer": "soap", "sharded": True}, "external": {}, "overlap": {},
    "accum_clip": {"accum": 2, "clip": 0.2},
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return H.run_world(2, list(CASES.items()), str(tmp_path_factory.mktemp("dp2")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return H.run_world(4, list(CASES4.items()), str(tmp_path_factory.mktemp("dp4")))


@functools.cache
def reference(world: int, case: str) -> dict:
    torch.set_num_threads(1)
    return H.train_reference(world, **REFERENCE[case])


result = H.results


# --- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["muon", "accum", "clip", "shampoo", "soap", "external", "overlap"])
def test_dp2_matches_one_process(world2, case):
    got = result(world2, case)
    ref = reference(2, case)
    for r, res in enumerate(got):
        err = H.rel_err(res["params"], ref["params"])
        assert err <= 1e-5, f"rank {r}: relative error {err:.3g}"
    # every rank ends with bitwise the same parameters
    for res in got[1:]:
        assert all(torch.equal(res["params"][k], got[0]["params"][k]) for k in got[0]["params"])


@pytest.mark.parametrize("case", ["muon", "accum_clip", "shampoo"])
def test_dp4_matches_one_process(world4, case):
    got = result(world4, case)
    ref = reference(4, case)
    for r, res in enumerate(got):
        err = H.rel_err(res["params"], ref["params"])
        assert err <= 1e-5, f"rank {r}: relative error {err:.3g}"


def test_clipping_is_active_and_norms_agree(world2):
    got = result(world2, "clip")
    ref = reference(2, "clip")
    assert min(ref["norms"]) > 0.2  # the clip binds at every step
    for res in got:
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)


def test_unused_parameter_is_not_updated(world2):
    spare = H.TinyGPT().spare.weight.detach()
    for res in result(world2, "muon"):
        assert torch.equal(res["params"]["spare.weight"], spare)


# --- memory -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["muon", "shampoo", "soap"])
def test_state_bytes_match_plan(world2, case):
    for r, res in enumerate(result(world2, case)):
        assert res["state_bytes"] == res["plan"].metrics.dp_state_bytes[r]


def test_state_bytes_match_plan_dp4(world4):
    for r, res in enumerate(result(world4, "muon")):
        assert res["state_bytes"] == res["plan"].metrics.dp_state_bytes[r]


# --- checkpoints and errors ---------------------------------------------------------------------


def test_state_dict_round_trip(world2):
    for res in result(world2, "state_dict"):
        assert res["same"] and res["nonempty"]
        assert res["lr"] == pytest.approx(0.02 * H.lr_factor(3))
        assert "saved by DP rank" in res["wrong_rank"]


def test_error_paths(world2):
    r0, r1 = result(world2, "errors")
    for res in (r0, r1):
        assert "'blocks.1.fc1.weight' has shape [96, 32] in the plan but [64, 32]" in res["fingerprint"] \
            or "'blocks.1.fc1.weight' has shape [64, 32] in the plan but [96, 32]" in res["fingerprint"]
        assert "different plans" in res["plans"]
        assert "optimizer='shampoo' disagrees with the plan" in res["optimizer"]
        assert "ns_steps=4 disagrees with the plan, which was made with ns_steps=5" in res["ns_steps"]
        assert "cuts matrix" in res["split"]
    assert "'blocks.1.fc1.weight'" in r1["fingerprint_one_rank"]
    assert "DP rank(s) [1]" in r0["fingerprint_one_rank"]


# --- single process (no process group) ----------------------------------------------------------


def test_single_process_without_process_group():
    assert not dist.is_initialized()
    torch.set_num_threads(1)
    got = H.train_canzona(0, 1, steps=3)
    ref = H.train_reference(1, steps=3)
    assert H.rel_err(got["params"], ref["params"]) <= 1e-5


def test_refuses_tp_plans_without_groups_and_wrong_dp():
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=2)
    with pytest.raises(PlanMismatchError, match="dp=2 but the data-parallel group has 1"):
        CanzonaOptimizer(model, plan)
    tp_plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={"tp": 2})})
    with pytest.raises(PlanMismatchError, match="pass tp_group="):
        CanzonaOptimizer(model, tp_plan)
    ep_plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={"ep": 2})})
    with pytest.raises(PlanMismatchError, match="ep=2; this runtime executes ep=1"):
        CanzonaOptimizer(model, ep_plan)


@functools.cache
def _method_reference(world: int) -> dict:
    torch.set_num_threads(1)
    return H.train_reference(world, **METHOD_RUN)


@pytest.mark.parametrize("method", METHODS)
def test_every_collective_method_gives_the_same_training(world2, world4, method):
    """Each method, forced on every bucket (accumulation and clipping on), trains as one
    process does, at dp 2 and dp 4."""
    for world, ranks in ((2, world2), (4, world4)):
        if world == 4 and method not in METHODS4:
            continue
        ref = _method_reference(world)
        for res in result(ranks, f"method_{method}"):
            assert set(res["methods"]) == {method}
            assert H.rel_err(res["params"], ref["params"]) <= 1e-5
            assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)
