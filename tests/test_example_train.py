"""examples/train_gpt.py end to end under torchrun (2 gloo ranks), as the README runs it.

An example that tears down with collectives still running can end with "terminate called
without an active exception" (SIGABRT, torchrun's ChildFailedError) after all its steps. Two
runs (Muon with gradient accumulation, SOAP without) must each exit 0 with a falling loss; the
runs by hand before a release repeat it more often. About 5 s a run, almost all of it process
start-up.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

RUNS = [("muon", 2), ("soap", 1)]


@pytest.mark.parametrize(("optimizer", "accum"), RUNS, ids=[f"{o}-accum{a}" for o, a in RUNS])
def test_example_trains_and_exits_cleanly(optimizer, accum, examples):
    losses = examples.losses("train_gpt.py", 2, "--optimizer", optimizer, "--accum", str(accum),
                             "--steps", "12", timeout=180)
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"


def test_example_checkpoint_resumes_under_the_same_and_another_plan(tmp_path, examples):
    """``--checkpoint`` then ``--resume``: on 2 ranks the last loss is the uninterrupted run's
    (one that saves along the way: saving changes nothing); on 1 rank (another plan) it resumes
    at the saved step."""

    def _run(nproc, *args):
        return examples.stdout("train_gpt.py", nproc, *args, timeout=180)

    ck = str(tmp_path / "ck")
    whole = first = _run(2, "--steps", "8", "--checkpoint", ck, "--save-every", "5")
    assert f"saved {ck} at step 5" in first
    again = _run(2, "--steps", "8", "--resume", ck)  # ck holds step 8 now: nothing left to do
    assert f"resumed from {ck} at step 8" in again
    _run(2, "--steps", "8", "--checkpoint", ck, "--stop-at", "5")
    resumed = _run(2, "--steps", "8", "--resume", ck)
    assert f"resumed from {ck} at step 5" in resumed

    def last_loss(out):
        return re.findall(r"^step\s+7\s+loss (\S+)", out, re.M)

    assert last_loss(resumed) == last_loss(whole) != []
    other = _run(1, "--steps", "7", "--resume", ck)
    assert f"resumed from {ck} at step 5" in other and re.search(r"^step\s+6\s+loss", other, re.M)


def test_tp_example_shares_matrices_over_the_tp_group(examples):
    """examples/train_tp.py at dp 2 × tp 2 with every Muon matrix shared by its TP group (the
    symmetric Gram and polynomial over DTensor shards), and with the column-parallel ones
    shared by both DP indices' TP groups (``--share pairs``, k = 2·tp): nothing gathered, and
    the same losses either way (bf16 Newton–Schulz: to 2e-3). Each equals one process in
    ``tests/runtime/test_tp_runtime.py`` (``muon_shared*``, ``muon_tp_pairs``)."""
    shared = examples.stdout("train_tp.py", 4, "--tp", "2", "--steps", "12",
                             "--share", "all-split", timeout=240)
    pairs = examples.stdout("train_tp.py", 4, "--tp", "2", "--steps", "12",
                            "--share", "pairs", timeout=240)
    assert "micro-groups per DP index [0, 0], matrices shared by the TP group [7, 7]" in shared
    assert re.search(r"micro-groups per DP index \[0, 0\], matrices shared by the TP group "
                     r"\[\d+, \d+\] \([1-9]\d* of them with the partner DP index's", pairs), pairs
    got = [[float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)", out, re.M)]
           for out in (shared, pairs)]
    assert len(got[0]) == len(got[1]) >= 2 and all(g[-1] < g[0] for g in got)
    assert max(abs(a - b) for a, b in zip(*got)) < 2e-3, got


def test_tp_example_preconditions_shampoo_blocks_shard_by_shard(examples):
    """examples/train_tp.py with Shampoo and blocks of 16: every TP shard is whole blocks, so
    each rank preconditions its own (nothing gathered) and the loss falls. That it equals one
    process: ``tests/runtime/test_tp_runtime.py`` (``shampoo_shard_blocks``)."""
    shard = examples.stdout("train_tp.py", 4, "--tp", "2", "--steps", "10", "--optimizer",
                            "shampoo", "--block", "16", "--share", "all", timeout=240)
    assert "micro-groups per DP index [0, 0], matrices shared by the TP group [7, 7]" in shard
    got = [float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)", shard, re.M)]
    assert len(got) >= 2 and got[-1] < got[0]


def test_pipeline_example_trains_and_exits_cleanly(examples):
    """examples/train_pipeline.py: pp 2 with ``torch.distributed.pipelining`` (1F1B) and tied
    embeddings (on 2 ranks, dp 1; the README's 4 ranks add the DP group, which
    ``tests/runtime/test_pipeline.py`` runs): exit 0 and a falling loss."""
    losses = examples.losses("train_pipeline.py", 2, "--steps", "4", timeout=240)
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"


def test_fsdp2_example_trains_a_fully_shard_model(examples):
    """examples/train_fsdp2.py: a ``fully_shard``-ed GPT at dp 2, planned for FSDP2's storage
    (owners and all-to-all rounds); exact against one process in
    ``tests/runtime/test_fsdp2.py``."""
    losses = examples.losses("train_fsdp2.py", 2, "--steps", "21", timeout=180)
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
