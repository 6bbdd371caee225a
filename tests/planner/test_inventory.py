"""Inventory: Megatron names and order, routing, fused parts, the parameter graph, fingerprints."""

import pytest

from canzona.planner import ModelError, build_inventory, get_preset
from canzona.planner.inventory import megatron_route


def test_megatron_registration_order(q32):
    names = [p.name for p in q32.params[:9]]
    assert names == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight",
        "decoder.layers.0.self_attention.k_layernorm.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
    ]
    assert [p.name for p in q32.params[-2:]] == ["decoder.final_layernorm.weight",
                                                  "output_layer.weight"]


def test_logical_shapes_and_parts(q32):
    qkv = q32["decoder.layers.3.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((64 + 2 * 8) * 128, 5120)
    assert [(p.name, p.rows) for p in qkv.parts] == [("q", 8192), ("k", 1024), ("v", 1024)]
    assert sum(p.rows for p in qkv.parts) == qkv.shape[0]
    fc1 = q32["decoder.layers.3.mlp.linear_fc1.weight"]
    assert fc1.shape == (51200, 5120) and fc1.tp_stride == 2 and fc1.tp_dim == 0
    assert q32["decoder.layers.3.self_attention.linear_proj.weight"].tp_dim == 1
    assert q32["decoder.layers.3.input_layernorm.weight"].tp_dim is None
    assert fc1.hf_names == ("model.layers.3.mlp.gate_proj.weight",
                            "model.layers.3.mlp.up_proj.weight")


def test_megatron_routing(q32):
    routes = {p.kind: set() for p in q32.params}
    for p in q32.params:
        routes[p.kind].add(p.optimizer)
        assert p.optimizer == megatron_route(p)
    assert routes["matrix"] == {"matrix"}
    assert routes["embedding"] == routes["output"] == routes["vector"] == {"adamw"}


def test_moe_router_is_adamw_experts_are_matrix():
    spec = build_inventory(get_preset("qwen3-30b-a3b"))
    assert spec["decoder.layers.0.mlp.router.weight"].optimizer == "adamw"
    e = spec["decoder.layers.0.mlp.experts.local_experts.127.linear_fc2.weight"]
    assert e.kind == "expert" and e.expert == 127 and e.optimizer == "matrix"


def test_megatron_grouped_names_te_grouped_experts():
    """``megatron-grouped``: each MoE layer's experts as TEGroupedMLP registers them (fc1's
    ``weight{e}`` for every expert, then fc2's), the same matrices as SequentialMLP's; the rest
    of the model as ``megatron``. A dense model has one Megatron naming."""
    cfg = get_preset("qwen3-30b-a3b").model_copy(update={"layers": 2})
    seq, grouped = build_inventory(cfg), build_inventory(cfg, names="megatron-grouped")
    pre = "decoder.layers.1.mlp.experts"
    assert [p.name for p in grouped.params if p.layer == 1 and p.is_expert] == (
        [f"{pre}.linear_fc1.weight{e}" for e in range(128)]
        + [f"{pre}.linear_fc2.weight{e}" for e in range(128)])
    e = grouped[f"{pre}.linear_fc1.weight5"]
    assert (e.kind, e.expert, e.shape, e.tp_layout, e.optimizer) == (
        "expert", 5, (2 * 768, 2048), "gate_up", "matrix")

    def matrix(p):
        return (p.layer, p.expert, p.shape, p.tp_layout, p.parts, p.hf_names, p.optimizer)

    same = {matrix(p): p.name for p in seq.params}
    assert {matrix(p) for p in grouped.params} == set(same)
    assert [p for p in grouped.params if not p.is_expert] == [
        p for p in seq.params if not p.is_expert]
    assert same[matrix(e)] == f"{pre}.local_experts.5.linear_fc1.weight"
    dense = get_preset("qwen3-0.6b")
    assert (build_inventory(dense, names="megatron-grouped").fingerprint()
            == build_inventory(dense).fingerprint())


def test_unknown_naming_lists_the_namings():
    with pytest.raises(ModelError, match="names must be one of: megatron, megatron-grouped, hf; "
                                         "got 'te'"):
        build_inventory(get_preset("qwen3-0.6b"), names="te")


def test_tied_embeddings_have_no_output_layer():
    assert "output_layer.weight" not in build_inventory(get_preset("qwen3-1.7b"))
    assert "output_layer.weight" in build_inventory(get_preset("qwen3-8b"))


def test_routing_overrides_by_glob():
    cfg = get_preset("qwen3-0.6b")
    spec = build_inventory(cfg, adamw_globs=["*.linear_proj.weight"],
                           matrix_globs=["embedding.*"])
    assert spec["decoder.layers.0.self_attention.linear_proj.weight"].optimizer == "adamw"
    assert spec["embedding.word_embeddings.weight"].optimizer == "matrix"
    # Hugging Face names work as well.
    spec = build_inventory(cfg, adamw_globs=["model.layers.*.mlp.down_proj.weight"])
    assert spec["decoder.layers.5.mlp.linear_fc2.weight"].optimizer == "adamw"


def test_routing_override_errors():
    cfg = get_preset("qwen3-0.6b")
    with pytest.raises(ModelError, match="matches no parameter"):
        build_inventory(cfg, adamw_globs=["*.nonexistent"])
    with pytest.raises(ModelError, match="not 2-D"):
        build_inventory(cfg, matrix_globs=["*input_layernorm*"])


def test_graph_structure(q32):
    g = q32.graph()
    assert g.nodes["decoder.layers.0.mlp.linear_fc1.weight"]["optimizer"] == "matrix"
    assert g.edges["layer:0", "layer:1"]["rel"] == "next"
    assert g.edges["layer:7", "decoder.layers.7.mlp.linear_fc2.weight"]["rel"] == "member"
    parts = [v for _, v, d in g.out_edges("decoder.layers.7.self_attention.linear_qkv.weight",
                                          data=True) if d["rel"] == "part"]
    assert sorted(parts) == [f"decoder.layers.7.self_attention.linear_qkv.weight#{x}"
                             for x in "kqv"]
    # Param numel over the graph adds up to the model total.
    assert sum(d["numel"] for _, d in g.nodes(data=True)
               if d["type"] == "param") == q32.total_params


def test_graph_expert_membership():
    g = build_inventory(get_preset("qwen3-30b-a3b")).graph()
    ex = "layer:2/expert:5"
    members = sorted(v for _, v in g.out_edges(ex))
    assert members == ["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight",
                       "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight"]
    assert g.has_edge("layer:2", ex)


def test_fingerprint_depends_on_shapes():
    a = build_inventory(get_preset("qwen3-8b")).fingerprint()
    assert a == build_inventory(get_preset("qwen3-8b")).fingerprint()
    assert a != build_inventory(get_preset("llama3-8b")).fingerprint()
    assert a.startswith("sha256:") and len(a) == 7 + 64
