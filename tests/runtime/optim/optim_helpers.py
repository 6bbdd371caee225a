"""Helpers of the optimizer-kernel tests (a uniquely named module, importable from the tests)."""

from __future__ import annotations


def rel_err(a, b) -> float:
    """Frobenius relative error of a against the reference b, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))
