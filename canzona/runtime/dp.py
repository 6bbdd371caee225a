"""The DP runtime's public names, kept importable from their first home.

The runtime now lives in rooms (``schedule``, ``checks``, ``buffers``, ``gradients``,
``collectives``, ``accounting``, ``checkpoint``, ``optimizer``); see
:mod:`canzona.runtime.optimizer` for the step.
"""

from __future__ import annotations

from canzona.runtime.accounting import predicted_state_bytes
from canzona.runtime.errors import PlanMismatchError, UnusedParameterWarning
from canzona.runtime.optimizer import CanzonaOptimizer

__all__ = ["CanzonaOptimizer", "PlanMismatchError", "UnusedParameterWarning",
           "predicted_state_bytes"]
