"""Charts of ``canzona inspect --plot`` (matplotlib, imported only when a chart is asked for)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from canzona.planner import CanzonaError
from canzona.planner.report import busiest_index

from ._units import human_bytes

if TYPE_CHECKING:
    from canzona.planner.plan import Plan


def _figure_classes():
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
    stem = plan_file.name.removesuffix(".json").removesuffix(".plan")
    plot = resolve_chart(plot, stem)
    return [plot] + ([plot.with_name(f"{plot.stem}-tp{plot.suffix}")] if tp else [])


def resolve_chart(plot: Path, stem: str) -> Path:
    """The file a ``--plot`` value names: itself (no extension: ``.png``), or ``stem.png`` in an
    existing folder; checked before any work.

    Raises:
        CanzonaError: matplotlib missing, a format it cannot write, or a folder that is not there.
    """
    _, canvas = _figure_classes()
    formats = sorted(canvas.get_supported_filetypes())
    if plot.is_dir():
        plot = plot / f"{stem}.png"
    elif not plot.suffix:
        plot = plot.with_name(plot.name + ".png")
    fmt = plot.suffix[1:].lower()
    if fmt not in formats:
        raise CanzonaError(f"--plot: matplotlib cannot write '.{fmt}' charts ('{plot}'); use one "
                           f"of: {', '.join('.' + f for f in formats)}.")
    folder = plot.parent if str(plot.parent) else Path(".")
    if not folder.is_dir():
        raise CanzonaError(f"--plot: cannot write chart '{plot}': folder '{folder}' does not "
                           "exist.")
    return plot


def timeline_path(chart: Path) -> Path:
    """The per-rank timeline beside a chart: NAME-timeline.EXT."""
    return chart.with_name(f"{chart.stem}-timeline{chart.suffix}")


def write_charts(plan: Plan, paths: list[Path],
                 progress: Callable[[str], None] | None = None) -> None:
    """Write :func:`chart_paths`' files: the per-DP-index chart, then the TP view (tp > 1)."""
    say = progress or (lambda _phase: None)
    for k, path in enumerate(paths):
        say(f"chart {path.name}")
        (plot_plan if k == 0 else plot_tp)(plan, path)


def _save(fig, path: Path) -> None:
    try:
        fig.savefig(path, dpi=110, format=path.suffix[1:].lower())
    except OSError as exc:
        raise CanzonaError(f"cannot write chart to '{path}': {exc.strerror or exc}.") from None


#: Up to this many DP indices a chart draws a bar per index; above, sorted curves and
#: histograms, so that a chart stays readable (and under 3,000 px wide) at any scale.
MARKS_PER_RANK = 64


def plot_plan(plan: Plan, path: Path) -> None:
    """A per-DP-index chart (FLOPs, optimizer state, reduce-scatter bytes): a bar per index up
    to :data:`MARKS_PER_RANK` indices, above that each series sorted (busiest first) as a curve."""
    Figure, FigureCanvasAgg = _figure_classes()
    inp, m = plan.inputs, plan.metrics
    d = list(range(inp.dp))
    sorted_curves = inp.dp > MARKS_PER_RANK
    width = 10.0 if sorted_curves else max(6.0, 0.18 * inp.dp + 3)
    fig = Figure(figsize=(width, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    series = ((m.dp_flops, "optimizer FLOPs / step", 1e12, "TFLOP"),
              (m.dp_state_bytes, "optimizer state", 2.0 ** 30, "GiB"),
              (m.dp_reduce_scatter_bytes, "reduce-scatter grads", 2.0 ** 30, "GiB"))
    for ax, (vals, label, scale, unit) in zip(axes, series):
        ys = [v / scale for v in vals]
        if sorted_curves:
            ax.fill_between(d, sorted(ys, reverse=True), step="post", color="#4878a8")
        else:
            ax.bar(d, ys, color="#4878a8")
        mean = sum(ys) / len(ys)
        ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.4g}")
        if label.startswith("optimizer FLOPs") and inp.cost_model == "flops":
            ax.axhline(m.certified_bound / scale, color="#c44e52", linewidth=1,
                       label=f"certified bound {m.certified_bound / scale:.4g}")
        ax.set_ylabel(f"{label}\n({unit})")
        ax.set_ylim(0, max(ys + [mean]) * 1.3 or 1.0)  # headroom for the legend
        ax.legend(loc="upper left", ncol=2, fontsize="small")
    axes[-1].set_xlabel(("DP indices, each series sorted busiest first" if sorted_curves
                         else "DP index") + (
        "" if inp.tp == 1 else f" (each index: its {inp.tp} TP ranks summed)"))
    fig.suptitle(f"{inp.model} dp={inp.dp} tp={inp.tp} {inp.optimizer.name}: "
                 f"{inp.solver.strategy}, gap to bound {m.gap_to_bound:.2%}")
    _save(fig, path)


def plot_tp(plan: Plan, path: Path) -> None:
    """Per-GPU load heat map and the busiest TP group's micro-group timeline."""
    Figure, FigureCanvasAgg = _figure_classes()
    tp, m = plan.tp, plan.tp.metrics  # type: ignore[union-attr]
    grid = m.gpu_load
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, height_ratios=[2, 1])
    if len(grid) > MARKS_PER_RANK:  # a histogram of the GPUs' loads, not a cell per GPU
        ax1.hist([x / m.lb_gpu for r in grid for x in r], bins=40, color="#4878a8")
        ax1.set_xlabel("load / LB_gpu")
        ax1.set_ylabel(f"GPUs (of {len(grid) * len(grid[0])})")
    else:
        im = ax1.imshow([[x / m.lb_gpu for x in r] for r in grid], aspect="auto",
                        cmap="viridis")
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


# --- simulate / compare -----------------------------------------------------------------------

#: Colours of the critical-path parts (stacked bars) and of the streams (timelines).
_PARTS = (("compute", "compute", "#55a868"), ("tp_gather_scatter", "TP gather/scatter", "#8172b2"),
          ("dp_reduce", "DP reduce (exposed)", "#4878a8"),
          ("dp_gather", "DP all-gather (exposed)", "#c44e52"))
_STREAMS = {"backward": "#cccccc", "compute": "#55a868", "tp": "#8172b2", "dp": "#4878a8",
            "wait": "#eeeeee"}


def plot_compare(comp, path: Path) -> None:
    """One stacked bar per strategy: the optimizer step's critical path (compute, exposed TP and
    DP communication); inexact strategies hatched."""
    Figure, FigureCanvasAgg = _figure_classes()
    runs = comp.runs
    fig = Figure(figsize=(max(6.0, 1.3 * len(runs) + 2), 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    x = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for key, label, colour in _PARTS:
        ys = [max(0.0, r.sim.breakdown()[key]) * 1e3 for r in runs]
        bars = ax.bar(x, ys, bottom=bottom, color=colour, label=label)
        for b, r in zip(bars, runs):
            if not r.exact:
                b.set_hatch("//")
        bottom = [b + y for b, y in zip(bottom, ys)]
    for k, r in enumerate(runs):
        ax.text(k, bottom[k], f"{r.step_s * 1e3:.3g} ms", ha="center", va="bottom",
                fontsize="small")
    ax.set_xticks(x, [r.name + ("" if r.exact else "\n(not exact)") for r in runs])
    ax.set_ylabel("predicted optimizer step (ms)")
    ax.set_ylim(0, max(bottom + [1e-9]) * 1.15)
    ax.legend(loc="upper right", fontsize="small")
    ep = f" ep={comp.ep}" if comp.ep > 1 else ""
    ax.set_title(f"{comp.model} dp={comp.dp} tp={comp.tp}{ep} on {comp.hardware}: forward+backward "
                 f"{comp.forward_backward_s * 1e3:.3g} ms (modelled, not measured)",
                 fontsize="medium")
    _save(fig, path)


def plot_timeline(sim, path: Path, *, ranks: int = 8, title: str = "") -> None:
    """The ranks done last (critical first), each a row per stream: backward, DP collectives,
    TP all-to-alls, compute and waiting, on the simulated clock."""
    Figure, FigureCanvasAgg = _figure_classes()
    chosen = [sim.ranks[sim.critical_rank]] + [r for r in sim.top_ranks(ranks)
                                                if r.rank != sim.critical_rank][:ranks - 1]
    rows = ("compute", "tp", "dp")
    fig = Figure(figsize=(11, 1.0 + 0.75 * len(chosen)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ticks, labels = [], []
    for i, r in enumerate(chosen):
        base = (len(chosen) - 1 - i) * (len(rows) + 1)
        for j, stream in enumerate(rows):
            y = base + len(rows) - 1 - j
            ticks.append(y)
            labels.append(f"rank {r.rank} {stream}" + (" (critical)" if i == 0 and j == 0 else ""))
        for st in sim.rank_timeline(r.rank):
            row = {"backward": "compute", "wait": "compute"}.get(st.stream, st.stream)
            if row not in rows or st.seconds <= 0:
                continue
            y = base + len(rows) - 1 - rows.index(row)
            ax.barh(y, st.seconds * 1e3, left=st.start * 1e3, height=0.8,
                    color=_STREAMS.get(st.name if st.name == "backward" else st.stream, "#999999"),
                    edgecolor="white", linewidth=0.3)
    ax.axvline(sim.backward_s * 1e3, color="black", linewidth=0.8, linestyle="--")
    ax.axvline(sim.params_ready * 1e3, color="#c44e52", linewidth=0.8)
    ax.set_yticks(ticks, labels, fontsize="x-small")
    ax.set_xlabel("simulated ms from the start of backward (dashed: backward ends; red: "
                  "parameters ready)")
    handles = [ax.barh(0, 0, color=c, label=k) for k, c in _STREAMS.items()]
    ax.legend(handles=handles, loc="lower right", fontsize="x-small", ncol=5)
    ax.set_title(title or f"{sim.label}: optimizer step {sim.step_s * 1e3:.3g} ms",
                 fontsize="medium")
    _save(fig, path)
