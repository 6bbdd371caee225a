"""Which optimizer class executes which kind of plan.

``CanzonaOptimizer(model, plan, ...)`` is the one entry for every plan: its ``__new__`` looks
the plan's type up here and builds the registered subclass instead (its ``__init__`` then runs
with the same arguments), so ``isinstance(opt, CanzonaOptimizer)`` holds for all of them. A
plan type without an entry (``Plan``, ``PipelinePlan``: ZeRO-1 buckets) is executed by
``CanzonaOptimizer`` itself.

Entries name the class by module and attribute and are imported on first use: the subclass
module imports ``runtime.optimizer``, which reads this registry.

=================  =================================================================
plan type          optimizer class
=================  =================================================================
``FSDP2Plan``      ``canzona.runtime.fsdp2.FSDP2Optimizer`` (``fully_shard``'s rows)
=================  =================================================================
"""

from __future__ import annotations

import importlib

from canzona.planner.plan import FSDP2Plan

__all__ = ["executor_for", "register"]

#: plan type → (module, class name) of the ``CanzonaOptimizer`` subclass that executes it.
_EXECUTORS: dict[type, tuple[str, str]] = {}


def register(plan_type: type, module: str, name: str) -> None:
    """Plans of ``plan_type`` are executed by ``module.name``, a subclass of
    ``CanzonaOptimizer`` (imported when such a plan first comes). Once per plan type."""
    if plan_type in _EXECUTORS:
        raise ValueError(f"plans of type {plan_type.__name__} already have an executor "
                         f"({'.'.join(_EXECUTORS[plan_type])})")
    _EXECUTORS[plan_type] = (module, name)


def executor_for(plan: object) -> type | None:
    """The class registered for ``type(plan)`` (the nearest registered base class), or None
    (``CanzonaOptimizer`` itself executes it)."""
    for kind in type(plan).__mro__:
        entry = _EXECUTORS.get(kind)
        if entry is not None:
            return getattr(importlib.import_module(entry[0]), entry[1])
    return None


register(FSDP2Plan, "canzona.runtime.fsdp2", "FSDP2Optimizer")
