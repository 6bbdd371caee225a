"""Helpers of the planner tests (a uniquely named module; tests/planner/conftest.py puts this
folder on the import path)."""

from __future__ import annotations


def scaled_hardware(hw, *, intra=1.0, inter=1.0, latency=1.0, flops=1.0, memory=1.0):
    """``hw`` with the intra- and inter-node bandwidths divided by ``intra`` and ``inter``, the
    latencies multiplied by ``latency``, peak FLOP/s and memory bandwidth divided by ``flops``
    and ``memory``."""
    def link(lp):
        return lp.model_copy(update={"busbw": lp.busbw / (intra if lp is hw.intra_node else inter),
                                     "latency_s": lp.latency_s * latency})
    return hw.model_copy(update={
        "intra_node": link(hw.intra_node), "inter_node": link(hw.inter_node),
        "peak_flops": {k: v / flops for k, v in hw.peak_flops.items()},
        "memory_bandwidth": hw.memory_bandwidth / memory})
