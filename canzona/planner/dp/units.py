"""A bucket as units (matrices whole, AdamW items in pieces) and cut points from matrix owners.

The lowest layer of the DP solvers: every solver (greedy, polish, CP-SAT, reorder) reads buckets
through :func:`bucket_units` and turns matrix owners back into cut points with
:func:`owners_to_cuts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..alike import Kept
from ..planning import BucketProblem, Cuts, DPProblem


@dataclass(frozen=True, slots=True)
class Units:
    """A bucket cut into units: atomic items whole, divisible items in pieces.

    ``bounds[k]`` is the element offset of the k-th allowed cut position (``bounds[0]`` = bucket
    start, ``bounds[-1]`` = bucket end) and ``prefix[k]`` the load before it.
    """

    bounds: np.ndarray  # int64, len m+1
    prefix: np.ndarray  # float64, len m+1 (load)
    piece_load: float   # largest load of a divisible piece (0 if none)
    state: np.ndarray | None = None  # float64, len m+1: optimizer-state bytes before each cut


def bucket_units(b: BucketProblem, pieces: int, grain: float,
                 state_grain: float | None = None) -> Units:
    """``pieces``: most pieces per divisible item; ``grain``: target load of one piece (items
    lighter than that, such as norms under the FLOPs cost, stay one unit); ``state_grain``:
    target optimizer-state bytes of one piece, so that state-heavy, nearly free items (an
    AdamW embedding) are cut finely too (None: by load only).

    Kept by bucket and arguments (the stages cut the same buckets again); the arrays are
    read-only."""
    key = (pieces, grain, state_grain)
    got = _KEPT.get((b,), key)
    if got is None:
        got = _KEPT.put((b,), key, _bucket_units(b, pieces, grain, state_grain))
    return got  # type: ignore[return-value]


#: :func:`bucket_units` by bucket and arguments (a model's buckets a few times over).
_KEPT = Kept(1 << 14)


def _bucket_units(b: BucketProblem, pieces: int, grain: float,
                  state_grain: float | None) -> Units:
    bounds = [b.start]
    loads: list[float] = []
    states: list[float] = []
    max_piece = 0.0
    items = b.items
    for k, it in enumerate(items):
        end = items[k + 1].start if k + 1 < len(items) else b.end
        if it.atomic or it.end - it.start <= 1:
            bounds.append(end)
            loads.append(float(it.load))
            states.append(float(it.state_bytes))
            continue
        n = it.end - it.start
        k = max(1, min(pieces, math.ceil(it.load / grain) if grain > 0 else pieces))
        if state_grain:
            k = max(k, min(pieces, math.ceil(it.state_bytes / state_grain)))
        step = max(1, -(-n // k))
        pos = it.start
        while pos < it.end:
            nxt = min(it.end, pos + step)
            load = it.load * (nxt - pos) / n
            max_piece = max(max_piece, load)
            states.append(it.state_bytes * (nxt - pos) / n)
            pos = nxt
            bounds.append(end if pos >= it.end else pos)
            loads.append(load)
    prefix = np.concatenate([[0.0], np.cumsum(loads)]) if loads else np.zeros(1)
    state = np.concatenate([[0.0], np.cumsum(states)]) if states else np.zeros(1)
    at = np.asarray(bounds, dtype=np.int64)
    for x in (at, prefix, state):
        x.flags.writeable = False
    return Units(at, prefix, max_piece, state)


def piece_grain(problem: DPProblem) -> float:
    """Target load of a divisible piece: 1/64 of the mean rank load."""
    return problem.total_load() / problem.dp / 64


def cuts_from_indices(u: Units, idx: list[int]) -> tuple[int, ...]:
    return tuple(int(u.bounds[i]) for i in idx)



def spread_cuts(b: BucketProblem, owners: list[int]) -> tuple[int, ...]:
    """Cut points of bucket ``b`` given the ranks of its matrices (in bucket order).

    Between two consecutive matrices owned by ranks a ≤ c (or the bucket's ends), the AdamW
    elements there are shared evenly by ranks a … c, as ZeRO-1 would share them, so huge AdamW
    tensors (embeddings, output layer) and their optimizer state spread over every rank that
    can take a piece.
    """
    atomic = [it for it in b.items if it.atomic]
    cuts = [b.start] + [0] * (b.ranks - 1) + [b.end]
    prev_end, prev_owner = b.start, 0
    for k in range(len(atomic) + 1):
        lo = prev_end
        hi = atomic[k].start if k < len(atomic) else b.end
        nxt = owners[k] if k < len(atomic) else b.ranks - 1
        # ranks prev_owner … nxt share [lo, hi); cut r (start of rank r) for r in prev_owner+1 … nxt
        share = nxt - prev_owner + 1
        for r in range(prev_owner + 1, nxt + 1):
            cuts[r] = lo + (hi - lo) * (r - prev_owner) // share
        if k < len(atomic):
            prev_end, prev_owner = atomic[k].end, nxt
    return tuple(cuts)


def owners_to_cuts(problem: DPProblem, owners: dict[tuple[int, int], list[int]]) -> Cuts:
    """Cut points from the owners (ranks) of every bucket's matrices (see :func:`spread_cuts`)."""
    return {(b.buffer, b.bucket): spread_cuts(b, owners[(b.buffer, b.bucket)])
            for b in problem.buckets}
