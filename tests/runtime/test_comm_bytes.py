"""Bytes a rank sends per step, per collective method, against hand-computed values.

``comm_bytes`` counts with the planner's communication model (``canzona.planner.comm``): a ring
reduce-scatter / all-gather sends (R-1)·max; a chain reduce to root r (r+1 → … → r) is sent by
every rank but r, a chain broadcast from r (r → … → r-1) by every rank but the tail r-1; a ring
all-reduce sends 2(R-1)/R of the bucket; all_to_all sends the others' slices (reduce) and the own
slice to every other rank (gather).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from canzona.planner import comm  # noqa: E402
from canzona.runtime.accounting import comm_bytes  # noqa: E402

SIZES = (30, 10, 0, 20)  # four ranks' slices of one bucket (60 elements); rank 2 owns nothing
EVEN = (15, 15, 15, 15)


@pytest.mark.parametrize("method,sizes,rank,reduce,gather", [
    ("padded", SIZES, 1, 3 * 30 * 4, 3 * 30 * 2),       # R-1 blocks of the largest slice
    ("equal", EVEN, 0, 3 * 15 * 4, 3 * 15 * 2),          # the same ring on equal slices
    ("all_to_all", SIZES, 1, (60 - 10) * 4, 3 * 10 * 2),  # the others' slices; own slice to 3
    # per_root, roots 0, 1, 3 (rank 2's empty slice has no call). Rank 0 is quiet in the reduce
    # to itself and is the tail (r-1) of the broadcast from root 1:
    ("per_root", SIZES, 0, (10 + 20) * 4, (30 + 20) * 2),
    # rank 2 is no root: it forwards every reduce chain; it is the tail of root 3's broadcast
    # (an empty owner still relays the others' slices)
    ("per_root", SIZES, 2, 60 * 4, (30 + 10) * 2),
    # rank 3: quiet in its own reduce; the tail of root 0's broadcast
    ("per_root", SIZES, 3, (30 + 10) * 4, (10 + 20) * 2),
    # ring all-reduce: 2(R-1)/R of the bucket; the gather per root, as per_root (rank 3: 60)
    ("all_reduce", SIZES, 3, 2 * 3 * 60 // 4 * 4, (10 + 20) * 2),
])
def test_bytes_per_method(method, sizes, rank, reduce, gather):
    got = comm_bytes([method], [sizes], rank, grad_bytes=[4], param_bytes=[2], external=False)
    assert got == {"reduce_scatter": reduce, "all_gather": gather}


@pytest.mark.parametrize("method", comm.METHODS[1:])
def test_the_planner_model_is_the_one_model(method):
    for rank in range(4):
        got = comm_bytes([method], [SIZES], rank, grad_bytes=[4], param_bytes=[2], external=False)
        assert got == {"reduce_scatter": comm.reduce_traffic(method, SIZES, 4).sent[rank],
                       "all_gather": comm.gather_traffic(method, SIZES, 2).sent[rank]}


def test_buckets_add_up_with_their_own_element_sizes():
    # rank 2: bucket 0 padded, fp32 grads, bf16 params: 3·30·4 = 360 and 3·30·2 = 180;
    # bucket 1 per_root on equal slices, bf16 both: the reduce sent by all but the root 2,
    # (15+15+15)·2 = 90; rank 2 is the tail of root 3's broadcast: (15+15+15)·2 = 90.
    got = comm_bytes(["padded", "per_root"], [SIZES, EVEN], 2, grad_bytes=[4, 2],
                     param_bytes=[2, 2], external=False)
    assert got == {"reduce_scatter": 360 + 90, "all_gather": 180 + 90}


def test_external_reduces_nothing_and_dp1_sends_nothing():
    got = comm_bytes(["per_root"], [SIZES], 0, grad_bytes=[4], param_bytes=[2], external=True)
    assert got == {"reduce_scatter": 0, "all_gather": (30 + 20) * 2}
    assert comm_bytes(["local"], [(60,)], 0, grad_bytes=[4], param_bytes=[2],
                      external=False) == {"reduce_scatter": 0, "all_gather": 0}


def test_equal_refuses_unequal_slices():
    with pytest.raises(ValueError, match="'equal' needs equal slices"):
        comm_bytes(["equal"], [SIZES], 0, grad_bytes=[4], param_bytes=[2], external=False)


def test_the_runtime_collectives_are_the_planners_methods():
    """One spelling of the methods: the runtime has one collective class per name in
    ``comm.METHODS`` and lists them in the planner's order."""
    from canzona.runtime.storage import collectives

    assert collectives.METHODS == comm.METHODS
    assert tuple(collectives._METHODS) == comm.METHODS
    assert all(cls.method == name for name, cls in collectives._METHODS.items())
