"""The logical key scheme: parameters named by their global layer and expert indices (the same
under every pipeline and expert-parallel layout), and checkpoints of an older key format loading
through the converter chain (``names.KEY_UPGRADES``)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import checkpoint_files_common as C  # noqa: E402
from canzona.runtime.checkpoint import keys, names  # noqa: E402
from canzona.runtime.checkpoint.names import Placement, global_name  # noqa: E402

P = Placement(layer_offset=10, expert_offset=4)


@pytest.mark.parametrize(("local", "expected"), [
    ("decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.13.mlp.linear_fc1.weight"),
    ("decoder.layers.1.self_attention.linear_qkv.weight#q",
     "decoder.layers.11.self_attention.linear_qkv.weight#q"),
    ("decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight",
     "decoder.layers.10.mlp.experts.local_experts.6.linear_fc1.weight"),
    ("decoder.layers.0.mlp.experts.linear_fc2.weight3",
     "decoder.layers.10.mlp.experts.linear_fc2.weight7"),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight10",
     "decoder.layers.10.mlp.experts.linear_fc1.weight14"),
    ("model.layers.5.mlp.experts.7.gate_proj.weight",
     "model.layers.15.mlp.experts.11.gate_proj.weight"),
    ("model.layers.12.mlp.experts.gate_up_proj", "model.layers.22.mlp.experts.gate_up_proj"),
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
    ("output_layer.weight", "output_layer.weight"),
    ("layers.0.weight", "layers.10.weight"),
])
def test_global_names(local, expected):
    assert global_name(local, P) == expected
    assert global_name(local) == local  # one stage, one EP rank: the local name


def test_stages_and_expert_ranks_together_name_every_parameter_once():
    """Two pipeline stages of 2 layers × two EP ranks of 2 experts: every (stage, EP rank)'s
    local names map to distinct global names, which are the whole model's."""
    def local(n_layers, n_experts):
        out = []
        for i in range(n_layers):
            out.append(f"decoder.layers.{i}.self_attention.linear_qkv.weight")
            out += [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight"
                    for j in range(n_experts)]
        return out

    whole = set(local(4, 4))
    seen = []
    for stage in range(2):
        for ep_rank in range(2):
            place = Placement(layer_offset=2 * stage, expert_offset=2 * ep_rank)
            seen += [global_name(n, place) for n in local(2, 2)]
    qkv = {n for n in seen if "qkv" in n}  # every EP rank holds its stage's attention
    experts = [n for n in seen if "experts" in n]
    assert len(experts) == len(set(experts)) == 16
    assert set(experts) | qkv == whole


def test_offsets_below_zero_are_refused():
    with pytest.raises(ValueError, match="offsets must be ≥ 0"):
        Placement(layer_offset=-1)


def _with_format(path, version):
    meta = path / "canzona.json"
    data = json.loads(meta.read_text())
    data["format"] = version
    meta.write_text(json.dumps(data))


def test_a_format_1_checkpoint_resumes_bit_identically(tmp_path, one_thread):
    import canzona

    ref_model, ref_opt = C.build()
    C.train(ref_model, ref_opt, range(4))
    model, opt = C.build()
    C.train(model, opt, range(2))
    path = tmp_path / "ck"
    canzona.save_checkpoint(path, model, opt)
    assert json.loads((path / "canzona.json").read_text())["format"] == names.FORMAT == 2
    _with_format(path, 1)
    model, opt = C.build(seed=3)
    canzona.load_checkpoint(path, model, opt)
    C.train(model, opt, range(2, 4))
    ref = C.params(ref_model)
    assert all(torch.equal(p, ref[n]) for n, p in C.params(model).items())


class _Layers(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(2))
        self.head = torch.nn.Linear(16, 4, bias=False)


def _build(seed):
    import canzona

    model = _Layers(seed)
    return model, canzona.CanzonaOptimizer(model, canzona.plan_model(model, dp=1),
                                           ns_dtype=torch.float32)


def test_an_older_format_loads_through_its_key_upgrade(tmp_path, monkeypatch):
    """A checkpoint whose keys the next format renames (here: layers by an offset of 5) loads
    only through ``KEY_UPGRADES``: with the format the file records it is found, and recorded
    as the current format its keys are missing."""
    import canzona
    from canzona.runtime.errors import CheckpointError

    model, opt = _build(0)
    path = tmp_path / "ck"
    canzona.save_checkpoint(path, model, opt)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(keys, "PLACEMENT", Placement(layer_offset=5))
    monkeypatch.setitem(names.KEY_UPGRADES, 1, lambda k: global_name(k, Placement(5)))
    _with_format(path, 1)
    model, opt = _build(1)
    canzona.load_checkpoint(path, model, opt)
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    _with_format(path, 2)
    with pytest.raises(CheckpointError, match="has no 'model.layers.5.weight'"):
        canzona.load_checkpoint(path, *_build(1))


@pytest.mark.parametrize(("version", "says"), [(3, "newer than this canzona's"),
                                                ("2", "not a key format")])
def test_a_newer_or_damaged_format_is_refused(tmp_path, version, says):
    import canzona
    from canzona.runtime.errors import CheckpointError

    model, opt = _build(0)
    path = tmp_path / "ck"
    canzona.save_checkpoint(path, model, opt)
    _with_format(path, version)
    with pytest.raises(CheckpointError, match=says):
        canzona.load_checkpoint(path, *_build(1))
