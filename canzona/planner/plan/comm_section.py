"""The plan's ``comm`` section (:func:`comm_section`: the profile and link used, and what the
buckets' methods predict against ZeRO-1) and a saved plan's buckets under their recorded methods
(:func:`plan_summary`), both from the communication model (:mod:`canzona.planner.comm`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..comm import (METHODS, BucketSlices, CommSummary, buffer_slices, plan_link, summarise)
from ..hardware import HardwareProfile, LinkProfile
from .schema import CommPlan, Plan

__all__ = ["comm_section", "plan_summary"]


def comm_section(slices: Sequence[BucketSlices], methods: Sequence[str], hw: HardwareProfile, *,
                 dp: int, tp: int, converted_from: int | None = None) -> CommPlan:
    """The plan's ``comm`` section: the profile and link used, and what ``methods`` (one per
    bucket) predict against ZeRO-1."""
    name, link = plan_link(hw, dp, tp)
    s = summarise(slices, dp, link, methods)
    counts: dict[str, int] = {}
    for m in methods:
        counts[m] = counts.get(m, 0) + 1
    return CommPlan(hardware=hw.name, hardware_version=hw.version, gpus_per_node=hw.gpus_per_node,
                    link=name, busbw=link.busbw, latency_s=link.latency_s,  # type: ignore[arg-type]
                    predicted_s=round(s.seconds, 9), zero1_s=round(s.zero1_seconds, 9),
                    max_sent_bytes=s.max_sent, zero1_max_sent_bytes=s.zero1_max_sent,
                    methods={m: counts[m] for m in METHODS if m in counts},
                    converted_from=converted_from)


def plan_summary(plan: Plan, link: LinkProfile | None = None) -> CommSummary:
    """Every bucket of ``plan`` under its recorded method, on ``link`` (default: the link the
    plan recorded)."""
    link = link or LinkProfile(busbw=plan.comm.busbw, latency_s=plan.comm.latency_s)
    methods = [b.method for buf in plan.buffers for b in buf.buckets]
    return summarise(buffer_slices(plan.buffers, plan.inputs.ep, tp=plan.inputs.tp,
                                   etp=plan.inputs.etp), plan.inputs.dp, link, methods)
