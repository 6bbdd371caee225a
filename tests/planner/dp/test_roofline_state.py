"""Under the roofline cost an AdamW tensor weighs in the balance (its memory traffic) while it
holds 8 B of state per element: the planner must not pile that state on a few DP indices to
shave compute (an embedding left whole on one DP index by the reordered assignment, indices
emptied by the joint refinement). qwen3-1.7b's tied embedding is 18 % of its parameters."""

import pytest

from canzona.planner import ParallelSizes
from canzona.planner.options import DPOptions, TPOptions
from canzona.planner.pipeline import plan


@pytest.mark.parametrize("model,dp,tp", [("qwen3-1.7b", 32, 4), ("qwen3-0.6b", 16, 2)])
def test_roofline_plans_keep_the_optimizer_state_spread(model, dp, tp):
    p = plan(model, ParallelSizes(dp=dp, tp=tp), "muon", dp_options=DPOptions(cost="roofline"),
             tp_options=TPOptions(share="off"))
    state = p.metrics.dp_state_bytes
    load = p.metrics.dp_load
    assert min(load) > 0, "a DP index left without work"
    assert max(state) <= 2.0 * sum(state) / len(state)
