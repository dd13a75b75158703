"""Name and layout mapping between HF decoder state dicts (Llama, Qwen2) and Megatron-core GPT ones.

Neutral ground for both sides of weight sync: the trainer (``training/megatron``) converts an HF
checkpoint into Megatron to start from it, and RaaS nodes (``rollout/``) convert a committed
Megatron checkpoint back into the HF layout their engine loads. Neither package may import the
other, so the mapping lives here. Pure tensor code: no Megatron import, no process group.

Supported HF architectures (``SUPPORTED_MODEL_TYPES``): ``llama`` (no biases) and ``qwen2`` (the
Llama block plus q/k/v projection biases). Both: RMSNorm, RoPE without scaling, GQA, SwiGLU MLP,
tied or separate output head. Anything else is refused by ``GPTShape.from_hf_config``.

Layouts (``L`` layers, ``G`` query groups = KV heads, ``h`` = head_dim, ``q = heads // G``):

* fused QKV ``linear_qkv.weight`` is ``[G * (q + 2) * h, hidden]``, per group the group's ``q``
  query heads, then its key head, then its value head; the Qwen2 bias ``linear_qkv.bias`` is
  ``[G * (q + 2) * h]`` in the same row order;
* ``linear_fc1.weight`` is ``[gate; up]`` (SwiGLU), ``[2 * ffn, hidden]``;
* with tied embeddings Megatron has no ``output_layer.weight``; HF's ``lm_head.weight`` is the
  embedding.

Megatron state dicts come in two spellings and ``megatron_to_hf`` accepts both:

* *module* names (``model.state_dict()``): ``decoder.layers.<i>.input_layernorm.weight`` ...;
* *checkpoint* names (``dist_checkpointing`` / DCP, what the weight store holds): layers stacked
  on a leading axis, ``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[L, ...]``,
  and the norms renamed to ``...linear_qkv.layer_norm_weight`` / ``...linear_fc1.layer_norm_weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

Tensor = torch.Tensor


#: HF ``model_type``s the conversion (and so the Megatron backend) supports.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class GPTShape:
    """The architecture numbers of a supported HF decoder that both layouts need."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    #: the q/k/v projections have biases (Qwen2); the output projection and the MLP never do.
    qkv_bias: bool = False

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Why Megatron cannot shard this shape over ``tp`` tensor-parallel ranks (None: it can)."""
        if self.num_kv_heads % tp or self.num_heads % tp:
            return (f"tensor-parallel size {tp} must divide num_attention_heads={self.num_heads} and "
                    f"num_key_value_heads={self.num_kv_heads}: choose a TP size that divides both")
        if self.vocab_size % tp:
            return (f"vocab_size={self.vocab_size} is not divisible by tensor-parallel size {tp}: "
                    "pad the tokenizer's vocabulary (e.g. to a multiple of 64) or change TP")
        if self.intermediate_size % tp:
            return f"intermediate_size={self.intermediate_size} is not divisible by tensor-parallel size {tp}"
        return None

    @classmethod
    def from_hf_config(cls, config: Any | Mapping[str, Any]) -> "GPTShape":
        """From a ``transformers`` config object or its ``to_dict()``. ``ValueError`` naming the
        reason for an architecture, or a feature of one, that the Megatron GPT model does not have."""
        c = dict(config) if isinstance(config, Mapping) else config.to_dict()
        model_type = c.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported by the Megatron conversion; supported: "
                "llama (LlamaForCausalLM, no biases) and qwen2 (Qwen2ForCausalLM, q/k/v biases). "
                "Train other architectures with trainer.backend: torch"
            )
        heads = int(c["num_attention_heads"])
        layers = int(c["num_hidden_layers"])
        if model_type == "llama":
            # Megatron has one switch for every linear bias (add_bias_linear) and one for q/k/v
            # only; Llama's attention_bias (q/k/v and o) and mlp_bias fit neither
            for key in ("attention_bias", "mlp_bias"):
                if c.get(key):
                    raise ValueError(f"Llama {key}=True is not supported by the Megatron conversion "
                                     "(only q/k/v biases, as Qwen2 has, are)")
        elif _qwen2_sliding_window(c, layers):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window with max_window_layers < "
                             "num_hidden_layers) is not supported by the Megatron conversion: every layer "
                             "must attend to the full context")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={c['hidden_act']!r}: only SwiGLU (silu) is supported")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or c.get("rope_scaling"):
            kind = rope.get("rope_type") if rope.get("rope_type", "default") != "default" else \
                (c.get("rope_scaling") or {}).get("rope_type") or (c.get("rope_scaling") or {}).get("type")
            raise ValueError(f"rope scaling ({kind or 'set'}) is not supported by the Megatron conversion: train "
                             "this model with trainer.backend: torch")
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        kv = int(c.get("num_key_value_heads") or heads)
        if heads % kv:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        return cls(
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
        )


def _qwen2_sliding_window(c: Mapping[str, Any], layers: int) -> bool:
    """Whether a Qwen2 config has sliding-window layers: ``layer_types`` says so where the config
    object filled it in; a raw ``config.json`` may only have the switches it is derived from."""
    types = c.get("layer_types")
    if types is not None:
        return "sliding_attention" in types
    return bool(c.get("use_sliding_window")) and c.get("sliding_window") is not None \
        and int(c.get("max_window_layers", layers)) < layers


# per-layer names: (megatron module suffix, megatron checkpoint suffix, hf suffix); the fused
# tensors (qkv, fc1) are handled separately.
_LAYER_SIMPLE = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)
_QKV = "self_attention.linear_qkv.weight"
_QKV_BIAS = "self_attention.linear_qkv.bias"
_FC1 = "mlp.linear_fc1.weight"
_STACKED_PER_LAYER = tuple(ck for _, ck, _ in _LAYER_SIMPLE) + (_QKV, _QKV_BIAS, _FC1)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: GPTShape) -> Tensor:
    """HF q/k/v projections -> Megatron fused QKV (grouped per KV head). Weights (``[rows,
    hidden]``) and biases (``[rows]``) alike: only the leading (output) axis is regrouped."""
    g, h, rest = shape.num_kv_heads, shape.head_dim, tuple(q.shape[1:])
    per = shape.num_heads // g
    return torch.cat(
        [q.reshape(g, per * h, *rest), k.reshape(g, h, *rest), v.reshape(g, h, *rest)], dim=1
    ).reshape(g * (per + 2) * h, *rest)


def split_qkv(qkv: Tensor, shape: GPTShape) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron fused QKV weight or bias -> HF q, k, v projections (the inverse of ``fuse_qkv``)."""
    g, h, rest = shape.num_kv_heads, shape.head_dim, tuple(qkv.shape[1:])
    per = shape.num_heads // g
    grouped = qkv.reshape(g, (per + 2) * h, *rest)
    q, k, v = torch.split(grouped, [per * h, h, h], dim=1)
    return (
        q.reshape(g * per * h, *rest).contiguous(),
        k.reshape(g * h, *rest).contiguous(),
        v.reshape(g * h, *rest).contiguous(),
    )


def hf_to_megatron(hf_sd: Mapping[str, Tensor], hf_config: Any | Mapping[str, Any]) -> dict[str, Tensor]:
    """HF Llama/Qwen2 state dict -> Megatron GPT state dict in *module* names (unsharded, TP=1)."""
    s = GPTShape.from_hf_config(hf_config)
    out = {"embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"]}
    for i in range(s.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mod, _ck, hf in _LAYER_SIMPLE:
            out[mp + mod] = hf_sd[hp + hf]
        attn = hp + "self_attn."
        out[mp + _QKV] = fuse_qkv(*(hf_sd[f"{attn}{p}_proj.weight"] for p in "qkv"), s)
        if s.qkv_bias:
            out[mp + _QKV_BIAS] = fuse_qkv(*(hf_sd[f"{attn}{p}_proj.bias"] for p in "qkv"), s)
        out[mp + _FC1] = torch.cat([hf_sd[hp + "mlp.gate_proj.weight"], hf_sd[hp + "mlp.up_proj.weight"]], 0)
    out["decoder.final_layernorm.weight"] = hf_sd["model.norm.weight"]
    if not s.tie_word_embeddings:
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    return out


def unstack_checkpoint(sd: Mapping[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Megatron *checkpoint* names (stacked layers) -> *module* names (one entry per layer).

    Entries that are not tensors (Megatron's ``_extra_state`` objects) are dropped."""
    ck_to_mod = {ck: mod for mod, ck, _ in _LAYER_SIMPLE}
    for name in (_QKV, _QKV_BIAS, _FC1):
        ck_to_mod[name] = name
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if not isinstance(t, Tensor):
            continue
        if name.startswith("decoder.layers."):
            suffix = name[len("decoder.layers."):]
            if suffix not in ck_to_mod:
                raise ValueError(f"unexpected stacked Megatron tensor {name!r}")
            if t.shape[0] != num_layers:
                raise ValueError(f"{name}: {t.shape[0]} stacked layers but the config has {num_layers}")
            for i in range(num_layers):
                out[f"decoder.layers.{i}.{ck_to_mod[suffix]}"] = t[i]
        else:
            out[name] = t
    return out


def is_checkpoint_layout(sd: Mapping[str, Any]) -> bool:
    return any(f"decoder.layers.{ck}" in sd for ck in _STACKED_PER_LAYER)


def megatron_to_hf(sd: Mapping[str, Tensor], hf_config: Any | Mapping[str, Any]) -> dict[str, Tensor]:
    """Megatron GPT state dict (module or checkpoint names, unsharded) -> HF Llama/Qwen2 state dict.

    The exact inverse of ``hf_to_megatron``. For tied embeddings ``lm_head.weight`` is the same
    tensor as ``model.embed_tokens.weight`` (what HF's ``state_dict()`` of a tied model holds).
    """
    s = GPTShape.from_hf_config(hf_config)
    if is_checkpoint_layout(sd):
        sd = unstack_checkpoint(sd, s.num_layers)
    emb = sd["embedding.word_embeddings.weight"]
    out = {"model.embed_tokens.weight": emb}
    for i in range(s.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mod, _ck, hf in _LAYER_SIMPLE:
            out[hp + hf] = sd[mp + mod]
        for p, t in zip("qkv", split_qkv(sd[mp + _QKV], s)):
            out[f"{hp}self_attn.{p}_proj.weight"] = t
        if s.qkv_bias:
            for p, t in zip("qkv", split_qkv(sd[mp + _QKV_BIAS], s)):
                out[f"{hp}self_attn.{p}_proj.bias"] = t
        gate, up = torch.chunk(sd[mp + _FC1], 2, dim=0)
        out[hp + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hp + "mlp.up_proj.weight"] = up.contiguous()
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = emb if s.tie_word_embeddings else sd["output_layer.weight"]
    return out


def to_hf_state_dict(state: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """A committed version's tensors in the HF layout an engine loads, whatever the trainer
    published: ``meta["layout"]`` is ``hf`` (the PyTorch backend: nothing to do) or
    ``megatron`` (Megatron-core shards: names and fused layouts mapped back, using
    ``meta["hf_config"]``)."""
    layout = meta.get("layout", "hf")
    if layout == "hf":
        return dict(state)
    if layout == "megatron":
        return megatron_to_hf(state, meta["hf_config"])
    raise ValueError(f"unknown weight layout {layout!r} in the manifest; known: hf, megatron")
