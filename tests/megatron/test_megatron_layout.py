"""canzona's emulated Megatron layout equals megatron-core's own.

For Llama-style (RMSNorm, GQA, gated SwiGLU, untied embeddings) and Qwen3-style (QK-norm,
head_dim ≠ hidden/heads, tied and untied) GPTModels built by megatron-core 0.16 with the local layer
spec, at dp 1–4 and tp 1–2, with bucket sizes that give one bucket per parameter, several buckets,
Megatron's default and no grad-reduce overlap (one bucket), the tests compare, against
``canzona.planner.layout.build_layout`` (and the plan canzona writes with reordering off):

* every parameter's offset [start, end), its bucket and its TP shard's shape
  (``DistributedDataParallel.buffers[i].param_index_map``);
* every buffer's dtypes and size, every bucket's bounds, unpadded size, end padding and parameters;
* each DP rank's range: Megatron's reduce-scatter shard of every bucket (``shard_buffer``, what
  ``start_grad_sync`` hands ``reduce_scatter_tensor``) and the ``DistributedOptimizer`` range map
  (``_build_model_gbuf_range``: per parameter its world, in-bucket, local and in-parameter ranges);
* the vocabulary padding: Megatron's training script's rule against ``padded_vocab``.

Qwen3-MoE models (ep 1, 2, 4; the first and the last EP rank) add the expert buffers: with ep > 1
one per EP rank, sharded over the expert-data-parallel group; at ep = 1 Megatron keeps the experts
in the dense buffer, which canzona did not (fixed in ``build_layout`` with these tests). A model
without ``Float16Module`` (fp32 local-spec norms) checks canzona's per-dtype buffers.

Everything runs in this one process: the ``fake`` process group lets rank 0 of a dp·tp world build
the model and its DDP buffers without peers. Megatron's side is recorded once (a module fixture),
then the world is torn down before any comparison runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import types

import pytest

from canzona.planner.inventory import ModelSpec, build_inventory
from canzona.planner.layout import ParallelSizes, PhysicalLayout, build_layout, padded_vocab
from canzona.planner.models import ModelConfig
from canzona.planner.options import DPOptions
from canzona.planner.pipeline import plan
from canzona.planner.planning import equal_cuts, make_problem
from megatron_stubs import gpt_model, megatron_padded_vocab, megatron_world

#: megatron-core on CPU warns about the missing Transformer Engine and Apex, and deprecations
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")]

#: The models: tiny, with sizes that are not round, so padding shows everywhere.
MODELS = {
    # Llama: RMSNorm, GQA (8 q heads, 2 KV groups), gated SwiGLU, untied, head_dim = hidden/heads
    "llama": ModelConfig(name="llama-tiny", arch="llama", hidden=64, ffn=176, layers=3, q_heads=8,
                         kv_heads=2, head_dim=8, vocab=1000, tied_embeddings=False,
                         qk_norm=False),
    # Qwen3: QK-norm, head_dim 32 ≠ hidden/heads 16, tied embeddings
    "qwen3-tied": ModelConfig(name="qwen3-tied-tiny", arch="qwen3", hidden=64, ffn=96, layers=2,
                              q_heads=4, kv_heads=2, head_dim=32, vocab=1000,
                              tied_embeddings=True, qk_norm=True),
    # Qwen3: QK-norm, head_dim 24 ≠ hidden/heads 12, untied, a vocabulary far from a multiple of 128
    "qwen3-untied": ModelConfig(name="qwen3-untied-tiny", arch="qwen3", hidden=48, ffn=120,
                                layers=3, q_heads=4, kv_heads=2, head_dim=24, vocab=777,
                                tied_embeddings=False, qk_norm=True),
}
#: Qwen3-MoE: every layer MoE (router + per-expert gated SwiGLU), QK-norm, untied.
MOE = ModelConfig(name="qwen3-moe-tiny", arch="qwen3_moe", hidden=64, ffn=0, layers=2, q_heads=4,
                  kv_heads=2, head_dim=32, vocab=1000, tied_embeddings=False, qk_norm=True,
                  num_experts=8, experts_per_token=2, moe_ffn=40)
DPS = (1, 2, 3, 4)
TPS = (1, 2)
#: name → (bucket_size, overlap_grad_reduce). "per-param": every parameter closes its bucket;
#: "small"/"medium": several buckets, boundaries inside layers; "default": Megatron's
#: max(40M, 1M·dp) (one bucket at these sizes); "one": overlap off, Megatron's single bucket.
BUCKETS = {"per-param": (1, True), "small": (2_500, True), "medium": (30_000, True),
           "default": (None, True), "one": (None, False)}

CASES = list(itertools.product(MODELS, DPS, TPS, BUCKETS))
#: MoE: (dp, tp, ep), each recorded on the first and the last EP rank; bucket settings.
MOE_SIZES = [(1, 1, 1), (2, 1, 1), (4, 2, 1), (3, 2, 1), (2, 1, 2), (4, 1, 2), (2, 2, 2),
             (4, 2, 2), (4, 1, 4), (4, 2, 4)]
MOE_BUCKETS = ("per-param", "small", "one")
MOE_CASES = [(dp, tp, ep, k, bucket) for (dp, tp, ep) in MOE_SIZES
             for k in sorted({0, ep - 1}) for bucket in MOE_BUCKETS]


def _case_id(case: tuple) -> str:
    model, dp, tp, bucket = case
    return f"{model}-dp{dp}-tp{tp}-{bucket}"


def _moe_id(case: tuple) -> str:
    dp, tp, ep, k, bucket = case
    return f"moe-dp{dp}-tp{tp}-ep{ep}-eprank{k}-{bucket}"


_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


class _DPGroup:
    """A stand-in for a DP group of ``size`` seen from ``rank``: Megatron's range map asks the
    buffer's group only for these two, so one process can read every DP rank's ranges."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _record_buffer(buf, names: dict) -> dict:
    """Megatron's layout of one ``_ParamAndGradBuffer`` as plain data (its sharding group: the
    DP group, or the expert-data-parallel group of an expert buffer)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    dp = buf.data_parallel_world_size
    base = buf.grad_data.data_ptr()
    item = buf.grad_data.element_size()
    buckets = []
    for b in buf.buckets:
        start = (b.grad_data.data_ptr() - base) // item
        assert start == b.offset
        shards = [((s.data_ptr() - base) // item, (s.data_ptr() - base) // item + s.numel())
                  for s in shard_buffer(b.grad_data, dp)]
        buckets.append({"start": b.offset, "end": b.offset + b.grad_data.numel(),
                        "numel_unpadded": b.numel_unpadded,
                        "params": sorted(names[p] for p in b.params_list),
                        "shards": shards})
    ranges = []  # [rank][bucket] → {name: {range kind: (start, end)}}
    for r in range(dp):
        view = types.SimpleNamespace(data_parallel_group=_DPGroup(r, dp), buckets=buf.buckets,
                                     param_index_map=buf.param_index_map)
        per_bucket = []
        for bi in range(len(buf.buckets)):
            pmap = DistributedOptimizer._build_model_gbuf_range(view, bi)["param_map"]
            per_bucket.append({names[p]: {k: (v.start, v.end) for k, v in rs.items()}
                               for p, rs in pmap.items()})
        ranges.append(per_bucket)
    return {
        "dtype": _DTYPE_NAMES[str(buf.param_dtype)],
        "grad_dtype": _DTYPE_NAMES[str(buf.grad_dtype)],
        "dp_size": buf.data_parallel_world_size, "numel": buf.numel,
        "numel_unpadded": buf.numel_unpadded,
        "params": {names[p]: v for p, v in buf.param_index_map.items()},
        "shapes": {names[p]: tuple(p.shape) for p in buf.param_index_map},
        "buckets": buckets, "ranges": ranges,
    }


_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")


def _record_megatron(dp: int, tp: int, cases: list, *, ep: int = 1, rank: int = 0,
                     float16_module: bool = True) -> dict:
    """Inside one world (played by ``rank``): for each (model config, bucket setting) build the
    GPTModel and its DDP, and record the dense buffers, then this EP rank's expert buffers.

    Megatron numbers the experts of each EP rank from 0 (``local_experts.{i}``); canzona names
    them by their global index, ``ep_rank·E/ep + i``: the record uses canzona's names."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    out = {}
    with megatron_world(dp, tp, ep=ep, rank=rank):
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        for cfg, bucket in cases:
            size, overlap = BUCKETS[bucket]
            module, gpt = gpt_model(cfg, tp, ep, float16_module=float16_module,
                                    perform_initialization=False)
            first = ep_rank * (cfg.num_experts // ep)
            names = {p: _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{first + int(m[2])}{m[3]}", n)
                     for n, p in gpt.named_parameters()}
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=overlap, bucket_size=size,
                grad_reduce_in_fp32=True)
            ddp = DistributedDataParallel(gpt.config, ddp_config, module)
            out[cfg.name, bucket] = {
                "buffers": [_record_buffer(b, names) for b in ddp.buffers],
                "expert_buffers": [_record_buffer(b, names) for b in ddp.expert_parallel_buffers],
                "ep_rank": ep_rank,
                "bucket_size": ddp.bucket_size,  # Megatron's default filled in; None: one bucket
                "embedding_rows": gpt.embedding.word_embeddings.weight.shape[0],
                "vocab_size": gpt.vocab_size,
            }
    return out


@pytest.fixture(scope="module")
def megatron_layouts() -> dict:
    """Megatron's layout for every case, recorded in this process (fake process group)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    layouts = {}
    for dp, tp in itertools.product(DPS, TPS):
        todo = [(MODELS[m], b) for m, d, t, b in CASES if (d, t) == (dp, tp)]
        recs = _record_megatron(dp, tp, todo)
        for m, d, t, b in CASES:
            if (d, t) == (dp, tp):
                layouts[m, dp, tp, b] = recs[MODELS[m].name, b]
    for dp, tp, ep in MOE_SIZES:
        for k in sorted({0, ep - 1}):
            # the last rank of the world is on the last EP rank (Megatron's tp-cp-ep-dp order)
            rank = 0 if k == 0 else dp * tp - 1
            recs = _record_megatron(dp, tp, [(MOE, b) for b in MOE_BUCKETS], ep=ep, rank=rank)
            for b in MOE_BUCKETS:
                assert recs[MOE.name, b]["ep_rank"] == k
                layouts[dp, tp, ep, k, b] = recs[MOE.name, b]
    return layouts


def _canzona_layout(case: tuple) -> PhysicalLayout:
    model, dp, tp, bucket = case
    size, overlap = BUCKETS[bucket]
    return build_layout(build_inventory(MODELS[model]), ParallelSizes(dp, tp), bucket_size=size,
                        overlap_grad_reduce=overlap)


def _moe_buffers(case: tuple) -> tuple[list, list]:
    """canzona's buffers on EP rank k of a MoE case: (dense, that EP rank's expert buffers)."""
    dp, tp, ep, k, bucket = case
    size, overlap = BUCKETS[bucket]
    lay = build_layout(build_inventory(MOE), ParallelSizes(dp, tp, ep), bucket_size=size,
                       overlap_grad_reduce=overlap)
    return ([b for b in lay.buffers if not b.expert],
            [b for b in lay.buffers if b.expert and b.ep_rank == k])


def _ranges(bucket, r: int, dp: int) -> dict:
    """DP rank r's ranges in ``bucket`` as Megatron's range map names them, from canzona's
    equal chunk: each parameter's overlap with the chunk in buffer coordinates, in bucket
    coordinates, in chunk coordinates and within the parameter."""
    lo, hi = bucket.chunk(r, dp)
    out = {}
    for s in bucket.slots:
        a, b = max(s.start, lo), min(s.end, hi)
        if b > a:
            out[s.name] = {"gbuf_world": (a, b),
                           "gbuf_world_in_bucket": (a - bucket.start, b - bucket.start),
                           "gbuf_local": (a - lo, b - lo), "param": (a - s.start, b - s.start)}
    return out


def _assert_params(ours: list, mega: list) -> None:
    """Every parameter's [start, end), bucket and TP-shard shape, buffer by buffer."""
    assert len(ours) == len(mega)
    for buf, mbuf in zip(ours, mega):
        assert {s.name: (s.start, s.end, b.index) for b in buf.buckets
                for s in b.slots} == mbuf["params"]
        assert {s.name: s.local_shape for b in buf.buckets for s in b.slots} == mbuf["shapes"]


def _assert_buckets(ours: list, mega: list) -> None:
    """Every buffer's dtypes, sharding group and size; every bucket's bounds, unpadded size,
    end padding and parameters."""
    assert len(ours) == len(mega)
    for buf, mbuf in zip(ours, mega):
        assert (buf.dtype, buf.grad_dtype, buf.dp_size) == (mbuf["dtype"], mbuf["grad_dtype"],
                                                            mbuf["dp_size"])
        assert buf.numel == mbuf["numel"]
        assert sum(b.numel_unpadded for b in buf.buckets) == mbuf["numel_unpadded"]
        got = [{"start": b.start, "end": b.end, "numel_unpadded": b.numel_unpadded,
                "padding": b.numel - b.numel_unpadded, "params": sorted(s.name for s in b.slots)}
               for b in buf.buckets]
        want = [{"start": b["start"], "end": b["end"], "numel_unpadded": b["numel_unpadded"],
                 "padding": b["end"] - b["start"] - b["numel_unpadded"], "params": b["params"]}
                for b in mbuf["buckets"]]
        assert got == want


def _assert_ranges(ours: list, mega: list) -> None:
    """Each rank's reduce-scatter shard of every bucket and its DistributedOptimizer ranges."""
    assert len(ours) == len(mega)
    for buf, mbuf in zip(ours, mega):
        n = buf.dp_size
        for b, mb in zip(buf.buckets, mbuf["buckets"], strict=True):
            assert [b.chunk(r, n) for r in range(n)] == mb["shards"]
            for r in range(n):
                assert _ranges(b, r, n) == mbuf["ranges"][r][b.index], (r, b.index)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_parameter_offset_bucket_and_shape(megatron_layouts, case):
    mega = megatron_layouts[case]
    assert not mega["expert_buffers"]
    _assert_params(list(_canzona_layout(case).buffers), mega["buffers"])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_bucket_bounds_and_padding(megatron_layouts, case):
    ours = _canzona_layout(case)
    _assert_buckets(list(ours.buffers), megatron_layouts[case]["buffers"])
    assert ours.bucket_size == megatron_layouts[case]["bucket_size"]
    model, _, _, bucket = case
    assert len(ours.buffers) == 1
    if bucket == "per-param":  # one bucket per parameter
        assert len(ours.buffers[0].buckets) == len(build_inventory(MODELS[model]).params)
    elif bucket == "small":
        assert len(ours.buffers[0].buckets) >= 4
    elif bucket in ("default", "one"):
        assert len(ours.buffers[0].buckets) == 1


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_dp_rank_range(megatron_layouts, case):
    """Megatron's reduce-scatter shards and DistributedOptimizer range map, rank by rank; and
    the planner's ZeRO-1 cuts (its zero1 baseline) are those shards."""
    model, dp, tp, bucket = case
    mega = megatron_layouts[case]["buffers"]
    _assert_ranges(list(_canzona_layout(case).buffers), mega)
    size, overlap = BUCKETS[bucket]
    problem = make_problem(build_inventory(MODELS[model]), ParallelSizes(dp, tp),
                           bucket_size=size, overlap_grad_reduce=overlap)
    for pb, mb in zip(problem.buckets, mega[0]["buckets"], strict=True):
        cuts = equal_cuts(pb)
        assert list(zip(cuts, cuts[1:])) == mb["shards"]


@pytest.mark.parametrize("case", [c for c in CASES if c[3] in ("small", "one")], ids=_case_id)
def test_plan_records_megatron_layout(megatron_layouts, case):
    """The plan file's buffers (reordering off) are Megatron's: bucket bounds, unpadded sizes
    and every slot in Megatron's order."""
    model, dp, tp, bucket = case
    size, overlap = BUCKETS[bucket]
    p = plan(MODELS[model], ParallelSizes(dp, tp), "muon", dp_only=True,
             dp_options=DPOptions(bucket_size=size, overlap_grad_reduce=overlap, reorder=False,
                                  solver="greedy"))
    buffers = json.loads(p.to_json())["buffers"]  # as the plan file records them
    mega = megatron_layouts[case]["buffers"]
    assert len(buffers) == len(mega)
    for buf, mbuf in zip(buffers, mega):
        assert (buf["dtype"], buf["grad_dtype"], buf["dp_size"]) == (
            mbuf["dtype"], mbuf["grad_dtype"], mbuf["dp_size"])
        for b, mb in zip(buf["buckets"], mbuf["buckets"], strict=True):
            assert (b["start"], b["end"], b["numel_unpadded"]) == (
                mb["start"], mb["end"], mb["numel_unpadded"])
            order = sorted(b["slots"], key=lambda s: s["start"])
            assert [s["name"] for s in b["slots"]] == [s["name"] for s in order]
            assert {s["name"]: (s["start"], s["end"], b["index"]) for s in b["slots"]} == {
                n: v for n, v in mbuf["params"].items() if v[2] == b["index"]}


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE: the dense buffer and each EP rank's expert buffer (ep > 1, sharded over the
# expert-data-parallel group); at ep = 1 the experts are in the dense buffer


@pytest.mark.parametrize("case", MOE_CASES, ids=_moe_id)
def test_moe_layout(megatron_layouts, case):
    dp, tp, ep, k, bucket = case
    mega = megatron_layouts[case]
    dense, experts = _moe_buffers(case)
    assert len(experts) == (1 if ep > 1 else 0) == len(mega["expert_buffers"])
    if experts:
        assert experts[0].dp_size == dp * tp // (ep * tp)
    ours, theirs = dense + experts, mega["buffers"] + mega["expert_buffers"]
    _assert_params(ours, theirs)
    _assert_buckets(ours, theirs)
    _assert_ranges(ours, theirs)


# ---------------------------------------------------------------------------------------------
# vocabulary padding


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 16])
def test_padded_vocab_is_megatrons_rule(tp):
    """canzona's ``padded_vocab`` is the rule Megatron's training script pads the tokenizer's
    vocabulary with before it builds the model (make_vocab_size_divisible_by 128 × tp)."""
    for vocab in [*range(1, 2 * 128 * tp + 2), 32000, 128256, 151643, 151669, 151936]:
        assert padded_vocab(vocab, tp) == megatron_padded_vocab(vocab, tp), (vocab, tp)


@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "one"], ids=_case_id)
def test_embedding_shard_is_the_padded_vocabulary(megatron_layouts, case):
    """The GPTModel built with Megatron's padded vocabulary holds Vpad/tp embedding rows per TP
    rank: canzona's shard of the unpadded vocabulary."""
    model, dp, tp, _ = case
    mega = megatron_layouts[case]
    assert mega["vocab_size"] == padded_vocab(MODELS[model].vocab, tp)
    spec = build_inventory(MODELS[model])
    ours = _canzona_layout(case)
    slot = next(s for s in ours.buffers[0].buckets[0].slots
                if s.name == "embedding.word_embeddings.weight")
    assert slot.local_shape == (mega["embedding_rows"], MODELS[model].hidden)
    assert spec["embedding.word_embeddings.weight"].shape[0] == MODELS[model].vocab


# ---------------------------------------------------------------------------------------------
# a GPTModel without Float16Module: the local spec's norms stay float32, Megatron makes a second
# buffer; canzona's per-dtype buffers (the inventory's norms marked fp32) are the same


def test_mixed_dtype_buffers():
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dp, tp = 2, 2
    model, bucket = "qwen3-untied", "small"
    rec = _record_megatron(dp, tp, [(MODELS[model], bucket)],
                           float16_module=False)[MODELS[model].name, bucket]
    spec = build_inventory(MODELS[model])
    mixed = ModelSpec(config=spec.config, params=tuple(
        dataclasses.replace(p, dtype="fp32") if p.kind == "vector" else p for p in spec.params))
    size, overlap = BUCKETS[bucket]
    ours = build_layout(mixed, ParallelSizes(dp, tp), bucket_size=size, overlap_grad_reduce=overlap)
    assert [(b.dtype, b.numel) for b in ours.buffers] == [
        (m["dtype"], m["numel"]) for m in rec["buffers"]] == [
        ("bf16", ours.buffers[0].numel), ("fp32", ours.buffers[1].numel)]
    for buf, mbuf in zip(ours.buffers, rec["buffers"]):
        assert {s.name: (s.start, s.end, b.index) for b in buf.buckets
                for s in b.slots} == mbuf["params"]
        assert [(b.start, b.end, b.numel_unpadded) for b in buf.buckets] == [
            (b["start"], b["end"], b["numel_unpadded"]) for b in mbuf["buckets"]]
