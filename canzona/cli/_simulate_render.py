"""Terminal output of ``canzona simulate``: the step's breakdown, the critical rank, the ranks
done last (the simulation itself is :mod:`canzona.planner.simulate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from ._render import console

if TYPE_CHECKING:
    from canzona.planner.hardware import HardwareProfile
    from canzona.planner.simulate import StepSim

_LABELS = {
    "compute": "compute (critical rank)",
    "tp_gather_scatter": "TP gather/scatter (exposed, incl. waiting)",
    "dp_reduce": "DP reduce (not hidden by backward)",
    "dp_gather": "DP all-gather (exposed)",
}
_HIDDEN = {
    "dp_reduce_behind_backward": "DP reduce behind backward",
    "tp_behind_compute": "TP all-to-alls behind compute",
    "dp_gather_behind_forward": "DP all-gather behind next forward",
}


def ms(x: float) -> str:
    """Seconds as milliseconds, three decimals."""
    return f"{x * 1e3:,.3f} ms"


def simulate_json(sim: StepSim, hw: HardwareProfile, plan_file: str, *, how: str = "") -> dict:
    """What ``--json`` prints: the plan, the profile, the forward/backward the step runs behind,
    both step figures and the whole simulation."""
    return {"plan": plan_file,
            "hardware": {"name": hw.name, "version": hw.version,
                         "gpus_per_node": hw.gpus_per_node},
            "forward_backward": {"forward_s": sim.forward_s, "backward_s": sim.backward_s,
                                 "how": how},
            "step_s": sim.step_s, "reduced_step_s": sim.reduced_step_s,
            "simulation": sim.to_dict()}


def simulate_view(sim: StepSim, hw: HardwareProfile, *, top: int = 5, how: str = "") -> None:
    """The step (whole, and after the gradients are reduced), the breakdown table, what is
    hidden, the critical rank and the ranks done last."""
    step = sim.step_s
    console.print(f"[bold]{escape(sim.label)}[/] on [bold]{escape(hw.name)}[/] "
                  f"v{hw.version}: predicted optimizer step [bold]{ms(step)}[/] whole (end of "
                  f"backward → parameters ready), [bold]{ms(sim.reduced_step_s)}[/] after the "
                  "gradients are reduced (the paper's accounting)", highlight=False)
    console.print(f"behind forward {ms(sim.forward_s)} and backward {ms(sim.backward_s)}"
                  + (f": {escape(how)}" if how else ""), highlight=False)
    t = Table(title="Critical path", title_justify="left")
    t.add_column("part")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    for k, v in sim.breakdown().items():
        t.add_row(_LABELS[k], ms(v), f"{100 * v / step:.1f} %" if step > 0 else "–")
    t.add_row("[bold]optimizer step[/]", f"[bold]{ms(step)}[/]", "100.0 %" if step > 0 else "–")
    console.print(t)

    h = Table(title="Overlapped (hidden) communication", title_justify="left")
    h.add_column("what")
    h.add_column("hidden", justify="right")
    h.add_column("of total", justify="right")
    totals = {"dp_reduce_behind_backward": sim.dp_reduce_total,
              "tp_behind_compute": sim.ranks[sim.critical_rank].tp_comm_s,
              "dp_gather_behind_forward": sim.dp_gather_total}
    for k, v in sim.hidden().items():
        h.add_row(_HIDDEN[k], ms(v), ms(totals[k]))
    console.print(h)

    c = sim.ranks[sim.critical_rank]
    console.print(f"critical rank: [bold]{c.rank}[/] (DP index {c.dp_index}, TP rank "
                  f"{c.tp_rank}), done {ms(c.done - sim.backward_s)} after backward",
                  highlight=False)
    r = Table(title=f"Ranks done last (top {min(top, len(sim.ranks))} of {len(sim.ranks)})",
              title_justify="left")
    for col in ("rank", "dp", "tp"):
        r.add_column(col, justify="right")
    for col in ("waits reduces", "TP groups", "matrices", "AdamW", "TP comm", "idle", "done"):
        r.add_column(col, justify="right")
    for x in sim.top_ranks(top):
        r.add_row(str(x.rank), str(x.dp_index), str(x.tp_rank),
                  ms(x.step_start - sim.backward_s), ms(x.group_compute_s), ms(x.matrix_s),
                  ms(x.adamw_s), ms(x.tp_comm_s), ms(x.span - x.compute_s),
                  ms(x.done - sim.backward_s))
    console.print(r)
    for n in sim.notes:
        console.print(f"[dim]{escape(n)}[/]", highlight=False)


# --- canzona compare ------------------------------------------------------------------------------


def _n(x: float) -> str:
    """Seconds as milliseconds in a table cell."""
    v = x * 1e3
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"


def compare_json(comp) -> dict:
    """What ``compare --json`` prints: every strategy's simulation (per-rank rows included)."""
    return comp.to_dict(stages=False)


def compare_view(comp) -> None:
    """Every strategy: predicted step and iteration, the critical path's parts, what is hidden,
    bytes, balance, the critical rank."""
    from canzona.planner.strategies import CANZONA, DESCRIPTIONS

    ep = f" ep={comp.ep}" if comp.ep > 1 else ""
    ov = ("all-gathers overlap the next forward" if comp.overlap_param_gather
          else "all-gathers not overlapped")
    console.print(f"[bold]{escape(comp.model)}[/] dp={comp.dp} tp={comp.tp}{ep} on "
                  f"[bold]{escape(comp.hardware)}[/]: forward+backward "
                  f"{ms(comp.forward_backward_s)} "
                  + ("(given)" if comp.forward_backward_given else
                     f"(6·N_active·{comp.tokens:,} tokens at MFU {comp.mfu:g})")
                  + f"; {ov}", highlight=False)
    base = next((r for r in comp.runs if r.name == CANZONA), None)
    t = Table(title="Predicted per iteration, ms (modelled, not measured); the step's critical "
                    "path = compute + TP + DP reduce + DP gather", title_justify="left")
    for col in ("strategy", "step", "paper", "iter", "×cz", "compute", "TP", "DP red",
                "DP gath", "hidden", "MB", "FLOPs", "state", "crit"):
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for r in comp.runs:
        b = r.sim.breakdown()
        name = r.name if r.exact else f"{r.name} [red]✗[/]"
        rel = f"{r.step_s / base.step_s:.2f}" if base is not None and base.step_s > 0 else "–"
        t.add_row(name, _n(r.step_s), _n(r.sim.reduced_step_s), _n(r.iteration_s), rel,
                  _n(b["compute"]),
                  _n(b["tp_gather_scatter"]), _n(b["dp_reduce"]), _n(b["dp_gather"]),
                  _n(r.sim.hidden()["dp_reduce_behind_backward"]),
                  f"{r.sent_bytes / 1e6:,.0f}", f"{r.flops_balance:.2f}",
                  f"{r.state_balance:.2f}", str(r.sim.critical_rank))
    console.print(t)
    console.print("[dim]step: the whole optimizer step (end of backward → parameters ready); "
                  "paper: the step from the gradients reduced on (the paper's accounting: the "
                  "exposed DP reduce counts in backward); ×cz: step / canzona's; hidden: DP "
                  "reduce behind backward; MB: DP bytes the busiest rank sends per iteration; "
                  "FLOPs, state: max/mean over DP indices; crit: the rank done last[/]",
                  highlight=False)
    console.print("[dim]✗: not the exact optimizer[/]", highlight=False)
    share = comp.canzona_share
    for r in comp.runs:
        note = f" (matrices shared: {share})" if r.name == CANZONA and share != "off" else ""
        console.print(f"[dim]{r.name}: {escape(DESCRIPTIONS[r.name] + note)}[/]", highlight=False)
    if comp.runs:
        for n in comp.runs[-1].sim.notes[:2]:
            console.print(f"[dim]{escape(n)}[/]", highlight=False)


def compare_pipeline_view(comp) -> None:
    """Every strategy on a pipeline: its 1F1B iteration, the step beyond the forwards and
    backwards, the critical stage and each stage's step."""
    from canzona.planner.strategies import CANZONA, DESCRIPTIONS

    first = comp.stages[0]
    ep = f" ep={first.ep}" if first.ep > 1 else ""
    console.print(f"[bold]{escape(first.model)}[/] pp={comp.pp} × dp={first.dp} tp={first.tp}"
                  f"{ep} on [bold]{escape(first.hardware)}[/]: 1F1B over {comp.microbatches} "
                  f"microbatches; each stage's forward+backward "
                  + ", ".join(ms(x) for x in comp.forward_backward_s), highlight=False)
    base = next((sim for n, sim in comp.runs if n == CANZONA), None)
    t = Table(title="Predicted per iteration, ms (modelled, not measured); step: from the last "
                    "backward's end to the slowest stage's parameters ready",
              title_justify="left")
    cols = ["strategy", "iter", "step", "×cz", "crit"] + [f"stage {s}" for s in range(comp.pp)]
    for col in cols:
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for name, sim in comp.runs:
        label = name if first.run(name).exact else f"{name} [red]✗[/]"
        rel = f"{sim.step_s / base.step_s:.2f}" if base is not None and base.step_s > 0 else "–"
        t.add_row(label, _n(sim.iteration_s), _n(sim.step_s), rel, str(sim.critical_stage),
                  *(_n(st.step_s) for st in sim.steps))
    console.print(t)
    console.print("[dim]iter: the 1F1B iteration; step: what the optimizer adds beyond the "
                  "forwards and backwards; ×cz: step / canzona's; crit: the stage done last; "
                  "stage s: that stage's optimizer step behind its own last backward[/]",
                  highlight=False)
    console.print("[dim]✗: not the exact optimizer[/]", highlight=False)
    for name, _ in comp.runs:
        console.print(f"[dim]{name}: {escape(DESCRIPTIONS[name])}[/]", highlight=False)
