"""The runtime's records and checks on one process: bucket boundaries as the runtime receives
them, the work order's coverage, the plan's collective methods, the fingerprint's dtype,
keyword-only arguments."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import canzona
from canzona.planner import CanzonaError
import dp_helpers as H
from canzona.runtime import checks
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.introspect import inventory
from canzona.runtime.optimizer import CanzonaOptimizer
from canzona.runtime.schedule import build_schedule


def _schedule(model, plan, rank: int = 0):
    names = [n for n, _ in model.named_parameters()]
    return names, build_schedule(plan, names, rank)


def test_a_bucket_closes_when_it_reaches_its_size_exactly():
    """Megatron closes a bucket as soon as it holds ``bucket_size`` elements (>=, not >): with the
    size exactly on the end of the first parameter laid out (lm_head, laid out in reverse
    registration order), that parameter is a bucket of its own."""
    model = H.TinyGPT()
    first = model.lm_head.weight.numel()
    names, s = _schedule(model, canzona.plan_model(model, dp=2, bucket_size=first))
    assert [names[sl.param] for sl in s.buckets[0].slots] == ["lm_head.weight"]
    # one element more and the next parameters join it
    names, s = _schedule(model, canzona.plan_model(model, dp=2, bucket_size=first + 1))
    assert [names[sl.param] for sl in s.buckets[0].slots][:2] == ["lm_head.weight", "ln_f.bias"]


def test_the_work_order_covers_every_parameter_exactly_once():
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=2, bucket_size=3000)
    names, s = _schedule(model, plan)
    checks.check_work_order(s, names)  # the ranks together: every element once
    assert sum(len(ts) for w in s.work for ts in w.matrix) == sum(
        1 for t in plan.tasks if t.optimizer == "matrix")
    # a task dropped from rank 1's order: its matrix is not updated at all
    w1 = s.work[1]
    bi = next(i for i, ts in enumerate(w1.matrix) if ts)
    dropped = w1.matrix[bi][0]
    matrix = tuple(ts[1:] if i == bi else ts for i, ts in enumerate(w1.matrix))
    broken = dataclasses.replace(s, work=(s.work[0], dataclasses.replace(w1, matrix=matrix)))
    with pytest.raises(PlanMismatchError, match=f"'{dropped.name}'"):
        checks.check_work_order(broken, names)
    # the same task twice: updated twice
    doubled = tuple(ts + (dropped,) if i == bi else ts for i, ts in enumerate(w1.matrix))
    broken = dataclasses.replace(s, work=(s.work[0], dataclasses.replace(w1, matrix=doubled)))
    with pytest.raises(PlanMismatchError, match="twice"):
        checks.check_work_order(broken, names)


def test_each_bucket_moves_with_the_plans_method():
    """The schedule takes each bucket's collective method from the plan, whatever it is."""
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=2, bucket_size=model.lm_head.weight.numel())
    chosen = [b.method for buf in plan.buffers for b in buf.buckets]
    _, s = _schedule(model, plan)
    assert [b.method for b in s.buckets] == chosen
    other = {"per_root": "all_to_all", "all_to_all": "per_root", "padded": "all_reduce",
             "equal": "per_root", "all_reduce": "padded"}
    edited = plan.model_copy(update={"buffers": tuple(
        buf.model_copy(update={"buckets": tuple(b.model_copy(update={"method": other[b.method]})
                                                for b in buf.buckets)})
        for buf in plan.buffers)})
    _, s = _schedule(model, edited)
    assert [b.method for b in s.buckets] == [other[m] for m in chosen]


def test_a_dtype_change_changes_the_fingerprint():
    fp32 = inventory(H.TinyGPT()).fingerprint()
    bf16 = inventory(H.TinyGPT().to(torch.bfloat16)).fingerprint()
    assert fp32 != bf16
    assert inventory(H.TinyGPT()).fingerprint() == fp32  # and nothing else does


def test_a_bf16_model_is_refused_a_plan_made_for_fp32():
    plan = canzona.plan_model(H.TinyGPT(), dp=1)
    model = H.TinyGPT().to(torch.bfloat16)
    with pytest.raises(PlanMismatchError, match=r"parameter 'wte.weight' is fp32 in the plan but "
                                                r"bf16 in the model"):
        CanzonaOptimizer(model, plan)


def test_arguments_after_plan_are_keyword_only():
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=1)
    with pytest.raises(TypeError, match="positional"):
        CanzonaOptimizer(model, plan, 0.02)
    CanzonaOptimizer(model, plan=plan, lr=0.02).close()


def test_plan_mismatch_is_a_canzona_error():
    from canzona.planner.errors import CanzonaError

    assert issubclass(PlanMismatchError, CanzonaError)
    assert issubclass(PlanMismatchError, ValueError)


def test_plan_model_takes_the_objective_and_the_hardware_profile():
    """plan_model records the profile its methods were chosen with and the objective, and
    refuses an unknown profile naming the option."""
    model = H.TinyGPT()
    plan = canzona.plan_model(model, dp=2, hardware="cpu", objective="max-load")
    assert plan.comm.hardware == "cpu" and plan.inputs.solver.objective == "max-load"
    assert canzona.plan_model(model, dp=2).comm.hardware == "h100"
    with pytest.raises(CanzonaError, match="TPOptions.hardware"):
        canzona.plan_model(model, dp=2, hardware="a100")


def test_split_qkv_at_tp1_on_megatron_grouped_qkv_is_refused():
    """At tp 1 a split part is taken as contiguous rows; Megatron's fused QKV is grouped per KV
    group, so the runtime refuses the plan instead of updating the wrong rows (measured 5e-3 off
    the reference before)."""
    import tp_helpers as T

    import canzona
    from canzona.runtime.errors import PlanMismatchError

    old = T.CFG
    T.CFG = T.CFG.model_copy(update={"vocab": 128})  # tp 1 holds it unpadded
    try:
        start = T.initial_full()
        local = [(p.name, T.megatron_param(p, T.local_of(p, start[p.name], 1, 0), 1))
                 for p in T.spec().params]
        with pytest.raises(PlanMismatchError, match="splits Q/K/V of .*linear_qkv.* at tp = 1"):
            canzona.CanzonaOptimizer(local, T.plan_for(1, 1, split=True))
        canzona.CanzonaOptimizer(local, T.plan_for(1, 1, split=False))  # fused: accepted
    finally:
        T.CFG = old
