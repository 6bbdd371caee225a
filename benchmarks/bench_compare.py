"""What the simulator predicts at the paper's scale and beyond.

    python benchmarks/bench_compare.py --paper                # the paper's configuration
    python benchmarks/bench_compare.py --scaling              # dp × tp × model sweep, PNG
    python benchmarks/bench_compare.py --paper --scaling --write-readme

Both parts call :func:`canzona.planner.strategies.compare` (torch-free): every strategy of one
model, sizes and hardware profile simulated alike, forward/backward from 6·N_active·tokens at a
stated MFU (one 4096-token sequence per DP rank) unless a measured time is given. canzona's
plans here are the paper's comparisons' (:func:`paper_options`: FLOPs cost, whole matrices).

* ``--paper``: Qwen3-32B, 256 GPUs, dp 32, tp 8, Muon, the H800 profile, next to the figures the
  Canzona paper (arXiv 2602.06079) measured there, in two settings: (a) the defaults (MFU 0.4,
  all-gathers not overlapped with the next forward) and (b) forward/backward set to the paper's
  measured 0.811 s with the ZeRO-1 all-gathers overlapped with the next forward (Megatron's
  ``overlap_param_gather``; the layer-wise optimizer's own all-gather is waited for in its step).
  The paper times the layer-wise optimizer's exposed all-reduce inside forward/backward (0.998 s
  against canzona's 0.811 s); the ``paper accounting`` rows do the same: step without the
  exposed DP reduce.
* ``--scaling``: the predicted optimizer step of every strategy over qwen3-1.7b … qwen3-32b at
  dp 8 … 256 and tp 1, 4, 8, and Qwen3-235B-A22B with ep 8; a table and
  ``benchmarks/figures/simulate_scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from canzona.planner import CanzonaError, DPOptions, ParallelSizes, TPOptions
from canzona.planner.strategies import STRATEGIES, compare

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
FIGURE = HERE / "figures" / "simulate_scaling.png"

#: The paper's measurements: Qwen3-32B, 256 H800, dp 32, tp 8, Muon.
PAPER = {"layerwise_step": 0.383, "canzona_step": 0.066, "step_ratio": 5.8,
         "layerwise_iter": 1.381, "canzona_iter": 0.877, "iter_ratio": 1.57,
         "layerwise_fb": 0.998, "canzona_fb": 0.811,
         "layerwise_flops": 3.24, "canzona_flops": 1.43,
         "layerwise_mem": 2.46, "canzona_mem": 1.11, "dp16_step_ratio": 8.3}
FLAG = 0.30  # a prediction this far (relative) from the paper's figure is flagged

MODELS = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
DPS = (8, 16, 32, 64, 128, 256)
TPS = (1, 4, 8)
MOE = ("qwen3-235b-a22b", ((8, 1), (16, 1), (32, 1), (64, 1), (16, 4), (32, 4), (64, 4), (128, 4)))


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _flag(pred: float, paper: float) -> str:
    return "⚑" if abs(pred / paper - 1) > FLAG else ""


# --- the paper's configuration --------------------------------------------------------------------


def paper(hardware: str) -> dict:
    out = {}
    for key, kw in (("a", {}), ("b", {"forward_backward_s": PAPER["canzona_fb"],
                                      "overlap_param_gather": True})):
        t0 = time.perf_counter()
        c = compare("qwen3-32b", ParallelSizes(dp=32, tp=8), hardware=hardware, **kw,
                    **paper_options(hardware))
        say(f"paper setting {key}: {time.perf_counter() - t0:.1f} s")
        out[key] = c
    t0 = time.perf_counter()
    out["dp16"] = compare("qwen3-32b", ParallelSizes(dp=16, tp=8), hardware=hardware,
                          forward_backward_s=PAPER["canzona_fb"], overlap_param_gather=True,
                          strategies=("layerwise", "canzona"), **paper_options(hardware))
    say(f"paper dp16: {time.perf_counter() - t0:.1f} s")
    return out


def paper_steps(res: dict) -> tuple[float, float]:
    """The layer-wise and canzona optimizer steps of setting (b) in the paper's accounting: the
    exposed gradient reduction belongs to forward/backward, not to the optimizer step."""
    lw, cz = res["b"].run("layerwise"), res["b"].run("canzona")
    return lw.sim.reduced_step_s, cz.sim.reduced_step_s


def paper_tables(res: dict, hardware: str) -> str:
    a, b = res["a"], res["b"]
    lines = [
        "| strategy | step (a) | iteration (a) | step (b) | iteration (b) | (b) compute | TP | "
        "DP reduce exposed | DP gather exposed | DP MB sent/rank | DP FLOPs max/mean | "
        "DP state max/mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ra, rb in zip(a.runs, b.runs):
        bd = rb.sim.breakdown()
        name = ra.name if ra.exact else f"{ra.name} (not exact)"
        lines.append(f"| {name} | {_ms(ra.step_s)} | {_ms(ra.iteration_s)} | {_ms(rb.step_s)} | "
                     f"{_ms(rb.iteration_s)} | {_ms(bd['compute'])} | "
                     f"{_ms(bd['tp_gather_scatter'])} | {_ms(bd['dp_reduce'])} | "
                     f"{_ms(bd['dp_gather'])} | {rb.sent_bytes / 1e6:,.0f} | "
                     f"{rb.flops_balance:.2f} | {rb.state_balance:.2f} |")
    lw_a, cz_a = a.run("layerwise"), a.run("canzona")
    lw, cz = b.run("layerwise"), b.run("canzona")
    lw_red, cz_red = lw.sim.breakdown()["dp_reduce"], cz.sim.breakdown()["dp_reduce"]
    lw_step_p, cz_step_p = paper_steps(res)
    lw_fb_p = b.forward_backward_s + lw_red
    d16 = res["dp16"]
    d16_ratio = ((d16.run("layerwise").step_s - d16.run("layerwise").sim.breakdown()["dp_reduce"])
                 / (d16.run("canzona").step_s - d16.run("canzona").sim.breakdown()["dp_reduce"]))
    plan = b.plan
    rows = [
        ("layer-wise optimizer step (s)", PAPER["layerwise_step"], lw_step_p,
         f"(b), paper accounting: {_ms(lw.step_s)} ms minus its exposed all-reduce "
         f"{_ms(lw_red)} ms; (a): {_ms(lw_a.step_s)} ms"),
        ("canzona optimizer step (s)", PAPER["canzona_step"], cz_step_p,
         f"(b), paper accounting: {_ms(cz.step_s)} ms minus its exposed reduce {_ms(cz_red)} ms;"
         f" (a): {_ms(cz_a.step_s)} ms"),
        ("optimizer step ratio layer-wise → canzona", PAPER["step_ratio"], lw_step_p / cz_step_p,
         f"(b), paper accounting; whole steps (b) {lw.step_s / cz.step_s:.2f}×, "
         f"(a) {lw_a.step_s / cz_a.step_s:.2f}×"),
        ("layer-wise forward/backward (s)", PAPER["layerwise_fb"], lw_fb_p,
         f"0.811 s given + its exposed all-reduce {_ms(lw_red)} ms"),
        ("layer-wise iteration (s)", PAPER["layerwise_iter"], lw.iteration_s,
         f"(b); (a): {lw_a.iteration_s:.3f} s at MFU 0.4 (forward/backward "
         f"{a.forward_backward_s:.3f} s)"),
        ("canzona iteration (s)", PAPER["canzona_iter"], cz.iteration_s,
         f"(b); (a): {cz_a.iteration_s:.3f} s"),
        ("iteration ratio layer-wise → canzona", PAPER["iter_ratio"],
         lw.iteration_s / cz.iteration_s, f"(b); (a): {lw_a.iteration_s / cz_a.iteration_s:.2f}×"),
        ("layer-wise DP FLOPs max/mean", PAPER["layerwise_flops"], lw.flops_balance,
         "megatron-core's shard_params (ascending size, ping-pong) over whole parameters; "
         f"layerwise-lpt (LPT on max(m,n)·min(m,n)²): {b.run('layerwise-lpt').flops_balance:.2f}"),
        ("canzona DP FLOPs max/mean", PAPER["canzona_flops"], cz.flops_balance,
         f"per GPU (TP): {plan.tp.metrics.max_over_mean:.2f} (at LB_gpu: "
         f"{plan.tp.metrics.gap_to_lb_gpu:.2%} gap)" if plan and plan.tp else ""),
        ("layer-wise DP memory max/mean", PAPER["layerwise_mem"], lw.state_balance,
         "optimizer state per DP index"),
        ("canzona DP memory max/mean", PAPER["canzona_mem"], cz.state_balance,
         "optimizer state per DP index"),
        ("dp16 tp8 optimizer step ratio", PAPER["dp16_step_ratio"], d16_ratio,
         "(b)'s settings, paper accounting"),
    ]
    out = [
        f"Qwen3-32B, 256 GPUs (dp 32 × tp 8), Muon, hardware profile `{hardware}`. Setting (a): "
        f"forward/backward {a.forward_backward_s:.3f} s (6·N_active·131,072 tokens at MFU 0.4), "
        "all-gathers not overlapped. Setting (b): forward/backward 0.811 s (the paper's measured "
        "canzona figure), ZeRO-1 all-gathers overlapped with the next forward. Milliseconds.",
        "",
        *lines,
        "",
        "| figure | paper | predicted | ⚑ > 30 % off | how |",
        "|---|---:|---:|:---:|---|",
    ]
    for label, p, x, how in rows:
        out.append(f"| {label} | {p:g} | {x:.3g} | {_flag(x, p)} | {how} |")
    return "\n".join(out)


PAPER_NOTES = """\
Reading it (⚑: more than 30 % from the paper's figure; the causes found):

- **Steps and iterations.** The paper times the layer-wise baseline's exposed all-reduce inside
  forward/backward (0.998 s against canzona's 0.811 s), so its 0.383 s optimizer step is compute,
  TP traffic and the all-gather. Counted the same way (*paper accounting*), the model gives the
  layer-wise step and forward/backward within 5 % of the paper's, and both iterations within 3 %.
- **canzona's step** is predicted 13 % below the measured 0.066 s; term by term (every task at
  its roofline, `canzona.planner.cost.Roofline`): its busiest GPU hosts the fused gate/up
  projection (51200 × 5120): 28.2 TFLOP of Newton–Schulz at 60 % of the bf16 peak is 47.6 ms,
  and Muon's element-wise passes (54 bytes per element: momentum, Nesterov blend, cast, norm,
  update) over 3.35 TB/s add 4.2 ms; TP gathers and scatters not hidden add 5.7 ms. Left out:
  kernel launches, and Newton–Schulz below 60 % of peak on that shape. The error carries into
  the step ratio (6.95× against 5.8×) and, with the layer-wise step about 4 % above the
  paper's, into the dp 16 ratio (10.5× against ≈ 8.3×): canzona's predicted step is the same
  at dp 16 as at dp 32 (the same matrix bounds it) while the layer-wise compute doubles.
- **Whole steps** (every exposed collective counted, what `canzona compare` prints): 9.0× in (b)
  and 2.1× in (a). At MFU 0.4 backward lasts 0.165 s, too short to hide a 32B model's gradient
  collectives over one 400 Gb/s NIC per GPU (the DP group spans 32 nodes); they then dominate every
  strategy's step.
- **DP FLOPs balance** (⚑ both): not reproduced. Qwen3-32B has 64 layers × 4 matrices;
  megatron-core's ping-pong by size (`layerwise`) and the LPT on max(m,n)·min(m,n)²
  (`layerwise-lpt`) both give each of the 32 ranks two layers' worth of every kind: max/mean 1.00 in
  FLOPs. canzona's plan is at its certified bound per DP index (1.00) and at LB_gpu per GPU (2.04,
  the gate/up matrix alone). Neither count gives 3.24 or 1.43; the paper prints
  one pair for DP and TP. The **memory** figures agree: the dealings balance sizes or a cost
  proxy, not the optimizer state (2.36 against 2.46); canzona's state 1.00 against 1.11.
"""


def paper_options(hardware: str) -> dict:
    """The paper's comparisons' canzona plans: FLOPs cost, whole matrices (the paper's canzona
    shares none; the defaults, roofline and ``--share auto``, are canzona's own)."""
    return {"dp_options": DPOptions(cost="flops"),
            "tp_options": TPOptions(hardware=hardware, share="off")}


# --- scaling ------------------------------------------------------------------------------------


def scaling(hardware: str, quick: bool = False) -> tuple[list[dict], list[str]]:
    rows, skipped = [], []
    cases = [(m, dp, tp, 1) for m in MODELS for tp in TPS for dp in DPS]
    cases += [(MOE[0], dp, tp, 8) for dp, tp in MOE[1]]
    if quick:
        cases = [c for c in cases if c[1] <= 32][:6]
    for m, dp, tp, ep in cases:
        t0 = time.perf_counter()
        try:
            c = compare(m, ParallelSizes(dp=dp, tp=tp, ep=ep), hardware=hardware,
                        **paper_options(hardware))
        except CanzonaError as exc:
            skipped.append(f"{m} dp{dp} tp{tp}" + (f" ep{ep}" if ep > 1 else "")
                           + f" ({str(exc).split(';')[0]})")
            say(f"skip {m} dp{dp} tp{tp} ep{ep}: {exc}")
            continue
        wall = time.perf_counter() - t0
        say(f"{m} dp{dp} tp{tp} ep{ep}: {wall:.1f} s")
        rows.append({"model": m, "dp": dp, "tp": tp, "ep": ep, "gpus": dp * tp,
                     "forward_backward_s": c.forward_backward_s, "plan_s": wall,
                     "step_s": {r.name: r.step_s for r in c.runs},
                     "iteration_s": {r.name: r.iteration_s for r in c.runs}})
    return rows, skipped


SCALING_NOTES = """\
Reading it: every step here is dominated by the DP collectives once the DP group leaves the node
(dp·tp > 8: one 400 Gb/s NIC per GPU), because at MFU 0.4 backward is too short to hide them; the
compute is what separates the strategies. `sc` computes every matrix on every rank; `layerwise` and
`layerwise-lpt` all-reduce (2× a reduce-scatter's bytes) and wait for their all-gather;
`megatron-packed` keeps the stock even collectives but pads, and its last buckets (fewer matrices
than ranks) pad more as dp grows. canzona-greedy beats canzona where the planner keeps compute
balance first: at tp 1 and dp ≥ 128 every bucket has up to 128–256 per-root owners, each charged 2α
(the model does not credit NCCL's coalescing of those calls, so it is conservative there), and the
planner holds the busiest compute within 0.5 points of the bound at tp 1 instead of concentrating
owners as the greedy's unbalanced cuts do. For Qwen3-235B-A22B at tp 1, ep 8, `megatron-packed` (dp
16) and the inexact `zero1` predict shorter steps than canzona: expert buckets are sharded over only
dp/ep = 2–8 ranks, where even collectives are cheap and canzona's per-root calls are not.
"""


def scaling_table(rows: list[dict], skipped: list[str]) -> str:
    head = ("| model | dp | tp | ep | GPUs | " + " | ".join(
        s if s != "zero1" else "zero1 (not exact)" for s in STRATEGIES)
        + " | layerwise / canzona | canzona-greedy / canzona |")
    lines = [head, "|---|---:|---:|---:|---:|" + "---:|" * (len(STRATEGIES) + 2)]
    for r in rows:
        s = r["step_s"]
        lines.append(f"| {r['model']} | {r['dp']} | {r['tp']} | {r['ep']} | {r['gpus']} | "
                     + " | ".join(_ms(s[k]) for k in STRATEGIES)
                     + f" | {s['layerwise'] / s['canzona']:.2f}× | "
                       f"{s['canzona-greedy'] / s['canzona']:.3f}× |")
    if skipped:
        lines += ["", "Not valid for the model (the planner's message): " + "; ".join(skipped)
                  + "."]
    slower = [r for r in rows if r["step_s"]["canzona"] > r["step_s"]["canzona-greedy"]]
    lw = [r["step_s"]["layerwise"] / r["step_s"]["canzona"] for r in rows]
    lines += ["", f"layer-wise / canzona: {min(lw):.2f}× to {max(lw):.2f}× over {len(rows)} "
              f"configurations. canzona-greedy is predicted faster than canzona in "
              f"{len(slower)} of "
              f"{len(rows)}" + (": " + ", ".join(
                  f"{r['model']} dp{r['dp']} tp{r['tp']}" + (f" ep{r['ep']}" if r["ep"] > 1 else "")
                  + f" ({r['step_s']['canzona'] / r['step_s']['canzona-greedy'] - 1:.1%})"
                  for r in slower) if slower else "") + "."]
    return "\n".join(lines)


def scaling_figure(rows: list[dict], path: Path, hardware: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    models = [m for m in MODELS + (MOE[0],) if any(r["model"] == m for r in rows)]
    fig = Figure(figsize=(4.0 * len(TPS), 3.2 * len(models) + 0.8), layout="constrained")
    axes = fig.subplots(len(models), len(TPS), squeeze=False, sharex=True)
    colours = {"sc": "#8c8c8c", "layerwise": "#c44e52", "layerwise-lpt": "#8172b3",
               "megatron-packed": "#dd8452",
               "zero1": "#bbbbbb", "canzona-greedy": "#4878a8", "canzona": "#55a868"}
    for i, m in enumerate(models):
        for j, tp in enumerate(TPS):
            ax = axes[i][j]
            pts = sorted((r for r in rows if r["model"] == m and r["tp"] == tp),
                         key=lambda r: r["gpus"])
            ep = max((r["ep"] for r in pts), default=1)
            if not pts:
                ax.text(0.5, 0.5, f"{m}: tp {tp} not valid", ha="center", va="center",
                        transform=ax.transAxes, fontsize="small")
            for s in STRATEGIES:
                ax.plot([r["gpus"] for r in pts], [r["step_s"][s] * 1e3 for r in pts],
                        marker="o", markersize=3, color=colours[s],
                        linestyle=":" if s == "zero1" else "-",
                        label=s if s != "zero1" else "zero1 (not exact)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{m}, tp {tp}" + (f", ep {ep}" if ep > 1 else ""), fontsize="medium")
            if j == 0:
                ax.set_ylabel("optimizer step (ms)")
            if i == len(models) - 1:
                ax.set_xlabel("GPUs (dp · tp)")
    axes[0][0].legend(fontsize="x-small")
    fig.suptitle(f"Predicted optimizer step per strategy ({hardware}, MFU 0.4, one 4096-token "
                 "sequence per DP rank; modelled, not measured)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


# --- output -------------------------------------------------------------------------------------


def _section(body: str, title: str, text: str) -> str:
    block = f"{title}\n\n{text.rstrip()}\n"
    pat = re.compile(rf"{re.escape(title)}\n.*?(?=\n## |\Z)", re.S)
    if pat.search(body):
        return pat.sub(lambda _m: block, body)
    return body.rstrip("\n") + "\n\n" + block


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paper", action="store_true")
    ap.add_argument("--scaling", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a few scaling cases (a smoke run)")
    ap.add_argument("--hardware", default="h800")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--write-readme", action="store_true")
    args = ap.parse_args(argv)
    if not (args.paper or args.scaling):
        ap.error("choose --paper, --scaling or both")
    sections, dump = [], {}
    if args.paper:
        t0 = time.perf_counter()
        res = paper(args.hardware)
        text = (f"`python benchmarks/bench_compare.py --paper --hardware {args.hardware}` "
                f"({time.perf_counter() - t0:.0f} s).\n\n" + paper_tables(res, args.hardware)
                + "\n\n" + PAPER_NOTES)
        print(text)
        sections.append(("## Simulator: the paper's configuration", text))
        dump["paper"] = {k: c.to_dict() for k, c in res.items()}
    if args.scaling:
        t0 = time.perf_counter()
        rows, skipped = scaling(args.hardware, args.quick)
        wall = time.perf_counter() - t0
        scaling_figure(rows, FIGURE, args.hardware)
        text = (f"`python benchmarks/bench_compare.py --scaling --hardware {args.hardware}` "
                f"({wall:.0f} s for {len(rows)} configurations). Predicted optimizer step in ms "
                f"(end of backward → parameters ready), Muon, MFU 0.4, one 4096-token sequence "
                "per DP rank, all-gathers not overlapped.\n\n"
                f"![predicted optimizer step per strategy](figures/{FIGURE.name})\n\n"
                + scaling_table(rows, skipped) + "\n\n" + SCALING_NOTES)
        print(text)
        sections.append(("## Simulator: scaling", text))
        dump["scaling"] = rows
    if args.json:
        args.json.write_text(json.dumps(dump, indent=1))
    if args.write_readme:
        body = README.read_text()
        for title, text in sections:
            body = _section(body, title, text)
        README.write_text(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
