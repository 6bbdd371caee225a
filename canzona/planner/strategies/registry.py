"""The strategy registry: every way to run the optimizer step that ``canzona compare`` and
``canzona inspect`` price, by name, in the order both print them.

A :class:`Strategy` says what it is (a one-line description, whether it computes the exact
single-device optimizer, how gradients are synchronised), how it assigns whole parameters to DP
ranks where it deals them (``deal``), and how it becomes each front end's figures: a simulated
workload (``workload``, for ``compare``), a DP row and a TP row (``baseline``, ``tp_baseline``,
for ``inspect``), and the plan it is priced from (``plan``, the canzona rows). A front end lists
the strategies that have its hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import baselines as bl
from ..comm import PER_ROOT
from ..baselines import BaselineInputs, BaselineRow, Dealing
from ..hardware import HardwareProfile, LinkProfile
from ..options import DPOptions, TPOptions
from ..pipeline import Behind, greedy_options, plan_problem
from ..plan import Plan
from ..planning import Cuts, DPProblem
from ..simulate import Workload
from ..tp import TPContext
from ..tp import baselines as tpb
from ..tp.baselines import TPBaselineInputs, TPBaselineRow
from ..tp.schedule import TPSchedule
from . import workloads as wl
from .workloads import Built, WorkloadInputs

__all__ = ["CANZONA", "CANZONA_GREEDY", "DESCRIPTIONS", "EXACT", "REGISTRY", "STRATEGIES",
           "Strategy", "baseline_rows", "build", "strategy_workload", "tp_baseline_rows"]

#: The planner's own rows: the plan given or made with the defaults, and the paper's method.
CANZONA, CANZONA_GREEDY = "canzona", "canzona-greedy"


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run the optimizer step, as both front ends see it.

    Attributes:
        name: its name in tables, ``--strategies`` and ``--json``.
        description: one line: what it does (both front ends' legends).
        exact: whether it computes the exact single-device optimizer.
        grad_sync: ``all-reduce`` or ``reduce-scatter``.
        deal: how it assigns whole parameters to DP ranks, for the strategies that deal them
            (the layer-wise ones); the others assign inside their builders (cuts, shards, plans).
        workload: ``compare``'s simulated workload.
        baseline: ``inspect``'s DP row (None where it has none to give, e.g. no plan).
        tp_baseline: ``inspect``'s TP row (tp > 1).
        plan: makes the plan the strategy is priced from when none is given (from the
            problem, the options, and the forward/backward the comparison runs behind).
    """

    name: str
    description: str
    exact: bool
    grad_sync: str
    deal: Callable[[DPProblem], Dealing] | None = None
    workload: Callable[[Strategy, WorkloadInputs], Built] | None = None
    baseline: Callable[[Strategy, BaselineInputs], BaselineRow | None] | None = None
    tp_baseline: Callable[[Strategy, TPBaselineInputs], TPBaselineRow | None] | None = None
    plan: Callable[[DPProblem, DPOptions, TPOptions, Behind | None], Plan] | None = None


# --- the hooks ------------------------------------------------------------------------------------


def _named(build_row: Callable) -> Callable:
    """A row builder that needs only the strategy's name and gradient sync."""
    return lambda s, x: build_row(x, s.name, s.grad_sync)


def _labelled(build: Callable[[WorkloadInputs, str], Built]) -> Callable:
    """A workload builder that needs only the strategy's name."""
    return lambda s, x: build(x, s.name)


def _dealt_workload(s: Strategy, x: WorkloadInputs) -> Built:
    return wl.dealt_workload(x, s.name, s.deal(x.problem), s.description)  # type: ignore[misc]


def _dealt_row(s: Strategy, x: BaselineInputs) -> BaselineRow:
    return bl.dealt_row(x, s.name, s.grad_sync, s.deal(x.problem))  # type: ignore[misc]


def _tp_row(build_row: Callable) -> Callable:
    """A TP row builder that needs only the strategy's name."""
    return lambda s, x: build_row(x, s.name)


def _plan_canzona(problem: DPProblem, dp: DPOptions, tp: TPOptions,
                  behind: Behind | None = None) -> Plan:
    return plan_problem(problem, dp_options=dp, tp_options=tp, behind=behind)


def _plan_greedy(problem: DPProblem, dp: DPOptions, tp: TPOptions,
                 behind: Behind | None = None) -> Plan:
    """The DP greedy (α = 1, max load) and the TP greedy, nothing shared."""
    go, gt = greedy_options(dp, tp)
    return plan_problem(problem, dp_options=go, tp_options=gt)


# --- the registry ---------------------------------------------------------------------------------

_ALL = (
    Strategy("sc", "all-reduce; every rank updates everything (TP: duplicated)", True,
             "all-reduce", workload=_labelled(wl.sc_workload), tp_baseline=_tp_row(tpb.sc_row)),
    Strategy("zero1", "equal chunks, optimizer on fragments — NOT the exact optimizer", False,
             "reduce-scatter", workload=_labelled(wl.zero1_workload),
             baseline=_named(bl.zero1_row)),
    Strategy("asc", "equal chunks; each matrix computed whole by the rank holding its start",
             True,
             "reduce-scatter", baseline=_named(bl.asc_row)),
    Strategy("layerwise", "all-reduce; whole params dealt ping-pong by ascending size "
                          "(megatron-core's shard_params); uneven all-gather (TP: duplicated)",
             True, "all-reduce", deal=bl.megatron_layerwise, workload=_dealt_workload,
             baseline=_dealt_row),
    Strategy("layerwise-lpt", "all-reduce; whole params dealt by LPT on the proxy "
                              "max(m,n)·min(m,n)²; uneven all-gather (TP: duplicated)",
             True, "all-reduce", deal=bl.layerwise_lpt, workload=_dealt_workload,
             baseline=_dealt_row),
    Strategy("megatron-packed", "Megatron's packed shards; even RS/AG, padded (TP: duplicated)",
             True, "reduce-scatter", workload=_labelled(wl.packed_workload),
             baseline=_named(bl.packed_row)),
    Strategy(CANZONA_GREEDY, "the paper: α-greedy cuts, TP greedy micro-groups", True,
             "reduce-scatter", workload=_labelled(wl.plan_workload),
             baseline=_named(bl.greedy_row), tp_baseline=_tp_row(tpb.greedy_row),
             plan=_plan_greedy),
    Strategy(CANZONA, "the planner's plan", True, "reduce-scatter",
             workload=_labelled(wl.plan_workload), baseline=_named(bl.plan_row),
             tp_baseline=_tp_row(tpb.schedule_row), plan=_plan_canzona),
)

#: Every strategy by name, in the order tables print them.
REGISTRY: dict[str, Strategy] = {s.name: s for s in _ALL}
#: The strategies ``compare`` simulates (those with a workload), in table order.
STRATEGIES = tuple(s.name for s in _ALL if s.workload is not None)
#: The strategies of :data:`STRATEGIES` that compute the exact single-device optimizer.
EXACT = frozenset(s.name for s in _ALL if s.workload is not None and s.exact)
#: One line per strategy: what it does.
DESCRIPTIONS = {s.name: s.description for s in _ALL}


# --- what the front ends call ---------------------------------------------------------------------


def build(name: str, x: WorkloadInputs) -> Built:
    """Strategy ``name``'s workload, and the logical FLOPs and state bytes per DP index.

    Raises:
        ValueError: a name that :data:`STRATEGIES` does not hold.
    """
    s = REGISTRY.get(name)
    if s is None or s.workload is None:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return s.workload(s, x)


def strategy_workload(name: str, problem: DPProblem, hw: HardwareProfile, *,
                      plan: Plan | None = None, matrix_dtype: str = "bf16",
                      adamw_dtype: str = "bf16", gather_method: str = PER_ROOT) -> Workload:
    """The workload of strategy ``name`` (:data:`STRATEGIES`) on ``problem``.

    ``canzona`` and ``canzona-greedy`` need their ``plan`` (made from the same problem);
    ``gather_method`` is the layer-wise all-gather's (``per_root`` on NCCL, ``padded`` on gloo).
    """
    return build(name, WorkloadInputs(problem, hw, plan, matrix_dtype, adamw_dtype,
                                      gather_method))[0]


def baseline_rows(problem: DPProblem, plan: Plan | None = None,
                  link: LinkProfile | None = None) -> list[BaselineRow]:
    """Every strategy's DP row (``inspect``'s baselines, and ``plan`` as ``canzona``): max/mean,
    gap to the certified bound and collectives, on ``link`` (default: the plan's recorded link,
    else the default hardware profile's)."""
    x = BaselineInputs(problem, plan, link)
    rows = (s.baseline(s, x) for s in _ALL if s.baseline is not None)
    return [r for r in rows if r is not None]


def tp_baseline_rows(problem: DPProblem, cuts: Cuts, *, plan: Plan | None = None,
                     schedule: TPSchedule | None = None,
                     ctx: TPContext | None = None) -> list[TPBaselineRow]:
    """Every strategy's TP row (per GPU) on the DP partition ``cuts``; canzona's from ``plan``'s
    recorded metrics, else from ``schedule`` (neither: no canzona row)."""
    recorded = None
    if plan is not None and plan.tp is not None:
        m = plan.tp.metrics
        flat = [v for r in m.gpu_load for v in r]
        recorded = TPBaselineRow(CANZONA, m.max_gpu_load, sum(flat) / len(flat),
                                 m.max_over_mean, m.gap_to_lb_gpu)
    x = TPBaselineInputs(problem, cuts, recorded=recorded, schedule=schedule, ctx=ctx)
    rows = (s.tp_baseline(s, x) for s in _ALL if s.tp_baseline is not None)
    return [r for r in rows if r is not None]
