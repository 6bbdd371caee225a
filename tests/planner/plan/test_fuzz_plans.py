"""Bad plans, fuzzed: hypothesis mutates valid plans at the JSON level and
loading either gives a plan that validates or fails in canzona's own words; a plan that loads
never crashes the runtime's preparation and never changes what a step computes.

**What counts as canzona's own error.** Every input error the project raises derives from
:class:`canzona.planner.errors.CanzonaError` (a ``ValueError`` carrying one readable line):
``PlanFileError`` for plan files, ``ModelError`` / ``SizeError`` / ``OptionError`` for models,
sizes and options, and the runtime's :class:`canzona.runtime.errors.PlanMismatchError` for a plan
that does not fit the model, the process group or the settings. Here:

* loading (``canzona.planner.plan.load.parse_plan``: JSON, version, schema, structure, formulas)
  must return a plan or raise ``PlanFileError`` with one line; any other exception — ``KeyError``,
  ``IndexError``, ``TypeError``, ``ZeroDivisionError``, ``AttributeError``, ``OverflowError``,
  ``RecursionError``, a pydantic ``ValidationError`` leaking unwrapped, or even a plain
  ``ValueError`` — is a defect;
* a plan that loads is checked again (``check_plan``) and survives a JSON round trip;
* what the runtime does before its first collective, without processes: for every DP index and
  TP rank, ``build_schedule`` + ``check_work_order`` (the work order covers every element once)
  and ``build_tp_groups`` (split sizes against the layouts) either succeed or raise
  ``PlanMismatchError``; with the plan of a live model at dp = 1, ``CanzonaOptimizer(model, plan)``
  either refuses with ``PlanMismatchError`` or takes steps bit-identical to the unmutated plan's
  (no silent wrong update).

Mutations: integers in cuts, owners, hosts, ids, starts, ends, shapes and TP segments shifted,
set to 0 / -1 / huge, or swapped with a neighbour; tasks, buckets and list entries dropped,
duplicated or swapped; fields removed, renamed or given the wrong type; the schema version
changed; fingerprints and names altered; lists truncated. The plans: a tiny Qwen3 at dp 1–4 ×
tp 1–2 with several buckets, Shampoo with split Q/K/V, a tiny MoE with ep 2, a schema-1 file,
one committed file from ``plans/``, and the plan of ``TinyGPT`` (``tests/runtime/dp_helpers``).

The plain tests at the end are the regressions of the defects this fuzzing found.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import _as_version_1
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canzona.planner.errors import CanzonaError, PlanFileError
from canzona.planner.layout import ParallelSizes
from canzona.planner.models import ModelConfig
from canzona.planner.options import DPOptions
from canzona.planner.pipeline import plan as make_plan
from canzona.planner.plan import Plan
from canzona.planner.plan.checks import check_plan
from canzona.planner.plan.load import parse_plan
from canzona.planner.settings import OptimizerSettings

torch = pytest.importorskip("torch")

PLANS = Path(__file__).resolve().parents[3] / "plans"
SOURCE = "<fuzzed>"
FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def tiny(arch: str = "qwen3", **kw) -> ModelConfig:
    base = dict(name="tiny", arch=arch, hidden=64, ffn=128, layers=2, q_heads=4, kv_heads=2,
                head_dim=16, vocab=256, tied_embeddings=False, qk_norm=arch != "llama")
    if arch == "qwen3_moe":
        base.update(ffn=0, num_experts=4, experts_per_token=2, moe_ffn=32)
    return ModelConfig(**{**base, **kw})


def as_version_1(data: dict) -> dict:
    """The same plan as schema version 1 wrote it (no comm section, no bucket methods)."""
    return _as_version_1(json.dumps(data))


def _bases() -> dict[str, dict]:
    out = {}
    small = DPOptions(bucket_size=20000)  # 3–4 buckets per plan
    for dp in (1, 2, 3, 4):
        for tp in (1, 2):
            p = make_plan(tiny(), ParallelSizes(dp=dp, tp=tp), dp_options=small)
            out[f"tiny-dp{dp}-tp{tp}"] = json.loads(p.to_json())
    p = make_plan(tiny(), ParallelSizes(dp=2, tp=2),
                  OptimizerSettings(name="shampoo", split_qkv=True), dp_options=small)
    out["shampoo-split-dp2-tp2"] = json.loads(p.to_json())
    # schema version 7: the QKV per head, each head whole on its TP rank
    for tp in (1, 2):
        p = make_plan(tiny(), ParallelSizes(dp=2, tp=tp), OptimizerSettings(qkv_split="heads"),
                      dp_options=small)
        out[f"heads-dp2-tp{tp}"] = json.loads(p.to_json())
    p = make_plan(tiny("qwen3_moe"), ParallelSizes(dp=2, tp=2, ep=2), dp_options=small)
    out["moe-dp2-tp2-ep2"] = json.loads(p.to_json())
    p = make_plan(tiny("qwen3_moe"), ParallelSizes(dp=2, tp=2, ep=2, etp=1), dp_options=small)
    out["moe-dp2-tp2-ep2-etp1"] = json.loads(p.to_json())
    out["v1-tiny-dp2-tp2"] = as_version_1(out["tiny-dp2-tp2"])
    # schema version 3: matrices shared by their TP group (with and without the polynomial
    # split), beside hosted ones
    from canzona.planner import TPOptions

    for share in ("all", "all-split"):
        p = make_plan(tiny(), ParallelSizes(dp=2, tp=2), dp_options=small,
                      tp_options=TPOptions(share=share))
        out[f"shared-{share}-dp2-tp2"] = json.loads(p.to_json())
    # schema version 4: matrices split over two DP indices at tp 1 (Muon pairs, with the
    # polynomial split; Shampoo block rows hosted apart)
    p = make_plan(tiny(), ParallelSizes(dp=4, tp=1), dp_options=small,
                  tp_options=TPOptions(share="all-split"))
    out["pairs-all-split-dp4"] = json.loads(p.to_json())
    p = make_plan(tiny(), ParallelSizes(dp=4, tp=1),
                  OptimizerSettings(name="shampoo", max_preconditioner_dim=32), dp_options=small,
                  tp_options=TPOptions(share="all"))
    out["shampoo-blocks-dp4"] = json.loads(p.to_json())
    return out


BASES = _bases()
FILE_BASE = json.loads((PLANS / "qwen3-1.7b-dp32-tp4-muon.plan.json").read_text())


# --- where to mutate -----------------------------------------------------------------------------

#: Path categories (regular expressions over "a.b[3].c") the strategies aim at, beside "anything".
TARGETS = {
    "cuts": r"\.cuts\[\d+\]$",
    "owners": r"^tasks\[\d+\]\.owner$",
    "hosts": r"\.host$",
    "ids": r"(\.id|\.index|\.dp_index|\.layout)$",
    "shared": r"\.shared(\[\d+\](\.\w+)?)?$|\.shared_load$|^tp\.share$",
    "bounds": r"\.(start|end|numel_unpadded)$",
    "shapes": r"(shape|_shape)\[\d+\]$",
    "segments": r"\.segments\[\d+\]\[\d+\]$|^tp\.layouts\[\d+\]\.dim$",
    "sizes": r"^(inputs|rank_layout)\.(dp|tp|ep|etp)$|\.dp_size$|\.ep_rank$",
    "schema": r"^schema_version$",
    "fingerprint": r"^fingerprint$|\.name$|\.param$|\.key$|\.part$",
    "tasks": r"^tasks(\[\d+\])?$",
    "metrics": r"^metrics\.|^tp\.metrics\.|\.rank_load|\.gather_|\.scatter_",
    "settings": r"^inputs\.(optimizer|solver)\.|^inputs\.(cost_model|grad_dtype|comm_dtype)$"
                r"|\.method$|\.dtype$|\.grad_dtype$|\.expert$",
}


def _paths(x, path: tuple = ()) -> list[tuple]:
    """Every node's path (containers included, the root excluded)."""
    out = [path] if path else []
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*path, i))
    return out


def _spell(path: tuple) -> str:
    s = ""
    for k in path:
        s += f"[{k}]" if isinstance(k, int) else (f".{k}" if s else k)
    return s


def _index(data: dict) -> dict[str, list[tuple]]:
    every = _paths(data)
    out = {"anything": every}
    for name, rx in TARGETS.items():
        pattern = re.compile(rx)
        out[name] = [p for p in every if pattern.search(_spell(p))] or every
    return out


INDEX = {k: _index(v) for k, v in BASES.items()}
FILE_INDEX = _index(FILE_BASE)

ALL_KINDS = ["shift", "special", "wrong_type", "delete", "rename", "swap", "drop", "duplicate",
             "truncate", "tweak_string"]
#: Numbers are mostly shifted or swapped (edits that keep a plan plausible), lists cut or doubled.
KINDS = {"cuts": ["shift", "shift", "swap", "special"],
         "owners": ["shift", "special", "wrong_type"],
         "hosts": ["shift", "special", "wrong_type", "delete"],
         "bounds": ["shift", "shift", "swap", "special"],
         "shapes": ["swap", "swap", "shift", "special", "duplicate", "drop"],
         "segments": ["swap", "swap", "shift", "special"],
         "tasks": ["swap", "drop", "duplicate", "truncate", "delete"]}
HUGE = [0, -1, 1, 2**31, 2**63, -(2**63), 10**30]
WRONG_TYPES = [None, "7", 1.5, True, [], {}, [1, 2], "", "sha256:" + "0" * 64]


@st.composite
def mutation(draw, index: dict[str, list[tuple]]):
    """One edit: (kind, path, argument), applied by :func:`apply`."""
    target = draw(st.sampled_from(sorted(index)))
    paths = index[target]
    path = paths[draw(st.integers(0, len(paths) - 1))]
    kind = draw(st.sampled_from(KINDS.get(target, ALL_KINDS)))
    arg = {"shift": draw(st.sampled_from([-1, 1, -2, 2, -64, 64, 128, -4096])),
           "special": draw(st.sampled_from(HUGE)),
           "wrong_type": draw(st.sampled_from(WRONG_TYPES)),
           "truncate": draw(st.integers(0, 3))}.get(kind, draw(st.integers(0, 10**6)))
    return kind, path, arg


def apply(data: dict, edit: tuple) -> dict:
    """``data`` (a deep copy) with one edit; an edit that does not fit its node changes nothing."""
    kind, path, arg = edit
    data = copy.deepcopy(data)
    parent = data
    try:
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        value = parent[key]
    except (KeyError, IndexError, TypeError):
        return data  # an earlier edit moved this node
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "shift" and is_int:
        parent[key] = value + arg
    elif kind == "special":
        parent[key] = arg
    elif kind == "wrong_type":
        parent[key] = arg
    elif kind == "delete" and isinstance(parent, dict):
        del parent[key]
    elif kind == "delete" and isinstance(parent, list):
        parent.pop(key)
    elif kind == "rename" and isinstance(parent, dict):
        parent[f"{key}_renamed"] = parent.pop(key)
    elif kind == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = (key + 1 + arg % (len(parent) - 1)) % len(parent)
        parent[key], parent[other] = parent[other], parent[key]
    elif kind == "swap" and isinstance(value, list) and len(value) > 1:
        value.reverse()
    elif kind == "drop" and isinstance(value, list) and value:
        value.pop(arg % len(value))
    elif kind == "duplicate" and isinstance(value, list) and value:
        i = arg % len(value)
        value.insert(i, copy.deepcopy(value[i]))
    elif kind == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(value))
    elif kind == "truncate" and isinstance(value, list):
        parent[key] = value[:min(arg, max(len(value) - 1, 0))]
    elif kind == "tweak_string" and isinstance(value, str):
        parent[key] = value[:-1] + ("0" if value[-1:] != "0" else "1") if value else "x"
    elif is_int:
        parent[key] = value + 1
    return data


# --- the properties ------------------------------------------------------------------------------


def load_or_refuse(text: str) -> Plan | None:
    """The plan ``text`` holds if it validates, None if loading refused it in one line."""
    try:
        plan = parse_plan(text, SOURCE)
    except PlanFileError as exc:  # anything else propagates: the test fails on it
        msg = str(exc)
        assert msg and "\n" not in msg, msg
        assert "Traceback" not in msg
        return None
    check_plan(plan, SOURCE)  # what loaded is consistent by the validator's own standard
    assert parse_plan(plan.to_json(), SOURCE) == plan
    return plan


def runtime_preparation(plan: Plan) -> None:
    """What the runtime derives from a plan before its first collective, for every rank: it
    succeeds or raises PlanMismatchError (never a crash that would leave peers waiting)."""
    from canzona.runtime.checks import check_work_order, plan_params
    from canzona.runtime.errors import PlanMismatchError
    from canzona.runtime.schedule import build_schedule
    from canzona.runtime.tp_tasks import build_shared_tasks, build_tp_groups

    names = [name for name, _, _ in plan_params(plan)]
    try:
        for d in range(plan.inputs.dp):
            for t in range(plan.inputs.tp):  # each TP rank its own heads (qkv_split="heads")
                check_work_order(build_schedule(plan, names, d, tp_rank=t), names)
            sched = build_schedule(plan, names, d)
            for t in range(plan.inputs.tp):
                build_tp_groups(plan, names, sched.param_bucket, sched.param_range,
                                [b.cuts[d] for b in sched.buckets], d, t)
            build_shared_tasks(plan, names, sched.param_bucket, sched.param_range,
                               [b.cuts[d] for b in sched.buckets], d)
    except PlanMismatchError as exc:
        assert "\n" not in str(exc)


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def live_params(plan: Plan) -> list[tuple[str, "torch.Tensor"]]:
    """Stand-ins (meta tensors) for the parameters of the model ``plan`` was made for, as one rank
    holds them: logical shapes at tp = 1; under TP, a split matrix's local shard, a replicated
    matrix whole, anything else as many elements as its slot."""
    from canzona.planner.heads import is_head
    from canzona.runtime.checks import plan_params

    slots = {s.name: s.end - s.start for buf in plan.buffers for b in buf.buckets for s in b.slots}
    layouts = {}
    if plan.tp is not None:
        layouts = {plan.tasks[gt.id].param: tuple(plan.tp.layouts[gt.layout].local_shape)
                   for ix in plan.tp.indices for g in ix.groups for gt in g.tasks}
    hosted = {t.param for t in plan.tasks if t.host is not None}
    whole = {t.param for t in plan.tasks if t.optimizer == "matrix" and t.param not in hosted}
    heads = {t.param for t in plan.tasks if t.optimizer == "matrix" and is_head(t.part)}
    out = []
    for name, shape, dtype in plan_params(plan):
        if name in heads and plan.inputs.tp > 1:  # a row shard of the fused QKV
            shape = (shape[0] // plan.inputs.tp, shape[1])
        elif plan.inputs.tp > 1:
            shape = layouts.get(name) or (shape if name in whole else (slots[name],))
        out.append((name, torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device="meta")))
    return out


def model_refuses(plan: Plan, base: Plan) -> bool:
    """Whether the runtime refuses ``plan`` on the model ``base`` was made for, by the checks it
    makes before any collective: the fingerprint (one string), the tasks against it (names, order,
    logical shapes, dtypes; ``fingerprint_problem`` once the string matches) and, under TP, every
    local shard (``local_layout_problem``)."""
    from canzona.runtime.checks import local_layout_problem, plan_params

    if plan.fingerprint != base.fingerprint or plan_params(plan) != plan_params(base):
        return True
    if plan.inputs.tp > 1:
        return local_layout_problem(plan, live_params(base)) is not None
    return False


def views(plan: Plan) -> dict:
    """How the runtime reads each matrix task's elements: its (rows, cols) view of the slice, or
    under TP the layout its shards are gathered by (split dim, shapes, segments)."""
    out = {}
    for t in plan.tasks:
        if t.optimizer == "matrix":
            out[t.param, t.part] = ("whole", tuple(t.shape))
    if plan.tp is not None:
        for ix in plan.tp.indices:
            for g in ix.groups:
                for gt in g.tasks:
                    t, L = plan.tasks[gt.id], plan.tp.layouts[gt.layout]
                    out[t.param, t.part] = ("tp", L.dim, tuple(L.local_shape),
                                            tuple(L.full_shape), tuple(map(tuple, L.segments)))
    return out


def check_mutated(base: dict, edits: list[tuple]) -> None:
    data = base
    for e in edits:
        data = apply(data, e)
    plan = load_or_refuse(json.dumps(data))
    if plan is None or plan.inputs.ep != 1:
        return
    runtime_preparation(plan)
    original = Plan.model_validate(base) if base.get("schema_version") == 2 else None
    if original is not None and not model_refuses(plan, original):
        # the runtime would run it on the original model: it must read every matrix as the
        # original plan does (a different view is a silently wrong update)
        assert views(plan) == views(original), [e[:2] for e in edits]


@FUZZ
@given(data=st.data())
def test_mutated_tiny_plans_load_or_fail_in_one_line(data):
    key = data.draw(st.sampled_from(sorted(BASES)), label="base")
    edits = data.draw(st.lists(mutation(INDEX[key]), min_size=1, max_size=3), label="edits")
    check_mutated(BASES[key], edits)


@settings(FUZZ, max_examples=60)
@given(edits=st.lists(mutation(FILE_INDEX), min_size=1, max_size=2))
def test_mutated_committed_plan_loads_or_fails_in_one_line(edits):
    check_mutated(FILE_BASE, edits)


def test_unmutated_bases_load_and_prepare():
    for key, data in BASES.items():
        plan = load_or_refuse(json.dumps(data))
        assert plan is not None, key
        if plan.inputs.ep == 1:
            runtime_preparation(plan)
    assert load_or_refuse(json.dumps(FILE_BASE)) is not None


def test_texts_that_are_not_plans():
    for text in ("", "{", "[]", "null", "1e999", '"plan"', "[" * 100_000 + "]" * 100_000,
                 json.dumps({"schema_version": 2}), json.dumps({"schema_version": 2**70}),
                 json.dumps({"schema_version": -(2**70)}), json.dumps({"schema_version": 2.0}),
                 "\x00\xff", json.dumps({**BASES["tiny-dp1-tp1"], "tasks": {"0": 1}})):
        assert load_or_refuse(text) is None, text[:40]


# --- the runtime at world size 1: refuse, or step exactly as the unmutated plan does ------------

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))
from dp_helpers import TinyGPT, batch, loss_fn  # noqa: E402

import canzona  # noqa: E402
from canzona.runtime.errors import PlanMismatchError  # noqa: E402


def _steps(plan: Plan) -> dict:
    """Parameters of a fresh TinyGPT after two steps under ``plan`` (world size 1)."""
    torch.manual_seed(0)
    model = TinyGPT(spare=False)
    opt = canzona.CanzonaOptimizer(model, plan, ns_dtype=torch.float32, adamw_lr=3e-3)
    try:
        for step in range(2):
            x, y = batch(step, 0, 1)
            loss_fn(model, x[:4], y[:4]).backward()
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def module_plans():
    """TinyGPT's plans at dp 1 (Muon and Shampoo) and their steps."""
    torch.set_num_threads(1)
    out = {}
    for opt in ("muon", "shampoo"):
        plan = canzona.plan_model(TinyGPT(spare=False), dp=1, bucket_size=3000, optimizer=opt)
        data = json.loads(plan.to_json())
        out[opt] = (data, _index(data), _steps(plan))
    return out


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_mutated_module_plan_steps_identically_or_is_refused(module_plans, data):
    opt = data.draw(st.sampled_from(sorted(module_plans)), label="optimizer")
    base, index, reference = module_plans[opt]
    edits = data.draw(st.lists(mutation(index), min_size=1, max_size=2), label="edits")
    mutated = base
    for e in edits:
        mutated = apply(mutated, e)
    plan = load_or_refuse(json.dumps(mutated))
    if plan is None:
        return
    try:
        got = _steps(plan)
    except PlanMismatchError as exc:
        assert "\n" not in str(exc)
        return
    for name, ref in reference.items():
        assert torch.equal(got[name], ref), (name, [e[:2] for e in edits])


# --- regressions: defects the fuzzing found -------------------------------------------------------


def _tiny_module_plan(opt: str = "muon") -> tuple[dict, int]:
    plan = canzona.plan_model(TinyGPT(spare=False), dp=1, bucket_size=3000, optimizer=opt)
    data = json.loads(plan.to_json())
    k = next(i for i, t in enumerate(data["tasks"])
             if t["optimizer"] == "matrix" and t["shape"][0] != t["shape"][1])
    return data, k


def test_transposed_matrix_task_is_refused_before_any_update():
    """Defect: a matrix task's shape swapped (96×32 → 32×96) kept every cost (Muon's and
    Shampoo's are symmetric), so the plan validated, the fingerprint (one string) still matched,
    and the runtime viewed the gradient as 32×96: a silently wrong update."""
    for opt in ("muon", "shampoo"):
        data, k = _tiny_module_plan(opt)
        data["tasks"][k]["shape"] = data["tasks"][k]["shape"][::-1]
        plan = parse_plan(json.dumps(data))  # still self-consistent for the planner
        with pytest.raises(PlanMismatchError,
                           match=r"contradicts its own fingerprint.*"
                                 r"give shape \[32, 96\].*\[96, 32\].*regenerate"):
            canzona.CanzonaOptimizer(TinyGPT(spare=False), plan)


def test_edited_task_order_dtype_or_part_is_refused():
    """The tasks and buffers must say what the fingerprint says: order, dtype, expert parts."""
    data, _ = _tiny_module_plan()
    swapped = copy.deepcopy(data)
    i, j = (next(i for i, t in enumerate(swapped["tasks"]) if t["param"] == n)
            for n in ("blocks.0.proj.weight", "blocks.1.proj.weight"))
    swapped["tasks"][i]["param"], swapped["tasks"][j]["param"] = (swapped["tasks"][j]["param"],
                                                                  swapped["tasks"][i]["param"])
    bf16 = copy.deepcopy(data)
    for buf in bf16["buffers"]:
        buf["dtype"], buf["key"] = "bf16", "dense bf16/fp32"
    part = copy.deepcopy(data)
    part["tasks"][next(i for i, t in enumerate(part["tasks"])
                       if t["optimizer"] == "matrix")]["part"] = "expert0"
    for edited, needle in ((swapped, "parameter #5 is 'blocks.1.proj.weight'"),
                           (bf16, "is bf16 in the plan's buffers but fp32"),
                           (part, "give shape [1, 96, 32]")):
        plan = parse_plan(json.dumps(edited))
        with pytest.raises(PlanMismatchError) as e:
            canzona.CanzonaOptimizer(TinyGPT(spare=False), plan)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_replicated_matrix_shape_is_checked_under_tp():
    """Under TP the runtime checks local shards (``local_layout_problem``), not the fingerprint:
    a matrix that TP replicates (here the MoE router, routed to the matrix optimizer) must have
    its tasks' shape on the rank too, or its slice is viewed wrongly."""
    from canzona.planner.inventory import build_inventory
    from canzona.runtime.checks import local_layout_problem, plan_params

    spec = build_inventory(tiny("qwen3_moe"), matrix_globs=["*router.weight"])
    plan = make_plan(spec, ParallelSizes(dp=1, tp=2))
    router = next(t for t in plan.tasks if t.param.endswith("layers.0.mlp.router.weight"))
    assert router.optimizer == "matrix" and router.host is None and router.shape == (4, 64)
    slots = {s.name: s.end - s.start for buf in plan.buffers for b in buf.buckets
             for s in b.slots}
    layouts = {plan.tasks[gt.id].param: plan.tp.layouts[gt.layout].local_shape
               for ix in plan.tp.indices for g in ix.groups for gt in g.tasks}
    whole = {t.param for t in plan.tasks if t.optimizer == "matrix" and t.host is None}
    pairs = []
    for name, shape, dtype in plan_params(plan):
        local = layouts.get(name) or (shape if name in whole else (slots[name],))
        pairs.append((name, torch.empty(local, dtype=torch.bfloat16)))
    assert local_layout_problem(plan, pairs) is None
    k = next(i for i, (n, _) in enumerate(pairs) if n == router.param)
    pairs[k] = (router.param, torch.empty(64, 4, dtype=torch.bfloat16))  # the transpose
    problem = local_layout_problem(plan, pairs)
    assert problem is not None and f"matrix '{router.param}' should be [4, 64]" in problem
    data = json.loads(plan.to_json())  # and the other way round: the plan's task transposed
    data["tasks"][router.id]["shape"] = [64, 4]
    pairs[k] = (router.param, torch.empty(4, 64, dtype=torch.bfloat16))
    assert "should be [64, 4]" in local_layout_problem(parse_plan(json.dumps(data)), pairs)


def _tp_plan_json() -> dict:
    return json.loads(make_plan(tiny(), ParallelSizes(dp=3, tp=2),
                                dp_options=DPOptions(bucket_size=20000)).to_json())


def test_tp_layout_split_dim_edited_is_refused():
    """Defect: a layout's split dim changed (1 → 0) on a square matrix kept every segment in
    range and the shards equal, so the plan loaded, and the runtime would have gathered the
    shards along the wrong dimension. Now a shard must keep the other dimensions whole."""
    data = _tp_plan_json()
    li = next(i for i, L in enumerate(data["tp"]["layouts"])
              if L["dim"] == 1 and L["full_shape"][0] == L["full_shape"][1])
    data["tp"]["layouts"][li]["dim"] = 0
    with pytest.raises(PlanFileError, match=rf"field 'tp.layouts\[{li}\].local_shape'.*keeps "
                                            r"every other dimension whole.*regenerate"):
        parse_plan(json.dumps(data))
    data = _tp_plan_json()
    L = data["tp"]["layouts"][li]
    L["local_shape"] = L["local_shape"][::-1]
    with pytest.raises(PlanFileError, match=rf"tp.layouts\[{li}\]"):
        parse_plan(json.dumps(data))


def test_equal_method_on_unequal_slices_is_refused():
    """Defect: a bucket whose method was edited to 'equal' while its cuts are uneven loaded,
    and every rank then failed building its collectives with a plain ValueError that blamed a
    ``collective=`` argument nobody passed. Now loading names the bucket's method."""
    data = _tp_plan_json()
    for i, buf in enumerate(data["buffers"]):
        for j, b in enumerate(buf["buckets"]):
            sizes = {y - x for x, y in zip(b["cuts"], b["cuts"][1:])}
            if len(sizes) > 1:
                b["method"] = "equal"
                with pytest.raises(PlanFileError, match=rf"field 'buffers\[{i}\].buckets\[{j}\]"
                                                        r"\.method'.*equal slices only"):
                    parse_plan(json.dumps(data))
                return
    pytest.fail("no bucket with unequal slices")


def test_split_part_pointed_at_another_parts_layout_is_refused():
    """Defect: with split Q/K/V, task k's group entry edited to v's layout loaded, and the
    runtime would have updated V twice and K never. Now the parts of a parameter must read
    every row of every TP rank's shard exactly once."""
    data = json.loads(make_plan(tiny(), ParallelSizes(dp=2, tp=2),
                                OptimizerSettings(name="muon", split_qkv=True),
                                dp_options=DPOptions(bucket_size=20000)).to_json())
    parts = {(t["param"], t["part"]): t["id"] for t in data["tasks"]
             if t["part"] in ("q", "k", "v")}
    param = next(p for p, part in parts if part == "k")
    k_id, v_id = parts[(param, "k")], parts[(param, "v")]
    entries = [gt for ix in data["tp"]["indices"] for g in ix["groups"] for gt in g["tasks"]]
    layout_of = {gt["id"]: gt["layout"] for gt in entries}
    for gt in entries:
        if gt["id"] == k_id:
            gt["layout"] = layout_of[v_id]
    with pytest.raises(PlanFileError, match=r"layout"):
        parse_plan(json.dumps(data))
