"""Planning for FSDP2's storage: the row rule, owners and rounds, the modelled step against its
bound, the plan file's checks, and the refusals."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner.errors import CanzonaError, PlanFileError, SizeError
from canzona.planner.formulas import fsdp2_rows
from canzona.planner.fsdp2 import (FSDP2Solution, deal_rounds, make_fsdp2_problem,
                                   round_timeline, solve_fsdp2, step_bound)
from canzona.planner.hardware import load_hardware
from canzona.planner.inventory import build_inventory
from canzona.planner.layout import ParallelSizes
from canzona.planner.models import get_preset
from canzona.planner.pipeline import plan
from canzona.planner.plan import FSDP2Plan, save_plan
from canzona.planner.plan.load import load_plan, parse_plan
from canzona.planner.settings import OptimizerSettings
from canzona.planner.stages import StageSplit


@given(rows=st.integers(0, 200), ranks=st.integers(1, 17))
@settings(max_examples=200, deadline=None)
def test_rows_follow_torch_chunk(rows: int, ranks: int) -> None:
    """ceil(rows / ranks) rows each from the top, contiguous, the last ranks short or empty."""
    got = fsdp2_rows(rows, ranks)
    each = -(-rows // ranks)
    assert len(got) == ranks
    assert sum(n for _, n in got) == rows
    at = 0
    for start, n in got:
        assert n == min(each, rows - at) if at < rows else n == 0
        if n:
            assert start == at
        at += n


@pytest.fixture(scope="module")
def qwen8b():
    return build_inventory(get_preset("qwen3-8b"))


def _problem(spec, dp, **kw):
    return make_fsdp2_problem(spec, dp, OptimizerSettings(), hardware=load_hardware("h800"),
                              **kw)


@pytest.mark.parametrize("dp", [8, 64])
def test_canzona_is_no_slower_than_dist_muon_and_the_bound_holds(qwen8b, dp: int) -> None:
    problem = _problem(qwen8b, dp)
    mine, theirs = solve_fsdp2(problem, "canzona"), solve_fsdp2(problem, "dist-muon")
    sync = solve_fsdp2(problem, "sync")
    assert mine.bound_s <= mine.step_s <= theirs.step_s < sync.step_s
    assert set(mine.owners) == set(problem.matrices) == {i for r in mine.rounds for i in r}
    # every round within the cap where its matrices allow
    for r in mine.rounds:
        held: dict[int, int] = {}
        for i in r:
            for o in mine.places[i]:
                held[o] = held.get(o, 0) + problem.full_bytes(i) // len(mine.places[i])
        assert all(b <= problem.cmax_bytes for b in held.values())


@given(seed=st.integers(0, 10_000), dp=st.integers(2, 6), count=st.integers(1, 4),
       share=st.floats(0, 1))
@settings(max_examples=40, deadline=None)
def test_the_bound_holds_for_any_owners_pairs_and_rounds(seed: int, dp: int, count: int,
                                                         share: float) -> None:
    """step_bound is a lower bound of the modelled step for owners, shared pairs and rounds
    chosen at random, not only for the planner's; a shared task's members compute it in one
    round."""
    import random

    spec = build_inventory(get_preset("qwen3-0.6b"))
    problem = make_fsdp2_problem(spec, dp, OptimizerSettings(), hardware=load_hardware("h100"))
    rng = random.Random(seed)
    places = {}
    for i in problem.matrices:
        if problem.shareable(i) and rng.random() < share:
            s = rng.randrange(dp // 2)
            places[i] = (2 * s, 2 * s + 1)
        else:
            places[i] = (rng.randrange(dp),)
    rounds = deal_rounds(problem, places, count)
    assert sorted(i for r in rounds for i in r) == sorted(places)
    assert step_bound(problem) <= round_timeline(problem, places, rounds) * (1 + 1e-9)


def test_more_rounds_hide_gathers_behind_compute(qwen8b) -> None:
    """The timeline pipelines: with compute to hide behind, several rounds are shorter than
    one, and never shorter than the compute of the busiest rank."""
    problem = _problem(qwen8b, 8)
    sol = solve_fsdp2(problem, "canzona")
    assert not sol.shared  # eight ranks: each holds many whole matrices
    one = round_timeline(problem, sol.places, deal_rounds(problem, sol.places, 1))
    assert sol.step_s < one
    busiest = max(sum(problem.compute_s[i] for i in sol.owners if sol.owners[i] == r)
                  for r in range(8))
    assert sol.step_s >= busiest


def test_at_scale_pairs_share_the_heavy_matrices(qwen8b) -> None:
    """At 256 ranks qwen3-8b has fewer matrices than ranks: longest-first leaves the largest
    on one rank each; pairs of ranks sharing them take at most 0.8 of its step, and every
    pair computes its matrix in one round."""
    problem = _problem(qwen8b, 256)
    mine, theirs = solve_fsdp2(problem, "canzona"), solve_fsdp2(problem, "dist-muon")
    assert mine.shared and mine.step_s <= 0.8 * theirs.step_s
    assert mine.bound_s <= mine.step_s
    for i, (a, b) in mine.shared.items():
        assert b == a + 1 and a % 2 == 0 and mine.owners[i] == a
        assert sum(i in r for r in mine.rounds) == 1


def test_a_plan_is_deterministic_and_reads_back(tmp_path, qwen8b) -> None:
    made = [plan("qwen3-8b", ParallelSizes(dp=16, tp=1), "muon", storage="fsdp2")
            for _ in range(2)]
    assert isinstance(made[0], FSDP2Plan) and made[0].schema_version == 10
    assert made[0].to_json() == made[1].to_json()
    path = save_plan(made[0], tmp_path / "p.plan.json")
    back = load_plan(path)
    assert back == made[0] and back.to_json() == path.read_text()


@pytest.mark.parametrize("optimizer", ["shampoo", "soap"])
def test_other_matrix_optimizers_plan(optimizer: str) -> None:
    p = plan("qwen3-0.6b", ParallelSizes(dp=4, tp=1), optimizer, storage="fsdp2")
    assert p.inputs.optimizer.name == optimizer
    assert all(t.owner in range(4) for t in p.tasks if t.optimizer == "matrix")


def _tampered(p: FSDP2Plan, edit) -> str:  # noqa: ANN001
    data = json.loads(p.to_json())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["tasks"][next(i for i, t in enumerate(d["tasks"])
                               if t["optimizer"] == "matrix")].update(owner=99),
     "tasks["),
    (lambda d: d["fsdp2"]["rounds"][0].update(tasks=d["fsdp2"]["rounds"][0]["tasks"][1:]),
     "fsdp2.rounds"),
    (lambda d: d["fsdp2"]["rounds"][0]["sent_bytes"].__setitem__(0, 1), "sent_bytes"),
    (lambda d: d["metrics"].update(dp_load=[0] * len(d["metrics"]["dp_load"])),
     "metrics.dp_load"),
    (lambda d: d["tasks"][0].update(flops=d["tasks"][0]["flops"] + 1), "tasks[0]"),
])
def test_a_tampered_plan_is_refused_naming_the_field(edit, field: str) -> None:  # noqa: ANN001
    p = plan("qwen3-0.6b", ParallelSizes(dp=4, tp=1), "muon", storage="fsdp2")
    with pytest.raises(PlanFileError, match=None) as err:
        parse_plan(_tampered(p, edit), "p.json")
    assert field in str(err.value) and "\n" not in str(err.value)


def test_an_fsdp2_file_of_another_version_is_refused() -> None:
    p = plan("qwen3-0.6b", ParallelSizes(dp=2, tp=1), "muon", storage="fsdp2")
    with pytest.raises(PlanFileError, match="schema version 10"):
        parse_plan(_tampered(p, lambda d: d.update(schema_version=9)), "p.json")


@pytest.mark.parametrize("sizes, split, field", [
    (ParallelSizes(dp=4, tp=1, ep=2), None, "ParallelSizes.ep"),
    (ParallelSizes(dp=4, tp=1), StageSplit(pp=2), "StageSplit.pp"),
])
def test_expert_and_pipeline_parallelism_are_refused(sizes, split, field: str) -> None:
    with pytest.raises(SizeError) as err:
        plan("qwen3-30b-a3b" if sizes.ep > 1 else "qwen3-0.6b", sizes, "muon",
             storage="fsdp2", stages=split)
    assert field in err.value.fields


def test_split_matrices_and_unknown_storages_are_refused() -> None:
    with pytest.raises(SizeError, match="qkv_split"):
        plan("qwen3-0.6b", ParallelSizes(dp=2, tp=1), OptimizerSettings(qkv_split="qkv"),
             storage="fsdp2")
    with pytest.raises(CanzonaError, match="zero1, fsdp2"):
        plan("qwen3-0.6b", ParallelSizes(dp=2, tp=1), "muon", storage="fsdp1")


def test_a_solution_reports_its_owners_loads(qwen8b) -> None:
    problem = _problem(qwen8b, 4)
    sol = solve_fsdp2(problem, "canzona")
    assert isinstance(sol, FSDP2Solution)
    loads = sol.loads(problem)
    assert sum(loads) == pytest.approx(sum(problem.weight(i) for i in problem.matrices))


#: What torch 2.13 holds on each rank (d, t) of a dp 2 × tp 2 mesh, read from the ranks'
#: ``to_local()`` after ``parallelize_module`` then ``fully_shard``: colwise (7, 5) and (3, 5),
#: rowwise (5, 7), a rowwise-parallel embedding (11, 5) (TP shards its rows).
TORCH_BLOCKS = [
    ((7, 5), 0, [(0, 2, 0, 5), (4, 6, 0, 5), (2, 4, 0, 5), (6, 7, 0, 5)]),
    ((3, 5), 0, [(0, 1, 0, 5), (2, 3, 0, 5), (1, 2, 0, 5), (3, 3, 0, 5)]),
    ((5, 7), 1, [(0, 3, 0, 4), (0, 3, 4, 7), (3, 5, 0, 4), (3, 5, 4, 7)]),
    ((11, 5), 0, [(0, 3, 0, 5), (6, 9, 0, 5), (3, 6, 0, 5), (9, 11, 0, 5)]),
]


@pytest.mark.parametrize("shape, dim, blocks", TORCH_BLOCKS)
def test_blocks_under_tp_are_torchs(shape, dim, blocks) -> None:
    from canzona.planner.formulas import fsdp2_block

    assert [fsdp2_block(shape, dim, 2, 2, d, t) for d in (0, 1) for t in (0, 1)] == blocks


@given(rows=st.integers(1, 40), cols=st.integers(1, 40), dp=st.integers(1, 4),
       tp=st.integers(1, 3), dim=st.sampled_from([0, 1, None]), owner=st.integers(0, 11))
@settings(max_examples=150, deadline=None)
def test_a_gather_moves_the_matrix_but_the_owners_block(rows, cols, dp, tp, dim, owner) -> None:
    """The blocks tile the matrix (each TP copy of a replicated one); the owner receives all
    of it but what it holds, whoever sends."""
    from canzona.planner.formulas import fsdp2_block
    from canzona.planner.fsdp2 import gather_bytes

    owner %= dp * tp
    cells = {}
    for d in range(dp):
        for t in range(tp):
            r0, r1, c0, c1 = fsdp2_block((rows, cols), dim, dp, tp, d, t)
            if dim is None and t:
                continue
            for r in range(r0, r1):
                for c in range(c0, c1):
                    assert (r, c) not in cells
                    cells[(r, c)] = d * tp + t
    assert len(cells) == rows * cols
    sent, received = gather_bytes((rows, cols), dim, dp, tp, 1,
                                  ((owner, 0, max(rows, cols)),))
    r0, r1, c0, c1 = fsdp2_block((rows, cols), dim, dp, tp, owner // tp, owner % tp)
    assert sum(sent) == received[owner] == rows * cols - (r1 - r0) * (c1 - c0)


def test_fsdp2_with_tp_plans_over_the_whole_mesh() -> None:
    """dp 8 × tp 8 is 64 owners, as dp 64 is; the plan records each task's TP split."""
    made = plan("qwen3-8b", ParallelSizes(dp=8, tp=8), "muon", storage="fsdp2")
    flat = plan("qwen3-8b", ParallelSizes(dp=64, tp=1), "muon", storage="fsdp2")
    assert made.inputs.tp == 8 and len(made.fsdp2.split_dims) == len(made.tasks)
    assert {t.owner for t in made.tasks if t.owner is not None} <= set(range(64))
    assert len(made.metrics.dp_load) == 64
    assert made.fsdp2.modelled_step_s <= 1.05 * flat.fsdp2.modelled_step_s
    assert parse_plan(made.to_json()) == made
