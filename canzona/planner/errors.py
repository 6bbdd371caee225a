"""Errors the planner raises for bad input.

Every error carries one readable line that names the field, the value and the fix; the CLI prints
that line (no traceback) and exits with status 1.
"""

from __future__ import annotations


class CanzonaError(ValueError):
    """Base class of canzona's input errors (a ``ValueError``, one line of text)."""


class ModelError(CanzonaError):
    """Unknown preset, unreadable or unsupported model config."""


class SizeError(CanzonaError):
    """Parallel sizes (dp, tp, ep, ...) that the model or Megatron's layout rules do not allow."""


class PlanFileError(CanzonaError):
    """A plan file that is unreadable, malformed, of another schema version, or for another run."""


class CanzonaWarning(UserWarning):
    """Something a user should know about a plan that is still valid (the CLI prints it as a note)."""


class OversizedTaskWarning(CanzonaWarning):
    """Matrices larger than C_max when gathered: each gets a micro-group of its own."""
