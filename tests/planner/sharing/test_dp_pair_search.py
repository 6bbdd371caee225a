"""DP pairs as bundles (tp = 1; ``canzona.planner.sharing``'s DP pair search): DP
indices paired up front, each pair sharing several Muon matrices in one lockstep so that their
exchanges hide behind each other's compute. qwen3-8b at dp 64 on the H800 profile: the
whole-matrix plan sits at 1.054× the mean (fc1 0.856 + proj 0.198 is the best bin), and so does
every placement of pieces priced with their exchanges (a pattern ILP says 1.0535); bundles reach
below the mean."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from canzona.planner import DPOptions, OptimizerSettings, ParallelSizes, TPOptions
from canzona.planner.hardware import load_hardware
from canzona.planner.inventory import build_inventory
from canzona.planner.models import ModelConfig
from canzona.planner.pipeline import inventory_of, plan
from canzona.planner.planning import make_problem, pair_owners
from canzona.planner.plan import save_plan
from canzona.planner.report import pairs_dict
from canzona.planner.sharing import bundle_pairs, pair_decision, pair_waits
from canzona.planner.simulate import simulate_plan
from canzona.planner.plan.load import load_plan

H800 = load_hardware("h800")


def _plan(dp: int, objective: str, share: str = "auto", model: str = "qwen3-8b",
          cmax_mib: float = 512.0):
    return plan(model, ParallelSizes(dp=dp, tp=1), dp_options=DPOptions(objective=objective,
                                                                        cost="flops"),
                tp_options=TPOptions(share=share, hardware="h800", cmax_mib=cmax_mib))


#: A wider C_max: a pair's lockstep may hold 2 · 768 MiB (two fc1 halves and a QKV half).
CMAX = 768.0


@pytest.fixture(scope="module")
def q8_64():
    return {o: _plan(64, o) for o in ("max-load", "step-time")}


def _path(p) -> float:  # noqa: ANN001
    return simulate_plan(p, H800).breakdown()["compute"]


def test_bundles_take_qwen3_8b_dp64_under_the_issue_target(q8_64):
    p = q8_64["max-load"]
    rep = pairs_dict(p)
    assert rep is not None and rep["run_max_over_useful_mean"] <= 1.02  # the issue: ≤ 1.02
    # every pair is (2s, 2s + 1), in one node, one lockstep each (a single phase)
    assert all(x.owners[1] == x.owners[0] + 1 and x.owners[0] % 2 == 0 for x in p.dp_shared)
    assert rep["across_nodes"] == 0 and rep["phases"] == 1
    per_pair: dict[tuple[int, int], int] = {}
    for x in p.dp_shared:
        per_pair[tuple(x.owners)] = per_pair.get(tuple(x.owners), 0) + 1
    assert max(per_pair.values()) >= 2  # bundles, not lone pairs
    # the simulated compute path against the whole-matrix plan's
    whole = _plan(64, "max-load", "off")
    assert _path(p) < 0.96 * _path(whole)
    # the optimizer state stays near balance (AdamW's embedding spread, pieces by rows; the
    # max-load search weighs compute only: an index with a whole fc1 and more holds 1.13x)
    state = p.metrics.dp_state_bytes
    assert max(state) <= 1.15 * sum(state) / len(state)


def test_the_default_objective_weighs_the_collectives_the_bundles_add(q8_64):
    # step-time: the pairs' extra per-root calls cost more than the compute they save at dp
    # 64, so the plan without pairs stays; its modelled step is the shorter one
    default, bundles = q8_64["step-time"], q8_64["max-load"]
    assert not default.dp_shared
    assert _path(default) + default.comm.predicted_s < _path(bundles) + bundles.comm.predicted_s


def test_bundle_plans_are_deterministic_and_valid_files(q8_64, tmp_path):
    a = q8_64["max-load"]
    assert _plan(64, "max-load").to_json() == a.to_json()
    save_plan(a, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").to_json() == a.to_json()


def test_bundles_at_dp256_halve_the_floor():
    # fc1 alone is 3.42× the mean; shared by a pair, each half with its partner's lockstep
    p = _plan(256, "step-time")
    rep = pairs_dict(p)
    assert rep is not None and rep["run_max_over_useful_mean"] < 2.0
    assert rep["phases"] == 1 and rep["across_nodes"] == 0
    # the other matrices fit whole under fc1's half: made whole again (fewer bucket slices)
    assert set(rep["kinds"]) == {"mlp.linear_fc1"}


def _small(dp: int = 8):
    spec, _ = inventory_of("qwen3-0.6b")
    return make_problem(spec, ParallelSizes(dp=dp, tp=1), cost="flops")


def _free_links():
    """H800 with exchanges free over NVLink: the search shares whatever evens loads out."""
    from canzona.planner.hardware import LinkProfile

    return H800.model_copy(update={"intra_node": LinkProfile(busbw=1e15, latency_s=0.0)})


def test_a_pair_shares_one_matrix_per_bucket_and_lightens_the_busiest_index():
    problem = _small()
    hw = _free_links()
    got = bundle_pairs(problem, pair_decision(problem, hw, "all-split"), hw)
    assert got is not None
    used, cuts = got
    owners = pair_owners(used, cuts)
    assert owners and all(b == a + 1 and a % 2 == 0 for a, b in owners.values())
    for b in used.buckets:  # a pair's pieces of a bucket: one matrix at most
        shared = {it.tasks[0] for it in b.items if len(it.tasks) == 1
                  and it.tasks[0] in used.pairs}
        pairs = [owners[t] for t in shared]
        assert len(pairs) == len(set(pairs)), (b.bucket, pairs)
    # the busiest index (pairs in lockstep) against the whole-matrix partition's
    solve = importlib.import_module("canzona.planner.solve").solve
    whole = solve(problem, DPOptions(objective="max-load"), hardware=hw)
    assert max(pair_waits(used, cuts)) < max(pair_waits(whole.problem, whole.cuts))


def test_not_applied_where_it_does_not_fit():
    hw = _free_links()
    problem = _small()
    pairs = pair_decision(problem, hw, "all-split")
    assert bundle_pairs(problem, {}, hw) is None
    for gpus in (1, 3):  # some partners (2s, 2s + 1) on two nodes
        assert bundle_pairs(problem, pairs, hw.model_copy(update={"gpus_per_node": gpus})) \
            is None
    one = make_problem(inventory_of("qwen3-0.6b")[0], ParallelSizes(dp=1, tp=1), cost="flops")
    assert bundle_pairs(one, pairs, hw) is None  # no partner
    tp2 = make_problem(inventory_of("qwen3-0.6b")[0], ParallelSizes(dp=4, tp=2), cost="flops")
    assert bundle_pairs(tp2, pairs, hw) is None  # TP sharing's business
    shampoo = dataclasses.replace(problem, settings=OptimizerSettings(name="shampoo"))
    assert bundle_pairs(shampoo, pairs, hw) is None
    moe = ModelConfig(name="tiny-moe", arch="qwen3_moe", hidden=256, ffn=0, layers=2, q_heads=4,
                      kv_heads=2, head_dim=64, vocab=1000, tied_embeddings=False, qk_norm=True,
                      num_experts=4, experts_per_token=2, moe_ffn=128)
    mp = make_problem(build_inventory(moe), ParallelSizes(dp=4, tp=1, ep=2), cost="flops")
    assert bundle_pairs(mp, pair_decision(mp, hw, "all-split"), hw) is None


def test_reorder_off_keeps_megatron_order():
    # a trainer whose buffers follow Megatron's order: the bundle stage (a reordering) is off
    p = plan("qwen3-8b", ParallelSizes(dp=64, tp=1),
             dp_options=DPOptions(objective="max-load", reorder=False, cost="flops"),
             tp_options=TPOptions(share="auto", hardware="h800"))
    assert not p.inputs.solver.reorder
    rep = pairs_dict(p)
    assert rep is None or rep["run_max_over_useful_mean"] > 1.02


def test_a_pairs_lockstep_scratch_stays_under_the_cap():
    # at the default C_max (512 MiB) a pair's lockstep holds at most 2 · C_max of scratch
    # (formulas.lockstep_bytes of each half, bf16), as a TP group's lockstep batches do
    from canzona.planner.formulas import LOCKSTEP_CMAX, lockstep_bytes

    p = _plan(64, "max-load")
    per_pair: dict[tuple[int, int], int] = {}
    for x in p.dp_shared:
        m, n = max(p.tasks[x.id].shape), min(p.tasks[x.id].shape)
        per_pair[tuple(x.owners)] = per_pair.get(tuple(x.owners), 0) + \
            lockstep_bytes(-(-m // 2), n, 2, x.split_poly, 2)
    assert per_pair and max(per_pair.values()) <= LOCKSTEP_CMAX * 512 * 2**20
    wide = _plan(64, "max-load", cmax_mib=CMAX)
    assert pairs_dict(wide)["run_max_over_useful_mean"] < pairs_dict(p)["run_max_over_useful_mean"]


@pytest.mark.parametrize("seed", range(40))
def test_cut_layouts_keep_every_matrix_on_its_rank(seed):
    # _compact_cuts, _spread_over and _cheaper_cuts on random owners: non-decreasing cuts, each
    # matrix inside its owner's range, AdamW elements only moved, never a matrix
    import random

    from canzona.planner.sharing.layout import _cheaper_cuts, _compact_cuts, _spread_over
    from canzona.planner.planning import owner_of

    rng = random.Random(seed)
    problem = _small(dp=rng.choice([2, 3, 5, 8]))
    owners = {}
    for b in problem.buckets:
        n = sum(1 for it in b.items if it.atomic)
        owners[(b.buffer, b.bucket)] = sorted(rng.randrange(b.ranks) for _ in range(n))
    cap = float(rng.choice([0, 1e6, 1e12]))
    layouts = [_cheaper_cuts(problem, owners, H800, cap)]
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        if owners[key]:
            layouts.append({key: _compact_cuts(b, owners[key])})
        for width in (1, 2, b.ranks):
            layouts.append({key: _spread_over(b, owners[key], width)})
    for cuts in layouts:
        for key, c in cuts.items():
            b = next(x for x in problem.buckets if (x.buffer, x.bucket) == key)
            assert c[0] == b.start and c[-1] == b.end and list(c) == sorted(c), (key, c)
            got = [owner_of(c, it.start) for it in b.items if it.atomic]
            assert got == owners[key], (key, got, owners[key])
            for it in b.items:  # a matrix never straddles a cut
                if it.atomic:
                    assert owner_of(c, it.end - 1) == owner_of(c, it.start)


def test_the_pattern_start_reaches_what_moves_alone_do_not():
    # qwen3-8b dp64 at the default C_max: from the heaviest-first placement the moves and swaps
    # stop at 1.049; the class-level ILP's patterns (an fc1 and a QKV per pair, a whole fc2
    # beside each half, ...) given real matrices reach under 1.0
    from canzona.planner.sharing.cpsat_start import pattern_start
    from canzona.planner.sharing.dp_search import PairSearch

    spec, _ = inventory_of("qwen3-8b")
    problem = make_problem(spec, ParallelSizes(dp=64, tp=1), cost="flops")
    pairs = pair_decision(problem, H800, "all-split")
    cap = 2 * 512 * 2**20
    mean = problem.total / problem.dp
    moves = PairSearch(problem, pairs, cap)
    for i in sorted(range(len(moves.load)), key=lambda i: (-moves.load[i], i)):
        moves.place(i)
    moves.improve(5000)
    start = pattern_start(problem, pairs, cap)
    assert start is not None
    start.improve(5000)
    assert start.busiest() / mean <= 1.0 < 1.02 < moves.busiest() / mean
    # every matrix placed once, where ``where`` says; bundles within the cap, one per bucket
    seen = [i for d in range(start.dp) for i in start.whole[d]] + \
        [i for b in start.shared for i in b]
    assert sorted(seen) == list(range(len(start.load)))
    for d in range(start.dp):
        assert all(start.where[i] == ("w", d) for i in start.whole[d])
    for s, b in enumerate(start.shared):
        assert all(start.where[i] == ("s", s) for i in b) and start.fits(b)
    odd = make_problem(spec, ParallelSizes(dp=63, tp=1), cost="flops")
    assert pattern_start(odd, pair_decision(odd, H800, "all-split"), cap) is None


def test_both_starts_are_laid_out_and_judged_on_the_layout():
    """``bundle_candidates``: the heaviest-first start and the pattern start, each laid out
    (its pairs (2s, 2s + 1) where the search put them); ``bundle_pairs`` is the one whose
    search found the lighter busiest index (heaviest-first on a tie), while the pipeline judges
    both layouts by its objective: at qwen3-8b dp256 the two searches tie, and the pattern
    start's layout is the lighter one, which the max-load plan takes."""
    from canzona.planner.sharing import bundle_candidates
    from canzona.planner.report import _pair_runs

    spec, _ = inventory_of("qwen3-8b")
    cap = 2 * 512 * 2**20
    for dp in (64, 256):
        problem = make_problem(spec, ParallelSizes(dp=dp, tp=1), cost="flops")
        pairs = pair_decision(problem, H800, "all-split")
        got = bundle_candidates(problem, pairs, H800, scratch_cap=cap)
        assert len(got) == 2 and all(layout is not None for _, layout in got)
        loads = []
        for busiest, (used, cuts) in got:
            owners = pair_owners(used, cuts)
            assert used.pairs and all(b == a + 1 and a % 2 == 0 for a, b in owners.values())
            loads.append(max(pair_waits(used, cuts)))
            assert loads[-1] == pytest.approx(busiest, rel=0.05)  # the layout keeps the search's
        lighter = min(range(2), key=lambda j: (got[j][0], j))
        assert bundle_pairs(problem, pairs, H800, scratch_cap=cap)[1] == got[lighter][1][1]
        p = _plan(dp, "max-load")
        assert max(_pair_runs(p, H800)) <= min(loads) * (1 + 1e-9)
        if dp == 256:  # the searches tie; the layouts do not
            assert got[0][0] == pytest.approx(got[1][0], rel=1e-9) and loads[1] < loads[0]
            assert max(_pair_runs(p, H800)) < loads[0]
