"""The one-line errors of plan files (every failure to read or check a plan is one
:class:`~canzona.planner.errors.PlanFileError` line naming the file, the field and the fix), and
the comparison and task names they report."""

from __future__ import annotations

import math

from ..errors import PlanFileError

#: The fix named by every consistency error: plans are written by the planner, never by hand.
REGENERATE = "regenerate it with 'canzona plan'"


def one_line(text: str) -> str:
    """``text`` with its line breaks escaped (a message quotes names from the file)."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def version_error(source: str, found: object, problem: str, fix: str = REGENERATE,
                  *, oldest: int, newest: int) -> PlanFileError:
    """The one-line error for a plan this canzona cannot read as it is: the file's schema version
    (``found``), the versions read (``oldest`` to ``newest``) and the fix."""
    return PlanFileError(one_line(f"{source}: {problem} (file schema version {found}; this "
                                  f"canzona reads version {oldest} to version {newest}); {fix}."))


def inconsistency(source: str, field: str, problem: str, fix: str = REGENERATE) -> PlanFileError:
    """The one-line error for a plan that parses but contradicts itself."""
    return PlanFileError(one_line(f"{source}: inconsistent plan: field '{field}': {problem}; "
                                  f"{fix}."))


def label(t) -> str:  # noqa: ANN001  (a TaskPlan)
    """A task as messages name it: its parameter, with ``#part`` for a split matrix's part."""
    return t.param if t.part is None else f"{t.param}#{t.part}"


def matches(a: float, b: float) -> bool:
    """A recorded number equals the one recomputed: integers exactly; floats (recomputed as the
    planner does, read back from JSON) to the last bits."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
