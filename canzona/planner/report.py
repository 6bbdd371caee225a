"""Reports on models, layouts and plans as plain data (what ``canzona ... --json`` prints).

Front ends render these dicts; nothing here prints. The main entry is :func:`inspect_report`: a
saved plan's problem rebuilt from its inputs (fingerprint checked:
:func:`canzona.planner.plan.inverse.read_problem`), its per-DP-index metrics, heaviest tasks, DP
baselines and, for tp > 1, the TP schedule and its baselines.

Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .comm import CommSummary
from .errors import CanzonaError
from .fsdp2 import FSDP2_STRATEGIES, make_fsdp2_problem, solve_fsdp2
from .hardware import DEFAULT_HARDWARE, HardwareProfile, hardware_names, load_hardware
from .inventory import ModelSpec, build_inventory, layer_index
from .layout import ParallelSizes, PhysicalLayout, build_layout
from .models import PRESETS, ModelConfig
from .plan.comm_section import plan_summary
from .plan.inverse import read_problem, rebuild_model
from .simulate import (plan_forward_backward, plan_hardware, simulate_pipeline,
                       simulate_plan_behind)
from .strategies import baseline_rows, tp_baseline_rows
from .tp.context import gpu_packing_bound
from .sharing import (kind_of, pair_link, pair_timeline, pattern_bound, profile_rate,
                      shared_piece, sharing_bound)
from .sharing.patterns import PATTERN_LIMIT

if TYPE_CHECKING:
    from .baselines import BaselineRow
    from .plan import FSDP2Plan, MicroGroupPlan, PipelinePlan, Plan
    from .tp.baselines import TPBaselineRow
    from .tp.context import Run

__all__ = ["busiest_index", "comm_dict", "fsdp2_dict", "inspect_dict", "inspect_report",
           "layout_dict", "layout_of", "max_mean", "model_rows", "oversized_groups",
           "peak_within_cmax", "predicted_step", "stages_dict", "task_name", "tp_dict"]


# --- small metrics shared by the reports and their renderers ---------------------------------


def max_mean(values: Sequence[int]) -> tuple[int, float]:
    """The largest value and the mean."""
    return max(values), sum(values) / len(values)


def task_name(param: str, part: str | None) -> str:
    """A task's name: its parameter, with ``#part`` for a split matrix's part (``qkv#q``)."""
    return f"{param}#{part}" if part else param


def busiest_index(grid: Sequence[Sequence[int]]) -> int:
    """The DP index whose TP group holds the busiest GPU (lowest index on ties)."""
    return max(range(len(grid)), key=lambda d: (max(grid[d]), -d))


def oversized_groups(plan: Plan) -> list[MicroGroupPlan]:
    """The plan's micro-groups holding a single matrix larger than C_max (tp > 1 plans)."""
    groups = (g for ix in plan.tp.indices for g in ix.groups)  # type: ignore[union-attr]
    return [g for g in groups if g.oversized]


def useful_mean(plan: Plan) -> float:
    """The mean useful work per GPU of a TP plan: every task's single-device cost once (a shared
    task's whole cost, not its pieces and collectives), AdamW shards and replicated matrices as
    the per-GPU grid counts them."""
    assert plan.tp is not None
    m, tp = plan.tp.metrics, plan.inputs.tp
    total = float(sum(sum(r) for r in m.gpu_load))
    for ix in plan.tp.indices:  # a half shared with a partner index: half the task's cost
        total += sum(plan.tasks[x.id].cost / (1 if x.partner is None else 2)
                     for x in ix.shared) - tp * ix.shared_load
    return total / (plan.inputs.dp * tp)


def pairs_dict(plan: Plan) -> dict | None:
    """The matrices DP pairs share (``plan.dp_shared``; None when none), as the plan records
    them: how many, of which kinds, how many with the polynomial split, the phases, the pairs of
    adjacent DP indices and of indices on two nodes (``comm.gpus_per_node``), and the busiest DP
    index against the mean useful work (every task's single-device cost once, not its pieces and
    collectives): ``max_over_useful_mean`` with every piece's exchanges in its load
    (``metrics.dp_load``), ``run_max_over_useful_mean`` as the runtime runs the pairs
    (:func:`_pair_runs` on the plan's hardware profile, the default one where that profile is no
    longer there; Shampoo's blocks: the same as the first)."""
    if not plan.dp_shared or plan.inputs.tp > 1:  # at tp > 1: the TP section's (tp_summary)
        return None
    try:
        hw = load_hardware(plan.comm.hardware)
    except CanzonaError:
        hw = load_hardware(DEFAULT_HARDWARE)
    m = plan.metrics
    node = plan.comm.gpus_per_node  # at tp = 1 a DP index is its global rank
    total = sum(m.dp_load) + sum(plan.tasks[x.id].cost - sum(x.loads) for x in plan.dp_shared)
    mean = total / plan.inputs.dp
    kinds: dict[str, int] = {}
    for x in plan.dp_shared:
        k = kind_of(plan.tasks[x.id].param)
        kinds[k] = kinds.get(k, 0) + 1
    return {"optimizer": plan.inputs.optimizer.name, "tasks": len(plan.dp_shared),
            "split_poly": sum(x.split_poly for x in plan.dp_shared),
            "phases": 1 + max(x.phase for x in plan.dp_shared),
            "adjacent": sum(x.owners[1] == x.owners[0] + 1 for x in plan.dp_shared),
            "across_nodes": sum(x.owners[0] // node != x.owners[1] // node
                                for x in plan.dp_shared),
            "kinds": dict(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
            "useful_mean_load": mean, "max_load": max(m.dp_load),
            "max_over_useful_mean": round(max(m.dp_load) / mean, 6) if mean else 1.0,
            "run_max_over_useful_mean": round(max(_pair_runs(plan, hw)) / mean, 6)
            if mean else 1.0}


def _pair_runs(plan: Plan, hw: HardwareProfile) -> list[float]:
    """Per DP index of a plan with DP pairs, its load as the runtime meets it (the simulator's
    model, ``sharing.pair_waits``): the pairs first, phase by phase, each pair's matrices in
    lockstep (one's exchanges beside the others' compute), a pair starting when both partners
    are free; then the rest of the index's load.

    Each piece's load and modelled seconds are the plan's (``dp_shared``); the plan does not
    record how many of those seconds are exchanges and how many of them the piece's own Gram
    products hide, so those come from ``sharing.shared_piece`` on ``hw``."""
    load = [float(x) for x in plan.metrics.dp_load]
    if not plan.inputs.optimizer.spec.gram_shared:
        return load
    runs: dict[tuple[int, tuple[int, int]], list[Run]] = {}
    steps = plan.inputs.optimizer.ns_steps
    for x in plan.dp_shared:
        rows, cols = plan.tasks[x.id].shape
        o = shared_piece("dp", 2, x.split_poly, max(rows, cols), min(rows, cols), steps, 2,
                         pair_link(hw, tuple(x.owners)), rate=profile_rate(hw),
                         exchange=rows < cols)
        per = x.loads[0] / x.modelled_s if x.modelled_s else 0.0  # load units per second
        exposed = min(o.comm_s - o.hidden_s, x.modelled_s) * per
        runs.setdefault((x.phase, tuple(x.owners)), []).append(
            (x.loads[0] - exposed, o.comm_s * per, o.hidden_s * per))
        for d, piece in zip(x.owners, x.loads):
            load[d] -= piece
    return [a + f for a, f in zip(load, pair_timeline(runs, steps, plan.inputs.dp))]


def peak_within_cmax(plan: Plan) -> int:
    """The peak gathered bytes per host rank over the groups that are not oversized (≤ C_max)."""
    return max((g.peak_gathered_bytes for ix in plan.tp.indices  # type: ignore[union-attr]
                for g in ix.groups if not g.oversized), default=0)


# --- canzona models / canzona layout -----------------------------------------------------------


def model_rows() -> list[dict]:
    """One row per built-in model (``canzona models``): parameters, layers, widths, experts."""
    rows = []
    for name, cfg in PRESETS.items():
        spec = build_inventory(cfg)
        rows.append({"name": name, "params": spec.total_params, "layers": cfg.layers,
                     "hidden": cfg.hidden, "ffn": cfg.ffn or cfg.moe_ffn, "q_heads": cfg.q_heads,
                     "kv_heads": cfg.kv_heads, "experts": cfg.num_experts,
                     "experts_per_token": cfg.experts_per_token, "vocab": cfg.vocab,
                     "tied_embeddings": cfg.tied_embeddings})
    return rows


def layout_of(cfg: ModelConfig, sizes: ParallelSizes, *, bucket_size: int | None = None,
              overlap_grad_reduce: bool = True,
              progress: Callable[[str], None] | None = None) -> tuple[ModelSpec, PhysicalLayout]:
    """The inventory of ``cfg`` and Megatron's ZeRO-1 layout of it at ``sizes``.

    Args:
        cfg: the model.
        sizes: dp, tp, ep.
        bucket_size: elements per bucket (None: Megatron's default).
        overlap_grad_reduce: False gives one bucket per buffer.
        progress: told the name of each stage as it starts.
    """
    say = progress or (lambda _phase: None)
    say("model inventory")
    spec = build_inventory(cfg)
    say("buffers and buckets")
    return spec, build_layout(spec, sizes, bucket_size=bucket_size,
                              overlap_grad_reduce=overlap_grad_reduce)


def layout_dict(spec: ModelSpec, lay: PhysicalLayout) -> dict:
    """Buffers, buckets and the matrices ZeRO-1's equal chunks split (``canzona layout --json``)."""
    split = lay.split_matrices()
    return {
        "model": spec.name,
        "dp": lay.sizes.dp, "tp": lay.sizes.tp, "ep": lay.sizes.ep,
        "bucket_size": lay.bucket_size,
        "matrices": lay.matrix_count(),
        "split_matrices": len(split),
        "buffers": [
            {"key": b.key, "dp_size": b.dp_size, "numel": b.numel,
             "buckets": [{"index": k.index, "start": k.start, "end": k.end,
                          "numel_unpadded": k.numel_unpadded, "params": len(k.slots),
                          "split_matrices": sum(1 for s in k.slots if s.name in dict(split))}
                         for k in b.buckets]}
            for b in lay.buffers
        ],
        "split": [{"name": n, "ranks": r} for n, r in split],
    }


# --- canzona inspect ---------------------------------------------------------------------------


def inspect_report(plan: Plan, *, config: Path | None = None, top: int = 10,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Everything ``canzona inspect`` shows, as plain data (``canzona inspect --json``).

    Args:
        plan: a loaded plan.
        config: the Hugging Face ``config.json`` the plan was made from (``hf_config`` plans).
        top: how many of the heaviest tasks to list.
        progress: told the name of each stage as it starts.

    Returns:
        :func:`inspect_dict`'s report (with the collectives, :func:`comm_dict`, under ``comm``),
        with the TP part (:func:`tp_dict`, None for tp = 1) under ``tp_schedule`` and the
        per-GPU atomic bound beside the bound with Muon tasks shared
        (:func:`canzona.planner.sharing.sharing_bound`) under ``sharing``, and there, at
        tp > 1, the floor of the layout-free pattern model with any sharing option
        (:func:`canzona.planner.sharing.pattern_bound`) under ``pattern``. Baselines and
        the sharing bound are None where the problem cannot be rebuilt.

    Raises:
        CanzonaError: see :func:`canzona.planner.plan.inverse.rebuild_model`.
    """
    say = progress or (lambda _phase: None)
    say("rebuilding the model's problem")
    inverse = read_problem(plan, model=True, config=config)
    problem = inverse.problem
    say("baselines")
    rows = baseline_rows(problem, plan) if problem is not None else None
    report = inspect_dict(plan, rows, top=top)
    tp_rows = None
    if plan.tp is not None and inverse.in_plan_order is not None:

        say("TP baselines")
        # The plan's own schedule is the "canzona" row, from its recorded metrics.
        tp_rows = tp_baseline_rows(inverse.in_plan_order, inverse.cuts, plan=plan)
    report["tp_schedule"] = tp_dict(plan, tp_rows)
    report["dp_pairs"] = pairs_dict(plan)
    report["sharing"] = None
    recorded = plan.comm.hardware.lower() in hardware_names()  # else a profile file's name
    if problem is not None and recorded:
        say("sharing bound")
        report["sharing"] = sharing_bound(problem, hardware=plan.comm.hardware).to_dict()
        report["sharing"]["pattern"] = None
        if plan.tp is not None:
            say("pattern bound (CP-SAT)")
            got = pattern_bound(problem, load_hardware(plan.comm.hardware),
                                plan.tp.metrics.max_gpu_load)
            if got is not None:
                report["sharing"]["pattern"] = {**got.to_dict(),
                                                "plan": plan.tp.metrics.max_gpu_load,
                                                "cost_model": plan.inputs.cost_model}
            elif plan.inputs.optimizer.spec.gram_shared:
                report["sharing"]["pattern"] = {
                    "unavailable": f"no matrix may be shared, or more than "
                                   f"{PATTERN_LIMIT:,} patterns of pieces fit under this plan's "
                                   f"busiest GPU"}
    say("the predicted step")
    report["predicted"] = predicted_step(plan)
    return report


def inspect_dict(plan: Plan, rows: list[BaselineRow] | None, *, top: int = 10) -> dict:
    """The DP part of :func:`inspect_report`: inputs, metrics, per-DP-index rows (compute, state,
    bytes sent and predicted collective seconds), heaviest tasks, the collectives
    (:func:`comm_dict`) and the baselines ``rows`` (None: not available)."""
    inp, m = plan.inputs, plan.metrics
    summary = plan_summary(plan)
    sent, secs = summary.index_sent, summary.index_seconds
    owned = [0] * inp.dp
    split = {x.id: x for x in plan.dp_shared}
    for t in plan.tasks:
        if t.id in split:  # a piece on each of its two DP indices
            for d in split[t.id].owners:
                owned[d] += 1
        elif t.owner is not None:
            owned[t.owner] += 1
    mx, mean = max_mean(m.dp_load)
    heavy = sorted(plan.tasks, key=lambda t: (-t.cost, t.id))[:top]
    return {
        "model": inp.model, "model_source": inp.model_source,
        "dp": inp.dp, "tp": inp.tp, "ep": inp.ep,
        "optimizer": inp.optimizer.name, "cost_model": inp.cost_model,
        "strategy": inp.solver.strategy, "solver": inp.solver.solver, "alpha": inp.solver.alpha,
        "bucket_size": inp.bucket_size, "fingerprint": plan.fingerprint,
        "metrics": {
            "max_load": mx, "mean_load": mean, "max_over_mean": m.max_over_mean,
            "lower_bound": m.lower_bound, "certified_bound": m.certified_bound,
            "gap_to_lower_bound": round(mx / m.lower_bound - 1, 6) if m.lower_bound else 0.0,
            "gap_to_bound": m.gap_to_bound, "split_matrices": m.split_matrices,
            "solver_status": m.solver_status,
        },
        "ranks": [
            {"dp_index": d, "load": m.dp_load[d], "flops": m.dp_flops[d],
             "state_bytes": m.dp_state_bytes[d],
             "reduce_scatter_bytes": m.dp_reduce_scatter_bytes[d], "matrices": owned[d],
             "sent_bytes": sent[d], "collective_s": round(secs[d], 9)}
            for d in range(inp.dp)
        ],
        "comm": comm_dict(plan, summary),
        "heaviest_tasks": [
            {"id": t.id, "name": task_name(t.param, t.part), "shape": list(t.shape),
             "optimizer": t.optimizer, "owner": t.owner, "cost": t.cost, "flops": t.flops,
             "state_bytes": t.state_bytes}
            for t in heavy
        ],
        "baselines": None if rows is None else [
            {"name": r.name, "max_load": r.max_load, "mean_load": r.mean_load,
             "max_over_mean": round(r.max_over_mean, 6), "gap_to_bound": round(r.gap_to_bound, 6),
             "split_matrices": r.split_matrices, "grad_sync": r.grad_sync,
             "max_sent_bytes": r.max_sent_bytes,
             "collective_s": None if r.collective_s is None else round(r.collective_s, 9),
             "padding": None if r.padding is None else round(r.padding, 6)}
            for r in rows
        ],
    }


def comm_dict(plan: Plan, summary: CommSummary) -> dict:
    """The plan's collectives: its ``comm`` section with the ratios to ZeRO-1, every bucket (plan
    order) and the totals, as :func:`canzona.planner.comm.summarise` computes them under the
    plan's methods and recorded link (``summary``:
    :func:`canzona.planner.plan.comm_section.plan_summary`).

    Per bucket: the FLOPs of the matrices it holds (all, and the busiest DP index's share), its
    method, slices (min, max, max over the even slice), calls, the most bytes a
    rank sends (reduce + gather), the busiest rank's bytes of the α–β time (the larger of sent
    and received, per collective, summed), and the predicted seconds, each against ZeRO-1's even
    collectives of the same bucket."""
    c = plan.comm
    # Matrix FLOPs per bucket and owning DP index (a task names its parameter, which lies in one
    # bucket; an expert parameter's name is its own expert's).
    where = {s.name: (bi, k) for bi, buf in enumerate(plan.buffers)
             for k, b in enumerate(buf.buckets) for s in b.slots}
    flops: dict[tuple[int, int], dict[int, int]] = {}
    split = {x.id: x for x in plan.dp_shared}
    for t in plan.tasks:
        if t.owner is not None and t.param in where:
            per = flops.setdefault(where[t.param], {})
            x = split.get(t.id)  # a task split over two DP indices: each its piece's FLOPs
            for d, f in zip(x.owners, x.flops) if x else ((t.owner, t.flops),):
                per[d] = per.get(d, 0) + f
    buckets = []
    lines = iter(summary.lines)
    for bi, buf in enumerate(plan.buffers):
        for k, b in enumerate(buf.buckets):
            ln = next(lines)
            sizes = ln.slices.sizes
            even = sum(sizes) / len(sizes)
            per = flops.get((bi, k), {})
            buckets.append({
                "buffer": buf.key, "bucket": b.index, "numel": b.end - b.start,
                "matrix_flops": sum(per.values()), "max_rank_flops": max(per.values(), default=0),
                "method": ln.comm.method, "slice_min": min(sizes), "slice_max": max(sizes),
                "max_over_even": round(max(sizes) / even, 6) if even else 1.0,
                "calls": ln.comm.calls, "max_sent_bytes": max(ln.comm.sent),
                "busiest_bytes": ln.comm.reduce.busiest + ln.comm.gather.busiest,
                "seconds": round(ln.comm.seconds, 9),
                "zero1_max_sent_bytes": max(ln.zero1.sent),
                "zero1_seconds": round(ln.zero1.seconds, 9)})
    return {
        "hardware": c.hardware, "hardware_version": c.hardware_version,
        "gpus_per_node": c.gpus_per_node, "link": c.link, "busbw": c.busbw,
        "latency_s": c.latency_s, "predicted_s": c.predicted_s, "zero1_s": c.zero1_s,
        "time_ratio": round(c.predicted_s / c.zero1_s, 6) if c.zero1_s else 1.0,
        "max_sent_bytes": c.max_sent_bytes, "zero1_max_sent_bytes": c.zero1_max_sent_bytes,
        "bytes_ratio": (round(c.max_sent_bytes / c.zero1_max_sent_bytes, 6)
                        if c.zero1_max_sent_bytes else 1.0),
        "methods": dict(c.methods), "converted_from": c.converted_from,
        "totals": {"buckets": len(buckets), "predicted_s": round(summary.seconds, 9),
                   "zero1_s": round(summary.zero1_seconds, 9),
                   "max_sent_bytes": summary.max_sent,
                   "zero1_max_sent_bytes": summary.zero1_max_sent,
                   "calls": sum(ln.comm.calls for ln in summary.lines),
                   "zero1_calls": sum(ln.zero1.calls for ln in summary.lines)},
        "buckets": buckets,
    }


def gpu_packing_bound_of(plan: Plan) -> int | None:
    """A certified lower bound on the busiest GPU of a plan at tp > 1 that shares no matrix
    (``tp.context.gpu_packing_bound`` on its rebuilt problem): what no placement of its hosted
    matrices on the dp·tp GPUs can beat. None where it does not apply (tp = 1, shared matrices,
    whose pieces the bound would count whole) or the model is not rebuilt."""
    if plan.tp is None or plan.dp_shared or any(ix.shared for ix in plan.tp.indices):
        return None
    try:
        problem = read_problem(plan, model=True).problem
    except CanzonaError:
        return None
    if problem is None:
        return None
    return gpu_packing_bound(problem, plan.tp.metrics.max_gpu_load)


def tp_dict(plan: Plan, rows: list[TPBaselineRow] | None) -> dict | None:
    """The TP part of :func:`inspect_report` (``tp_schedule``; None for tp = 1): C_max, the
    per-GPU grid, every micro-group and the TP baselines ``rows`` (None: not available)."""
    if plan.tp is None:
        return None
    tp, m = plan.tp, plan.tp.metrics
    return {
        "cmax_bytes": tp.cmax_bytes, "comm_dtype": tp.comm_dtype, "solver": tp.solver,
        "status": tp.status, "hardware": tp.hardware,
        "metrics": {"max_gpu_load": m.max_gpu_load, "mean_gpu_load": m.mean_gpu_load,
                    "max_over_mean": m.max_over_mean, "lb_gpu": m.lb_gpu,
                    "gap_to_lb_gpu": m.gap_to_lb_gpu, "micro_groups": m.micro_groups,
                    "peak_gathered_bytes": m.peak_gathered_bytes,
                    "useful_mean_gpu_load": useful_mean(plan),
                    "max_over_useful_mean": round(m.max_gpu_load / useful_mean(plan), 6),
                    "shared_tasks": sum(len(ix.shared) for ix in tp.indices),
                    "peak_gathered_bytes_within_cmax": peak_within_cmax(plan),
                    "oversized_groups": len(oversized_groups(plan)),
                    "oversized_tasks": list(m.oversized_tasks),
                    "modelled_step_s": m.modelled_step_s},
        "gpu_load": [list(r) for r in m.gpu_load],
        "all_to_all_bytes": [list(r) for r in m.all_to_all_bytes],
        "groups": [
            {"dp_index": ix.dp_index, "group": g.index, "tasks": len(g.tasks),
             "peak_gathered_bytes": g.peak_gathered_bytes, "rank_load": list(g.rank_load),
             "oversized": g.oversized, "timeline_s": list(g.timeline_s)}
            for ix in tp.indices for g in ix.groups],
        "baselines": None if rows is None else [
            {"name": r.name, "max_gpu_load": r.max_gpu_load, "mean_gpu_load": r.mean_gpu_load,
             "max_over_mean": round(r.max_over_mean, 6), "gap_to_lb_gpu": round(r.gap_to_lb_gpu, 6)}
            for r in rows],
    }


#: What decides the step, by the largest part of the critical rank's step.
_DECIDES = {
    "compute": "the busiest GPU's compute: its balance (per GPU at tp > 1) decides the step",
    "tp_gather_scatter": "the TP gathers and scatters of the busiest TP group",
    "dp_reduce": "the DP reduce-scatters not hidden by backward: the bucket collectives decide "
                 "the step, the compute balance only its smaller part",
    "dp_gather": "the DP all-gathers: the bucket collectives decide the step, the compute "
                 "balance only its smaller part",
}


def predicted_step(plan: Plan, hw: HardwareProfile | None = None) -> dict | None:
    """The plan's optimizer step as ``canzona simulate`` and ``canzona compare`` predict it on
    ``hw`` (default: the profile the plan records), behind their forward/backward model: the
    whole step, the step from the gradients reduced on (the paper's accounting), the iteration,
    the critical rank's parts and which of them decides the step. None when ``hw`` is not given
    and the recorded profile is not built in (a profile file the plan names by its name only)."""
    if hw is None:
        try:
            hw = plan_hardware(plan)
        except CanzonaError:
            return None
    fb, how = plan_forward_backward(plan, hw)
    sim = simulate_plan_behind(plan, hw, forward_backward_s=fb)
    parts = sim.breakdown()
    top = max(parts, key=lambda k: parts[k])
    return {"hardware": f"{hw.name} v{hw.version}", "step_s": sim.step_s,
            "reduced_step_s": sim.reduced_step_s, "iteration_s": fb + sim.step_s,
            "forward_backward_s": fb, "forward_backward": how, "parts_s": parts,
            "decided_by": top, "decides": _DECIDES[top]}


def stages_dict(plan: PipelinePlan, hw: HardwareProfile | None = None, *,
                microbatches: int | None = None, overlap_param_gather: bool = False,
                forward_backward_s: Sequence[float] | None = None) -> dict:
    """A pipeline's stages side by side (``canzona plan --pp``, ``inspect`` and ``simulate`` of
    a pipeline's plan): per stage its layers, parameters, balance (per DP index and, under TP,
    per GPU), optimizer state, the AdamW state of the embedding or output layer it holds, and
    its optimizer step in one simulated 1F1B iteration
    (:func:`~canzona.planner.simulate.simulate_pipeline`, on ``hw``, default the profile the
    stages record); the critical stage, and the step as the slowest stage's."""
    hw = hw or plan_hardware(plan.stages[0])
    sim = simulate_pipeline(plan, hw, microbatches=microbatches,
                            overlap_param_gather=overlap_param_gather,
                            forward_backward_s=forward_backward_s)
    simd = sim.to_dict()
    rows = []
    for s, p in enumerate(plan.stages):
        st, m = p.inputs.stage, p.metrics
        assert st is not None
        mx, mean = max_mean(m.dp_load)
        smx, smean = max_mean(m.dp_state_bytes)
        ends = [t for t in p.tasks  # the embedding or output layer: 2-D, outside the layers
                if t.optimizer == "adamw" and len(t.shape) == 2 and layer_index(t.param) is None]
        row = {"stage": s, "first_layer": st.first_layer, "layers": st.layers,
               "params": p.total_params,
               "matrices": sum(1 for t in p.tasks if t.optimizer == "matrix"),
               "tied_copy": st.tied_copy,
               "dp_load_max_over_mean": round(mx / mean, 6) if mean else 1.0,
               "gpu_load_max_over_mean": (p.tp.metrics.max_over_mean if p.tp is not None
                                          else None),
               "state_bytes_max": smx, "state_bytes_mean": smean,
               "end_layers": [t.param for t in ends],
               "end_layers_state_bytes": sum(t.state_bytes for t in ends),
               "gap_to_bound": m.gap_to_bound}
        row.update({k: v for k, v in simd["stages"][s].items() if k != "stage"})
        rows.append(row)
    middle = [r["state_bytes_max"] for r in rows if not r["end_layers"]]
    ref = sum(middle) / len(middle) if middle else None
    for r in rows:
        r["state_over_middle"] = (round(r["state_bytes_max"] / ref, 6) if ref else None)
    inp = plan.stages[0].inputs
    return {"model": inp.model, "pp": plan.pp, "dp": inp.dp, "tp": inp.tp, "ep": inp.ep,
            "optimizer": inp.optimizer.name, "hardware": f"{hw.name} v{hw.version}",
            "microbatches": sim.microbatches, "forward_backward_s": simd["forward_backward_s"],
            "step_s": simd["step_s"], "iteration_s": simd["iteration_s"],
            "critical_stage": sim.critical_stage, "stages": rows}



def fsdp2_dict(plan: FSDP2Plan, *, config: Path | None = None) -> dict:
    """The data behind ``plan`` and ``inspect`` of an FSDP2 plan: its owners' loads, its rounds,
    its modelled step against the bound, and (where the model can be rebuilt: a preset's or a
    config's plan) the same model under the other FSDP2 strategies
    (:data:`~canzona.planner.fsdp2.FSDP2_STRATEGIES`: ``dist-muon``, ``sync``) side by side."""
    sec, inp = plan.fsdp2, plan.inputs
    m = plan.metrics
    rounds = [{"index": r.index, "tasks": len(r.tasks),
               "gathered_bytes_max": max(r.gathered_bytes),
               "received_bytes_max": max(r.received_bytes),
               "compute_s_max": max(r.compute_s)} for r in sec.rounds]
    rows = [{"strategy": "canzona", "description": FSDP2_STRATEGIES["canzona"],
             "step_s": sec.modelled_step_s, "rounds": len(sec.rounds)}]
    spec = rebuild_model(plan, config)
    if spec is not None and inp.model_source != "module":
        hw = load_hardware(sec.hardware) if sec.hardware.lower() in hardware_names() else None
        if hw is not None:
            problem = make_fsdp2_problem(spec, inp.dp, inp.optimizer, hardware=hw,
                                         comm_dtype=sec.comm_dtype, cmax_bytes=sec.cmax_bytes,
                                         tp=inp.tp)
            for name in ("dist-muon", "sync"):
                sol = solve_fsdp2(problem, name)
                rows.append({"strategy": name, "description": FSDP2_STRATEGIES[name],
                             "step_s": round(sol.step_s, 9), "rounds": len(sol.rounds)})
    for r in rows:
        r["over_bound"] = round(r["step_s"] / sec.bound_s, 6) if sec.bound_s else None
        r["over_plan"] = round(r["step_s"] / sec.modelled_step_s, 6) \
            if sec.modelled_step_s else None
    matrices = sum(1 for t in plan.tasks if t.optimizer == "matrix")
    return {"model": inp.model, "dp": inp.dp, "tp": inp.tp, "optimizer": inp.optimizer.name,
            "storage": "fsdp2", "hardware": sec.hardware, "link": sec.link,
            "comm_dtype": sec.comm_dtype, "cmax_bytes": sec.cmax_bytes, "matrices": matrices,
            "adamw": len(plan.tasks) - matrices, "dp_load_max_over_mean": m.max_over_mean,
            "dp_state_bytes_max": max(m.dp_state_bytes),
            "dp_state_bytes_mean": sum(m.dp_state_bytes) / len(m.dp_state_bytes),
            "received_bytes_max": max(m.dp_reduce_scatter_bytes),
            "shared": [{"task": task_name(plan.tasks[x.id].param, plan.tasks[x.id].part),
                        "owners": list(x.owners), "piece_s": x.piece_s} for x in sec.shared],
            "modelled_step_s": sec.modelled_step_s, "bound_s": sec.bound_s,
            "rounds": rounds, "strategies": rows}
