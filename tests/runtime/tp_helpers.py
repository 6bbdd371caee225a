"""Helpers of the TP runtime tests: a Megatron-style parameter set (fused QKV with KV groups, gated
fc1 held as [gate_r; up_r], vocabulary-parallel embedding and output layer), a synthetic loss on
the logical (single-device) matrices, the spawned dp × tp world and the one-process reference.

Every rank keeps the whole logical model (rebuilt each step from the TP shards with the planner's
shard maps), takes the gradient of its DP rank's data on it, and hands canzona its TP shard of that
gradient through autograd (``torch.autograd.backward`` on the local shards fires the optimizer's
gradient hooks exactly as a Megatron backward does). The optimizer never sees the full model:
reduce-scatter over DP, micro-groups over TP, all-gather over DP.
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist

from canzona.planner import DPOptions, OptimizerSettings, ParallelSizes, TPOptions, build_inventory
from canzona.planner.models import ModelConfig
from canzona.planner.pipeline import plan as make_plan
from canzona.planner.shards import concat_shards, shard_map, split_full

CFG = ModelConfig(name="tiny-tp", arch="qwen3", hidden=64, ffn=96, layers=2, q_heads=4,
                  kv_heads=2, head_dim=16, vocab=100, tied_embeddings=False, qk_norm=True,
                  dtype="fp32")
STEPS = 10
ROWS = 96  # data rows per DP rank and step (SOAP: statistics of full rank, a unique eigenbasis)
LR = {"muon": 0.02, "normuon": 0.02, "shampoo": 0.01, "soap": 3e-3}
ADAMW_LR = 3e-3
SHAMPOO_OPTIONS = {"eps": 1e-4}


def spec():
    return build_inventory(CFG)


def plan_for(dp: int, tp: int, optimizer: str = "muon", *, split: bool = False,
             cmax_mib: float = 0.05, dtype: str = "fp32", share: str = "off",
             block: int | None = None, comm_dtype: str = "fp32", ns: str = "simple"):
    """The plan: fp32 gather/scatter (exactness; ``comm_dtype`` another), a C_max small enough
    for several groups; ``split``: True for Q, K, V and gate, up apart, ``"heads"`` for the QKV
    per head;
    ``share``: ``TPOptions.share`` (the TP group shares matrices); ``block``: Shampoo's
    max_preconditioner_dim (default its 1024); ``ns``: Muon's Newton–Schulz schedule."""
    extra = {"shampoo": {"shampoo_precondition_frequency": 3},
             "soap": {"soap_precondition_frequency": 3}}.get(optimizer, {})
    if block is not None:
        extra["max_preconditioner_dim"] = block
    if ns != "simple":
        extra["ns_coefficients"] = ns
    qkv = "heads" if split == "heads" else "qkv" if split else "fused"
    settings = OptimizerSettings(name=optimizer, qkv_split=qkv, split_gate_up=split is True,
                                 **extra)
    return make_plan(CFG.model_copy(update={"dtype": dtype}), ParallelSizes(dp=dp, tp=tp), settings,
                     dp_options=DPOptions(bucket_size=20_000),
                     tp_options=TPOptions(cmax_mib=cmax_mib, comm_dtype=comm_dtype,
                                          share=share))


def initial_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for p in spec().params:
        t = torch.randn(p.shape, generator=g) * (0.5 if len(p.shape) == 2 else 0.1)
        out[p.name] = t + (1.0 if len(p.shape) == 1 else 0.0)
    return out


def data(step: int, dp_rank: int, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(zlib.crc32(f"{step}/{dp_rank}/{name}".encode()))
    cols = shape[-1]
    x = torch.randn(ROWS, cols, generator=g)
    y = torch.randn(ROWS, shape[0] if len(shape) == 2 else cols, generator=g)
    return x, y


def loss(full: dict[str, torch.Tensor], step: int, dp_rank: int) -> torch.Tensor:
    """A smooth loss of every logical parameter on this DP rank's data."""
    total = torch.zeros(())
    for name, w in full.items():
        x, y = data(step, dp_rank, name, tuple(w.shape))
        pred = x @ w.T if w.dim() == 2 else x * w
        total = total + torch.tanh(pred - y).pow(2).mean()
    return total


def local_of(p, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s shard of a logical tensor (Megatron's layout; vocabulary padding 0)."""
    m = shard_map(p, tp, kv_groups=CFG.kv_heads)
    if m.dim is None:
        return full.clone()
    out = torch.zeros(m.local_shape, dtype=full.dtype)
    for ls, piece in split_full(m, full, rank):
        n = piece.shape[m.dim]
        (out[ls:ls + n] if m.dim == 0 else out[:, ls:ls + n]).copy_(piece)
    return out


def megatron_param(p, local: torch.Tensor, tp: int) -> torch.nn.Parameter:
    """A parameter carrying Megatron's TP attributes (what clipping reads to count replicated
    parameters once)."""
    w = torch.nn.Parameter(local)
    m = shard_map(p, tp, kv_groups=CFG.kv_heads)
    w.tensor_model_parallel = m.dim is not None
    w.partition_dim = m.dim if m.dim is not None else -1
    w.partition_stride = 2 if p.tp_layout == "gate_up" else 1
    return w


def full_of(p, local: torch.Tensor, tp: int, group) -> torch.Tensor:
    """The logical tensor from every TP rank's shard (an all-gather over the TP group)."""
    m = shard_map(p, tp, kv_groups=CFG.kv_heads)
    if m.dim is None or tp == 1:
        return local.detach().clone() if m.dim is None else concat_shards(
            m, [local.detach()], lambda xs, d: torch.cat(xs, d))
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    return concat_shards(m, shards, lambda xs, d: torch.cat(xs, d))


QK_TAU, QK_ALPHA = 1.0, 0.5  # QK-clip's threshold and the query rows' share


def qk_logits(step: int, dp_rank: int, layer: int) -> torch.Tensor:
    """The largest attention logit of each query head of ``layer`` over DP rank ``dp_rank``'s
    batch at ``step`` (all heads): in [0, 2τ), so that some KV groups clip and others do not,
    and different on every DP rank, so that only their maximum gives the reference."""
    g = torch.Generator().manual_seed(zlib.crc32(f"qk/{step}/{dp_rank}/{layer}".encode()))
    return torch.rand(CFG.q_heads, generator=g) * 2 * QK_TAU


def qk_layers():
    from canzona.runtime.qk_clip import AttentionHeads

    return [AttentionHeads(f"decoder.layers.{i}.self_attention",
                           f"decoder.layers.{i}.self_attention.linear_qkv.weight", None,
                           CFG.q_heads, CFG.kv_heads, CFG.head_dim) for i in range(CFG.layers)]


def qk_clip_full(full: dict[str, torch.Tensor], step: int, dp: int) -> None:
    """QK-clip on the logical (single-device) QKV, [q; k; v], with the maxima over the DP
    ranks: the reference of ``CanzonaOptimizer.qk_clip_``."""
    hd, per = CFG.head_dim, CFG.q_heads // CFG.kv_heads
    for layer in qk_layers():
        i = int(layer.name.split(".")[2])
        m = torch.stack([qk_logits(step, d, i) for d in range(dp)]).amax(0)
        eta = torch.clamp(QK_TAU / m.view(CFG.kv_heads, per).amax(1), max=1.0)
        w = full[layer.weight]
        q = CFG.q_heads * hd
        with torch.no_grad():
            w[:q] *= eta.pow(QK_ALPHA).repeat_interleave(per * hd).view(-1, 1)
            w[q:q + CFG.kv_heads * hd] *= eta.pow(1 - QK_ALPHA).repeat_interleave(hd).view(-1, 1)


def _partial(g: torch.Tensor, tp_rank: int, step: int, name: str) -> torch.Tensor:
    noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(
        zlib.crc32(f"sp/{step}/{name}".encode()))) * g.abs().max()
    return g + noise if tp_rank == 0 else -noise


def groups(dp: int, tp: int):
    """(dp_group, tp_group) of this rank, Megatron's order (TP ranks adjacent)."""
    rank = dist.get_rank()
    dp_group = tp_group = None
    for d in range(dp):
        g = dist.new_group([d * tp + t for t in range(tp)])
        if rank // tp == d:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([d * tp + t for d in range(dp)])
        if rank % tp == t:
            dp_group = g
    return dp_group, tp_group


def train_tp(rank: int, world: int, *, dp: int, tp: int, optimizer: str = "muon",
             split: bool = False, accum: int = 1, clip: float | None = None,
             steps: int = STEPS, roundtrip: bool = False, overlap_tp: bool = True,
             sequence_parallel: bool = False, bf16: bool = False,
             share: str = "off", cmax_mib: float = 0.05, plan=None,
             block: int | None = None, untouched: tuple[str, int] | None = None,
             matrix_options: dict | None = None, ns: str | None = None,
             qk_clip: bool = False) -> dict:
    """Train the TP shards with CanzonaOptimizer over dp × tp (the counterpart of
    :func:`reference`); return the logical parameters at the end. ``qk_clip``: QK-clip after
    every step, each rank giving its own heads' maxima (:func:`qk_logits`).
    ``bf16``: bf16 shards with fp32 main copies (``main_params="fp32"``); ``plan``: this plan
    instead of ``plan_for``'s (a zero-argument callable making it); ``untouched``: (name, step):
    no rank produces that parameter's gradient at that step (its shard is left out of the
    backward, so its ``grad`` stays None); ``matrix_options``: added to the kernel's options;
    ``ns``: the Newton–Schulz schedule the plan records, which the runtime takes from it (else
    ``matrix_options``'s, recorded too)."""
    import canzona

    assert world == dp * tp
    dp_group, tp_group = groups(dp, tp)
    dp_rank, tp_rank = rank // tp, rank % tp
    plan = plan() if plan is not None else plan_for(
        dp, tp, optimizer, split=split, dtype="bf16" if bf16 else "fp32", share=share,
        cmax_mib=cmax_mib, block=block,
        ns=ns or (matrix_options or {}).get("ns_coefficients", "simple"))
    low = torch.bfloat16 if bf16 else torch.float32
    ps = spec().params
    start = initial_full()
    local = [(p.name, megatron_param(p, local_of(p, start[p.name], tp, tp_rank).to(low), tp))
             for p in ps]
    # Sequence parallelism: the norms' gradients are partial per TP rank: rank 0 holds g + n,
    # rank 1 holds -n (n random), so only their sum is the gradient.
    for p, (_, w) in zip(ps, local):
        w.sequence_parallel = sequence_parallel and tp == 2 and p.kind == "vector"

    def build():
        return canzona.CanzonaOptimizer(
            local, plan, lr=LR[optimizer], ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
            adamw_weight_decay=0.01, dp_group=dp_group if dp > 1 else None, tp_group=tp_group,
            matrix_options={**(SHAMPOO_OPTIONS if optimizer == "shampoo" else {}),
                            **(matrix_options or {})} or None,
            overlap_tp=overlap_tp, main_params="fp32" if bf16 else None)

    opt = build()
    norms = []
    for step in range(steps):
        full = {p.name: full_of(p, w, tp, tp_group).float().requires_grad_(True)
                for p, (_, w) in zip(ps, local)}
        for micro in range(accum):
            grads = torch.autograd.grad(loss(full, step * accum + micro, dp_rank) / accum,
                                        list(full.values()))
            shards = [(_partial(local_of(p, g, tp, tp_rank), tp_rank, step, p.name)
                       if w.sequence_parallel else local_of(p, g, tp, tp_rank)).to(low)
                      for p, g, (_, w) in zip(ps, grads, local)]
            pairs = [(w, g) for p, (_, w), g in zip(ps, local, shards)
                     if (p.name, step) != untouched]
            with opt.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                torch.autograd.backward([w for w, _ in pairs], [g for _, g in pairs])
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        if qk_clip:
            heads = slice(tp_rank * CFG.q_heads // tp, (tp_rank + 1) * CFG.q_heads // tp)
            logits = {x.name: qk_logits(step, dp_rank, i)[heads]
                      for i, x in enumerate(qk_layers())}
            opt.qk_clip_(logits, threshold=QK_TAU, alpha=QK_ALPHA, attention=qk_layers())
        if roundtrip and step == steps // 2:
            sd = opt.state_dict()
            opt.close()
            opt = build()
            opt.load_state_dict(sd)
    out = {p.name: full_of(p, w, tp, tp_group).float() for p, (_, w) in zip(ps, local)}
    from canzona.runtime.accounting import predicted_state_bytes

    state = {"measured": opt.state_bytes(), "predicted": opt.predicted_state_bytes(),
             "from_plan": predicted_state_bytes(plan, dp_rank, tp_rank=tp_rank,
                                                main_params="fp32" if bf16 else None)}
    opt.close()
    return {"params": out, "norms": norms, "dp_rank": dp_rank, "tp_rank": tp_rank,
            "scratch": opt.tp_scratch_bytes(), "plan": plan, "state": state}


def reference(dp: int, optimizer: str = "muon", *, split: bool = False, accum: int = 1,
              clip: float | None = None, steps: int = STEPS, bf16: bool = False,
              block: int | None = None, untouched: tuple[str, int] | None = None,
              matrix_options: dict | None = None, ns: str | None = None,
              qk_clip: bool = False) -> dict:
    """One process, the logical matrices: the kernel per matrix task (per part when split),
    torch.optim.AdamW on the rest. The gradient is summed as the runtime sums it: each DP rank's
    micro-batches, then the ranks, then ÷ dp. One thread, as the ranks: SOAP's statistics of a
    non-square gradient are rank deficient, and LAPACK's basis of their null space depends on the
    thread count. ``block``: Shampoo's max_preconditioner_dim (default its 1024); ``untouched``:
    (name, step): that parameter's ``grad`` is None at that step, so its kernel skips it;
    ``matrix_options``: the kernel's settings, as ``train_tp`` passes them; ``ns``: the
    Newton–Schulz schedule."""
    if ns is not None:
        matrix_options = {**(matrix_options or {}), "ns_coefficients": ns}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(dp, optimizer, split=split, accum=accum, clip=clip, steps=steps,
                          bf16=bf16, block=block, untouched=untouched,
                          matrix_options=matrix_options, qk_clip=qk_clip)
    finally:
        torch.set_num_threads(threads)


def _reference(dp: int, optimizer: str, *, split: bool, accum: int, clip: float | None,
               steps: int, bf16: bool = False, block: int | None = None,
               untouched: tuple[str, int] | None = None,
               matrix_options: dict | None = None, qk_clip: bool = False) -> dict:
    """``bf16``: the fp32 master (the main copies) starts as the bf16 parameters; every step's
    gradient is taken at the bf16 parameters and rounded to bf16 as the ranks hand it over."""
    import dp_helpers as H

    ps = spec().params
    low = torch.bfloat16 if bf16 else torch.float32
    full = {n: t.to(low).float().requires_grad_(True) for n, t in initial_full().items()}
    kernel = H.matrix_kernel(optimizer, LR[optimizer])
    if block is not None or matrix_options:
        import dataclasses

        kernel = type(kernel)(dataclasses.replace(
            kernel.config, **({} if block is None else {"max_preconditioner_dim": block}),
            **(matrix_options or {})))
    tasks = []  # (parameter, first row, rows)
    for p in ps:
        if p.optimizer != "matrix":
            continue
        if split == "heads" and p.tp_layout == "qkv":  # every head: head_dim logical rows
            tasks += [(p.name, r, CFG.head_dim) for r in range(0, p.shape[0], CFG.head_dim)]
        elif split is True and p.parts:
            row = 0
            for part in p.parts:
                tasks.append((p.name, row, part.rows))
                row += part.rows
        else:
            tasks.append((p.name, 0, p.shape[0]))
    states = [kernel.init_state((rows, full[n].shape[1])) for n, _, rows in tasks]
    adamw = torch.optim.AdamW([full[p.name] for p in ps if p.optimizer != "matrix"],
                              lr=ADAMW_LR, weight_decay=0.01)
    names = list(full)
    norms = []
    for step in range(steps):
        total = None
        for d in range(dp):
            mine = None
            for micro in range(accum):
                at = full if not bf16 else {n: t.detach().to(low).float().requires_grad_(True)
                                            for n, t in full.items()}
                g = torch.autograd.grad(loss(at, step * accum + micro, d) / accum,
                                        list(at.values()))
                g = [x.to(low).float() for x in g]
                mine = list(g) if mine is None else [a + b for a, b in zip(mine, g)]
            total = mine if total is None else [a + b for a, b in zip(total, mine)]
        grads = {n: g / dp for n, g in zip(names, total)}
        for n in names:
            full[n].grad = None if (n, step) == untouched else grads[n]
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(full.values()), clip)))
        with torch.no_grad():
            for (n, r0, rows), st in zip(tasks, states):
                if full[n].grad is None:
                    continue
                w = full[n][r0:r0 + rows]
                kernel.step([w], [full[n].grad[r0:r0 + rows]], [st], lr=LR[optimizer])
        adamw.step()
        adamw.zero_grad()
        if qk_clip:
            qk_clip_full(full, step, dp)
    return {"params": {n: t.detach().to(low).float() for n, t in full.items()}, "norms": norms}


# --- a real TP forward (tests/runtime/megatron_forward.py) ----------------------------------------

FORWARD_STEPS = 5


def tokens(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(f"tokens/{step}/{dp_rank}".encode()))
    data = torch.randint(0, CFG.vocab, (4, 9), generator=g)
    return data[:, :-1], data[:, 1:]


def train_forward(rank: int, world: int, *, dp: int, tp: int, optimizer: str = "muon",
                  steps: int = FORWARD_STEPS) -> dict:
    """Megatron-style TP forward and backward on the shards; CanzonaOptimizer updates them."""
    import canzona
    import megatron_forward as M
    from canzona.planner.layout import padded_vocab

    dp_group, tp_group = groups(dp, tp)
    dp_rank, tp_rank = rank // tp, rank % tp
    plan = plan_for(dp, tp, optimizer)
    ps = spec().params
    start = initial_full()
    local = {p.name: megatron_param(p, local_of(p, start[p.name], tp, tp_rank), tp) for p in ps}
    opt = canzona.CanzonaOptimizer(
        list(local.items()), plan, lr=LR[optimizer], ns_dtype=torch.float32, adamw_lr=ADAMW_LR,
        adamw_weight_decay=0.01, dp_group=dp_group if dp > 1 else None, tp_group=tp_group,
        matrix_options=SHAMPOO_OPTIONS if optimizer == "shampoo" else None,
        tp_sum_grads=("*q_layernorm.weight", "*k_layernorm.weight"))  # per-head norms: partial
    vpad = padded_vocab(CFG.vocab, tp)
    losses = []
    for step in range(steps):
        idx, target = tokens(step, dp_rank)
        loss_value = M.tp_loss(CFG, local, idx, target, tp_group, vpad)
        loss_value.backward()
        losses.append(float(loss_value.detach()))
        opt.step()
        opt.zero_grad()
    out = {p.name: full_of(p, local[p.name], tp, tp_group) for p in ps}
    opt.close()
    return {"params": out, "losses": losses}


def reference_forward(dp: int, optimizer: str = "muon", steps: int = FORWARD_STEPS) -> dict:
    """One process, the single-device forward on the logical weights, the DP ranks' batches."""
    import dp_helpers as H
    import megatron_forward as M

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ps = spec().params
        full = {n: t.clone().requires_grad_(True) for n, t in initial_full().items()}
        kernel = H.matrix_kernel(optimizer, LR[optimizer])
        mats = [p.name for p in ps if p.optimizer == "matrix"]
        states = [kernel.init_state(full[n].shape) for n in mats]
        adamw = torch.optim.AdamW([full[p.name] for p in ps if p.optimizer != "matrix"],
                                  lr=ADAMW_LR, weight_decay=0.01)
        losses = []
        for step in range(steps):
            total = None
            for d in range(dp):
                idx, target = tokens(step, d)
                value = M.full_loss(CFG, full, idx, target)
                g = torch.autograd.grad(value, list(full.values()))
                total = list(g) if total is None else [a + b for a, b in zip(total, g)]
                losses.append(float(value.detach()))
            for (n, t), g in zip(full.items(), total):
                t.grad = g / dp
            with torch.no_grad():
                for n, st in zip(mats, states):
                    kernel.step([full[n]], [full[n].grad], [st], lr=LR[optimizer])
            adamw.step()
            adamw.zero_grad()
        return {"params": {n: t.detach().clone() for n, t in full.items()}, "losses": losses}
    finally:
        torch.set_num_threads(threads)
