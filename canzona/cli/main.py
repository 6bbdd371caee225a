"""The ``canzona`` command line: thin commands over the planner.

Each command is a signature and one call into the library (:mod:`canzona.planner.pipeline`,
:mod:`canzona.planner.report`); terminal output lives in ``_render``, charts in ``plots``.

Domain errors (:class:`canzona.planner.CanzonaError`) become one readable line on stderr and exit
status 1, in one place (:func:`command`).
"""

from __future__ import annotations

import functools
import importlib
import inspect as pyinspect
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from canzona import __version__
from canzona.planner import CanzonaError, CanzonaWarning, optimizers
from canzona.planner.hardware import hardware_names
from canzona.planner.options import DEFAULT_COST, DEFAULT_SHARE
from canzona.planner.settings import NS_SCHEDULES, QKV_SPLITS, ns_schedule

from . import _render


def _tidy_params(params: list) -> list:
    """Help without typer's type placeholder on flags (``--json <bool>``)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


#: click's (or typer's own click's) error for a missing option value or argument.
_MissingParameter = importlib.import_module(typer.BadParameter.__module__).MissingParameter


class _Command(TyperCommand):
    """A command whose help shows flags bare and arguments as ``PLAN_FILE``, not ``{plan_file}``,
    and whose option values that do not parse (``--dp four``) are one error line and exit 1, as
    canzona's other input errors are."""

    def get_params(self, ctx: Any) -> list:
        return _tidy_params(super().get_params(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given = list(args)  # the parser consumes ``args``
        try:
            return super().parse_args(ctx, args)
        except typer.BadParameter as exc:
            if isinstance(exc, _MissingParameter):
                raise  # a usage error: typer's box shows the usage
            _render.error(f"{_bad_value(exc, given)} (see 'canzona {ctx.info_name} --help').")
            raise typer.Exit(1) from None

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if isinstance(p, TyperArgument):
                name = (p.metavar or p.name or "").upper()
                pieces.append(name if p.required else f"[{name}]")
        return pieces


def _bad_value(exc: Any, args: list[str]) -> str:
    """``--dp 'four': Input should be a valid integer…``: the option, the value given and why it
    is refused (click's own message where the option cannot be found in ``args``)."""
    opts = tuple(getattr(exc.param, "opts", ()) or ())
    for k, arg in enumerate(args):
        for opt in opts:
            if arg == opt and k + 1 < len(args):
                return f"{opt} {args[k + 1]!r}: {exc.message.rstrip('.')}"
            if arg.startswith(opt + "="):
                return f"{opt} {arg[len(opt) + 1:]!r}: {exc.message.rstrip('.')}"
    return exc.format_message().rstrip(".")


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list:
        return _tidy_params(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
    name="canzona",
    help="Plan Muon / Shampoo / SOAP under ZeRO-1 data parallelism and tensor parallelism.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

#: The forward/backward model ``simulate`` and ``compare`` share (6·N_active·tokens at the MFU).
MfuOpt = Annotated[float, typer.Option(
    "--mfu", help="Model FLOPs utilisation of forward/backward (6·N_active·tokens), in (0, 1].")]
SeqOpt = Annotated[int, typer.Option("--seq", min=1, help="Sequence length.")]
TokensOpt = Annotated[Optional[int], typer.Option(
    "--tokens", min=1, show_default="dp · seq (one sequence per DP rank)",
    help="Global batch in tokens.")]
ForwardBackwardOpt = Annotated[Optional[float], typer.Option(
    "--forward-backward", min=0.0, show_default="from --mfu",
    help="Forward + backward seconds (a measured value), instead of --mfu; backward is two "
         "thirds of it.")]

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Built-in model (see 'canzona models').")]
ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", help="Hugging Face config.json (Qwen3, Qwen3-MoE, Llama).")]
DpOpt = Annotated[int, typer.Option("--dp", help="Data-parallel size.")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel size (MoE models).")]
PpOpt = Annotated[int, typer.Option(
    "--pp", help="Pipeline stages: each stage's layers planned over its own DP and TP groups "
                 "(--dp and --tp are each stage's), in one plan file.")]
FirstStageOpt = Annotated[Optional[int], typer.Option(
    "--first-stage-layers", show_default="an even share",
    help="Decoder layers on the first pipeline stage (Megatron's "
         "num_layers_in_first_pipeline_stage).")]
LastStageOpt = Annotated[Optional[int], typer.Option(
    "--last-stage-layers", show_default="an even share",
    help="Decoder layers on the last pipeline stage (Megatron's "
         "num_layers_in_last_pipeline_stage).")]
StageOpt = Annotated[Optional[int], typer.Option(
    "--stage", min=0, show_default="the critical stage",
    help="A pipeline's plan (pp > 1): the stage shown in full after the stages side by "
         "side.")]
MicrobatchesOpt = Annotated[Optional[int], typer.Option(
    "--microbatches", min=1, show_default="4 · pp",
    help="Microbatches per iteration of a pipeline (1F1B), pp > 1.")]
EtpOpt = Annotated[Optional[int], typer.Option(
    "--etp", show_default="tp",
    help="Expert tensor-parallel size (MoE models): 1 keeps every expert matrix whole on its "
         "GPU, or tp.")]
BucketSizeOpt = Annotated[Optional[int], typer.Option(
    "--bucket-size", show_default="Megatron's max(40M, 1M·dp)", help="Elements per bucket.")]
NoOverlapOpt = Annotated[bool, typer.Option(
    "--no-overlap", help="Grad-reduce overlap off: one bucket per buffer.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress on stderr (it shows when a step runs over 2 s).")]
#: The ``--hardware`` choices, in the library's order (:func:`hardware_names`).
HARDWARE_CHOICES = f"{', '.join(hardware_names())}, or a profile file (.json)"


#: The library's option fields as this CLI spells them (errors name the flag to change).
FLAGS = {
    "DPOptions.solver": "--solver", "DPOptions.alpha": "--alpha", "DPOptions.cost": "--cost",
    "DPOptions.time_limit_s": "--time-limit", "DPOptions.comm_limit": "--comm-limit",
    "DPOptions.seed": "--seed", "DPOptions.reorder": "--reorder",
    "DPOptions.bucket_size": "--bucket-size", "TPOptions.cmax_mib": "--cmax",
    "TPOptions.solver": "--tp-solver", "TPOptions.comm_dtype": "--comm-dtype",
    "TPOptions.hardware": "--hardware", "DPOptions.objective": "--objective",
    "TPOptions.share": "--share",
    "ParallelSizes.dp": "--dp", "ParallelSizes.tp": "--tp",
    "ParallelSizes.ep": "--ep", "ParallelSizes.etp": "--etp",
    "StageSplit.pp": "--pp", "StageSplit.first_stage_layers": "--first-stage-layers",
    "StageSplit.last_stage_layers": "--last-stage-layers",
    "inspect_report.config": "--config",
}


def command(fn: Callable) -> Callable:
    """Register ``fn`` as a command whose canzona input errors become one line and exit 1.

    The planner's warnings (:class:`CanzonaWarning`, e.g. matrices over C_max) become one
    ``note:`` line each on stderr, not Python's warning with a source line.
    """

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CanzonaWarning)
            try:
                return fn(*args, **kwargs)
            except CanzonaError as exc:
                _render.error(exc.render(FLAGS))
                raise typer.Exit(1) from None
            finally:
                seen: set[str] = set()
                for w in caught:
                    if issubclass(w.category, CanzonaWarning):
                        if str(w.message) not in seen:
                            seen.add(str(w.message))
                            _render.note(str(w.message))
                    else:
                        warnings.showwarning(w.message, w.category, w.filename, w.lineno)

    return app.command(cls=_Command, help=_unwrapped(fn.__doc__))(wrapper)


def _unwrapped(doc: str | None) -> str | None:
    """A docstring as help text: its paragraphs each one line, for the terminal to wrap (typer
    keeps a docstring's line breaks, which break its lines mid-phrase at any other width)."""
    if doc is None:
        return None
    return "\n\n".join(" ".join(par.split()) for par in pyinspect.cleandoc(doc).split("\n\n"))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"canzona {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """canzona: α-balanced ZeRO-1 partitioning and TP micro-group scheduling for matrix
    optimizers."""


@command
def models(as_json: JsonOpt = False) -> None:
    """List the built-in models: parameters, layers, hidden size, heads, experts."""
    from canzona.planner.report import model_rows

    rows = model_rows()
    if as_json:
        _render.json_out(rows)
    else:
        _render.models_table(rows)


@command
def layout(
    model: ModelOpt = None,
    config: ConfigOpt = None,
    dp: DpOpt = 1,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    etp: EtpOpt = None,
    bucket_size: BucketSizeOpt = None,
    no_overlap: NoOverlapOpt = False,
    buckets: Annotated[bool, typer.Option("--buckets", help="List every bucket.")] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Show Megatron's ZeRO-1 buffers and buckets, and the matrices its equal chunks split."""
    from canzona.planner import ParallelSizes, resolve_model
    from canzona.planner.report import layout_dict, layout_of

    cfg = resolve_model(model, config)
    with _render.progress(f"layout of {cfg.name} dp={dp} tp={tp}", quiet=quiet) as say:
        spec, lay = layout_of(cfg, ParallelSizes(dp=dp, tp=tp, ep=ep, etp=etp),
                              bucket_size=bucket_size,
                              overlap_grad_reduce=not no_overlap, progress=say)
    if as_json:
        _render.json_out(layout_dict(spec, lay))
    else:
        _render.layout_view(spec, lay, show_buckets=buckets)


def _qkv_split(value: str, alias: bool) -> str:
    """``--qkv-split``, with ``--split-qkv`` as the alias of ``qkv``."""
    value = _choice(value, QKV_SPLITS, "--qkv-split")
    if alias and value not in ("fused", "qkv"):
        raise CanzonaError(f"--split-qkv means --qkv-split qkv, not {value}; give one of them.")
    return "qkv" if alias else value


def _choice(value: str, allowed: tuple[str, ...], option: str) -> str:
    """Lower-case ``value`` if it is one of ``allowed``; a one-line error otherwise."""
    v = value.strip().lower()
    if v not in allowed:
        raise CanzonaError(f"{option} must be one of: {', '.join(allowed)}; got '{value}'.")
    return v


def _ns_schedule(text: str) -> str | tuple[tuple[float, float, float], ...]:
    """``--ns``: a schedule's name, or per-step triples ``a,b,c;a,b,c``; a one-line error
    naming the choices otherwise."""
    v = text.strip().lower()
    if v in NS_SCHEDULES:
        return v
    try:
        steps = tuple(tuple(float(x) for x in step.split(",")) for step in v.split(";")
                      if step.strip())
        ns_schedule(steps, 1)
    except ValueError:
        raise CanzonaError(f"--ns must be one of: {', '.join(NS_SCHEDULES)}, or per-step "
                           f"coefficients 'a,b,c;a,b,c' (finite numbers, three per step); got "
                           f"'{text}'.") from None
    if not steps:
        raise CanzonaError(f"--ns must be one of: {', '.join(NS_SCHEDULES)}, or per-step "
                           f"coefficients 'a,b,c;a,b,c'; got '{text}'.")
    return steps  # type: ignore[return-value]


def _check_output(path: Path, what: str = "plan") -> None:
    """Fail before any work if the file could not be written there."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise CanzonaError(f"cannot write {what} to '{path}': it is a folder; give a file name.")
    if not folder.is_dir():
        raise CanzonaError(f"cannot write {what} to '{path}': folder '{folder}' does not exist.")
    if not os.access(folder, os.W_OK):
        raise CanzonaError(f"cannot write {what} to '{path}': folder '{folder}' is not "
                           "writable.")


@command
def plan(
    model: ModelOpt = None,
    config: ConfigOpt = None,
    dp: DpOpt = 1,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    etp: EtpOpt = None,
    pp: PpOpt = 1,
    first_stage_layers: FirstStageOpt = None,
    last_stage_layers: LastStageOpt = None,
    optimizer: Annotated[str, typer.Option(
        "--optimizer", help=f"Matrix optimizer: {', '.join(optimizers.names())}.")] = "muon",
    ns: Annotated[str, typer.Option(
        "--ns", help=f"Muon's Newton–Schulz schedule, recorded in the plan (the runtime takes "
                     f"it from there): {', '.join(NS_SCHEDULES)}, or per-step coefficients "
                     "'a,b,c;a,b,c;…' (a shorter list than --ns-steps repeats its last "
                     "step, a longer one is cut).")] = "simple",
    ns_steps: Annotated[int, typer.Option(
        "--ns-steps", min=1, max=99, help="Muon's Newton–Schulz steps, what the planner "
                                          "costs.")] = 5,
    alpha: Annotated[float, typer.Option(
        "--alpha",
        help="The paper's α in [0, 1] for the greedy: 0 even split, 1 fill deficits.")] = 1.0,
    cost: Annotated[str, typer.Option(
        "--cost",
        help="Load per task: roofline (seconds on --hardware: FLOPs at the achieved rate, "
             "memory traffic at the bandwidth), flops (optimizer FLOPs) or numel (the "
             "paper's); --cost flops --share off makes the paper's comparisons' "
             "plans.")] = DEFAULT_COST,
    solver: Annotated[str, typer.Option(
        "--solver", help="auto (greedy + exact per-bucket polish), greedy (the paper) or "
                         "cpsat (OR-Tools, proves a bound).")] = "auto",
    time_limit: Annotated[float, typer.Option(
        "--time-limit", help="CP-SAT time limit in seconds per phase (cpsat only: the busiest "
                             "load, then the state and slice balances with it held).")] = 10.0,
    comm_limit: Annotated[Optional[float], typer.Option(
        "--comm-limit", show_default="no cap",
        help="Cap every DP slice at this multiple (≥ 1) of the even slice S/R (bounds the padded "
             "collectives' cost).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="CP-SAT random seed (recorded).")] = 0,
    reorder: Annotated[bool, typer.Option(
        "--reorder/--no-reorder", help="Let parameters change places inside their bucket (same "
        "buckets, much better balance; the plan records the order and canzona's runtime lays "
        "its buffers out from it). --no-reorder keeps Megatron's order.")] = True,
    qkv_split: Annotated[str, typer.Option(
        "--qkv-split", help="Megatron's fused QKV orthogonalised as one matrix (fused), as Q, K "
        "and V (qkv) or head by head (heads: one matrix per query, key and value head, each "
        "computed by the TP rank that holds it).")] = "fused",
    split_qkv: Annotated[bool, typer.Option(
        "--split-qkv", help="The same as --qkv-split qkv.")] = False,
    split_gate_up: Annotated[bool, typer.Option(
        "--split-gate-up", help="gate and up projections as separate matrices.")] = False,
    bucket_size: BucketSizeOpt = None,
    no_overlap: NoOverlapOpt = False,
    cmax: Annotated[float, typer.Option(
        "--cmax", help="TP micro-group cap C_max: MiB of gathered full matrices per host rank "
                       "and group (tp > 1); a lockstep of shared matrices (a TP group's "
                       "batch, a DP pair's bundle) holds at most 2 · C_max of scratch.")] = 512.0,
    tp_solver: Annotated[str, typer.Option(
        "--tp-solver", help="TP hosting: greedy (the paper's LPT with rollback) or cpsat "
                            "(greedy, then CP-SAT per micro-group).")] = "greedy",
    share: Annotated[str, typer.Option(
        "--share", help="off; auto: Muon matrices heavier than the mean per-GPU work are "
                        "shared by their TP group (shared Newton–Schulz, no gather) where the "
                        "cost model says it lowers the busiest GPU, or every eligible one with "
                        "the polynomial split, whichever plan is lighter; all / all-split: "
                        "every Muon matrix TP splits along its long dimension, without / with the "
                        "polynomial split; pairs: as all-split, and every tall column-parallel "
                        "matrix (fc1, QKV) shared by two TP groups, partner DP indices "
                        "(k = 2·tp; auto does that where it lowers the objective); "
                        "sub-groups (tp ≥ 4): every class of alike eligible matrices in rounds "
                        "of tp/k, each shared by k strided TP ranks that gather its rows (auto: "
                        "as many as the pattern model finds worth it). At tp 1 the "
                        "same choices (but pairs) share matrices over DP "
                        "pairs (the bucket cut inside a matrix, between two rows; auto keeps "
                        "them only where the busiest DP index gets lighter). Shampoo: at tp > 1 "
                        "every matrix whose TP shards are whole blocks is preconditioned shard "
                        "by shard (no gather; auto: where the objective prefers it to "
                        "hosting); at tp 1 block rows are hosted by two DP "
                        "ranks.")] = DEFAULT_SHARE,
    comm_dtype: Annotated[str, typer.Option(
        "--comm-dtype", help="dtype of the TP gather/scatter (tp > 1; sizes C_max): bf16, fp16, "
                             "or fp32 (exact: bf16 rounds fp32 gradients).")] = "bf16",
    objective: Annotated[str, typer.Option(
        "--objective", help="step-time (the busiest compute, then the bucket cuts and "
                            "collective methods that lower the predicted collective time, the "
                            "compute gap growing by at most 0.5 points) or max-load (compute "
                            "only).")] = "step-time",
    hardware: Annotated[str, typer.Option(
        "--hardware", help="Hardware profile of the communication model and the TP timeline: "
                           f"{HARDWARE_CHOICES}.")] = "h100",
    names: Annotated[str, typer.Option(
        "--names", help="Parameter names of the plan: megatron (Megatron-core's: fused QKV and "
                        "gate/up, per-expert weights as SequentialMLP's), megatron-grouped (the "
                        "same, experts as TEGroupedMLP's: experts.linear_fc1.weight<e>) or hf "
                        "(the transformers model's own: separate projections, 3-D experts; "
                        "tp 1), so the plan fits that live model.")] = "megatron",
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", show_default="./MODEL-dpD-tpT-OPTIMIZER.plan.json",
        help="Plan file (written atomically); an existing folder: that default name inside "
             "it.")] = None,
    storage: Annotated[str, typer.Option(
        "--storage", help="Where the parameters live: zero1 (ZeRO-1 buckets: Megatron's or "
                          "canzona's own) or fsdp2 (fully_shard's Shard(0) rows: each "
                          "matrix's owner and the all-to-all rounds that bring its rows there "
                          "and back; with --tp a dp × tp mesh, TP then fully_shard as "
                          "torchtitan; ep 1, pp 1; --cmax caps a round, --hardware prices "
                          "it).")] = "zero1",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Plan which DP rank computes every whole matrix (α-balanced ZeRO-1 cuts, or owners and
    all-to-all rounds under FSDP2) and write the plan."""
    from canzona.planner import (DPOptions, OptimizerSettings, ParallelSizes, TPOptions, pipeline,
                                 resolve_model)
    from canzona.planner.inventory import NAMINGS
    from canzona.planner.plan import FSDP2Plan, PipelinePlan, save_plan
    from canzona.planner.planning import default_plan_name
    from canzona.planner.stages import StageSplit, stage_layers

    t0 = time.perf_counter()
    dp_options = DPOptions(solver=solver.strip().lower(), alpha=alpha, cost=cost.strip().lower(),
                           time_limit_s=time_limit, comm_limit=comm_limit, seed=seed,
                           reorder=reorder, bucket_size=bucket_size,
                           overlap_grad_reduce=not no_overlap,
                           objective=objective.strip().lower())
    tp_options = TPOptions(cmax_mib=cmax, solver=tp_solver.strip().lower(),
                           comm_dtype=comm_dtype.strip().lower(), hardware=hardware.strip(),
                           share=share.strip().lower())
    settings = OptimizerSettings(
        name=_choice(optimizer, optimizers.names(), "--optimizer"),  # type: ignore[arg-type]
        ns_steps=ns_steps, ns_coefficients=_ns_schedule(ns),
        qkv_split=_qkv_split(qkv_split, split_qkv), split_gate_up=split_gate_up)
    sizes = ParallelSizes(dp=dp, tp=tp, ep=ep, etp=None if etp == tp else etp)
    split = StageSplit(pp=pp, first_stage_layers=first_stage_layers,
                       last_stage_layers=last_stage_layers)
    cfg = resolve_model(model, config)
    stage_layers(cfg.layers, split)  # a split that does not fit fails before anything else
    storage = _choice(storage, pipeline.STORAGES, "--storage")
    default = default_plan_name(cfg.name, sizes, settings.name, pp=pp, storage=storage)
    out = output / default if output is not None and output.is_dir() else output or Path(default)
    _check_output(out)
    ep_text = f" ep={ep}" if ep > 1 else ""
    pp_text = f" pp={pp}" if pp > 1 else ""
    with _render.progress(f"planning {cfg.name} dp={dp} tp={tp}{ep_text}{pp_text}",
                          quiet=quiet) as say:
        result = pipeline.plan(model or config, sizes, settings, dp_options=dp_options,
                               tp_options=tp_options, progress=say,
                               names=_choice(names, tuple(NAMINGS), "--names"), stages=split,
                               storage=storage)
        wall = time.perf_counter() - t0
        say("writing the plan")
        save_plan(result, out)
    from canzona.planner.hardware import load_hardware

    hw = load_hardware(tp_options.hardware)
    if isinstance(result, FSDP2Plan):
        from canzona.planner.report import fsdp2_dict

        d = fsdp2_dict(result, config=config)
        if as_json:
            _render.json_out({"fsdp2": d, "wall_s": wall, "output": str(out)})
        else:
            _render.fsdp2_summary(result, out, wall, d)
    elif isinstance(result, PipelinePlan):
        if as_json:
            _render.json_out(_render.pipeline_json(result, out, wall, hw))
        else:
            _render.pipeline_summary(result, out, wall, hw)
    elif as_json:
        _render.json_out(_render.plan_json(result, out, wall, hw))
    else:
        _render.plan_summary(result, out, wall, hw)


@command
def inspect(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by 'canzona plan'.",
                                              metavar="PLAN_FILE", show_default=False)],
    config: Annotated[Optional[Path], typer.Option(
        "--config", "-c", help="The Hugging Face config.json the plan was made from "
                               "(plans made with --config only).")] = None,
    top: Annotated[int, typer.Option("--top", help="How many of the heaviest tasks to list.",
                                     min=0)] = 5,
    top_buckets: Annotated[int, typer.Option(
        "--top-buckets", min=0, help="How many of the most costly buckets (predicted collective "
                                     "time) to list; --json lists every bucket.")] = 5,
    ranks: Annotated[str, typer.Option(
        "--ranks", help="auto: every DP index up to 16, above that their distribution and the "
                        "5 busiest; all: every DP index (and TP group).")] = "auto",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Write a per-DP-index chart to this file (.png, .pdf, .svg, …; a folder: "
                       "named after the plan) and, for tp > 1, the TP view beside it as "
                       "NAME-tp.EXT (needs matplotlib).")] = None,
    stage: StageOpt = None,
) -> None:
    """Report a plan: per-DP-index loads and collectives, the costliest buckets, gap to the bound,
    heaviest tasks, every baseline; a pipeline's stages side by side, then one stage so."""
    from canzona.planner.report import fsdp2_dict, inspect_report, stages_dict
    from canzona.planner.plan import FSDP2Plan, PipelinePlan
    from canzona.planner.plan.load import load_plan

    from . import plots

    ranks = _choice(ranks, ("auto", "all"), "--ranks")
    stages = None
    with _render.progress(f"inspecting {plan_file.name}", quiet=quiet) as say:
        say("reading the plan")
        whole = load_plan(plan_file)
        if isinstance(whole, FSDP2Plan):
            _refuse_for_fsdp2(plan_file, stage=stage, plot=plot)
            say("the FSDP2 strategies, modelled")
            d = fsdp2_dict(whole, config=config)
        elif isinstance(whole, PipelinePlan):
            say("the stages, simulated")
            stages = stages_dict(whole)
            s = _stage_of(whole, stage, stages["critical_stage"])
            p = whole.stage(s)
        else:
            if stage is not None:
                raise CanzonaError(f"--stage {stage}: {plan_file} is a plan of a whole model "
                                   "(pp 1); drop --stage.")
            p = whole
        if isinstance(whole, FSDP2Plan):
            charts = []
        else:
            charts = plots.chart_paths(plan_file, plot, tp=p.tp is not None) if plot else []
            report = inspect_report(p, config=config, top=top, progress=say)
            plots.write_charts(p, charts, progress=say)
    if isinstance(whole, FSDP2Plan):
        if as_json:
            _render.json_out({"fsdp2": d})
        else:
            _render.fsdp2_view(d)
    elif as_json:
        _render.json_out(report if stages is None else
                         {"pipeline": stages, "stage": s, "report": report})
    else:
        if stages is not None:
            _render.stages_view(stages)
            _render.console.rule(f"stage {s} of {whole.pp}, in full")
        _render.inspect_view(p, report, top_buckets=top_buckets, ranks=ranks)
        if report["tp_schedule"] is not None:
            _render.tp_view(p, report["tp_schedule"], ranks=ranks)
    _render.wrote_charts(charts, as_json=as_json)


def _refuse_for_fsdp2(plan_file: Path, **given: Any) -> None:
    """An FSDP2 plan has no stages, buckets or per-bucket charts: the options about them are
    refused in one line."""
    for name, value in given.items():
        if value is not None:
            raise CanzonaError(f"--{name}: {plan_file} is an FSDP2 plan (one DP mesh "
                               f"dimension, no buckets or stages); drop --{name}.")


def _stage_of(plan: Any, stage: int | None, critical: int) -> int:
    """The stage ``--stage`` names of a pipeline's plan (default: ``critical``)."""
    if stage is None:
        return critical
    if stage >= plan.pp:
        raise CanzonaError(f"--stage {stage}: the plan has stages 0 to {plan.pp - 1}; give one "
                           "of them.")
    return stage


@command
def simulate(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by 'canzona plan'.",
                                              metavar="PLAN_FILE", show_default=False)],
    hardware: Annotated[Optional[str], typer.Option(
        "--hardware", show_default="the profile the plan records",
        help=f"Hardware profile: {HARDWARE_CHOICES}.")] = None,
    mfu: MfuOpt = 0.4,
    seq: SeqOpt = 4096,
    tokens: TokensOpt = None,
    forward_backward: ForwardBackwardOpt = None,
    backward: Annotated[Optional[float], typer.Option(
        "--backward", min=0.0, show_default="two thirds of forward/backward",
        help="Backward seconds alone (0: nothing hides the reduce-scatters); forward is half "
             "of it.")] = None,
    overlap_param_gather: Annotated[bool, typer.Option(
        "--overlap-param-gather", help="All-gathers run into the next forward.")] = False,
    top: Annotated[int, typer.Option("--top", min=0, help="How many ranks to list.")] = 5,
    as_json: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Write the per-rank timeline (the critical rank and the ranks done last) "
                       "to this file (.png, .pdf, .svg, …; a folder: named after the plan; needs "
                       "matplotlib).")] = None,
    microbatches: MicrobatchesOpt = None,
    stage: StageOpt = None,
) -> None:
    """Predict a plan's optimizer step on a cluster: compute, TP gather/scatter, DP reduce and
    all-gather, what overlaps what, and the critical rank. Behind the same forward/backward as
    canzona compare (6·N_active·tokens at --mfu) unless told. A pipeline's plan: one 1F1B
    iteration, each stage's step behind its own last backward, then one stage in full."""
    from canzona.planner.plan import FSDP2Plan, PipelinePlan
    from canzona.planner.report import stages_dict
    from canzona.planner.simulate import (plan_forward_backward, plan_hardware, simulate_plan,
                                          split_forward_backward)
    from canzona.planner.plan.load import load_plan

    from . import _simulate_render, plots

    if not 0 < mfu <= 1:
        raise CanzonaError(f"--mfu must be in (0, 1], got {mfu:g}.")
    if backward is not None and forward_backward is not None:
        raise CanzonaError("give --backward or --forward-backward, not both.")
    whole = load_plan(plan_file)
    if isinstance(whole, FSDP2Plan):
        from canzona.planner.report import fsdp2_dict

        if hardware is not None and hardware.strip() != whole.fsdp2.hardware:
            raise CanzonaError(f"--hardware {hardware}: {plan_file} is an FSDP2 plan modelled "
                               f"on {whole.fsdp2.hardware}, its rounds chosen for it; re-plan "
                               f"with 'canzona plan ... --storage fsdp2 --hardware {hardware}'.")
        _refuse_for_fsdp2(plan_file, stage=stage, plot=plot, backward=backward,
                          tokens=tokens, **{"forward-backward": forward_backward})
        d = fsdp2_dict(whole)
        if as_json:
            _render.json_out({"fsdp2": d})
        else:
            _render.fsdp2_view(d)
        return
    if isinstance(whole, PipelinePlan):
        if backward is not None or tokens is not None or seq != 4096 or mfu != 0.4:
            raise CanzonaError(
                "a pipeline's plan is simulated behind each stage's own forward and backward "
                "(6·N_stage·tokens at MFU 0.4, split over --microbatches); drop --backward, "
                "--tokens, --seq and --mfu, or give --forward-backward (each stage's, seconds).")
        hw = plan_hardware(whole.stages[0], hardware)
        st = stages_dict(whole, hw, microbatches=microbatches,
                         overlap_param_gather=overlap_param_gather,
                         forward_backward_s=None if forward_backward is None
                         else (forward_backward,) * whole.pp)
        s = _stage_of(whole, stage, st["critical_stage"])
        row = st["stages"][s]
        p = whole.stage(s)
        fwd, bwd = row["forward_s"], row["backward_s"]
        how = (f"stage {s}'s last microbatch ({st['microbatches']} in 1F1B over {whole.pp} "
               "stages)")
        chart = None
        if plot is not None:
            chart = plots.resolve_chart(plot, plan_file.name.removesuffix(".json")
                                        .removesuffix(".plan") + f"-stage{s}-timeline")
        sim = simulate_plan(p, hw, backward_s=bwd, overlap_param_gather=overlap_param_gather,
                            forward_s=fwd)
        if chart is not None:
            plots.plot_timeline(sim, chart)
        if as_json:
            _render.json_out({"pipeline": st, "stage": s, "simulation":
                              _simulate_render.simulate_json(sim, hw, str(plan_file), how=how)})
        else:
            _render.stages_view(st)
            _render.console.rule(f"stage {s} of {whole.pp}: its optimizer step")
            _simulate_render.simulate_view(sim, hw, top=top, how=how)
        if chart is not None:
            _render.wrote_charts([chart], as_json=as_json, labels=("timeline",))
        return
    if microbatches is not None or stage is not None:
        raise CanzonaError(f"{plan_file} is a plan of a whole model (pp 1): --microbatches and "
                           "--stage apply to a pipeline's plan; drop them.")
    p = whole
    hw = plan_hardware(p, hardware)
    if backward is not None:
        fwd, bwd, how = backward / 2, backward, "backward given (--backward)"
    else:
        if forward_backward is None:
            forward_backward, how = plan_forward_backward(p, hw, tokens=tokens, seq=seq,
                                                          mfu=mfu)
        else:
            how = "forward/backward given (--forward-backward)"
        fwd, bwd = split_forward_backward(forward_backward)
    chart = None
    if plot is not None:
        chart = plots.resolve_chart(plot, plan_file.name.removesuffix(".json")
                                    .removesuffix(".plan") + "-timeline")
    sim = simulate_plan(p, hw, backward_s=bwd, overlap_param_gather=overlap_param_gather,
                        forward_s=fwd)
    if chart is not None:
        plots.plot_timeline(sim, chart)
    if as_json:
        _render.json_out(_simulate_render.simulate_json(sim, hw, str(plan_file), how=how))
    else:
        _simulate_render.simulate_view(sim, hw, top=top, how=how)
    if chart is not None:
        _render.wrote_charts([chart], as_json=as_json, labels=("timeline",))


#: How ``compare`` documents an option that a plan given with ``--plan`` records.
FROM_PLAN = " With --plan: the plan's (a different value is refused)."


def _agree_with_plan(plan_file: Path, given: dict[str, tuple[object, object]]) -> None:
    """Refuse an option given beside ``--plan`` that contradicts the plan (``given``: per option
    name, the value given, None if none, and the plan's)."""
    for name, (value, planned) in given.items():
        if value is not None and value != planned:
            shown = "none (one bucket per buffer)" if planned is None else planned
            raise CanzonaError(
                f"--{name} {value} contradicts the plan {plan_file}, made with {name} {shown}; "
                f"compare --plan takes it from the plan: drop --{name}, or make a plan with "
                f"'canzona plan ... --{name} {value}'.")


@command
def compare(
    model: ModelOpt = None,
    config: ConfigOpt = None,
    plan_file: Annotated[Optional[Path], typer.Option(
        "--plan", help="Compare this plan (as the canzona row) instead of planning "
                       "--model/--config.")] = None,
    dp: Annotated[Optional[int], typer.Option(
        "--dp", show_default="1, or the plan's", help=f"Data-parallel size.{FROM_PLAN}")] = None,
    tp: Annotated[Optional[int], typer.Option(
        "--tp", show_default="1, or the plan's", help=f"Tensor-parallel size.{FROM_PLAN}")] = None,
    ep: Annotated[Optional[int], typer.Option(
        "--ep", show_default="1, or the plan's",
        help=f"Expert-parallel size (MoE models).{FROM_PLAN}")] = None,
    optimizer: Annotated[Optional[str], typer.Option(
        "--optimizer", show_default="muon, or the plan's",
        help=f"Matrix optimizer: {', '.join(optimizers.names())}.{FROM_PLAN}")] = None,
    hardware: Annotated[Optional[str], typer.Option(
        "--hardware", show_default="h100, or the profile --plan records",
        help=f"Hardware profile: {HARDWARE_CHOICES}; canzona's plans "
             "choose their collectives for it.")] = None,
    strategies: Annotated[str, typer.Option(
        "--strategies", help="Comma-separated: sc, zero1, layerwise, layerwise-lpt, "
                             "megatron-packed, canzona-greedy, canzona; or all.")] = "all",
    mfu: MfuOpt = 0.4,
    seq: SeqOpt = 4096,
    tokens: TokensOpt = None,
    forward_backward: ForwardBackwardOpt = None,
    overlap_param_gather: Annotated[bool, typer.Option(
        "--overlap-param-gather", help="ZeRO-1 all-gathers run into the next forward (the "
                                       "layer-wise optimizer's own all-gather cannot).")] = False,
    bucket_size: Annotated[Optional[int], typer.Option(
        "--bucket-size", show_default="Megatron's max(40M, 1M·dp), or the plan's",
        help=f"Elements per bucket.{FROM_PLAN}")] = None,
    share: Annotated[Optional[str], typer.Option(
        "--share", show_default="auto, as canzona plan",
        help="The canzona row's plan shares Muon matrices (as canzona plan "
             "--share: off, auto, all, all-split); the other rows stay whole.")] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="Write a stacked bar per strategy to this file (.png, .pdf, .svg, …; a "
                       "folder: a name is made) and canzona's per-rank timeline beside it as "
                       "NAME-timeline.EXT (needs matplotlib).")] = None,
    pp: Annotated[Optional[int], typer.Option(
        "--pp", show_default="1, or the plan's",
        help=f"Pipeline stages (1F1B): every strategy on each stage, each stage's step behind "
             f"its own last backward; the iteration ends with the slowest stage's.{FROM_PLAN}"
    )] = None,
    first_stage_layers: FirstStageOpt = None,
    last_stage_layers: LastStageOpt = None,
    microbatches: MicrobatchesOpt = None,
    storage: Annotated[Optional[str], typer.Option(
        "--storage", show_default="zero1, or the plan's",
        help="fsdp2: the FSDP2 strategies side by side (canzona's owners and rounds, "
             "dist-muon: torchtitan DistMuon's longest-first owners on FLOPs, sync: every "
             f"rank computes every matrix), modelled on --hardware.{FROM_PLAN}")] = None,
) -> None:
    """Predict the optimizer step and iteration of every strategy (sc, zero1, layer-wise as
    megatron-core deals it and by LPT, Megatron's packed layout, the paper's greedy, canzona) on
    one model, sizes and cluster; under FSDP2 (--storage fsdp2), its strategies'."""
    from canzona.planner import (DPOptions, OptimizerSettings, ParallelSizes, TPOptions,
                                 resolve_model)
    from canzona.planner.strategies import CANZONA, STRATEGIES, compare as run_compare, compare_plan

    from . import _simulate_render, plots

    if not 0.0 < mfu <= 1.0:
        raise CanzonaError(f"--mfu must be in (0, 1], got {mfu:g}.")
    picked = STRATEGIES if strategies.strip().lower() == "all" else tuple(
        _choice(s, STRATEGIES, "--strategies") for s in strategies.split(",") if s.strip())
    chosen = tuple(s for s in STRATEGIES if s in picked)  # the table's order
    if not chosen:
        raise CanzonaError("--strategies: name at least one of: " + ", ".join(STRATEGIES) + ".")
    kw = dict(strategies=chosen, mfu=mfu, seq=seq, tokens=tokens,
              forward_backward_s=forward_backward, overlap_param_gather=overlap_param_gather)
    if _compare_fsdp2(model, config, plan_file, storage, dp=dp, tp=tp, ep=ep,
                      optimizer=optimizer, hardware=hardware, as_json=as_json, quiet=quiet,
                      others={"pp": pp, "plot": plot, "share": share,
                              "bucket-size": bucket_size, "microbatches": microbatches}):
        return
    staged = _compare_stages(plan_file, pp, first_stage_layers, last_stage_layers)
    if staged is not None:
        if plot is not None:
            raise CanzonaError("--plot draws one model's strategies; for a pipeline, compare "
                               "a stage's plan (canzona simulate PLAN --stage S --plot) or drop "
                               "--plot.")
        _compare_pipeline(model, config, plan_file, staged, dp, tp, ep, optimizer, hardware,
                          bucket_size, share, microbatches, as_json, quiet, kw)
        return
    if microbatches is not None:
        raise CanzonaError("--microbatches applies to pipelines (--pp > 1); drop it.")
    if plan_file is not None:
        if model is not None:
            raise CanzonaError("give --plan or --model, not both (--config goes with --plan only "
                               "for plans made from a config.json).")
        if share is not None:
            raise CanzonaError("--share applies when compare makes the plans (--model/--config); "
                               "the plan given with --plan already records what it shares.")
        from canzona.planner.plan.load import load_plan
        title = plan_file.name
    else:
        dp, tp, ep = (1 if v is None else v for v in (dp, tp, ep))
        cfg = resolve_model(model, config)
        title = f"{cfg.name} dp={dp} tp={tp}"
    chart = None
    if plot is not None:
        stem = (plan_file.name.removesuffix(".json").removesuffix(".plan") if plan_file
                else f"{title.split()[0]}-dp{dp}-tp{tp}" + (f"-ep{ep}" if ep > 1 else "")) \
            + "-compare"
        chart = plots.resolve_chart(plot, stem)
    with _render.progress(f"comparing {title}", quiet=quiet) as say:
        if plan_file is not None:
            p = load_plan(plan_file)
            _agree_with_plan(plan_file, {
                "dp": (dp, p.inputs.dp), "tp": (tp, p.inputs.tp), "ep": (ep, p.inputs.ep),
                "optimizer": (optimizer and _choice(optimizer, optimizers.names(), "--optimizer"),
                              p.inputs.optimizer.name),
                "bucket-size": (bucket_size, p.inputs.bucket_size)})
            comp = compare_plan(p, hardware, config=config, progress=say, **kw)
        else:
            settings = OptimizerSettings(
                name=_choice(optimizer or "muon", optimizers.names(),  # type: ignore[arg-type]
                             "--optimizer"))
            hw_name = (hardware or "h100").strip()
            comp = run_compare(model or config, ParallelSizes(dp=dp, tp=tp, ep=ep), settings,
                               hardware=hw_name, dp_options=DPOptions(bucket_size=bucket_size),
                               tp_options=TPOptions(hardware=hw_name,
                                                    share=(share or DEFAULT_SHARE).strip().lower()),
                               progress=say,
                               **kw)
        if chart is not None:
            say("charts")
            plots.plot_compare(comp, chart)
            focus = next((r for r in comp.runs if r.name == CANZONA), comp.runs[-1])
            plots.plot_timeline(focus.sim, plots.timeline_path(chart),
                                title=f"{comp.model} dp={comp.dp} tp={comp.tp}: {focus.name}, "
                                      f"optimizer step {focus.step_s * 1e3:.3g} ms (simulated)")
    if as_json:
        _render.json_out(_simulate_render.compare_json(comp))
    else:
        _simulate_render.compare_view(comp)
    if chart is not None:
        _render.wrote_charts([chart, plots.timeline_path(chart)], as_json=as_json,
                             labels=("chart", "timeline"))


def _compare_fsdp2(model: str | None, config: Path | None, plan_file: Path | None,
                   storage: str | None, *, dp: int | None, tp: int | None, ep: int | None,
                   optimizer: str | None, hardware: str | None, as_json: bool, quiet: bool,
                   others: dict[str, Any]) -> bool:
    """``compare`` under FSDP2 (``--storage fsdp2``, or an FSDP2 plan given with ``--plan``):
    the FSDP2 strategies side by side. False when it is not FSDP2's."""
    from canzona.planner import OptimizerSettings, ParallelSizes, TPOptions, pipeline
    from canzona.planner.plan import FSDP2Plan
    from canzona.planner.plan.load import load_plan
    from canzona.planner.report import fsdp2_dict

    if storage is not None:
        storage = _choice(storage, pipeline.STORAGES, "--storage")
    given = load_plan(plan_file) if plan_file is not None else None
    if given is not None:
        if model is not None:
            raise CanzonaError("give --plan or --model, not both (--config goes with --plan "
                               "only for plans made from a config.json).")
        got = "fsdp2" if isinstance(given, FSDP2Plan) else "zero1"
        _agree_with_plan(plan_file, {"storage": (storage, got)})
        storage = got
    if storage != "fsdp2":
        return False
    for name, value in others.items():
        if value is not None:
            raise CanzonaError(f"--{name} does not apply to FSDP2's strategies (one DP mesh "
                               f"dimension, no buckets or stages); drop --{name}.")
    with _render.progress("comparing FSDP2 strategies", quiet=quiet) as say:
        if isinstance(given, FSDP2Plan):
            _agree_with_plan(plan_file, {
                "dp": (dp, given.inputs.dp), "tp": (tp, 1), "ep": (ep, 1),
                "optimizer": (optimizer and _choice(optimizer, optimizers.names(),
                                                    "--optimizer"), given.inputs.optimizer.name),
                "hardware": (hardware, given.fsdp2.hardware)})
            made = given
        else:
            settings = OptimizerSettings(
                name=_choice(optimizer or "muon", optimizers.names(),  # type: ignore[arg-type]
                             "--optimizer"))
            made = pipeline.plan(model or config, ParallelSizes(dp=dp or 1, tp=tp or 1,
                                                                ep=ep or 1), settings,
                                 tp_options=TPOptions(hardware=(hardware or "h100").strip()),
                                 progress=say, storage="fsdp2")
        d = fsdp2_dict(made, config=config)
    if as_json:
        _render.json_out({"fsdp2": d})
    else:
        _render.fsdp2_view(d)
    return True


def _compare_stages(plan_file: Path | None, pp: int | None, first: int | None,
                    last: int | None) -> Any:
    """The stages ``compare`` runs (a ``StageSplit``), None for a whole model: ``--pp`` and
    the first and last stages' layers, or a pipeline's plan given with ``--plan``."""
    from canzona.planner.plan import PipelinePlan
    from canzona.planner.plan.load import load_plan
    from canzona.planner.stages import StageSplit

    if plan_file is not None:
        if first is not None or last is not None:
            raise CanzonaError("--first-stage-layers and --last-stage-layers shape the stages "
                               "compare plans; a plan given with --plan records its own: drop "
                               "them.")
        p = load_plan(plan_file)
        got = p.pp if isinstance(p, PipelinePlan) else 1
        _agree_with_plan(plan_file, {"pp": (pp, got)})
        return p if isinstance(p, PipelinePlan) else None
    split = StageSplit(pp=pp or 1, first_stage_layers=first, last_stage_layers=last)
    return split if split.pp > 1 or first is not None or last is not None else None


def _compare_pipeline(model: str | None, config: Path | None, plan_file: Path | None,
                      staged: Any, dp: int | None, tp: int | None, ep: int | None,
                      optimizer: str | None, hardware: str | None, bucket_size: int | None,
                      share: str | None, microbatches: int | None, as_json: bool, quiet: bool,
                      kw: dict) -> None:
    """``compare`` of a pipeline: every strategy on each stage, and the 1F1B iteration."""
    from canzona.planner import (DPOptions, OptimizerSettings, ParallelSizes, TPOptions,
                                 resolve_model)
    from canzona.planner.plan import PipelinePlan
    from canzona.planner.stages import StageSplit, stage_layers
    from canzona.planner.strategies import compare_pipeline

    from . import _simulate_render

    if isinstance(staged, PipelinePlan):
        if model is not None:
            raise CanzonaError("give --plan or --model, not both.")
        if share is not None:
            raise CanzonaError("--share applies when compare makes the plans (--model/--config); "
                               "the plan given with --plan already records what it shares.")
        inp = staged.stages[0].inputs
        _agree_with_plan(plan_file, {  # type: ignore[arg-type]
            "dp": (dp, inp.dp), "tp": (tp, inp.tp), "ep": (ep, inp.ep),
            "optimizer": (optimizer and _choice(optimizer, optimizers.names(), "--optimizer"),
                          inp.optimizer.name),
            "bucket-size": (bucket_size, inp.bucket_size)})
        title = plan_file.name  # type: ignore[union-attr]
        with _render.progress(f"comparing {title}", quiet=quiet) as say:
            comp = compare_pipeline(None, None,  # type: ignore[arg-type]
                                    stages=StageSplit(pp=staged.pp), plan=staged,
                                    microbatches=microbatches, hardware=hardware,
                                    config=config, progress=say, **kw)
    else:
        dp, tp, ep = (1 if v is None else v for v in (dp, tp, ep))
        cfg = resolve_model(model, config)
        stage_layers(cfg.layers, staged)
        settings = OptimizerSettings(
            name=_choice(optimizer or "muon", optimizers.names(),  # type: ignore[arg-type]
                         "--optimizer"))
        hw_name = (hardware or "h100").strip()
        with _render.progress(f"comparing {cfg.name} pp={staged.pp} dp={dp} tp={tp}",
                              quiet=quiet) as say:
            comp = compare_pipeline(
                model or config, ParallelSizes(dp=dp, tp=tp, ep=ep), settings, stages=staged,
                microbatches=microbatches, hardware=hw_name,
                dp_options=DPOptions(bucket_size=bucket_size),
                tp_options=TPOptions(hardware=hw_name,
                                     share=(share or DEFAULT_SHARE).strip().lower()),
                progress=say, **kw)
    if as_json:
        _render.json_out(comp.to_dict())
    else:
        _simulate_render.compare_pipeline_view(comp)


@command
def calibrate(
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Profile file to write (atomically).")] = Path("hardware.json"),
    quick: Annotated[bool, typer.Option(
        "--quick",
        help="Tiny shapes, few repetitions: seconds, rough figures (for tests).")] = False,
    name: Annotated[Optional[str], typer.Option(
        "--name", show_default="calibrated-HOSTNAME", help="The profile's name.")] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Measure this machine (matmul, Newton–Schulz, eigh/QR, memory, a 2-process collective
    link) and write a hardware profile for 'canzona plan --hardware FILE' and 'simulate'."""
    try:
        from canzona.runtime.calibrate import calibrate as measure
    except ImportError as exc:
        raise CanzonaError(f"canzona calibrate needs torch ({exc.msg}); install it with: "
                           "python -m pip install 'canzona[runtime]'") from None
    from canzona.planner.plan import write_atomically

    _check_output(output, "hardware profile")
    with _render.progress("calibrating this machine", quiet=quiet) as say:
        profile = measure(quick=quick, name=name, progress=say)
        write_atomically(output, profile.model_dump_json(indent=2) + "\n",
                         what="hardware profile", error=CanzonaError)
    if as_json:
        _render.json_out(profile.model_dump(mode="json"))
        return
    link = profile.intra_node
    rates = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in profile.peak_flops.items())
    _render.console.print(
        f"{profile.name}: matmul {rates}; memory {profile.memory_bandwidth / 1e9:.1f} GB/s; "
        f"link busbw {link.busbw / 1e9:.2f} GB/s, α {link.latency_s * 1e6:.1f} µs\n"
        f"wrote {output}; use it with: canzona plan ... --hardware {output}", highlight=False)


def main() -> None:
    """Console entry point."""
    app()


if __name__ == "__main__":
    main()
