"""Fixtures and import path of the runtime tests."""

import sys
from pathlib import Path

# The helper modules here (dp_helpers, tp_helpers, megatron_forward) are imported by name from
# every folder under tests/runtime and in the spawned ranks too (they unpickle their functions).
sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tp_world4(tmp_path_factory):
    """Every 4-rank TP case (Megatron-style shards and DTensor models) in ONE spawn."""
    import dp_helpers as H
    import test_tp_dtensor
    import test_tp_runtime

    cases = test_tp_runtime.cases4(str(tmp_path_factory.mktemp("tp4-ck"))) + \
        test_tp_dtensor.cases()
    return H.run_world(4, cases, str(tmp_path_factory.mktemp("tp4")))


@pytest.fixture(scope="session")
def fsdp2_world4(tmp_path_factory):
    """Every 4-rank FSDP2 case (training and checkpoints) in ONE spawn."""
    import dp_helpers as H
    import test_fsdp2
    import test_fsdp2_checkpoint

    cases = test_fsdp2.CASES + \
        test_fsdp2_checkpoint.cases(str(tmp_path_factory.mktemp("fsdp2-ck")))
    names = [name for name, _ in cases]
    assert len(set(names)) == len(names), "FSDP2 case names must be unique across the modules"
    return H.run_world(4, cases, str(tmp_path_factory.mktemp("fsdp2")))
