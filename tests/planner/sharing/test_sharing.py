"""The bound beyond whole matrices (the planner's analysis): which Muon
tasks a few ranks would share, over which group, and the per-GPU bound with sharing beside the
atomic LB = max(mean, largest task)."""

from __future__ import annotations

import pytest

from canzona.planner.formulas import muon_flops, poly_flops
from canzona.planner.hardware import load_hardware
from canzona.planner.inventory import build_inventory
from canzona.planner.layout import ParallelSizes
from canzona.planner.models import ModelConfig, get_preset
from canzona.planner.planning import make_problem
from canzona.planner.settings import OptimizerSettings
from canzona.planner.sharing import kind_of, share_options, sharing_bound


def _problem(model, dp: int, tp: int, optimizer: str = "muon"):
    cfg = get_preset(model) if isinstance(model, str) else model
    return make_problem(build_inventory(cfg), ParallelSizes(dp=dp, tp=tp),
                        OptimizerSettings(name=optimizer), cost="flops")


def test_qwen3_32b_dp32_tp8_the_issues_floor_and_fc1_shared_over_tp():
    pr = _problem("qwen3-32b", 32, 8)
    r = sharing_bound(pr, hardware="h800")
    assert r.atomic_ratio == pytest.approx(2.04, abs=0.005)  # the issue's figure
    assert r.largest_task == max(pr.loads[t.id] for t in pr.tasks if t.optimizer == "matrix")
    assert r.shared_ratio < 1.10 and r.shared_lb >= r.mean
    fc1 = [s for s in r.shared if kind_of(s.name) == "mlp.linear_fc1"]
    assert len(fc1) == 64  # every layer's fused gate/up, the tasks above the mean
    for s in r.shared:
        assert s.option.group == "tp" and s.option.k == 8
        assert s.piece_load < s.load and s.piece_load <= r.shared_lb
    # nothing below the mean is shared, and everything above it is
    names = {s.task for s in r.shared}
    assert all(pr.loads[i] > r.mean for i in names)
    assert all(pr.loads[t.id] <= r.shared_lb for t in pr.tasks
               if t.optimizer == "matrix" and t.id not in names)


def test_the_bound_grows_with_scale_but_stays_far_below_the_atomic_one():
    small = sharing_bound(_problem("qwen3-32b", 32, 8), hardware="h800")
    big = sharing_bound(_problem("qwen3-32b", 128, 8), hardware="h800")
    assert big.atomic_ratio == pytest.approx(8.2, abs=0.1)
    assert big.shared_ratio >= small.shared_ratio
    assert big.shared_ratio < big.atomic_ratio / 3


@pytest.mark.parametrize("k", [2, 4, 8])
def test_piece_flops_are_the_kernels(k):
    """k unsplit pieces are the single-device FLOPs plus (k-1) copies of the 2n³ polynomial;
    split pieces compute the polynomial's upper parts once (shared_ns's cost table): fewer
    FLOPs than the single-device kernel, which forms all of P."""
    hw = load_hardware("h100")
    pr = _problem("qwen3-0.6b", 8, k)
    i = next(t.id for t in pr.tasks if t.optimizer == "matrix" and t.tp_split
             and share_options(pr, t.id, hw))
    m, n = max(pr.tasks[i].shape), min(pr.tasks[i].shape)
    s = pr.settings.ns_steps
    opts = {o.split_poly: o for o in share_options(pr, i, hw)}
    assert k * opts[False].piece_flops == muon_flops(m, n, ns_steps=s) + (k - 1) * s * 2 * n ** 3
    assert k * opts[True].piece_flops == muon_flops(m, n, ns_steps=s) - s * 2 * n ** 3 \
        + s * k * poly_flops(n, k) < muon_flops(m, n, ns_steps=s)
    assert k * poly_flops(n, k) == 2 * n ** 3 * (2 * k + 1) // (4 * k)  # 2k divides n here
    assert opts[True].comm_s > opts[False].comm_s > 0  # the split adds an all-gather


def test_tp_sharing_needs_the_split_dim_to_be_the_long_one():
    """QKV with fewer rows than the hidden size: its column-parallel shards are column blocks of
    the oriented matrix, so its TP group cannot share it without a gather."""
    cfg = ModelConfig(name="narrow-qkv", arch="qwen3", hidden=1024, ffn=4096, layers=1,
                      q_heads=4, kv_heads=2, head_dim=64, vocab=1000, tied_embeddings=False,
                      qk_norm=True)
    pr = _problem(cfg, 2, 2)
    hw = load_hardware("h100")
    by_kind = {kind_of(t.name): share_options(pr, t.id, hw) for t in pr.tasks
               if t.optimizer == "matrix"}
    assert by_kind["self_attention.linear_qkv"] == []  # 512 × 1024, split along the 512
    # 8192 × 1024, split rows: its TP group, or that and a second DP index's (its shards tall)
    assert {o.group for o in by_kind["mlp.linear_fc1"]} == {"tp", "tp_pair"}


@pytest.mark.parametrize("dp,ks", [(6, {2}), (8, {2, 4}), (1, set())])
def test_dp_sharing_uses_fixed_pairs_and_quads(dp, ks):
    pr = _problem("qwen3-0.6b", dp, 1)
    hw = load_hardware("h100")
    i = max((t.id for t in pr.tasks if t.optimizer == "matrix"), key=lambda i: pr.loads[i])
    opts = share_options(pr, i, hw)
    assert {o.k for o in opts} == ks and all(o.group == "dp" for o in opts)


def test_qwen3_8b_at_scale_shares_over_dp_quads():
    r = sharing_bound(_problem("qwen3-8b", 1024, 1), hardware="h800")
    assert r.atomic_ratio == pytest.approx(13.7, abs=0.1)
    assert r.shared and {(s.option.group, s.option.k) for s in r.shared} <= {("dp", 2), ("dp", 4)}
    assert r.shared_ratio < r.atomic_ratio / 2


def test_other_optimizers_stay_whole():
    r = sharing_bound(_problem("qwen3-0.6b", 16, 2, optimizer="soap"))
    assert r.shared == () and r.shared_lb == r.atomic_lb and "Muon" in r.note


def test_shampoo_blocks_shard_by_shard_where_the_shards_are_whole_blocks():
    """Shampoo at tp > 1: a TP-split matrix whose every shard is whole blocks of the matrix's
    grid is preconditioned shard by shard (each piece exactly its shard's FLOPs, nothing added);
    QKV, whose shards interleave 512-row Q and 128-row K/V segments, stays whole. qwen3-8b tp 4:
    fc1 (3072 rows per gate/up segment), fc2 and proj (3072 and 1024 columns) are whole blocks."""
    from canzona.planner import optimizers
    from canzona.planner.sharing import shard_block_decision, shard_blocks_aligned
    from canzona.planner.shards import shard_map

    pr = _problem("qwen3-8b", 64, 4, optimizer="shampoo")
    chosen = shard_block_decision(pr, "h800")
    kinds = {kind_of(pr.tasks[i].name) for i in chosen}
    assert kinds == {"mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj"}
    spec, st = optimizers.get("shampoo"), pr.settings
    kv = pr.spec.config.kv_heads
    for t in pr.tasks:
        if t.optimizer != "matrix" or not t.tp_split:
            continue
        smap = shard_map(pr.spec[t.param], 4, kv_groups=kv)
        assert (t.id in chosen) == shard_blocks_aligned(smap, st.max_preconditioner_dim)
        if t.id in chosen:  # the four shards' blocks are the matrix's blocks: FLOPs add up
            load, split, comp, comm, hidden = chosen[t.id]
            assert 4 * spec.flops(*smap.local_shape, st) == pytest.approx(
                pr.costs[t.id].flops, abs=4)  # the amortised roots are rounded per piece
            assert not split and comm == hidden == 0.0 and load == pytest.approx(pr.loads[t.id] / 4)
    r = sharing_bound(pr, hardware="h800")
    assert {s.task for s in r.shared} == set(chosen) and r.shared_ratio < r.atomic_ratio
    # qwen3-32b tp 8: fc1's 3200-row gate/up segments are not whole blocks of 1024
    big = _problem("qwen3-32b", 8, 8, optimizer="shampoo")
    assert "mlp.linear_fc1" not in {kind_of(big.tasks[i].name)
                                    for i in shard_block_decision(big, "h800")}


def test_deterministic_and_serialisable():
    pr = _problem("qwen3-8b", 64, 2)
    a, b = sharing_bound(pr).to_dict(), sharing_bound(pr).to_dict()
    assert a == b and a["atomic_lb_over_mean"] >= a["shared_lb_over_mean"] >= 1.0


def test_llama3_70b_at_scale_needs_more_ranks_than_the_tp_group():
    """llama3-70b dp256 tp8: fc1's piece over its TP group alone is 1.58× the mean useful work,
    so the TP-only bound cannot reach 1.5; a TP group and its partner DP index (k = 16) can.
    Only tall column-parallel weights get that option (a ZeRO-1 cut of a row-parallel shard is
    a block of its short dimension), and only with a second DP index."""
    pr = _problem("llama3-70b", 256, 8)
    tp_only = sharing_bound(pr, hardware="h800", groups=("tp", "dp"))
    both = sharing_bound(pr, hardware="h800")
    # fc1's piece alone, its Gram's all-reduce beside its own products: still over 1.5
    assert tp_only.longest_path / tp_only.mean > 1.7
    assert max(s.piece_load for s in tp_only.shared) / tp_only.mean > 1.5
    fc1 = [s for s in both.shared if kind_of(s.name) == "mlp.linear_fc1"]
    assert len(fc1) == 80 and all((s.option.group, s.option.k) == ("tp_pair", 16) for s in fc1)
    assert all(s.option.group == "tp" for s in both.shared if s not in fc1)  # k = tp suffices
    assert both.shared_ratio < 1.1 and both.longest_path / both.mean < 1.55
    hw = load_hardware("h800")
    groups = {kind_of(t.name): {o.group for o in share_options(pr, t.id, hw)}
              for t in pr.tasks if t.optimizer == "matrix"}
    assert "tp_pair" in groups["mlp.linear_fc1"] and "tp_pair" not in groups["mlp.linear_fc2"]
    fc1 = next(t.id for t in pr.tasks if kind_of(t.name) == "mlp.linear_fc1")
    assert {o.group for o in share_options(pr, fc1, hw, groups=("tp_pair",))} == {"tp_pair"}
    one = _problem("llama3-70b", 1, 8)
    assert all(o.group != "tp_pair" for t in one.tasks if t.optimizer == "matrix"
               for o in share_options(one, t.id, hw))


def test_tp_pair_pieces_halve_the_tp_groups_row_work():
    """k = 2·tp: each rank's rows halve against the TP group alone; the Gram's TP collectives
    are the TP group's, and only 1/tp of it (plus the split's blocks) crosses to the partner."""
    from canzona.planner.formulas import gram_chunks, gram_packed_numel
    from canzona.planner.sharing import profile_rate, shared_piece, tp_pair_piece

    hw = load_hardware("h800")
    m, n, s, tp = 57344, 8192, 5, 8
    rate = profile_rate(hw)
    alone = shared_piece("tp", tp, False, m, n, s, 2, hw.intra_node, rate=rate)
    pair = tp_pair_piece(tp, False, m, n, s, 2, hw.intra_node, hw.inter_node, rate=rate)
    assert pair.k == 16 and alone.piece_flops - pair.piece_flops == s * 4 * n * n * (m // 16)
    g, c = gram_packed_numel(n), len(gram_chunks(n))
    # per chunk a reduce-scatter and an all-gather over TP and 1/tp of it to the partner
    tp_part = 2 * (c * hw.intra_node.latency_s + 7 / 8 * g * 2 / hw.intra_node.busbw)
    cross = c * hw.inter_node.latency_s + g / 8 * 2 / hw.inter_node.busbw
    assert pair.comm_s == pytest.approx(s * (tp_part + cross))
    # only the reduce-scatters start at once: beside the Gram's products, at most their time
    assert 0 < pair.hidden_s <= s * (c * hw.intra_node.latency_s
                                     + 7 / 8 * g * 2 / hw.intra_node.busbw)


@pytest.mark.parametrize("n", [1, 5, 17, 64, 8192])
def test_gram_chunks_cover_the_rows_and_the_packed_gram(n):
    """``formulas.gram_chunks``: consecutive whole block rows, at most GRAM_CHUNKS of them, their
    packed ranges back to back over the whole packed Gram, sizes falling."""
    from canzona.planner.formulas import GRAM_CHUNKS, gram_blocks, gram_chunks, gram_packed_numel

    chunks = gram_chunks(n)
    assert 1 <= len(chunks) <= GRAM_CHUNKS
    starts = {r0 for r0, _ in gram_blocks(n)} | {n}
    assert chunks[0][0] == 0 and chunks[-1][1] == n and chunks[0][2] == 0
    assert chunks[-1][3] == gram_packed_numel(n)
    for (r0, r1, p0, p1), nxt in zip(chunks, chunks[1:] + [None]):
        assert r0 in starts and r1 in starts and r1 > r0
        assert p1 - p0 == sum((b1 - b0) * (n - b0) for b0, b1 in gram_blocks(n) if r0 <= b0 < r1)
        if nxt is not None:
            assert (nxt[0], nxt[2]) == (r1, p1) and nxt[3] - nxt[2] <= p1 - p0


def test_the_gram_all_reduce_runs_beside_its_own_products():
    """``sharing.gram_pipeline`` is the two-stage pipeline of the kernel's chunks (each chunk's
    all-reduce after its rows and after the chunk before it), checked by simulating it; a piece
    alone (and ``lockstep_seconds`` of one piece) takes its compute plus what that hides not of
    its collectives; chunking adds one latency per chunk to the link, nothing else."""
    from canzona.planner.formulas import gram_chunks, gram_packed_numel
    from canzona.planner.sharing import gram_pipeline, profile_rate, shared_piece
    from canzona.planner.sharing.pieces import _all_reduce_s
    from canzona.planner.tp.context import lockstep_seconds

    def all_reduce(k, link):
        return lambda numel: (_all_reduce_s(numel, 2, k, link), 0.0)

    hw = load_hardware("h800")
    rate, link = profile_rate(hw), hw.intra_node
    for rows, n, k in ((7168, 8192, 8), (1024, 8192, 8), (64, 64, 2), (50_000, 512, 2)):
        comm, hidden = gram_pipeline(rows, n, rate, all_reduce(k, link))
        t_comp = t_link = 0.0
        for r0, r1, p0, p1 in gram_chunks(n):
            t_comp += 2 * rows * (r1 - r0) * n / rate
            t_link = max(t_link, t_comp) + _all_reduce_s(p1 - p0, 2, k, link)
        comp = 2 * rows * n * n / rate
        assert comp + comm - hidden == pytest.approx(t_link, rel=1e-12)
        assert 0 <= hidden <= min(comm, comp)
        whole = _all_reduce_s(gram_packed_numel(n), 2, k, link)
        assert comm == pytest.approx(whole + (len(gram_chunks(n)) - 1) * link.latency_s)
        o = shared_piece("tp", k, True, rows * k, n, 5, 2, link, rate=rate)
        assert o.hidden_s == pytest.approx(5 * hidden)
        run = (o.piece_flops / rate, o.comm_s, o.hidden_s)
        assert lockstep_seconds([run], 5) == pytest.approx(o.alone_s(rate))
        # compute-heavy (fc1's TP piece): most of its Gram's all-reduce is hidden
        if (rows, n) == (7168, 8192):
            assert hidden > 0.9 * comm


def test_tp_sub_group_pieces_gather_their_rows_and_keep_the_grams_collectives():
    """A TP sub-group of k < tp ranks (``tp_sub``): each rank computes the rows of k ranks, its
    Gram's collectives are those of a k-rank group, and it gathers tp/k − 1 foreign shards of
    its matrix before and returns as many after, time nothing hides (``moved_s``, part of its
    compute); k = tp is the TP group's own piece with nothing moved. Only asked for, never by
    default."""
    from canzona.planner.sharing import profile_rate, shared_piece, tp_sub_piece

    hw = load_hardware("h800")
    link, rate = hw.intra_node, profile_rate(hw)
    m, n, s, tp = 8192, 8192, 5, 8
    whole = shared_piece("tp", tp, True, m, n, s, 2, link, rate=rate)
    assert tp_sub_piece(tp, tp, True, m, n, s, 2, link, rate=rate) == \
        shared_piece("tp_sub", tp, True, m, n, s, 2, link, rate=rate)
    for k in (2, 4):
        sub = tp_sub_piece(tp, k, True, m, n, s, 2, link, rate=rate)
        own = shared_piece("tp_sub", k, True, m, n, s, 2, link, rate=rate)
        moved = (tp // k - 1) * (m // tp) * n * 2
        assert sub.k == k and sub.piece_flops == own.piece_flops > whole.piece_flops
        assert sub.comm_s == own.comm_s and sub.hidden_s == own.hidden_s
        assert sub.moved_s == pytest.approx(2 * (link.latency_s + moved / link.busbw))
        assert sub.compute_s(rate) == pytest.approx(own.compute_s(rate) + sub.moved_s)
        # fewer ranks per matrix: fewer collective seconds per FLOP than the whole TP group
        assert (sub.comm_s + sub.moved_s) / sub.piece_flops < whole.comm_s / whole.piece_flops
    with pytest.raises(ValueError, match="divides tp"):
        tp_sub_piece(tp, 3, True, m, n, s, 2, link, rate=rate)

    pr = make_problem(build_inventory(get_preset("llama3-70b")), ParallelSizes(dp=4, tp=8),
                      OptimizerSettings(name="muon"), cost="flops")
    proj = next(t for t in pr.tasks if t.name.endswith("self_attention.linear_proj.weight"))
    assert not any(o.group == "tp_sub" for o in share_options(pr, proj.id, hw))
    subs = [(o.k, o.split_poly) for o in share_options(pr, proj.id, hw, groups=("tp_sub",))]
    assert subs == [(2, False), (2, True), (4, False), (4, True)]


def test_a_lockstep_never_beats_a_pieces_own_chain():
    """Pieces beside a matrix fill its Gram waits but cannot shorten its own chain (its next
    iteration needs its reduced Gram): a long piece with exposed collectives beside a short
    one takes at least its compute plus what its Gram products do not hide. The planner's
    ``Lockstep`` (whole and split into batches) and the simulator's ``lockstep_seconds`` agree."""
    from canzona.planner.tp.context import lockstep_seconds
    from canzona.planner.tp.context import HALF, Lockstep

    big, small = (8.4, 5.1, 0.9), (2.9, 2.9, 0.9)  # (compute, collectives, hidden) seconds
    chain = big[0] + big[1] - big[2]  # 12.6
    # without the chain: max(Σ compute 11.3, Σ collectives 8.0 + least 2.0) = 11.3
    assert lockstep_seconds([big, small], 5) == pytest.approx(chain)
    assert lockstep_seconds([small], 5) == pytest.approx(small[0] + small[1] - small[2])
    lock = Lockstep(0)
    for key, (c, a, h) in ((1, big), (2, small)):
        lock.add((key, c, a, max(c, a), 10, h))
    assert lock.load() == pytest.approx(chain)
    capped = Lockstep(15)  # each piece its own batch: two chains
    halves = Lockstep(15)
    for key, (c, a, h) in ((1, big), (2, small)):
        capped.add((key, c, a, max(c, a), 10, h))
        halves.add((key - HALF * (key == 1), c, a, max(c, a), 10, h))
    two = chain + small[0] + small[1] - small[2]
    assert capped.load() == pytest.approx(two)
    assert halves.split() == pytest.approx((chain, small[0] + small[1] - small[2]))
    together = Lockstep(20)
    for key, (c, a, h) in ((-HALF + 1, big), (2, small)):
        together.add((key, c, a, max(c, a), 10, h))
    assert together.split() == pytest.approx((chain, 0.0))
