"""Real tensors: shards cut by Megatron's rules, re-concatenated per the planner's shard maps, equal
the logical matrix; the split-part view picks the right rows; scattering back restores the shards.

The cutting here is written independently of ``canzona.planner.shards``: it follows Megatron-core's
layers and its HF→Megatron checkpoint converters (fused QKV grouped per KV group, fc1 as
[gate_r; up_r] per rank, vocabulary padded to a multiple of 128·t).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from canzona.planner import build_inventory, get_preset  # noqa: E402
from canzona.planner.inventory import Part, ParamSpec  # noqa: E402
from canzona.planner.layout import padded_vocab  # noqa: E402
from canzona.planner.shards import concat_shards, shard_map, split_full  # noqa: E402


def cat(xs, d):
    return torch.cat(xs, d)


def megatron_qkv_shards(q, k, v, groups: int, tp: int):
    """Megatron's fused QKV: per KV group [q heads of the group; k_g; v_g], groups split over TP."""
    qg = q.shape[0] // groups
    hd = k.shape[0] // groups
    fused = torch.cat([torch.cat([q[g * qg:(g + 1) * qg], k[g * hd:(g + 1) * hd],
                                  v[g * hd:(g + 1) * hd]]) for g in range(groups)])
    return list(fused.chunk(tp, dim=0))


def megatron_fc1_shards(gate, up, tp: int):
    """fc1 with partition_stride 2: rank r holds [gate rows of r; up rows of r]."""
    return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]


def spec(name, shape, layout, parts=()):
    return ParamSpec(name=name, shape=shape, dtype="bf16", kind="matrix", layer=0, expert=None,
                     tp_layout=layout, parts=parts, optimizer="matrix")


@pytest.mark.parametrize("groups,q_per_group,tp", [(8, 8, 8), (8, 8, 4), (4, 16, 4), (8, 2, 2),
                                                   (2, 3, 1)])
def test_qkv_groups_reconstruct_hf_order(groups, q_per_group, tp):
    hd, h = 4, 6
    q = torch.randn(groups * q_per_group * hd, h)
    k = torch.randn(groups * hd, h)
    v = torch.randn(groups * hd, h)
    p = spec("qkv", (q.shape[0] + 2 * k.shape[0], h), "qkv",
             (Part("q", q.shape[0]), Part("k", k.shape[0]), Part("v", v.shape[0])))
    shards = megatron_qkv_shards(q, k, v, groups, tp)
    m = shard_map(p, tp, kv_groups=groups)
    assert tuple(shards[0].shape) == m.local_shape
    assert torch.equal(concat_shards(m, shards, cat), torch.cat([q, k, v]))
    for name, want in (("q", q), ("k", k), ("v", v)):
        mp = shard_map(p, tp, kv_groups=groups, part=name)
        assert torch.equal(concat_shards(mp, shards, cat), want)
        assert sum(mp.sent_numel(r) for r in range(tp)) == want.numel()
    # Scattering an update of the full matrix back gives every rank its Megatron shard.
    full = torch.cat([q, k, v])
    for r in range(tp):
        local = torch.zeros_like(shards[r])
        for start, piece in split_full(m, full, r):
            local[start:start + piece.shape[0]] = piece
        assert torch.equal(local, shards[r])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fc1_stride2_interleave(tp):
    f, h = 16, 5
    gate, up = torch.randn(f, h), torch.randn(f, h)
    p = spec("fc1", (2 * f, h), "gate_up", (Part("gate", f), Part("up", f)))
    shards = megatron_fc1_shards(gate, up, tp)
    m = shard_map(p, tp)
    if tp > 1:  # naive concatenation is [g0; u0; g1; u1; ...], not [gate; up]
        assert not torch.equal(torch.cat(shards), torch.cat([gate, up]))
    assert torch.equal(concat_shards(m, shards, cat), torch.cat([gate, up]))
    assert torch.equal(concat_shards(shard_map(p, tp, part="gate"), shards, cat), gate)
    assert torch.equal(concat_shards(shard_map(p, tp, part="up"), shards, cat), up)
    for r in range(tp):
        local = torch.zeros_like(shards[r])
        for start, piece in split_full(m, torch.cat([gate, up]), r):
            local[start:start + piece.shape[0]] = piece
        assert torch.equal(local, shards[r])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_and_column_parallel(tp):
    w = torch.randn(8, 12)
    col = spec("col", (8, 12), "column")
    row = spec("row", (8, 12), "row")
    assert torch.equal(concat_shards(shard_map(col, tp), list(w.chunk(tp, 0)), cat), w)
    assert torch.equal(concat_shards(shard_map(row, tp), list(w.chunk(tp, 1)), cat), w)
    mr = shard_map(row, tp)
    for r in range(tp):
        (start, piece), = split_full(mr, w, r)
        assert start == 0 and torch.equal(piece, w.chunk(tp, 1)[r])


@pytest.mark.parametrize("tp", [1, 3, 8])
def test_vocab_padding_is_dropped(tp):
    V, h = 300, 4
    w = torch.randn(V, h)
    vp = padded_vocab(V, tp)
    padded = torch.cat([w, torch.full((vp - V, h), float("nan"))])
    p = ParamSpec(name="emb", shape=(V, h), dtype="bf16", kind="embedding", layer=None,
                  expert=None, tp_layout="vocab")
    m = shard_map(p, tp)
    shards = list(padded.chunk(tp, 0))
    assert tuple(shards[0].shape) == m.local_shape
    assert torch.equal(concat_shards(m, shards, cat), w)


def test_real_model_maps_cover_every_matrix():
    """Every TP-split matrix of a real preset has a map that tiles its logical rows exactly."""
    s = build_inventory(get_preset("qwen3-30b-a3b"))
    tp = 4
    for p in s.params[:40]:
        if p.tp_layout == "replicated":
            continue
        m = shard_map(p, tp, kv_groups=s.config.kv_heads)
        covered = sorted((x.full_start, x.length) for x in m.segments)
        pos = 0
        for start, n in covered:
            assert start == pos
            pos += n
        assert pos == m.full_shape[m.dim]
        assert sum(m.sent_numel(r) for r in range(tp)) == m.full_numel
