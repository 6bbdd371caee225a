"""Terminal output of the CLI: messages, the progress spinner, rich tables and bars.

Only this module prints (charts are ``plots``'s; the reports it renders are built by
:mod:`canzona.planner.report`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.bar import Bar
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from canzona.planner import optimizers
from canzona.planner.inventory import ModelSpec
from canzona.planner.layout import PhysicalLayout
from canzona.planner.report import (busiest_index, gpu_packing_bound_of, max_mean,
                                    oversized_groups, pairs_dict, peak_within_cmax,
                                    predicted_step, stages_dict, useful_mean)

from ._units import gpus, human, human_bytes, human_flops, load, params_count

if TYPE_CHECKING:
    from canzona.planner.hardware import HardwareProfile
    from canzona.planner.plan import FSDP2Plan, PipelinePlan, Plan

console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True)


def error(message: str) -> None:
    """One readable line on stderr (the message is printed as it is, never read as markup)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def note(message: str) -> None:
    """One note line on stderr (warnings of the planner, files written beside JSON output)."""
    err_console.print(f"[yellow]note:[/] {escape(message)}", highlight=False, soft_wrap=True)


def info(message: str) -> None:
    """One plain line on stderr (kept off stdout, e.g. beside ``--json``)."""
    err_console.print(escape(message), highlight=False, soft_wrap=True)


def json_out(data: object) -> None:
    """``data`` as indented JSON on stdout (``--json``)."""
    typer.echo(json.dumps(data, indent=2))


class _Elapsed:
    """Status text re-rendered at every refresh, so the elapsed seconds tick."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.phase = "starting"
        self.t0 = time.perf_counter()

    def __rich__(self) -> Text:
        return Text(f"{self.title}: {self.phase}… {time.perf_counter() - self.t0:.0f} s")


#: Seconds a block runs, off a terminal, before its stages are printed as lines (short runs, and
#: the errors of bad input, print nothing more).
PLAIN_DELAY_S = 2.0


@contextmanager
def progress(title: str, delay_s: float = 0.25, *,
             quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A transient spinner on stderr, shown only if the block runs longer than ``delay_s``.

    Yields the ``progress`` callback the solvers call with phase names. When stderr is not a
    terminal (a log, a pipe), a block that runs longer than :data:`PLAIN_DELAY_S` prints its
    stage then, and every later one, as a plain line on stderr (stdout, ``--json``'s, stays
    clean). ``quiet`` (``--quiet``): nothing is shown.
    """
    if quiet:
        yield lambda _phase: None
        return
    if not err_console.is_terminal:
        with _plain_progress(title, PLAIN_DELAY_S) as say:
            yield say
        return
    text = _Elapsed(title)
    status = err_console.status(text, spinner="dots")

    def say(phase: str) -> None:
        text.phase = phase  # read by the status's refresh thread

    with _delayed(delay_s, status.start, status.stop):
        yield say


@contextmanager
def _delayed(delay_s: float, start: Callable[[], None],
             stop: Callable[[], None] = lambda: None) -> Iterator[tuple[Any, dict]]:
    """Run ``start`` once, ``delay_s`` into the block, unless the block ended first, and
    ``stop`` at its end if ``start`` ran; both under one lock, shared with the block (yielded
    with the state ``{"started", "done"}``)."""
    lock = threading.Lock()
    state = {"started": False, "done": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["started"] = True
                start()

    timer = threading.Timer(delay_s, fire)
    timer.daemon = True
    timer.start()
    try:
        yield lock, state
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                stop()


@contextmanager
def _plain_progress(title: str, delay_s: float) -> Iterator[Callable[[str], None]]:
    """:func:`progress` off a terminal: ``TITLE: STAGE (N s)`` lines on stderr, from ``delay_s``
    on."""
    t0 = time.perf_counter()
    phase = ["starting"]

    def line() -> None:
        info(f"{title}: {phase[0]} ({time.perf_counter() - t0:.0f} s)")

    with _delayed(delay_s, line) as (lock, state):
        def say(stage: str) -> None:
            with lock:
                phase[0] = stage
                if state["started"] and not state["done"]:
                    line()

        yield say


# --- canzona models, canzona layout ----------------------------------------------------------


def models_table(rows: list[dict]) -> None:
    """The table of ``canzona models`` (rows: :func:`canzona.planner.report.model_rows`)."""
    t = Table(title="Built-in models")
    for col, just in (("model", "left"), ("params", "right"),
                      ("layers", "right"), ("hidden", "right"), ("ffn", "right"),
                      ("heads q/kv", "right"), ("experts", "right"), ("vocab", "right"),
                      ("tied", "center")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in rows:
        experts = f"{r['experts']}/top{r['experts_per_token']}" if r["experts"] else "-"
        t.add_row(r["name"], f"{r['params']:,}", str(r["layers"]),
                  str(r["hidden"]), str(r["ffn"]), f"{r['q_heads']}/{r['kv_heads']}", experts,
                  str(r["vocab"]), "yes" if r["tied_embeddings"] else "no")
    console.print(t)


def layout_view(spec: ModelSpec, lay: PhysicalLayout, *, show_buckets: bool = False) -> None:
    """Megatron's ZeRO-1 buffers (and, with ``show_buckets``, every bucket) and the split count."""
    s = lay.sizes
    split = lay.split_matrices()
    split_names = {n for n, _ in split}
    console.print(
        f"[bold]{escape(spec.name)}[/]  {params_count(spec.total_params)} params  "
        f"dp={s.dp} tp={s.tp}"
        + (f" ep={s.ep} (expert dp={s.edp})" if s.ep > 1 or spec.config.is_moe else "")
        + f"  bucket size: {lay.bucket_size:,} elements" if lay.bucket_size else
        f"[bold]{escape(spec.name)}[/]  dp={s.dp} tp={s.tp}  one bucket per buffer (no overlap)")
    t = Table(title="ZeRO-1 buffers (one TP rank)")
    for col in ("buffer", "sharded over", "buckets", "elements", "padding", "params",
                "matrices split"):
        t.add_column(col, justify="left" if col == "buffer" else "right")
    shown = [b for b in lay.buffers if not (b.expert and b.ep_rank)]  # EP ranks share shapes
    for b in shown:
        n_params = sum(len(k.slots) for k in b.buckets)
        unpadded = sum(sum(x.numel for x in k.slots) for k in b.buckets)
        n_split = sum(1 for k in b.buckets for x in k.slots if x.name in split_names)
        key = (f"expert {b.dtype}/{b.grad_dtype} (each of {s.ep} EP ranks)" if b.expert
               else b.key)
        t.add_row(key, f"{b.dp_size} ranks", str(len(b.buckets)), f"{b.numel:,}",
                  f"{b.numel - unpadded:,}", str(n_params), str(n_split))
    console.print(t)
    if show_buckets:
        bt = Table(title="Buckets")
        for col in ("buffer", "bucket", "start", "end", "elements", "per rank", "params",
                    "split"):
            bt.add_column(col, justify="right")
        for b in lay.buffers:
            for k in b.buckets:
                bt.add_row(b.key, str(k.index), f"{k.start:,}", f"{k.end:,}", f"{k.numel:,}",
                           f"{k.numel // b.dp_size:,}", str(len(k.slots)),
                           str(sum(1 for x in k.slots if x.name in split_names)))
        console.print(bt)
    total = lay.matrix_count()
    worst = max((r for _, r in split), default=0)
    console.print(
        f"ZeRO-1's equal chunks split [bold]{len(split)}[/] of {total} matrix-optimizer "
        f"parameters across DP ranks" + (f" (up to {worst} ranks each)" if split else "")
        + ": Muon, Shampoo and SOAP need each whole; canzona moves the cuts to parameter "
        "boundaries.", highlight=False)


# --- canzona plan ------------------------------------------------------------------------------


def dp_scope(plan: Plan) -> str:
    """What a per-DP-index figure covers: one GPU (tp = 1) or its whole TP group, summed."""
    tp = plan.inputs.tp
    return "per DP index" if tp == 1 else f"per DP index (its {tp} TP ranks summed)"


def ns_text(settings: Any) -> str:
    """`` (NS polar_express × 8)`` for an optimizer that reads a Newton–Schulz schedule, when it
    is not the default (``simple``, 5 steps); ``""`` otherwise."""
    if "ns_steps" not in settings.spec.settings or (
            settings.ns_coefficients == "simple" and settings.ns_steps == 5):
        return ""
    sched = settings.ns_coefficients
    name = sched if isinstance(sched, str) else f"{len(sched)} custom steps"
    return f" (NS {name} × {settings.ns_steps})"


def qkv_text(settings: Any) -> str:
    """``, QKV per head`` (or ``as Q, K, V``) when the QKV is not one matrix; ``""`` else."""
    return {"heads": ", QKV per head", "qkv": ", QKV as Q, K, V"}.get(settings.qkv_split, "")


def plan_header(plan: Plan) -> str:
    inp = plan.inputs
    ep = f" ep={inp.ep}" if inp.ep > 1 else ""
    return (f"[bold]{escape(inp.model)}[/]  dp={inp.dp} tp={inp.tp}{ep} ({gpus(inp.dp * inp.tp)})  "
            f"{inp.optimizer.name}{escape(ns_text(inp.optimizer))}{qkv_text(inp.optimizer)}, "
            f"cost {inp.cost_model}, "
            f"solver {inp.solver.solver}, "
            f"α={inp.solver.alpha:g}")


def plan_summary(plan: Plan, path: Path, wall_s: float,
                 hw: HardwareProfile | None = None) -> None:
    """The short summary ``canzona plan`` prints after writing ``path`` (``hw``: the profile it
    was planned for)."""
    inp, m = plan.inputs, plan.metrics
    console.print(plan_header(plan), highlight=False)
    step_view(predicted_step(plan, hw), plan)
    t = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    for col in (dp_scope(plan), "max", "mean", "max/mean"):
        t.add_column(col, justify="left" if col == dp_scope(plan) else "right")
    rows = [("optimizer FLOPs / step", m.dp_flops, human_flops),
            ("optimizer state", m.dp_state_bytes, human_bytes),
            ("reduce-scatter slice", m.dp_reduce_scatter_bytes, human_bytes)]
    if tuple(m.dp_load) != tuple(m.dp_flops):  # what the bound and inspect speak of
        rows.insert(0, (f"load ({inp.cost_model})", m.dp_load, lambda v: load(v, inp.cost_model)))
    for label, vals, fmt in rows:
        mx, mean = max_mean(vals)
        t.add_row(label, fmt(mx), fmt(mean), f"{mx / mean:.4f}" if mean else "-")
    console.print(t)
    console.print(
        f"gap to the certified bound: [bold]{m.gap_to_bound:.2%}[/] "
        f"(bound {load(m.certified_bound, inp.cost_model)}; LB = max(mean, largest task) "
        f"{load(m.lower_bound, inp.cost_model)})", highlight=False)
    if plan.tp is not None and m.gap_to_bound > 0.05 and plan.tp.metrics.gap_to_lb_gpu < 0.01:
        console.print("[dim]  (per DP index, its TP ranks summed: under TP the step waits for the "
                      "busiest GPU, whose gap is below)[/]", highlight=False)
    c = plan.comm
    console.print(
        f"collectives ({c.hardware}@{c.hardware_version}, {c.link.replace('_', '-')}, α–β model): "
        f"predicted {seconds(c.predicted_s)} per iteration vs ZeRO-1's {seconds(c.zero1_s)} "
        f"({_ratio(c.predicted_s, c.zero1_s)}); most bytes a rank sends "
        f"{human_bytes(c.max_sent_bytes)} ({_ratio(c.max_sent_bytes, c.zero1_max_sent_bytes)}); "
        "methods: " + ", ".join(f"{k} {n}" for k, n in c.methods.items()), highlight=False)
    console.print(
        f"matrices split across DP ranks: {m.split_matrices}{_paired(plan)}   "
        f"solver status: {m.solver_status}   "
        f"wall time: {wall_s:.2f} s", highlight=False)
    pairs_view(pairs_dict(plan))
    tp_summary(plan)
    console.print(f"wrote [bold]{escape(str(path))}[/]", highlight=False)


def pipeline_summary(plan: PipelinePlan, path: Path, wall_s: float,
                     hw: HardwareProfile | None = None) -> None:
    """What ``canzona plan --pp`` prints after writing ``path``: the stages side by side."""
    first = plan.stages[0]
    console.print(plan_header(first).replace(
        f"dp={first.inputs.dp} ", f"pp={plan.pp} × dp={first.inputs.dp} ", 1).replace(
        f"({gpus(first.inputs.dp * first.inputs.tp)})",
        f"({gpus(plan.pp * first.inputs.dp * first.inputs.tp)})", 1), highlight=False)
    stages_view(stages_dict(plan, hw))
    console.print(f"wall time: {wall_s:.2f} s   (canzona inspect PLAN shows each stage in full: "
                  "--stage S)", highlight=False)
    console.print(f"wrote [bold]{escape(str(path))}[/]", highlight=False)


def fsdp2_summary(plan: FSDP2Plan, path: Path, wall_s: float, d: dict) -> None:
    """What ``canzona plan --storage fsdp2`` prints after writing ``path``."""
    inp = plan.inputs
    tp = f" tp={inp.tp}" if inp.tp > 1 else ""
    console.print(f"[bold]{escape(inp.model)}[/]  dp={inp.dp}{tp} ({gpus(inp.dp * inp.tp)}), "
                  f"FSDP2 storage, {escape(inp.optimizer.name)}", highlight=False)
    fsdp2_view(d)
    console.print(f"wall time: {wall_s:.2f} s", highlight=False)
    console.print(f"wrote [bold]{escape(str(path))}[/]", highlight=False)


def fsdp2_view(d: dict) -> None:
    """An FSDP2 plan (:func:`canzona.planner.report.fsdp2_dict`): owners, rounds, and the
    strategies side by side."""
    console.print(
        f"{d['matrices']} matrices on planned owners (busiest GPU "
        f"{d['dp_load_max_over_mean']:.4f}× the mean load, optimizer state "
        f"{human_bytes(d['dp_state_bytes_max'])} max / {human_bytes(d['dp_state_bytes_mean'])} "
        f"mean per GPU), {d['adamw']} AdamW tensors on every rank's own rows", highlight=False)
    if d["shared"]:
        console.print(
            f"{len(d['shared'])} matrices shared by adjacent pairs of ranks (each gathers its "
            f"block of the long dimension; Newton–Schulz together, the Gram summed over the "
            f"pair), e.g. {escape(d['shared'][0]['task'])}: {seconds(d['shared'][0]['piece_s'])} "
            "per member", highlight=False)
    console.print(
        f"{len(d['rounds'])} all-to-all rounds (cap {human_bytes(d['cmax_bytes'])} of whole "
        f"matrices per rank and round; rows in {d['comm_dtype']}, the busiest rank receives "
        f"{human_bytes(d['received_bytes_max'])} and sends as much back)", highlight=False)
    t = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    for c in ("strategy", "matrices' step", "× bound", "× plan", "rounds"):
        t.add_column(c, justify="left" if c == "strategy" else "right")
    for r in d["strategies"]:
        t.add_row(r["strategy"], seconds(r["step_s"]),
                  "-" if r["over_bound"] is None else f"{r['over_bound']:.3f}",
                  "-" if r["over_plan"] is None else f"{r['over_plan']:.3f}", str(r["rounds"]),
                  style="bold" if r["strategy"] == "canzona" else None)
    console.print(t)
    console.print(
        f"modelled on {escape(d['hardware'])} ({d['link'].replace('_', '-')} link): gathers, "
        f"compute and returns pipelined, round k + 1's gather during round k's compute; bound "
        f"{seconds(d['bound_s'])} for any owners, pairs and rounds", highlight=False)


def stages_view(d: dict) -> None:
    """A pipeline's stages side by side (:func:`canzona.planner.report.stages_dict`)."""
    tp = d["tp"] > 1
    t = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    cols = ["stage", "layers", "params", "matrices", "DP max/mean"]
    cols += ["GPU max/mean"] if tp else []
    cols += ["state/GPU max", "× middle", "step", "ends at"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("stage", "layers") else "right")
    for r in d["stages"]:
        crit = r["stage"] == d["critical_stage"]
        name = f"{r['stage']}" + (" ◀ critical" if crit else "")
        held = (" + emb" if r["stage"] == 0 else " + out") if r["end_layers"] else ""
        lay = (f"{r['first_layer']}–{r['first_layer'] + r['layers'] - 1}" if r["layers"]
               else "none") + held
        row = [name, lay, params_count(r["params"]), str(r["matrices"]),
               f"{r['dp_load_max_over_mean']:.4f}"]
        if tp:
            g = r["gpu_load_max_over_mean"]
            row.append("-" if g is None else f"{g:.4f}")
        over = r["state_over_middle"]
        per_gpu = r["state_bytes_max"] / (d["tp"] if tp else 1)
        row += [human_bytes(per_gpu), "-" if over is None else f"{over:.2f}",
                seconds(r["step_s"]), seconds(r["end_s"])]
        t.add_row(*row, style="bold" if crit else None)
    console.print(t)
    console.print(
        f"iteration [bold]{seconds(d['iteration_s'])}[/] on {escape(d['hardware'])}: 1F1B over "
        f"{d['microbatches']} microbatches, forwards and backwards "
        f"{seconds(d['forward_backward_s'])}, then the slowest stage's optimizer step, "
        f"[bold]{seconds(d['step_s'])}[/] beyond them "
        f"(stage {d['critical_stage']}; each stage's step starts at its own last backward)",
        highlight=False)
    ends = [r for r in d["stages"] if r["end_layers"]]
    if ends:
        said = "; ".join(
            f"stage {r['stage']} holds {', '.join(r['end_layers'])}"
            f"{' (tied: one weight in two copies)' if r['tied_copy'] else ''}: "
            f"{human_bytes(r['end_layers_state_bytes'])} of AdamW state"
            + (f", its GPUs' state {r['state_over_middle']:.2f}× a middle stage's"
               if r["state_over_middle"] else "") for r in ends)
        console.print(f"uneven split: {said} (the layout is the trainer's: "
                      "--first-stage-layers/--last-stage-layers move layers off the end stages)",
                      highlight=False)


def pipeline_json(plan: PipelinePlan, path: Path, wall_s: float,
                  hw: HardwareProfile | None = None) -> dict:
    """What ``canzona plan --pp --json`` prints: the stages side by side and each stage's
    figures as ``plan --json`` gives them."""
    return {"pipeline": stages_dict(plan, hw), "wall_s": wall_s, "output": str(path),
            "stages": [plan_json(p, path, wall_s, hw) for p in plan.stages]}


def step_view(st: dict | None, plan: Plan) -> None:
    """The predicted step first: what a plan is for (or how to get it, for a plan made with a
    profile file)."""
    if st is None:
        console.print(f"predicted optimizer step: the plan's hardware profile "
                      f"'{escape(plan.comm.hardware)}' is not built in; canzona simulate PLAN "
                      "--hardware FILE.json predicts it", highlight=False)
        return
    console.print(
        f"predicted optimizer step [bold]{seconds(st['step_s'])}[/] "
        f"({seconds(st['reduced_step_s'])} after the gradients are reduced), iteration "
        f"{seconds(st['iteration_s'])} on {escape(st['hardware'])}, behind a forward/backward "
        f"of {seconds(st['forward_backward_s'])} (6·N_active·tokens at MFU 0.4, as simulate and "
        "compare)", highlight=False)
    parts = ", ".join(f"{_PART[k]} {seconds(v)}" for k, v in st["parts_s"].items())
    console.print(f"decided by {escape(st['decides'])} ({parts})", highlight=False)


_PART = {"compute": "compute", "tp_gather_scatter": "TP", "dp_reduce": "DP reduce",
         "dp_gather": "DP all-gather"}


def plan_json(plan: Plan, path: Path, wall_s: float, hw: HardwareProfile | None = None) -> dict:
    """What ``canzona plan --json`` prints: the figures of :func:`plan_summary`, as numbers."""
    inp, m, c = plan.inputs, plan.metrics, plan.comm

    def balance(vals: tuple[int, ...]) -> dict:
        mx, mean = max_mean(vals)
        return {"max": mx, "mean": mean, "max_over_mean": mx / mean if mean else None}

    out = {
        "model": inp.model, "dp": inp.dp, "tp": inp.tp, "ep": inp.ep,
        "optimizer": inp.optimizer.name, "cost_model": inp.cost_model,
        "solver": inp.solver.solver, "alpha": inp.solver.alpha,
        "per_dp_index": {"load": balance(m.dp_load), "flops": balance(m.dp_flops),
                         "state_bytes": balance(m.dp_state_bytes),
                         "reduce_scatter_bytes": balance(m.dp_reduce_scatter_bytes)},
        "gap_to_bound": m.gap_to_bound, "certified_bound": m.certified_bound,
        "lower_bound": m.lower_bound, "split_matrices": m.split_matrices,
        "dp_shared": len(plan.dp_shared), "solver_status": m.solver_status,
        "collectives": {"hardware": c.hardware, "hardware_version": c.hardware_version,
                        "link": c.link, "predicted_s": c.predicted_s, "zero1_s": c.zero1_s,
                        "max_sent_bytes": c.max_sent_bytes,
                        "zero1_max_sent_bytes": c.zero1_max_sent_bytes,
                        "methods": dict(c.methods)},
        "tp_per_gpu": None, "wall_s": wall_s, "output": str(path),
        "predicted": predicted_step(plan, hw),
    }
    if plan.tp is not None:
        t = plan.tp.metrics
        out["tp_per_gpu"] = {"max": t.max_gpu_load, "mean": t.mean_gpu_load,
                             "max_over_mean": t.max_over_mean, "lb_gpu": t.lb_gpu,
                             "gap_to_lb_gpu": t.gap_to_lb_gpu, "micro_groups": t.micro_groups,
                             "peak_gathered_bytes": t.peak_gathered_bytes,
                             "cmax_bytes": plan.tp.cmax_bytes}
    return out


def _paired(plan) -> str:  # noqa: ANN001
    """After the count of matrices split across DP ranks (ZeRO-1 fragments): the ones two DP
    ranks share by design (``plan.dp_shared``), which it does not count."""
    if not plan.dp_shared:
        return ""
    by = "DP pairs" if plan.inputs.tp == 1 else "two TP groups"
    return f" (and {len(plan.dp_shared)} shared by {by})"


# --- canzona inspect ---------------------------------------------------------------------------


def _bar(value: int, top: int, width: int = 16) -> Bar:
    return Bar(size=float(top or 1), begin=0.0, end=float(value), width=width)


def seconds(s: float) -> str:
    """A modelled duration: ``12.34 ms`` under a second, ``1.234 s`` above."""
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.2f} ms"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}×" if b else "-"


def comm_view(c: dict, *, top: int = 10) -> None:
    """The plan's collectives (``report["comm"]``): the profile, predicted time and bytes against
    ZeRO-1, and the ``top`` most costly buckets with a totals line."""
    tot = c["totals"]
    console.rule("DP collectives (α–β model, not measured)")
    console.print(
        f"profile [bold]{escape(c['hardware'])}@{c['hardware_version']}[/] "
        f"({c['gpus_per_node']} GPUs per node): DP groups on {c['link'].replace('_', '-')} links, "
        f"bus bandwidth {human_bytes(c['busbw'])}/s, α {c['latency_s'] * 1e6:.1f} µs",
        highlight=False)
    if c["converted_from"] is not None:
        console.print(f"[yellow]converted from schema {c['converted_from']}[/]: the methods were "
                      "chosen on load with this profile", highlight=False)
    console.print(
        f"predicted per iteration (busiest DP index): [bold]{seconds(c['predicted_s'])}[/] vs "
        f"ZeRO-1's even collectives {seconds(c['zero1_s'])} ({c['time_ratio']:.3f}×); most bytes "
        f"a rank sends {human_bytes(c['max_sent_bytes'])} vs "
        f"{human_bytes(c['zero1_max_sent_bytes'])} ({c['bytes_ratio']:.3f}×)", highlight=False)
    console.print("methods: " + ", ".join(f"{m} {n}" for m, n in c["methods"].items())
                  + f" bucket{'s' if tot['buckets'] != 1 else ''}; {tot['calls']} calls per "
                  f"iteration (ZeRO-1: {tot['zero1_calls']})", highlight=False)
    shown = sorted(c["buckets"], key=lambda b: -b["seconds"])[:top]
    if not shown:
        return
    keys = {b["buffer"] for b in c["buckets"]}
    dtypes = {k.rsplit(" ", 1)[-1] for k in keys}
    one = len(dtypes) == 1  # one dtype pair: name buffers without it

    def name(b: dict) -> str:
        key = b["buffer"].rsplit(" ", 1)[0] if one else b["buffer"]
        return f"{key} #{b['bucket']}"

    t = Table(title=f"The {len(shown)} most costly of {tot['buckets']} buckets by predicted "
                    f"reduce + gather time{' (' + next(iter(dtypes)) + ')' if one else ''}; "
                    "--json lists every bucket")
    for col in ("bucket", "elements", "compute", "method", "slices min–max", "max/even", "calls",
                "max sent", "predicted", "/ ZeRO-1"):
        t.add_column(col, justify="left" if col in ("bucket", "method") else "right")
    for b in shown:
        t.add_row(escape(name(b)), human(b["numel"]), human_flops(b["max_rank_flops"]), b["method"],
                  f"{human(b['slice_min'])}–{human(b['slice_max'])}", f"{b['max_over_even']:.2f}",
                  str(b["calls"]), human_bytes(b["max_sent_bytes"]), seconds(b["seconds"]),
                  _ratio(b["seconds"], b["zero1_seconds"]))
    t.add_section()
    t.add_row(f"all {tot['buckets']}", human(sum(b["numel"] for b in c["buckets"])), "", "", "", "",
              str(tot["calls"]), human_bytes(tot["max_sent_bytes"]), seconds(tot["predicted_s"]),
              _ratio(tot["predicted_s"], tot["zero1_s"]),
              style="bold")
    console.print(t)
    console.print("compute: the busiest DP index's matrix FLOPs in the bucket; totals: the "
                  "busiest DP index's sum over the buckets it joins; max sent: the most bytes one "
                  "rank sends (reduce + gather).", style="dim", highlight=False)


#: Up to this many DP indices the per-index tables list every one; above, their distribution
#: and the busiest few (``canzona inspect --ranks all`` lists every one).
RANKS_LISTED = 16
#: The busiest indices listed beside a distribution.
RANKS_TOP = 5
_BLOCKS = " ▁▂▃▄▅▆▇█"


def spark(values: list[float], bins: int = 12) -> str:
    """A histogram of ``values`` in ``bins`` equal bins from min to max, one block each."""
    lo, hi = min(values), max(values)
    if hi <= lo:
        return _BLOCKS[-1] + " (all equal)"
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / (hi - lo) * bins))] += 1
    top = max(counts)
    return "".join(_BLOCKS[0 if c == 0 else max(1, round(8 * c / top))] for c in counts)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def distribution_view(title: str, rows: list[tuple[str, list[float], Callable[[float], str]]],
                      ) -> None:
    """min / median / max / max over mean and a histogram of each row's values."""
    t = Table(title=title)
    for col in ("", "min", "median", "max", "max/mean", "histogram (min → max)"):
        t.add_column(col, justify="left" if col in ("", "histogram (min → max)") else "right")
    for label, vals, fmt in rows:
        mean = sum(vals) / len(vals)
        t.add_row(label, fmt(min(vals)), fmt(_median(vals)), fmt(max(vals)),
                  f"{max(vals) / mean:.3f}" if mean else "-", spark(vals))
    console.print(t)


def inspect_view(plan: Plan, report: dict, *, top_buckets: int = 10, ranks: str = "auto") -> None:
    """The rich report of ``canzona inspect`` (``top_buckets``: how many of the most costly
    buckets to list; ``ranks``: ``all`` lists every DP index, ``auto`` lists them up to
    :data:`RANKS_LISTED` and above gives their distribution and the busiest few)."""
    from canzona.planner.strategies import CANZONA

    inp, m = plan.inputs, plan.metrics
    r = report["metrics"]
    cm = inp.cost_model
    console.print(
        plan_header(plan) + f"  ({inp.model_source}; strategy {inp.solver.strategy}, "
        f"status {m.solver_status})", highlight=False)
    step_view(report["predicted"], plan)
    console.print(
        f"{dp_scope(plan)}: max load {load(r['max_load'], cm)}, mean {load(r['mean_load'], cm)}; "
        f"max/mean {r['max_over_mean']:.4f}; matrices split across DP ranks: "
        f"{m.split_matrices}{_paired(plan)}",
        highlight=False)
    console.print(
        f"gap to LB = max(mean, largest task) {load(m.lower_bound, cm)}: "
        f"{r['gap_to_lower_bound']:.2%};  gap to the certified bound "
        f"{load(m.certified_bound, cm)}: [bold]{m.gap_to_bound:.2%}[/]", highlight=False)

    every = report["ranks"]
    scope = dp_scope(plan)
    listed = every
    if ranks != "all" and len(every) > RANKS_LISTED:
        distribution_view(
            f"{scope[0].upper()}{scope[1:]}: the distribution over {len(every)} indices "
            "(--ranks all lists every one)",
            [("matrices", [x["matrices"] for x in every], lambda v: f"{v:.0f}"),
             ("optimizer FLOPs", [x["flops"] for x in every], human_flops),
             ("state", [x["state_bytes"] for x in every], human_bytes),
             ("reduce-scatter", [x["reduce_scatter_bytes"] for x in every], human_bytes),
             ("bytes sent", [x["sent_bytes"] for x in every], human_bytes),
             ("collectives", [x["collective_s"] for x in every], seconds)])
        listed = sorted(every, key=lambda x: (-x["load"], x["dp_index"]))[:RANKS_TOP]
    tops = {k: max(x[k] for x in every) for k in ("flops", "sent_bytes")}
    shown = "" if listed is every else f"the {len(listed)} busiest; "
    t = Table(title=f"{scope[0].upper()}{scope[1:]} ({shown}bars relative to the busiest; bytes "
                    "sent and collectives per iteration)")
    for col, just in (("d", "right"), ("matrices", "right"), ("optimizer FLOPs", "left"),
                      ("", "right"), ("state", "right"), ("reduce-scatter", "right"),
                      ("bytes sent", "left"), (" ", "right"), ("collectives", "right")):
        width = len(col) if len(col) < 15 else None  # no "reduce-scatt…"
        t.add_column(col, justify=just, min_width=width)  # type: ignore[arg-type]
    for x in listed:
        busiest = x["load"] == r["max_load"]
        t.add_row(
            f"[bold]{x['dp_index']}[/]" if busiest else str(x["dp_index"]), str(x["matrices"]),
            _bar(x["flops"], tops["flops"], 10), human_flops(x["flops"]),
            human_bytes(x["state_bytes"]), human_bytes(x["reduce_scatter_bytes"]),
            _bar(x["sent_bytes"], tops["sent_bytes"], 10), human_bytes(x["sent_bytes"]),
            seconds(x["collective_s"]))
    console.print(t)
    comm_view(report["comm"], top=top_buckets)

    if report["heaviest_tasks"]:
        h = Table(title=f"Heaviest {len(report['heaviest_tasks'])} tasks")
        for col in ("task", "shape", "optimizer", "owner d", f"cost ({inp.cost_model})",
                    "FLOPs", "state"):
            h.add_column(col, justify="left" if col in ("task", "optimizer") else "right")
        for x in report["heaviest_tasks"]:
            h.add_row(escape(x["name"]), "×".join(map(str, x["shape"])), x["optimizer"],
                      "-" if x["owner"] is None else str(x["owner"]), load(x["cost"], cm),
                      human_flops(x["flops"]), human_bytes(x["state_bytes"]))
        console.print(h)

    if report["baselines"] is None:
        console.print("baselines: not available for this plan (made from a live module or a "
                      "custom cost model).", highlight=False)
    else:
        b = Table(title=f"Against the baselines (same model and sizes; bound "
                        f"{load(m.certified_bound, cm)}; {dp_scope(plan)})")
        for col in ("strategy", "max load", "max/mean", "gap to bound", "split matrices",
                    "grad sync", "max sent", "collectives"):
            b.add_column(col, justify="left" if col in ("strategy", "grad sync") else "right")
        for x in report["baselines"]:
            style = "bold" if x["name"] == CANZONA else None
            b.add_row(x["name"], load(x["max_load"], cm), f"{x['max_over_mean']:.4f}",
                      f"{x['gap_to_bound']:.2%}", str(x["split_matrices"]), x["grad_sync"],
                      "-" if x["max_sent_bytes"] is None else human_bytes(x["max_sent_bytes"]),
                      "-" if x["collective_s"] is None else seconds(x["collective_s"]),
                      style=style)
        console.print(b)
        padded = [x for x in report["baselines"] if x.get("padding") is not None]
        console.print(
            "zero1 is not the exact optimizer (it orthogonalises fragments); "
            + "".join(f"{x['name']} pads {x['padding']:.1%} of the matrix elements; "
                      for x in padded)
            + "the strategies: docs/compare.md or canzona compare. max sent: bytes one rank "
            "sends per iteration; collectives: predicted on the plan's link.", highlight=False,
            style="dim", markup=False)
    pairs_view(report.get("dp_pairs"))
    sharing_view(report.get("sharing"))


def pairs_view(pr: dict | None) -> None:
    """The matrices DP pairs share (``report["dp_pairs"]``)."""
    if pr is None:
        return
    if not optimizers.get(pr["optimizer"]).gram_shared:
        console.print(
            f"blocks hosted by two DP ranks (the bucket cut inside the matrix between two block "
            f"rows; each preconditions its own blocks, nothing exchanged): {pr['tasks']} "
            "matrices (" + ", ".join(f"{n} {k}" for k, n in pr["kinds"].items())
            + f"); busiest DP index / mean useful work {pr['max_over_useful_mean']:.3f}",
            highlight=False)
        return
    console.print(
        f"shared by DP pairs (shared Newton–Schulz over two DP ranks, the bucket cut inside the "
        f"matrix at a row boundary): {pr['tasks']} matrices ("
        + ", ".join(f"{n} {k}" for k, n in pr["kinds"].items())
        + f"), {pr['split_poly']} with the polynomial split, {pr['phases']} phases, "
        f"{pr['across_nodes']} pairs across two nodes (exchanging over the network); busiest DP "
        f"index / mean useful work {pr['run_max_over_useful_mean']:.3f} with each pair's "
        f"matrices in lockstep (one's exchanges beside the others' compute, as the runtime runs "
        f"them), {pr['max_over_useful_mean']:.3f} with every piece's exchanges in its load",
        highlight=False)


def sharing_view(sh: dict | None) -> None:
    """The per-GPU atomic bound beside the bound with shared Newton–Schulz
    (``report["sharing"]``)."""
    if sh is None:
        return
    from canzona.planner.sharing import kind_of

    console.print(
        f"beyond whole matrices (per GPU, {sh['gpus']} GPUs): atomic LB = max(mean, largest task) "
        f"= {sh['atomic_lb_over_mean']:.3f}× the mean useful work; with tasks shared by a "
        f"few ranks the bound is {sh['shared_lb_over_mean']:.3f}×, the longest critical path "
        f"(a piece and its collectives) {sh['longest_path_over_mean']:.3f}× (canzona plan --share "
        "auto shares over TP groups, and two TP groups where that helps, at tp > 1; over DP "
        "pairs at tp = 1)", highlight=False)
    if sh["note"]:
        console.print(sh["note"], highlight=False, style="dim")
    pat = sh.get("pattern")
    if pat is not None and "unavailable" in pat:
        console.print(f"certified per-GPU floor with any sharing option: not computed "
                      f"({pat['unavailable']})", highlight=False, style="dim")
    elif pat is not None:
        cm = pat["cost_model"]
        how = ("the model's optimum, every lower ceiling proven unreachable" if pat["tight"]
               else "every lower ceiling proven unreachable; the optimum may lie higher, "
                    "CP-SAT stopped at its budget")
        console.print(
            f"certified per-GPU floor with any sharing option (over the TP group, TP pairs, TP "
            f"sub-groups, or hosted; the layout-free pattern model, {pat['patterns']} patterns "
            f"of {pat['kinds']} kinds of piece, CP-SAT: {how}): [bold]{load(pat['bound'], cm)}"
            f"[/]; this plan's busiest GPU {load(pat['plan'], cm)} is "
            f"[bold]{pat['plan'] / pat['bound'] - 1:.2%}[/] above it" if pat["bound"] else
            "certified per-GPU floor with any sharing option: 0", highlight=False)
    groups: dict[tuple, list[dict]] = {}
    for x in sh["shared"]:
        groups.setdefault((x["group"], x["k"], x["split_poly"]), []).append(x)
    for (g, k, split), xs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        kinds = sorted({kind_of(x["name"]) for x in xs})
        where = {"tp": "its TP group" if not optimizers.get(sh["optimizer"]).block_hosted
                 else "its TP group, each rank the blocks of its own shard",
                 "tp_pair": "its TP group and the same TP ranks at a second DP index; "
                            "--share auto where it lowers the objective, or pairs",
                 "tp_sub": f"a sub-group of {k} of its TP group's ranks, tp/k alike "
                           f"matrices side by side; --share auto where it lowers the "
                           f"objective, or sub-groups"
                 }.get(g, f"{k} adjacent DP indices")
        console.print(f"  {len(xs)} tasks in the bound shared by {k} ranks ({where}"
                      f"{', polynomial split' if split else ''}): {', '.join(kinds)}",
                      highlight=False)


def wrote(what: str, path: Path) -> None:
    """``wrote chart FILE`` on stdout, after the report."""
    console.print(f"wrote {what} [bold]{escape(str(path))}[/]", highlight=False)


def wrote_charts(paths: list[Path], *, as_json: bool,
                 labels: tuple[str, ...] = ("chart", "TP chart")) -> None:
    """Name the charts written (``labels``: by default the per-DP-index chart, then the TP
    view): after the report on stdout, or on stderr beside ``--json``."""
    for k, path in enumerate(paths):
        what = labels[min(k, len(labels) - 1)]
        if as_json:
            info(f"wrote {what} {path}")
        else:
            wrote(what, path)


# --- TP view (micro-groups) --------------------------------------------------------------------


def tp_summary(plan: Plan) -> None:
    """The per-GPU lines after ``canzona plan`` (tp > 1)."""
    if plan.tp is None:
        return
    m, cm = plan.tp.metrics, plan.inputs.cost_model
    cap = plan.tp.cmax_bytes
    console.print(
        f"per GPU (one DP index × one TP rank): max {load(m.max_gpu_load, cm)}, mean "
        f"{load(m.mean_gpu_load, cm)} (max/mean {m.max_over_mean:.3f}); LB_gpu = max(mean, "
        f"largest task) {load(m.lb_gpu, cm)}, gap [bold]{m.gap_to_lb_gpu:.2%}[/]", highlight=False)
    if m.gap_to_lb_gpu > 0.01 and (bound := gpu_packing_bound_of(plan)) is not None:
        console.print(
            f"certified per-GPU bound {load(bound, cm)} (the hosted matrices packed onto the "
            f"{plan.inputs.dp * plan.inputs.tp} GPUs: no plan's busiest GPU is below it), "
            f"{bound / m.lb_gpu - 1:.2%} above LB_gpu; this plan is "
            f"[bold]{m.max_gpu_load / bound - 1:.2%}[/] above it", highlight=False)
    over = oversized_groups(plan)
    within = peak_within_cmax(plan)
    line = (f"{m.micro_groups} micro-groups; peak gathered per host rank "
            f"{human_bytes(m.peak_gathered_bytes)}")
    if over:
        line += (f" in {len(over)} oversized groups (a single matrix larger than C_max "
                 f"{human_bytes(cap)}, alone in its group); the other groups peak at "
                 f"{human_bytes(within)} ≤ C_max")
    else:
        line += f" ≤ C_max {human_bytes(cap)}"
    console.print(line, highlight=False)
    shared = [x for ix in plan.tp.indices for x in ix.shared]
    ix_of = {id(x): ix.dp_index for ix in plan.tp.indices for x in ix.shared}
    if shared:
        from canzona.planner.sharing import kind_of

        kinds: dict[str, int] = {}
        pairs: dict[str, int] = {}
        subs: dict[tuple[str, int], int] = {}
        for x in shared:
            k = kind_of(plan.tasks[x.id].param)
            if x.sub is not None:
                subs[(k, x.sub.k)] = subs.get((k, x.sub.k), 0) + 1
            elif x.partner is None:
                kinds[k] = kinds.get(k, 0) + 1
            elif x.partner > ix_of[id(x)]:  # a matrix two TP groups share: once
                pairs[k] = pairs.get(k, 0) + 1
        split = sum(x.split_poly for x in shared if x.partner is None and x.sub is None)
        listed = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        paired = ""
        if pairs:
            paired = (f"; and shared by two TP groups, partner DP indices (k = 2·tp, each index "
                      f"half of every shard's rows): {sum(pairs.values())} matrices ("
                      + ", ".join(f"{n} {k}" for k, n in sorted(pairs.items(),
                                                                key=lambda kv: -kv[1])) + ")")
        if subs:
            tp = plan.inputs.tp
            paired += ("; and shared by TP sub-groups (k of the tp ranks, strided, each "
                       "gathering its rows of the matrix; tp/k alike matrices side by side in "
                       "a round): " + ", ".join(
                           f"{n} {kind} over k = {k} ({n * k // tp} rounds)"
                           for (kind, k), n in sorted(subs.items(), key=lambda kv: -kv[1])))
        if plan.inputs.optimizer.spec.block_hosted:
            console.print(
                f"preconditioned shard by shard (--share {plan.tp.share}: each TP rank Shampoo's "
                f"blocks of its own shard, whole blocks of the matrix; no gather, no collective; "
                f"run before the micro-groups): {len(shared)} matrices ({listed}); max / mean "
                f"useful work {m.max_gpu_load / useful_mean(plan):.3f}", highlight=False)
            return
        console.print(
            f"shared by their TP group (--share {plan.tp.share}: shared Newton–Schulz over the "
            f"shards, no gather; run before the micro-groups): {sum(kinds.values())} matrices "
            f"({listed}), {split} with the polynomial split{paired}; their Gram all-reduces are "
            f"in the loads "
            f"(less what runs beside their own Gram products, in chunks): "
            f"max / mean useful work (each task's single-device cost) "
            f"{m.max_gpu_load / useful_mean(plan):.3f}", highlight=False)


def _gantt(ix, width: int = 60) -> list[str]:
    """Terminal Gantt of one TP group: a comm row (g = gather, s = scatter) and a compute row."""
    end = max((g.timeline_s[5] for g in ix.groups if g.timeline_s), default=0.0) or 1.0
    comm = [" "] * width
    comp = [" "] * width

    def paint(row, a, b, ch):
        lo, hi = int(a / end * width), max(int(a / end * width) + 1, int(b / end * width))
        for k in range(lo, min(hi, width)):
            row[k] = ch

    for g in ix.groups:
        if not g.timeline_s:
            continue
        gs, ge, cs, ce, ss, se = g.timeline_s
        label = str(g.index % 10)
        paint(comm, gs, ge, "g")
        paint(comm, ss, se, "s")
        paint(comp, cs, ce, label)
    return ["comm    |" + "".join(comm) + "|",
            "compute |" + "".join(comp) + f"| {end * 1e3:.2f} ms"]


def tp_view(plan: Plan, tp_rep: dict, *, ranks: str = "auto") -> None:
    """The TP section of ``canzona inspect`` (``ranks`` as :func:`inspect_view`'s)."""
    from canzona.planner.strategies import CANZONA

    tp, m = plan.tp, plan.tp.metrics  # type: ignore[union-attr]
    cm = plan.inputs.cost_model
    console.rule("TP micro-groups")
    tp_summary(plan)
    grid = m.gpu_load
    top = max(max(r) for r in grid) or 1
    busiest_d = busiest_index(grid)
    rows = list(enumerate(grid))
    which = "rows: DP index d"
    if ranks != "all" and len(grid) > RANKS_LISTED:
        distribution_view(f"Per-GPU load over {len(grid) * len(grid[0])} GPUs (--ranks all lists "
                          "every TP group)",
                          [("load", [float(x) for r in grid for x in r],
                            lambda v: load(v, cm))])
        rows = sorted(rows, key=lambda dr: (-max(dr[1]), dr[0]))[:RANKS_TOP]
        which = f"rows: the {len(rows)} busiest DP indices d"
    t = Table(title=f"Per-GPU load ({which}, columns: TP rank t; % of the busiest GPU)")
    t.add_column("d", justify="right")
    for k in range(len(grid[0])):
        t.add_column(f"t{k}", justify="right")
    t.add_column("all-to-all (busiest rank)", justify="right")
    for d, r in rows:
        cells = [(f"[bold]{x / top:.0%}[/]" if x == top else f"{x / top:.0%}") for x in r]
        t.add_row(str(d), *cells, human_bytes(max(m.all_to_all_bytes[d])))
    console.print(t)
    ix = tp.indices[busiest_d]
    g = Table(title=f"Micro-groups of the busiest TP group (d = {busiest_d}), in execution order")
    for col in ("group", "tasks", "peak gathered", "max rank load", "min rank load", "gather out"):
        g.add_column(col, justify="right")
    for grp in ix.groups:
        out = max(sum(v for h, v in enumerate(row) if h != t)
                  for t, row in enumerate(grp.gather_send))
        g.add_row(str(grp.index) + (" (oversized)" if grp.oversized else ""), str(len(grp.tasks)),
                  human_bytes(grp.peak_gathered_bytes), load(max(grp.rank_load), cm),
                  load(min(grp.rank_load), cm), f"{out:,} el")
    console.print(g)
    console.print(f"modelled timeline, not measured (hardware profile '{escape(tp.hardware)}': "
                  "its peak FLOP/s × efficiency and intra-node bus bandwidth, see "
                  "docs/cost-model.md; gather of group i+1 overlaps compute of group i):",
                  highlight=False)
    for line in _gantt(ix):
        console.print(line, highlight=False, markup=False)
    if tp_rep.get("baselines"):
        b = Table(title=f"TP baselines (per GPU; LB_gpu {load(m.lb_gpu, cm)})")
        for col in ("strategy", "max GPU load", "max/mean", "gap to LB_gpu"):
            b.add_column(col, justify="left" if col == "strategy" else "right")
        for x in tp_rep["baselines"]:
            b.add_row(x["name"], load(x["max_gpu_load"], cm), f"{x['max_over_mean']:.3f}",
                      f"{x['gap_to_lb_gpu']:.2%}",
                      style="bold" if x["name"] == CANZONA else None)
        console.print(b)
        console.print("sc: every TP rank all-gathers and computes every matrix of its DP index "
                      "(Megatron's duplicated); canzona-greedy: the paper's DP greedy + TP greedy.",
                      style="dim", highlight=False)
