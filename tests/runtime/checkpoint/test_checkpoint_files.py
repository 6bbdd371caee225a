"""Checkpoints on one process: bad input refused before anything changes, crash safety (a saving
process killed at three points leaves the previous checkpoint loadable and the next save
recovers), fp32 main copies, and the recipe for calling DCP directly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402

import checkpoint_files_common as C  # noqa: E402

HERE = os.path.dirname(__file__)


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in b) and set(a) == set(b)


def _saved(tmp_path, name="ck", **kw):
    import canzona

    model, opt = C.build(**kw)
    C.train(model, opt, range(2))
    path = tmp_path / name
    canzona.save_checkpoint(path, model, opt)
    return path, model, opt


def test_resume_same_plan_bit_identical_with_main_copies(tmp_path, one_thread):
    import canzona

    ref_model, ref_opt = C.build(dtype=torch.bfloat16, main_params="fp32")
    C.train(ref_model, ref_opt, range(4))
    path, _, _ = _saved(tmp_path, dtype=torch.bfloat16, main_params="fp32")
    assert any(k.endswith(".main") for k in dcp.FileSystemReader(path).read_metadata()
               .state_dict_metadata)
    model, opt = C.build(seed=3, dtype=torch.bfloat16, main_params="fp32")
    canzona.load_checkpoint(path, model, opt)
    C.train(model, opt, range(2, 4))
    assert _equal(C.params(model), C.params(ref_model))


def test_checkpoint_without_main_copies_takes_them_from_the_weights(tmp_path, one_thread):
    import canzona

    path, saved_model, _ = _saved(tmp_path, dtype=torch.bfloat16)
    model, opt = C.build(seed=3, dtype=torch.bfloat16, main_params="fp32")
    canzona.load_checkpoint(path, model, opt)
    assert _equal(C.params(model), C.params(saved_model))
    for buf in opt._storage.buffers:
        if buf.main is not None:
            assert torch.equal(buf.main, buf.own_params.float())


def test_bad_inputs_refused_and_nothing_changes(tmp_path):
    import canzona
    from canzona.runtime.errors import CheckpointError

    path, _, _ = _saved(tmp_path)
    model, opt = C.build(seed=5)
    before = C.params(model)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        canzona.load_checkpoint(tmp_path / "nothing", model, opt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a complete canzona checkpoint"):
        canzona.load_checkpoint(tmp_path / "empty", model, opt)
    other, other_opt = C.build(optimizer="shampoo")
    with pytest.raises(CheckpointError, match="holds Muon state; this optimizer runs Shampoo"):
        canzona.load_checkpoint(path, other, other_opt)
    with pytest.raises(CheckpointError, match="no extra 'sched'"):
        canzona.load_checkpoint(path, model, opt, extra={"sched": {"x": 1}})
    with pytest.raises(CheckpointError, match="not the one the optimizer was built for"):
        canzona.load_checkpoint(path, torch.nn.Linear(2, 2), opt)
    assert _equal(C.params(model), before)


def test_other_shapes_named(tmp_path):
    import canzona
    from canzona.runtime.errors import CheckpointError

    import dp_helpers as H

    path, _, _ = _saved(tmp_path)
    old = H.VOCAB
    H.VOCAB = 96
    try:
        model, opt = C.build()
    finally:
        H.VOCAB = old
    with pytest.raises(CheckpointError, match=r"'model.wte.weight' is \[64, 32\] in the "
                                              r"checkpoint but \[96, 32\] here"):
        canzona.load_checkpoint(path, model, opt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_recipe(tmp_path, one_thread):
    import canzona

    model, opt = C.build()
    C.train(model, opt, range(2))
    st = canzona.dcp_state(model, opt)
    st.state_dict["trainer.step"] = torch.tensor(2)
    dcp.save(st.state_dict, checkpoint_id=tmp_path / "mine", planner=st.planner, no_dist=True)
    C.train(model, opt, range(2, 3))
    fresh, fresh_opt = C.build(seed=9)
    st = canzona.dcp_state(fresh, fresh_opt, load_from=tmp_path / "mine")
    step = torch.tensor(0)
    st.state_dict["trainer.step"] = step
    dcp.load(st.state_dict, checkpoint_id=tmp_path / "mine", planner=st.planner, no_dist=True)
    st.finish()
    assert int(step) == 2
    C.train(fresh, fresh_opt, range(2, 3))
    assert _equal(C.params(fresh), C.params(model))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["write", "meta", "publish"])
def test_killed_while_saving(tmp_path, point, one_thread):
    """A SIGKILL at any point of a save leaves the previous checkpoint loadable; the next save
    publishes cleanly."""
    import canzona

    # the worker imports checkpoint_files_common (here) and dp_helpers (tests/runtime)
    path = [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "checkpoint_crash_worker.py"),
                           str(tmp_path), point], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    after2 = torch.load(tmp_path / "after2.pt")
    model, opt = C.build(seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        canzona.load_checkpoint(tmp_path / "ck", model, opt)
    assert _equal(C.params(model), after2)
    assert (point == "publish") == any("interrupted" in str(w.message) for w in caught)
    # the resumed run continues as the uninterrupted one
    ref, ref_opt = C.build()
    C.train(ref, ref_opt, range(3))
    C.train(model, opt, range(2, 3))
    assert _equal(C.params(model), C.params(ref))
    canzona.save_checkpoint(tmp_path / "ck", model, opt)
    assert sorted(os.listdir(tmp_path)) == ["after2.pt", "ck"]
