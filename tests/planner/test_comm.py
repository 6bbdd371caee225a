"""The communication model (canzona.planner.comm) against numbers worked by hand.

Every expected value below is written out from the formulas of the module docstring, not
computed by the module: ring reduce-scatter / all-gather (equal, padded) move (R-1)·max·e bytes
through every rank; a chain reduce to root r (r+1 → … → r) has every rank but r send s_r·e and
every rank but the head r+1 receive it; a chain broadcast from r (r → … → r-1) has every rank but
the tail r-1 send and every rank but r receive; a ring all-reduce moves 2(R-1)/R·S·e (floored);
all_to_all's reduce sends (S - s_m)·e and receives (R-1)·s_m·e, its gather the reverse. Time is
``calls·α + busiest/busbw``.
"""

from __future__ import annotations

import json

import pytest

from canzona.planner import ParallelSizes
from canzona.planner import comm
from canzona.planner.errors import CanzonaError
from canzona.planner.hardware import DEFAULT_HARDWARE, HardwareProfile, LinkProfile, load_hardware
from canzona.planner.options import DPOptions
from canzona.planner.pipeline import plan as make_plan
from canzona.planner.plan import Plan
from canzona.planner.plan.comm_section import comm_section
from canzona.planner.plan.load import load_plan

#: α = 0.5 s, 100 bytes/s: a call costs 0.5 s and every 100 bytes through the busiest rank 1 s.
LINK = LinkProfile(busbw=100.0, latency_s=0.5)
UNEVEN = (3, 0, 5)  # R = 3, S = 8, max 5; rank 1 owns nothing
EVEN = (4, 4, 4, 4)  # R = 4, S = 16


def T(calls, sent, received):
    return comm.Traffic(calls, tuple(sent), tuple(received))


# --- bytes per rank ----------------------------------------------------------------------------

# (3, 0, 5), 2 bytes per element:
#   ring:  ·max·e = 2·5·2 = 20 through every rank, one call.
#   chain reduce, roots 0 and 2 (rank 1's empty slice has no call):
#     root 0 (6 bytes): 1 → 2 → 0: senders 1, 2; receivers 2, 0
#     root 2 (10 bytes): 0 → 1 → 2: senders 0, 1; receivers 1, 2
#     sent (10, 6+10, 6) = (10, 16, 6); received (6, 10, 6+10) = (6, 10, 16)
#   chain broadcast:
#     root 0 (6): 0 → 1 → 2: senders 0, 1; receivers 1, 2
#     root 2 (10): 2 → 0 → 1: senders 2, 0; receivers 0, 1
#     sent (6+10, 6, 10) = (16, 6, 10); received (10, 6+10, 6) = (10, 16, 6)
#   all-reduce: 2·(R-1)·S·e // R = 2·2·8·2 // 3 = 64 // 3 = 21
#   all_to_all reduce: sent (S-s)·e = (5·2, 8·2, 3·2) = (10, 16, 6);
#                      received ·s·e = (2·3·2, 0, 2·5·2) = (12, 0, 20)
UNEVEN_REDUCE = {
    "padded": T(1, (20, 20, 20), (20, 20, 20)),
    "per_root": T(2, (10, 16, 6), (6, 10, 16)),
    "all_reduce": T(1, (21, 21, 21), (21, 21, 21)),
    "all_to_all": T(1, (10, 16, 6), (12, 0, 20)),
}
UNEVEN_GATHER = {
    "padded": T(1, (20, 20, 20), (20, 20, 20)),
    "per_root": T(2, (16, 6, 10), (10, 16, 6)),
    "all_reduce": T(2, (16, 6, 10), (10, 16, 6)),  # the gather per root
    "all_to_all": T(1, (12, 0, 20), (10, 16, 6)),
}
# busiest and seconds (α = 0.5, busbw = 100):
#   padded 20 → 0.5 + 0.2 = 0.7 (both)
#   per_root reduce 16 → 2·0.5 + 0.16 = 1.16; gather 16 → 1.16
#   all_reduce reduce 21 → 0.5 + 0.21 = 0.71; gather as per_root 1.16
#   all_to_all reduce 20 → 0.7; gather 20 → 0.7
UNEVEN_SECONDS = {  # (reduce busiest, reduce s, gather busiest, gather s)
    "padded": (20, 0.7, 20, 0.7),
    "per_root": (16, 1.16, 16, 1.16),
    "all_reduce": (21, 0.71, 16, 1.16),
    "all_to_all": (20, 0.7, 20, 0.7),
}


@pytest.mark.parametrize("method", list(UNEVEN_REDUCE))
def test_uneven_slices_bytes_and_seconds(method):
    red = comm.reduce_traffic(method, UNEVEN, 2)
    gat = comm.gather_traffic(method, UNEVEN, 2)
    assert red == UNEVEN_REDUCE[method]
    assert gat == UNEVEN_GATHER[method]
    rb, rs, gb, gs = UNEVEN_SECONDS[method]
    assert (red.busiest, gat.busiest) == (rb, gb)
    assert red.seconds(LINK) == pytest.approx(rs)
    assert gat.seconds(LINK) == pytest.approx(gs)


# (4, 4, 4, 4), 4 bytes per element:
#   ring: 3·4·4 = 48 everywhere, one call
#   chain (reduce or broadcast): 4 roots of 16 bytes; every rank is quiet as a sender once and
#     as a receiver once: 3·16 = 48 sent and received everywhere, 4 calls
#   all-reduce: 2·3·16·4 // 4 = 96
#   all_to_all: sent (16-4)·4 = 48, received 3·4·4 = 48
EVEN_REDUCE = {
    "equal": T(1, (48,) * 4, (48,) * 4),
    "padded": T(1, (48,) * 4, (48,) * 4),
    "per_root": T(4, (48,) * 4, (48,) * 4),
    "all_reduce": T(1, (96,) * 4, (96,) * 4),
    "all_to_all": T(1, (48,) * 4, (48,) * 4),
}
EVEN_GATHER = {**EVEN_REDUCE, "all_reduce": T(4, (48,) * 4, (48,) * 4)}
#   seconds: ring 0.5 + 0.48 = 0.98; chain 4·0.5 + 0.48 = 2.48; all-reduce 0.5 + 0.96 = 1.46
EVEN_SECONDS = {"equal": (0.98, 0.98), "padded": (0.98, 0.98), "per_root": (2.48, 2.48),
                "all_reduce": (1.46, 2.48), "all_to_all": (0.98, 0.98)}


@pytest.mark.parametrize("method", list(EVEN_REDUCE))
def test_equal_slices_bytes_and_seconds(method):
    red = comm.reduce_traffic(method, EVEN, 4)
    gat = comm.gather_traffic(method, EVEN, 4)
    assert red == EVEN_REDUCE[method]
    assert gat == EVEN_GATHER[method]
    assert (red.seconds(LINK), gat.seconds(LINK)) == pytest.approx(EVEN_SECONDS[method])


def test_bucket_comm_uses_grad_bytes_for_the_reduce_and_param_bytes_for_the_gather():
    # (3, 0, 5), fp32 grads, bf16 params, per_root: reduce as above ×2 (e = 4): sent
    # (20, 32, 12), busiest 32 → 1 + 0.32; gather (e = 2) busiest 16 → 1.16.
    c = comm.bucket_comm("per_root", UNEVEN, grad_bytes=4, param_bytes=2, link=LINK)
    assert c.method == "per_root"
    assert c.reduce == T(2, (20, 32, 12), (12, 20, 32))
    assert c.gather == T(2, (16, 6, 10), (10, 16, 6))
    assert c.seconds == pytest.approx(1.32 + 1.16)
    assert c.calls == 4
    assert c.sent == (20 + 16, 32 + 6, 12 + 10)


def test_equal_refuses_unequal_slices_and_unknown_methods():
    with pytest.raises(ValueError, match="'equal' needs equal slices, got \\[3, 0, 5\\]"):
        comm.reduce_traffic("equal", UNEVEN, 2)
    with pytest.raises(ValueError, match="'equal' needs equal slices"):
        comm.gather_traffic("equal", UNEVEN, 2)
    with pytest.raises(ValueError, match="method must be one of: equal, padded, per_root"):
        comm.reduce_traffic("ring", EVEN, 2)
    with pytest.raises(ValueError, match="none of the methods \\['equal'\\]"):
        comm.choose(UNEVEN, grad_bytes=4, param_bytes=4, link=LINK, methods=("equal",))


@pytest.mark.parametrize("method", comm.METHODS)
def test_one_rank_costs_nothing(method):
    for traffic in (comm.reduce_traffic(method, (7,), 4), comm.gather_traffic(method, (7,), 2)):
        assert traffic == T(0, (0,), (0,))
        assert traffic.busiest == 0 and traffic.seconds(LINK) == 0.0
    c = comm.bucket_comm(method, (7,), grad_bytes=4, param_bytes=2, link=LINK)
    assert c.seconds == 0.0 and c.calls == 0 and c.sent == (0,)
    assert comm.choose((7,), grad_bytes=4, param_bytes=2, link=LINK).seconds == 0.0


def test_empty_bucket_per_root_issues_no_call():
    # No non-empty owner: no reduce and no broadcast, so no α either.
    assert comm.reduce_traffic("per_root", (0, 0), 4) == T(0, (0, 0), (0, 0))
    assert comm.gather_traffic("per_root", (0, 0), 4).seconds(LINK) == 0.0


def test_link_seconds_is_alpha_plus_bytes_over_bandwidth():
    """The α–β time every collective of the planner is priced by: calls·α + bytes/busbw."""
    assert LINK.seconds(250) == 0.5 + 2.5
    assert LINK.seconds(250, calls=3) == 3 * 0.5 + 2.5
    assert LINK.seconds(0) == 0.5  # a call that moves nothing still pays α
    assert LINK.seconds(250, calls=0) == 0.0
    assert T(2, (100, 300), (300, 100)).seconds(LINK) == LINK.seconds(300, calls=2)


def test_all_to_all_busiest_counts_off_rank_elements_sent_or_received():
    # rank 0 sends 2 + 3 and receives 4 + 0; rank 1 sends 4 + 1, receives 2 + 6; rank 2 sends
    # 0 + 6, receives 3 + 1: the busiest moves 8 (rank 1's receipts); the diagonal is free.
    assert comm.all_to_all_busiest(((9, 2, 3), (4, 9, 1), (0, 6, 9))) == 8
    assert comm.all_to_all_busiest(((5, 0), (0, 7))) == 0


# --- choose -------------------------------------------------------------------------------------


def test_choose_equal_for_equal_slices():
    # (4, 4, 4, 4), fp32 grads, bf16 params (gather bytes halve: ring 3·4·2 = 24 → 0.74):
    #   equal      0.98 + 0.74 = 1.72
    #   all_to_all 0.98 + 0.74 = 1.72 (a tie: the earlier method, equal, is kept)
    #   all_reduce 1.46 + (4·0.5 + 0.24) = 3.70
    #   per_root   2.48 + 2.24 = 4.72
    #   padded     the same calls as equal: 1.72, a tie (equal, earlier, is kept)
    c = comm.choose(EVEN, grad_bytes=4, param_bytes=2, link=LINK)
    assert c.method == "equal" and c.seconds == pytest.approx(1.72)
    assert comm.methods_for(EVEN) == comm.METHODS
    padded = comm.choose(EVEN, grad_bytes=4, param_bytes=2, link=LINK, methods=("padded",))
    assert padded.method == "padded" and padded.seconds == pytest.approx(1.72)
    assert comm.methods_for(UNEVEN) == ("padded", "per_root", "all_reduce", "all_to_all")


def test_choose_padded_for_nearly_even_slices():
    # (5, 4, 4, 4), 4 bytes both ways, S = 17:
    #   padded: ring 3·5·4 = 60 → 0.5 + 0.6 = 1.1, twice: 2.2
    #   all_to_all: reduce sent (12, 13, 13, 13)·4 = (48, 52, 52, 52), received
    #     (15, 12, 12, 12)·4 = (60, 48, 48, 48): busiest 60 → 1.1; the gather mirrors it: 2.2,
    #     a tie with padded (the earlier, padded, wins)
    #   per_root: reduce, four roots of (20, 16, 16, 16) bytes; rank 1 sends all but its own
    #     root's 16: 20+16+16 = 52; busiest 52 → 4·0.5 + 0.52 = 2.52; gather likewise 2.52: 5.04
    #   all_reduce: 2·3·17·4 // 4 = 102 → 1.52, + per-root gather 2.52 = 4.04
    sizes = (5, 4, 4, 4)
    c = comm.choose(sizes, grad_bytes=4, param_bytes=4, link=LINK)
    assert c.method == "padded" and c.seconds == pytest.approx(2.2)
    every = {m: comm.bucket_comm(m, sizes, grad_bytes=4, param_bytes=4, link=LINK).seconds
             for m in comm.methods_for(sizes)}
    assert every == pytest.approx({"padded": 2.2, "all_to_all": 2.2, "per_root": 5.04,
                                   "all_reduce": 4.04})
    # Without padded, all_to_all is the fastest left.
    assert comm.choose(sizes, grad_bytes=4, param_bytes=4, link=LINK,
                       methods=("per_root", "all_reduce", "all_to_all")).method == "all_to_all"


def test_choose_per_root_for_very_uneven_slices_with_few_owners():
    # (600, 0, 0, 400), 4 bytes both ways: two owners.
    #   per_root reduce: root 0 (2400 B): senders 1, 2, 3, receivers 0, 2, 3;
    #     root 3 (1600 B): senders 0, 1, 2, receivers 1, 2, 3
    #     sent (1600, 4000, 4000, 2400), received (2400, 1600, 4000, 4000): busiest 4000
    #     → 2·0.5 + 40 = 41
    #   per_root broadcast: root 0: senders 0, 1, 2 (tail 3 quiet), receivers 1, 2, 3;
    #     root 3: senders 0, 1, 3 (tail 2 quiet), receivers 0, 1, 2
    #     sent (4000, 4000, 2400, 1600), received (1600, 4000, 4000, 2400) → 41; total 82
    #   padded: every rank moves 3 blocks of the largest, 3·600·4 = 7200 → 72.5, twice: 145
    #   all_reduce: 2·3·1000·4 // 4 = 6000 → 60.5, + per-root gather 41 = 101.5
    #   Few owners: per_root moves each slice about once, padded moves R-1 blocks of the max.
    sizes = (600, 0, 0, 400)
    c = comm.choose(sizes, grad_bytes=4, param_bytes=4, link=LINK)
    assert c.method == "per_root" and c.seconds == pytest.approx(82.0)
    assert c.reduce == T(2, (1600, 4000, 4000, 2400), (2400, 1600, 4000, 4000))
    assert c.gather == T(2, (4000, 4000, 2400, 1600), (1600, 4000, 4000, 2400))
    every = {m: comm.bucket_comm(m, sizes, grad_bytes=4, param_bytes=4, link=LINK).seconds
             for m in comm.methods_for(sizes)}
    assert every == pytest.approx({"per_root": 82.0, "padded": 145.0, "all_to_all": 145.0,
                                   "all_reduce": 101.5})


def test_latency_can_outweigh_bytes():
    # The same (600, 0, 0, 400) on a link where a call costs 100 s: per_root pays 4 calls
    # (4·100 + 40 + 40 = 480), padded 2 (2·100 + 72 + 72 = 344).
    slow = LinkProfile(busbw=100.0, latency_s=100.0)
    c = comm.choose((600, 0, 0, 400), grad_bytes=4, param_bytes=4, link=slow)
    assert c.method == "padded" and c.seconds == pytest.approx(344.0)


# --- ZeRO-1 and the link ------------------------------------------------------------------------


def test_zero1_is_the_even_split():
    assert comm.even_sizes(10, 4) == (3, 3, 2, 2)
    assert comm.even_sizes(8, 4) == (2, 2, 2, 2)
    # 10 over 4: (3, 3, 2, 2), padded: reduce 3·3·4 = 36 → 0.86; gather 3·3·2 = 18 → 0.68
    z = comm.zero1(10, 4, grad_bytes=4, param_bytes=2, link=LINK)
    assert z.method == "padded" and z.seconds == pytest.approx(0.86 + 0.68)
    assert z.reduce == T(1, (36,) * 4, (36,) * 4)
    # 8 over 4: equal; reduce 3·2·4 = 24 → 0.74; gather 12 → 0.62
    z = comm.zero1(8, 4, grad_bytes=4, param_bytes=2, link=LINK)
    assert z.method == "equal" and z.seconds == pytest.approx(1.36)


def test_plan_link_intra_node_when_the_group_fits_in_a_node():
    hw = load_hardware("h100")  # 8 GPUs per node
    assert hw.gpus_per_node == 8
    assert comm.plan_link(hw, 8, 1) == ("intra_node", hw.intra_node)
    assert comm.plan_link(hw, 4, 2) == ("intra_node", hw.intra_node)  # dp·tp = 8
    assert comm.plan_link(hw, 1, 8) == ("intra_node", hw.intra_node)
    assert comm.plan_link(hw, 16, 1) == ("inter_node", hw.inter_node)
    assert comm.plan_link(hw, 8, 2) == ("inter_node", hw.inter_node)  # dp·tp = 16
    assert comm.plan_link(hw, 3, 4)[0] == "inter_node"  # 12 > 8


def test_summarise_per_dp_index():
    # Two 2-rank buckets, fp32 both ways; the second's ranks are DP indices (1, 0).
    b1 = comm.BucketSlices((3, 1), 4, 4, (0, 1))
    b2 = comm.BucketSlices((2, 2), 4, 4, (1, 0))
    s = comm.summarise([b1, b2], 2, LINK, ["padded", "equal"])
    # b1 padded: 0.62 + 0.62 = 1.24, sent 12 + 12 per rank; b2 equal: ring 1·2·4 = 8 → 0.58 twice
    # = 1.16, sent 8 + 8. Both DP indices join both buckets.
    assert s.index_seconds == pytest.approx((2.4, 2.4))
    assert s.index_sent == (40, 40)
    assert s.seconds == pytest.approx(2.4) and s.max_sent == 40
    # ZeRO-1 of 4 elements over 2 ranks is equal (2, 2) for both: 1.16 each → 2.32, 16 + 16 sent
    assert s.zero1_seconds == pytest.approx(2.32) and s.zero1_max_sent == 32
    # None: each bucket's fastest. (3, 1): padded 1.24; all_to_all the same 1.24 (the tie goes
    # to padded); per_root: two one-hop chains, reduce sent (4, 12), received (12, 4) → 2·0.5 +
    # 0.12 = 1.12, the broadcast the same: 2.24; all_reduce 2·1·4·4 // 2 = 16 → 0.66 + 1.12 = 1.78.
    assert [line.comm.method for line in comm.summarise([b1, b2], 2, LINK).lines] == \
        ["padded", "equal"]


def test_buffer_slices_maps_expert_ranks_to_dp_indices():
    class B:  # the fields buffer_slices reads
        def __init__(self, cuts):
            self.cuts = cuts

    class Buf:
        def __init__(self, expert, ep_rank, buckets, dtype="bf16", grad_dtype="fp32"):
            self.expert, self.ep_rank, self.buckets = expert, ep_rank, buckets
            self.dtype, self.grad_dtype = dtype, grad_dtype

    got = comm.buffer_slices([Buf(False, None, [B((0, 3, 3, 8, 8))]),
                              Buf(True, 1, [B((0, 4, 6))])], ep=2)
    assert got == [comm.BucketSlices((3, 0, 5, 0), 4, 2, (0, 1, 2, 3)),
                   comm.BucketSlices((4, 2), 4, 2, (1, 3))]


# --- hardware profiles ----------------------------------------------------------------------------


def test_load_hardware_by_name():
    hw = load_hardware("h100")
    assert hw.name == "h100" and hw.gpus_per_node == 8
    assert hw.intra_node == LinkProfile(busbw=360e9, latency_s=1e-5)
    assert load_hardware("H100") == hw
    assert load_hardware(DEFAULT_HARDWARE) == hw


def test_load_hardware_from_a_file(tmp_path):
    data = {**load_hardware("h100").model_dump(mode="json"), "name": "mine", "version": 3,
            "gpus_per_node": 4, "intra_node": {"busbw": 100.0, "latency_s": 0.5}}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    for ref in (path, str(path)):
        hw = load_hardware(ref)
        assert isinstance(hw, HardwareProfile)
        assert (hw.name, hw.version, hw.gpus_per_node) == ("mine", 3, 4)
        assert hw.intra_node == LINK
    assert comm.plan_link(hw, 2, 2) == ("intra_node", LINK)
    assert comm.plan_link(hw, 8, 1)[0] == "inter_node"


def test_load_hardware_errors(tmp_path):
    with pytest.raises(CanzonaError,
                       match="unknown hardware profile 'a100'; choose one of: .*h100"):
        load_hardware("a100")
    with pytest.raises(CanzonaError, match="cannot read hardware profile '.*missing.json'"):
        load_hardware(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CanzonaError, match="is not JSON"):
        load_hardware(bad)
    data = load_hardware("h100").model_dump(mode="json")
    data["inter_node"]["busbw"] = -1
    bad.write_text(json.dumps(data))
    with pytest.raises(CanzonaError, match="is not valid: inter_node.busbw: .*greater than 0"):
        load_hardware(bad)
    del data["inter_node"]
    bad.write_text(json.dumps(data))
    with pytest.raises(CanzonaError, match="is not valid: inter_node: Field required"):
        load_hardware(bad)


# --- plans: the comm section and version-1 files --------------------------------------------------


@pytest.fixture(scope="module")
def qwen_plan() -> Plan:
    return make_plan("qwen3-0.6b", ParallelSizes(dp=4, tp=1),
                     dp_options=DPOptions(objective="max-load"))


def _slices(p: Plan) -> list[comm.BucketSlices]:
    return comm.buffer_slices(p.buffers, p.inputs.ep)


def test_plan_comm_section_agrees_with_summarise(qwen_plan):
    p = qwen_plan
    hw = load_hardware(p.comm.hardware)
    assert (p.comm.hardware, p.comm.hardware_version) == (hw.name, hw.version)
    name, link = comm.plan_link(hw, p.inputs.dp, p.inputs.tp)
    assert (p.comm.link, p.comm.busbw, p.comm.latency_s) == (name, link.busbw, link.latency_s)
    methods = [b.method for buf in p.buffers for b in buf.buckets]
    slices = _slices(p)
    # Every bucket's method is the fastest for its slices.
    assert methods == [comm.choose(s.sizes, grad_bytes=s.grad_bytes, param_bytes=s.param_bytes,
                                   link=link).method for s in slices]
    s = comm.summarise(slices, p.inputs.dp, link, methods)
    assert p.comm.predicted_s == round(s.seconds, 9)
    assert p.comm.zero1_s == round(s.zero1_seconds, 9)
    assert p.comm.max_sent_bytes == s.max_sent
    assert p.comm.zero1_max_sent_bytes == s.zero1_max_sent
    counts = {m: methods.count(m) for m in comm.METHODS if m in methods}
    assert p.comm.methods == counts and sum(counts.values()) == len(slices)
    assert p.comm.converted_from is None
    assert p.comm == comm_section(slices, methods, hw, dp=p.inputs.dp, tp=p.inputs.tp)


@pytest.mark.parametrize("dp,words", [(0, "rank_layout.dp is 0, must be ≥ 1"),
                                      (1, "its buckets do not fit rank_layout (dp 1")])
def test_version_1_plan_whose_layout_does_not_fit_is_refused(qwen_plan, refused_edit,
                                                             as_version_1, dp, words):
    """A version-1 plan is converted (its comm section computed from the buckets) before it is
    validated: a rank layout that does not fit its buckets is one clear line, not an IndexError
    (found by the plan fuzzer)."""
    assert qwen_plan.inputs.dp == 4
    v1 = as_version_1(qwen_plan.to_json())

    def edit(data: dict) -> None:
        data.clear()
        data.update(v1)
        data["rank_layout"]["dp"] = dp

    msg = refused_edit(qwen_plan, edit)
    assert words in msg and "schema version 1" in msg and "\n" not in msg


def test_version_1_plan_is_converted_on_load(qwen_plan, tmp_path, as_version_1):
    p = qwen_plan
    data = as_version_1(p.to_json())
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))

    got = load_plan(path)
    assert got.schema_version == 2
    assert got.comm.converted_from == 1
    assert got.inputs.solver.objective == "max-load"
    _, link = comm.plan_link(load_hardware(DEFAULT_HARDWARE), p.inputs.dp, p.inputs.tp)
    for s, b in zip(_slices(got), [b for buf in got.buffers for b in buf.buckets], strict=True):
        assert b.method == comm.choose(s.sizes, grad_bytes=s.grad_bytes,
                                       param_bytes=s.param_bytes, link=link).method
    assert got.comm.hardware == DEFAULT_HARDWARE
    # The rest is the original (made with the default profile and the max-load objective).
    assert got.model_copy(update={"comm": got.comm.model_copy(update={"converted_from": None})}) \
        == p
