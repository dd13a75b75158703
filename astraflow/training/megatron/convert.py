"""Load HF Llama weights into a (tensor-parallel) Megatron GPTModel, and read them back.

The HF <-> Megatron *name and layout* mapping lives in ``astraflow.weightconv`` (RaaS nodes need
it too); this module adds what only the trainer needs: cutting a full Megatron tensor into the
shard a tensor-parallel rank holds, and loading those shards into the module.

Tensor-parallel split of each Megatron tensor (``tp`` ranks, rank ``r``):

* column-parallel (``embedding.word_embeddings``, ``output_layer``, ``linear_qkv``): rows split
  in ``tp`` contiguous chunks (QKV rows are grouped per KV head, so each rank gets whole groups);
* ``linear_fc1`` (SwiGLU): rank ``r`` holds ``[gate_r; up_r]``, the r-th chunk of gate and of up;
* row-parallel (``linear_proj``, ``linear_fc2``): columns split in ``tp`` chunks;
* norms: replicated.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from astraflow.weightconv import LlamaShape, hf_to_megatron, megatron_to_hf  # noqa: F401 (re-exported)

_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.linear_qkv.weight")
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


def load_hf_state_into(model: torch.nn.Module, hf_sd: Mapping[str, torch.Tensor], hf_config: Any,
                       tp_rank: int, tp_size: int) -> None:
    """Copy an HF Llama state dict into this rank's Megatron model (strict except ``_extra_state``)."""
    mine = shard_for_rank(hf_to_megatron(hf_sd, hf_config), tp_rank, tp_size)
    own = model.state_dict()
    expected = {k for k, v in own.items() if isinstance(v, torch.Tensor)}
    if set(mine) != expected:
        raise ValueError(
            "HF checkpoint does not match the Megatron model: missing "
            f"{sorted(expected - set(mine))[:5]}, unexpected {sorted(set(mine) - expected)[:5]}"
        )
    with torch.no_grad():
        for name, t in mine.items():
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: HF gives {tuple(t.shape)}, model has {tuple(own[name].shape)}")
            own[name].copy_(t)


def load_hf_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], Any]:
    """(state dict in fp32, config) of an HF Llama checkpoint directory, read offline."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(path)
    LlamaShape.from_hf_config(config)  # fail early, with a clear message, on unsupported configs
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, config
