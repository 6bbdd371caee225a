"""The planner's optimizer registry (canzona.planner.optimizers): names, settings, costs, schema."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ValidationError

from canzona.planner import CanzonaError, ParallelSizes, optimizers
from canzona.planner.cost import Task, task_cost
from canzona.planner.settings import OptimizerSettings

SHAPES = [(64, 64), (96, 40), (40, 96), (2048, 300), (5000, 64), (300, 20000)]
#: OptimizerSettings fields no optimizer's cost formula reads (task shapes, the Newton–Schulz
#: coefficients: what the runtime computes, not its cost).
NOT_COSTS = {"name", "qkv_split", "split_gate_up", "ns_coefficients"}


def _other_value(value):
    return (not value) if isinstance(value, bool) else max(1, value // 3)


def _costs(spec, settings):
    return [(spec.flops(m, n, settings), spec.state_numel(m, n, settings)) for m, n in SHAPES]


def test_builtin_names_in_order():
    assert optimizers.names() == ("muon", "shampoo", "soap", "normuon")
    assert all(optimizers.get(n).name == n for n in optimizers.names())


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(CanzonaError,
                       match="unknown optimizer 'adam'; registered: muon, shampoo, soap, "
                             "normuon"):
        optimizers.get("adam")
    with pytest.raises(ValidationError, match="registered: muon, shampoo, soap, normuon"):
        OptimizerSettings(name="adam")


@pytest.mark.parametrize("name", optimizers.names())
def test_spec_reads_exactly_its_settings(name):
    spec = optimizers.get(name)
    fields = set(OptimizerSettings.model_fields)
    assert set(spec.settings) <= fields - NOT_COSTS
    base = OptimizerSettings(name=name)
    before = _costs(spec, base)
    for f in fields - NOT_COSTS:
        changed = base.model_copy(update={f: _other_value(getattr(base, f))})
        if f in spec.settings:
            assert _costs(spec, changed) != before, f"{name}: {f} changes no cost"
        else:
            assert _costs(spec, changed) == before, f"{name}: {f} is read but not declared"


def test_register_rejects_duplicates_and_bad_names():
    spec = optimizers.get("muon")
    with pytest.raises(ValueError, match="already registered"):
        optimizers.register(spec)
    with pytest.raises(ValueError, match="lower-case identifier"):
        optimizers.register(optimizers.OptimizerSpec(
            name="Ada-Muon", summary="", settings=(), flops=spec.flops,
            state_numel=spec.state_numel))


def test_a_registered_optimizer_is_planned_with_its_formulas(monkeypatch):
    toy = optimizers.OptimizerSpec(name="toy", summary="a test optimizer", settings=(),
                                   flops=lambda m, n, s: 7 * m * n, state_numel=lambda m, n, s: 3)
    monkeypatch.setitem(optimizers._REGISTRY, "toy", toy)
    s = OptimizerSettings(name="toy")
    c = task_cost(Task(0, "w", None, (8, 16), "matrix", False), s, ParallelSizes(dp=2, tp=1))
    assert (c.flops, c.state_bytes) == (7 * 8 * 16, 3 * 4)
    assert OptimizerSettings.model_json_schema()["properties"]["name"]["enum"][-1] == "toy"


def test_name_schema_is_that_of_a_literal_of_the_registered_names():
    class Literal_(BaseModel):
        name: Literal["muon", "shampoo", "soap", "normuon"] = "muon"

    ours = OptimizerSettings.model_json_schema()["properties"]["name"]
    assert ours == Literal_.model_json_schema()["properties"]["name"]
    assert list(ours) == list(Literal_.model_json_schema()["properties"]["name"])


def test_normuons_sharing_counts_the_sum_of_its_row_statistics():
    """A shared NorMuon matrix's pieces all-reduce their row statistics once per step: two
    norms where the pieces hold whole rows (column-parallel shards, DP pairs), every row's
    partial sum where they hold columns (row-parallel shards). Its sharing options cost
    exactly that beyond Muon's."""
    from canzona.planner import formulas
    from canzona.planner.hardware import load_hardware
    from canzona.planner.inventory import build_inventory
    from canzona.planner.models import get_preset
    from canzona.planner.planning import make_problem
    from canzona.planner.sharing import share_options

    hw = load_hardware("h100")

    def options(name, dp, tp):
        pr = make_problem(build_inventory(get_preset("qwen3-0.6b")), ParallelSizes(dp=dp, tp=tp),
                          OptimizerSettings(name=name), cost="flops")
        return pr, {t.id: share_options(pr, t.id, hw) for t in pr.tasks}

    for dp, tp in ((2, 2), (4, 1)):
        pr, muon = options("muon", dp, tp)
        _, nor = options("normuon", dp, tp)
        seen = set()
        for t in pr.tasks:
            for a, b in zip(muon[t.id], nor[t.id]):
                assert (a.group, a.k, a.split_poly) == (b.group, b.k, b.split_poly)
                p = pr.spec[t.param]
                whole = a.group == "dp" or p.tp_dim == 0
                numel = formulas.row_stats_numel(*t.shape, whole_rows=whole)
                ranks = {"dp": a.k * tp, "tp_pair": 2 * tp}.get(a.group, tp)
                extra = hw.link(ranks).seconds(2 * (a.k - 1) / a.k * numel * 4)
                assert b.comm_s - a.comm_s == pytest.approx(extra)
                assert extra > 0
                seen.add((a.group, whole))
        assert seen == ({("tp", True), ("tp", False), ("tp_pair", True)} if tp > 1
                        else {("dp", True)})
