"""The compact plan file (schema version 8): what repeats is stored once.

A plan of a large MoE holds tens of thousands of tasks, bucket slots and TP entries, each a JSON
object repeating its field names, and every parameter's name twice (its tasks, its slot). Plans
of more than :data:`COMPACT_TASKS` tasks are written compact, which is the same plan in fewer
bytes (qwen3-235b-a22b at dp 64, tp 4, ep 8: 20 MB indented, about 4 MB compact):

* ``params``: every parameter's name once, in task order; a task's ``param`` and a slot's
  ``name`` are positions in it;
* ``task_kinds``: every distinct (shape, optimizer, cost, flops, state bytes, TP bytes) once;
  a task's ``kind`` is a position in it, and its ``id`` is its position in ``tasks``;
* every list of two or more objects with the same fields is a table, ``{"@table": fields,
  "@rows": [values, …]}``, the fields written once;
* no indentation.

:func:`encode` turns a plan's JSON data into that form and :func:`decode` back, exactly (the
writer is :meth:`~canzona.planner.plan.schema.Plan.to_json`, the reader
:func:`~canzona.planner.plan.load.parse_plan`). The planner writes the lowest version that
holds a plan, so smaller plans keep the indented text of their version.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

#: Plans with more tasks than this are written compact (schema version 8).
COMPACT_TASKS = 4096

#: A task's fields that its kind holds (``task_kinds``), in order.
KIND_FIELDS = ("shape", "optimizer", "cost", "flops", "state_bytes", "tp_comm_bytes")

TABLE, ROWS = "@table", "@rows"


def encode(data: dict) -> dict:
    """A plan's JSON data (``Plan.model_dump(mode="json")``) in the compact form."""
    params: dict[str, int] = {}
    kinds: dict[tuple, int] = {}
    tasks = []
    take = itemgetter(*KIND_FIELDS)
    for k, t in enumerate(data["tasks"]):
        if t["id"] != k:
            raise ValueError(f"task {k} has id {t['id']}: a compact plan numbers tasks by "
                             "position")
        kind = tuple([tuple(v) if type(v) is list else v for v in take(t)])
        row = {f: v for f, v in t.items() if f not in _NOT_IN_ROW}
        row["param"] = params.setdefault(t["param"], len(params))
        row["kind"] = kinds.setdefault(kind, len(kinds))
        tasks.append(row)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tasks":
            out["params"] = list(params)
            out["task_kinds"] = [dict(zip(KIND_FIELDS, (list(v) if isinstance(v, tuple) else v
                                                        for v in kind))) for kind in kinds]
            out["tasks"] = tasks
        elif key == "buffers":
            out["buffers"] = [{**buf, "buckets": [
                {**b, "slots": [{**s, "name": params.setdefault(s["name"], len(params))}
                                for s in b["slots"]]} for b in buf["buckets"]]}
                for buf in value]
        else:
            out[key] = value
    out["params"] = list(params)  # slots may name a parameter no task updates
    return _tables(out)


def decode(data: dict) -> dict:
    """The compact form back to a plan's JSON data, as :func:`encode` took it.

    Raises:
        ValueError: the compact data is malformed (named by its field).
    """
    data = _rows(data)
    try:
        params, kinds = data.pop("params"), data.pop("task_kinds")
    except KeyError as exc:
        raise ValueError(f"field '{exc.args[0]}' is missing (a version-8 plan lists its "
                         "parameters and task kinds)") from None
    if not isinstance(params, list) or not isinstance(kinds, list):
        raise ValueError("fields 'params' and 'task_kinds' must be lists")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tasks":
            out["tasks"] = [_task(k, t, params, kinds) for k, t in enumerate(_list(value, key))]
        elif key == "buffers":
            out["buffers"] = [{**buf, "buckets": [
                {**b, "slots": [{**s, "name": _at(params, s.get("name"), "params")}
                                for s in _list(b.get("slots"), "slots")]}
                for b in _list(buf.get("buckets"), "buckets")]} for buf in _list(value, key)]
        else:
            out[key] = value
    return out


def _task(k: int, t: Any, params: list, kinds: list) -> dict:
    if not isinstance(t, dict):
        raise ValueError(f"tasks.{k} must be an object")
    row = dict(t)
    kind = _at(kinds, row.pop("kind", None), "task_kinds")
    if not isinstance(kind, dict):
        raise ValueError(f"task_kinds entry of task {k} must be an object")
    return {"id": k, "param": _at(params, row.pop("param", None), "params"), "part": None,
            **row, **kind}


def _at(table: list, index: Any, name: str) -> Any:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(table):
        raise ValueError(f"{index!r} is not a position in '{name}' ({len(table)} entries)")
    return table[index]


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"field '{name}' must be a list")
    return value


def _tables(x: Any) -> Any:
    """Every list of two or more objects with the same fields, as a table (children first;
    scalars, most of a plan, are not walked into)."""
    if isinstance(x, dict):
        if _NESTED_TYPES.isdisjoint(map(type, x.values())):
            return x  # scalars only: as it is
        return {k: v if type(v) not in _NESTED else _tables(v) for k, v in x.items()}
    if isinstance(x, list):
        x = [v if type(v) not in _NESTED or (
                type(v) is dict and _NESTED_TYPES.isdisjoint(map(type, v.values())))
             else _tables(v) for v in x]  # (an object of scalars as it is, without a call)
        if len(x) >= 2 and type(x[0]) is dict:
            fields = list(x[0])
            if all(type(v) is dict and list(v) == fields for v in x):
                return {TABLE: fields, ROWS: [list(v.values()) for v in x]}
        return x
    return x


def _rows(x: Any) -> Any:
    """:func:`_tables` undone (scalars, most of a plan, are not walked into)."""
    if isinstance(x, dict):
        if TABLE in x:
            fields, rows = x[TABLE], x.get(ROWS)
            if not isinstance(fields, list) or not isinstance(rows, list) or any(
                    not isinstance(r, list) or len(r) != len(fields) for r in rows):
                raise ValueError(f"a table ({', '.join(map(str, fields))}) whose rows do not "
                                 "match its fields")
            return [{f: v if type(v) not in _NESTED else _rows(v) for f, v in zip(fields, r)}
                    for r in rows]
        return {k: v if type(v) not in _NESTED else _rows(v) for k, v in x.items()}
    if isinstance(x, list):
        return [v if type(v) not in _NESTED else _rows(v) for v in x]
    return x


_NESTED = (dict, list)
_NESTED_TYPES = frozenset(_NESTED)
#: A task's fields its row does not hold (its position and its kind's).
_NOT_IN_ROW = frozenset(("id", *KIND_FIELDS))
