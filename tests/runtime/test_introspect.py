"""Live inventory (canzona.runtime.introspect) and the plan_model facade."""

from __future__ import annotations


import pytest
import torch

import canzona
import dp_helpers as H
from canzona.planner.errors import ModelError, SizeError
from canzona.planner.inventory import build_inventory
from canzona.planner.layout import ParallelSizes
from canzona.planner.models import ModelConfig
from canzona.planner.planning import make_problem
from canzona.runtime.introspect import inventory


def test_module_routes_embeddings_heads_and_vectors_to_adamw():
    spec = inventory(H.TinyGPT())
    route = {p.name: (p.kind, p.optimizer) for p in spec.params}
    assert route["wte.weight"] == ("embedding", "adamw")
    assert route["wpe.weight"] == ("embedding", "adamw")
    assert route["lm_head.weight"] == ("output", "adamw")
    assert route["blocks.0.ln_1.bias"] == ("vector", "adamw")
    assert route["blocks.0.fc1.bias"] == ("vector", "adamw")
    assert route["blocks.1.qkv.weight"] == ("matrix", "matrix")
    assert spec.name == "TinyGPT" and spec.config is None
    assert [p.name for p in spec.params] == [n for n, _ in H.TinyGPT().named_parameters()]


def test_hugging_face_names_without_a_module():
    names = {"model.embed_tokens.weight": (16, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
             "model.layers.0.mlp.gate.weight": (4, 8), "model.norm.weight": (8,),
             "lm_head.weight": (16, 8), "conv.weight": (2, 2, 3)}
    spec = inventory([(n, torch.zeros(s, dtype=torch.bfloat16)) for n, s in names.items()])
    got = {p.name: p.optimizer for p in spec.params}
    assert got == {"model.embed_tokens.weight": "adamw",
                   "model.layers.0.self_attn.q_proj.weight": "matrix",
                   "model.layers.0.mlp.gate.weight": "adamw", "model.norm.weight": "adamw",
                   "lm_head.weight": "adamw", "conv.weight": "adamw"}
    assert {p.dtype for p in spec.params} == {"bf16"}


def test_overrides_and_their_errors():
    spec = inventory(H.TinyGPT(), adamw_globs=["*.qkv.weight"], matrix_globs=["lm_head.weight"])
    route = {p.name: p.optimizer for p in spec.params}
    assert route["blocks.0.qkv.weight"] == "adamw" and route["lm_head.weight"] == "matrix"
    with pytest.raises(ModelError, match="matches no parameter"):
        inventory(H.TinyGPT(), adamw_globs=["nothing.*"])
    with pytest.raises(ModelError, match="dtype torch.float64"):
        inventory([("w", torch.zeros(2, 2, dtype=torch.float64))])


def test_megatron_module_fingerprints_like_the_preset_inventory():
    cfg = ModelConfig(name="tiny", arch="qwen3", hidden=64, ffn=128, layers=2, q_heads=4,
                      kv_heads=2, head_dim=16, vocab=256, tied_embeddings=False, qk_norm=True)
    preset = build_inventory(cfg)
    pairs = []
    for p in preset.params:
        t = torch.nn.Parameter(torch.zeros(p.shape, dtype=torch.bfloat16))
        if p.tp_layout != "replicated":
            t.tensor_model_parallel = True
            t.partition_dim = p.tp_dim
        pairs.append((p.name, t))
    live = inventory(pairs)
    assert live.fingerprint() == preset.fingerprint()
    assert [p.optimizer for p in live.params] == [p.optimizer for p in preset.params]


def test_configless_spec_sizes():
    spec = inventory(H.TinyGPT())
    make_problem(spec, ParallelSizes(dp=4, tp=1))
    with pytest.raises(SizeError, match="ep=2 needs per-expert weights"):
        make_problem(spec, ParallelSizes(dp=2, tp=1, ep=2))
    # tp > 1 needs plain column/row splits that divide evenly (fused layouts need a config)
    pairs = [(n, p) for n, p in H.TinyGPT().named_parameters()]
    name, w = next((n, p) for n, p in pairs if p.dim() == 2 and "emb" not in n and "wte" not in n)
    w.tensor_model_parallel, w.partition_dim = True, 0
    make_problem(inventory(pairs), ParallelSizes(dp=1, tp=2))
    with pytest.raises(SizeError, match="does not split evenly"):
        make_problem(inventory(pairs), ParallelSizes(dp=1, tp=w.shape[0] + 1))


def test_plan_model_whole_matrices_and_options():
    plan = canzona.plan_model(H.TinyGPT(), dp=2, optimizer="shampoo", bucket_size=3000,
                              shampoo_precondition_frequency=7, name="tiny-gpt")
    assert plan.inputs.model == "tiny-gpt" and plan.inputs.model_source == "module"
    assert plan.inputs.optimizer.shampoo_precondition_frequency == 7
    assert plan.metrics.split_matrices == 0 and len(plan.buffers[0].buckets) > 1
    assert plan.fingerprint == inventory(H.TinyGPT()).fingerprint()
