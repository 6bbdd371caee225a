"""Micro-group scheduling for tensor parallelism, and the per-GPU (joint DP × TP) objective.

Canzona (arXiv 2602.06079, §TP). Under TP every matrix is split over the TP group, so its update
needs the whole matrix on one *host* rank: gather the shards, compute, scatter the update back.
For each DP index d (its TP group holds the shards of every parameter d owns) this module chooses

* a host TP rank per TP-split matrix task (replicated parameters stay local, computed by every
  rank; AdamW works on each rank's shard);
* ordered *micro-groups*: the full matrices a rank hosts in one group fit a memory cap C_max
  (bytes of the gathered full matrices in the communication dtype; the update overwrites the
  gathered gradient, and Newton–Schulz / Shampoo workspace is not counted; with the pipeline
  below two groups are in flight, so the peak is up to 2·C_max);
* the exact all-to-all split sizes of every group, so the runtime does no planning.

::

    TP group of DP index d (tp = 4)         time ─────────────────────────────────────►
    comm    │ gather g0 │ gather g1 │ scatter g0 │ gather g2 │ scatter g1 │   │ scatter g2 │
    t=0     │           │ compute g0 (hosted on 0)│ compute g1            │ compute g2 │
    t=1..3  │           │ compute g0 (hosted on t)│ …  (every rank waits for the slowest in g)

Solvers: ``greedy`` is the paper's global LPT with rollback (tasks by decreasing load, each to
the rank with the least total load; if that rank's share of the current group would exceed C_max
the group closes and a new one starts); ``cpsat`` re-hosts every group with OR-Tools (minimise the
busiest rank's running total, then the group's max − min), warm-started from greedy. The order of
the groups is a two-machine flow shop (gather of group i+1 overlaps compute of group i), which
Johnson's rule solves exactly, so no search is needed there.

The objective that costs time is the slowest GPU, max over (d, t): :func:`gpu_loads` evaluates a DP
partition plus a TP schedule on that grid and :func:`joint_refine` moves DP cut points (whole
matrices between neighbouring DP indices of a bucket) to lower it. LB_gpu = max(total / (dp·tp),
largest task) bounds every schedule with whole-matrix tasks.

Modules, in dependency order: ``context`` (settings, per-task facts, the per-GPU objective) →
``schedule`` → ``joint`` (the refinement the DP solver calls); the plan's TP section is written
by :mod:`canzona.planner.plan.tp_section`.
``baselines`` (the TP rows of the strategy registry, :mod:`canzona.planner.strategies`) sits
above the DP package (it runs the DP greedy) and is imported on its own.
"""

from ..options import MIB, TP_SOLVERS, TPOptions
from ..planning import Cuts
from .context import TPContext, index_gpu_max, index_work, lb_gpu, lpt_bins, lpt_makespan
from .joint import joint_refine
from .schedule import IndexSchedule, MicroGroup, TPSchedule, gpu_loads, schedule_index, schedule_tp

__all__ = [
    "MIB", "TP_SOLVERS", "Cuts", "IndexSchedule", "MicroGroup", "TPContext", "TPSchedule",
    "TPOptions", "gpu_loads", "index_gpu_max", "index_work", "joint_refine", "lb_gpu",
    "lpt_bins", "lpt_makespan", "schedule_index", "schedule_tp",
]
