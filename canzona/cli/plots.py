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
