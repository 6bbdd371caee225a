"""canzona: matrix-based optimizers (Muon, Shampoo, SOAP) under ZeRO-1 DP and TP.

The planner (``canzona.planner``) is torch-free; the runtime (``canzona.runtime``) needs torch
(``pip install canzona[runtime]``). Names that need torch are loaded lazily so that
``import canzona`` and ``import canzona.planner`` never import torch.

    plan = canzona.plan_model(model, dp=2)               # or canzona.load_plan("plan.json")
    canzona.save_plan(plan, "plan.json")                 # atomically; torch-free, as load_plan
    opt = canzona.CanzonaOptimizer(model, plan, lr=0.02)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["CanzonaOptimizer", "__version__", "dcp_state", "load_checkpoint", "load_plan",
           "plan_model", "save_checkpoint", "save_plan"]

# name → (module, attribute), imported on first access (PEP 562).
_LAZY = {
    "CanzonaOptimizer": ("canzona.runtime.optimizer", "CanzonaOptimizer"),
    "plan_model": ("canzona._facade", "plan_model"),
    "load_plan": ("canzona.planner.plan.load", "load_plan"),
    "save_plan": ("canzona.planner.plan.schema", "save_plan"),
    "save_checkpoint": ("canzona.runtime.checkpoint.files", "save_checkpoint"),
    "load_checkpoint": ("canzona.runtime.checkpoint.files", "load_checkpoint"),
    "dcp_state": ("canzona.runtime.checkpoint.dcp", "dcp_state"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != "torch" and not (exc.name or "").startswith("torch."):
                raise
            raise ModuleNotFoundError(
                f"canzona.{name} needs PyTorch, which is not installed: "
                "pip install 'canzona[runtime]' (or install your own torch build). "
                "Planning (canzona.planner, the canzona command) needs no torch.",
                name=exc.name) from None
        value = getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'canzona' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
