"""Deprecated: the names this module re-exports have their own homes, and it goes in the next
release (``CHANGELOG.md``). Importing it warns.

* ``CanzonaOptimizer``: ``canzona.CanzonaOptimizer`` (:mod:`canzona.runtime.optimizer`)
* ``PlanMismatchError``, ``UnusedParameterWarning``: :mod:`canzona.runtime.errors`
* ``predicted_state_bytes``: :mod:`canzona.runtime.accounting`
"""

from __future__ import annotations

import warnings

from canzona.runtime.accounting import predicted_state_bytes
from canzona.runtime.errors import PlanMismatchError, UnusedParameterWarning
from canzona.runtime.optimizer import CanzonaOptimizer

__all__ = ["CanzonaOptimizer", "PlanMismatchError", "UnusedParameterWarning",
           "predicted_state_bytes"]

warnings.warn(
    "canzona.runtime.dp is deprecated and goes in the next release: import CanzonaOptimizer "
    "from canzona (or canzona.runtime.optimizer), PlanMismatchError and UnusedParameterWarning "
    "from canzona.runtime.errors, predicted_state_bytes from canzona.runtime.accounting.",
    DeprecationWarning, stacklevel=2)
