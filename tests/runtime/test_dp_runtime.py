"""CanzonaOptimizer on gloo: exactness against one process, real-loop features, error paths.

Every distributed case of a world size runs inside ONE spawn (module-scoped fixtures ``world2``
and ``world4``); the single-process references run here. Newton–Schulz runs in float32 on both
sides (torch's bf16 cast makes the summation order visible).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import canzona
import dp_helpers as H
from canzona.planner import comm as comm_model
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.optimizer import CanzonaOptimizer

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
    from canzona.planner.plan.build import baseline_plan
    from canzona.planner.planning import make_problem
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


class _Stack(torch.nn.Module):
    """Four 64×64 matrices: the planner gives each rank whole, equal slices (method ``equal``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _stack_loss(model: torch.nn.Module, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(H.GLOBAL_BATCH, 64, generator=g)
    t = torch.randn(H.GLOBAL_BATCH, 64, generator=g)
    mine = H.rows(rank, world)
    return torch.nn.functional.mse_loss(model(x[mine]), t[mine])


def _tiny_loss(model: torch.nn.Module, rank: int, world: int) -> torch.Tensor:
    x, y = H.batch(0, 0, world)
    mine = H.rows(rank, world)
    return H.loss_fn(model, x[mine], y[mine])


#: The torch.distributed calls of canzona.runtime.storage.collectives and what each one's
#: payload is.
_SPIED = ("all_to_all_single", "reduce", "broadcast", "all_reduce")


def _payload(op: str, args: tuple, kw: dict) -> dict:
    if op in ("reduce_scatter", "all_gather"):  # (output, input)
        return {"out": args[0].numel(), "in": args[1].numel()}
    if op == "all_to_all_single":
        return {"out": args[0].numel(), "in": args[1].numel(),
                "out_splits": list(kw["output_split_sizes"]),
                "in_splits": list(kw["input_split_sizes"])}
    if op == "reduce":
        return {"numel": args[0].numel(), "root": kw["group_dst"]}
    if op == "broadcast":
        return {"numel": args[0].numel(), "root": kw["group_src"]}
    return {"numel": args[0].numel()}  # all_reduce


class _DistSpy:
    """Stands in for ``torch.distributed`` inside ``canzona.runtime.storage.collectives`` only:
    records the payload of every collective that module launches (tagged with the bucket and
    phase being launched), then makes the real call."""

    def __init__(self, real, log: list, where: list) -> None:
        self._real, self._log, self._where = real, log, where

    def record(self, op: str, fn):
        def call(*args, **kw):
            self._log.append({"bucket": self._where[0], "phase": self._where[1], "op": op,
                              **_payload(op, args, kw)})
            return fn(*args, **kw)
        return call

    def __getattr__(self, name: str):
        attr = getattr(self._real, name)
        return self.record(name, attr) if name in _SPIED else attr


def _spied_step(model, plan, method, loss_of, rank: int, world: int) -> dict:
    """One optimizer step with every collective of ``canzona.runtime.storage.collectives`` recorded;
    each bucket's reduced (averaged) gradient slice and gathered parameter buffer kept."""
    from canzona.runtime.storage import collectives as C

    opt = CanzonaOptimizer(model, plan, lr=0.02, ns_dtype=torch.float32, collective=method)
    log: list = []
    where = [None, None]
    spy = _DistSpy(dist, log, where)
    own: dict[int, torch.Tensor] = {}
    for k, c in enumerate(opt._storage.collectives):
        def tagged(fn, phase, k=k):
            def start(group):
                where[:] = [k, phase]
                try:
                    return fn(group)
                finally:
                    where[:] = [None, None]
            return start

        def finish(fn=c.finish_reduce, buf=c.buffers, k=k):
            fn()
            own[k] = buf.own.clone()

        c._start_reduce = tagged(c._start_reduce, "reduce")
        c._start_gather = tagged(c._start_gather, "gather")
        c.finish_reduce = finish
    saved = C.dist, C._reduce_scatter, C._all_gather
    C.dist = spy
    C._reduce_scatter = spy.record("reduce_scatter", saved[1])
    C._all_gather = spy.record("all_gather", saved[2])
    try:
        loss_of(model, rank, world).backward()
        opt.step()
        opt.wait_params()
    finally:
        C.dist, C._reduce_scatter, C._all_gather = saved
    opt.finish()
    return {"calls": log, "methods": opt.collective_methods,
            "own": [own[k] for k in range(len(opt._storage.collectives))],
            "params": [c.buffers.params.clone() for c in opt._storage.collectives]}


#: Methods forced on every bucket in the payload case (None: each bucket's plan method).
PAYLOAD_METHODS = (None, "padded", "per_root", "all_reduce", "all_to_all")


def _payloads(rank: int, world: int) -> dict:
    """One step per method on TinyGPT's plan (uneven slices: padded and, at dp 4, per_root by
    the plan) and on ``_Stack``'s (equal slices: equal by the plan), every collective recorded."""
    out: dict = {}
    for kind, make, loss_of, bucket_size in (("tiny", lambda: H.TinyGPT(spare=False), _tiny_loss,
                                              3000),
                                             ("stack", _Stack, _stack_loss, None)):
        plan = canzona.plan_model(make(), dp=world, bucket_size=bucket_size)
        out[kind, "plan"] = plan
        for method in PAYLOAD_METHODS:
            out[kind, method] = _spied_step(make(), plan, method, loss_of, rank, world)
    try:
        CanzonaOptimizer(H.TinyGPT(spare=False), out["tiny", "plan"], collective="equal")
        out["equal_refused"] = "no error"
    except ValueError as exc:
        out["equal_refused"] = str(exc)
    return out


CASES = {
    "muon": H.train_dp,
    "accum": functools.partial(H.train_dp, accum=2),
    "clip": functools.partial(H.train_dp, clip=0.2),
    "shampoo": functools.partial(H.train_dp, optimizer="shampoo"),
    "soap": functools.partial(H.train_dp, optimizer="soap"),
    "external": functools.partial(H.train_dp, grad_sync="external"),
    "overlap": functools.partial(H.train_dp, overlap_param_gather=True),
    "errors": _errors,
    "state_dict": _state_dict,
    "payloads": _payloads,
}
#: Every collective method forced on every bucket (the default picks per bucket).
METHODS = ("padded", "per_root", "all_reduce", "all_to_all")
METHOD_RUN = {"accum": 2, "clip": 0.2, "steps": 4}
CASES.update({f"method_{m}": functools.partial(H.train_dp, collective=m, **METHOD_RUN)
              for m in METHODS})
CASES4 = {
    "muon": H.train_dp,
    "accum_clip": functools.partial(H.train_dp, accum=2, clip=0.2),
    "shampoo": functools.partial(H.train_dp, optimizer="shampoo"),
    "payloads": _payloads,
}
#: At dp 4 the methods this model's plan does not pick (its buckets move by padded, per_root and
#: equal in the dp 4 cases above; the "payloads" case checks every method's calls).
METHODS4 = ("all_reduce", "all_to_all")
CASES4.update({f"method_{m}": functools.partial(H.train_dp, collective=m, **METHOD_RUN)
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


# --- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["muon", "accum", "clip", "shampoo", "soap", "external",
                                  "overlap"])
def test_dp2_matches_one_process(world2, case):
    got = H.results(world2, case)
    ref = reference(2, case)
    for r, res in enumerate(got):
        err = H.max_rel_err(res["params"], ref["params"])
        assert err <= 1e-5, f"rank {r}: relative error {err:.3g}"
    # every rank ends with bitwise the same parameters
    for res in got[1:]:
        assert all(torch.equal(res["params"][k], got[0]["params"][k]) for k in got[0]["params"])


@pytest.mark.parametrize("case", ["muon", "accum_clip", "shampoo"])
def test_dp4_matches_one_process(world4, case):
    got = H.results(world4, case)
    ref = reference(4, case)
    for r, res in enumerate(got):
        err = H.max_rel_err(res["params"], ref["params"])
        assert err <= 1e-5, f"rank {r}: relative error {err:.3g}"


def test_clipping_is_active_and_norms_agree(world2):
    got = H.results(world2, "clip")
    ref = reference(2, "clip")
    assert min(ref["norms"]) > 0.2  # the clip binds at every step
    for res in got:
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)


def test_unused_parameter_is_not_updated(world2):
    spare = H.TinyGPT().spare.weight.detach()
    for res in H.results(world2, "muon"):
        assert torch.equal(res["params"]["spare.weight"], spare)


# --- memory -----------------------------------------------------------------------------------


def _cut_adamw_pieces(plan, r: int) -> int:
    """AdamW tensors cut across DP ranks that rank ``r`` holds a piece of: each has a step
    counter on every rank holding a piece, which the plan shares among them by elements."""
    adamw = {t.param for t in plan.tasks if t.optimizer == "adamw"}
    n = 0
    for buf in plan.buffers:
        for b in buf.buckets:
            lo, hi = b.cuts[r], b.cuts[r + 1]
            for s in b.slots:
                if s.name in adamw and s.start < hi and lo < s.end and not lo <= s.start < \
                        s.end <= hi:
                    n += 1
    return n


def _state_matches(res, r: int) -> None:
    """The measured state is the plan's, within 4 bytes per cut AdamW tensor (its counter)."""
    extra = res["state_bytes"] - res["plan"].metrics.dp_state_bytes[r]
    assert 0 <= extra <= 4 * _cut_adamw_pieces(res["plan"], r), extra


@pytest.mark.parametrize("case", ["muon", "shampoo", "soap"])
def test_state_bytes_match_plan(world2, case):
    for r, res in enumerate(H.results(world2, case)):
        _state_matches(res, r)


def test_state_bytes_match_plan_dp4(world4):
    for r, res in enumerate(H.results(world4, "muon")):
        _state_matches(res, r)


# --- checkpoints and errors ---------------------------------------------------------------------


def test_state_dict_round_trip(world2):
    for res in H.results(world2, "state_dict"):
        assert res["same"] and res["nonempty"]
        assert res["lr"] == pytest.approx(0.02 * H.lr_factor(3))
        assert "saved by DP rank" in res["wrong_rank"]


def test_error_paths(world2):
    r0, r1 = H.results(world2, "errors")
    for res in (r0, r1):
        assert ("'blocks.1.fc1.weight' has shape [96, 32] in the plan but [64, 32]"
                in res["fingerprint"]
                or "'blocks.1.fc1.weight' has shape [64, 32] in the plan but [96, 32]"
                in res["fingerprint"])
        assert "different plans" in res["plans"]
        assert "optimizer='shampoo' disagrees with the plan" in res["optimizer"]
        assert ("ns_steps=4 disagrees with the plan, which was made with ns_steps=5"
                in res["ns_steps"])
        assert "cuts matrix" in res["split"]
    assert "'blocks.1.fc1.weight'" in r1["fingerprint_one_rank"]
    assert "DP rank(s) [1]" in r0["fingerprint_one_rank"]


# --- single process (no process group) ----------------------------------------------------------


def test_single_process_without_process_group():
    assert not dist.is_initialized()
    torch.set_num_threads(1)
    got = H.train_dp(0, 1, steps=3)
    ref = H.train_reference(1, steps=3)
    assert H.max_rel_err(got["params"], ref["params"]) <= 1e-5


def test_refuses_tp_plans_without_groups_and_wrong_dp():
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=2)
    with pytest.raises(PlanMismatchError, match="dp=2 but the data-parallel group has 1"):
        CanzonaOptimizer(model, plan)
    tp_plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={"tp": 2})})
    with pytest.raises(PlanMismatchError, match="pass tp_group="):
        CanzonaOptimizer(model, tp_plan)
    ep_plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={"ep": 2})})
    with pytest.raises(PlanMismatchError, match="ep=2 but has no expert buffers"):
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
        for res in H.results(ranks, f"method_{method}"):
            assert set(res["methods"]) == {method}
            assert H.max_rel_err(res["params"], ref["params"]) <= 1e-5
            assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5)


# --- payloads: what each method hands torch.distributed ------------------------------------------


def _plan_sizes(plan) -> list[tuple[int, ...]]:
    return [tuple(y - x for x, y in zip(b.cuts, b.cuts[1:]))
            for buf in plan.buffers for b in buf.buckets]


def _expected_calls(method: str, sizes: tuple[int, ...], rank: int) -> list[dict]:
    """The calls one bucket's reduce and gather must make on ``rank``, from its slice sizes."""
    R, S, n, big = len(sizes), sum(sizes), sizes[rank], max(sizes)
    owners = [r for r, s in enumerate(sizes) if s > 0]
    roots = {"reduce": [{"phase": "reduce", "op": "reduce", "numel": sizes[r], "root": r}
                        for r in owners],
             "gather": [{"phase": "gather", "op": "broadcast", "numel": sizes[r], "root": r}
                        for r in owners]}
    if method == "equal":
        assert len(set(sizes)) == 1
        return [{"phase": "reduce", "op": "reduce_scatter", "in": S, "out": n},
                {"phase": "gather", "op": "all_gather", "in": n, "out": S}]
    if method == "padded":
        return [{"phase": "reduce", "op": "reduce_scatter", "in": R * big, "out": big},
                {"phase": "gather", "op": "all_gather", "in": big, "out": R * big}]
    if method == "per_root":
        return roots["reduce"] + roots["gather"]
    if method == "all_reduce":
        return [{"phase": "reduce", "op": "all_reduce", "numel": S}] + roots["gather"]
    assert method == "all_to_all"
    return [{"phase": "reduce", "op": "all_to_all_single", "in": S, "out": R * n,
             "in_splits": list(sizes), "out_splits": [n] * R},
            {"phase": "gather", "op": "all_to_all_single", "in": R * n, "out": S,
             "in_splits": [n] * R, "out_splits": list(sizes)}]


def _close(a: torch.Tensor, b: torch.Tensor, world: int, rel: float) -> bool:
    """Bitwise at dp 2 (a sum of two terms has one order), else within ``rel`` of the norm."""
    if world == 2:
        return torch.equal(a, b)
    return bool((a - b).norm() <= rel * b.norm().clamp(min=1e-30))


def test_collective_payloads_are_the_plan_slices(world2, world4):
    """One step per method (each bucket's plan method, then each forced on every bucket), on a
    plan with uneven slices and one with equal slices, at dp 2 and dp 4: every bucket makes
    exactly the calls its slice sizes imply — padded: R·max; per_root (and all_reduce's
    gather): one reduce / broadcast per non-empty owner of exactly its slice; all_to_all: the
    slices as split sizes; all_reduce: the whole bucket; equal (the stock calls) only where the
    slices are equal — and no other."""
    seen_methods = set()
    for world, ranks in ((2, world2), (4, world4)):
        for rank, res in enumerate(H.results(ranks, "payloads")):
            assert "cannot move bucket" in res["equal_refused"]
            for kind in ("tiny", "stack"):
                sizes = _plan_sizes(res[kind, "plan"])
                plan_methods = [b.method for buf in res[kind, "plan"].buffers
                                for b in buf.buckets]
                assert all(len(s) == world for s in sizes)
                # The stack's slices are equal; TinyGPT's mostly not (dp 4 has an equal bucket).
                unequal = sum(len(set(s)) > 1 for s in sizes)
                assert unequal == 0 if kind == "stack" else unequal >= len(sizes) - 1
                for method in PAYLOAD_METHODS:
                    got = res[kind, method]
                    used = plan_methods if method is None else [method] * len(sizes)
                    assert list(got["methods"]) == used
                    seen_methods.update(used)
                    for k, (m, s) in enumerate(zip(used, sizes)):
                        calls = [{key: v for key, v in c.items() if key != "bucket"}
                                 for c in got["calls"] if c["bucket"] == k]
                        assert calls == _expected_calls(m, s, rank), (world, kind, method, k)
                    assert all(c["bucket"] is not None for c in got["calls"])
    # Both plans' own methods and the forced ones cover every method.
    assert seen_methods == set(comm_model.METHODS)


def test_every_method_reduces_and_gathers_the_same_values(world2, world4):
    """Per bucket, every method's averaged gradient slice and gathered parameter buffer equal
    those of the stock calls (equal on the equal-slice plan, padded on the other): bitwise at
    dp 2, to 1e-6 at dp 4 (the sums' order differs); the gathered parameters are bitwise the
    same on every rank."""
    for world, ranks in ((2, world2), (4, world4)):
        got = H.results(ranks, "payloads")
        for kind, ref_method in (("tiny", "padded"), ("stack", None)):
            for method in PAYLOAD_METHODS:
                for rank, res in enumerate(got):
                    ref, run = res[kind, ref_method], res[kind, method]
                    for k, (a, b) in enumerate(zip(run["own"], ref["own"], strict=True)):
                        assert a.shape == b.shape and _close(a, b, world, 1e-6), \
                            (world, kind, method, rank, k)
                    for k, (a, b) in enumerate(zip(run["params"], ref["params"], strict=True)):
                        assert _close(a, b, world, 1e-5), (world, kind, method, rank, k)
                        assert torch.equal(a, got[0][kind, method]["params"][k])
