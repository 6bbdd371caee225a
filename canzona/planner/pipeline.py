"""The planner's one entry: from a model source, sizes, optimizer settings, DP options and TP
options to a :class:`~canzona.planner.plan.Plan`.

::

    source ──inventory──► ModelSpec ──make_problem──► DPProblem (layout, tasks, costs, buckets)
        ──solve──► cut points (and the reordered problem) ──tp.schedule_tp──► TP schedule
        ──planning.build_plan──► Plan (assembled once, TP section included)

The CLI (``canzona plan``), ``canzona.plan_model``, ``plans/regenerate.py`` and the benchmarks
all plan through :func:`plan` (or :func:`plan_problem`, given a problem already built).
"""

from __future__ import annotations

import dataclasses
import warnings

from collections.abc import Callable
from pathlib import Path

from .cost import OptimizerSettings
from .solve import solve
from .bundles import bundle_candidates
from .solve import Solution, modelled_step, state_target
from .formulas import LOCKSTEP_CMAX
from .errors import CanzonaError, CanzonaWarning, SizeError
from .hardware import HardwareProfile, load_hardware
from .inventory import ModelSpec, build_inventory
from .layout import ParallelSizes
from .models import PRESETS, ModelConfig, get_preset, load_hf_config
from .objective import StepTime
from .options import DPOptions, TPOptions
from .plan import Plan, SolverOptions
from .planning import (DPProblem, build_plan, evaluate, make_problem, pair_owners, pieces_apart,
                       with_pairs)
from .sharing import pair_decision, pair_waits, pairs_in_nodes, priced_for
from .tp import TPContext, placements, schedule_tp, tp_plan
from .tp.schedule import warn_oversized

#: A model source: a preset name, a Hugging Face ``config.json`` path, a config, or an inventory
#: (e.g. ``canzona.runtime.introspect.inventory`` of a live module).
Source = str | Path | ModelConfig | ModelSpec

__all__ = ["Source", "inventory_of", "plan", "plan_problem"]


def inventory_of(source: Source, names: str = "megatron") -> tuple[ModelSpec, str]:
    """The inventory of ``source`` and the plan's ``model_source`` for it (``names``: the
    parameter names of a config's inventory, ``megatron`` or ``hf``; an inventory keeps its own)."""
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
) -> Plan:
    """Plan ``source`` at ``sizes``: the DP partition and, for tp > 1, the TP micro-groups.

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
        names: a config's parameter names: ``megatron`` (Megatron-core's) or ``hf`` (the live
            ``transformers`` model's, so the plan fits it; tp = 1).

    Raises:
        CanzonaError: bad input (unknown model, sizes the model does not allow, an option out of
            range), before any solving.
    """
    say = progress or (lambda _msg: None)
    o = dp_options or DPOptions()
    t = tp_options or TPOptions()
    settings = OptimizerSettings(name=optimizer) if isinstance(optimizer, str) else optimizer  # type: ignore[arg-type]
    say("model inventory and ZeRO-1 layout")
    if names == "hf" and (sizes.tp > 1 or sizes.ep > 1):
        raise SizeError(f"parameter names 'hf' describe a plain transformers model at tp 1 and "
                        f"ep 1; got {{ParallelSizes.tp}} {sizes.tp}, {{ParallelSizes.ep}} "
                        f"{sizes.ep}. Megatron-core's names ('megatron') carry the tensor- and "
                        "expert-parallel layout.", fields=("ParallelSizes.tp", "ParallelSizes.ep"))
    spec, model_source = inventory_of(source, names)
    problem = make_problem(spec, sizes, settings, cost=o.cost, bucket_size=o.bucket_size,
                           overlap_grad_reduce=o.overlap_grad_reduce, comm_dtype=t.comm_dtype)
    return plan_problem(problem, dp_options=o, tp_options=t, model_source=model_source,
                        dp_only=dp_only, progress=progress)


def plan_problem(
    problem: DPProblem,
    *,
    dp_options: DPOptions | None = None,
    tp_options: TPOptions | None = None,
    model_source: str = "preset",
    dp_only: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan a problem already built by ``make_problem``.

    ``dp_options``' layout fields (cost, bucket_size, overlap_grad_reduce) were ``make_problem``'s
    business and are not read here; ``tp_options.comm_dtype`` must be the problem's (the
    default options take it from the problem).
    """
    say = progress or (lambda _msg: None)
    o = dp_options or DPOptions()
    t = tp_options or TPOptions(comm_dtype=problem.comm_dtype)
    if t.comm_dtype != problem.comm_dtype:
        raise ValueError(f"the problem was built with comm dtype {problem.comm_dtype!r}, "
                         f"tp_options.comm_dtype is {t.comm_dtype!r}")
    hw = load_hardware(t.hardware)
    if t.share == "pairs" and problem.sizes.tp == 1:
        raise CanzonaError("TPOptions.share = 'pairs' (--share pairs) shares a matrix over two "
                           "TP groups (tp > 1); at tp = 1 use 'all' or 'all-split' (DP pairs).")
    if t.share == "pairs" and not o.reorder:
        raise CanzonaError("TPOptions.share = 'pairs' (--share pairs) lays a shared matrix out "
                           "between its two DP indices by reordering each bucket's parameters; "
                           "it needs DPOptions.reorder (drop --no-reorder), or use 'all-split'.")
    shares: list[dict] = []
    if t.share != "off" and problem.sizes.tp > 1 and not problem.shared:
        from .tp.schedule import share_decision

        say("sharing decision")
        # auto: the bound's choice (the tasks above the mean), and every eligible task with
        # the polynomial split; the plan keeps whichever gives the lighter busiest GPU
        for mode in ("auto", "all-split") if t.share == "auto" else (t.share,):
            cand = share_decision(problem, t.hardware, "all-split" if mode == "pairs" else mode)
            if cand not in shares:
                shares.append(cand)
        if t.share == "auto" and problem.settings.name == "shampoo" and shares[0]:
            # Shampoo's shard blocks save compute only: against none, the modelled step decides
            shares.append({})
        if problem.settings.name not in ("shampoo",) and not any(shares):
            name = problem.settings.name
            why = ("no TP-split matrix here is split along its long dimension (its TP shards "
                   "would be its row blocks)" if name == "muon" else
                   f"sharing applies to Muon's Newton–Schulz and Shampoo's blocks; {name}'s "
                   f"updates stay whole")
            warnings.warn(f"TPOptions.share = {t.share!r}: no matrix is shared over its TP "
                          f"group: {why}.", CanzonaWarning, stacklevel=2)
        if problem.settings.name == "shampoo" and not shares[0]:
            warnings.warn(f"TPOptions.share = {t.share!r}: no Shampoo matrix here has TP shards "
                          f"that are whole blocks of max_preconditioner_dim = "
                          f"{problem.settings.max_preconditioner_dim}, so every one is hosted "
                          f"whole (a block size dividing the shards' segments allows it).",
                          CanzonaWarning, stacklevel=2)
        problem = dataclasses.replace(problem, shared=shares[0])
    if problem.shared:  # the DP side batches the lockstep as the schedule will
        problem = dataclasses.replace(problem, lockstep_cap=LOCKSTEP_CMAX * t.cmax_bytes)
    pairs: list[dict] = []
    if t.share != "off" and problem.sizes.tp == 1 and not problem.pairs:
        say("sharing decision (DP pairs)")
        # auto: the bound's choice, and every eligible task with and without the split; the
        # partition keeps whichever lowers the busiest DP index most (or none).
        modes = ("auto", "all", "all-split") if t.share == "auto" else (t.share,)
        for mode in modes:
            cand = pair_decision(problem, hw, mode)
            if cand and cand not in pairs:
                pairs.append(cand)
        if not pairs:
            warnings.warn(f"TPOptions.share = {t.share!r}: no matrix is worth splitting over DP "
                          f"pairs here (a whole matrix of a dense buffer, Muon or Shampoo with "
                          f"two block rows or more, dp ≥ 2).", CanzonaWarning, stacklevel=2)
    say("DP partition")
    if pairs:
        sol = _solve_pairs(problem, pairs, o, progress, hw, keep=t.share != "auto",
                           scratch_cap=LOCKSTEP_CMAX * t.cmax_bytes)
    else:
        sol = solve(problem, o, progress=progress, hardware=hw)
    tp_section = hosts = None
    if problem.sizes.tp > 1 and not dp_only:
        say("tp micro-groups")
        ctx = TPContext.build(sol.problem, t.comm_dtype)
        schedule = schedule_tp(sol.problem, sol.cuts, t, ctx=ctx, warn=False)
        for shared in shares[1:]:  # share="auto": the other candidate sets of shared tasks
            say("DP partition (other shared tasks)")
            other = solve(dataclasses.replace(problem, shared=shared, lockstep_cap=(
                LOCKSTEP_CMAX * t.cmax_bytes if shared else 0)), o, progress=progress,
                hardware=hw)
            octx = TPContext.build(other.problem, t.comm_dtype)
            osched = schedule_tp(other.problem, other.cuts, t, ctx=octx, warn=False)
            if not shared and _objective_name(o.objective) == "step-time":
                # sharing against none: by the modelled step (the busiest GPU and the bucket
                # collectives), as the partition itself is judged
                better = modelled_step(other.problem, other.cuts, hw) < \
                    modelled_step(sol.problem, sol.cuts, hw)
            else:
                better = max(map(max, osched.grid())) < max(map(max, schedule.grid()))
            if better:
                sol, ctx, schedule = other, octx, osched
        if t.share in ("auto", "pairs") and o.reorder and problem.settings.name == "muon":
            # fc1/QKV shared by two TP groups (k = 2·tp) on partner indices, laid out by
            # reordering: kept where the busiest GPU gets lighter and (step-time) the modelled
            # step no longer ("pairs": always, if any)
            say("tp pairs")
            step = _objective_name(o.objective) == "step-time"
            for shared in shares if t.share == "auto" else shares[:1]:
                start = dataclasses.replace(problem, shared=shared,
                                            lockstep_cap=LOCKSTEP_CMAX * t.cmax_bytes)
                for used, cuts in tp_pair_candidates(start, t, hw, force=t.share == "pairs"):
                    uctx = TPContext.build(used, t.comm_dtype)
                    usched = schedule_tp(used, cuts, t, ctx=uctx, warn=False)
                    if t.share == "pairs":
                        better = not sol.problem.pairs
                    else:  # a lighter busiest GPU, and under step-time no longer a step
                        better = max(map(max, usched.grid())) < max(map(max, schedule.grid()))
                        if better and step:
                            better = modelled_step(used, cuts, hw) <= \
                                modelled_step(sol.problem, sol.cuts, hw)
                    if better:
                        sol = Solution(cuts, "heuristic", used.lower_bound(), used)
                        ctx, schedule = uctx, usched
            if t.share == "pairs" and not sol.problem.pairs:
                warnings.warn("TPOptions.share = 'pairs': no matrix is shared by two TP groups "
                              "here (a tall Muon matrix split along its rows, dp ≥ 2, two rows "
                              "of every shard or more); every eligible one is shared by its TP "
                              "group (as 'all-split').", CanzonaWarning, stacklevel=2)
        if schedule.oversized:  # the note of the schedule kept
            warn_oversized(schedule.oversized, t, stacklevel=3)
        tp_section, hosts = tp_plan(sol.problem, schedule, ctx), placements(schedule)
    recorded = SolverOptions(strategy="canzona-greedy" if o.solver == "greedy" else "canzona",
                             solver=o.solver, alpha=o.alpha,
                             time_limit_s=o.time_limit_s if o.solver == "cpsat" else None,
                             seed=o.seed, workers=o.workers, reorder=_order(sol.problem) != _order(problem),
                             objective=_objective_name(o.objective))
    return build_plan(sol.problem, sol.cuts, solver=recorded, model_source=model_source,
                      certified_bound=sol.bound, status=sol.status, tp=tp_section,
                      placements=hosts, hardware=hw)


def _solve_pairs(problem: DPProblem, candidates: list[dict], o: DPOptions,
                 progress: Callable[[str], None] | None, hw: HardwareProfile, *,
                 keep: bool = False, scratch_cap: int = 0) -> Solution:
    """The DP partition with DP pairs: the plan without them first (parameters reordered as
    usual), then for each candidate set of split tasks, each cut into its two pieces and the
    partition solved again (every stage, the collectives' and the optimizer state's included) in
    that plan's bucket order and in Megatron's, so that a bucket cut may fall between a task's
    pieces; and, where parameters may be reordered, the candidates as bundles of fixed
    partners (``bundles.bundle_candidates``: both starts of its search; a pair's lockstep within
    ``scratch_cap`` bytes). A
    result is kept if it lowers the score most: the busiest DP index (its load counts every
    piece's compute and exchanges and the waits between partners), plus under the
    ``step-time`` objective the bucket collectives and the optimizer state above its target
    (``StepTime``'s terms, converted at the problem's rate: under the ``flops`` cost model a
    piece's load and a second are converted alike; other cost models convert a piece at its
    task's load per FLOP); or with
    ``keep`` (``share="all"``: the pieces moved apart wherever a cut can move,
    ``planning.pieces_apart``; the first result with pieces apart, or a better one); a task
    whose pieces stay on one DP index is whole again."""
    say = progress or (lambda _msg: None)
    sol = solve(problem, o, progress=progress, hardware=hw)
    say("DP pairs")
    terms = StepTime(problem, hw, state_cap=state_target(problem)) \
        if _objective_name(o.objective) == "step-time" else None

    def score(used: DPProblem, cuts: dict) -> float:
        load = max(pair_waits(used, cuts))  # the busiest index, waits between partners too
        if terms is None:
            return load
        return load + terms.bucket_terms(used, cuts) + terms.state_term(
            max(evaluate(used, cuts).state_bytes))

    best, best_score = sol, score(sol.problem, sol.cuts)

    def consider(used: DPProblem, cuts: dict) -> None:
        nonlocal best, best_score
        got = score(used, cuts)
        if used.pairs and (got < best_score or keep and best is sol):
            best, best_score = Solution(cuts, "heuristic", used.lower_bound(), used), got

    whole = dataclasses.replace(o, reorder=False)
    for pairs in candidates:
        # the whole solve (its state and collective stages too) with the pieces, in the order
        # of the plan without pairs (reordered) and in Megatron's
        for base in (sol.problem,) if sol.problem is problem else (sol.problem, problem):
            cuts = solve(with_pairs(base, pairs), whole, hardware=hw).cuts
            if keep:  # "all": the pieces apart wherever a cut can move between them
                cuts = pieces_apart(with_pairs(base, pairs), cuts)
            cuts = pairs_in_nodes(base, pairs, cuts, hw)  # fewer pairs across two nodes
            owners = pair_owners(with_pairs(base, pairs), cuts)
            # both pieces on one DP index: the task is whole again; pairs across two nodes
            # exchange over the network
            consider(with_pairs(base, priced_for(base, {i: x for i, x in pairs.items()
                                                        if owners[i][0] != owners[i][1]},
                                                 owners, hw)), cuts)
    if o.reorder:
        say("DP pairs (bundles)")
        for pairs in candidates:  # both starts of the search, judged by the objective
            for _, got in bundle_candidates(problem, pairs, hw, scratch_cap=scratch_cap):
                if got is not None:
                    consider(*got)
    return best


def tp_pair_candidates(problem: DPProblem, t: TPOptions, hw: HardwareProfile, *,
                       force: bool = False) -> list[tuple[DPProblem, dict]]:
    """tp > 1, Muon, ``problem.shared`` set: placements with the tall column-parallel matrices
    shared by two TP groups (k = 2·tp) on fixed partner indices, for each candidate set of
    pairs (``sharing.tp_pair_decision``: the bound's choice, and every eligible one with the
    polynomial split; with ``force``, every eligible one, each shared), laid out by
    ``bundles.tp_bundle_candidate``: (the problem with the pairs it uses, its cuts) each; empty
    where none applies or shares anything."""
    from .bundles import tp_bundle_candidate
    from .sharing import tp_pair_decision

    if problem.settings.name != "muon" or problem.sizes.tp == 1 or not problem.shared:
        return []
    out = []
    seen: list[dict] = []
    for mode in ("all-split",) if force else ("auto", "all-split"):
        pairs = tp_pair_decision(problem, hw, mode)
        if not pairs or pairs in seen:
            continue
        seen.append(pairs)
        _, got = tp_bundle_candidate(problem, pairs, hw,
                                     scratch_cap=LOCKSTEP_CMAX * t.cmax_bytes, force=force)
        if got is not None:
            used, cuts = got
            # a paired task is its two TP groups' only: not also its first index's alone
            shared = {i: x for i, x in used.shared.items() if i not in used.pairs}
            out.append((dataclasses.replace(used, shared=shared), cuts))
    return out


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


def _objective_name(objective: object) -> str:
    """The name a plan records for ``DPOptions.objective``."""
    if isinstance(objective, str):
        return objective
    return getattr(objective, "name", "max-load") if objective is not None else "max-load"
