"""Reading a plan file: the one reader, and every check a plan file gets.

:func:`load_plan` (``canzona.load_plan``) and :func:`parse_plan` check, in order:

1. the JSON;
2. the schema version: a newer one asks the user to upgrade canzona, one older than the oldest
   read (:data:`~canzona.planner.plan.convert.OLDEST_VERSION`) to regenerate the plan; an older
   one is converted (:mod:`canzona.planner.plan.convert`: the chain of converters, one per
   version);
3. the pydantic schema (:mod:`canzona.planner.plan.schema`: types, ranges, unknown fields, the
   version each feature needs);
4. the structure (:func:`~canzona.planner.plan.structure.check_structure`: the fields against each
   other, without cost formulas);
5. the arithmetic (:func:`~canzona.planner.plan.checks.check_plan`: what the planner computes
   from the plan's own contents — task costs, owners and loads from the cuts, totals, the TP
   section and the shared tasks).

Every failure is one :class:`~canzona.planner.errors.PlanFileError` line naming the file, the
field and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import PlanFileError
from .checks import check_plan
from .fsdp2_plan import check_fsdp2_plan
from .convert import OLDEST_VERSION, unreadable, upgrade
from . import compact
from .schema import (COMPACT_VERSION, FSDP2_VERSION, PIPELINE_VERSION, SCHEMA_VERSION,
                     FSDP2Plan, PipelinePlan, Plan, gc_paused)

__all__ = ["as_pipeline", "load_plan", "parse_plan"]

#: The fix named for a plan newer than this canzona reads.
UPGRADE = ("upgrade canzona (python -m pip install -U canzona) or re-plan with this one's "
           "'canzona plan'")


def load_plan(path: str | Path) -> Plan | PipelinePlan | FSDP2Plan:
    """Read a plan file and check everything: JSON, version, schema, structure and the planner's
    formulas (:func:`parse_plan`). This is ``canzona.load_plan``. A pipeline's file (pp > 1)
    gives a :class:`~canzona.planner.plan.schema.PipelinePlan`, a plan per stage, each checked;
    an FSDP2 plan (``storage: fsdp2``) a :class:`~canzona.planner.plan.schema.FSDP2Plan`,
    checked by :func:`~canzona.planner.plan.fsdp2_plan.check_fsdp2_plan`.

    Raises:
        PlanFileError: unreadable, not JSON, a schema version this canzona does not read, fields
            that do not validate, or a plan that contradicts itself or the planner's formulas;
            one line naming the file, the field and the fix.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PlanFileError(f"cannot read plan '{path}': {reason}.") from None
    return parse_plan(text, str(path))


def parse_plan(text: str, source: str = "<plan>") -> Plan | PipelinePlan | FSDP2Plan:
    """Plan JSON text → a checked :class:`~canzona.planner.plan.schema.Plan` (every check of the
    module docstring), or for a pipeline's file a
    :class:`~canzona.planner.plan.schema.PipelinePlan` whose every stage is checked so;
    ``source`` names the text in errors.

    Raises:
        PlanFileError: one line naming ``source``, the problem (and versions) and the fix.
    """
    with gc_paused():  # no cycles are made here; the collector would walk the whole plan
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"{source}: not a plan file: invalid JSON at line {exc.lineno} "
                                f"({exc.msg}).") from None
        except RecursionError:
            raise PlanFileError(f"{source}: not a plan file: JSON nested too deeply (a plan is "
                                f"a few levels deep).") from None
        if isinstance(data, dict) and "stages" in data:
            return _pipeline(data, source)
        if isinstance(data, dict) and "storage" in data:
            return _fsdp2(data, source)
        return _plan(data, source)


def _plan(data: object, source: str) -> Plan:
    """One plan's data, read (:func:`_read`), validated and checked."""
    data, found = _read(data, source)
    plan = _validate(data, found, source)
    check_plan(plan, source)
    return plan


def _pipeline(data: dict, source: str) -> PipelinePlan:
    """A pipeline's file: its version, then each stage's plan (as a plan file's, every check),
    then the stages against each other."""
    found = _version(data, source, PIPELINE_VERSION, "a pipeline's plan file")
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
        raise unreadable(source, found, "malformed plan: field 'stages' must be a non-empty "
                                        "list of the stages' plans")
    plans = [_plan(stage, f"{source} (stage {s})") for s, stage in enumerate(stages)]
    try:
        return PipelinePlan(schema_version=found, pp=data.get("pp"), stages=tuple(plans))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        raise unreadable(source, found, f"malformed pipeline plan: field '{loc}': {err['msg']}"
                         ) from None


def _version(data: dict, source: str, version: int, what: str) -> int:
    """The schema version of a file of a kind only ``version`` writes (``what``), checked."""
    found = data.get("schema_version")
    if not isinstance(found, int) or isinstance(found, bool):
        raise unreadable(source, repr(found), "schema_version must be an integer")
    if found > SCHEMA_VERSION:
        raise unreadable(source, found, "a plan newer than this canzona reads", UPGRADE)
    if found != version:
        raise unreadable(source, found, f"{what} is schema version {version}")
    return found


def _fsdp2(data: dict, source: str) -> FSDP2Plan:
    """An FSDP2 plan's file (``storage: fsdp2``): its version, the schema, then its checks
    (:func:`~canzona.planner.plan.fsdp2_plan.check_fsdp2_plan`)."""
    found = _version(data, source, FSDP2_VERSION, "an FSDP2 plan file")
    plan = _validate(data, found, source, FSDP2Plan)
    check_fsdp2_plan(plan, source)
    return plan


def as_pipeline(plan: Plan | PipelinePlan) -> tuple[Plan, ...]:
    """The stages' plans of ``plan``: a pipeline's, or a whole model's plan as the one stage."""
    return plan.stages if isinstance(plan, PipelinePlan) else (plan,)


def _read(data: object, source: str) -> tuple[dict, int]:
    """A plan file's JSON data, brought to the current schema version, and the file's
    version."""
    if not isinstance(data, dict) or "schema_version" not in data:
        raise PlanFileError(f"{source}: not a canzona plan (no schema_version field).")
    found = data["schema_version"]
    if not isinstance(found, int) or isinstance(found, bool):
        raise unreadable(source, repr(found), "schema_version must be an integer")
    if found > SCHEMA_VERSION:
        raise unreadable(source, found, "a plan newer than this canzona reads", UPGRADE)
    if found < OLDEST_VERSION:
        what = "no plan schema version" if found < 1 else "a plan older than this canzona reads"
        raise unreadable(source, found, what)
    if found >= COMPACT_VERSION and "task_kinds" in data:  # written compact
        try:
            data = compact.decode(data)
        except ValueError as exc:
            raise unreadable(source, found, f"malformed compact plan: {exc}") from None
    return upgrade(data, source), found


def _validate(data: dict, found: int, source: str, kind: type = Plan) -> Any:
    """The schema's validation of ``data`` as a ``kind`` (of a file of schema version
    ``found``): its first problem, in one line."""
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        raise unreadable(source, found, f"malformed plan: field '{loc}': {err['msg']}{more}"
                         ) from None
