"""Build a Megatron-core ``GPTModel`` equivalent to an HF Llama or Qwen2 config, and start its
process group.

The trainer keeps HF checkpoints as its interchange format (rollout engines load HF layouts); the
Megatron model is built from the same config so that the HF <-> Megatron conversion in
``astraflow.weightconv`` is exact. Supported is what a Llama block has: RMSNorm (the config's
eps), RoPE (non-interleaved, full head, the config's ``rope_theta``), GQA, SwiGLU MLP, tied or
separate output head; plus Qwen2's q/k/v biases (``add_qkv_bias``). Anything else in the config
(rope scaling, other biases, sliding windows, other architectures) raises ``ValueError``
(``GPTShape.from_hf_config``) instead of silently building a different model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch

from astraflow.training.megatron.cpu_standins import apply_cpu_standins, seed_model_parallel_rng
from astraflow.weightconv import GPTShape


@dataclass(frozen=True)
class DistSpec:
    """Where a rank process finds its peers. Written by the backend that launches the ranks,
    read by each rank's ``init_distributed``."""

    #: this process's rank in [0, world_size).
    rank: int
    #: number of rank processes: tp_size * dp_size (no pipeline parallelism).
    world_size: int
    #: torch.distributed rendezvous: ``file://<path>`` (one host or a shared file system, no
    #: port to pick) or ``tcp://host:port`` / ``env://`` under torchrun or srun.
    init_method: str
    #: tensor-parallel size; must divide the number of KV heads and the vocabulary.
    tp_size: int
    #: data-parallel size: replicas of the tensor-parallel group, each training on its share
    #: of a batch. Megatron's rank order puts tensor-parallel ranks next to each other:
    #: rank = dp_rank * tp_size + tp_rank.
    dp_size: int = 1


def init_distributed(spec: DistSpec, timeout_s: float = 120.0) -> torch.device:
    """Initialise ``torch.distributed`` (gloo on CPU, NCCL on GPU) and Megatron's parallel state.

    Returns the device this rank computes on. Must run before ``build_gpt_model``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if spec.world_size != spec.tp_size * spec.dp_size:
        raise ValueError(
            f"world_size={spec.world_size} but tp_size={spec.tp_size} x dp_size={spec.dp_size}: the "
            "Megatron backend runs dp_size replicas of one tensor-parallel group (no pipeline "
            "parallelism); launch tp_size * dp_size ranks"
        )
    if torch.cuda.is_available():
        backend = "nccl"
        local = int(os.environ.get("LOCAL_RANK", spec.rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        backend = "gloo"
        apply_cpu_standins()
        device = torch.device("cpu")
    dist.init_process_group(
        backend=backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    # the data-parallel size is what the world leaves: world_size / tp_size
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec.tp_size)
    return device


def shutdown_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def transformer_config(shape: GPTShape, tp_size: int, params_dtype: torch.dtype = torch.float32):
    """The Megatron ``TransformerConfig`` of an HF shape (dropout 0, no fusions needing apex/TE).
    Qwen2's q/k/v biases are ``add_qkv_bias``; ``add_bias_linear`` (every other linear) stays off."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    problem = shape.tensor_parallel_problem(tp_size)
    if problem:
        raise ValueError(problem)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt_model(hf_config: Any | Mapping[str, Any], tp_size: int, seed: int = 0,
                    params_dtype: torch.dtype = torch.float32):
    """A Megatron ``GPTModel`` (local layer spec) with the architecture of an HF Llama or Qwen2
    config; the output layer shares the embedding exactly when ``tie_word_embeddings`` says so.

    Call after ``init_distributed`` (Megatron needs its parallel state even for TP=1). Weights
    are randomly initialised; load real ones with ``astraflow.training.megatron.convert``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    shape = GPTShape.from_hf_config(hf_config)
    seed_model_parallel_rng(seed)
    config = transformer_config(shape, tp_size, params_dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=shape.rope_theta,
    )
    if torch.cuda.is_available():
        model = model.cuda()
    return model
