"""Physical layout against Megatron-core's rules."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner import (ParallelSizes, SizeError, build_inventory, build_layout, get_preset,
                             local_shape)
from canzona.planner.layout import default_bucket_size, padded_vocab
from canzona.planner.models import PRESETS, ModelConfig


def test_qwen3_32b_tp8_local_shapes():
    spec = build_inventory(get_preset("qwen3-32b"))
    sizes = ParallelSizes(dp=32, tp=8)
    shape = {p.name.split(".", 3)[-1] if p.layer is not None else p.name: local_shape(p, sizes)
             for p in spec.params}
    assert shape["self_attention.linear_qkv.weight"] == (1280, 5120)
    assert shape["self_attention.linear_proj.weight"] == (5120, 1024)
    assert shape["mlp.linear_fc1.weight"] == (6400, 5120)
    assert shape["mlp.linear_fc2.weight"] == (5120, 3200)
    assert shape["embedding.word_embeddings.weight"] == (19072, 5120)
    assert shape["output_layer.weight"] == (19072, 5120)
    assert shape["input_layernorm.weight"] == (5120,)
    assert padded_vocab(151936, 8) == 152576


def test_expert_shapes_use_expert_tp():
    spec = build_inventory(get_preset("qwen3-235b-a22b"))
    p = spec["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert local_shape(p, ParallelSizes(dp=64, tp=4, ep=8)) == (2 * 1536 // 4, 4096)
    assert local_shape(p, ParallelSizes(dp=64, tp=4, ep=8, etp=1)) == (2 * 1536, 4096)


TINY = ModelConfig(name="tiny", arch="llama", hidden=64, ffn=128, layers=2, q_heads=2, kv_heads=1,
                   head_dim=32, vocab=100, tied_embeddings=False, qk_norm=False)


def test_tiny_model_buckets_by_hand():
    """Offsets worked out by hand from Megatron's _ParamAndGradBuffer rules (see docstring of
    canzona.planner.layout): reversed order, 64-aligned starts, close at >= 10,000 elements, end
    padded to lcm(2, 128) = 128."""
    lay = build_layout(build_inventory(TINY), ParallelSizes(dp=2, tp=1), bucket_size=10_000)
    (buf,) = lay.buffers
    assert [(b.start, b.end, b.numel_unpadded) for b in buf.buckets] == [
        (0, 16512, 16448), (16512, 32896, 16384), (32896, 45312, 12352),
        (45312, 70016, 24640), (70016, 82432, 12352), (82432, 90752, 8256)]
    first = buf.buckets[0].slots
    assert [(s.name, s.start, s.end) for s in first] == [
        ("output_layer.weight", 0, 8192),  # vocab 100 padded to 128 rows
        ("decoder.final_layernorm.weight", 8192, 8256),
        ("decoder.layers.1.mlp.linear_fc2.weight", 8256, 16448)]
    assert buf.buckets[-1].slots[-1].name == "embedding.word_embeddings.weight"
    assert buf.buckets[2].chunk(1, 2) == (32896 + 6208, 45312)


def test_unaligned_sizes_are_padded_to_64():
    cfg = TINY.model_copy(update={"hidden": 72, "head_dim": 36, "ffn": 144})
    lay = build_layout(build_inventory(cfg), ParallelSizes(dp=3, tp=1), bucket_size=None,
                       overlap_grad_reduce=False)
    (buf,) = lay.buffers
    (bucket,) = buf.buckets
    slots = bucket.slots
    assert all(s.start % 64 == 0 for s in slots)
    # The final norm (72 elements) follows the output layer; the next start pads to 64.
    assert slots[1].start == 128 * 72 and slots[2].start == math.ceil((128 * 72 + 72) / 64) * 64
    assert bucket.end % math.lcm(3, 128) == 0 and bucket.end - slots[-1].end < math.lcm(3, 128)


def test_no_overlap_gives_one_bucket_per_buffer():
    lay = build_layout(build_inventory(get_preset("qwen3-8b")), ParallelSizes(dp=16, tp=4),
                       overlap_grad_reduce=False)
    assert lay.bucket_size is None and [len(b.buckets) for b in lay.buffers] == [1]


def test_default_bucket_size():
    assert default_bucket_size(8) == 40_000_000 and default_bucket_size(64) == 64_000_000
    lay = build_layout(build_inventory(get_preset("qwen3-8b")), ParallelSizes(dp=64, tp=1))
    assert lay.bucket_size == 64_000_000


def test_expert_buffers_per_ep_rank_over_edp():
    lay = build_layout(build_inventory(get_preset("qwen3-30b-a3b")),
                       ParallelSizes(dp=16, tp=2, ep=8))
    dense = [b for b in lay.buffers if not b.expert]
    experts = [b for b in lay.buffers if b.expert]
    assert len(dense) == 1 and dense[0].dp_size == 16
    assert [b.ep_rank for b in experts] == list(range(8))
    assert all(b.dp_size == 16 * 2 // (8 * 2) for b in experts)
    names = {s.name for k in experts[1].buckets for s in k.slots}
    assert "decoder.layers.0.mlp.experts.local_experts.16.linear_fc1.weight" in names
    assert "decoder.layers.0.mlp.experts.local_experts.15.linear_fc1.weight" not in names
    assert all(b.numel % math.lcm(2, 128) == 0 for b in experts)


def test_experts_stay_in_the_dense_buffer_at_ep1():
    """Megatron gives experts buffers of their own only with expert parallelism (``allreduce`` is
    ``not (is_expert and ep > 1)``): at ep = 1 they sit in the dense buffer in registration order,
    sharded over the DP group (checked against megatron-core itself in tests/megatron)."""
    spec = build_inventory(get_preset("qwen3-30b-a3b"))
    lay = build_layout(spec, ParallelSizes(dp=8, tp=2, ep=1))
    assert [(b.expert, b.dp_size) for b in lay.buffers] == [(False, 8)]
    order = [s.name for b in lay.buffers[0].buckets for s in b.slots]
    assert order == [p.name for p in reversed(spec.params)]


def test_te_grouped_expert_buffers_reverse_their_registration():
    """TEGroupedMLP's weights (``megatron-grouped``) enter each EP rank's expert buffer in
    reverse registration order: per layer, last to first, fc2's weights then fc1's, each from
    the rank's last expert to its first (checked against megatron-core in tests/megatron)."""
    cfg = get_preset("qwen3-30b-a3b").model_copy(update={"layers": 2, "num_experts": 8})
    spec = build_inventory(cfg, names="megatron-grouped")
    lay = build_layout(spec, ParallelSizes(dp=4, tp=1, ep=2), overlap_grad_reduce=False)
    experts = [b for b in lay.buffers if b.expert]
    for k, buf in enumerate(experts):
        order = [s.name for s in sorted(buf.buckets[0].slots, key=lambda s: s.start)]
        mine = [p.name for p in spec.params if p.is_expert and 4 * k <= p.expert < 4 * k + 4]
        assert order == mine[::-1]
    assert order[:2] == ["decoder.layers.1.mlp.experts.linear_fc2.weight7",
                         "decoder.layers.1.mlp.experts.linear_fc2.weight6"]


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from([n for n, c in PRESETS.items() if not c.is_moe]),
       dp=st.sampled_from([1, 2, 3, 8, 24, 64]), tp=st.sampled_from([1, 2, 4, 8]),
       bucket=st.one_of(st.none(), st.integers(1_000_000, 80_000_000)))
def test_megatron_bucket_rules(name, dp, tp, bucket):
    spec = build_inventory(PRESETS[name])
    lay = build_layout(spec, ParallelSizes(dp=dp, tp=tp), bucket_size=bucket)
    size = bucket or default_bucket_size(dp)
    (buf,) = lay.buffers
    order = [s.name for b in buf.buckets for s in b.slots]
    assert order == [p.name for p in reversed(spec.params)]  # reverse registration order
    prev_end = 0
    for i, b in enumerate(buf.buckets):
        assert b.start == prev_end and b.end % math.lcm(dp, 128) == 0
        assert b.end - (b.start + b.numel_unpadded) < math.lcm(dp, 128)
        for s, nxt in zip(b.slots, b.slots[1:]):
            assert s.start % 64 == 0 and s.end <= nxt.start < s.end + 64
            assert s.end - b.start < size  # a bucket closes as soon as it reaches bucket_size
        if i < len(buf.buckets) - 1:
            assert b.numel_unpadded >= size
        chunks = [b.chunk(r, dp) for r in range(dp)]
        assert chunks[0][0] == b.start and chunks[-1][1] == b.end
        assert len({hi - lo for lo, hi in chunks}) == 1
        prev_end = b.end


def test_tp_must_divide_heads_groups_ffn():
    with pytest.raises(SizeError) as e:
        build_layout(build_inventory(get_preset("qwen3-32b")), ParallelSizes(dp=1, tp=3))
    msg = str(e.value)
    assert "tp=3" in msg and "attention heads (64)" in msg and "KV groups (8)" in msg
    assert "nearest valid tp: 2, 4" in msg and "\n" not in msg


def test_tp_16_exceeds_kv_groups():
    with pytest.raises(SizeError, match=r"KV groups \(8\).*nearest valid tp: 8"):
        build_layout(build_inventory(get_preset("qwen3-32b")), ParallelSizes(dp=1, tp=16))


def test_ep_must_divide_experts_and_world():
    spec = build_inventory(get_preset("qwen3-30b-a3b"))
    # 4 divides the experts but not the world size 6: the one list of nearest sizes says 2 only.
    with pytest.raises(SizeError, match=r"ep=3 must divide the number of experts .*128\); "
                                        r"nearest valid ep: 2\.$"):
        build_layout(spec, ParallelSizes(dp=6, tp=1, ep=3))
    # Both ep constraints fail: one sentence, the nearest sizes listed once.
    with pytest.raises(SizeError) as info:
        build_layout(spec, ParallelSizes(dp=4, tp=1, ep=3))
    msg = str(info.value)
    assert "experts" in msg and "world size dp·tp=4" in msg, msg
    assert msg.count("nearest valid ep") == 1 and msg.endswith("nearest valid ep: 2, 4."), msg
    with pytest.raises(SizeError, match=r"ep·etp=16 must divide the world size"):
        build_layout(spec, ParallelSizes(dp=4, tp=2, ep=8))


def test_ep_on_dense_model_and_non_positive_sizes():
    spec = build_inventory(get_preset("qwen3-8b"))
    with pytest.raises(SizeError, match="dense"):
        build_layout(spec, ParallelSizes(dp=4, tp=1, ep=2))
    with pytest.raises(SizeError, match="ParallelSizes.dp must be a positive integer"):
        build_layout(spec, ParallelSizes(dp=0, tp=1))
    with pytest.raises(SizeError, match="DPOptions.bucket_size"):
        build_layout(spec, ParallelSizes(dp=2, tp=1), bucket_size=0)


def test_split_matrix_count_matches_chunk_boundaries():
    lay = build_layout(build_inventory(get_preset("qwen3-32b")), ParallelSizes(dp=32, tp=8))
    split = dict(lay.split_matrices())
    (buf,) = lay.buffers
    for b in buf.buckets:
        bounds = [b.chunk(r, 32)[0] for r in range(1, 32)]
        for s in b.slots:
            inside = sum(1 for x in bounds if s.start < x < s.end)
            if s.optimizer == "matrix":
                assert split.get(s.name, 1) - 1 == inside
