"""Plans whose DP pairs share Muon matrices (tp = 1: ``TPOptions.share`` at tp 1):
the decision, the loads against the plan without pairs, the schema (version 4 only for plans
with pairs; every other plan byte for byte as before), determinism, the simulator, ``inspect``
and the checks of an edited file."""

from __future__ import annotations

import pytest

from canzona.planner import DPOptions, ParallelSizes, TPOptions
from canzona.planner.errors import CanzonaWarning
from canzona.planner.hardware import load_hardware
from canzona.planner.pipeline import inventory_of, plan
from canzona.planner.plan import BASE_VERSION, DP_PAIR_VERSION, save_plan
from canzona.planner.planning import make_problem, pair_phases
from canzona.planner.report import pairs_dict
from canzona.planner.sharing import kind_of, pair_decision, share_options
from canzona.planner.simulate import simulate_plan, workload_from_plan
from canzona.planner.plan.load import load_plan


def _plan(model: str, dp: int, share: str, hardware: str = "h100", **kw):
    kw.setdefault("dp_options", DPOptions(cost="flops"))  # the figures below are FLOPs plans
    return plan(model, ParallelSizes(dp=dp, tp=1),
                tp_options=TPOptions(share=share, hardware=hardware), **kw)


@pytest.fixture(scope="module")
def q8():
    """qwen3-8b at dp 256 on the H800 profile: past the atomic floor (the largest task is 3.4×
    the mean)."""
    return {s: _plan("qwen3-8b", 256, s, "h800") for s in ("off", "auto")}


def test_auto_shares_where_the_floor_binds_and_lowers_the_busiest_index(q8):
    off, auto = q8["off"], q8["auto"]
    assert auto.schema_version == DP_PAIR_VERSION and off.schema_version == BASE_VERSION
    kinds = {kind_of(auto.tasks[x.id].param) for x in auto.dp_shared}
    assert "mlp.linear_fc1" in kinds
    # the busiest DP index (pieces with their exchanges counted in full) against the plan
    # without pairs
    assert max(auto.metrics.dp_load) < 0.95 * max(off.metrics.dp_load)
    rep = pairs_dict(auto)
    assert rep["max_over_useful_mean"] < 0.95 * off.metrics.max_over_mean
    for x in auto.dp_shared:  # the owner of a shared task is its first piece's index
        assert auto.tasks[x.id].owner == x.owners[0] < x.owners[1]
        assert 0 < x.row < auto.tasks[x.id].shape[0]


def test_pairs_meet_in_phases_no_index_twice():
    owners = {0: (0, 1), 1: (1, 2), 2: (2, 3), 3: (0, 3), 4: (0, 1)}
    ph = pair_phases(owners)
    assert ph[(0, 1)] == 0 and len(ph) == 4
    for d in range(4):
        used = [ph[p] for p in ph if d in p]
        assert len(used) == len(set(used)), (d, used)


def test_auto_weighs_pairs_by_the_objective():
    # qwen3-0.6b at dp 2: every task far below the mean. By the compute alone (max-load) the
    # exchanges would only add time: the plan without pairs, byte for byte.
    def mk(share: str, objective: str):
        return _plan("qwen3-0.6b", 2, share, dp_options=DPOptions(objective=objective,
                                                                  cost="flops"))

    assert mk("auto", "max-load").to_json() == mk("off", "max-load").to_json()
    # By the modelled step (the default) pairs may even out the bucket collectives, but not by
    # holding optimizer state above its target (qwen3-0.6b dp 2: 2 ms of collectives saved by
    # a plan holding 1.41x the mean state, which the state term turns down): the plan kept
    # has a step no longer than without pairs and its state within the target.
    auto, off = mk("auto", "step-time"), mk("off", "step-time")
    hw = load_hardware("h100")

    def step(p) -> float:  # noqa: ANN001
        return simulate_plan(p, hw).breakdown()["compute"] + p.comm.predicted_s

    assert step(auto) <= step(off)
    state = auto.metrics.dp_state_bytes
    assert max(state) <= max(1.10 * sum(state) / len(state), max(off.metrics.dp_state_bytes))


def test_pair_plans_are_deterministic(tmp_path):
    a, b = (_plan("qwen3-0.6b", 8, "all-split") for _ in range(2))
    assert a.dp_shared and a.to_json() == b.to_json()
    save_plan(a, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").to_json() == a.to_json()


def test_decision_only_for_dense_matrices_at_tp1():
    spec, _ = inventory_of("qwen3-0.6b")
    pr = make_problem(spec, ParallelSizes(dp=4, tp=1), cost="flops")
    hw = load_hardware("h100")
    got = pair_decision(pr, hw, "all")
    assert got and all(pr.tasks[i].optimizer == "matrix" and pr.tasks[i].part is None
                       for i in got)
    wide = [i for i in got if pr.tasks[i].shape[0] < pr.tasks[i].shape[1]]
    tall = [i for i in got if pr.tasks[i].shape[0] >= pr.tasks[i].shape[1]]
    assert wide and tall  # down projections (wide) are shared too: their blocks are exchanged
    o_wide = share_options(pr, wide[0], hw, groups=("dp",), dp_sizes=(2,))[0]
    assert o_wide.comm_s > 0
    assert pair_decision(make_problem(spec, ParallelSizes(dp=4, tp=2),
                                      cost="flops"), hw, "all") == {}
    from canzona.planner.settings import OptimizerSettings

    # Shampoo: whole block rows per piece (item 3), SOAP: never (blocking it would change it)
    pr_s = make_problem(spec, ParallelSizes(dp=4, tp=1), OptimizerSettings(name="shampoo"),
                        cost="flops")
    blocks = pair_decision(pr_s, hw, "all")
    assert blocks and all(x.row % 1024 == 0 and x.comm_s == 0 for x in blocks.values())
    pr_soap = make_problem(spec, ParallelSizes(dp=4, tp=1), OptimizerSettings(name="soap"),
                           cost="flops")
    assert pair_decision(pr_soap, hw, "all") == {}
    with pytest.warns(CanzonaWarning, match="no matrix is worth splitting"):
        plan("qwen3-0.6b", ParallelSizes(dp=4, tp=1), "soap",
             tp_options=TPOptions(share="all"))
    # at tp > 1 too: a note, not a silent plan without sharing
    with pytest.warns(CanzonaWarning, match="soap's updates stay whole"):
        plan("qwen3-0.6b", ParallelSizes(dp=2, tp=2), "soap",
             tp_options=TPOptions(share="all-split"))


def test_simulator_puts_each_piece_on_both_owners(q8):
    p = q8["auto"]
    w = workload_from_plan(p, load_hardware("h800"))
    x = p.dp_shared[0]
    for d, f in zip(x.owners, x.flops):
        assert w.ranks[d].matrix_flops >= f
    total_off = sum(r.matrix_flops for r in workload_from_plan(q8["off"],
                                                               load_hardware("h800")).ranks)
    total = sum(r.matrix_flops for r in w.ranks)
    # every shared task's whole FLOPs replaced by its two pieces' (the split polynomial computes
    # the symmetric P's upper parts only, fewer than the whole task's dense polynomial; without
    # the split each partner computes P whole, more)
    expected = total_off + sum(sum(x.flops) - p.tasks[x.id].flops for x in p.dp_shared)
    assert total == expected
    for x in p.dp_shared:
        assert (sum(x.flops) < p.tasks[x.id].flops) == x.split_poly


def test_edited_pair_plans_are_refused(refused_edit):
    p = _plan("qwen3-0.6b", 4, "all-split")
    assert len(p.dp_shared) >= 2

    def version(d):
        d["schema_version"] = 3

    def owners(d):
        x = d["dp_shared"][0]
        x["owners"] = x["owners"][::-1]

    def flops(d):
        d["dp_shared"][0]["flops"][0] += 1

    def twice(d):
        d["dp_shared"][1]["id"] = d["dp_shared"][0]["id"]

    def row(d):
        d["dp_shared"][0]["row"] = 10**9

    def phase(d):
        x = d["dp_shared"][0]
        other = next(y for y in d["dp_shared"][1:] if set(y["owners"]) & set(x["owners"])
                     and y["owners"] != x["owners"])
        other["phase"] = x["phase"]

    def cut_inside(d):  # the cut between the pieces moved up one row: inside the first piece
        x = d["dp_shared"][0]
        t = d["tasks"][x["id"]]
        for buf in d["buffers"]:
            for b in buf["buckets"]:
                for sl in b["slots"]:
                    if sl["name"] == t["param"]:
                        mid = sl["start"] + x["row"] * t["shape"][1]
                        b["cuts"][b["cuts"].index(mid)] = mid - t["shape"][1]

    for change, field in ((cut_inside, "dp_shared[0].row"), (version, "schema_version"),
                          (owners, "dp_shared[0].owners"),
                          (flops, "dp_shared[0].flops"), (twice, "dp_shared[1].id"),
                          (row, "dp_shared[0].row"), (phase, ".phase")):
        msg = refused_edit(p, change)
        assert field in msg, (field, msg)


def test_all_moves_pieces_apart_without_undoing_pairs_or_piling_up_load():
    from canzona.planner.solve import solve
    from canzona.planner.options import DPOptions
    from canzona.planner.planning import evaluate, pair_owners
    from canzona.planner.sharing import pieces_apart, with_pairs

    spec, _ = inventory_of("qwen3-0.6b")
    for opt in ("muon", "shampoo"):
        from canzona.planner.settings import OptimizerSettings

        pr = make_problem(spec, ParallelSizes(dp=4, tp=1), OptimizerSettings(name=opt),
                          cost="flops")
        pairs = pair_decision(pr, load_hardware("h100"), "all")
        shared = with_pairs(pr, pairs)
        cuts = solve(shared, DPOptions(reorder=False)).cuts
        moved = pieces_apart(shared, cuts)
        before, after = pair_owners(shared, cuts), pair_owners(shared, moved)
        apart_before = {i for i, (a, b) in before.items() if a != b}
        apart_after = {i for i, (a, b) in after.items() if a != b}
        assert apart_before <= apart_after and len(apart_after) > len(apart_before), opt
        assert max(evaluate(shared, moved).load) <= 1.05 * max(evaluate(shared, cuts).load)
        for c in moved.values():
            assert all(x <= y for x, y in zip(c, c[1:]))


def test_pairs_move_into_one_node_where_the_ranks_between_are_empty():
    """``sharing.pairs_in_nodes``: with two GPUs per node most pairs of qwen3-1.7b dp16 span
    two nodes; moving a piece's range to an empty rank in its partner's node makes fewer of
    them do so, the busiest DP index no heavier (pairs across nodes priced on the network),
    every cut still in order and every pair still apart."""
    from canzona.planner import DPOptions, OptimizerSettings
    from canzona.planner.solve import solve
    from canzona.planner.planning import pair_owners
    from canzona.planner.sharing import pair_link, pairs_in_nodes, with_pairs

    hw = load_hardware("h800").model_copy(update={"gpus_per_node": 2})
    spec, _ = inventory_of("qwen3-1.7b")
    base = make_problem(spec, ParallelSizes(dp=16, tp=1), OptimizerSettings(name="muon"),
                        cost="flops")
    pairs = pair_decision(base, hw, "all")
    prob = with_pairs(base, pairs)
    cuts = solve(prob, DPOptions(reorder=False), hardware=hw).cuts
    moved = pairs_in_nodes(base, pairs, cuts, hw)

    def across(c):
        return sum(pair_link(hw, o) is not hw.intra_node for o in pair_owners(prob, c).values())

    def busiest(c):  # as sharing.Candidates prices it
        from canzona.planner.planning import evaluate
        from canzona.planner.sharing import priced_for
        owners = pair_owners(prob, c)
        used = with_pairs(base, priced_for(base, {i: x for i, x in pairs.items()
                                                  if owners[i][0] != owners[i][1]}, owners, hw))
        return max(evaluate(used, c).load)

    assert across(moved) < across(cuts)
    assert busiest(moved) <= busiest(cuts)
    for key, c in moved.items():
        assert list(c) == sorted(c) and (c[0], c[-1]) == (cuts[key][0], cuts[key][-1])
    before, after = pair_owners(prob, cuts), pair_owners(prob, moved)
    assert all(after[i][0] != after[i][1] for i, o in before.items() if o[0] != o[1])


def test_pair_waits_count_the_chains_between_partners():
    """``sharing.pair_waits``: an index in no pair keeps its load; an index in pairs is no
    lighter than its pieces' compute and the rest of its work; and an index whose later-phase
    pair partner first ran an earlier pair waits for it (the chain the simulator models)."""
    from canzona.planner import DPOptions, OptimizerSettings
    from canzona.planner.solve import solve
    from canzona.planner.planning import evaluate, pair_owners, pair_phases
    from canzona.planner.sharing import pair_waits, with_pairs
    from canzona.planner.tp.context import lockstep_seconds

    hw = load_hardware("h800")
    chains = 0
    # chains are rare: a partner in no other pair whose other partner ran an earlier one
    for model, dp in (("qwen3-0.6b", 8), ("qwen3-1.7b", 12)):
        spec, _ = inventory_of(model)
        base = make_problem(spec, ParallelSizes(dp=dp, tp=1), OptimizerSettings(name="muon"),
                            cost="flops")
        prob = with_pairs(base, pair_decision(base, hw, "all-split"))
        cuts = solve(prob, DPOptions(reorder=False), hardware=hw).cuts
        owners = {i: o for i, o in pair_owners(prob, cuts).items() if o[0] != o[1]}
        phases = pair_phases(owners)
        load, waits = evaluate(prob, cuts).load, pair_waits(prob, cuts)
        paired = {d for o in owners.values() for d in o}
        assert paired and len(set(phases.values())) > 1
        for d in range(prob.dp):
            if d not in paired:
                assert waits[d] == load[d]
            else:
                comm = sum(x.run_piece()[1] for i, x in prob.pairs.items()
                           if i in owners and d in owners[i])
                assert waits[d] >= load[d] - comm - 1

        # a pair of a later phase starts when both partners are free: a partner in no other
        # pair waits for the other's earlier one (the chain)
        def dur(o, prob=prob, owners=owners):
            return lockstep_seconds([x.run_piece() for i, x in prob.pairs.items()
                                     if owners.get(i) == o], prob.settings.ns_steps)

        def rest(d, prob=prob, owners=owners, load=load):
            return load[d] - sum(prob.pairs[i].loads[o.index(d)] for i, o in owners.items()
                                 if d in o)

        for o, ph in phases.items():
            for lead, follow in (o, o[::-1]):
                first = [q for q, p in phases.items() if p < ph and lead in q]
                if first and sum(follow in q for q in phases) == 1:  # its only pair
                    assert waits[follow] - rest(follow) >= max(map(dur, first)) + dur(o) - 1
                    chains += 1
    assert chains, "no pair follows another"
