"""The offline planner: torch-free (pydantic, OR-Tools, networkx).

Data flow: model source → :class:`ModelSpec` (inventory) → :class:`PhysicalLayout` (Megatron's TP
shards and ZeRO-1 buckets) → tasks and costs → DP cut points (``dp``) → TP micro-groups (``tp``) →
plan (``canzona.planner.plan``). One call does it all: ``canzona.planner.pipeline.plan``.
"""

from .cost import CostModel, Task, TaskCost, build_tasks, task_cost
from .errors import (CanzonaError, CanzonaWarning, ModelError, OptionError, OversizedTaskWarning,
                     PlanFileError, SizeError)
from .hardware import load_hardware
from .inventory import ModelSpec, ParamSpec, build_inventory
from .layout import ParallelSizes, PhysicalLayout, build_layout, local_shape, validate_sizes
from .models import PRESETS, ModelConfig, get_preset, load_hf_config, resolve_model
from .options import DPOptions, TPOptions
from .settings import OptimizerSettings

__all__ = [
    "PRESETS",
    "CanzonaError",
    "CanzonaWarning",
    "CostModel",
    "DPOptions",
    "ModelConfig",
    "ModelError",
    "ModelSpec",
    "OptionError",
    "OptimizerSettings",
    "OversizedTaskWarning",
    "ParallelSizes",
    "ParamSpec",
    "PhysicalLayout",
    "PlanFileError",
    "SizeError",
    "TPOptions",
    "Task",
    "TaskCost",
    "build_inventory",
    "build_layout",
    "build_tasks",
    "get_preset",
    "load_hardware",
    "load_hf_config",
    "local_shape",
    "resolve_model",
    "task_cost",
    "validate_sizes",
]
