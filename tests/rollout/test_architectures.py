"""Checkpoints that are neither Llama nor Qwen2: the HF engine samples from the model's own
distribution (its cached decoding step checked against the full forward at start, switched
where a state-space model reads the step's mask as its inputs'), refuses what it cannot decode
with the fix, and the probe and the position checks read any family's config."""

from __future__ import annotations

import asyncio

import pytest
import torch

from astraflow.models import build_tokenizer
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.training.grpo import token_logprobs

PROMPTS = ["1+2=", "What is 3 + 4? Answer: ", "x", "The quick brown fox. 7+8="]


def _model(config_cls, **kw):
    """A tiny random model of ``config_cls`` with the byte tokenizer, as an object pair."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    ids = dict(vocab_size=320, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**ids, **kw))
    with torch.no_grad():  # sharper than at initialisation: the next token depends on the context
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model, tok


def _engine_vs_trainer(engine: HFEngine) -> float:
    """Largest gap between the engine's sampled log-probs and the trainer's teacher-forced ones;
    every prompt twice, as a group's samples share theirs (the shared prefill, or its fallback)."""
    tok = engine.tokenizer
    prompts = [tok.encode(s, add_special_tokens=False) for s in PROMPTS] * 2

    async def go():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=16, temperature=1.0))
                                      for p in prompts])

    gens = asyncio.run(go())
    seqs = [p + list(g.tokens) for p, g in zip(prompts, gens)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), engine._pad_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        lp = token_logprobs(engine.model, ids, mask)
    return max(float((lp[i, len(p):len(p) + len(g.tokens)] - torch.tensor(g.logprobs)).abs().max())
               for i, (p, g) in enumerate(zip(prompts, gens)))


def test_a_state_space_model_decodes_its_own_distribution():
    from transformers import MambaConfig

    model, tok = _model(MambaConfig, hidden_size=64, num_hidden_layers=2, state_size=8)
    engine = HFEngine(model, tokenizer=tok, device="cpu", seed=1)
    assert engine._step_mask_only  # the full row's mask in a cached step corrupts its state
    assert _engine_vs_trainer(engine) < 1e-3
    assert not engine.share_prefill  # its cache holds states, not rows of keys and values: every row forwarded


def test_an_attention_model_keeps_the_full_mask_and_matches():
    from transformers import GPT2Config

    model, tok = _model(GPT2Config, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    engine = HFEngine(model, tokenizer=tok, device="cpu", seed=1)
    assert not engine._step_mask_only and _engine_vs_trainer(engine) < 1e-3
    assert engine.share_prefill and engine.stats()["prefill_rows"] == len(PROMPTS)


def test_a_model_that_fails_in_bf16_is_refused_naming_fp32():
    from transformers import XGLMConfig

    model, tok = _model(XGLMConfig, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128,
                        max_position_embeddings=512)
    HFEngine(model, tokenizer=tok, device="cpu")  # fp32 serves it
    with pytest.raises(ValueError, match=r"cannot decode xglm models in bf16 .*set rollout.engine.dtype: fp32"):
        HFEngine(model, tokenizer=tok, device="cpu", dtype="bf16")


def test_an_architecture_without_a_cache_is_refused():
    from transformers import RecurrentGemmaConfig

    model, tok = _model(RecurrentGemmaConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, lru_width=64, attention_window_size=16)
    with pytest.raises(ValueError, match="cannot decode recurrent_gemma models .*cannot be served by the HF engine: "
                                         "serve it with rollout.engine.type: vllm where vLLM supports it, or train"):
        HFEngine(model, tokenizer=tok, device="cpu")


def test_the_probe_of_a_multimodal_model_and_of_a_short_one():
    from transformers import Gemma3Config, Gemma3TextConfig, GPT2Config, SiglipVisionConfig

    from astraflow.probe import PROBE_LEN, make_probe

    text = Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, head_dim=16, vocab_size=320, max_position_embeddings=128)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    from transformers import AutoModelForCausalLM

    mm = AutoModelForCausalLM.from_config(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                       image_token_index=319, boi_token_index=318,
                                                       eoi_token_index=317))
    assert len(make_probe(mm)["logprobs"]) == PROBE_LEN - 1  # the vocabulary of its text config
    short, _ = _model(GPT2Config, n_embd=32, n_layer=1, n_head=2, n_positions=20)
    assert len(make_probe(short)["tokens"]) == 20


@pytest.mark.parametrize("config, positions", [
    ({"max_position_embeddings": 512}, 512),
    ({"n_positions": 1024, "n_ctx": 1024}, 1024),  # GPT-2 and its kin
    ({"text_config": {"max_position_embeddings": 8192}}, 8192),  # a multimodal model's language part
    ({"vocab_size": 10}, None),
])
def test_positions_of_any_family(config, positions):
    from astraflow.context_fit import max_positions

    assert max_positions(config) == positions


def test_the_vllm_engine_stops_on_an_eos_list_given_in_config_json_alone(tmp_path):
    """As the HF engine does: transformers reads config.json's eos where there is no generation config."""
    import json
    from types import SimpleNamespace

    from astraflow.rollout.vllm_engine import VLLMEngine

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [262, 263]}))
    assert {262, 263} <= VLLMEngine._stops(SimpleNamespace(tokenizer=build_tokenizer()), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 264}))
    stops = VLLMEngine._stops(SimpleNamespace(tokenizer=build_tokenizer()), tmp_path)
    assert 264 in stops and 262 not in stops
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))  # none: none from config.json
    assert not {262, 263} & VLLMEngine._stops(SimpleNamespace(tokenizer=build_tokenizer()), tmp_path)


def test_a_model_handed_over_in_bf16_is_checked_too():
    from transformers import MambaConfig

    model, tok = _model(MambaConfig, hidden_size=64, num_hidden_layers=2, state_size=8)
    engine = HFEngine(model.to(torch.bfloat16), tokenizer=tok, device="cpu", seed=1)
    assert engine._step_mask_only
