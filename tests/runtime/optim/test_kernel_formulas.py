"""The planner's formulas on their own: validated and internally consistent (torch-free imports:
tests/test_torch_free.py)."""

from __future__ import annotations

import pytest

from canzona.planner import formulas


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: formulas.muon_flops(0, 4), "m"),
        (lambda: formulas.muon_flops(4, -1), "n"),
        (lambda: formulas.muon_flops(4, 4, ns_steps=0), "ns_steps"),
        (lambda: formulas.shampoo_flops(4, 4, max_preconditioner_dim=0), "max_preconditioner_dim"),
        (
            lambda: formulas.shampoo_flops(4, 4, precondition_frequency=2.0),
            "precondition_frequency",
        ),
        (lambda: formulas.soap_flops(4, True), "n"),
        (lambda: formulas.soap_state_numel(4, 4, max_precond_dim=-3), "max_precond_dim"),
        (lambda: formulas.adamw_flops(0), "numel"),
        (lambda: formulas.adamw_state_numel(1.5), "numel"),
        (lambda: formulas.shampoo_state_numel("8", 4), "m"),
    ],
)
def test_formulas_reject_non_positive_ints(call, argument):
    with pytest.raises(ValueError, match=rf"^{argument} must be a positive int"):
        call()


def test_shampoo_blocks_cover_the_matrix():
    assert formulas.block_sizes(2500, 1024) == [1024, 1024, 452]
    assert formulas.block_sizes(1024, 1024) == [1024]
    # Per block: 4k1²k2 + 4k1k2²; a 2048×1024 matrix is two 1024² blocks.
    assert formulas.shampoo_flops(2048, 1024, amortised=False) == 2 * 8 * 1024**3
    assert (
        formulas.shampoo_flops(2048, 1024, precondition_frequency=1)
        == 2 * 8 * 1024**3 + 2 * 22 * 1024**3
    )
