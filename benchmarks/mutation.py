"""Mutation testing: does the suite catch plausible one-line bugs in the runtime and plan checks?

    python benchmarks/mutation.py [--only ID ...] [--list] [--timeout 900] [--json FILE]

Each mutant below is a one-line change a careful person could make by mistake, with the tests
that guard that code. For each, the repository (``canzona/``, ``tests/``, ``plans/``,
``benchmarks/``, ``pyproject.toml``) is copied to a temporary folder, the one line changed
there, and its tests run against the copy (``PYTHONPATH`` points at it, so spawned ranks import
the mutated package too). A mutant is *killed* when the tests fail (or time out: a hang is a
failure), *survives* when they pass; a mutant that does not compile, or whose line is gone, is
*stale* (it proves nothing). A survivor is a gap in the tests unless the mutant is
*equivalent* — it cannot change a result — which its ``equivalent`` note then says why. The
score is killed / (mutants − equivalent). Prints one line per mutant and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("canzona", "tests", "plans", "benchmarks", "pyproject.toml", "examples")


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files or folders, and -k expressions
    what: str
    equivalent: str = ""  # why the mutant cannot change a result, when it cannot
    extra: dict = field(default_factory=dict)


RT = "canzona/runtime/"
DP = "tests/runtime/test_dp_runtime.py"
TP = "tests/runtime/test_tp_runtime.py"
NONFINITE = "tests/runtime/test_nonfinite_agreed.py"
BF16 = "tests/runtime/test_dp_bf16.py"
SCHED = "tests/runtime/test_dp_schedulers.py"
M = Mutant
MUTANTS: list[Mutant] = [
    # -- the ZeRO-1 storage: buckets, collectives, gradient collection ---------------------------
    M("average", RT + "storage/collectives.py", "self.buffers.own.div_(self.dp)",
      "self.buffers.own.div_(self.dp * 2)", (DP,),
      "the reduce-scatter's average divides by twice the ranks"),
    M("padded-gather-own", RT + "storage/collectives.py", "if r != self.rank:",
      "if r == self.rank:",
      (DP,), "the padded all-gather unpacks only its own slice"),
    M("a2a-sum", RT + "storage/collectives.py",
      "torch.sum(self._received.view(self.dp, n), dim=0, out=self.buffers.own)",
      "torch.mean(self._received.view(self.dp, n), dim=0, out=self.buffers.own)",
      (DP,), "the all-to-all reduce averages before averaging"),
    M("per-root-empty", RT + "storage/collectives.py",
      "return [r for r, n in enumerate(self.bucket.sizes) if n > 0]",
      "return [r for r, n in enumerate(self.bucket.sizes) if n >= 0]",
      (DP,), "per-root calls also for empty slices"),
    M("received-flag", RT + "storage/gradients.py", "self.received[i] = 1",
      "self.received[i] = 0", (DP,),
      "a gradient that arrived is recorded as missing"),
    M("bucket-order", RT + "storage/gradients.py",
      "and self.reported[self.next_bucket] >= self.expected[self.next_bucket]):",
      "and self.reported[self.next_bucket] >= self.expected[self.next_bucket] - 1):",
      ("tests/runtime/test_dp_overlap.py", DP),
      "a bucket launches one gradient before it is complete"),
    M("clip-up", RT + "storage/gradients.py",
      "coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)",
      "coef = max_norm / (total + 1e-6)", ("tests/runtime/test_clipping.py",),
      "clipping also scales gradients up when the norm is below max_norm"),
    M("clip-tp-duplicates", RT + "storage/gradients.py",
      "parts.append(o[lo:hi].float().pow(2).sum() * (1.0 / tp - 1.0))",
      "parts.append(o[lo:hi].float().pow(2).sum() * 0.0)", (TP,),
      "TP-replicated parameters count tp times in the global norm"),
    M("clip-dp", RT + "storage/gradients.py", "    if dp > 1:\n        dist.all_reduce(total",
      "    if dp > 2:\n        dist.all_reduce(total", (DP, SCHED),
      "at dp 2 the norm is not summed over the DP group"),
    M("dp1-unpack", RT + "storage/collectives.py",
      "        self.wait_reduce()\n        self._unpack_reduce()",
      "        self.wait_reduce()\n        if self.dp > 1:\n            self._unpack_reduce()",
      ("tests/test_gpu_check.py",), "a named collective at dp 1 never unpacks its result"),
    # -- what the ranks agree on ------------------------------------------------------------------
    M("uneven-backward", RT + "flags.py", "had[rank] = int(bool(grads.received.any()))",
      "had[rank] = 1", ("tests/runtime/test_misuse.py",),
      "a rank without gradients counts as having them"),
    M("nonfinite-policy", RT + "flags.py", 'raise_on = [i for i in bad if policy(i) == "raise"]',
      'raise_on = [i for i in bad if policy(i) != "raise"]', (NONFINITE,),
      "raise and skip swapped"),
    M("skip-zeroes", RT + "flags.py", "                buf.own[x.lo:x.hi].zero_()",
      "                pass", (NONFINITE,),
      "a skipped non-finite gradient still counts in the clipping norm"),
    M("weights-digest", RT + "weights.py", "differs = torch.nonzero(high != low)",
      "differs = torch.nonzero(high != high)", ("tests/runtime/test_misuse.py",),
      "ranks with different weights pass the check"),
    M("ddp-refused", RT + "checks.py",
      'if grad_sync != "external" and isinstance(model, nn.parallel.DistributedDataParallel):',
      'if grad_sync == "external" and isinstance(model, nn.parallel.DistributedDataParallel):',
      ("tests/runtime/test_misuse.py",), "a DDP model is accepted with canzona's own reduction"),
    # -- the owned updates -------------------------------------------------------------------------
    M("untouched-matrix", RT + "update.py",
      "tasks = [t for ts in work.matrix for t in ts if received[t.param] and t.pair is None]",
      "tasks = [t for ts in work.matrix for t in ts if t.pair is None]",
      (DP, "tests/runtime/test_untouched.py"),
      "a matrix no rank had a gradient for is updated (and decayed)"),
    M("untouched-adamw", RT + "update.py",
      "slices = [a for a in work.adamw[bucket] if received[a.param]]",
      "slices = list(work.adamw[bucket])", (DP, "tests/runtime/test_untouched.py"),
      "an AdamW parameter no rank had a gradient for is updated (and decayed)"),
    M("main-copy-back", RT + "update.py",
      "        if main is not None:\n            own_params[t.lo:t.hi].copy_(main[t.lo:t.hi])",
      "        if main is None:\n            own_params[t.lo:t.hi].copy_(main[t.lo:t.hi])",
      (BF16,), "the fp32 main copy of a matrix never reaches the bf16 parameter"),
    # -- TP micro-groups ---------------------------------------------------------------------------
    M("tp-comm-dtype", RT + "tp.py",
      "        send = (torch.cat(pieces) if pieces else torch.empty(0, device=device))"
      ".to(self.comm_dtype)\n        return self._all_to_all(send, g.recv, g.send, group,",
      "        send = (torch.cat(pieces) if pieces else torch.empty(0, device=device))"
      ".to(torch.float32)\n        return self._all_to_all(send, g.recv, g.send, group,",
      (TP,), "the TP gather ignores the plan's communication dtype"),
    M("tp-raise-together", RT + "tp.py", '"nonfinite", None) == "raise" and self.tp > 1:',
      '"nonfinite", None) == "raise" and self.tp > 2:', (TP, NONFINITE),
      "at tp 2 only the host raises for a non-finite matrix"),
    M("tp-untouched", RT + "tp.py", "todo = [t for t in g.hosted if received[t.param]]",
      "todo = list(g.hosted)", (TP,),
      "a hosted matrix without gradient is updated"),
    M("tp-apply-untouched", RT + "tp.py", "            if received[t.param] and chunks:",
      "            if chunks:", (TP,),
      "every TP rank applies an update to a matrix without gradient"),
    M("tp-nan-skip", RT + "tp.py", "            if not ok:\n                continue",
      "            if ok is None:\n                continue", (TP,),
      "the NaN that marks an untouched matrix is applied"),
    # -- shared Newton–Schulz ----------------------------------------------------------------------
    M("ns-norm", RT + "optim/shared_ns.py", "norm = sq.sqrt().to(dt).clamp(min=eps)",
      "norm = sq.to(dt).clamp(min=eps)", ("tests/runtime/optim", "tests/runtime/test_dp_pairs.py"),
      "the shared kernel normalises by the squared norm"),
    M("gram-mirror", RT + "optim/gram_packing.py", "        v.copy_(gram[r0:r1, r0:])",
      "        v.copy_(gram[r0:r1, r0:] * 2)", ("tests/runtime/optim",),
      "each rank's partial Gram counts twice in the packed sum"),
    M("row-block", RT + "optim/orientation.py", "    return start // cols, stop // cols",
      "    return start // cols, stop // cols + 1",
      ("tests/runtime/optim/test_shared_ns.py", "tests/runtime/test_dp_pairs.py"),
      "a ZeRO-1 cut's rows run one row too far"),
    M("muon-momentum", RT + "optim/muon.py", "torch._foreach_lerp_(bufs, gs, 1 - cfg.momentum)",
      "torch._foreach_lerp_(bufs, gs, cfg.momentum)", ("tests/runtime/optim",),
      "Muon's momentum weights the gradient by μ instead of 1 − μ"),
    # -- checkpoints -------------------------------------------------------------------------
    M("ckpt-row-offset", RT + "checkpoint/keys.py",
      "at = x.row0 * x.local_shape[1]  # its rows of the shard",
      "at = 0 * x.local_shape[1]  # its rows of the shard",
      ("tests/runtime/checkpoint", TP, "tests/runtime/test_dp_pairs.py"),
      "a shared piece's state is saved at row 0 instead of its own row"),
    M("equal-gather", RT + "storage/collectives.py",
      "        self._send.copy_(self.buffers.own_params)",
      "        pass", (DP,),
      "the equal all-gather sends a stale slice"),
    M("a2a-gather", RT + "storage/collectives.py",
      "self._send.view(self.dp, n).copy_(self.buffers.own_params.expand(self.dp, n))",
      "self._send.view(self.dp, n).zero_()", (DP,),
      "the all-to-all all-gather sends zeros"),
    M("main-copies", RT + "storage/buffers.py", "main=pbuf[lo:hi].float() if low else None,",
      "main=None,", (BF16,), "no fp32 main copies under main_params='fp32'"),
    M("tp-sum-partial", RT + "replicated.py", "    dist.all_reduce(flat, group=tp_group)",
      "    pass", (TP,),
      "partial gradients of sequence-parallel norms are not summed over TP"),
    M("tp-group-size", RT + "checks.py", "    if size != tp:", "    if size < tp:",
      (TP, "tests/runtime/test_tp_dtensor.py"), "a TP group larger than the plan's tp is accepted"),
    M("muon-nesterov", RT + "optim/muon.py", "ups = torch._foreach_lerp(gs, bufs, cfg.momentum)",
      "ups = torch._foreach_lerp(gs, bufs, 1 - cfg.momentum)", ("tests/runtime/optim",),
      "Nesterov's look-ahead weights swapped"),
    M("muon-lr-scale", RT + "optim/muon.py", "ratio = 0.2 * math.sqrt(max(rows, cols))",
      "ratio = 0.2 * math.sqrt(min(rows, cols))", ("tests/runtime/optim",),
      "the RMS-matched learning-rate scale uses the short side"),
    M("split-poly", RT + "optim/shared_ns.py",
      "torch.addmm(t.gram[r0:r1, r0:], t.gram[r0:r1], t.gram[:, r0:], beta=b,\n"
      "                                alpha=c, out=v)",
      "torch.addmm(t.gram[r0:r1, r0:], t.gram[r0:r1], t.gram[:, r0:], beta=c,\n"
      "                                alpha=b, out=v)",
      ("tests/runtime/optim", "tests/runtime/test_dp_pairs.py"),
      "the split polynomial's coefficients swapped"),
    M("pair-sum", RT + "optim/transports.py", "lambda: t.add_(other))", "lambda: t.copy_(other))",
      ("tests/runtime/optim", "tests/runtime/test_dp_pairs.py"),
      "a DP pair keeps its partner's Gram instead of the sum"),
    M("adamw-bias", RT + "optim/adamw.py", "            step_size = lr / (1 - beta1**t)",
      "            step_size = lr", ("tests/runtime/optim",),
      "AdamW without the first moment's bias correction"),
    M("tp-shampoo-blocks", "canzona/planner/plan/tp_checks.py",
      "if x.split_poly or not shard_blocks_aligned(smap, st.max_preconditioner_dim):",
      "if not shard_blocks_aligned(smap, st.max_preconditioner_dim):",
      ("tests/planner/plan", "tests/cli"), "a Shampoo shard-blocks task with split_poly passes"),
    # -- plan checks ------------------------------------------------------------------------------
    M("plan-bound", "canzona/planner/plan/checks.py", "if m.certified_bound < lb:",
      "if m.certified_bound < 0:", ("tests/planner/plan", "tests/cli"),
      "a certified bound below the simple lower bound is accepted"),
    M("plan-alignment", "canzona/planner/plan/structure.py",
      "if sl.start % PARAM_ALIGN:", "if False and sl.start % PARAM_ALIGN:",
      ("tests/planner/plan", "tests/cli"), "a slot that breaks the alignment rule is accepted"),
    M("plan-pair-poly", "canzona/planner/plan/pair_checks.py", "if x.phase or x.split_poly:",
      "if x.phase:", ("tests/planner/plan", "tests/cli"),
      "a DP pair's split_poly is not checked"),
]


def _copy(dest: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__",
                                                                              "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dest / name)


def run_mutant(m: Mutant, work: Path, timeout: float) -> dict:
    path = work / m.file
    original = path.read_text()
    if original.count(m.old) != 1:
        return {"id": m.id, "status": "stale",
                "detail": f"{m.file}: the line to mutate occurs {original.count(m.old)} times"}
    mutated = original.replace(m.old, m.new)
    try:
        compile(mutated, str(path), "exec")
    except SyntaxError as exc:  # a mutant that does not compile proves nothing
        return {"id": m.id, "status": "stale", "detail": f"{m.file}: the mutant does not "
                                                         f"compile ({exc.msg}, line {exc.lineno})"}
    path.write_text(mutated)
    env = dict(os.environ, PYTHONPATH=str(work), PYTHONDONTWRITEBYTECODE="1")
    args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
            *m.tests]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True,
                           timeout=timeout)
        status = "survived" if r.returncode == 0 else "killed"
        detail = (r.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        status, detail = "killed", f"timed out after {timeout:.0f} s"
    finally:
        path.write_text(original)
    if status == "survived" and m.equivalent:
        status = "equivalent"
    return {"id": m.id, "status": status, "seconds": time.perf_counter() - t0,
            "detail": detail, "file": m.file, "what": m.what, "equivalent": m.equivalent}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="run these mutant ids")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant's tests")
    ap.add_argument("--json", type=Path, help="write every result here")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.id:20} {m.file}: {m.what}")
        return 0
    unknown = set(args.only or ()) - {m.id for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutant ids: {', '.join(sorted(unknown))}")
    results = []
    with tempfile.TemporaryDirectory(prefix="canzona-mutants-") as tmp:
        work = Path(tmp)
        _copy(work)
        for m in chosen:
            res = run_mutant(m, work, args.timeout)
            results.append(res)
            print(f"{res['id']:20} {res['status']:10} {res.get('seconds', 0):6.1f} s  "
                  f"{res['detail'][:80]}", flush=True)
    counted = [r for r in results if r["status"] in ("killed", "survived")]
    killed = sum(r["status"] == "killed" for r in counted)
    score = killed / len(counted) if counted else 1.0
    print("\n| mutant | file | the bug | result |\n|---|---|---|---|")
    for r in results:
        note = f" ({r['equivalent']})" if r["status"] == "equivalent" else ""
        print(f"| {r['id']} | {r.get('file', '')} | {r.get('what', '')} | {r['status']}{note} |")
    print(f"\nscore {killed}/{len(counted)} = {score:.0%} "
          f"({sum(r['status'] == 'equivalent' for r in results)} equivalent, "
          f"{sum(r['status'] == 'stale' for r in results)} stale)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["status"] != "stale" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
