"""A rank that stops calling ``step()`` makes the others fail early and catchably: with
``collective_timeout`` a waiting rank raises ``CollectiveTimeoutError`` naming
the collective (and its bucket or micro-group) within about that many seconds (gloo), instead of
hanging for the process group's timeout. Its own spawn: the group is not usable afterwards.

The stopped rank runs its backward first: gloo runs the reduce-scatters that backward launches
partly on the launching thread, so a rank that never starts backward blocks its peers inside
their backward, where only the group's own timeout ends the wait."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import pytest
import torch

from dp_helpers import ADAMW_LR, LR, TinyGPT, batch, init_gloo, loss_fn, rendezvous, rows

TIMEOUT_S = 0.5


def _worker(rank: int, world: int, init_method: str, out: str) -> None:
    # the group's own timeout is long: only collective_timeout can end the wait early
    init_gloo(rank, world, init_method, timeout_s=120)
    import canzona
    from canzona.runtime.errors import CollectiveTimeoutError

    result: dict = {}
    try:
        model = TinyGPT(spare=False)
        plan = canzona.plan_model(model, dp=world, bucket_size=3000)
        opt = canzona.CanzonaOptimizer(model, plan, lr=LR, ns_dtype=torch.float32,
                                       adamw_lr=ADAMW_LR, collective_timeout=TIMEOUT_S,
                                       flight_record=os.path.join(out, "flight"))
        mine = rows(rank, world)
        for step in range(2):
            x, y = batch(step, 0, world)
            loss_fn(model, x[mine], y[mine]).backward()
            if step == 1 and rank == 1:
                time.sleep(2 * TIMEOUT_S + 2)  # a rank that stopped after backward: no step
                result["stopped"] = True
                break
            t0 = time.perf_counter()
            try:
                opt.step()
                result[f"step{step}"] = "ok"
            except CollectiveTimeoutError as exc:
                result[f"step{step}"] = ("timeout", str(exc), time.perf_counter() - t0)
                # what NCCL's watchdog would leave: the process lives on a while, its flight
                # file names what it waits for
                time.sleep(4 * opt._flight.interval_s)
                break
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the group is broken after a timeout: no barrier, no destroy


def test_a_stopped_rank_fails_the_others_within_the_timeout(tmp_path):
    from canzona.runtime.optimizer import CanzonaOptimizer

    torch.multiprocessing.start_processes(
        _worker, args=(2, rendezvous(str(tmp_path)), str(tmp_path)), nprocs=2, join=True,
        start_method="forkserver")
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["step0"] == r1["step0"] == "ok" and r1["stopped"]
    kind, message, waited = r0["step1"]
    assert kind == "timeout"
    # the first collective of step() that the stopped rank never joins: the flags all-reduce
    assert "rank 0" in message and "all-reduce" in message and "collective_timeout" in message
    assert TIMEOUT_S * 0.9 <= waited <= TIMEOUT_S + 3.0, waited  # early, not the group's 120 s
    # the flight record (flight_record=): rank 0's file names the collective still in flight
    flight = json.loads((tmp_path / "flight" / "canzona-flight-rank0.json").read_text())
    assert flight["rank"] == 0 and flight["dp_rank"] == 0
    assert any("all-reduce of the per-parameter gradient flags" in w
               for w in flight["in_flight"]), flight
    assert not any("Bucket(" in w for w in flight["in_flight"])
    with pytest.raises(ValueError, match="collective_timeout"):
        CanzonaOptimizer(TinyGPT(), None, collective_timeout=0)  # checked before anything else


class _Slow:
    """A work handle taking ``seconds``; a wait shorter than that raises as gloo's does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.given: list[float] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.given.append(timeout.total_seconds())
        if timeout.total_seconds() < self.seconds:
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Timed out waiting for the work")
        time.sleep(self.seconds)
        return True


def test_several_stages_share_one_timeout():
    # a TPPair sum is three stages (TP reduce-scatter, partner exchange, TP all-gather), each a
    # handle: the timeout is for them all, each stage waits only for what the ones before it left
    from canzona.runtime.waits import wait_within
    from canzona.runtime.optim.transports import _Then

    stages = [_Slow(0.2), _Slow(0.2), _Slow(0.2)]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out"):
        wait_within(stages, timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 0.65  # one budget, not 0.5 s per stage
    assert stages[1].given[0] < 0.35 and stages[2].given[0] < 0.15
    first, second = _Slow(0.3), _Slow(0.3)
    chained = _Then(first, lambda: second)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out"):
        chained.wait(timeout=timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 0.65 and second.given[0] < 0.25
    ok = [_Slow(0.01), _Slow(0.01)]
    wait_within(ok, timedelta(seconds=1))
    assert all(len(w.given) == 1 for w in ok)
