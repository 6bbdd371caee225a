"""What the runtime raises and warns: one readable line each, in canzona's error families."""

from __future__ import annotations

from canzona.planner.errors import CanzonaError, CanzonaWarning

__all__ = ["CheckpointError", "CollectiveTimeoutError", "NonFiniteSkipWarning", "PlanMismatchError",
           "UnevenBackwardError", "UnusedParameterWarning", "WeightsDifferError"]


class PlanMismatchError(CanzonaError):
    """The plan does not fit the model, the process group, the other ranks or the settings
    (a ``ValueError``, as every :class:`~canzona.planner.errors.CanzonaError`)."""


class UnusedParameterWarning(CanzonaWarning):
    """A parameter received no gradient, so its bucket (and every later one) reduce-scattered
    only at ``step()`` instead of overlapping backward. Emitted once per optimizer."""


class NonFiniteSkipWarning(CanzonaWarning):
    """Under ``nonfinite="skip"``: parameters whose averaged gradient held NaN or Inf were left
    alone this step, on every rank alike (named in the message)."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not finish within ``CanzonaOptimizer(collective_timeout=...)``: a peer
    rank died, hangs, or stopped calling ``step()``. The message names the collective and its
    bucket or micro-group. The process group is not usable afterwards."""


class CheckpointError(CanzonaError):
    """A checkpoint cannot be saved or loaded as asked: missing or incomplete, of another model
    or kernel, or state that cannot follow the change of plan (the message says which and the
    fix). Raised on every rank before anything is loaded."""


class UnevenBackwardError(RuntimeError):
    """Some DP ranks produced gradients for a step and others none (a rank skipped
    ``loss.backward()``): averaging would halve every gradient without a word. Raised on every
    rank, naming the ranks without gradients, before anything is updated; the step's gradients
    are dropped."""


class WeightsDifferError(PlanMismatchError):
    """The DP ranks hold different weights at construction (seeded differently): they would
    train on until the first all-gather overwrote them. Raised on every rank, naming the first
    parameter that differs; ``CanzonaOptimizer(sync_init=True)`` broadcasts DP rank 0's
    weights instead."""
