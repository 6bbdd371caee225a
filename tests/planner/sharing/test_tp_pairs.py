"""k = 2·tp in the DP problem: a tall column-parallel Muon matrix whose TP shards are
each cut at one row between two DP indices (``sharing.tp_pair_decision``, ``with_pairs`` at
tp > 1) and the per-GPU objective that counts each half on its index and makes partners finish
their locksteps together (``tp.context``), the placement on fixed partners
(``sharing.tp_bundle_candidate``) at llama3-70b dp256 tp8."""

from __future__ import annotations

import dataclasses

import pytest

from canzona.planner.dp.units import owners_to_cuts
from canzona.planner.hardware import load_hardware
from canzona.planner.inventory import build_inventory
from canzona.planner.layout import ParallelSizes
from canzona.planner.models import get_preset
from canzona.planner.planning import evaluate, make_problem
from canzona.planner.settings import OptimizerSettings
from canzona.planner.sharing import (kind_of, profile_rate, share_options, tp_pair_decision,
                                     tp_pair_piece, with_pairs)
from canzona.planner.tp.context import (TPContext, coupled, index_gpu_max, index_lockstep,
                                        index_work, lb_gpu)


def _problem(model: str, dp: int, tp: int):
    return make_problem(build_inventory(get_preset(model)), ParallelSizes(dp=dp, tp=tp),
                        OptimizerSettings(name="muon"), cost="flops")


def test_the_decision_takes_tall_column_parallel_matrices_and_prices_their_halves():
    hw = load_hardware("h100")
    big = _problem("llama3-70b", 256, 8)
    auto = tp_pair_decision(big, hw, "auto")
    # the bound's choice at llama3-70b dp256: fc1 (its piece over its TP group alone outweighs
    # a GPU's share); at dp 4 the share is larger and nothing needs a partner
    assert {kind_of(big.tasks[i].name) for i in auto} == {"mlp.linear_fc1"} and len(auto) == 80
    pr = _problem("llama3-70b", 4, 8)
    assert tp_pair_decision(pr, hw, "auto") == {}
    every = tp_pair_decision(pr, hw, "all-split")
    assert {kind_of(pr.tasks[i].name) for i in every} == {"mlp.linear_fc1",
                                                          "self_attention.linear_qkv"}
    for i, x in every.items():
        rows, cols = pr.tasks[i].shape
        assert x.row == rows // 8 // 2 and x.split_poly
        o = tp_pair_piece(8, True, rows, cols, 5, 2, hw.link(8), hw.link(16),
                          rate=profile_rate(hw))
        assert x.flops == (o.piece_flops, o.piece_flops)
        assert x.comm_s == pytest.approx(o.comm_s) and x.hidden_s == pytest.approx(o.hidden_s)
        # the load is the piece alone (compute + what its own products do not hide)
        unit = pr.loads[i] / pr.costs[i].flops
        assert x.loads[0] == pytest.approx(o.alone_s(profile_rate(hw)) * profile_rate(hw) * unit,
                                           abs=1)
    # row-parallel matrices (fc2, proj) are not: a DP cut of their shard is a column block
    assert not any(o.group == "tp_pair" for t in pr.tasks
                   if kind_of(t.name) in ("mlp.linear_fc2", "self_attention.linear_proj")
                   for o in share_options(pr, t.id, hw))
    assert tp_pair_decision(_problem("llama3-70b", 4, 1), hw, "all") == {}
    assert tp_pair_decision(_problem("llama3-70b", 1, 8), hw, "all") == {}


@pytest.fixture(scope="module")
def small():
    """qwen3-0.6b at dp 2 × tp 2 with every fused gate/up shared by a TP pair."""
    pr = _problem("qwen3-0.6b", 2, 2)
    pairs = tp_pair_decision(pr, "h100", "all-split")
    fc1 = [i for i in pairs if kind_of(pr.tasks[i].name) == "mlp.linear_fc1"]
    assert fc1
    return pr, {i: pairs[i] for i in fc1}


def test_each_shard_is_cut_at_the_pairs_row(small):
    pr, pairs = small
    got = with_pairs(pr, pairs)
    for b, nb in zip(pr.buckets, got.buckets):
        whole = {it.tasks[0]: it for it in b.items if len(it.tasks) == 1}
        pieces: dict[int, list] = {}
        for it in nb.items:
            if len(it.tasks) == 1 and it.tasks[0] in pairs:
                pieces.setdefault(it.tasks[0], []).append(it)
        for i, (a, c) in pieces.items():
            w, x = whole[i], pairs[i]
            cols = pr.tasks[i].shape[1]
            assert (w.end - w.start) * 2 == pr.tasks[i].shape[0] * cols  # the TP shard
            assert (a.start, a.end, c.start, c.end) == (w.start, w.start + x.row * cols,
                                                        w.start + x.row * cols, w.end)
            assert a.atomic and c.atomic and (a.load, c.load) == x.loads
            assert a.state_bytes + c.state_bytes == w.state_bytes
            assert a.state_bytes == w.state_bytes * x.row // ((w.end - w.start) // cols)
    assert got.total - pr.total == sum(sum(x.loads) - pr.loads[i] for i, x in pairs.items())


def _cuts(problem, split_at: int):
    """Every matrix on DP index 0 but for task ``split_at``'s second piece and everything after
    it in its bucket (on index 1)."""
    owners = {}
    for b in problem.buckets:
        atomic = [it for it in b.items if it.atomic]
        ks = [k for k, it in enumerate(atomic) if it.tasks == (split_at,)]
        owners[(b.buffer, b.bucket)] = [0 if not ks or k <= ks[0] else 1
                                        for k in range(len(atomic))]
    return owners_to_cuts(problem, owners)


def test_each_half_counts_on_its_index_and_partners_finish_together(small):
    pr, pairs = small
    i = min(pairs)
    used = with_pairs(pr, {i: pairs[i]})
    cuts = _cuts(used, i)
    ctx = TPContext.build(used)
    base, owned, _ = index_work(used, cuts, ctx)
    assert all(i not in ids for ids in owned)  # never hosted whole by a micro-group
    from canzona.planner.tp.context import HALF, index_halves

    assert all(not s.items for s in index_lockstep(used, cuts))  # no task its TP group shares
    steps, partners = index_halves(used, cuts)
    assert partners == [{1}, {0}]
    halves = [[x for x in s.items if x[0] == i - HALF] for s in steps]  # keyed first
    assert [len(h) for h in halves] == [1, 1] and halves[0][0][3] == pairs[i].loads[0]
    # the same cuts without the pair: each half would be a matrix to host; with it, each
    # index carries its half's load on every TP rank instead
    base0, owned0, _ = index_work(dataclasses.replace(used, pairs={}), cuts, ctx)
    assert [ids.count(i) for ids in owned0] == [1, 1]
    assert [b - b0 for b, b0 in zip(base, base0)] == [pytest.approx(x) for x in pairs[i].loads]
    # partners end the batches holding their halves together
    gpu = index_gpu_max(used, cuts, ctx)
    parts = [s.split() for s in steps]
    for d in range(2):
        rest = base[d] - steps[d].pieces + max(h for h, _ in parts) + parts[d][1]
        assert gpu[d] == pytest.approx(rest + _lpt(used, owned[d]))
    assert lb_gpu(used, ctx=ctx) >= max(pairs[i].loads)
    # the DP problem's own evaluation counts each piece on its owner
    loads = evaluate(used, cuts).load
    assert sum(loads) == used.total


def _lpt(problem, ids):
    from canzona.planner.tp.context import lpt_makespan

    return lpt_makespan([problem.loads[j] for j in ids], problem.sizes.tp)


def test_coupled_indices_run_at_the_slowest_of_their_component():
    assert coupled([1.0, 5.0, 2.0, 3.0, 4.0], [{1}, {0, 2}, {1}, set(), set()]) == \
        [5.0, 5.0, 5.0, 3.0, 4.0]
    assert coupled([1.0, 2.0], [set(), set()]) == [1.0, 2.0]


def test_plans_without_pairs_are_unchanged(small):
    """No pairs: the objective is what it was (every tp > 1 plan today)."""
    pr, _ = small
    cuts = _cuts(pr, -1)
    plain = dataclasses.replace(pr, pairs={})
    assert index_gpu_max(pr, cuts) == index_gpu_max(plain, cuts)


@pytest.mark.parametrize("hardware, ceiling", [("h100", 1.173), ("h800", 1.545)])
def test_llama3_70b_dp256_tp8_with_fc1_over_tp_pairs_reaches_the_layout_free_optimum(
        hardware, ceiling):
    """The issue's at-scale figure: with every TP-split matrix shared by its TP group and fc1
    by TP pairs (fixed partners), the laid-out placement's busiest GPU reaches the layout-free
    optimum of ``benchmarks/bench_k_beyond_tp.py`` for these options — on the default (H100)
    profile 1.172× the mean useful work, an fc1 half's own chain (its compute and unhidden
    exchanges, which nothing beside it shortens); on H800 1.540, an fc1 half beside a proj
    (≤ 1.5 asked; 1.679 / 1.795 with the TP group alone). Moves alone stopped at 1.574 there:
    partners end their halves together, so both need a change at once
    (``TPPairSearch._swap``). Each pair's halves sit on partners, every shard cut at its middle
    row, at most one shared matrix per bucket and pair."""
    from canzona.planner.formulas import LOCKSTEP_CMAX
    from canzona.planner.options import MIB
    from canzona.planner.planning import pair_owners
    from canzona.planner.sharing import share_decision, tp_bundle_candidate
    from canzona.planner.sharing.bound import _useful_total

    hw = load_hardware(hardware)
    base = _problem("llama3-70b", 256, 8)
    mean = _useful_total(base) / (256 * 8)
    pr = dataclasses.replace(base, shared=share_decision(base, hardware, "all-split"),
                             lockstep_cap=LOCKSTEP_CMAX * 512 * MIB)
    pairs = tp_pair_decision(pr, hw, "auto")
    busiest, got = tp_bundle_candidate(pr, pairs, hw, scratch_cap=LOCKSTEP_CMAX * 512 * MIB)
    assert got is not None
    used, cuts = got
    assert set(used.pairs) == set(pairs)
    gpu = index_gpu_max(used, cuts)
    assert busiest <= max(gpu) <= busiest * 1.001  # the search leaves the AdamW elements out
    assert max(gpu) / mean < ceiling
    owners = pair_owners(used, cuts)
    assert all(b == a + 1 and a % 2 == 0 for a, b in owners.values())
    for b in used.buckets:
        shared_here = [it.tasks[0] for it in b.items if it.atomic and it.tasks[0] in used.pairs]
        assert len(shared_here) == 2 * len(set(shared_here))  # both halves, side by side
        assert len({owners[i] for i in shared_here}) == len(set(shared_here))


@pytest.fixture(scope="module")
def pairs_plan():
    """qwen3-0.6b dp 4 × tp 2 with every fused gate/up (and tall QKV) shared by two TP groups."""
    from canzona.planner.options import TPOptions
    from canzona.planner.pipeline import plan

    return plan("qwen3-0.6b", ParallelSizes(dp=4, tp=2), tp_options=TPOptions(share="pairs"))


def test_share_pairs_plans_every_half_on_partners_and_in_their_locksteps(pairs_plan):
    from canzona.planner.plan import TP_PAIR_VERSION

    p = pairs_plan
    assert p.schema_version == TP_PAIR_VERSION and p.dp_shared
    for x in p.dp_shared:
        a, b = x.owners
        assert b == a + 1 and a % 2 == 0 and 0 < x.row < p.tasks[x.id].shape[0] // 2
        assert p.tasks[x.id].owner == a and p.tasks[x.id].host is None
        halves = {ix.dp_index: s for ix in p.tp.indices for s in ix.shared if s.id == x.id}
        assert set(halves) == {a, b} and halves[a].partner == b and halves[b].partner == a
    # every other TP-split matrix shared by its TP group alone (all-split), none hosted
    assert not any(ix.groups for ix in p.tp.indices)


def test_edited_tp_pair_plans_are_refused(pairs_plan, refused_edit):
    p = pairs_plan

    def version(d):
        d["schema_version"] = 4

    def partner(d):  # a half naming the wrong partner
        for ix in d["tp"]["indices"]:
            for s in ix["shared"]:
                if "partner" in s:
                    s["partner"] = (s["partner"] + 2) % len(d["tp"]["indices"])
                    return

    def lone(d):  # a half that forgot its partner: shared by its TP group alone
        for ix in d["tp"]["indices"]:
            for s in ix["shared"]:
                if "partner" in s:
                    del s["partner"]
                    return

    def row(d):
        d["dp_shared"][0]["row"] = d["tasks"][d["dp_shared"][0]["id"]]["shape"][0]  # > a shard

    def flops(d):
        d["dp_shared"][0]["flops"][1] += 1

    for change, field in ((version, "schema_version"), (partner, ".partner"),
                          (lone, "scheduled twice"), (row, "dp_shared[0].row"),
                          (flops, "dp_shared[0].flops")):
        msg = refused_edit(p, change)
        assert field in msg, (field, msg)


def test_the_simulator_runs_each_half_in_both_partners_phases(pairs_plan):
    """Each half is priced over k = 2·tp in its index's shared phase, and partners' phases end
    together; nothing of a pair is counted as a tp = 1 DP pair's piece."""
    from canzona.planner.simulate import workload_from_plan

    p = pairs_plan
    w = workload_from_plan(p, load_hardware("h100"))
    first = [g[0] for g in w.groups]
    assert all(g.barrier for g in first)  # every index's shared phase
    for x in p.dp_shared:
        a, b = x.owners
        ends = [first[d].scatter_s + first[d].compute_s[0] for d in (a, b)]
        assert ends[0] == pytest.approx(ends[1])
    assert all(r.matrix_flops == 0 for r in w.ranks)  # no matrix outside the TP phases


def test_share_pairs_needs_tp_groups():
    from canzona.planner.errors import CanzonaError
    from canzona.planner.options import TPOptions
    from canzona.planner.pipeline import plan

    with pytest.raises(CanzonaError, match="tp > 1"):
        plan("qwen3-0.6b", ParallelSizes(dp=4, tp=1), tp_options=TPOptions(share="pairs"))


def test_share_pairs_says_what_it_cannot_do():
    """--share pairs without reordering is refused (the layout needs it); where nothing can
    be shared by two TP groups (one DP index) the plan says so and shares over TP alone."""
    from canzona.planner.errors import CanzonaError, CanzonaWarning
    from canzona.planner.options import DPOptions, TPOptions
    from canzona.planner.pipeline import plan

    with pytest.raises(CanzonaError, match="reorder"):
        plan("qwen3-0.6b", ParallelSizes(dp=2, tp=2), dp_options=DPOptions(reorder=False),
             tp_options=TPOptions(share="pairs"))
    with pytest.warns(CanzonaWarning, match="no matrix is shared by two TP groups"):
        p = plan("qwen3-0.6b", ParallelSizes(dp=1, tp=2), tp_options=TPOptions(share="pairs"))
    assert not p.dp_shared and any(ix.shared for ix in p.tp.indices)


def test_a_locksteps_split_adds_up_to_its_load_and_puts_halves_first():
    """``Lockstep.split``: the batches holding a half (keyed below 0, run first) and the
    others add up to the phase's load, for one batch and for several."""
    import random

    from canzona.planner.tp.context import HALF, Lockstep

    rng = random.Random(5)
    for cap in (0, 100, 250):
        for _ in range(50):
            lock = Lockstep(cap)
            for k in range(rng.randint(1, 6)):
                key = k - HALF if rng.random() < 0.4 else k
                c = rng.uniform(0.1, 3.0)
                lock.add((key, c, rng.uniform(0, 3.0), 1.0, rng.randint(10, 120),
                          rng.uniform(0, c / 2)))
            first, rest = lock.split()
            assert first + rest == pytest.approx(lock.load())
            if not any(x[0] < 0 for x in lock.items):
                assert first == 0.0


def test_the_step_time_rate_is_the_same_with_halves_or_without(small):
    """``StepTime`` converts seconds at the tasks' own rate: a problem whose total counts the
    halves per TP rank must not convert the bucket collectives at another rate, or the modelled
    steps of a plan with TP pairs and one without (which ``plan_problem`` compares) are in
    different units (H800 qwen3-32b dp128 tp8: 32 fc1 pairs were kept for a modelled step 14 %
    shorter that was 0.6 % longer in seconds)."""
    from canzona.planner.objective import StepTime

    pr, pairs = small
    got = with_pairs(pr, pairs)
    assert got.total != pr.total  # the halves are counted per TP rank
    hw = load_hardware("h800")
    assert StepTime(got, hw).seconds_per_load == pytest.approx(
        StepTime(pr, hw).seconds_per_load, rel=1e-9, abs=0)  # (rates ~1e-15 s per FLOP)
    one = pr.costs[0]
    assert StepTime(pr, hw).to_load(hw.seconds(one.flops)) == pytest.approx(pr.loads[0])
