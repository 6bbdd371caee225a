"""Test-only stand-ins that let megatron-core 0.16 build (and run) a GPTModel on CPU.

megatron-core assumes CUDA in a few places that a CPU test can do without:

* ``torch.cuda.current_device()`` is passed as the ``device=`` of the DDP buffers
  (``_ParamAndGradBuffer``) and of a few model tensors: :func:`cpu_cuda_stand_ins` makes it
  return the CPU device for as long as it is active;
* ``tensor_parallel.model_parallel_cuda_manual_seed`` would seed CUDA RNG trackers:
  ``inference_rng_tracker=True`` gives it a tracker that works without CUDA
  (:func:`megatron_world` calls it);
* the local layer spec's attention needs an explicit causal mask on CPU (no fused kernel builds
  one): :func:`causal_attention_mask`.

:func:`megatron_world` initialises ``torch.distributed`` (the in-process ``fake`` backend, where one
process acts as rank 0 of a ``dp·tp`` world and every collective is a no-op — enough to build
models and DDP buffers — or gloo for real multi-process runs) and Megatron's model-parallel groups,
and tears both down on exit (with ``pp`` > 1 also :func:`cpu_pipeline_stand_ins`, for
Megatron's pipeline schedule). :func:`gpt_model` builds a GPTModel (this rank's pipeline stage)
with the local (non Transformer-Engine) layer spec from a canzona
:class:`~canzona.planner.models.ModelConfig`, as Megatron's training script would: the
vocabulary padded first, the model wrapped in ``Float16Module`` for bf16/fp16.

Everything imports torch and megatron lazily, so importing this module costs nothing when
megatron-core is absent.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from canzona.planner.models import ModelConfig

#: Why the Megatron tests skip when megatron-core is missing.
MISSING_REASON = ("megatron-core is not installed (the Megatron layout tests need it: "
                  "python -m pip install -e '.[dev]', which pins megatron-core==0.16.1)")


def megatron_available() -> bool:
    """True when ``megatron.core`` can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # a 'megatron' that is not a package
        return False


@contextlib.contextmanager
def cpu_cuda_stand_ins() -> Iterator[None]:
    """``torch.cuda.current_device()`` returns ``torch.device("cpu")`` inside the block (Megatron
    allocates its DDP buffers and some model tensors on that device); restored on exit. The MoE
    router's Transformer Engine GEMM is set to None where Transformer Engine is missing."""
    import torch

    # megatron-core 0.16.1's MoE router names te_general_gemm only when Transformer Engine
    # imports; without it the name is undefined (a NameError in every MoE forward on CPU).
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


class _CpuSchedulesTorch:
    """``torch`` as megatron-core 0.16.1's pipeline schedules see it: everything torch's, but
    ``torch.zeros(..., device="cuda")`` (the token count every ``forward_backward_*`` allocates)
    on the CPU."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        import torch

        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


@contextlib.contextmanager
def cpu_pipeline_stand_ins() -> Iterator[None]:
    """What megatron-core 0.16.1's pipeline schedule (``get_forward_backward_func``, 1F1B), its
    point-to-point code and a tied GPTModel's set-up under pp > 1 assume about CUDA, pointed at
    the CPU inside the block (with :func:`cpu_cuda_stand_ins`' ``current_device``): the p2p
    code's ``torch.cuda.synchronize()`` after its batched sends and receives, the schedule's
    ``torch.zeros(..., device="cuda")``, and ``LanguageModule``'s ``weight.data.cuda()`` before
    the embedding group's all-reduce of the tied copy. Restored on exit."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    patch(torch.cuda, "synchronize", lambda device=None: None)
    patch(schedules, "torch", _CpuSchedulesTorch())
    patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


@contextlib.contextmanager
def megatron_world(dp: int, tp: int, *, backend: str = "fake", rank: int = 0, seed: int = 1234,
                   ep: int = 1, etp: int | None = None, init_method: str | None = None,
                   timeout_s: float | None = None, pp: int = 1) -> Iterator[None]:
    """``torch.distributed`` (world size ``dp·tp``) and Megatron's model-parallel groups, on CPU.

    ``backend="fake"``: one process plays rank ``rank`` of the whole world with no-op collectives
    (build models and DDP buffers for any sizes in one process); ``"gloo"``: a real member of a
    multi-process world (``init_method`` or the ``MASTER_ADDR``/``MASTER_PORT`` environment).
    Also seeds Megatron's RNG trackers the CPU way and applies :func:`cpu_cuda_stand_ins`.
    ``timeout_s``: the process group's collective timeout (a failing peer fails the rest fast).
    ``etp``: the expert tensor-parallel size (None: tp, Megatron's default). ``pp``: pipeline
    stages (the world is then ``pp·dp·tp``, Megatron's order: stage-major), with
    :func:`cpu_pipeline_stand_ins` applied.
    Everything is torn down on exit, so the next world may have other sizes.

    Raises:
        RuntimeError: a default process group already exists in this process.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if dist.is_initialized():
        raise RuntimeError("megatron_world needs a process without a default process group; "
                           "one is already initialised")
    world = dp * tp * pp
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        extra: dict[str, Any] = {"init_method": init_method} if init_method else {}
        if timeout_s is not None:
            import datetime

            extra["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, **extra)
    try:
        with cpu_cuda_stand_ins(), (cpu_pipeline_stand_ins() if pp > 1
                                    else contextlib.nullcontext()):
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, pipeline_model_parallel_size=pp,
                create_gloo_process_groups=backend != "fake")
            try:
                tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
                yield
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def megatron_padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary Megatron's training script builds the model with.

    Megatron-LM pads the tokenizer's vocabulary before building the model
    (``megatron/training/tokenizer/tokenizer.py``, ``_vocab_size_with_padding``; not part of the
    megatron-core wheel): the smallest multiple of ``make_vocab_size_divisible_by`` (``--make-vocab-
    size-divisible-by``, default 128) times the tensor-parallel size that is ≥ the vocabulary.
    Written here from that documented rule, so the tests can compare canzona's
    :func:`~canzona.planner.layout.padded_vocab` with it.
    """
    multiple = divisible_by * tp
    return (vocab + multiple - 1) // multiple * multiple


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def transformer_config(cfg: "ModelConfig", tp: int, ep: int = 1, **overrides: Any):
    """Megatron's ``TransformerConfig`` for a canzona ``ModelConfig`` (Llama, Qwen3, Qwen3-MoE:
    RMSNorm, GQA, gated SwiGLU, no biases, QK-norm for Qwen3, ``kv_channels`` = head_dim; MoE
    layers everywhere with ``cfg.num_experts`` experts of width ``cfg.moe_ffn``, ``ep``-way expert
    parallel, expert TP = tp)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, _DTYPES[cfg.dtype])
    kwargs = dict(
        num_layers=cfg.layers, hidden_size=cfg.hidden, ffn_hidden_size=cfg.ffn or cfg.moe_ffn,
        num_attention_heads=cfg.q_heads, num_query_groups=cfg.kv_heads, kv_channels=cfg.head_dim,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=cfg.qk_norm,
        tensor_model_parallel_size=tp, use_cpu_initialization=True,
        params_dtype=dtype, bf16=cfg.dtype == "bf16", fp16=cfg.dtype == "fp16",
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    if cfg.is_moe:
        kwargs.update(num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_ffn,
                      moe_router_topk=cfg.experts_per_token, expert_model_parallel_size=ep)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def gpt_model(cfg: "ModelConfig", tp: int, ep: int = 1, *, max_sequence_length: int = 64,
              float16_module: bool = True, **config_overrides: Any):
    """A Megatron-core GPTModel (local layer spec, RoPE) shaped as ``cfg``, inside
    :func:`megatron_world` (with the same ``tp`` and ``ep``). MoE configs get MoE layers of
    per-expert weights (``SequentialMLP``: ``local_experts.{i}`` numbered per EP rank).

    The vocabulary is padded as Megatron's training script pads it
    (:func:`megatron_padded_vocab`); the embeddings are tied when ``cfg.tied_embeddings``. With
    bf16/fp16 the model is wrapped in ``Float16Module`` as Megatron's ``get_model`` does, so every
    parameter (norms included) has the config's dtype; ``float16_module=False`` returns the bare
    GPTModel (whose local-spec norms then stay float32).

    Returns:
        (module, gpt): the module to hand to DDP and the bare GPTModel (for names and config).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:  # this rank's stage: Megatron's pre_process/post_process
        import torch

        config_overrides = {"pipeline_model_parallel_size": pp, "pipeline_dtype": torch.float32,
                            **config_overrides}
    config = transformer_config(cfg, tp, ep, **config_overrides)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts or None,
                                    qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    gpt = GPTModel(config=config, transformer_layer_spec=spec,
                   vocab_size=megatron_padded_vocab(cfg.vocab, tp),
                   max_sequence_length=max_sequence_length, position_embedding_type="rope",
                   share_embeddings_and_output_weights=cfg.tied_embeddings,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    if float16_module and cfg.dtype in ("bf16", "fp16"):
        return Float16Module(config, gpt), gpt
    return gpt, gpt


def causal_attention_mask(seq_len: int) -> "torch.Tensor":
    """Megatron's boolean attention mask for causal attention, shape [1, 1, s, s]: True where a
    query must not attend (the keys after it). Pass it as ``attention_mask`` to a GPTModel built
    with the local spec on CPU."""
    import torch

    return torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)[None, None]


@contextlib.contextmanager
def torch_norms_under_sequence_parallelism() -> Iterator[None]:
    """Megatron's local spec builds its norms with ``torch.nn.RMSNorm``, which refuses
    ``sequence_parallel`` (Transformer Engine's norms take it); Megatron runs MoE under TP only
    with it. Inside the block a local-spec norm is built as if sequence parallelism were off and
    its weight marked ``sequence_parallel``, as Megatron marks Transformer Engine's: each TP rank
    normalises its part of the sequence, and the weight's gradient is summed over TP."""
    import copy

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def build(cls, config, *args, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = build
    try:
        yield
    finally:
        torch_norm.WrappedTorchNorm.__new__ = original
