"""Improving cuts: the exact per-bucket DP (block coordinate descent), whole-matrix moves and
swaps across buckets, and the AdamW re-spreading between matrices."""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from .. import alike
from ..alike import Kept
from ..errors import OptionError
from ..objective import MAX_LOAD, Objective
from ..planning import BucketProblem, DPProblem, evaluate, owner_of
from .units import (Cuts, Units, bucket_units, cuts_from_indices, owners_to_cuts, piece_grain,
                    spread_cuts)


#: Smooth objectives of the coordinate descent, ever closer to the maximum.
_POWERS = {"ssq": 2, "p8": 8}


def _bucket_dp(u: Units, base: np.ndarray, cap: float | None, phase: str,
               slice_cost: np.ndarray | None = None,
               limit: tuple[np.ndarray, np.ndarray, float] | None = None,
               start: list[int] | None = None, ukey: tuple | None = None) -> list[int]:
    """:func:`_solve_bucket`, kept by its inputs: twin buckets (an MoE's expert layers, repeated
    blocks) meet the same loads again and again (three calls in four, on qwen3-235b-a22b), and
    the cut is a function of the inputs alone (the units' positions only through their
    differences). ``ukey``: :func:`_units_key` of ``u`` and ``slice_cost``, when the caller
    keeps it."""
    if not alike.SHARED:
        return _solve_bucket(u, base, cap, phase, slice_cost, limit, start)
    key = (ukey or _units_key(u, slice_cost), np.asarray(base, dtype=float).tobytes(), cap, phase,
           None if limit is None else (limit[0].tobytes(), np.asarray(limit[1]).tobytes(),
                                       limit[2]),
           None if start is None else tuple(start))
    got = _SOLVED.get(key)
    if got is None:
        if len(_SOLVED) > 20_000:
            _SOLVED.clear()
        got = _SOLVED[key] = tuple(_solve_bucket(u, base, cap, phase, slice_cost, limit, start))
    else:
        alike.reused("bucket dp")
    return list(got)


def _units_key(u: Units, slice_cost: np.ndarray | None) -> tuple:
    """What :func:`_bucket_dp`'s cut reads of the units and the per-slice terms, as a key."""
    return (u.prefix.tobytes(), (u.bounds - u.bounds[0]).tobytes(),
            None if slice_cost is None else slice_cost.tobytes())


#: :func:`_bucket_dp`'s inputs → the cut it found.
_SOLVED: dict[tuple, tuple[int, ...]] = {}


def _solve_bucket(u: Units, base: np.ndarray, cap: float | None, phase: str,
                  slice_cost: np.ndarray | None = None,
                  limit: tuple[np.ndarray, np.ndarray, float] | None = None,
                  start: list[int] | None = None) -> list[int]:
    """Optimal cut indices for one bucket given the other buckets' loads ``base`` per rank.

    Rank r receives units [c_r, c_{r+1}); minimise Σ (base_r + x_r)^p + Σ h(s_r) or
    max (base_r + x_r) (+ Σ h(s_r)). ``cap`` bounds each slice's elements (communication
    limit); ``slice_cost[j, i]`` is the objective's per-slice term h for units j..i-1 (g of
    :class:`~canzona.planner.objective.Objective`, scaled like the loads), None when zero.

    ``start``: cut indices of a feasible cut, if known (the bucket's current one). Its value
    bounds the optimum, so no slice whose own term exceeds it can be on the optimal path: the
    DP then runs over a band of the slices short enough (:func:`_band`), which returns the
    same cut as the full table, since every state on the optimal path keeps its value and its
    first minimiser. Where the table is too large for either (:data:`WINDOW_WORK`, or from
    :data:`WINDOW_RANKS` ranks a band wider than the window), each cut stays within
    :data:`WINDOW` units of ``start`` (:func:`_bucket_dp_window`), which is not worse than it.
    """
    R = len(base)
    m = len(u.bounds) - 1
    if m <= 3 and slice_cost is None:
        return _bucket_dp_small(u, base, cap, phase)
    P = u.prefix
    # (a small table is quicker whole than its band is found)
    width = _band(u, base, cap, phase, slice_cost, limit, start) \
        if R * (m + 1) ** 2 > SMALL_TABLE else None
    windowed = start is not None and width is not None and (
        R * (m + 1) ** 2 > WINDOW_WORK
        or (R >= WINDOW_RANKS and (m + 1) * min(width, m + 1) > (2 * WINDOW + 1) ** 2))
    if windowed:
        return _bucket_dp_window(u, base, cap, phase, slice_cost, limit, start, WINDOW)
    if width is not None and 4 * width < m:
        return _bucket_dp_band(u, base, cap, phase, slice_cost, limit, width)
    # Laid out [i, j] (j: where rank r's units start, i: where they end), so that the minimum
    # over j runs along contiguous rows; buffers reused across ranks.
    blk = P[:, None] - P[None, :]  # blk[i, j] = load of units j..i-1
    valid = np.tril(np.ones((m + 1, m + 1), dtype=bool))
    if cap is not None:
        span = u.bounds[:, None] - u.bounds[None, :]
        valid &= span <= cap
    inf = np.inf
    # what every rank adds: the per-slice term where a slice is allowed, +inf where it is not
    extra = np.where(valid, 0.0 if slice_cost is None else slice_cost.T, inf)
    choice = np.zeros((R, m + 1), dtype=np.int64)
    g = np.full(m + 1, inf)
    g[0] = 0.0
    if limit is not None:
        lblk = limit[0][:, None] - limit[0][None, :]
    tot = np.empty((m + 1, m + 1))
    cols = np.arange(m + 1)
    power = _POWERS.get(phase)
    for r in range(R):
        np.add(blk, base[r], out=tot)  # rank r's load for every slice
        if limit is not None:
            tot = np.where(limit[1][r] + lblk <= limit[2], tot, inf)
        if power is None:
            np.maximum(g[None, :], tot, out=tot)
        else:
            np.power(tot, power, out=tot)
            np.add(g[None, :], tot, out=tot)
        np.add(tot, extra, out=tot)
        choice[r] = tot.argmin(axis=1)  # first (smallest j) on ties: deterministic
        g = tot[cols, choice[r]]
    return _trace(choice, g, m)


#: Up to this many table entries (ranks × (units + 1)²), a bucket's DP runs on the whole table.
SMALL_TABLE = 20_000
#: Past this many table entries (ranks × (units + 1)²: dp ≈ 1,000 with a unit per rank), a
#: bucket is re-cut with every cut within :data:`WINDOW` units of where it is.
WINDOW_WORK = 50_000_000
WINDOW = 32
#: From this many ranks (dp ≥ 512) a bucket is re-cut in the window wherever its band or table
#: per rank is larger than the window's.
WINDOW_RANKS = 512


def _bucket_dp_window(u: Units, base: np.ndarray, cap: float | None, phase: str,
                      slice_cost: np.ndarray | None,
                      limit: tuple[np.ndarray, np.ndarray, float] | None,
                      start: list[int], w: int) -> list[int]:
    """:func:`_bucket_dp` with each cut kept within ``w`` units of its place in the feasible
    cut ``start``: the best such cut (the first minimiser, as the full table's), never worse
    than ``start`` on the DP's objective. The full table is cubic in the DP size when a bucket
    has about a unit per rank, and the band of :func:`_band` spans most of it where the units
    are light AdamW pieces; this one is linear in the ranks (each entry computed as the
    table's). The polish calls it again while the objective falls, so a cut can travel further
    than ``w`` over its rounds."""
    R = len(base)
    m = len(u.bounds) - 1
    P, B = u.prefix, u.bounds
    inf = np.inf
    power = _POWERS.get(phase)
    J = np.zeros(1, dtype=np.int64)  # the states after the ranks so far: where they end
    g = np.zeros(1)
    ends, picks = [], []
    for r in range(R):
        I = np.array([m]) if r == R - 1 else np.arange(max(0, start[r + 1] - w),
                                                       min(m, start[r + 1] + w) + 1)
        tot = (P[I][:, None] - P[J][None, :]) + base[r]
        valid = J[None, :] <= I[:, None]
        if cap is not None:
            valid &= (B[I][:, None] - B[J][None, :]) <= cap
        if limit is not None:
            tot = np.where(limit[1][r] + (limit[0][I][:, None] - limit[0][J][None, :])
                           <= limit[2], tot, inf)
        if power is None:
            tot = np.maximum(g[None, :], tot)
        else:
            tot = g[None, :] + np.power(tot, power)
        tot = tot + np.where(valid, 0.0 if slice_cost is None
                             else slice_cost[J[None, :], I[:, None]], inf)
        k = tot.argmin(axis=1)
        g = tot[np.arange(len(I)), k]
        ends.append(I)
        picks.append(J[k])
        J = I
    if not np.isfinite(g[0]):
        raise OptionError("{DPOptions.comm_limit} is too tight: some bucket cannot be cut into "
                          "slices that small at parameter boundaries; raise it.",
                          fields=("DPOptions.comm_limit",))
    idx = [m]
    for r in range(R - 1, -1, -1):
        pos = int(np.searchsorted(ends[r], idx[-1]))
        idx.append(int(picks[r][pos]))
    return idx[::-1]


def _trace(choice: np.ndarray, g: np.ndarray, m: int) -> list[int]:
    """The cut indices the DP chose, traced back from the bucket's end."""
    if not np.isfinite(g[m]):
        raise OptionError("{DPOptions.comm_limit} is too tight: some bucket cannot be cut into "
                          "slices that small at parameter boundaries; raise it.",
                          fields=("DPOptions.comm_limit",))
    idx = [m]
    for r in range(len(choice) - 1, -1, -1):
        idx.append(int(choice[r][idx[-1]]))
    return idx[::-1]


#: Relative slack on the bound of :func:`_band`, far above the rounding of its sums.
_SLACK = 1e-9


def _band(u: Units, base: np.ndarray, cap: float | None, phase: str,
          slice_cost: np.ndarray | None,
          limit: tuple[np.ndarray, np.ndarray, float] | None,
          start: list[int] | None) -> int | None:
    """How many start positions j ≤ i the DP must try per end i (the band's width), from the
    value U of the feasible cut ``start``; None where there is no such bound (no start, an
    infeasible one, a negative per-slice term or load).

    The objective only grows along the DP's path (the terms and h are non-negative), so each
    state on the optimal path has value ≤ U, and a slice whose own term exceeds U is never
    chosen: in the max phase a slice's load base_r + x is at most U; in a power phase
    (base_r + x)^p is at most U less every other rank's base^p."""
    m = len(u.bounds) - 1
    P = u.prefix
    if start is None or len(start) != len(base) + 1 or start[0] != 0 or start[-1] != m:
        return None
    if (slice_cost is not None and not slice_cost.min() >= 0) or np.any(np.diff(P) < 0):
        return None
    power = _POWERS.get(phase)
    value = 0.0
    for r in range(len(base)):
        j, i = start[r], start[r + 1]
        if i < j or (cap is not None and u.bounds[i] - u.bounds[j] > cap):
            return None
        if limit is not None and not limit[1][r] + (limit[0][i] - limit[0][j]) <= limit[2]:
            return None
        tot = (P[i] - P[j]) + base[r]
        value = max(value, tot) if power is None else value + tot ** power
        if slice_cost is not None:
            value += slice_cost[j, i]
    if not np.isfinite(value):
        return None
    bound = value * (1 + _SLACK) + 1e-300
    low = float(base.min())
    if power is None:
        reach = bound - low
    else:
        pos = np.maximum(base, 0.0) ** power
        rest = float(pos.sum()) * (1 - _SLACK)
        reach = float(((bound - rest + pos.max()) ** (1.0 / power))) - low
    reach = reach * (1 + _SLACK) + 1e-300
    lo = np.searchsorted(P, P - reach, side="left")
    return int((np.arange(m + 1) - lo).max()) + 1


def _bucket_dp_band(u: Units, base: np.ndarray, cap: float | None, phase: str,
                    slice_cost: np.ndarray | None,
                    limit: tuple[np.ndarray, np.ndarray, float] | None,
                    width: int) -> list[int]:
    """:func:`_bucket_dp` over the band of ``width`` start positions j ∈ [i - width + 1, i]
    per end i, in increasing j (so the first minimiser is the full table's), each entry
    computed by the same operations as the full table's."""
    R = len(base)
    m = len(u.bounds) - 1
    P = u.prefix
    rows = np.arange(m + 1)
    J = rows[:, None] - (width - 1) + np.arange(width)[None, :]
    valid = J >= 0
    J = np.maximum(J, 0)
    blk = P[:, None] - P[J]
    if cap is not None:
        valid &= (u.bounds[:, None] - u.bounds[J]) <= cap
    inf = np.inf
    extra = np.where(valid, 0.0 if slice_cost is None else slice_cost[J, rows[:, None]], inf)
    if limit is not None:
        lblk = limit[0][:, None] - limit[0][J]
    choice = np.zeros((R, m + 1), dtype=np.int64)
    g = np.full(m + 1, inf)
    g[0] = 0.0
    tot = np.empty((m + 1, width))
    power = _POWERS.get(phase)
    for r in range(R):
        np.add(blk, base[r], out=tot)
        if limit is not None:
            tot = np.where(limit[1][r] + lblk <= limit[2], tot, inf)
        if power is None:
            np.maximum(g[J], tot, out=tot)
        else:
            np.power(tot, power, out=tot)
            np.add(g[J], tot, out=tot)
        np.add(tot, extra, out=tot)
        k = tot.argmin(axis=1)
        choice[r] = J[rows, k]
        g = tot[rows, k]
    return _trace(choice, g, m)


def _bucket_dp_small(u: Units, base: np.ndarray, cap: float | None, phase: str) -> list[int]:
    """The same DP in plain Python, faster than numpy for buckets of at most three units."""
    R, m = len(base), len(u.bounds) - 1
    P = [float(x) for x in u.prefix]
    B = [int(x) for x in u.bounds]
    power = _POWERS.get(phase)
    inf = float("inf")
    g = [0.0] + [inf] * m
    choice = []
    for r in range(R):
        br = float(base[r])
        ng, ch = [inf] * (m + 1), [0] * (m + 1)
        for i in range(m + 1):
            for j in range(i + 1):
                if g[j] == inf or (cap is not None and B[i] - B[j] > cap):
                    continue
                x = br + P[i] - P[j]
                v = max(g[j], x) if power is None else g[j] + x ** power
                if v < ng[i]:
                    ng[i], ch[i] = v, j
        g = ng
        choice.append(ch)
    if g[m] == inf:
        raise OptionError("{DPOptions.comm_limit} is too tight: some bucket cannot be cut into "
                          "slices that small at parameter boundaries; raise it.",
                          fields=("DPOptions.comm_limit",))
    idx = [m]
    for r in range(R - 1, -1, -1):
        idx.append(choice[r][idx[-1]])
    return idx[::-1]


def _loads_by_bucket(problem: DPProblem, units: dict, cuts_idx: dict,
                     what: str = "load") -> np.ndarray:
    """Per DP index: the load (or optimizer-state bytes) of its slices."""
    load = np.zeros(problem.dp)
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u, idx = units[key], cuts_idx[key]
        p = u.prefix if what == "load" else u.state
        ix = problem.dp_indices(b)
        for r in range(b.ranks):
            load[ix[r]] += p[idx[r + 1]] - p[idx[r]]
    return load


def polish(problem: DPProblem, cuts: Cuts, *, comm_limit: float | None = None,
           max_rounds: int = 30, pieces: int | None = None,
           objective: Objective = MAX_LOAD, phases: tuple[str, ...] | None = None) -> Cuts:
    """Block coordinate descent: re-cut one bucket at a time, optimally given the others.

    Each bucket's DP balances the loads (the objective's F: smooth powers, then the maximum)
    plus the objective's per-slice term h_b (its g), when it has one. In the max phase, a bucket
    is also cut under each of the objective's ``slice_caps`` (largest slices worth trying for
    g's max-type parts), and the cut with the lowest ``load_term(max load) + g_b`` stays.
    ``phases``: a subset of ("ssq", "p8", "max") to run (default all, in that order).
    """
    sg = objective.state_grain(problem) if objective.has_state_term else None
    units = {(b.buffer, b.bucket): bucket_units(b, pieces or 4 * b.ranks, piece_grain(problem), sg)
             for b in problem.buckets}
    if pieces is not None:
        # Coarse pieces: keep the given cuts representable, so the descent starts from them.
        units = {k: _with_cuts(u, cuts[k]) for k, u in units.items()}
    idx: dict[tuple[int, int], list[int]] = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        u = units[key]
        idx[key] = u.bounds.searchsorted(cuts[key]).tolist()  # start: next boundary
    load = _loads_by_bucket(problem, units, idx)
    state = _loads_by_bucket(problem, units, idx, "state")
    widest = {(b.buffer, b.bucket): max((it.end - it.start for it in b.items if it.atomic),
                                        default=0) for b in problem.buckets}
    # Buckets whose divisible items hold state worth balancing (an AdamW embedding).
    heavy = {(b.buffer, b.bucket) for b in problem.buckets if sg and any(
        not it.atomic and it.state_bytes > 4 * sg for it in b.items)}
    scale = max(1.0, float(load.max()))

    def total() -> float:
        return (objective.load_term(float(load.max())) + sum(gvals.values())
                + objective.state_term(float(state.max())))

    order = sorted(problem.buckets, key=lambda b: (-b.load, b.buffer, b.bucket))
    gvals = {(b.buffer, b.bucket): _g(objective, problem, b, units[(b.buffer, b.bucket)],
                                      idx[(b.buffer, b.bucket)]) for b in problem.buckets}
    fixed: dict[tuple[int, int], tuple] = {}  # per bucket: what no round changes
    rest_of: dict[tuple[int, ...], np.ndarray] = {}  # DP indices → the others' mask
    for phase in phases or (*_POWERS, "max"):
        power = _POWERS.get(phase, 2)
        for _ in range(max_rounds):
            before = (total(), float(((load / scale) ** power).sum()))
            for b in order:
                key = (b.buffer, b.bucket)
                u = units[key]
                f = fixed.get(key)
                if f is None:
                    ix = problem.dp_indices(b)
                    costs = _slice_costs(objective, problem, b, u, scale)
                    su = _scaled(u, scale)
                    cap = None
                    if comm_limit is not None:
                        cap = comm_limit * (u.bounds[-1] - u.bounds[0]) / b.ranks
                    f = fixed[key] = (np.array(ix), su, costs, _units_key(su, costs), cap, ix)
                ds, su, costs, ukey, cap, ix = f
                base = load[ds] - _mine(u, idx[key])
                sbase_ = base / scale
                new = _bucket_dp(su, sbase_, cap, phase, costs, start=idx[key], ukey=ukey)
                new_mine = _mine(u, new)
                sbase = state[ds] - _mine(u, idx[key], "state")
                if phase == "max":
                    if len(ix) < len(load):
                        rest = rest_of.get(ix)
                        if rest is None:
                            rest = rest_of[ix] = np.ones(len(load), dtype=bool)
                            rest[ds] = False
                        others, others_s = float(load[rest].max()), float(state[rest].max())
                    else:
                        others = others_s = 0.0
                    peaks: dict[tuple[int, ...], tuple[float, float]] = {}
                    gs: dict[tuple[int, ...], float] = {}

                    def value(t: list[int], g: float) -> float:
                        """The objective with ``b`` cut at ``t`` (its term ``g``)."""
                        k = tuple(t)
                        got = peaks.get(k)
                        if got is None:
                            got = peaks[k] = (
                                max(others, float((base + _mine(u, t)).max())),
                                max(others_s, float((sbase + _mine(u, t, "state")).max())))
                        return objective.load_term(got[0]) + g + objective.state_term(got[1])

                    def g_of(t: list[int]) -> float:
                        k = tuple(t)
                        got = gs.get(k)
                        if got is None:
                            got = gs[k] = _g(objective, problem, b, u, t)
                        return got

                    g_new = g_of(new)
                    best = (value(new, g_new), new, g_new)
                    now = value(idx[key], gvals[key])
                    if now < best[0]:  # ties go to the new cut
                        best = (now, idx[key], gvals[key])
                    tries = []
                    for c in objective.slice_caps(problem, b):
                        c = c if cap is None else min(c, cap)
                        if c < widest[key]:
                            continue  # a matrix is wider than the cap: no such cut
                        try:
                            tries.append(_bucket_dp(su, sbase_, c, phase, costs,
                                                    start=idx[key], ukey=ukey))
                        except OptionError:
                            continue  # no cut at parameter boundaries that fine
                    if key in heavy:
                        # The state balanced, every rank's load kept under the ceiling.
                        ceil = objective.load_ceiling
                        ss = max(1.0, float(state.max()))
                        try:
                            tries.append(_bucket_dp(
                                Units(u.bounds, u.state / ss, 0.0), sbase / ss, cap, phase, None,
                                None if ceil is None else (u.prefix / scale, base / scale,
                                                           max(ceil, float(load.max())) / scale),
                                start=idx[key]))
                        except OptionError:
                            pass  # no cut keeps every load under the ceiling
                    for t in tries:
                        g = g_of(t)
                        v = value(t, g)
                        if v < best[0]:
                            best = (v, t, g)
                    _, new, gvals[key] = best
                    new_mine = _mine(u, new)
                idx[key] = new
                load[ds] = base + new_mine
                state[ds] = sbase + _mine(u, new, "state")
            after = (total(), float(((load / scale) ** power).sum()))
            if after >= before if phase == "max" else after[1] >= before[1] * (1 - 1e-12):
                break
    return {k: cuts_from_indices(units[k], v) for k, v in idx.items()}


def _with_cuts(u: Units, cuts: tuple[int, ...]) -> Units:
    """``u`` with every cut position among its bounds (loads and state interpolated linearly
    inside the unit a cut falls in: the cuts of our plans fall inside divisible pieces only)."""
    at = np.asarray(cuts, dtype=np.int64)
    k = np.minimum(np.searchsorted(u.bounds, at), len(u.bounds) - 1)
    missing = u.bounds[k] != at  # (the bounds are sorted)
    if not missing.any():
        return u
    extra = np.unique(at[missing])
    bounds = np.union1d(u.bounds, extra)
    prefix = np.interp(bounds, u.bounds, u.prefix)
    state = None if u.state is None else np.interp(bounds, u.bounds, u.state)
    return Units(bounds, prefix, u.piece_load, state)


def _mine(u: Units, idx: list[int], what: str = "load") -> np.ndarray:
    """Load (or optimizer-state bytes) of every rank's slice under cut indices ``idx``."""
    p = u.prefix if what == "load" else u.state
    at = p[np.asarray(idx)]
    return at[1:] - at[:-1]


def _slice_costs(objective: Objective, problem: DPProblem, b: BucketProblem, u: Units,
                 scale: float) -> np.ndarray | None:
    """h_b of every slice units j..i-1 of ``b`` (a matrix over (j, i)), scaled, or None."""
    if not objective.has_bucket_term:
        return None
    span = np.maximum(u.bounds[None, :] - u.bounds[:, None], 0)
    return np.asarray(objective.slice_term(problem, b, span), dtype=float) / scale


def _g(objective: Objective, problem: DPProblem, b: BucketProblem, u: Units,
       idx: list[int]) -> float:
    """g_b of the slices that cut indices ``idx`` give (0 for an objective without g)."""
    if not objective.has_bucket_term:
        return 0.0
    return objective.bucket_term(problem, b, np.diff(u.bounds[np.asarray(idx)]).tolist())


def _scaled(u: Units, scale: float) -> Units:
    return Units(u.bounds, u.prefix / scale, u.piece_load / scale, u.state)


def rebalance_divisible(problem: DPProblem, cuts: Cuts, *, comm_limit: float | None = None,
                        tolerance: float = 1e-3, ceiling: float | None = None,
                        objective: Objective = MAX_LOAD) -> Cuts:
    """Re-place every cut that sits between matrices so the AdamW elements between two matrices
    are shared evenly by the ranks that may take them (:func:`spread_cuts`).

    Such a cut can slide without changing who owns any matrix; spreading keeps optimizer state
    and reduce-scatter slices balanced around huge AdamW tensors (embeddings, output layer),
    which cost almost nothing in FLOPs. Kept only if the objective's score grows by at most
    ``tolerance`` (relative) and stays within ``ceiling`` (the greedy plan's score, so the
    result is never worse than the paper's algorithm).
    """
    out: Cuts = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        c = cuts[key]
        new = _SPREAD.get((b,), tuple(c))
        if new is None:
            top = len(c) - 2  # owner_of, inlined
            owners = [min(max(bisect_right(c, it.start) - 1, 0), top)
                      for it in b.items if it.atomic]
            new = _SPREAD.put((b,), tuple(c), spread_cuts(b, owners))
        if comm_limit is not None:
            cap = comm_limit * (b.end - b.start) / b.ranks
            if max(v - u for u, v in zip(new, new[1:])) > cap:
                new = c
        out[key] = new
    before = objective.score(problem, cuts)
    after = objective.score(problem, out)
    limit = before * (1 + tolerance) if ceiling is None else min(before * (1 + tolerance),
                                                                 max(before, ceiling))
    return out if after <= limit else cuts


#: :func:`spread_cuts` of a bucket by the bucket and the cuts its owners are read from.
_SPREAD = Kept(8192)


def _rank_in(problem: DPProblem, b: BucketProblem, d: int) -> int | None:
    """Rank of DP index ``d`` in ``b``'s sharding group (None if d does not hold this bucket)."""
    buf = problem.layout.buffers[b.buffer]
    if not buf.expert:
        return d
    ep = problem.sizes.ep
    return (d - buf.ep_rank) // ep if d % ep == buf.ep_rank else None


def swap_search(problem: DPProblem, cuts: Cuts, *, max_moves: int = 5000) -> tuple[Cuts, int]:
    """Local search on whole matrices: move one matrix off the busiest DP index, or swap it
    with a lighter matrix of another index, wherever both buckets' rank order allows.

    This is what the per-bucket DP cannot do (it changes two buckets at once); it matters most
    where buckets hold one or two matrices, i.e. where the problem is plain bin packing.
    Returns the new cuts and the number of moves made.
    """
    owners: dict[tuple[int, int], list[int]] = {}
    atomic: dict[tuple[int, int], list] = {}
    for b in problem.buckets:
        key = (b.buffer, b.bucket)
        c = cuts[key]
        atomic[key] = [it for it in b.items if it.atomic]
        owners[key] = [owner_of(c, it.start) for it in atomic[key]]
    by_key = {(b.buffer, b.bucket): b for b in problem.buckets}
    load = list(evaluate(problem, cuts).load)
    held: dict[int, set] = {d: set() for d in range(problem.dp)}
    for key, own in owners.items():
        for k, r in enumerate(own):
            held[problem.dp_index(by_key[key], r)].add((key, k))

    def window(key, k):
        own = owners[key]
        lo = own[k - 1] if k > 0 else 0
        hi = own[k + 1] if k + 1 < len(own) else by_key[key].ranks - 1
        return lo, hi

    moves = 0
    for _ in range(max_moves):
        top = max(range(problem.dp), key=lambda d: (load[d], -d))
        L = load[top]
        best = None  # (new pair max, kind, ...)
        for key, k in sorted(held[top]):
            b = by_key[key]
            w = atomic[key][k].load
            lo, hi = window(key, k)
            for r in range(lo, hi + 1):
                d2 = problem.dp_index(b, r)
                if d2 == top:
                    continue
                if load[d2] + w < L and (best is None or load[d2] + w < best[0]):
                    best = (load[d2] + w, "move", key, k, r, d2)
                for key2, k2 in held[d2]:
                    if key2 == key:
                        continue
                    w2 = atomic[key2][k2].load
                    if w2 >= w:
                        continue
                    r_top = _rank_in(problem, by_key[key2], top)
                    if r_top is None:
                        continue
                    lo2, hi2 = window(key2, k2)
                    if not lo2 <= r_top <= hi2:
                        continue
                    worst = max(L - w + w2, load[d2] - w2 + w)
                    if worst < L and (best is None or worst < best[0]):
                        best = (worst, "swap", key, k, r, d2, key2, k2, r_top)
        if best is None:
            break
        moves += 1
        _, kind, key, k, r, d2, *rest = best

        def transfer(key, k, slot_rank, src, dst):  # one matrix from DP index src to dst
            w = atomic[key][k].load
            owners[key][k] = slot_rank
            held[src].discard((key, k))
            held[dst].add((key, k))
            load[src] -= w
            load[dst] += w

        transfer(key, k, r, top, d2)
        if kind == "swap":
            key2, k2, r_top = rest
            transfer(key2, k2, r_top, d2, top)
    return owners_to_cuts(problem, owners), moves



def improve(problem: DPProblem, cuts: Cuts, comm_limit: float | None,
            max_rounds: int = 30, *, objective: Objective = MAX_LOAD) -> Cuts:
    """Per-bucket DP polish alternating with whole-matrix moves/swaps across buckets (which
    propose; the objective's score decides)."""
    best = polish(problem, cuts, comm_limit=comm_limit, max_rounds=max_rounds,
                  objective=objective)
    best_score = objective.score(problem, best)
    for _ in range(4):
        cand, moves = swap_search(problem, best)
        if not moves:
            break
        cand = polish(problem, cand, comm_limit=comm_limit, max_rounds=max_rounds,
                      objective=objective)
        cand_score = objective.score(problem, cand)
        if cand_score >= best_score:
            break
        best, best_score = cand, cand_score
    return best


def improve_comm(problem: DPProblem, cuts: Cuts, comm_limit: float | None, *,
                 objective: Objective, max_rounds: int = 2) -> Cuts:
    """From cuts already balanced for the compute: identical buckets re-cut together
    (:func:`even_out_twins`), then the max phase of :func:`polish` alone, each bucket re-cut
    where the objective's communication term falls by more than its load term grows."""
    cuts = even_out_twins(problem, cuts, comm_limit, objective=objective)
    return polish(problem, cuts, comm_limit=comm_limit, max_rounds=max_rounds,
                  objective=objective, phases=("max",), pieces=COMM_PIECES)


def even_out_twins(problem: DPProblem, cuts: Cuts, comm_limit: float | None, *,
                   objective: Objective) -> Cuts:
    """Buckets with the same items in the same order (the expert layers of an MoE, repeated
    blocks) re-cut R at a time under the objective's slice cap, so their slices are nearly
    even — the stock collectives' layout — while together they leave every rank the load it
    had: a move no single bucket can make, since one bucket cut evenly shifts load onto ranks
    that the next one must relieve. Kept, R buckets at a time, where the objective's load and
    communication terms fall."""
    grain = piece_grain(problem)
    units = {(b.buffer, b.bucket): _with_cuts(bucket_units(b, COMM_PIECES, grain),
                                              cuts[(b.buffer, b.bucket)])
             for b in problem.buckets}
    idx = {k: u.bounds.searchsorted(cuts[k]).tolist() for k, u in units.items()}
    load = _loads_by_bucket(problem, units, idx)
    scale = max(1.0, float(load.max()))
    twins: dict[tuple, list[BucketProblem]] = {}
    for b in problem.buckets:
        sig = tuple((it.atomic, it.end - it.start, it.load) for it in b.items)
        twins.setdefault((b.buffer, b.ranks, b.end - b.start, sig), []).append(b)
    changed = False
    for (_, ranks, _, _), group in sorted(twins.items(), key=lambda kv: kv[0][:3]):
        if len(group) < 2 or ranks < 2:
            continue
        # Chunks of R twins each wholly owned by a different rank: cut evenly together, they
        # give every rank one bucket's load again.
        whole: dict[int, list[BucketProblem]] = {}
        for b in group:
            i = idx[(b.buffer, b.bucket)]
            owners = [r for r in range(b.ranks) if i[r + 1] > i[r]]
            if len(owners) == 1:
                whole.setdefault(owners[0], []).append(b)
        chunks = list(zip(*(whole[r] for r in range(ranks)))) if len(whole) == ranks else []
        for chunk in chunks:
            trial = load.copy()
            for b in chunk:
                k = (b.buffer, b.bucket)
                trial[list(problem.dp_indices(b))] -= _mine(units[k], idx[k])
            new: dict[tuple[int, int], list[int]] = {}
            for b in chunk:
                k, u = (b.buffer, b.bucket), units[(b.buffer, b.bucket)]
                caps = objective.slice_caps(problem, b)
                cap = min(caps[0], comm_limit * (b.end - b.start) / b.ranks) if caps and \
                    comm_limit is not None else (caps[0] if caps else None)
                if cap is None:
                    break
                ds = list(problem.dp_indices(b))
                try:
                    new[k] = _bucket_dp(_scaled(u, scale), trial[ds] / scale, cap, "max")
                except OptionError:
                    break  # a matrix wider than the cap: these buckets stay as they are
                trial[ds] += _mine(u, new[k])
            if len(new) < len(chunk):
                continue
            old_g = sum(_g(objective, problem, b, units[(b.buffer, b.bucket)],
                           idx[(b.buffer, b.bucket)]) for b in chunk)
            new_g = sum(_g(objective, problem, b, units[(b.buffer, b.bucket)],
                           new[(b.buffer, b.bucket)]) for b in chunk)
            if objective.load_term(float(trial.max())) + new_g \
                    < objective.load_term(float(load.max())) + old_g:
                load = trial
                idx.update(new)
                changed = True
    if not changed:
        return cuts
    return {k: cuts_from_indices(units[k], v) for k, v in idx.items()}


#: Pieces per divisible item in the communication stage (coarser than the compute stages'
#: 4·R: its moves are whole matrices and slice counts, and R² pieces would dominate at R = 256).
COMM_PIECES = 16
