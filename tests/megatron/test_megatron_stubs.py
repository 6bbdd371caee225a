"""The CPU stand-ins of ``megatron_stubs`` suffice to run a megatron-core GPTModel: a forward with
the explicit causal mask (later tokens do not change earlier logits), a loss and a backward that
reaches every parameter."""

from __future__ import annotations

import pytest

from canzona.planner.models import ModelConfig
from megatron_stubs import causal_attention_mask, gpt_model, megatron_world

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")]

CFG = ModelConfig(name="qwen3-fp32-tiny", arch="qwen3", hidden=64, ffn=96, layers=2, q_heads=4,
                  kv_heads=2, head_dim=32, vocab=1000, tied_embeddings=False, qk_norm=True,
                  dtype="fp32")


def test_gpt_forward_backward_on_cpu():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    seq = 16
    torch.manual_seed(0)
    with megatron_world(1, 1):
        module, gpt = gpt_model(CFG, 1)
        ids = torch.randint(0, CFG.vocab, (2, seq))
        pos = torch.arange(seq)[None].expand(2, -1)
        mask = causal_attention_mask(seq)
        assert mask.shape == (1, 1, seq, seq) and mask[0, 0, 0, 1] and not mask[0, 0, 1, 0]
        loss = module(ids, pos, mask, labels=ids)  # per-token loss, [batch, seq]
        assert loss.shape == (2, seq) and torch.isfinite(loss).all()
        loss.mean().backward()
        assert all(p.grad is not None for p in gpt.parameters())
        with torch.no_grad():
            changed = ids.clone()
            changed[:, 10] = (changed[:, 10] + 1) % CFG.vocab
            a, b = module(ids, pos, mask), module(changed, pos, mask)
        assert a.shape == (2, seq, 1024)  # the vocabulary padded to a multiple of 128
        assert torch.equal(a[:, :10], b[:, :10])
        assert not torch.equal(a[:, 10:], b[:, 10:])
