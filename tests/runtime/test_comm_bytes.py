"""Bytes a rank sends per step, per collective method, against hand-computed values."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from canzona.runtime.accounting import comm_bytes  # noqa: E402

SIZES = (30, 10, 0, 20)  # four ranks' slices of one bucket (60 elements); rank 2 owns nothing


@pytest.mark.parametrize("method,rank,reduce,gather", [
    ("padded", 1, 3 * 30 * 4, 3 * 30 * 2),      # R-1 blocks of the largest slice
    ("all_to_all", 1, (60 - 10) * 4, 3 * 10 * 2),  # the others' slices; own slice to 3 ranks
    ("per_root", 0, (60 - 30) * 4, 3 * 30 * 2),   # the same direct sends, one call per owner
    ("per_root", 2, 60 * 4, 0),                    # an empty owner broadcasts nothing
    ("all_reduce", 3, 2 * 3 * 60 // 4 * 4, 3 * 20 * 2),  # ring: 2(R-1)/R of the bucket
])
def test_bytes_per_method(method, rank, reduce, gather):
    got = comm_bytes([method], [SIZES], rank, grad_bytes=[4], param_bytes=[2], external=False)
    assert got == {"reduce_scatter": reduce, "all_gather": gather}


def test_external_reduces_nothing_and_dp1_sends_nothing():
    assert comm_bytes(["per_root"], [SIZES], 0, grad_bytes=[4], param_bytes=[2],
                      external=True)["reduce_scatter"] == 0
    assert comm_bytes(["local"], [(60,)], 0, grad_bytes=[4], param_bytes=[2],
                      external=False) == {"reduce_scatter": 0, "all_gather": 0}
