"""HF Llama/Qwen2 <-> Megatron GPT mapping: exact inverses, layout spot checks (the fused QKV
weight and Qwen2's bias), TP sharding, the architectures refused. No process group, no Megatron
import: pure tensor code."""

from __future__ import annotations

import pytest
import torch

from astraflow.training.megatron.convert import gather_shards, shard_for_rank, to_module_state
from astraflow.weightconv import (
    GPTShape, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv, unstack_checkpoint,
)
from tests.megatron.helpers import tiny_llama_config, tiny_qwen2, tiny_qwen2_config

pytestmark = pytest.mark.timeout(60)  # pure tensor code: runs without megatron-core


def _hf_sd(tied: bool, arch: str = "llama"):
    from transformers import LlamaForCausalLM

    if arch == "qwen2":
        model = tiny_qwen2(tied)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_llama_config(tied))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _config(tied: bool, arch: str):
    return tiny_qwen2_config(tied) if arch == "qwen2" else tiny_llama_config(tied)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_megatron_roundtrip_is_exact(tied, arch):
    cfg = _config(tied, arch)
    hf = _hf_sd(tied, arch)
    meg = hf_to_megatron(hf, cfg)
    assert ("output_layer.weight" in meg) is (not tied)
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in meg) is (arch == "qwen2")
    back = megatron_to_hf(meg, cfg)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    again = hf_to_megatron(back, cfg)
    assert set(again) == set(meg) and all(torch.equal(again[k], meg[k]) for k in meg)


def test_qkv_layout_groups_queries_with_their_kv_head():
    s = GPTShape.from_hf_config(tiny_llama_config(False))  # 4 heads, 2 kv heads, head_dim 16
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpoint_names_unstack_to_module_names(arch):
    cfg = _config(False, arch)
    meg = hf_to_megatron(_hf_sd(False, arch), cfg)
    stacked = {
        "embedding.word_embeddings.weight": meg["embedding.word_embeddings.weight"],
        "decoder.final_layernorm.weight": meg["decoder.final_layernorm.weight"],
        "output_layer.weight": meg["output_layer.weight"],
    }
    names = [("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
             ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")]
    names += [(n, n) for n in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                               "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
    if arch == "qwen2":
        names.append(("self_attention.linear_qkv.bias",) * 2)
    for mod, ck in names:
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
    from transformers import MistralConfig

    with pytest.raises(ValueError, match=r"model_type 'mistral' is not supported .*supported: llama .* qwen2"):
        GPTShape.from_hf_config(MistralConfig(vocab_size=320, hidden_size=64, num_attention_heads=4))
    bad = tiny_llama_config(False).to_dict() | {"attention_bias": True}
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        GPTShape.from_hf_config(bad)
    with pytest.raises(ValueError, match=r"rope scaling \(yarn\) is not supported .*trainer.backend: torch"):
        GPTShape.from_hf_config(tiny_qwen2_config(False).to_dict()
                                | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}})


def test_qwen2_settings_reach_the_shape():
    from transformers import Qwen2Config

    s = GPTShape.from_hf_config(tiny_qwen2_config(True))
    assert s.qkv_bias and s.tie_word_embeddings and s.rope_theta == 1e6 and s.rms_norm_eps == 1e-6
    assert not GPTShape.from_hf_config(tiny_llama_config(True)).qkv_bias
    # a Qwen2.5 config.json as published: old-style rope_theta, sliding window switched off
    raw = {"model_type": "qwen2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6,
           "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 2}
    assert GPTShape.from_hf_config(raw).rope_theta == 1e6
    for sliding in (raw | {"use_sliding_window": True, "max_window_layers": 1},
                    Qwen2Config(**(raw | {"use_sliding_window": True, "max_window_layers": 1}))):
        with pytest.raises(ValueError, match="sliding-window attention"):
            GPTShape.from_hf_config(sliding)


def test_qwen2_bias_is_fused_and_sharded_like_its_weight_rows():
    cfg = tiny_qwen2_config(False)
    s = GPTShape.from_hf_config(cfg)  # 4 heads, 2 kv heads, head_dim 16: a group is 64 rows
    h, per = s.head_dim, s.num_heads // s.num_kv_heads
    hf = _hf_sd(False, "qwen2")
    meg = hf_to_megatron(hf, cfg)
    w, b = (meg[f"decoder.layers.0.self_attention.linear_qkv.{n}"] for n in ("weight", "bias"))
    assert b.shape == (w.shape[0],)
    q_b, k_b, v_b = (hf[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    group1 = b[(per + 2) * h:]  # second query group: query heads 2, 3, then kv head 1
    assert torch.equal(group1[: per * h], q_b[per * h:])
    assert torch.equal(group1[per * h: per * h + h], k_b[h:]) and torch.equal(group1[per * h + h:], v_b[h:])
    assert all(torch.equal(x, y) for x, y in zip(split_qkv(b, s), (q_b, k_b, v_b)))
    # each TP rank holds the bias of exactly the QKV rows (whole groups) it holds the weight of
    for tp in (1, 2):
        shards = [shard_for_rank(meg, r, tp) for r in range(tp)]
        for r, shard in enumerate(shards):
            rows = slice(r * w.shape[0] // tp, (r + 1) * w.shape[0] // tp)
            assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.bias"], b[rows])
            assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.weight"], w[rows])
        assert torch.equal(gather_shards(shards)["decoder.layers.0.self_attention.linear_qkv.bias"], b)


def test_load_hf_checkpoint_refuses_an_unsupported_architecture(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from astraflow.training.megatron.convert import load_hf_checkpoint

    MistralForCausalLM(MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="supported: llama"):
        load_hf_checkpoint(str(tmp_path))


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


def test_backend_config_makes_relative_paths_absolute(tmp_path, monkeypatch):
    """The ranks start in the backend's private work directory: a checkpoint or log directory
    relative to the caller's would name nothing there (the ranks then tried the HF hub)."""
    from astraflow.training.megatron.backend import MegatronBackendConfig

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    cfg = MegatronBackendConfig(hf_checkpoint="hf", log_dir="logs")
    assert cfg.hf_checkpoint == str(tmp_path / "hf") and cfg.log_dir == str(tmp_path / "logs")
    assert MegatronBackendConfig(hf_checkpoint=str(tmp_path / "hf")).log_dir is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_gathered_shards_are_the_full_state(tp, arch):
    meg = hf_to_megatron(_hf_sd(False, arch), _config(False, arch))
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
