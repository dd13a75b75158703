"""Load HF Llama/Qwen2 weights into a (tensor-parallel) Megatron GPTModel, and read them back.

The HF <-> Megatron *name and layout* mapping lives in ``astraflow.weightconv`` (RaaS nodes need
it too); this module adds what only the trainer needs: cutting a full Megatron tensor into the
shard a tensor-parallel rank holds (and putting the shards back together), and loading those
shards into the module.

Tensor-parallel split of each Megatron tensor (``tp`` ranks, rank ``r``):

* column-parallel (``embedding.word_embeddings``, ``output_layer``, ``linear_qkv`` and its Qwen2
  bias): rows split in ``tp`` contiguous chunks (QKV rows are grouped per KV head, so each rank
  gets whole groups, the bias the same rows as the weight);
* ``linear_fc1`` (SwiGLU): rank ``r`` holds ``[gate_r; up_r]``, the r-th chunk of gate and of up;
* row-parallel (``linear_proj``, ``linear_fc2``): columns split in ``tp`` chunks;
* norms: replicated.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from astraflow.weightconv import GPTShape, hf_to_megatron, is_checkpoint_layout, unstack_checkpoint

_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight",
         "self_attention.linear_qkv.bias")
_COLS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_FC1 = "mlp.linear_fc1.weight"


def shard_for_rank(full: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """The tensors tensor-parallel rank ``tp_rank`` holds, from a full (TP=1) module state dict."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    out = {}
    for name, t in full.items():
        if name.endswith(_FC1):
            gate, up = torch.chunk(t, 2, dim=0)
            out[name] = torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
        elif name.endswith(_ROWS):
            out[name] = t.chunk(tp_size, 0)[tp_rank]
        elif name.endswith(_COLS):
            out[name] = t.chunk(tp_size, 1)[tp_rank]
        else:
            out[name] = t
        out[name] = out[name].contiguous()
    return out


def gather_shards(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full (TP=1) module state dict from every tensor-parallel rank's tensors, given in rank
    order: the inverse of ``shard_for_rank``."""
    out = {}
    for name, first in shards[0].items():
        parts = [s[name] for s in shards]
        if name.endswith(_FC1):
            halves = [p.chunk(2, 0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        elif name.endswith(_ROWS):
            out[name] = torch.cat(parts, 0)
        elif name.endswith(_COLS):
            out[name] = torch.cat(parts, 1)
        else:
            out[name] = first
    return out


def to_module_state(state: Mapping[str, Any], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full Megatron *module*-named tensors from weights in any spelling a resume meets: HF names
    (``MegatronBackend.state_dict``, saved as master weights), Megatron *checkpoint* names (a
    version this backend published, as ``WeightStore.load`` reads it) or module names."""
    if "model.embed_tokens.weight" in state:
        return hf_to_megatron(state, hf_config)
    if is_checkpoint_layout(state):
        return unstack_checkpoint(state, GPTShape.from_hf_config(hf_config).num_layers)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def check_shard(shard: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]], rank: int) -> None:
    """``ValueError`` unless ``shard`` has exactly the tensors ``shapes`` names (a rank's
    parameters), each of its shape."""
    if set(shard) != set(shapes):
        raise ValueError(
            f"weights do not match the Megatron model of rank {rank}: missing "
            f"{sorted(set(shapes) - set(shard))[:5]}, unexpected {sorted(set(shard) - set(shapes))[:5]}"
        )
    for name, t in shard.items():
        if tuple(t.shape) != tuple(shapes[name]):
            raise ValueError(f"{name}: the weights give {tuple(t.shape)}, rank {rank}'s model has "
                             f"{tuple(shapes[name])}")


def load_shard_into(model: torch.nn.Module, shard: Mapping[str, torch.Tensor], rank: int) -> None:
    """Copy this rank's tensors into the model, cast to its parameters' dtype and device
    (strict except ``_extra_state``)."""
    own = model.state_dict()
    check_shard(shard, {k: v.shape for k, v in own.items() if isinstance(v, torch.Tensor)}, rank)
    with torch.no_grad():
        for name, t in shard.items():
            own[name].copy_(t)


def load_hf_state_into(model: torch.nn.Module, hf_sd: Mapping[str, torch.Tensor], hf_config: Any,
                       tp_rank: int, tp_size: int) -> None:
    """Copy an HF Llama/Qwen2 state dict into this rank's Megatron model (strict except ``_extra_state``)."""
    load_shard_into(model, shard_for_rank(hf_to_megatron(hf_sd, hf_config), tp_rank, tp_size), tp_rank)


def load_hf_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], Any]:
    """(state dict in fp32, config) of an HF Llama or Qwen2 checkpoint directory, read offline."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    GPTShape.from_hf_config(config)  # fail early, with a clear message, on unsupported configs
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, config
