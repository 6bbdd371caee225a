"""The sha256 of every example plan and every plan of the planner sweep, recorded and checked.

    python benchmarks/plan_hashes.py            # check against benchmarks/plan_hashes.json
    python benchmarks/plan_hashes.py --record   # rewrite the record (only for an intended change)
    python benchmarks/plan_hashes.py --only qwen3-0.6b   # check the cases of some models only

A refactoring of the planner must leave every plan byte-identical. The record holds,
for each case, the sha256 of the plan's canonical JSON (``Plan.to_json()``, what ``save_plan``
writes):

* ``plans/NAME`` — every example plan, built as ``plans/regenerate.py`` builds it (DP and TP,
  the default options);
* ``flops/NAME`` — the same case with ``--cost flops --share off``: the paper's comparisons'
  plans, byte-identical to the example plans made before the roofline cost and sharing became
  the defaults;
* ``sweep/MODEL-dpD-tpT`` and ``sweep/MODEL-dpD-tpT-no-reorder`` — the DP plans of
  ``benchmarks/bench_planner.py``'s sweep (default solver, and ``reorder=False``; FLOPs cost,
  nothing shared);
* ``paths/MODEL-dpD-tpT[-epE]-OPTIMIZER-share-SHARE-HARDWARE`` — one plan per path the sweep does
  not take: sharing (``auto`` at tp 1 and tp 8, DP pairs, Shampoo blocks, TP pairs), an ep 4 MoE
  plan, Shampoo and SOAP at tp 1 and tp > 1 (:data:`PATHS`; FLOPs cost).

Exit status 1 and one line per differing case when a plan changed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from canzona.planner import ParallelSizes, SizeError
from canzona.planner.options import DPOptions, TPOptions
from canzona.planner.pipeline import plan

HERE = Path(__file__).resolve().parent
RECORD = HERE / "plan_hashes.json"
#: The FLOPs cost, the paper's comparisons' (the sweep and the paths keep it).
FLOPS = DPOptions(cost="flops")

#: (model, dp, tp, ep, optimizer, share, hardware): full plans (TP section included) of the
#: planner paths the sweep does not take.
PATHS = (
    ("qwen3-0.6b", 8, 1, 1, "muon", "auto", "h100"),
    ("qwen3-8b", 256, 1, 1, "muon", "auto", "h800"),
    ("qwen3-0.6b", 8, 1, 1, "muon", "all-split", "h100"),
    ("qwen3-0.6b", 4, 1, 1, "shampoo", "all", "h100"),
    ("llama3-8b", 16, 8, 1, "muon", "auto", "h100"),
    ("qwen3-4b", 16, 8, 1, "muon", "auto", "h800"),
    ("qwen3-4b", 4, 4, 1, "muon", "pairs", "h100"),
    ("qwen3-30b-a3b", 8, 2, 4, "muon", "off", "h100"),
    ("qwen3-0.6b", 8, 1, 1, "shampoo", "off", "h100"),
    ("qwen3-0.6b", 8, 1, 1, "soap", "off", "h100"),
    ("qwen3-0.6b", 4, 4, 1, "shampoo", "off", "h100"),
    ("qwen3-0.6b", 4, 4, 1, "soap", "off", "h100"),
)


def path_name(model: str, dp: int, tp: int, ep: int, optimizer: str, share: str,
              hardware: str) -> str:
    """The record's name of a :data:`PATHS` case."""
    epn = f"-ep{ep}" if ep > 1 else ""
    return f"paths/{model}-dp{dp}-tp{tp}{epn}-{optimizer}-share-{share}-{hardware}"


def _path_plan(model: str, dp: int, tp: int, ep: int, optimizer: str, share: str,
               hardware: str) -> str:
    return plan(model, ParallelSizes(dp=dp, tp=tp, ep=ep), optimizer, dp_options=FLOPS,
                tp_options=TPOptions(share=share, hardware=hardware)).to_json()


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases() -> Iterator[tuple[str, str, Callable[[], str]]]:
    """(case name, model, function giving the plan's JSON text) for every recorded case."""
    regen = _load(HERE.parent / "plans" / "regenerate.py", "plans_regenerate")
    bench = _load(HERE / "bench_planner.py", "bench_planner")
    for model, dp, tp in regen.CASES:
        yield (f"plans/{regen.plan_name(model, dp, tp)}", model,
               lambda m=model, d=dp, t=tp: regen.build(m, d, t).to_json())
        yield (f"flops/{regen.plan_name(model, dp, tp)}", model,
               lambda m=model, d=dp, t=tp: plan(m, ParallelSizes(dp=d, tp=t), "muon",
                                                dp_options=FLOPS,
                                                tp_options=TPOptions(share="off")).to_json())
    for model in bench.MODELS:
        for dp in bench.DPS:
            for tp in bench.TPS:
                for reorder in (True, False):
                    name = f"sweep/{model}-dp{dp}-tp{tp}" + ("" if reorder else "-no-reorder")
                    yield name, model, lambda m=model, d=dp, t=tp, r=reorder: _sweep(m, d, t, r)
    for case in PATHS:
        yield path_name(*case), case[0], lambda c=case: _path_plan(*c)


def _sweep(model: str, dp: int, tp: int, reorder: bool) -> str | None:
    try:
        sizes = ParallelSizes(dp=dp, tp=tp)
        # The DP plan alone (the sweep measures the DP partition): TP scheduling off.
        return plan(model, sizes, "muon", dp_options=DPOptions(reorder=reorder, cost="flops"),
                    tp_options=TPOptions(share="off"), dp_only=True).to_json()
    except SizeError:
        return None  # sizes the model does not allow: not a case


def compute(only: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 per case (models in ``only``, or all), with progress on stderr."""
    out: dict[str, str] = {}
    all_cases = [c for c in cases() if not only or c[1] in only]
    t0 = time.perf_counter()
    for k, (name, _, make) in enumerate(all_cases, 1):
        text = make()
        if text is not None:
            out[name] = hashlib.sha256(text.encode()).hexdigest()
        if sys.stderr.isatty():
            print(f"\r{k}/{len(all_cases)} plans, {time.perf_counter() - t0:.0f} s", end="",
                  file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return out


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check(hashes: dict[str, str], record: dict[str, str], only: tuple[str, ...] = ()) -> list[str]:
    """One line per case whose plan differs from the record, is new, or has gone."""
    problems = [f"{n}: sha256 {h[:12]}… differs from the recorded {record[n][:12]}…"
                for n, h in hashes.items() if n in record and record[n] != h]
    problems += [f"{n}: not in the record" for n in hashes if n not in record]
    if not only:
        problems += [f"{n}: recorded but no longer made" for n in record if n not in hashes]
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="rewrite benchmarks/plan_hashes.json")
    ap.add_argument("--only", nargs="+", default=(), metavar="MODEL",
                    help="check only the cases of these models")
    args = ap.parse_args()
    only = tuple(args.only)
    if args.record and only:
        ap.error("--record records every case; drop --only")
    hashes = compute(only)
    if args.record:
        _write_atomically(RECORD, json.dumps(hashes, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(hashes)} plan hashes in {RECORD}")
        return 0
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    problems = check(hashes, record, only)
    for p in problems:
        print(p)
    print(f"{len(hashes) - len(problems)} of {len(hashes)} plans byte-identical to the record")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
