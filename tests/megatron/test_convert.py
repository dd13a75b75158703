"""HF Llama <-> Megatron GPT mapping: exact inverses, layout spot checks, TP sharding. No process
group, no Megatron import: pure tensor code."""

from __future__ import annotations

import pytest
import torch

from astraflow.training.megatron.convert import gather_shards, shard_for_rank, to_module_state
from astraflow.weightconv import (
    LlamaShape, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv, unstack_checkpoint,
)
from tests.megatron.helpers import tiny_llama_config

pytestmark = pytest.mark.timeout(60)  # pure tensor code: runs without megatron-core


def _hf_sd(tied: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return {k: v.clone() for k, v in LlamaForCausalLM(tiny_llama_config(tied)).state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_megatron_roundtrip_is_exact(tied):
    cfg = tiny_llama_config(tied)
    hf = _hf_sd(tied)
    meg = hf_to_megatron(hf, cfg)
    assert ("output_layer.weight" in meg) is (not tied)
    back = megatron_to_hf(meg, cfg)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    again = hf_to_megatron(back, cfg)
    assert set(again) == set(meg) and all(torch.equal(again[k], meg[k]) for k in meg)


def test_qkv_layout_groups_queries_with_their_kv_head():
    s = LlamaShape.from_hf_config(tiny_llama_config(False))  # 4 heads, 2 kv heads, head_dim 16
    h, per = s.head_dim, s.num_heads // s.num_kv_heads
    q = torch.arange(s.num_heads * h, dtype=torch.float32)[:, None].expand(-1, 3).clone()
    k = 1000 + torch.arange(s.num_kv_heads * h, dtype=torch.float32)[:, None].expand(-1, 3).clone()
    v = 2000 + torch.arange(s.num_kv_heads * h, dtype=torch.float32)[:, None].expand(-1, 3).clone()
    fused = fuse_qkv(q, k, v, s)
    group1 = fused[(per + 2) * h:]  # second query group: heads 2,3 then kv head 1
    assert torch.equal(group1[: per * h], q[per * h:])
    assert torch.equal(group1[per * h: per * h + h], k[h:])
    assert torch.equal(group1[per * h + h:], v[h:])
    q2, k2, v2 = split_qkv(fused, s)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_checkpoint_names_unstack_to_module_names():
    cfg = tiny_llama_config(False)
    meg = hf_to_megatron(_hf_sd(False), cfg)
    stacked = {
        "embedding.word_embeddings.weight": meg["embedding.word_embeddings.weight"],
        "decoder.final_layernorm.weight": meg["decoder.final_layernorm.weight"],
        "output_layer.weight": meg["output_layer.weight"],
    }
    for mod, ck in [("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                    ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight"),
                    ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight"),
                    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
                    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight")]:
        stacked[f"decoder.layers.{ck}"] = torch.stack([meg[f"decoder.layers.{i}.{mod}"] for i in range(2)])
    un = unstack_checkpoint(stacked, 2)
    assert set(un) == set(meg) and all(torch.equal(un[k], meg[k]) for k in meg)
    hf_a, hf_b = megatron_to_hf(stacked, cfg), megatron_to_hf(meg, cfg)
    assert all(torch.equal(hf_a[k], hf_b[k]) for k in hf_b)


def test_tp_shards_reassemble_the_full_tensor():
    meg = hf_to_megatron(_hf_sd(False), tiny_llama_config(False))
    shards = [shard_for_rank(meg, r, 2) for r in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(torch.cat([s[qkv] for s in shards]), meg[qkv])
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert torch.equal(torch.cat([s[proj] for s in shards], 1), meg[proj])
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    gate, up = meg[fc1].chunk(2)
    r1_gate, r1_up = shards[1][fc1].chunk(2)
    assert torch.equal(r1_gate, gate.chunk(2)[1]) and torch.equal(r1_up, up.chunk(2)[1])
    norm = "decoder.final_layernorm.weight"
    assert all(torch.equal(s[norm], meg[norm]) for s in shards)


def test_unsupported_configs_are_refused_with_a_reason():
    from transformers import Qwen2Config

    with pytest.raises(ValueError, match="LlamaConfig"):
        LlamaShape.from_hf_config(Qwen2Config(vocab_size=320, hidden_size=64, num_attention_heads=4))
    bad = tiny_llama_config(False).to_dict() | {"attention_bias": True}
    with pytest.raises(ValueError, match="bias"):
        LlamaShape.from_hf_config(bad)


def test_backend_config_names_the_fix(tmp_path):
    from astraflow.training.megatron.backend import MegatronBackendConfig

    with pytest.raises(ValueError, match="config.json"):
        MegatronBackendConfig(hf_checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="module:function"):
        MegatronBackendConfig(hf_checkpoint=str(tmp_path), loss_fn="grpo_loss")
    # the tensor-parallel size is checked by the trainer's config, which fills tp_size
    from astraflow.training.config import TrainerConfig

    with pytest.raises(ValueError, match="tensor_parallel"):
        TrainerConfig(backend="megatron", tensor_parallel=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_gathered_shards_are_the_full_state(tp):
    meg = hf_to_megatron(_hf_sd(False), tiny_llama_config(False))
    back = gather_shards([shard_for_rank(meg, r, tp) for r in range(tp)])
    assert set(back) == set(meg) and all(torch.equal(back[k], meg[k]) for k in meg)


def test_every_spelling_of_the_weights_becomes_module_names():
    cfg = tiny_llama_config(True)
    hf = _hf_sd(True)
    meg = hf_to_megatron(hf, cfg)
    stacked = {k: v for k, v in meg.items() if not k.startswith("decoder.layers.")}
    for name in ("input_layernorm.weight", "self_attention.linear_qkv.weight"):
        ck = "self_attention.linear_qkv.layer_norm_weight" if name == "input_layernorm.weight" else name
        stacked[f"decoder.layers.{ck}"] = torch.stack([meg[f"decoder.layers.{i}.{name}"] for i in range(2)])
    for spelling in (hf, meg):
        got = to_module_state(spelling, cfg)
        assert set(got) == set(meg) and all(torch.equal(got[k], meg[k]) for k in meg)
    got = to_module_state(stacked, cfg)  # checkpoint names: unstacked
    assert torch.equal(got["decoder.layers.1.input_layernorm.weight"], meg["decoder.layers.1.input_layernorm.weight"])
