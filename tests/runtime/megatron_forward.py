"""A Megatron-style Qwen3 block stack with a real tensor-parallel forward, and the same model on one
device, written from Megatron-core's semantics (not from ``canzona.planner.shards``):

* vocabulary-parallel embedding: rank t looks up the rows of its vocabulary range (padded to a
  multiple of 128·tp), the partial embeddings are summed over TP;
* ``linear_qkv`` column-parallel, rows grouped per KV group as [q heads of g; k_g; v_g], rank t
  holding groups [t·G/tp, (t+1)·G/tp); q/k norms per head; causal GQA attention on the local
  heads; ``linear_proj`` row-parallel, its partial outputs summed over TP;
* ``linear_fc1`` column-parallel with ``partition_stride`` 2: rank t holds [gate_t; up_t];
  SwiGLU; ``linear_fc2`` row-parallel;
* RMSNorm weights replicated; the output layer vocabulary-parallel, its logits gathered.

The two forwards take the same logical weights, so the loss is the same function of them; on the
TP side autograd hands each rank the gradient of its own shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the backward sums the input gradient over TP (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Sum over TP forward; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim; the backward keeps this rank's part (every rank computes
    the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[-1]
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _attention(q, k, v):
    """q: (b, t, Hq, d), k/v: (b, t, G, d), heads of group g = g·(Hq/G) …"""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True)
    return y.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def full_loss(cfg, w: dict[str, torch.Tensor], idx, target) -> torch.Tensor:
    """One device, the logical (Hugging Face view) weights: [q; k; v], [gate; up], vocab V."""
    hd, Hq, G = cfg.head_dim, cfg.q_heads, cfg.kv_heads
    b, t = idx.shape
    x = w["embedding.word_embeddings.weight"][idx]
    for i in range(cfg.layers):
        pre = f"decoder.layers.{i}."
        h = _rms(x, w[pre + "input_layernorm.weight"])
        qkv = h @ w[pre + "self_attention.linear_qkv.weight"].T
        q, k, v = qkv.split([Hq * hd, G * hd, G * hd], -1)
        q = _rms(q.view(b, t, Hq, hd), w[pre + "self_attention.q_layernorm.weight"])
        k = _rms(k.view(b, t, G, hd), w[pre + "self_attention.k_layernorm.weight"])
        x = x + (_attention(q, k, v.view(b, t, G, hd))
                 @ w[pre + "self_attention.linear_proj.weight"].T)
        h = _rms(x, w[pre + "pre_mlp_layernorm.weight"])
        gate, up = (h @ w[pre + "mlp.linear_fc1.weight"].T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ w[pre + "mlp.linear_fc2.weight"].T
    logits = _rms(x, w["decoder.final_layernorm.weight"]) @ w["output_layer.weight"].T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def tp_loss(cfg, w: dict[str, torch.Tensor], idx, target, group, vpad: int) -> torch.Tensor:
    """This TP rank's forward on its Megatron shards ``w``; every rank returns the same loss."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    hd, Hq, G = cfg.head_dim, cfg.q_heads, cfg.kv_heads
    Gl, hpg = G // tp, Hq // G
    b, t = idx.shape
    rows = vpad // tp
    local = idx - r * rows
    mask = (local >= 0) & (local < rows)
    emb = w["embedding.word_embeddings.weight"][local.clamp(0, rows - 1)] * mask[..., None]
    x = _ReduceFromTP.apply(emb, group)
    for i in range(cfg.layers):
        pre = f"decoder.layers.{i}."
        h = _CopyToTP.apply(_rms(x, w[pre + "input_layernorm.weight"]), group)
        qkv = (h @ w[pre + "self_attention.linear_qkv.weight"].T).view(b, t, Gl, (hpg + 2) * hd)
        q, k, v = qkv.split([hpg * hd, hd, hd], -1)
        q = _rms(q.reshape(b, t, Gl * hpg, hd), w[pre + "self_attention.q_layernorm.weight"])
        k = _rms(k, w[pre + "self_attention.k_layernorm.weight"])
        y = _attention(q, k, v) @ w[pre + "self_attention.linear_proj.weight"].T
        x = x + _ReduceFromTP.apply(y, group)
        h = _CopyToTP.apply(_rms(x, w[pre + "pre_mlp_layernorm.weight"]), group)
        gate, up = (h @ w[pre + "mlp.linear_fc1.weight"].T).chunk(2, -1)  # [gate_r; up_r]
        x = x + _ReduceFromTP.apply((F.silu(gate) * up) @ w[pre + "mlp.linear_fc2.weight"].T,
                                    group)
    h = _CopyToTP.apply(_rms(x, w["decoder.final_layernorm.weight"]), group)
    logits = _GatherLastDim.apply(h @ w["output_layer.weight"].T, group)[..., :cfg.vocab]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
