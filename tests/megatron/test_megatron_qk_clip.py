"""QK-clip's logits from a Megatron-core GPTModel: ``record_max_logits`` hooks Megatron's local
``DotProductAttention`` and records, per layer and query head, the largest logit Megatron itself
computes (the scores its masked softmax receives), the maximum over the micro-batches until
``pop``; ``attention_heads`` reads the layers from the model's config."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")]


def test_recorded_maxima_are_megatrons_own_scores():
    import megatron_train as M
    from megatron_stubs import gpt_model, megatron_world

    from canzona.runtime.qk_clip import AttentionHeads, attention_heads, record_max_logits

    cfg = M.CFG.model_copy(update={"qk_norm": False})
    with megatron_world(1, 1):
        _, gpt = gpt_model(cfg, 1)
        layers = attention_heads(gpt)
        assert layers[1] == AttentionHeads(
            "decoder.layers.1.self_attention", "decoder.layers.1.self_attention.linear_qkv.weight",
            None, cfg.q_heads, cfg.kv_heads, cfg.head_dim)
        scores: dict[str, list[torch.Tensor]] = {x.name: [] for x in layers}

        def softmax_input(name):
            def hook(module, args):  # [b, np, sq, sk] and the mask, True where masked
                s = args[0].float().masked_fill(args[1], float("-inf"))
                scores[name].append(s.amax(dim=(0, 2, 3)))
            return hook

        hooks = [gpt.get_submodule(f"{x.name}.core_attention.scale_mask_softmax")
                 .register_forward_pre_hook(softmax_input(x.name)) for x in layers]
        rec = record_max_logits(gpt)
        M.forward_loss(gpt, M.tokens(0))
        M.forward_loss(gpt, M.tokens(1))  # a second micro-batch
        got = rec.pop()
        assert rec.pop() == {}
        for x in layers:
            want = torch.maximum(*scores[x.name])
            assert got[x.name].shape == (cfg.q_heads,)
            assert torch.allclose(got[x.name], want, atol=1e-5), x.name
            assert not torch.equal(scores[x.name][0], scores[x.name][1])
        rec.remove()
        for h in hooks:
            h.remove()
