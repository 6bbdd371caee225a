"""Rich rendering for the CLI (tables, bars). Only this module prints."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from canzona.planner.inventory import ModelSpec
from canzona.planner.layout import PhysicalLayout

console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True)


def error(message: str) -> None:
    """One readable line on stderr."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


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
        f"[bold]{spec.name}[/]  {human(spec.total_params)} params  dp={s.dp} tp={s.tp}"
        + (f" ep={s.ep} (expert dp={s.edp})" if s.ep > 1 or spec.config.is_moe else "")
        + f"  bucket size: {lay.bucket_size:,} elements" if lay.bucket_size else
        f"[bold]{spec.name}[/]  dp={s.dp} tp={s.tp}  one bucket per buffer (no overlap)")
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


def flush() -> None:
    sys.stdout.flush()
