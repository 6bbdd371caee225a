"""canzona.planner.report: the data behind ``canzona models/layout/inspect --json``, no CLI."""

import json

import pytest

from canzona.planner import PRESETS, CanzonaError, ParallelSizes, get_preset
from canzona.planner.pipeline import plan
from canzona.planner.plan.inverse import rebuild_model
from canzona.planner.report import busiest_index, inspect_report, layout_dict, layout_of, model_rows

QWEN3_0_6B = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tp2_plan():
    return plan("qwen3-0.6b", ParallelSizes(4, 2))


def test_inspect_report_restates_the_plan_and_adds_the_baselines(tp2_plan):
    p = tp2_plan
    phases = []
    rep = inspect_report(p, top=3, progress=phases.append)
    assert phases == ["rebuilding the model's problem", "baselines", "TP baselines",
                      "sharing bound", "pattern bound (CP-SAT)", "the predicted step"]
    assert rep["predicted"]["step_s"] >= rep["predicted"]["reduced_step_s"] > 0
    assert json.loads(json.dumps(rep)) == rep  # plain data
    assert (rep["model"], rep["dp"], rep["tp"]) == ("qwen3-0.6b", 4, 2)
    assert rep["metrics"]["max_load"] == max(p.metrics.dp_load)
    assert rep["metrics"]["mean_load"] == sum(p.metrics.dp_load) / 4
    assert [r["load"] for r in rep["ranks"]] == list(p.metrics.dp_load)
    assert sum(r["matrices"] for r in rep["ranks"]) == sum(t.owner is not None for t in p.tasks)
    costs = [t["cost"] for t in rep["heaviest_tasks"]]
    assert costs == sorted((t.cost for t in p.tasks), reverse=True)[:3]
    ours = rep["baselines"][-1]
    assert ours["name"] == "canzona" and ours["max_load"] == max(p.metrics.dp_load)
    tp = rep["tp_schedule"]
    assert tp["gpu_load"] == [list(r) for r in p.tp.metrics.gpu_load]
    assert [b["name"] for b in tp["baselines"]][-1] == "canzona"
    assert tp["baselines"][-1]["max_gpu_load"] == p.tp.metrics.max_gpu_load
    assert {b["name"] for b in tp["baselines"]} == {"sc", "canzona-greedy", "canzona"}


def test_inspect_report_of_a_tp1_plan_has_no_tp_schedule():
    rep = inspect_report(plan("qwen3-0.6b", ParallelSizes(2, 1)), top=0)
    assert rep["tp_schedule"] is None and rep["heaviest_tasks"] == []


def test_hf_config_plans_need_their_config_and_the_right_one(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN3_0_6B))
    p = plan(cfg, ParallelSizes(2, 1))
    with pytest.raises(CanzonaError) as info:
        inspect_report(p)
    assert info.value.fields == ("inspect_report.config",)
    assert "pass it again with inspect_report.config PATH" in str(info.value)
    assert "pass it again with --config PATH" in info.value.render(
        {"inspect_report.config": "--config"})
    assert inspect_report(p, config=cfg)["baselines"] is not None
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**QWEN3_0_6B, "num_hidden_layers": 27}))
    with pytest.raises(CanzonaError, match="does not match config .*other parameters"):
        rebuild_model(p, other)


def test_a_te_grouped_plan_rebuilds_under_its_naming(tmp_path):
    """A plan made with ``names='megatron-grouped'`` is inspected with TEGroupedMLP's names."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1000, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32)))
    p = plan(cfg, ParallelSizes(1, 1), names="megatron-grouped")
    spec = rebuild_model(p, cfg)
    assert spec.fingerprint() == p.fingerprint
    assert "decoder.layers.0.mlp.experts.linear_fc2.weight7" in spec


def test_layout_dict_counts_what_the_layout_splits():
    phases = []
    spec, lay = layout_of(get_preset("qwen3-0.6b"), ParallelSizes(8, 1), progress=phases.append)
    assert phases == ["model inventory", "buffers and buckets"]
    d = layout_dict(spec, lay)
    assert d["matrices"] == 28 * 4 and d["split_matrices"] == len(d["split"])
    buckets = [k for b in d["buffers"] for k in b["buckets"]]
    assert d["split_matrices"] == sum(k["split_matrices"] for k in buckets)
    assert sum(k["params"] for k in buckets) == len(spec.params)


def test_model_rows_and_busiest_index():
    assert [r["name"] for r in model_rows()] == list(PRESETS)
    assert busiest_index([[1, 5], [5, 2], [3, 3]]) == 0  # ties: the lowest DP index
    assert busiest_index([[1, 2], [3, 6], [6, 1]]) == 1


# --- collectives: per bucket, per DP index, the comm section -----------------------------------


def _summary(p):
    from canzona.planner import comm
    from canzona.planner.hardware import LinkProfile

    link = LinkProfile(busbw=p.comm.busbw, latency_s=p.comm.latency_s)
    methods = [b.method for buf in p.buffers for b in buf.buckets]
    return comm.summarise(comm.buffer_slices(p.buffers, p.inputs.ep), p.inputs.dp, link, methods)


def test_inspect_report_buckets_and_ranks_are_comm_summarise_numbers(tp2_plan):
    p = tp2_plan
    rep = inspect_report(p, top=0)
    s = _summary(p)
    c = rep["comm"]
    buckets = [(buf, b) for buf in p.buffers for b in buf.buckets]
    assert len(c["buckets"]) == len(s.lines) == len(buckets) == c["totals"]["buckets"]
    for row, line, (buf, b) in zip(c["buckets"], s.lines, buckets, strict=True):
        sizes = line.slices.sizes
        assert (row["buffer"], row["bucket"], row["numel"]) == (buf.key, b.index, b.end - b.start)
        assert row["method"] == b.method == line.comm.method
        assert (row["slice_min"], row["slice_max"]) == (min(sizes), max(sizes))
        assert row["calls"] == line.comm.calls
        assert row["max_sent_bytes"] == max(line.comm.sent)
        assert row["busiest_bytes"] == line.comm.reduce.busiest + line.comm.gather.busiest
        assert row["seconds"] == round(line.comm.seconds, 9)
        assert row["zero1_seconds"] == round(line.zero1.seconds, 9)
        assert row["zero1_max_sent_bytes"] == max(line.zero1.sent)
    # Each bucket's compute: the matrices it holds, all of them once, per owner.
    assert sum(r["matrix_flops"] for r in c["buckets"]) == sum(
        t.flops for t in p.tasks if t.owner is not None)
    assert all(0 < r["max_rank_flops"] <= r["matrix_flops"] or r["matrix_flops"] == 0
               for r in c["buckets"])
    assert [r["sent_bytes"] for r in rep["ranks"]] == list(s.index_sent)
    assert [r["collective_s"] for r in rep["ranks"]] == [round(x, 9) for x in s.index_seconds]
    t = c["totals"]
    assert (t["predicted_s"], t["zero1_s"]) == (round(s.seconds, 9), round(s.zero1_seconds, 9))
    assert (t["max_sent_bytes"], t["zero1_max_sent_bytes"]) == (s.max_sent, s.zero1_max_sent)
    # The plan's comm section, restated, and what the recomputation gives agree.
    assert {k: c[k] for k in p.comm.model_dump()} == p.comm.model_dump()
    assert t["predicted_s"] == p.comm.predicted_s and t["max_sent_bytes"] == p.comm.max_sent_bytes
    assert c["time_ratio"] == round(p.comm.predicted_s / p.comm.zero1_s, 6)
    assert c["bytes_ratio"] == round(p.comm.max_sent_bytes / p.comm.zero1_max_sent_bytes, 6)
    # Every baseline has its communication figures; canzona's are the plan's.
    rows = {r["name"]: r for r in rep["baselines"]}
    assert all(r["max_sent_bytes"] > 0 and r["collective_s"] > 0 for r in rows.values())
    assert rows["canzona"]["collective_s"] == p.comm.predicted_s
    assert rows["canzona"]["max_sent_bytes"] == p.comm.max_sent_bytes
    assert rows["zero1"]["collective_s"] == rows["asc"]["collective_s"] == p.comm.zero1_s
    assert rows["zero1"]["max_sent_bytes"] == p.comm.zero1_max_sent_bytes
    assert rows["layerwise"]["max_sent_bytes"] > 1.3 * rows["zero1"]["max_sent_bytes"]
    assert rows["megatron-packed"]["padding"] >= 0
    assert all(r["padding"] is None for n, r in rows.items() if n != "megatron-packed")


# --- megatron-packed ---------------------------------------------------------------------------


def _packed_problems():
    from canzona.planner import build_inventory
    from canzona.planner.models import ModelConfig
    from canzona.planner.planning import make_problem

    moe = ModelConfig(name="tiny-moe", arch="qwen3_moe", hidden=256, ffn=0, layers=4, q_heads=4,
                      kv_heads=2, head_dim=64, vocab=1000, tied_embeddings=False, qk_norm=True,
                      num_experts=8, experts_per_token=2, moe_ffn=128)
    q = build_inventory(get_preset("qwen3-0.6b"))
    return [make_problem(q, ParallelSizes(8, 1)),  # Megatron's default bucket size
            make_problem(q, ParallelSizes(6, 2), bucket_size=7_000_000),
            make_problem(q, ParallelSizes(4, 1), overlap_grad_reduce=False),
            make_problem(build_inventory(moe), ParallelSizes(4, 1, ep=2), bucket_size=100_000)]


@pytest.mark.parametrize("k", range(4))
def test_megatron_packed_places_every_matrix_whole_in_padded_even_shards(k):
    import math

    from canzona.planner.baselines import PADDING_FLOOR, megatron_packed

    problem = _packed_problems()[k]
    packed = megatron_packed(problem)
    assert packed == megatron_packed(problem)  # deterministic
    mats = {(bi, ii) for bi, b in enumerate(problem.buckets) for ii, it in enumerate(b.items)
            if it.atomic}
    placed = [ref for b in packed.buckets for shard in b.shards for ref in shard]
    assert sorted(placed) == sorted(mats)  # every matrix exactly once, whole
    last, largest = {}, {}
    for n, b in enumerate(packed.buckets):
        buf = problem.layout.buffers[b.buffer]
        assert b.ranks == buf.dp_size and len(b.fill) == b.ranks
        assert packed.slices[n].sizes == (b.shard,) * b.ranks  # even collectives
        # a valid Megatron bucket: R·shard divisible by lcm(R, 128), shard starts 64-aligned
        assert b.numel % math.lcm(b.ranks, 128) == 0 and b.shard % 64 == 0
        assert max(b.fill) <= b.shard
        if not b.matrix:
            assert b.shards == () and b.unpadded <= b.numel
            continue
        last[b.buffer] = n
        sizes = []
        for r, shard in enumerate(b.shards):
            end = 0
            for bi, ii in shard:
                it = problem.buckets[bi].items[ii]
                assert problem.buckets[bi].buffer == b.buffer  # stays in its buffer
                end = -(-end // 64) * 64 + it.end - it.start
                sizes.append(it.end - it.start)
            assert end == b.fill[r]
        assert b.unpadded == sum(sizes)
        largest[n] = max(sizes)
    # Megatron's padding floor: every bucket but a buffer's last holds ≥ 0.9·R·its largest
    # matrix, so the padding that matrix forces is ≤ 1/0.9 - 1 ≈ 11 %.
    checked = 0
    for n, b in enumerate(packed.buckets):
        if b.matrix and n != last[b.buffer] and problem.layout.bucket_size is not None:
            checked += 1
            assert b.unpadded >= int(PADDING_FLOOR * b.ranks * largest[n])
            assert b.ranks * largest[n] <= b.unpadded / PADDING_FLOOR + b.ranks
    assert checked or problem.layout.bucket_size is None
    unpadded = sum(b.unpadded for b in packed.buckets if b.matrix)
    assert packed.padding == pytest.approx(
        sum(b.numel for b in packed.buckets if b.matrix) / unpadded - 1)
    # The same total work over the same DP indices.
    assert sum(packed.load) == problem.total_load()
    assert sum(packed.flops) == sum(c.flops for c in problem.costs)
    assert len(packed.load) == problem.dp


def test_megatron_packed_row_uses_even_collectives_over_the_padded_buckets():
    from canzona.planner import comm
    from canzona.planner.baselines import megatron_packed, problem_link
    from canzona.planner.strategies import baseline_rows

    problem = _packed_problems()[1]
    rows = {r.name: r for r in baseline_rows(problem)}
    link = problem_link(problem)
    packed = megatron_packed(problem)
    per_bucket = [comm.bucket_comm("equal", s.sizes, grad_bytes=s.grad_bytes,
                                   param_bytes=s.param_bytes, link=link) for s in packed.slices]
    row = rows["megatron-packed"]
    assert row.max_sent_bytes == sum(c.sent[0] for c in per_bucket)
    assert row.collective_s == pytest.approx(sum(c.seconds for c in per_bucket))
    assert row.load == packed.load and row.padding == packed.padding
    assert row.split_matrices == 0 and row.grad_sync == "reduce-scatter"
    # ZeRO-1's even collectives move the fewest bytes of all.
    assert row.max_sent_bytes >= rows["zero1"].max_sent_bytes
    assert rows["layerwise"].max_sent_bytes > rows["zero1"].max_sent_bytes
