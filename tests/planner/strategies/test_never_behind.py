"""canzona is never behind the paper's method on the simulator: under the roofline cost the
planner simulates its plan beside the paper's greedy plan (and, when it shares matrices, beside
the plan sharing none) behind the forward/backward the comparison runs, and keeps the shortest.
``canzona compare``'s canzona row is therefore at most its canzona-greedy row, over a sweep of
models, sizes and share modes, and at the paper's configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from canzona.planner import DPOptions, ParallelSizes, TPOptions, build_inventory, get_preset
from canzona.planner.pipeline import greedy_options, plan_problem
from canzona.planner.plan import Plan
from canzona.planner.plan.load import load_plan
from canzona.planner.planning import make_problem
from canzona.planner.strategies import compare, compare_plan

#: The example plans: ``canzona plan`` with no flags (roofline cost, ``--share auto``).
PLANS = sorted((Path(__file__).resolve().parents[3] / "plans").glob("*.plan.json"))

#: (model, dp, tp, share): dp 8–256 × tp 1–8, with and without sharing
SWEEP = [
    ("qwen3-1.7b", 8, 8, "auto"), ("qwen3-1.7b", 16, 1, "off"), ("qwen3-1.7b", 32, 2, "auto"),
    ("qwen3-8b", 64, 4, "auto"), ("qwen3-8b", 128, 2, "off"), ("qwen3-8b", 256, 8, "off"),
    ("qwen3-32b", 8, 1, "off"), ("qwen3-32b", 32, 8, "auto"),
    ("llama3-8b", 16, 2, "auto"), ("llama3-8b", 128, 4, "off"),
    ("llama3-70b", 64, 8, "off"), ("llama3-70b", 256, 8, "auto"),
]


def _steps(model, dp, tp, share, hardware="h100", **kw):
    c = compare(model, ParallelSizes(dp=dp, tp=tp), hardware=hardware,
                dp_options=DPOptions(cost="roofline"),
                tp_options=TPOptions(share=share, hardware=hardware),
                strategies=("canzona-greedy", "canzona"), **kw)
    return c.run("canzona").sim.step_s, c.run("canzona-greedy").sim.step_s


@pytest.mark.parametrize("model,dp,tp,share", SWEEP,
                         ids=lambda x: str(x))
def test_canzona_is_never_behind_the_papers_greedy(model, dp, tp, share):
    canzona, greedy = _steps(model, dp, tp, share)
    assert canzona <= greedy, (canzona, greedy)


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_every_example_plan_is_never_behind(path):
    c = compare_plan(load_plan(path), strategies=("canzona-greedy", "canzona"))
    canzona, greedy = c.run("canzona").sim.step_s, c.run("canzona-greedy").sim.step_s
    assert canzona <= greedy, (canzona, greedy)


def test_at_the_papers_configuration():
    """Qwen3-32B dp32 tp8 on the H800 behind the paper's measured forward/backward (0.811 s),
    all-gathers overlapped: the step-time stage's cuts expose 0.3 ms more of the last reduce
    than the greedy's; the simulator sees it, and the greedy's cuts are kept."""
    canzona, greedy = _steps("qwen3-32b", 32, 8, "off", "h800", forward_backward_s=0.811,
                             overlap_param_gather=True)
    assert canzona <= greedy, (canzona, greedy)


def test_sharing_is_kept_only_where_the_simulated_step_is_shorter():
    """qwen3-1.7b dp16 at tp 1: the DP pairs the planner's model prefers simulate slower than
    sharing nothing, so the plan shares nothing."""
    shared, _ = _steps("qwen3-1.7b", 16, 1, "auto")
    alone, _ = _steps("qwen3-1.7b", 16, 1, "off")
    assert shared <= alone


def test_a_kept_judged_plan_is_the_plan_file_it_would_be():
    """The plans judged beside the one made are assembled unvalidated (they are only
    simulated); the one kept is assembled again as a plan file: a validated ``Plan``, the same
    text as the paper's greedy plan made directly, with the status saying why it was kept."""
    sizes = ParallelSizes(dp=32, tp=8)
    problem = make_problem(build_inventory(get_preset("qwen3-32b")), sizes, cost="roofline",
                           hardware="h800")
    o, t = DPOptions(cost="roofline"), TPOptions(share="off", hardware="h800")
    kept = plan_problem(problem, dp_options=o, tp_options=t, behind=(0.811, True))
    assert type(kept) is Plan and "the paper's greedy plan, kept" in kept.metrics.solver_status
    greedy = plan_problem(problem, dp_options=greedy_options(o, t)[0],
                          tp_options=greedy_options(o, t)[1])
    assert kept.model_copy(update={"metrics": greedy.metrics}).to_json() == greedy.to_json()
