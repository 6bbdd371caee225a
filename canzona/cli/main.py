"""The ``canzona`` command line: thin commands over the planner; rendering lives in ``_render``.

Domain errors (:class:`canzona.planner.CanzonaError`) become one readable line on stderr and exit
status 1, in one place (:func:`main`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from canzona import __version__
from canzona.planner import CanzonaError

from . import _render

app = typer.Typer(
    name="canzona",
    help="Plan Muon / Shampoo / SOAP under ZeRO-1 data parallelism and tensor parallelism.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Built-in model (see 'canzona models').")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Hugging Face config.json (Qwen3, Qwen3-MoE, Llama).")]
DpOpt = Annotated[int, typer.Option("--dp", help="Data-parallel size.")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel size (MoE models).")]


def command(fn: Callable) -> Callable:
    """Register ``fn`` as a command whose canzona input errors become one line and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except CanzonaError as exc:
            _render.error(str(exc))
            raise typer.Exit(1) from None

    return app.command()(wrapper)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"canzona {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """canzona: α-balanced ZeRO-1 partitioning and TP micro-group scheduling for matrix optimizers."""


@command
def models(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List the built-in models: parameters, layers, hidden size, heads, experts."""
    from canzona.planner import PRESETS, build_inventory

    rows = []
    for name, cfg in PRESETS.items():
        spec = build_inventory(cfg)
        rows.append({"name": name, "params": spec.total_params, "layers": cfg.layers,
                     "hidden": cfg.hidden, "ffn": cfg.ffn or cfg.moe_ffn, "q_heads": cfg.q_heads,
                     "kv_heads": cfg.kv_heads, "experts": cfg.num_experts,
                     "experts_per_token": cfg.experts_per_token, "vocab": cfg.vocab,
                     "tied_embeddings": cfg.tied_embeddings})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        _render.models_table(rows)


@command
def layout(
    model: ModelOpt = None,
    config: ConfigOpt = None,
    dp: DpOpt = 1,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    bucket_size: Annotated[Optional[int], typer.Option(
        "--bucket-size", help="Elements per bucket (default Megatron's max(40M, 1M·dp)).")] = None,
    no_overlap: Annotated[bool, typer.Option(
        "--no-overlap", help="Grad-reduce overlap off: one bucket per buffer.")] = False,
    buckets: Annotated[bool, typer.Option("--buckets", help="List every bucket.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show Megatron's ZeRO-1 buffers and buckets, and the matrices its equal chunks split."""
    from canzona.planner import ParallelSizes, build_inventory, build_layout, resolve_model

    cfg = resolve_model(model, config)
    spec = build_inventory(cfg)
    lay = build_layout(spec, ParallelSizes(dp=dp, tp=tp, ep=ep), bucket_size=bucket_size,
                       overlap_grad_reduce=not no_overlap)
    if as_json:
        typer.echo(json.dumps(_render.layout_dict(spec, lay), indent=2))
    else:
        _render.layout_report(spec, lay, show_buckets=buckets)


def main() -> None:
    """Console entry point."""
    app()


if __name__ == "__main__":
    main()
