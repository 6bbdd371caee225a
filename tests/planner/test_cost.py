"""Tasks and costs: the paper's figures, cost models, hardware profiles."""

import pytest

from canzona.planner import (OptimizerSettings, ParallelSizes, build_inventory, build_tasks,
                             get_preset, load_hardware, task_cost)
from canzona.planner.cost import FlopsCost, NumelCost, CalibratedCost, make_cost_model
from canzona.planner import formulas
from canzona.planner.errors import CanzonaError


def test_qwen3_32b_muon_bound(q32):
    """§8: total ≈ 3.5 PFLOP, mean per GPU (256) ≈ 13.8 TFLOP, fc1 ≈ 28 TFLOP, max/mean ≥ 2.04."""
    sizes = ParallelSizes(dp=32, tp=8)
    s = OptimizerSettings()
    tasks = build_tasks(q32, s, sizes)
    fc = FlopsCost(s, sizes)
    matrix = [fc.cost(t) for t in tasks if t.optimizer == "matrix"]
    total = sum(matrix)
    assert 3.5e15 < total < 3.6e15
    assert 13.7e12 < total / 256 < 13.9e12
    fc1 = max(matrix)
    assert fc1 == 5 * (4 * 5120**2 * 51200 + 2 * 5120**3)
    assert 2.03 < fc1 / (total / 256) < 2.05


def test_split_parts_become_tasks(q32):
    sizes = ParallelSizes(dp=32, tp=8)
    fused = build_tasks(q32, OptimizerSettings(), sizes)
    split = build_tasks(q32, OptimizerSettings(split_qkv=True, split_gate_up=True), sizes)
    assert len(split) == len(fused) + 64 * (2 + 1)
    parts = [t for t in split if t.param == "decoder.layers.0.mlp.linear_fc1.weight"]
    assert [(t.part, t.shape) for t in parts] == [("gate", (25600, 5120)), ("up", (25600, 5120))]
    assert [t.id for t in split] == list(range(len(split)))
    # Splitting preserves elements but lowers the largest task's FLOPs.
    assert sum(t.numel for t in split) == sum(t.numel for t in fused) == q32.total_params
    fc = FlopsCost(OptimizerSettings(), sizes)
    assert max(fc.cost(t) for t in split) < max(fc.cost(t) for t in fused) / 1.9


def test_cost_vector(q32):
    sizes = ParallelSizes(dp=4, tp=4)
    s = OptimizerSettings()
    t = next(t for t in build_tasks(q32, s, sizes)
             if t.param.endswith("layers.0.mlp.linear_fc2.weight"))
    c = task_cost(t, s, sizes)
    assert c.state_bytes == 5120 * 25600 * 4  # Muon momentum, fp32
    assert c.tp_comm_bytes == 2 * (5120 * 25600 * 3 // 4) * 2  # gather + scatter of 3/4, bf16
    emb = build_tasks(q32, s, sizes)[0]
    ce = task_cost(emb, s, sizes)
    assert (emb.optimizer == "adamw" and ce.tp_comm_bytes == 0
            and ce.state_bytes == 2 * emb.numel * 4 + 4)
    assert task_cost(t, s, ParallelSizes(dp=4, tp=1)).tp_comm_bytes == 0


@pytest.mark.parametrize("opt", ["muon", "shampoo", "soap"])
def test_every_optimizer_costs_its_formulas(q32, opt):
    """Matrices cost their optimizer's formulas (fp32 state), the rest AdamW's; all positive."""
    sizes = ParallelSizes(dp=8, tp=1)
    s = OptimizerSettings(name=opt)
    matrix = {
        "muon": lambda m, n: (formulas.muon_flops(m, n, ns_steps=s.ns_steps),
                              formulas.muon_state_numel(m, n)),
        "shampoo": lambda m, n: (
            formulas.shampoo_flops(m, n, max_preconditioner_dim=s.max_preconditioner_dim,
                                   precondition_frequency=s.shampoo_precondition_frequency),
            formulas.shampoo_state_numel(m, n, max_preconditioner_dim=s.max_preconditioner_dim,
                                         grafting=s.shampoo_grafting)),
        "soap": lambda m, n: (
            formulas.soap_flops(m, n, max_precond_dim=s.soap_max_precond_dim,
                                precondition_frequency=s.soap_precondition_frequency),
            formulas.soap_state_numel(m, n, max_precond_dim=s.soap_max_precond_dim)),
    }[opt]
    tasks = build_tasks(q32, s, sizes)[:12]
    assert {t.optimizer for t in tasks} == {"adamw", "matrix"}
    for t in tasks:
        c = task_cost(t, s, sizes)
        if t.optimizer == "matrix":
            flops, state = matrix(*t.shape)
            assert state >= t.numel  # at least a momentum buffer
        else:
            flops, state = formulas.adamw_flops(t.numel), formulas.adamw_state_numel(t.numel)
        assert flops > 0 and (c.flops, c.state_bytes, c.tp_comm_bytes) == (flops, 4 * state, 0)


def test_cost_models():
    spec = build_inventory(get_preset("qwen3-0.6b"))
    sizes = ParallelSizes(dp=2, tp=1)
    s = OptimizerSettings()
    tasks = build_tasks(spec, s, sizes)
    t = tasks[2]
    assert NumelCost().cost(t) == t.numel
    assert make_cost_model("flops", s, sizes).cost(t) == task_cost(t, s, sizes).flops
    cal = CalibratedCost(s, sizes, {t.shape: 0.5}, flops_per_second=1e9)
    assert cal.cost(t) == 500_000_000
    other = tasks[3]
    assert cal.cost(other) == round(task_cost(other, s, sizes).flops / 1e9 * 1e9)
    with pytest.raises(CanzonaError, match="flops, numel"):
        make_cost_model("time", s, sizes)


def test_hardware_profiles():
    h100, h800 = load_hardware("h100"), load_hardware("H800")
    assert h100.peak_flops["bf16"] == 989e12 and h800.intra_node.busbw < h100.intra_node.busbw
    assert load_hardware("cpu").gpus_per_node >= 1
    with pytest.raises(CanzonaError, match="h100"):
        load_hardware("a100")


# --- the roofline ---------------------------------------------------------------------------


def test_the_roofline_prices_adamw_by_its_memory_traffic_and_muon_by_both(q32):
    """AdamW is memory-bound: its seconds are its bytes over the bandwidth, hundreds of times
    what its FLOPs at the matmul rate say. A Muon matrix takes its Newton–Schulz FLOPs at the
    rate plus its element-wise passes over the bandwidth (the products themselves are
    compute-bound at this size)."""
    from canzona.planner.cost import Roofline, RooflineCost

    hw = load_hardware("h800")
    roof = Roofline.of(hw)
    assert roof.rate == hw.peak_flops["bf16"] * hw.compute_efficiency
    sizes, s = ParallelSizes(dp=32, tp=8), OptimizerSettings()
    tasks = {t.name: t for t in build_tasks(q32, s, sizes)}
    emb = tasks["embedding.word_embeddings.weight"]
    c = task_cost(emb, s, sizes)
    assert roof.seconds(c) == pytest.approx(30 * emb.numel / hw.memory_bandwidth, rel=1e-12)
    assert roof.seconds(c) > 300 * c.flops / roof.rate
    fc1 = tasks["decoder.layers.0.mlp.linear_fc1.weight"]
    c = task_cost(fc1, s, sizes)
    assert c.flops_bytes / hw.memory_bandwidth < c.flops / roof.rate  # compute-bound products
    want = c.flops / roof.rate + 54 * fc1.numel / hw.memory_bandwidth
    assert roof.seconds(c) == pytest.approx(want, rel=1e-12)
    model = make_cost_model("roofline", s, sizes, "h800")
    assert isinstance(model, RooflineCost)
    assert model.cost(fc1) == round(want * 1e9)
    # a small matrix's products are memory-bound: the roofline takes their bytes
    small = task_cost(type(fc1)(0, "w", None, (64, 64), "matrix", False), s, sizes)
    assert roof.seconds(small) == pytest.approx(
        (small.flops_bytes + small.traffic_bytes) / hw.memory_bandwidth, rel=1e-12)


def test_a_roofline_plan_records_nanoseconds_and_its_checks_refuse_others():
    """Every task's cost in a ``roofline`` plan is its roofline time on the plan's profile, in
    ns; ``load_plan`` refuses a plan whose cost was edited."""
    import json

    from canzona.planner import DPOptions, TPOptions
    from canzona.planner.cost import Roofline
    from canzona.planner.errors import PlanFileError
    from canzona.planner.pipeline import plan as make_plan
    from canzona.planner.plan.load import parse_plan

    plan = make_plan("qwen3-0.6b", ParallelSizes(dp=4, tp=2), dp_options=DPOptions(cost="roofline"),
                     tp_options=TPOptions(hardware="h800"))
    roof = Roofline.of(load_hardware("h800"))
    s = plan.inputs.optimizer
    for t in plan.tasks:
        c = task_cost(_task(t), s, ParallelSizes(dp=4, tp=2))
        assert t.cost == max(1, round(roof.seconds(c) * 1e9)), t.param
    data = json.loads(plan.model_dump_json())
    parse_plan(json.dumps(data))  # as written: accepted
    data["tasks"][3]["cost"] += 1
    with pytest.raises(PlanFileError, match=r"tasks\[3\]\.cost.*roofline"):
        parse_plan(json.dumps(data))


def _task(t):
    from canzona.planner.cost import Task

    return Task(t.id, t.param, t.part, t.shape, t.optimizer, False)
