"""Attention heads as matrices of their own: the tasks of a fused QKV split head by head.

With ``qkv_split="heads"`` the matrix optimizer orthogonalises every query, key and value head of
Megatron's fused ``linear_qkv`` on its own: one ``head_dim × hidden`` task per head (Megatron-
Canzona's per-head split; dion's ``num_heads``). Megatron stores the fused weight grouped per KV
group, ``[q heads of g; k_g; v_g]`` for g = 0 … G − 1, and under tensor parallelism TP rank r holds
the groups [r·G/t, (r+1)·G/t): so each head is contiguous rows of one TP rank's shard, and is
computed there, from the rows it already holds, with nothing gathered.

The tasks come in that storage order (query heads of group g, then its key head, then its value
head), named ``q<h>``, ``k<g>`` and ``v<g>`` by their global head index. Separate q, k and v
projections (Hugging Face names, or a live module's ``*_proj``) split the same way, each into its
heads in row order (``h<i>``), a column-parallel shard holding whole heads. A task's rows are
the next rows of the weight in that order, so the TP rank holding a head follows from the rows
before it (:func:`head_ranks`); the plan records no more than the tasks. The weights that split
are those the inventory gives a head size (``ParamSpec.head_rows``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from .errors import CanzonaError, ModelError
from .inventory import ParamSpec, Part

__all__ = ["HEAD_PART", "head_parts", "head_places", "head_ranks", "is_head"]

#: A head task's part name: ``q``, ``k`` or ``v`` and the head's global index (a fused QKV), or
#: ``h`` and its index (a single projection).
HEAD_PART = re.compile(r"[qkvh]\d+")


def is_head(part: str | None) -> bool:
    """``part`` names one attention head (``q12``, ``k3``, ``v0``, ``h5``)."""
    return part is not None and HEAD_PART.fullmatch(part) is not None


def head_parts(p: ParamSpec) -> tuple[Part, ...]:
    """The heads of ``p`` (``p.head_rows`` rows each) in storage order: Megatron's fused QKV
    (parts ``q``, ``k``, ``v``) grouped per KV group, named ``q<h>``, ``k<g>``, ``v<g>``; a
    single projection's heads in row order, named ``h<i>``.

    Raises:
        ModelError: the head size does not divide a projection's rows, or the KV heads do not
            divide the query heads (one line, naming the head sizes that would).
    """
    hd = p.head_rows
    rows = {x.name: x.rows for x in p.parts} if p.tp_layout == "qkv" else {"h": p.shape[0]}
    for what, n in rows.items():
        if n % hd:
            valid = [d for d in range(1, n + 1) if n % d == 0 and all(m % d == 0
                                                                     for m in rows.values())]
            raise ModelError(f"'{p.name}': a head of {hd} rows does not divide its "
                             f"{'' if what == 'h' else what + ' '}rows ({n}), so "
                             f"qkv_split='heads' cannot cut it per head; head sizes that divide "
                             f"them: {', '.join(map(str, valid[-8:]))} (or qkv_split='fused').")
    if p.tp_layout != "qkv":
        return tuple(Part(f"h{i}", hd) for i in range(p.shape[0] // hd))
    if set(rows) != {"q", "k", "v"} or rows["k"] != rows["v"]:
        raise CanzonaError(f"'{p.name}' has parts {sorted(rows)}; a fused QKV per head needs q, "
                           "k and v, with as many key as value rows.")
    q_heads, kv_heads = rows["q"] // hd, rows["k"] // hd
    if q_heads % kv_heads:
        raise ModelError(f"'{p.name}': {kv_heads} KV heads do not divide {q_heads} query heads; "
                         "grouped-query attention needs it.")
    per_group = q_heads // kv_heads
    out: list[Part] = []
    for g in range(kv_heads):
        out.extend(Part(f"q{g * per_group + j}", hd) for j in range(per_group))
        out += [Part(f"k{g}", hd), Part(f"v{g}", hd)]
    return tuple(out)


def head_ranks(rows: Sequence[int], tp: int) -> list[int]:
    """For a weight's head tasks in storage order (``rows``: each task's rows), the TP rank whose
    shard holds each: rank r holds rows [r·R/t, (r+1)·R/t) of R.

    Raises:
        CanzonaError: a task straddles two shards (the tasks do not cut the weight per head).
    """
    total = sum(rows)
    if total % tp:
        raise CanzonaError(f"{total} rows do not split over tp = {tp}.")
    local = total // tp
    out, at = [], 0
    for n in rows:
        r = at // local
        if (at + n - 1) // local != r:
            raise CanzonaError(f"rows [{at}, {at + n}) straddle the shards of TP ranks {r} and "
                               f"{r + 1} ({local} rows each); the tasks are not whole heads.")
        out.append(r)
        at += n
    return out


def head_places(tasks: Iterable[Any], tp: int) -> dict[int, tuple[int, int]]:
    """Task id → (the TP rank whose shard holds it, its first row in that shard) for every head
    task of ``tasks`` (a plan's, in plan order: each with ``id``, ``param``, ``part``, ``shape``
    and ``optimizer``).

    Raises:
        CanzonaError: a weight's head tasks straddle two shards (one line).
    """
    by_param: dict[str, list[Any]] = {}
    for t in tasks:
        if t.optimizer == "matrix" and is_head(t.part):
            by_param.setdefault(t.param, []).append(t)
    out: dict[int, tuple[int, int]] = {}
    for ts in by_param.values():
        rows = [t.shape[0] for t in ts]
        try:
            ranks = head_ranks(rows, tp)
        except CanzonaError as e:
            raise CanzonaError(f"'{ts[0].param}' is cut per head but {e}") from None
        local, at = sum(rows) // tp, 0
        for t, r in zip(ts, ranks):
            out[t.id] = (r, at - r * local)
            at += t.shape[0]
    return out
