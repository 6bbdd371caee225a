"""The planner's one entry: from a model source, sizes, optimizer settings, DP options and TP
options to a :class:`~canzona.planner.plan.Plan`.

::

    source ──inventory──► ModelSpec ──make_problem──► DPProblem (layout, tasks, costs, buckets)
        ──solve──► cut points (and the reordered problem) ──tp.schedule_tp──► TP schedule
        ──plan.build_plan──► Plan (assembled once, TP section included)

The CLI (``canzona plan``), ``canzona.plan_model``, ``plans/regenerate.py`` and the benchmarks
all plan through :func:`plan` (or :func:`plan_problem`, given a problem already built).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path

from .errors import CanzonaError, SizeError
from .hardware import HardwareProfile, load_hardware
from .inventory import NAMINGS, ModelSpec, build_inventory
from .layout import ParallelSizes, validate_sizes
from .models import PRESETS, ModelConfig, get_preset, load_hf_config
from .objective import objective_name
from .fsdp2 import make_fsdp2_problem, solve_fsdp2
from .options import DPOptions, TPOptions
from .plan import FSDP2Plan, PipelinePlan, Plan, SolverOptions
from .plan.build import build_plan
from .plan.fsdp2_plan import build_fsdp2_plan
from .plan.tp_section import placements, tp_plan
from .planning import DPProblem, make_problem
from .settings import OptimizerSettings
from .sharing import Candidate, Candidates
from .simulate import plan_forward_backward, simulate_plan_behind
from .stages import StageSplit, split_model, stage_layers
from .tp.schedule import warn_oversized

#: A model source: a preset name, a Hugging Face ``config.json`` path, a config, or an inventory
#: (e.g. ``canzona.runtime.introspect.inventory`` of a live module).
Source = str | Path | ModelConfig | ModelSpec

#: The forward/backward a plan's step is simulated behind when the planner judges it against
#: the paper's greedy plan: (seconds, ``overlap_param_gather``).
Behind = tuple[float, bool]

__all__ = ["STORAGES", "Behind", "Source", "greedy_options", "inventory_of", "plan", "plan_problem"]


def inventory_of(source: Source, names: str = "megatron") -> tuple[ModelSpec, str]:
    """The inventory of ``source`` and the plan's ``model_source`` for it (``names``: the
    parameter names of a config's inventory, a key of ``inventory.NAMINGS``; an inventory keeps
    its own)."""
    if isinstance(source, ModelSpec):
        if source.config is None:
            return source, "module"
        return source, _config_source(source.config)
    if isinstance(source, Path):
        return build_inventory(load_hf_config(source), names=names), "hf_config"
    if isinstance(source, str):
        return build_inventory(get_preset(source), names=names), "preset"
    if isinstance(source, ModelConfig):
        return build_inventory(source, names=names), _config_source(source)
    raise CanzonaError(f"a model source is a preset name, a config.json path, a ModelConfig or a "
                       f"ModelSpec; got {type(source).__name__}.")


def _config_source(cfg: ModelConfig) -> str:
    return "preset" if PRESETS.get(cfg.name) == cfg else "hf_config"


def plan(
    source: Source,
    sizes: ParallelSizes,
    optimizer: OptimizerSettings | str = "muon",
    *,
    dp_options: DPOptions | None = None,
    tp_options: TPOptions | None = None,
    dp_only: bool = False,
    progress: Callable[[str], None] | None = None,
    names: str = "megatron",
    stages: StageSplit | None = None,
    storage: str = "zero1",
) -> Plan | PipelinePlan | FSDP2Plan:
    """Plan ``source`` at ``sizes``: the DP partition and, for tp > 1, the TP micro-groups; with
    pipeline stages (``stages.pp`` > 1), each stage's, in one :class:`PipelinePlan`.

    Args:
        source: a preset name (``"qwen3-32b"``), a ``config.json`` :class:`~pathlib.Path`, a
            :class:`ModelConfig`, or a :class:`ModelSpec` (a live module's inventory).
        sizes: dp, tp, ep (and etp).
        optimizer: :class:`OptimizerSettings`, or a registered optimizer's name.
        dp_options: bucket layout, cost model and DP solver (:class:`DPOptions`).
        tp_options: micro-group cap, TP solver, comm dtype (:class:`TPOptions`).
        dp_only: stop after the DP stage: no TP section even for tp > 1 (for studies of the DP
            partition; the runtime and ``check_plan`` want the TP section).
        progress: told the name of each stage as it starts.
        names: a config's parameter names, a key of
            :data:`~canzona.planner.inventory.NAMINGS`: ``megatron`` (Megatron-core's, experts
            as SequentialMLP's), ``megatron-grouped`` (experts as TEGroupedMLP's) or ``hf`` (the
            live ``transformers`` model's, so the plan fits it; tp = 1).
        stages: the trainer's pipeline stages (:class:`~canzona.planner.stages.StageSplit`:
            pp and Megatron's first and last stages' layers). Each stage is planned on its own
            over its DP and TP groups (``sizes`` are each stage's); nothing moves across stages.
        storage: where the parameters live: ``zero1`` (ZeRO-1 buckets, the default) or
            ``fsdp2`` (``fully_shard``'s ``Shard(0)`` rows over the DP ranks: each matrix's
            owner and the all-to-all rounds, :mod:`canzona.planner.fsdp2`, in an
            :class:`FSDP2Plan`; with tp > 1 a dp × tp mesh; ep 1, no stages; the rounds' cap is
            ``tp_options.cmax_mib`` and their times are priced on ``tp_options.hardware``).

    Raises:
        CanzonaError: bad input (unknown model, sizes the model does not allow, an option out of
            range), before any solving.
    """
    say = progress or (lambda _msg: None)
    o = dp_options or DPOptions()
    t = tp_options or TPOptions()
    settings = (OptimizerSettings(name=optimizer)  # type: ignore[arg-type]
                if isinstance(optimizer, str) else optimizer)
    say("model inventory and ZeRO-1 layout")
    naming = NAMINGS.get(names)
    if naming is not None and not naming.parallel and (sizes.tp > 1 or sizes.ep > 1):
        raise SizeError(f"parameter names '{names}' describe a plain transformers model at tp 1 "
                        f"and ep 1; got {{ParallelSizes.tp}} {sizes.tp}, {{ParallelSizes.ep}} "
                        f"{sizes.ep}. Megatron-core's names ('megatron', 'megatron-grouped') "
                        "carry the tensor- and expert-parallel layout.",
                        fields=("ParallelSizes.tp", "ParallelSizes.ep"))
    spec, model_source = inventory_of(source, names)
    split = stages or StageSplit()
    if storage not in STORAGES:
        raise CanzonaError(f"storage {storage!r} is not known; choose one of "
                           f"{', '.join(STORAGES)}.")
    if storage == "fsdp2":
        return _plan_fsdp2(spec, sizes, split, settings, o, t, model_source, say)
    if split.pp == 1:
        stage_layers(0, split)  # first/last counts without stages fail here
        problem = make_problem(spec, sizes, settings, cost=o.cost, bucket_size=o.bucket_size,
                               overlap_grad_reduce=o.overlap_grad_reduce,
                               comm_dtype=t.comm_dtype, hardware=t.hardware)
        return plan_problem(problem, dp_options=o, tp_options=t, model_source=model_source,
                            dp_only=dp_only, progress=progress)
    if spec.config is not None:
        validate_sizes(spec.config, sizes)  # before any stage is planned
    parts = split_model(spec, split)
    made = []
    with warnings.catch_warnings(record=True) as notes:  # each stage's notes, said once
        warnings.simplefilter("always")
        made = _plan_stages(parts, split, sizes, settings, o, t, model_source, dp_only,
                            progress)
    said: set[tuple[type, str]] = set()
    for n in notes:
        if (n.category, str(n.message)) not in said:
            said.add((n.category, str(n.message)))
            warnings.warn(n.message, n.category, stacklevel=2)
    return PipelinePlan(pp=split.pp, stages=tuple(made))


#: Where a plan's parameters live: the storages :func:`plan` plans for.
STORAGES = ("zero1", "fsdp2")


def _plan_fsdp2(spec: ModelSpec, sizes: ParallelSizes, split: StageSplit,
                settings: OptimizerSettings, o: DPOptions, t: TPOptions, model_source: str,
                say: Callable[[str], None]) -> FSDP2Plan:
    """:func:`plan` for FSDP2's storage: a dp mesh, or dp × tp with tensor parallelism."""
    for field, value, flag in (("ParallelSizes.ep", sizes.ep, "ep"),
                               ("StageSplit.pp", split.pp, "pp")):
        if value != 1:
            raise SizeError(f"FSDP2 storage is planned over a dp (× tp) mesh; got "
                            f"{{{field}}} {value}. Plan --storage fsdp2 with {flag} 1 (FSDP2 "
                            "with EP or pipeline stages is not supported yet).",
                            fields=(field,))
    if spec.config is not None:
        validate_sizes(spec.config, sizes)
    hw = load_hardware(t.hardware)
    say("FSDP2 owners and rounds")
    problem = make_fsdp2_problem(spec, sizes.dp, settings, hardware=hw,
                                 cmax_bytes=t.cmax_bytes, tp=sizes.tp)
    solution = solve_fsdp2(problem, "canzona")
    return build_fsdp2_plan(problem, solution, cost=o.cost if isinstance(o.cost, str) else
                            "flops", solver=SolverOptions(strategy="canzona", solver="greedy"),
                            model_source=model_source)


def _plan_stages(parts: tuple[ModelSpec, ...], split: StageSplit, sizes: ParallelSizes,
                 settings: OptimizerSettings, o: DPOptions, t: TPOptions, model_source: str,
                 dp_only: bool, progress: Callable[[str], None] | None) -> list[Plan]:
    """Each stage's plan, in stage order (:func:`plan` with stages)."""
    made = []
    for part in parts:
        s = part.stage.stage  # type: ignore[union-attr]
        tell = None if progress is None else \
            (lambda msg, s=s: progress(f"stage {s + 1}/{split.pp}: {msg}"))
        problem = make_problem(part, sizes, settings, cost=o.cost, bucket_size=o.bucket_size,
                               overlap_grad_reduce=o.overlap_grad_reduce,
                               comm_dtype=t.comm_dtype, hardware=t.hardware)
        made.append(plan_problem(problem, dp_options=o, tp_options=t,
                                 model_source=model_source, dp_only=dp_only, progress=tell))
    return made


def plan_problem(
    problem: DPProblem,
    *,
    dp_options: DPOptions | None = None,
    tp_options: TPOptions | None = None,
    model_source: str = "preset",
    dp_only: bool = False,
    progress: Callable[[str], None] | None = None,
    behind: Behind | None = None,
) -> Plan:
    """Plan a problem already built by ``make_problem``: the candidate plans of the share mode
    (``sharing.Candidates``: each solved and, for tp > 1, scheduled), the best kept by the
    objective (``Candidates.better``), assembled.

    When the loads are seconds (the ``roofline`` cost), the objective is ``step-time`` and the
    share mode is ``off`` or ``auto`` (:data:`JUDGED_SHARES`), the plan is then simulated
    beside the paper's greedy plan (:func:`greedy_options`) and, under ``auto``, beside the
    plan sharing none, behind one forward/backward (``behind``;
    default the plan's own, 6·N_active·tokens at the default MFU, what ``canzona plan``
    prints); the one with the shortest step is returned. The simulator has the last word, so
    canzona is never behind the paper's method on it, and sharing is kept only where the
    simulated step is shorter.

    ``dp_options``' layout fields (cost, bucket_size, overlap_grad_reduce) were ``make_problem``'s
    business and are not read here; ``tp_options.comm_dtype`` must be the problem's (the
    default options take it from the problem).
    """
    o = dp_options or DPOptions()
    t = tp_options or TPOptions(comm_dtype=problem.comm_dtype)
    if t.comm_dtype != problem.comm_dtype:
        raise ValueError(f"the problem was built with comm dtype {problem.comm_dtype!r}, "
                         f"tp_options.comm_dtype is {t.comm_dtype!r}")
    hw = load_hardware(t.hardware)
    best, unshared = _assemble(problem, o, t, hw, dp_only, progress)
    made = _plan_of(best, problem, o, hw, model_source)
    if problem.seconds_per_load is None or o.solver == "greedy" or \
            objective_name(o.objective) != "step-time" or (dp_only and problem.sizes.tp > 1) \
            or t.share not in JUDGED_SHARES:
        return made
    others = [("the paper's greedy plan", *greedy_options(o, t), None)]
    if t.share == "auto":  # nothing shared: what sharing is kept against (one of auto's
        # candidates, already solved, when it had one)
        others.append(("the plan sharing nothing", o, dataclasses.replace(t, share="off"),
                       unshared))
    if progress is not None:
        progress("the paper's greedy plan, simulated beside")
    with warnings.catch_warnings():  # their notes are the made plan's, already given
        warnings.simplefilter("ignore")
        judged = [ready or _assemble(problem, xo, xt, hw, dp_only, None)[0]
                  for _, xo, xt, ready in others]
        # only simulated: assembled unvalidated, and again as the plan file if one is kept
        plans = [made] + [made if c is best else
                          _plan_of(c, problem, xo, hw, model_source, validated=False)
                          for c, (_, xo, _, _) in zip(judged, others)]
    if behind is None:  # the plans' own forward/backward: one model, alike for all
        behind = (plan_forward_backward(made, hw)[0], False)
    steps = [_step(p, hw, behind) for p in plans]
    k = steps.index(min(steps))  # ties: the plan made
    if k == 0:
        return made
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # its solver status says why (its options are recorded as they were)
        kept = _plan_of(judged[k - 1], problem, others[k - 1][1], hw, model_source)
    status = f"{others[k - 1][0]}, kept: its simulated step is shorter"
    return kept.model_copy(update={"metrics": kept.metrics.model_copy(
        update={"solver_status": status})})


#: The share modes the simulator judges (``plan_problem``); the others (``all``, ``all-split``,
#: ``pairs``) force what they share, for tests and measurements, and are written as made.
JUDGED_SHARES = ("off", "auto")


def greedy_options(o: DPOptions, t: TPOptions) -> tuple[DPOptions, TPOptions]:
    """The paper's method as options: the DP greedy (α = 1, the busiest load) and the TP greedy,
    nothing shared (``canzona compare``'s ``canzona-greedy``)."""
    return (dataclasses.replace(o, solver="greedy", alpha=1.0, objective="max-load"),
            dataclasses.replace(t, solver="greedy", share="off"))


def _step(plan: Plan, hw: HardwareProfile, behind: Behind) -> float:
    """``plan``'s simulated step behind ``behind``."""
    fb, overlap = behind
    return simulate_plan_behind(plan, hw, forward_backward_s=fb,
                                overlap_param_gather=overlap).step_s


def _assemble(problem: DPProblem, o: DPOptions, t: TPOptions, hw: HardwareProfile,
              dp_only: bool, progress: Callable[[str], None] | None
              ) -> tuple[Candidate, Candidate | None]:
    """The best candidate of ``o`` and ``t``; and the first candidate that shares nothing (the
    plan ``share="off"`` makes; None when there is none)."""
    candidates = Candidates(problem, o, t, hw, schedule=problem.sizes.tp > 1 and not dp_only,
                            progress=progress, stacklevel=3)
    best = unshared = None
    for cand in candidates:
        if unshared is None and not cand.problem.shared and not cand.problem.pairs:
            unshared = cand
        if best is None or candidates.better(cand, best):
            best = cand
    assert best is not None
    candidates.check_kept(best, stacklevel=3)
    if best.schedule is not None and best.schedule.oversized:  # the note of the schedule kept
        warn_oversized(best.schedule.oversized, t, stacklevel=4)
    return best, unshared


def _plan_of(best: Candidate, problem: DPProblem, o: DPOptions, hw: HardwareProfile,
             model_source: str, *, validated: bool = True) -> Plan:
    """Candidate ``best`` of ``problem``'s candidates, assembled into a plan (``validated``
    False: one only simulated, ``build_plan``'s)."""
    tp_section = hosts = None
    if best.schedule is not None:
        tp_section, hosts = tp_plan(best.problem, best.schedule, best.ctx,
                                    validated=validated), placements(best.schedule)
    recorded = SolverOptions(strategy="canzona-greedy" if o.solver == "greedy" else "canzona",
                             solver=o.solver, alpha=o.alpha,
                             time_limit_s=o.time_limit_s if o.solver == "cpsat" else None,
                             seed=o.seed, workers=o.workers,
                             reorder=_order(best.problem) != _order(problem),
                             objective=objective_name(o.objective))
    sol = best.solution
    return build_plan(sol.problem, sol.cuts, solver=recorded, model_source=model_source,
                      certified_bound=sol.bound, status=sol.status, tp=tp_section,
                      placements=hosts, hardware=hw, validated=validated)


def _order(problem: DPProblem) -> list[tuple[int, ...]]:
    """Every bucket's parameters in order (as task ids): whether a plan reordered them."""
    out = []
    for b in problem.buckets:
        ids: list[int] = []
        for it in b.items:
            if not ids or ids[-1] != it.tasks[0]:  # a task's two pieces are one parameter
                ids.append(it.tasks[0])
        out.append(tuple(ids))
    return out
