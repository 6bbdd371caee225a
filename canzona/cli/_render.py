"""Rich rendering for the CLI (tables, bars). Only this module prints."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.bar import Bar
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from canzona.planner.inventory import ModelSpec
from canzona.planner.layout import PhysicalLayout
from canzona.planner.planning import collective_elements

if TYPE_CHECKING:
    from canzona.planner.baselines import BaselineRow
    from canzona.planner.plan import Plan

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


# Units, one family each throughout the CLI (tables, summaries and charts alike): bytes in binary
# units (KiB, MiB, GiB, TiB: C_max is given in MiB), FLOPs and counts in decimal SI prefixes.


def human(n: float, unit: str = "") -> str:
    """A count or FLOPs in decimal prefixes: ``human(3.2e13, "FLOP")`` → ``32.00 TFLOP``."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def human_bytes(n: float) -> str:
    """Bytes in binary units: ``human_bytes(3 * 2**30)`` → ``3.00 GiB``."""
    for div, suffix in ((2.0 ** 40, "TiB"), (2.0 ** 30, "GiB"), (2.0 ** 20, "MiB"), (2.0 ** 10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {suffix}"
    return f"{n:.0f} B"


def params_count(n: int) -> str:
    """A parameter count as models are named: ``32.76B``."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def load(n: float, cost_model: str) -> str:
    """A load in the plan's cost units (FLOPs for the flops model, elements for numel)."""
    return human(n, "FLOP" if cost_model == "flops" else "el")


def gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def models_table(rows: list[dict]) -> None:
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


def layout_dict(spec: ModelSpec, lay: PhysicalLayout) -> dict:
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


def layout_report(spec: ModelSpec, lay: PhysicalLayout, *, show_buckets: bool = False) -> None:
    s = lay.sizes
    split = lay.split_matrices()
    split_names = {n for n, _ in split}
    console.print(
        f"[bold]{escape(spec.name)}[/]  {params_count(spec.total_params)} params  dp={s.dp} tp={s.tp}"
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


class _Elapsed:
    """Status text re-rendered at every refresh, so the elapsed seconds tick."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.phase = "starting"
        self.t0 = time.perf_counter()

    def __rich__(self) -> Text:
        return Text(f"{self.title}: {self.phase}… {time.perf_counter() - self.t0:.0f} s")


@contextmanager
def progress(title: str, delay_s: float = 0.25) -> Iterator[Callable[[str], None]]:
    """A transient spinner on stderr, shown only if the block runs longer than ``delay_s``.

    Yields the ``progress`` callback the solvers call with phase names. Nothing is printed when
    stderr is not a terminal (logs and pipes stay clean).
    """
    if not err_console.is_terminal:
        yield lambda _phase: None
        return
    text = _Elapsed(title)
    lock = threading.Lock()
    state: dict = {"status": None, "done": False}

    def start() -> None:
        with lock:
            if not state["done"]:
                state["status"] = err_console.status(text, spinner="dots")
                state["status"].start()

    def say(phase: str) -> None:
        text.phase = phase  # read by the status's refresh thread

    timer = threading.Timer(delay_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield say
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["status"] is not None:
                state["status"].stop()


def _max_mean(values: tuple[int, ...] | list[int]) -> tuple[int, float]:
    return max(values), sum(values) / len(values)


def dp_scope(plan: Plan) -> str:
    """What a per-DP-index figure covers: one GPU (tp = 1) or its whole TP group, summed."""
    tp = plan.inputs.tp
    return "per DP index" if tp == 1 else f"per DP index (its {tp} TP ranks summed)"


def plan_header(plan: Plan) -> str:
    inp = plan.inputs
    ep = f" ep={inp.ep}" if inp.ep > 1 else ""
    return (f"[bold]{escape(inp.model)}[/]  dp={inp.dp} tp={inp.tp}{ep} ({gpus(inp.dp * inp.tp)})  "
            f"{inp.optimizer.name}, cost {inp.cost_model}, solver {inp.solver.solver}, "
            f"α={inp.solver.alpha:g}")


def plan_summary(plan: Plan, path: Path, wall_s: float) -> None:
    """The short summary ``canzona plan`` prints after writing ``path``."""
    inp, m = plan.inputs, plan.metrics
    console.print(plan_header(plan), highlight=False)
    t = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    for col in (dp_scope(plan), "max", "mean", "max/mean"):
        t.add_column(col, justify="left" if col == dp_scope(plan) else "right")
    rows = [("optimizer FLOPs / step", m.dp_flops, human_flops),
            ("optimizer state", m.dp_state_bytes, human_bytes),
            ("reduce-scatter slice", m.dp_reduce_scatter_bytes, human_bytes)]
    if inp.cost_model != "flops":
        rows.insert(0, (f"load ({inp.cost_model})", m.dp_load, lambda v: load(v, inp.cost_model)))
    for label, vals, fmt in rows:
        mx, mean = _max_mean(vals)
        t.add_row(label, fmt(mx), fmt(mean), f"{mx / mean:.4f}" if mean else "-")
    console.print(t)
    console.print(
        f"gap to the certified bound: [bold]{m.gap_to_bound:.2%}[/] "
        f"(bound {load(m.certified_bound, inp.cost_model)}; LB = max(mean, largest task) "
        f"{load(m.lower_bound, inp.cost_model)})", highlight=False)
    even, padded = collective_elements(plan)
    console.print(
        f"uneven slices: padded reduce-scatter/all-gather would move {padded / even:.2f}× ZeRO-1's "
        "bytes (per-rank reduce/broadcast: 1.00×, in dp calls per bucket)", highlight=False)
    console.print(
        f"matrices split across DP ranks: {m.split_matrices}   solver status: {m.solver_status}   "
        f"wall time: {wall_s:.2f} s", highlight=False)
    tp_summary(plan)
    console.print(f"wrote [bold]{escape(str(path))}[/]", highlight=False)


def human_flops(n: float) -> str:
    return human(n, "FLOP")


# --- canzona inspect ---------------------------------------------------------------------------


def _task_name(param: str, part: str | None) -> str:
    return f"{param}#{part}" if part else param


def inspect_dict(plan: Plan, rows: list[BaselineRow] | None, *, top: int = 10) -> dict:
    """Everything ``canzona inspect`` shows, as plain data (``--json``)."""
    inp, m = plan.inputs, plan.metrics
    owned = [0] * inp.dp
    for t in plan.tasks:
        if t.owner is not None:
            owned[t.owner] += 1
    mx, mean = _max_mean(m.dp_load)
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
             "reduce_scatter_bytes": m.dp_reduce_scatter_bytes[d], "matrices": owned[d]}
            for d in range(inp.dp)
        ],
        "heaviest_tasks": [
            {"id": t.id, "name": _task_name(t.param, t.part), "shape": list(t.shape),
             "optimizer": t.optimizer, "owner": t.owner, "cost": t.cost, "flops": t.flops,
             "state_bytes": t.state_bytes}
            for t in heavy
        ],
        "baselines": None if rows is None else [
            {"name": r.name, "max_load": r.max_load, "mean_load": r.mean_load,
             "max_over_mean": round(r.max_over_mean, 6), "gap_to_bound": round(r.gap_to_bound, 6),
             "split_matrices": r.split_matrices, "grad_sync": r.grad_sync}
            for r in rows
        ],
    }


def _bar(value: int, top: int, width: int = 16) -> Bar:
    return Bar(size=float(top or 1), begin=0.0, end=float(value), width=width)


def inspect_report(plan: Plan, report: dict) -> None:
    """The rich report of ``canzona inspect``."""
    inp, m = plan.inputs, plan.metrics
    r = report["metrics"]
    cm = inp.cost_model
    console.print(
        plan_header(plan) + f"  ({inp.model_source}; strategy {inp.solver.strategy}, "
        f"status {m.solver_status})", highlight=False)
    console.print(
        f"{dp_scope(plan)}: max load {load(r['max_load'], cm)}, mean {load(r['mean_load'], cm)}; "
        f"max/mean {r['max_over_mean']:.4f}; matrices split across DP ranks: {m.split_matrices}",
        highlight=False)
    console.print(
        f"gap to LB = max(mean, largest task) {load(m.lower_bound, cm)}: "
        f"{r['gap_to_lower_bound']:.2%};  gap to the certified bound "
        f"{load(m.certified_bound, cm)}: [bold]{m.gap_to_bound:.2%}[/]", highlight=False)

    ranks = report["ranks"]
    tops = {k: max(x[k] for x in ranks) for k in ("flops", "state_bytes", "reduce_scatter_bytes")}
    scope = dp_scope(plan)
    t = Table(title=f"{scope[0].upper()}{scope[1:]} (bars relative to the busiest)")
    t.add_column("d", justify="right")
    t.add_column("matrices", justify="right")
    for label in ("optimizer FLOPs", "optimizer state", "reduce-scatter"):
        t.add_column(label, justify="left")
        t.add_column("", justify="right")
    for x in ranks:
        busiest = x["load"] == r["max_load"]
        t.add_row(
            f"[bold]{x['dp_index']}[/]" if busiest else str(x["dp_index"]), str(x["matrices"]),
            _bar(x["flops"], tops["flops"]), human_flops(x["flops"]),
            _bar(x["state_bytes"], tops["state_bytes"]), human_bytes(x["state_bytes"]),
            _bar(x["reduce_scatter_bytes"], tops["reduce_scatter_bytes"]),
            human_bytes(x["reduce_scatter_bytes"]))
    console.print(t)

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
                    "grad sync"):
            b.add_column(col, justify="left" if col in ("strategy", "grad sync") else "right")
        for x in report["baselines"]:
            style = "bold" if x["name"] == "canzona" else None
            b.add_row(x["name"], load(x["max_load"], cm), f"{x['max_over_mean']:.4f}",
                      f"{x['gap_to_bound']:.2%}", str(x["split_matrices"]), x["grad_sync"],
                      style=style)
        console.print(b)
        console.print("zero1 charges split matrices by fragments (not the exact optimizer); asc "
                      "computes each whole on the rank holding its start; layerwise all-reduces "
                      "gradients; layerwise-lpt balances Megatron's proxy max·min², not the "
                      "plan's cost, so it can lose to layerwise (README: Reading the reports).",
                      highlight=False, style="dim")


def _figure_classes():
    from canzona.planner import CanzonaError

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CanzonaError("--plot needs matplotlib: pip install 'canzona[plot]'.") from None
    return Figure, FigureCanvasAgg


def chart_paths(plan_file: Path, plot: Path, *, tp: bool) -> list[Path]:
    """The files ``inspect --plot`` writes, checked before any work.

    ``plot`` may be a file (its extension picks the format: png, pdf, svg, … as matplotlib writes
    them; none means ``.png``) or an existing folder (the chart is named after the plan there).
    With tp > 1 a second chart, the TP view, goes beside the first with ``-tp`` before the
    extension.

    Raises:
        CanzonaError: matplotlib missing, a format it cannot write, or a folder that is not there.
    """
    from canzona.planner import CanzonaError

    _, canvas = _figure_classes()
    formats = sorted(canvas.get_supported_filetypes())
    if plot.is_dir():
        stem = plan_file.name.removesuffix(".json").removesuffix(".plan")
        plot = plot / f"{stem}.png"
    elif not plot.suffix:
        plot = plot.with_name(plot.name + ".png")
    fmt = plot.suffix[1:].lower()
    if fmt not in formats:
        raise CanzonaError(f"--plot: matplotlib cannot write '.{fmt}' charts ('{plot}'); use one "
                           f"of: {', '.join('.' + f for f in formats)}.")
    folder = plot.parent if str(plot.parent) else Path(".")
    if not folder.is_dir():
        raise CanzonaError(f"--plot: cannot write chart '{plot}': folder '{folder}' does not exist.")
    return [plot] + ([plot.with_name(f"{plot.stem}-tp{plot.suffix}")] if tp else [])


def _save(fig, path: Path) -> None:
    from canzona.planner import CanzonaError

    try:
        fig.savefig(path, dpi=110, format=path.suffix[1:].lower())
    except OSError as exc:
        raise CanzonaError(f"cannot write chart to '{path}': {exc.strerror or exc}.") from None


def plot_plan(plan: Plan, path: Path) -> None:
    """A per-DP-index chart (FLOPs, optimizer state, reduce-scatter bytes)."""
    Figure, FigureCanvasAgg = _figure_classes()
    inp, m = plan.inputs, plan.metrics
    d = list(range(inp.dp))
    fig = Figure(figsize=(max(6.0, 0.18 * inp.dp + 3), 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    series = ((m.dp_flops, "optimizer FLOPs / step", 1e12, "TFLOP"),
              (m.dp_state_bytes, "optimizer state", 2.0 ** 30, "GiB"),
              (m.dp_reduce_scatter_bytes, "reduce-scatter grads", 2.0 ** 30, "GiB"))
    for ax, (vals, label, scale, unit) in zip(axes, series):
        ys = [v / scale for v in vals]
        ax.bar(d, ys, color="#4878a8")
        mean = sum(ys) / len(ys)
        ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.4g}")
        if label.startswith("optimizer FLOPs") and inp.cost_model == "flops":
            ax.axhline(m.certified_bound / scale, color="#c44e52", linewidth=1,
                       label=f"certified bound {m.certified_bound / scale:.4g}")
        ax.set_ylabel(f"{label}\n({unit})")
        ax.set_ylim(0, max(ys + [mean]) * 1.3 or 1.0)  # headroom for the legend
        ax.legend(loc="upper left", ncol=2, fontsize="small")
    axes[-1].set_xlabel("DP index" + ("" if inp.tp == 1 else f" (each bar: its {inp.tp} TP ranks summed)"))
    fig.suptitle(f"{inp.model} dp={inp.dp} tp={inp.tp} {inp.optimizer.name}: "
                 f"{inp.solver.strategy}, gap to bound {m.gap_to_bound:.2%}")
    _save(fig, path)


def wrote(what: str, path: Path) -> None:
    """``wrote chart FILE`` on stdout, after the report."""
    console.print(f"wrote {what} [bold]{escape(str(path))}[/]", highlight=False)


def flush() -> None:
    sys.stdout.flush()


# --- TP view (micro-groups) --------------------------------------------------------------------


def busiest_index(grid) -> int:
    """The DP index whose TP group holds the busiest GPU (lowest index on ties)."""
    return max(range(len(grid)), key=lambda d: (max(grid[d]), -d))


def _oversized_groups(plan: Plan) -> list:
    return [g for ix in plan.tp.indices for g in ix.groups if g.oversized]  # type: ignore[union-attr]


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
    over = _oversized_groups(plan)
    within = max((g.peak_gathered_bytes for ix in plan.tp.indices for g in ix.groups
                  if not g.oversized), default=0)
    line = (f"{m.micro_groups} micro-groups; peak gathered per host rank "
            f"{human_bytes(m.peak_gathered_bytes)}")
    if over:
        line += (f" in {len(over)} oversized groups (a single matrix larger than C_max "
                 f"{human_bytes(cap)}, alone in its group); the other groups peak at "
                 f"{human_bytes(within)} ≤ C_max")
    else:
        line += f" ≤ C_max {human_bytes(cap)}"
    console.print(line, highlight=False)


def tp_dict(plan: Plan, rows: list | None) -> dict | None:
    """The TP schedule part of ``canzona inspect --json`` (under ``tp_schedule``)."""
    if plan.tp is None:
        return None
    tp, m = plan.tp, plan.tp.metrics
    over = _oversized_groups(plan)
    return {
        "cmax_bytes": tp.cmax_bytes, "comm_dtype": tp.comm_dtype, "solver": tp.solver,
        "status": tp.status, "hardware": tp.hardware,
        "metrics": {"max_gpu_load": m.max_gpu_load, "mean_gpu_load": m.mean_gpu_load,
                    "max_over_mean": m.max_over_mean, "lb_gpu": m.lb_gpu,
                    "gap_to_lb_gpu": m.gap_to_lb_gpu, "micro_groups": m.micro_groups,
                    "peak_gathered_bytes": m.peak_gathered_bytes,
                    "peak_gathered_bytes_within_cmax": max(
                        (g.peak_gathered_bytes for ix in tp.indices for g in ix.groups
                         if not g.oversized), default=0),
                    "oversized_groups": len(over),
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
    return ["comm    |" + "".join(comm) + "|", "compute |" + "".join(comp) + f"| {end * 1e3:.2f} ms"]


def tp_report(plan: Plan, tp_rep: dict) -> None:
    """The TP section of ``canzona inspect``."""
    tp, m = plan.tp, plan.tp.metrics  # type: ignore[union-attr]
    cm = plan.inputs.cost_model
    console.rule("TP micro-groups")
    tp_summary(plan)
    grid = m.gpu_load
    top = max(max(r) for r in grid) or 1
    t = Table(title="Per-GPU load (rows: DP index d, columns: TP rank t; % of the busiest GPU)")
    t.add_column("d", justify="right")
    for k in range(len(grid[0])):
        t.add_column(f"t{k}", justify="right")
    t.add_column("all-to-all (busiest rank)", justify="right")
    busiest_d = busiest_index(grid)
    for d, r in enumerate(grid):
        cells = [(f"[bold]{x / top:.0%}[/]" if x == top else f"{x / top:.0%}") for x in r]
        t.add_row(str(d), *cells, human_bytes(max(m.all_to_all_bytes[d])))
    console.print(t)
    ix = tp.indices[busiest_d]
    g = Table(title=f"Micro-groups of the busiest TP group (d = {busiest_d}), in execution order")
    for col in ("group", "tasks", "peak gathered", "max rank load", "min rank load", "gather out"):
        g.add_column(col, justify="right")
    for grp in ix.groups:
        out = max(sum(v for h, v in enumerate(row) if h != t) for t, row in enumerate(grp.gather_send))
        g.add_row(str(grp.index) + (" (oversized)" if grp.oversized else ""), str(len(grp.tasks)),
                  human_bytes(grp.peak_gathered_bytes), load(max(grp.rank_load), cm),
                  load(min(grp.rank_load), cm), f"{out:,} el")
    console.print(g)
    console.print(f"modelled timeline, not measured (hardware profile '{escape(tp.hardware)}': "
                  "its peak FLOP/s × efficiency and intra-node bus bandwidth, see README; "
                  "gather of group i+1 overlaps compute of group i):", highlight=False)
    for line in _gantt(ix):
        console.print(line, highlight=False, markup=False)
    if tp_rep.get("baselines"):
        b = Table(title=f"TP baselines (per GPU; LB_gpu {load(m.lb_gpu, cm)})")
        for col in ("strategy", "max GPU load", "max/mean", "gap to LB_gpu"):
            b.add_column(col, justify="left" if col == "strategy" else "right")
        for x in tp_rep["baselines"]:
            b.add_row(x["name"], load(x["max_gpu_load"], cm), f"{x['max_over_mean']:.3f}",
                      f"{x['gap_to_lb_gpu']:.2%}", style="bold" if x["name"] == "canzona" else None)
        console.print(b)
        console.print("sc: every TP rank all-gathers and computes every matrix of its DP index "
                      "(Megatron's duplicated); canzona-greedy: the paper's DP greedy + TP greedy.",
                      style="dim", highlight=False)


def plot_tp(plan: Plan, path: Path) -> None:
    """Per-GPU load heat map and the busiest TP group's micro-group timeline."""
    Figure, FigureCanvasAgg = _figure_classes()
    tp, m = plan.tp, plan.tp.metrics  # type: ignore[union-attr]
    grid = m.gpu_load
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, height_ratios=[2, 1])
    im = ax1.imshow([[x / m.lb_gpu for x in r] for r in grid], aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=ax1, label="load / LB_gpu")
    ax1.set_xlabel("TP rank t")
    ax1.set_ylabel("DP index d")
    ax1.set_title(f"per-GPU load: max/LB_gpu {1 + m.gap_to_lb_gpu:.3f}, max/mean "
                  f"{m.max_over_mean:.3f}")
    d = busiest_index(grid)
    for g in tp.indices[d].groups:
        if not g.timeline_s:
            continue
        gs, ge, cs, ce, ss, se = (x * 1e3 for x in g.timeline_s)
        ax2.barh(1, ge - gs, left=gs, color="#4878a8")
        ax2.barh(1, se - ss, left=ss, color="#c44e52")
        ax2.barh(0, ce - cs, left=cs, color="#55a868", edgecolor="black")
        ax2.text((cs + ce) / 2, 0, str(g.index), ha="center", va="center", fontsize="small")
    ax2.set_yticks([0, 1], ["compute", "gather / scatter"])
    ax2.set_xlabel(f"modelled ms (hardware profile {tp.hardware}, not measured)")
    ax2.set_title(f"micro-groups of d = {d} (C_max {human_bytes(tp.cmax_bytes)})")
    _save(fig, path)
