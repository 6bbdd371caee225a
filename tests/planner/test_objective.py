"""The one objective hook: ``max-load`` is the busiest DP index's load, a per-bucket term g
reaches every DP solver (per-bucket DP, CP-SAT) and the joint DP × TP refinement, and the
default ``step-time`` objective lowers the predicted collective time within its bounds."""

import numpy as np
import pytest

from canzona.planner import DPOptions, OptimizerSettings, ParallelSizes, build_inventory
from canzona.planner.dp import greedy, solve_cpsat
from canzona.planner.solve import solve
from canzona.planner.models import ModelConfig
from canzona.planner.objective import MAX_LOAD, Objective
from canzona.planner.planning import evaluate, make_problem
from canzona.planner.tp import TPContext, index_gpu_max, joint_refine

SMALL = ModelConfig(name="small", arch="qwen3", hidden=256, ffn=768, layers=6, q_heads=4,
                    kv_heads=2, head_dim=64, vocab=1000, tied_embeddings=False, qk_norm=True)


def _problem(dp=4, tp=1):
    return make_problem(build_inventory(SMALL), ParallelSizes(dp, tp), OptimizerSettings(),
                        bucket_size=200_000)


class ExcessSlice(Objective):
    """g_b = β · Σ_r max(0, s_r − S_b/R_b): elements above the even slice (what padding costs)."""

    name = "max-load+excess"
    has_bucket_term = True

    def __init__(self, beta: float):
        self.beta = beta

    def slice_term(self, problem, bucket, size):
        even = (bucket.end - bucket.start) / bucket.ranks
        return self.beta * np.maximum(0.0, np.asarray(size, dtype=float) - even)


def _excess(problem, cuts):
    total = 0
    for b in problem.buckets:
        c = cuts[(b.buffer, b.bucket)]
        even = (b.end - b.start) / b.ranks
        total += sum(max(0.0, (y - x) - even) for x, y in zip(c, c[1:]))
    return total


def test_the_max_load_objective_by_name_and_by_object():
    pr = _problem()
    sol = solve(pr, DPOptions(objective="max-load"))
    ev = evaluate(sol.problem, sol.cuts)
    assert MAX_LOAD.score(sol.problem, sol.cuts) == max(ev.load)
    assert MAX_LOAD.bucket_terms(sol.problem, sol.cuts) == 0
    again = solve(pr, DPOptions(objective=MAX_LOAD))
    assert again.cuts == sol.cuts and again.problem.buckets == sol.problem.buckets


@pytest.mark.parametrize("reorder", [False, True])
def test_a_bucket_term_reaches_the_per_bucket_dp(reorder):
    pr = _problem()
    plain = solve(pr, DPOptions(reorder=reorder, objective="max-load"))
    # β so large that one element above the even slice outweighs any load difference.
    obj = ExcessSlice(beta=float(pr.total_load()))
    sol = solve(pr, DPOptions(reorder=reorder, objective=obj))
    assert _excess(sol.problem, sol.cuts) < _excess(plain.problem, plain.cuts)
    # The objective judged the result: never worse than the greedy start, or than today's cuts.
    start = greedy(pr)
    assert obj.score(sol.problem, sol.cuts) <= obj.score(pr, start)
    assert obj.score(sol.problem, sol.cuts) <= obj.score(plain.problem, plain.cuts)
    # Every matrix still whole on one rank.
    assert evaluate(sol.problem, sol.cuts).split_matrices == 0


def test_the_score_adds_g_to_f():
    pr = _problem()
    sol = solve(pr, DPOptions(objective="max-load"))
    obj = ExcessSlice(beta=2.0)
    expected = max(evaluate(sol.problem, sol.cuts).load) + 2.0 * _excess(sol.problem, sol.cuts)
    assert obj.score(sol.problem, sol.cuts) == pytest.approx(expected)


class EmptySlices(Objective):
    """g_b = β · (number of ranks with an empty slice of b), with its CP-SAT form."""

    has_bucket_term = True

    def __init__(self, beta: float):
        self.beta = beta

    def slice_term(self, problem, bucket, size):
        return self.beta * (np.asarray(size) == 0).astype(float)

    def cpsat_slice_term(self, model, problem, bucket, size, unit_load):
        empty = model.new_bool_var("empty")
        model.add(size >= 1).only_enforce_if(empty.Not())
        return int(round(self.beta / unit_load)) * empty  # in the model's load units


def _empty(problem, cuts):
    return sum(y == x for b in problem.buckets
               for x, y in zip(cuts[(b.buffer, b.bucket)], cuts[(b.buffer, b.bucket)][1:]))


def test_a_bucket_term_reaches_cpsat():
    pr = _problem()
    # Cuts for the max load alone leave some ranks with nothing in a bucket.
    loaded, _, _ = solve_cpsat(pr, greedy(pr), time_limit_s=1.0, seed=0)
    unit_load = pr.total_load() / pr.dp / 1_000_000  # dp.cpsat's scale (SCALE_UNITS)
    obj = EmptySlices(beta=100_000 * unit_load)  # an empty slice outweighs 10 % of the mean load
    cuts, status, bound = solve_cpsat(pr, loaded, time_limit_s=1.0, seed=0, objective=obj)
    assert status.startswith("cpsat-") and bound == 0  # no load bound with g in the model
    assert _empty(pr, cuts) < _empty(pr, loaded)
    assert obj.score(pr, cuts) < obj.score(pr, loaded)
    assert evaluate(pr, cuts).split_matrices == 0


def test_the_joint_refinement_is_judged_by_the_objective():
    pr = _problem(dp=4, tp=2)
    sol = solve(pr, DPOptions(objective="max-load"))
    ctx = TPContext.build(sol.problem)
    obj = ExcessSlice(beta=float(pr.total_load()))
    out = joint_refine(sol.problem, sol.cuts, ctx=ctx, objective=obj)
    before = obj.gpu_score(index_gpu_max(sol.problem, sol.cuts, ctx), sol.problem, sol.cuts)
    after = obj.gpu_score(index_gpu_max(sol.problem, out, ctx), sol.problem, out)
    assert after <= before


def test_an_objective_that_is_not_one_is_refused():
    from canzona.planner import OptionError

    with pytest.raises(OptionError, match="DPOptions.objective"):
        DPOptions(objective="max")


@pytest.mark.parametrize("dp,tp", [(4, 1), (8, 1), (4, 2)])
def test_step_time_lowers_the_predicted_collectives_within_its_bounds(dp, tp):
    """The default objective: never a slower predicted step than the max-load cuts, the busiest
    compute at most STEP_TIME_GAP_PP points of the bound above theirs, the busiest state under
    the target or hardly worse than theirs, every matrix whole."""
    from canzona.planner.solve import state_target
    from canzona.planner.hardware import load_hardware
    from canzona.planner.objective import StepTime
    from canzona.planner.options import STEP_TIME_GAP_PP

    pr = _problem(dp=dp, tp=tp)
    base = solve(pr, DPOptions(objective="max-load"))
    sol = solve(pr, DPOptions())  # the default: step-time
    obj = StepTime(sol.problem, load_hardware("h100"))
    assert obj.bucket_terms(sol.problem, sol.cuts) <= obj.bucket_terms(base.problem, base.cuts)
    ev, ev0 = evaluate(sol.problem, sol.cuts), evaluate(base.problem, base.cuts)
    assert max(ev.load) <= max(ev0.load) + STEP_TIME_GAP_PP / 100 * base.bound + 1
    # a bounded secondary term: under the target, or within 1 % of where it was
    assert max(ev.state_bytes) <= max(state_target(sol.problem), 1.01 * max(ev0.state_bytes))
    assert ev.split_matrices == 0


def test_step_time_in_load_units():
    """A bucket's term is its fastest method's predicted seconds at the problem's own rate
    (its compute seconds over its load), and a slice's separable part is 2α when non-empty."""
    from canzona.planner import comm
    from canzona.planner.hardware import load_hardware
    from canzona.planner.objective import StepTime

    pr = _problem(dp=4)
    hw = load_hardware("h800")
    obj = StepTime(pr, hw)
    rate = sum(hw.seconds(c.flops) for c in pr.costs) / pr.total_load()
    b = pr.buckets[0]
    sizes = [b.end - b.start, 0, 0, 0]
    _, link = comm.plan_link(hw, 4, 1)  # 4 GPUs: inside one node
    assert link == hw.intra_node
    buf = pr.layout.buffers[b.buffer]
    want = comm.choose(sizes, grad_bytes=comm.ELEMENT_BYTES[buf.grad_dtype],
                       param_bytes=comm.ELEMENT_BYTES[buf.dtype], link=link).seconds / rate
    assert obj.bucket_term(pr, b, sizes) == pytest.approx(want)
    assert obj.slice_term(pr, b, 5) == pytest.approx(2 * link.latency_s / rate)
    assert obj.slice_term(pr, b, 0) == 0.0


def test_cpsat_keeps_the_secondary_balances_of_auto():
    """A Shampoo plan by CP-SAT holds its optimizer state and reduce-scatter slices as evenly as
    the default solver's: its second phase balances them with the busiest load held (under
    max-load; step-time then trades slice sizes for fewer calls, alike after either)."""
    def balance(sol):
        ev = evaluate(sol.problem, sol.cuts)
        return [max(v) / (sum(v) / len(v)) for v in (ev.state_bytes, ev.rs_bytes)]

    pr = make_problem(build_inventory(SMALL), ParallelSizes(4, 1),
                      OptimizerSettings(name="shampoo"), bucket_size=200_000)
    auto = balance(solve(pr, DPOptions(objective="max-load")))
    cpsat = balance(solve(pr, DPOptions(solver="cpsat", time_limit_s=1.0, objective="max-load")))
    assert all(c <= max(1.10, a) + 1e-9 for c, a in zip(cpsat, auto)), (cpsat, auto)
