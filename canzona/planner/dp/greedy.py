"""The paper's α-balanced LPT over buckets (Canzona, arXiv 2602.06079, §DP)."""

from __future__ import annotations

from ..alike import Kept
from ..planning import DPProblem
from .units import Cuts, Units, bucket_units, piece_grain


def _snap(u: Units, target_pos: float, lo: int) -> int:
    """Index of the allowed boundary nearest ``target_pos``, not before index ``lo``."""
    k = int(u.bounds.searchsorted(target_pos))
    cands = [c for c in (k - 1, k) if lo <= c < len(u.bounds)]
    if not cands:
        return max(lo, min(k, len(u.bounds) - 1))
    return min(cands, key=lambda c: (abs(float(u.bounds[c]) - target_pos), c))


def _pos_at_load(u: Units, load: float) -> float:
    """Element position where the bucket's cumulative load reaches ``load`` (interpolated)."""
    p = u.prefix
    k = int(p.searchsorted(load, side="left"))
    if k <= 0:
        return float(u.bounds[0])
    if k >= len(p):
        return float(u.bounds[-1])
    span = p[k] - p[k - 1]
    frac = 0.0 if span <= 0 else (load - p[k - 1]) / span
    return float(u.bounds[k - 1] + frac * (u.bounds[k] - u.bounds[k - 1]))


def _load_at(u: Units, pos: float) -> float:
    """Cumulative load of the bucket up to element ``pos`` (linear inside a unit)."""
    k = int(u.bounds.searchsorted(pos, side="right"))
    if k <= 0:
        return 0.0
    if k >= len(u.bounds):
        return float(u.prefix[-1])
    lo, hi = u.bounds[k - 1], u.bounds[k]
    frac = (pos - lo) / (hi - lo) if hi > lo else 0.0
    return float(u.prefix[k - 1] + frac * (u.prefix[k] - u.prefix[k - 1]))


def greedy(problem: DPProblem, *, alpha: float = 1.0, pieces: int | None = None) -> Cuts:
    """The paper's α-balanced LPT over buckets (largest bucket first).

    Each cut goes to (1-α)·(even cut) + α·(position where the deficit shares are filled), then
    to the nearest allowed position: anywhere inside an AdamW item, else the nearest boundary of
    a matrix-optimizer parameter.

    The last few results are kept by what they read (candidates that differ in what they share
    have the same buckets); each caller gets its own cuts.
    """
    facts = (problem.buckets, problem.layout, problem.sizes)
    key = (problem.dp, problem.total_load(), alpha, pieces)
    got = _KEPT.get(facts, key)
    if got is None:
        got = _KEPT.put(facts, key, _greedy(problem, alpha, pieces))
    return dict(got)  # type: ignore[call-overload]


#: :func:`greedy`'s cuts by the buckets, layout and sizes they read.
_KEPT = Kept(8)


def _greedy(problem: DPProblem, alpha: float, pieces: int | None) -> Cuts:
    dp = problem.dp
    mean = problem.total_load() / dp
    load = [0.0] * dp
    cuts: Cuts = {}
    order = sorted(problem.buckets, key=lambda b: (-b.load, b.buffer, b.bucket))
    for b in order:
        u = bucket_units(b, pieces or 4 * b.ranks, piece_grain(problem))
        divisible = [(it.start, it.end) for it in b.items if not it.atomic]
        R = b.ranks
        ds = [problem.dp_index(b, r) for r in range(R)]
        total = float(u.prefix[-1])
        deficit = [max(0.0, mean - load[d]) for d in ds]
        dsum = sum(deficit)
        share = [total * x / dsum for x in deficit] if dsum > 0 else [total / R] * R
        S = float(u.bounds[-1] - u.bounds[0])
        pos = [int(u.bounds[0])]
        cum_share = 0.0
        for r in range(1, R):
            cum_share += share[r - 1]
            even_pos = float(u.bounds[0]) + S * r / R
            target = (1 - alpha) * even_pos + alpha * _pos_at_load(u, cum_share)
            exact = int(round(target))
            if any(lo < exact < hi for lo, hi in divisible):
                cut = exact  # AdamW items may be cut anywhere, as plain ZeRO-1 does
            else:
                cut = int(u.bounds[_snap(u, target, 0)])
            pos.append(max(cut, pos[-1]))
        pos.append(int(u.bounds[-1]))
        for r in range(R):
            load[ds[r]] += _load_at(u, pos[r + 1]) - _load_at(u, pos[r])
        cuts[(b.buffer, b.bucket)] = tuple(pos)
    return cuts
