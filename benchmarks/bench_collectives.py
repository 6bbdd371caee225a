"""Collectives, a method per bucket: modelled bytes and time per method, and a gloo measurement.

    python benchmarks/bench_collectives.py --model-figures [--hardware h800 h100]
    python benchmarks/bench_collectives.py --sweep [--hardware h800]
    python benchmarks/bench_collectives.py --measure [--dim 256 --layers 2 --bucket-size 200000
                                                      --rounds 6]
    … add --markdown (README tables) or --json (machine-readable) to any of them.

Parts A and B; the flags combine (they run in the order above).

A. Torch-free, from the planner's communication model (``canzona.planner.comm``):

* ``--model-figures``: qwen3-32b dp32 tp8, qwen3-8b dp64 tp1 and qwen3-1.7b dp8 tp1 (Muon,
  default options, the ``--hardware`` profile). Each default plan's buckets are costed with every
  method forced on every bucket (``equal`` only moves equal slices: elsewhere ``padded``, the
  same stock calls on padded slices, and the row says on how many buckets), with the plan's own
  mix (the ``method`` it records per bucket) and with the model's fastest per bucket. Figures are
  ratios against ZeRO-1's even reduce-scatter/all-gather of the same buckets: *bytes* = the most
  bytes any rank sends per iteration (reduce + gather, ``CommSummary.max_sent`` /
  ``zero1_max_sent``), *time* = predicted collective time of the busiest DP index (``seconds`` /
  ``zero1_seconds``), *worst bucket* = the largest over buckets of that bucket's busiest-rank
  bytes sent / ZeRO-1's for the bucket (with the median over buckets).
* ``--sweep``: every plan of the planner sweep (``benchmarks/bench_planner.py``'s models × dp ×
  tp, the full default plan, TP stage included), its recorded ``plan.comm``: bytes and time
  ratios, their median and max, how many cases meet the targets (bytes ≤ 1.10× at dp ≥ 16,
  ≤ 1.20× at dp 8; time ≤ 1.2×), and the 10 worst cases.

B. ``--measure`` (torch): DP = 2 gloo ranks on this machine (``torch.multiprocessing.spawn``), one
thread each, the small GPT of ``benchmarks/bench_dp_step.py`` (imported), planned with
``canzona.plan_model`` at a bucket size that gives several buckets with uneven slices. One
``CanzonaOptimizer`` per variant, each on its own copy of the model (same seed, same batches):
``equal/padded`` (``equal`` on the equal buckets, ``padded`` elsewhere: ZeRO-1's calls; a copy of
the plan with those methods), each method forced with ``collective=`` (``equal`` alone cannot
move the uneven buckets), and the plan's own choice (``collective=None``); variants with the same
methods on every bucket run once. The variants alternate iteration by iteration (interleaved
rounds; the first round is a warm-up). Per round and variant: the optimizer step (it waits for
the reduce-scatters started in backward, updates, all-gathers) and the whole iteration, then the
collectives alone (every bucket's reduce, then every bucket's gather, driven through the
optimizer's bucket collectives with nothing computed). A time is the slowest rank's; reported are
the median and the min–max over rounds. At the end the parameters of every variant are compared
with the baseline's (bit-identical, or the largest difference).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from canzona.planner import OptimizerSettings, ParallelSizes, SizeError, comm
from canzona.planner.hardware import load_hardware
from canzona.planner.options import DPOptions, TPOptions
from canzona.planner.pipeline import plan as make_plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: Part A's three cases: (model, dp, tp).
FIGURE_CASES = (("qwen3-32b", 32, 8), ("qwen3-8b", 64, 1), ("qwen3-1.7b", 8, 1))
#: Sweep targets: bytes ratio by dp (≥ 16: 1.10, 8: 1.20), time ratio.
BYTES_TARGET = {8: 1.20}
BYTES_TARGET_DEFAULT = 1.10
STATE_TARGET = 1.10
TIME_TARGET = 1.2


# -- part A: the model ----------------------------------------------------------------------------

def _plan_methods(p) -> list[str]:
    return [b.method for buf in p.buffers for b in buf.buckets]


def _row(label: str, s: comm.CommSummary, note: str = "") -> dict:
    per_bucket = [max(ln.comm.sent) / max(ln.zero1.sent) for ln in s.lines if max(ln.zero1.sent)]
    worst = max(range(len(per_bucket)), key=per_bucket.__getitem__) if per_bucket else -1
    counts: dict[str, int] = {}
    for ln in s.lines:
        counts[ln.comm.method] = counts.get(ln.comm.method, 0) + 1
    return {
        "variant": label, "note": note,
        "max_sent_bytes": s.max_sent, "zero1_max_sent_bytes": s.zero1_max_sent,
        "bytes_ratio": s.max_sent / s.zero1_max_sent if s.zero1_max_sent else 1.0,
        "seconds": s.seconds, "zero1_seconds": s.zero1_seconds,
        "time_ratio": s.seconds / s.zero1_seconds if s.zero1_seconds else 1.0,
        "bucket_ratio_max": per_bucket[worst] if per_bucket else 1.0,
        "bucket_ratio_max_index": worst,
        "bucket_ratio_median": statistics.median(per_bucket) if per_bucket else 1.0,
        "calls": sum(ln.comm.calls for ln in s.lines),
        "methods": counts,
    }


def model_figures(model: str, dp: int, tp: int, hardware: str) -> dict:
    """Every method forced on every bucket, the plan's mix and the fastest, against ZeRO-1."""
    t0 = time.perf_counter()
    p = make_plan(model, ParallelSizes(dp=dp, tp=tp), OptimizerSettings(name="muon"),
                  dp_options=DPOptions(), tp_options=TPOptions(hardware=hardware))
    plan_s = time.perf_counter() - t0
    hw = load_hardware(hardware)
    link_name, link = comm.plan_link(hw, dp, tp)
    slices = comm.buffer_slices(p.buffers, p.inputs.ep)
    equal = [len(set(b.sizes)) == 1 for b in slices]
    rows = []
    for m in comm.METHODS:
        if m == "equal":
            methods = ["equal" if e else "padded" for e in equal]
            fell = len(equal) - sum(equal)
            note = f"padded on {fell}/{len(equal)}" if fell else ""
            label = "equal"
        else:
            methods, note, label = [m] * len(slices), "", m
        rows.append(_row(label, comm.summarise(slices, dp, link, methods), note))
    planned = _plan_methods(p)
    plan_row = _row("plan's mix", comm.summarise(slices, dp, link, planned))
    rows.append(plan_row)
    rows.append(_row("fastest (model)", comm.summarise(slices, dp, link, None)))
    c = p.comm
    recorded = {"predicted_s": c.predicted_s, "zero1_s": c.zero1_s,
                "max_sent_bytes": c.max_sent_bytes,
                "zero1_max_sent_bytes": c.zero1_max_sent_bytes}
    agrees = (c.max_sent_bytes == plan_row["max_sent_bytes"]
              and abs(c.predicted_s - plan_row["seconds"]) <= 1e-8 * max(1.0, c.predicted_s))
    return {"model": model, "dp": dp, "tp": tp, "hardware": hardware, "link": link_name,
            "busbw": link.busbw, "latency_s": link.latency_s, "buckets": len(slices),
            "equal_buckets": sum(equal), "plan_s": plan_s, "rows": rows,
            "plan_comm": recorded, "plan_comm_agrees": agrees}


def sweep(hardware: str, progress: bool = True) -> dict:
    """The recorded ``plan.comm`` of every default plan of the planner sweep."""
    bench = _load_bench_planner()
    cases, skipped = [], []
    t0 = time.perf_counter()
    for model in bench.MODELS:
        for dp in bench.DPS:
            for tp in bench.TPS:
                try:
                    p = make_plan(model, ParallelSizes(dp=dp, tp=tp), "muon",
                                  tp_options=TPOptions(hardware=hardware))
                except SizeError:
                    skipped.append(f"{model} dp{dp} tp{tp}")
                    continue
                c = p.comm
                target = BYTES_TARGET.get(dp, BYTES_TARGET_DEFAULT)
                br = c.max_sent_bytes / c.zero1_max_sent_bytes if c.zero1_max_sent_bytes else 1.0
                tr = c.predicted_s / c.zero1_s if c.zero1_s else 1.0
                st = p.metrics.dp_state_bytes
                mean_state = sum(st) / len(st)
                # the issue's state target: max(1.10, the largest single matrix's state / mean)
                largest = max((t.state_bytes for t in p.tasks if t.optimizer == "matrix"),
                              default=0)
                state_target = max(STATE_TARGET, largest / mean_state if mean_state else 0.0)
                sr = max(st) / mean_state if mean_state else 1.0
                cases.append({"model": model, "dp": dp, "tp": tp, "link": c.link,
                              "bytes_ratio": br, "time_ratio": tr, "bytes_target": target,
                              "bytes_ok": br <= target + 1e-12,
                              "time_ok": tr <= TIME_TARGET + 1e-12, "methods": dict(c.methods),
                              "state_ratio": sr, "state_target": state_target,
                              "state_ok": sr <= state_target + 1e-9,
                              "gap": p.metrics.gap_to_bound})
                if progress and sys.stderr.isatty():
                    print(f"\r{len(cases)} plans, {time.perf_counter() - t0:.0f} s", end="",
                          file=sys.stderr, flush=True)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    wall = time.perf_counter() - t0
    b = [c["bytes_ratio"] for c in cases]
    t = [c["time_ratio"] for c in cases]
    worst = sorted(cases, key=lambda c: (-max(c["bytes_ratio"] / c["bytes_target"],
                                              c["time_ratio"] / TIME_TARGET)))[:10]
    methods: dict[str, int] = {}
    for c in cases:
        for m, n in c["methods"].items():
            methods[m] = methods.get(m, 0) + n
    return {"hardware": hardware, "cases": cases, "skipped": skipped, "wall_s": wall,
            "bytes_median": statistics.median(b), "bytes_max": max(b),
            "time_median": statistics.median(t), "time_max": max(t),
            "bytes_ok": sum(c["bytes_ok"] for c in cases),
            "time_ok": sum(c["time_ok"] for c in cases),
            "both_ok": sum(c["bytes_ok"] and c["time_ok"] for c in cases),
            "state_median": statistics.median(c["state_ratio"] for c in cases),
            "state_max": max(c["state_ratio"] for c in cases),
            "state_ok": sum(c["state_ok"] for c in cases),
            "gap_median": statistics.median(c["gap"] for c in cases),
            "gap_max": max(c["gap"] for c in cases),
            "bucket_methods": methods, "worst": worst}


def _load_bench_planner():
    import bench_planner  # benchmarks/ is on sys.path

    return bench_planner


# -- part B: the measurement ----------------------------------------------------------------------

def _with_methods(p, methods: list[str]):
    """A copy of plan ``p`` recording ``methods`` (one per bucket, plan order)."""
    it = iter(methods)
    bufs = tuple(buf.model_copy(update={"buckets": tuple(b.model_copy(update={"method": next(it)})
                                                         for b in buf.buckets)})
                 for buf in p.buffers)
    return p.model_copy(update={"buffers": bufs})


def _variants(p) -> list[tuple[str, str | None, list[str], bool]]:
    """(label, collective= argument, methods per bucket, rewrite the plan) per distinct variant;
    the first is the baseline (equal/padded)."""
    slices = comm.buffer_slices(p.buffers, p.inputs.ep)
    base = ["equal" if len(set(b.sizes)) == 1 else "padded" for b in slices]
    out: list[tuple[str, str | None, list[str], bool]] = [("equal/padded", None, base, True)]
    for m in ("padded", "per_root", "all_reduce", "all_to_all"):
        out.append((m, m, [m] * len(slices), False))
    out.append(("plan", None, _plan_methods(p), False))
    merged: list[tuple[str, str | None, list[str], bool]] = []
    for label, coll, methods, rewrite in out:
        for k, (l2, c2, m2, r2) in enumerate(merged):
            if m2 == methods:
                merged[k] = (f"{l2} = {label}", c2, m2, r2)
                break
        else:
            merged.append((label, coll, methods, rewrite))
    return merged


def _measure_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import canzona
    from bench_dp_step import VOCAB, Model

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    p = canzona.plan_model(Model(args.dim, args.layers), dp=world, bucket_size=args.bucket_size)
    variants = _variants(p)
    models, opts = {}, {}
    for label, coll, methods, rewrite in variants:
        model = Model(args.dim, args.layers)  # seeded: every variant starts from the same weights
        plan_v = _with_methods(p, methods) if rewrite else p
        opt = canzona.CanzonaOptimizer(model, plan_v, lr=0.02, ns_dtype=torch.float32,
                                       adamw_lr=3e-3, collective=coll)
        assert list(opt.collective_methods) == methods, (label, opt.collective_methods)
        models[label], opts[label] = model, opt
    times = {label: {"step": [], "iter": [], "comm": []} for label in opts}

    def iteration(label: str, x) -> tuple[float, float]:
        dist.barrier()
        t0 = time.perf_counter()
        logits = models[label](x[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
        t1 = time.perf_counter()
        opts[label].step()
        t2 = time.perf_counter()
        opts[label].zero_grad()
        return t2 - t1, t2 - t0

    def collectives_only(label: str) -> float:
        # The optimizer's bucket collectives with nothing computed: after a step the gradients
        # are zero and the parameters equal on every rank, so this changes no value.
        cs = opts[label]._collectives
        dist.barrier()
        t0 = time.perf_counter()
        for c in cs:
            c.launch_reduce(None)
        for c in cs:
            c.finish_reduce()
        for c in cs:
            c.launch_gather(None)
        for c in cs:
            c.finish_gather()
        return time.perf_counter() - t0

    for r in range(args.rounds + 1):  # round 0 warms up
        g = torch.Generator().manual_seed(1000 * r + rank)
        x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
        order = list(opts) if r % 2 == 0 else list(opts)[::-1]  # alternate who goes first
        for label in order:
            step_s, iter_s = iteration(label, x)
            comm_s = min(collectives_only(label) for _ in range(args.comm_repeats))
            if r > 0:
                times[label]["step"].append(step_s)
                times[label]["iter"].append(iter_s)
                times[label]["comm"].append(comm_s)
    # the slowest rank defines an iteration: max over ranks, per round
    result: dict = {"variants": []}
    base = variants[0][0]
    flat = {label: torch.cat([q.detach().reshape(-1) for q in m.parameters()])
            for label, m in models.items()}
    for label, coll, methods, rewrite in variants:
        rec: dict = {"label": label, "collective": coll, "rewrite": rewrite,
                     "methods": methods, "bytes": opts[label].comm_bytes()}
        for key, vals in times[label].items():
            t = torch.tensor(vals, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rec[key] = t.tolist()
        b = torch.tensor([sum(rec["bytes"].values())], dtype=torch.float64)
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
        rec["max_sent_bytes"] = int(b.item())
        d = (flat[label] - flat[base]).abs()
        rec["identical"] = bool(torch.equal(flat[label], flat[base]))
        rec["max_abs_diff"] = float(d.max())
        rec["max_rel_diff"] = float((d / flat[base].abs().clamp_min(1e-30)).max())
        result["variants"].append(rec)
    # every rank holds the same parameters after a step
    s = flat[base].clone()
    dist.broadcast(s, 0)
    result["ranks_agree"] = bool(torch.equal(s, flat[base]))
    result["params"] = int(flat[base].numel())
    result["buckets"] = [list(b.sizes) for b in comm.buffer_slices(p.buffers, p.inputs.ep)]
    result["plan_hardware"] = p.comm.hardware
    result["torch"] = torch.__version__
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    for opt in opts.values():
        opt.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace) -> dict:
    import torch

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        torch.multiprocessing.spawn(_measure_worker, args=(2, _free_port(), args, out),
                                    nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    res["wall_s"] = time.perf_counter() - t0
    # the communication model's prediction for these buckets on the cpu profile
    cpu = load_hardware("cpu")
    _, link = comm.plan_link(cpu, 2, 1)
    slices = [comm.BucketSlices(tuple(s), 4, 4, (0, 1)) for s in res["buckets"]]
    for v in res["variants"]:
        v["predicted_cpu_s"] = comm.summarise(slices, 2, link, v["methods"]).seconds
    res["args"] = {k: getattr(args, k) for k in ("dim", "layers", "batch", "seq", "bucket_size",
                                                 "rounds", "comm_repeats")}
    return res


# -- output ---------------------------------------------------------------------------------------

def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _x(r: float) -> str:
    return f"{r:.3f}×"


def figure_tables(figs: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    out = []
    for f in figs:
        title = (f"{f['model']} dp{f['dp']} tp{f['tp']} — {f['hardware']} {f['link']} "
                 f"(busbw {f['busbw'] / 1e9:.0f} GB/s, α {f['latency_s'] * 1e6:.0f} µs), "
                 f"{f['buckets']} buckets ({f['equal_buckets']} with equal slices); ZeRO-1: "
                 f"{_gb(f['rows'][0]['zero1_max_sent_bytes'])} sent by the busiest rank, "
                 f"{_ms(f['rows'][0]['zero1_seconds'])}")
        head = ["variant", "bytes / ZeRO-1", "time / ZeRO-1", "worst bucket bytes / ZeRO-1",
                "median bucket", "max sent", "time", "calls", "buckets per method"]
        rows = []
        for r in f["rows"]:
            name = r["variant"] + (f" ({r['note']})" if r["note"] else "")
            rows.append([name, _x(r["bytes_ratio"]), _x(r["time_ratio"]),
                         f"{_x(r['bucket_ratio_max'])} (#{r['bucket_ratio_max_index']})",
                         _x(r["bucket_ratio_median"]), _gb(r["max_sent_bytes"]),
                         _ms(r["seconds"]), str(r["calls"]),
                         ", ".join(f"{m} {n}" for m, n in r["methods"].items())])
        out.append((title, head, rows))
    return out


def sweep_tables(s: dict) -> tuple[str, list[tuple[str, list[str], list[list[str]]]]]:
    n = len(s["cases"])
    summary = (f"{n} default plans ({s['hardware']}, {s['wall_s']:.0f} s): bytes / ZeRO-1 median "
               f"{_x(s['bytes_median'])}, max {_x(s['bytes_max'])}; time / ZeRO-1 median "
               f"{_x(s['time_median'])}, max {_x(s['time_max'])}. Within target: bytes "
               f"{s['bytes_ok']}/{n} (≤ 1.10× at dp ≥ 16, ≤ 1.20× at dp 8), time "
               f"{s['time_ok']}/{n} (≤ 1.2×), both {s['both_ok']}/{n}. Buckets per method over "
               "the sweep: " + ", ".join(f"{m} {k}" for m, k in sorted(
                   s["bucket_methods"].items(), key=lambda kv: -kv[1])) + ".")
    summary += (f" Optimizer state max/mean median {s['state_median']:.2f}, max "
                f"{s['state_max']:.2f}, within max(1.10, largest matrix / mean) in "
                f"{s['state_ok']}/{n}; compute gap to the bound median "
                f"{100 * s['gap_median']:.2f} %, max {100 * s['gap_max']:.2f} %.")
    if s["skipped"]:
        summary += f" Skipped (invalid sizes): {', '.join(s['skipped'])}."
    head = ["model", "dp", "tp", "link", "bytes / ZeRO-1", "target", "time / ZeRO-1", "methods"]
    rows = [[c["model"], str(c["dp"]), str(c["tp"]), c["link"],
             _x(c["bytes_ratio"]) + ("" if c["bytes_ok"] else " ✗"),
             f"≤ {c['bytes_target']:.2f}×",
             _x(c["time_ratio"]) + ("" if c["time_ok"] else " ✗"),
             ", ".join(f"{m} {k}" for m, k in c["methods"].items())] for c in s["worst"]]
    over = [c for c in s["cases"] if not c["state_ok"]]
    state_rows = [[c["model"], str(c["dp"]), str(c["tp"]), f"{c['state_ratio']:.2f}",
                   f"{c['state_target']:.2f}", f"{100 * c['gap']:.2f} %"] for c in over]
    return summary, [("worst 10 cases (by ratio / target, the larger of bytes and time)", head,
                      rows),
                     (f"optimizer state over its target ({len(over)} of {n})",
                      ["model", "dp", "tp", "state max/mean", "target", "compute gap"],
                      state_rows)]


def _spread(v: list[float]) -> str:
    return f"{statistics.median(v) * 1e3:.1f} ({min(v) * 1e3:.1f}–{max(v) * 1e3:.1f})"


def measure_tables(res: dict) -> tuple[str, list[tuple[str, list[str], list[list[str]]]]]:
    a = res["args"]
    vs = res["variants"]
    base = vs[0]
    plan_v = next(v for v in vs if "plan" in v["label"].split(" = "))
    med = {v["label"]: {k: statistics.median(v[k]) for k in ("step", "iter", "comm")} for v in vs}
    uneven = sum(len(set(b)) > 1 for b in res["buckets"])
    intro = (f"DP = 2 gloo ranks, one thread each ({platform.machine()}, {os.cpu_count()} CPUs, "
             f"torch {res['torch']}); bench_dp_step's GPT, {a['layers']} blocks of width "
             f"{a['dim']}, {res['params'] / 1e6:.2f}M parameters, {a['batch']}×{a['seq']} tokens "
             f"per rank, Muon (fp32 Newton–Schulz) + AdamW, fp32 buckets; `canzona.plan_model("
             f"bucket_size={a['bucket_size']})` (profile {res['plan_hardware']}): "
             f"{len(res['buckets'])} buckets, {uneven} with uneven slices "
             f"({'; '.join('/'.join(str(x) for x in b) for b in res['buckets'])}). "
             f"{a['rounds']} interleaved rounds after a warm-up; times are the slowest rank's, "
             f"median (min–max) in ms; collectives alone best of {a['comm_repeats']} per round. "
             f"Run took {res['wall_s']:.0f} s.")
    head = ["variant", "step ms", "iteration ms", "collectives alone ms",
            "step / baseline", "iteration / baseline", "collectives / baseline",
            "collectives / plan",
            "MB sent (busiest rank)", "modelled (cpu profile)", "params"]
    rows = []
    for v in vs:
        m = med[v["label"]]
        same = ("bit-identical" if v["identical"]
                else f"max |Δ| {v['max_abs_diff']:.1e} (rel {v['max_rel_diff']:.1e})")
        rows.append([v["label"], _spread(v["step"]), _spread(v["iter"]), _spread(v["comm"]),
                     _x(m["step"] / med[base["label"]]["step"]),
                     _x(m["iter"] / med[base["label"]]["iter"]),
                     _x(m["comm"] / med[base["label"]]["comm"]),
                     _x(m["comm"] / med[plan_v["label"]]["comm"]),
                     f"{v['max_sent_bytes'] / 1e6:.1f}", _ms(v["predicted_cpu_s"]), same])
    ident = all(v["identical"] for v in vs)
    tail = ("Final parameters: " + ("bit-identical across all variants" if ident else
            "differ (see the last column)") + "; ranks agree: "
            + ("yes" if res["ranks_agree"] else "NO") + ".")
    return intro + "\n\n" + tail, [("", head, rows)]


_TEXT_COLUMNS = {"link", "methods", "buckets per method", "params"}


def _print(text: str, tables: list, markdown: bool) -> None:
    if markdown:
        print(text + "\n")
        for title, head, rows in tables:
            if title:
                print(f"**{title}**\n")
            print("| " + " | ".join(head) + " |")
            print("|" + "|".join("---" if i == 0 or h in _TEXT_COLUMNS else "---:"
                                 for i, h in enumerate(head)) + "|")
            for r in rows:
                print("| " + " | ".join(r) + " |")
            print()
        return
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(200, Console().width))
    con.print(text)
    for title, head, rows in tables:
        t = Table(title=title or None, title_justify="left")
        for i, h in enumerate(head):
            t.add_column(h, justify="left" if i == 0 or h in _TEXT_COLUMNS else "right")
        for r in rows:
            t.add_row(*r)
        con.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-figures", action="store_true", help="part A: three models")
    ap.add_argument("--sweep", action="store_true", help="part A: the planner sweep")
    ap.add_argument("--measure", action="store_true", help="part B: gloo, DP = 2")
    ap.add_argument("--hardware", nargs="+", default=["h800"],
                    help="profile(s) for part A (cpu, h100, h800 or a file; default h800)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables (README)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-size", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (≥ 5 advised)")
    ap.add_argument("--comm-repeats", type=int, default=3,
                    help="collectives-alone runs per round and variant (the best is kept)")
    args = ap.parse_args(argv)
    if not (args.model_figures or args.sweep or args.measure):
        ap.error("choose at least one of --model-figures, --sweep, --measure")
    out: dict = {}
    if args.model_figures:
        out["model_figures"] = [model_figures(m, d, t, hw) for hw in args.hardware
                                for m, d, t in FIGURE_CASES]
        if not args.json:
            figs = out["model_figures"]
            bad = [f"{f['model']} dp{f['dp']} tp{f['tp']} {f['hardware']}" for f in figs
                   if not f["plan_comm_agrees"]]
            note = ("Each plan's recorded `comm` section agrees with the plan's mix row."
                    if not bad else f"plan.comm DISAGREES with the recomputation: {bad}")
            _print(note, figure_tables(figs), args.markdown)
    if args.sweep:
        out["sweep"] = [sweep(hw) for hw in args.hardware]
        if not args.json:
            for s in out["sweep"]:
                _print(*sweep_tables(s), args.markdown)
    if args.measure:
        out["measure"] = measure(args)
        if not args.json:
            _print(*measure_tables(out["measure"]), args.markdown)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
