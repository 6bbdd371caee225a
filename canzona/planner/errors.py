"""Errors the planner raises for bad input.

Every error carries one readable line that names the field, the value and the fix; the CLI prints
that line (no traceback) and exits with status 1.

An error about an option names it as the library spells it (``DPOptions.alpha``); the message
keeps that name as a field, so a front end can show its own spelling instead
(``exc.render({"DPOptions.alpha": "--alpha"})``, which the CLI does for its flags).
"""

from __future__ import annotations

from collections.abc import Mapping


class CanzonaError(ValueError):
    """Base class of canzona's input errors (a ``ValueError``, one line of text).

    Args:
        message: the line; every name in ``fields`` appears in it as ``{name}``.
        fields: the option names the message is about (``"DPOptions.alpha"``).
    """

    def __init__(self, message: str = "", *, fields: tuple[str, ...] = ()) -> None:
        self.template = message
        self.fields = tuple(fields)
        super().__init__(self.render())

    def render(self, names: Mapping[str, str] | None = None) -> str:
        """The message with every field spelled as ``names`` says (default: the field itself)."""
        out = self.template
        for f in self.fields:
            out = out.replace("{" + f + "}", (names or {}).get(f, f))
        return out


class OptionError(CanzonaError):
    """An option object (``DPOptions``, ``TPOptions``, sizes) with a value out of range."""


class ModelError(CanzonaError):
    """Unknown preset, unreadable or unsupported model config."""


class SizeError(CanzonaError):
    """Parallel sizes (dp, tp, ep, ...) that the model or Megatron's layout rules do not allow."""


class PlanFileError(CanzonaError):
    """A plan file that is unreadable, malformed, of another schema version, or for another run."""


class CanzonaWarning(UserWarning):
    """Something a user should know about a plan that is still valid (the CLI prints it as a
    note)."""


class OversizedTaskWarning(CanzonaWarning):
    """Matrices larger than C_max when gathered: each gets a micro-group of its own."""
