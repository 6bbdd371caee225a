"""α-balanced static partitioning for data parallelism (Canzona, arXiv 2602.06079, §DP).

Inside every ZeRO-1 bucket, DP rank r still owns the r-th slice [s_r, s_{r+1}) — so one
(variable-size) reduce-scatter and all-gather per bucket remain — but the cut points s_1..s_{R-1}
move to boundaries of matrix-optimizer parameters, so every matrix is whole on one rank. AdamW
parameters are elementwise and may be cut anywhere, as plain ZeRO-1 does.

Solvers (one entry, :func:`canzona.planner.solve.solve`, steered by
:class:`~canzona.planner.options.DPOptions`):

* ``greedy`` — the paper's α-balanced LPT: buckets visited by load, largest first; each bucket's
  target split blends the even element split (α = 0, ZeRO-1's geometry) with filling every rank's
  deficit to the mean load (α = 1), then snaps each cut to the nearest allowed boundary.
* ``auto`` (default) — greedy, then exact per-bucket re-optimisation by dynamic programming
  (block coordinate descent: each bucket's cuts are re-chosen optimally given the other buckets,
  first for the sum of squared loads, then for the maximum), until no bucket improves.
* ``cpsat`` — an OR-Tools CP-SAT model minimising the maximum load, warm-started from ``auto``,
  limited in deterministic time with a fixed worker count (reproducible), returning its proven
  bound.

An optional ``comm_limit`` bounds every slice to ``comm_limit × S/R`` elements: with the padded
collectives, a bucket moves R·max-slice bytes, so this caps the communication overhead α trades
against. ``reorder`` (on by default) lets parameters move inside a bucket: a bucket is reduced
as a unit, so the order inside it changes neither when its reduce-scatter can start nor what it
moves, only which parameters can share a rank; the plan records the new order, and canzona's
runtime lays its buffers out from the plan. ``reorder=False`` keeps Megatron's order.

Modules, in dependency order: ``units`` (buckets as units, cuts from owners) → ``greedy`` →
``polish`` (per-bucket DP, moves/swaps) → ``bounds`` → ``cpsat`` → ``reorder``. The stages run
from ``canzona.planner.solve``, which also calls the TP side's joint refinement and so sits
above both packages. OR-Tools is imported only inside the functions that build a CP-SAT model.
"""

from .bounds import SCALE_UNITS, packing_bound, pigeonhole_bound
from .cpsat import solve_cpsat
from .greedy import greedy
from .polish import improve, polish, rebalance_divisible, swap_search
from .reorder import assign_free, reorder_problem
from .units import Cuts, Units, bucket_units, owners_to_cuts, piece_grain, spread_cuts

__all__ = [
    "SCALE_UNITS", "Cuts", "Units", "assign_free", "bucket_units", "greedy", "improve",
    "owners_to_cuts", "packing_bound", "piece_grain", "pigeonhole_bound", "polish",
    "rebalance_divisible", "reorder_problem", "solve_cpsat", "spread_cuts", "swap_search",
]
