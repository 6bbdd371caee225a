"""The runtime's optimizer registry (canzona.runtime.optim.registry) against the planner's.

Every optimizer the planner can plan for has a kernel; the kernel built from a plan's recorded
settings costs exactly what the planner's spec says (FLOPs and state elements); the
CanzonaOptimizer arguments a kernel's config lacks are refused in one message.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

import canzona
from canzona.planner import CanzonaError, optimizers
from canzona.planner.settings import OptimizerSettings
from canzona.runtime.errors import PlanMismatchError
from canzona.runtime.optim import registry
from canzona.runtime.optimizer import CanzonaOptimizer

SHAPES = [(64, 64), (96, 40), (40, 96), (33, 70)]
#: Non-default plan settings, so that the recorded fields really reach the kernel.
SETTINGS = {"muon": {"ns_steps": 3},
            "shampoo": {"max_preconditioner_dim": 32, "shampoo_precondition_frequency": 3,
                        "shampoo_grafting": False},
            "soap": {"soap_max_precond_dim": 50, "soap_precondition_frequency": 4}}


def test_every_planned_optimizer_has_a_kernel():
    assert registry.names() == optimizers.names()


@pytest.mark.parametrize("name", optimizers.names())
@pytest.mark.parametrize("custom", [False, True])
def test_kernel_from_recorded_settings_costs_what_the_planner_says(name, custom):
    s = OptimizerSettings(name=name, **(SETTINGS.get(name, {}) if custom else {}))
    spec, planned = registry.get(name), optimizers.get(name)
    recorded = spec.recorded(s)
    assert set(recorded) <= {f.name for f in dataclasses.fields(spec.config) if f.init}
    kernel = spec.build(spec.config(**recorded))
    for m, n in SHAPES:
        assert kernel.flops((m, n)) == planned.flops(m, n, s)
        assert kernel.state_numel((m, n)) == planned.state_numel(m, n, s)
        state = kernel.init_state((m, n))
        assert sum(t.numel() for t in state.values()) == planned.state_numel(m, n, s)
    assert all(isinstance(v, bool) for _, v in spec.state_layout(kernel.config))
    assert kernel.local_state == planned.local_state  # where FSDP2 keeps the state


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 8))


def test_plan_model_refuses_an_unknown_optimizer():
    with pytest.raises(CanzonaError,
                       match="unknown optimizer 'adam'; registered: muon, shampoo, soap"):
        canzona.plan_model(_tiny(), dp=1, optimizer="adam")


def test_arguments_the_kernel_config_lacks_are_refused():
    model = _tiny()
    soap = canzona.plan_model(model, dp=1, optimizer="soap")
    with pytest.raises(PlanMismatchError, match=r"SOAP has no momentum setting .*'betas'"):
        CanzonaOptimizer(model, soap, momentum=0.9)
    shampoo = canzona.plan_model(model, dp=1, optimizer="shampoo")
    with pytest.raises(PlanMismatchError, match="Shampoo has no ns_steps setting"):
        CanzonaOptimizer(model, shampoo, ns_steps=5)


def test_a_plan_without_a_registered_kernel_is_refused(monkeypatch):
    model = _tiny()
    plan = canzona.plan_model(model, dp=1, optimizer="soap")
    monkeypatch.delitem(registry._REGISTRY, "soap")
    with pytest.raises(PlanMismatchError, match="'soap', which has no runtime kernel"):
        CanzonaOptimizer(model, plan)
