"""QK-clip on one process: the per-head maxima from queries and keys, the attention layers read
from a module, the scaling of each KV group's query and key rows, and the refusals (the
distributed runs, against a single-process reference, are in ``test_tp_runtime.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import canzona
from canzona.runtime.qk_clip import AttentionHeads, attention_heads, max_logits

DIM, HEADS, KV, HD = 32, 4, 2, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HD
        self.q_proj = nn.Linear(DIM, HEADS * HD, bias=False)
        self.k_proj = nn.Linear(DIM, KV * HD, bias=False)
        self.v_proj = nn.Linear(DIM, KV * HD, bias=False)
        self.o_proj = nn.Linear(HEADS * HD, DIM, bias=False)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": Attention()}) for _ in range(2))


def test_max_logits_is_the_largest_attended_logit_per_query_head():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, HEADS, 5, HD, generator=g), torch.randn(2, KV, 5, HD, generator=g)
    got = max_logits(q, k, causal=True)
    want = torch.full((HEADS,), -math.inf)
    for b in range(2):
        for h in range(HEADS):
            for i in range(5):
                for j in range(i + 1):  # causal: keys at or before the query
                    s = float(q[b, h, i] @ k[b, h // (HEADS // KV), j]) / math.sqrt(HD)
                    want[h] = max(want[h], s)
    assert torch.allclose(got, want, atol=1e-5)
    masked = max_logits(q, k, mask=torch.ones(5, 5, dtype=torch.bool).triu(1))
    assert torch.allclose(masked, got, atol=1e-6)  # the same pairs, as a mask


def test_attention_layers_are_read_from_the_module():
    layers = attention_heads(Model())
    assert layers[0] == AttentionHeads("layers.0.self_attn", "layers.0.self_attn.q_proj.weight",
                                       "layers.0.self_attn.k_proj.weight", HEADS, KV, HD)
    assert [x.name for x in layers] == ["layers.0.self_attn", "layers.1.self_attn"]


def test_each_kv_groups_query_and_key_rows_scale_by_its_eta():
    model = Model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = canzona.CanzonaOptimizer(model, canzona.plan_model(model, dp=1, share="off"), lr=0.02)
    m0 = torch.tensor([0.5, 4.0, 1.0, 1.5])  # group 0 clips (max 4), group 1 does not (1.5 < 2)
    m1 = torch.tensor([1.0, 1.0, 1.0, 1.0])  # nothing clips
    top = opt.qk_clip_({"layers.0.self_attn": m0, "layers.1.self_attn": m1}, threshold=2.0,
                       alpha=0.25)
    assert top == 4.0
    eta = 2.0 / 4.0
    q, k = "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight"
    p = dict(model.named_parameters())
    want_q = before[q].clone()
    want_q[:2 * HD] *= eta ** 0.25  # group 0's two query heads
    want_k = before[k].clone()
    want_k[:HD] *= eta ** 0.75  # its key head
    assert torch.equal(p[q], want_q) and torch.equal(p[k], want_k)
    for n in before:  # values and layer 1 untouched
        if n not in (q, k):
            assert torch.equal(p[n], before[n]), n
    opt.close()


@pytest.mark.parametrize("logits,needle", [
    ({"layers.0.self_attn": torch.ones(HEADS), "layers.1.self_attn": torch.ones(HEADS),
      "layers.9.self_attn": torch.ones(HEADS)}, "not attention layers of this model"),
    ({"layers.0.self_attn": torch.ones(HEADS)}, "lacks 1 attention layer"),
    ({"layers.0.self_attn": torch.ones(HEADS + 1), "layers.1.self_attn": torch.ones(HEADS)},
     "is [5] but this rank holds 4 query heads"),
])
def test_bad_maxima_are_refused_in_one_line(logits, needle):
    model = Model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = canzona.CanzonaOptimizer(model, canzona.plan_model(model, dp=1, share="off"), lr=0.02)
    with pytest.raises(ValueError) as e:
        opt.qk_clip_(logits, threshold=0.5)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="threshold must be > 0"):
        opt.qk_clip_(logits, threshold=0.0)
    opt.close()


def test_a_transformers_models_maxima_are_recorded_from_its_queries_and_keys():
    """``record_max_logits`` on a ``transformers`` Qwen3: per layer (its attention module's name)
    the largest causal logit per query head, from the queries and keys the model attends with
    (checked pair by pair against a probe attention function); ``remove`` restores sdpa."""
    from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from canzona.runtime.qk_clip import record_max_logits

    cfg = Qwen3Config(vocab_size=64, hidden_size=DIM, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    seen = []

    def probe(module, query, key, value, attention_mask, **kw):
        seen.append((query.detach(), key.detach(), kw["scaling"]))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("probe_for_qk_clip_test", probe)
    model.set_attn_implementation("probe_for_qk_clip_test")
    rec = record_max_logits(model)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    model(ids)
    got = rec.pop()
    rec.remove()
    assert model.config._attn_implementation == "probe_for_qk_clip_test"
    assert list(got) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for (q, k, scale), name in zip(seen, got):
        want = torch.full((HEADS,), -math.inf)
        for h in range(HEADS):
            for i in range(6):
                for j in range(i + 1):
                    s = float(q[:, h, i] .mul(k[:, h // (HEADS // KV), j]).sum(-1).max()) * scale
                    want[h] = max(want[h], s)
        assert torch.allclose(got[name], want, atol=1e-5), name
    layers = attention_heads(model)
    assert layers[0].weight == "model.layers.0.self_attn.q_proj.weight"
    assert (layers[0].q_heads, layers[0].kv_heads, layers[0].head_dim) == (HEADS, KV, HD)
