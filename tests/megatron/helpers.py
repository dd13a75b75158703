"""Shared pieces of the Megatron tests: tiny offline Llama and Qwen2 models, a GRPO loss fallback, a weight-store
stand-in with the lead's ``staging``/``commit`` API, and synthetic GRPO batches.

The real ``astraflow.training.grpo`` and ``storage.weights.WeightStore`` are written on other
branches; the tests use them when present and these small stand-ins otherwise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from astraflow.batches import Batch, BatchItem
from astraflow.contracts import Sequence, WeightVersion
from storage import paths

VOCAB = 320


def tiny_llama_config(tied: bool, layers: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def save_tiny_llama(out_dir: Path, tied: bool, seed: int = 0) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tied))
    model.save_pretrained(out_dir)
    return out_dir


def tiny_qwen2_config(tied: bool, layers: int = 2):
    """The Qwen2 counterpart of ``tiny_llama_config``, with Qwen2's own rope base and a norm eps
    unlike Megatron's default, so that a setting the conversion drops shows in the parity."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def tiny_qwen2(tied: bool, seed: int = 0):
    """A random tiny ``Qwen2ForCausalLM``. HF initialises the q/k/v biases to zero and the norms
    to one, where a wrong mapping of them would not show; here they are random too."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(tied))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    return model


def save_tiny_qwen2(out_dir: Path, tied: bool, seed: int = 0) -> Path:
    tiny_qwen2(tied, seed).save_pretrained(out_dir)
    return out_dir


def loss_fn_name() -> str:
    """The real GRPO loss when it is on this branch, else the fallback below."""
    try:
        import astraflow.training.grpo  # noqa: F401
    except ModuleNotFoundError:
        return "tests.megatron.helpers:grpo_loss_fallback"
    return "astraflow.training.grpo:grpo_loss"


def grpo_loss_fallback(new_logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """Clipped-ratio GRPO objective, token mean (test fallback for astraflow.training.grpo)."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    adv = advantages[:, None]
    obj = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)
    return -(obj * mask).sum() / mask.sum().clamp_min(1)


class MiniStore:
    """Stand-in for ``storage.weights.WeightStore``'s writer half (same method names)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def staging(self, policy: str, version: int) -> Path:
        d = paths.staging_dir(self.root, policy, version)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def commit(self, policy: str, version: int, meta: dict) -> WeightVersion:
        final = paths.version_dir(self.root, policy, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.staging(policy, version), final)
        manifest = paths.manifest_file(self.root, policy, version)
        manifest.write_text(json.dumps({"policy": policy, "version": version, "meta": meta}))
        paths.commit_file(self.root, policy, version).write_text("ok")
        return WeightVersion(policy=policy, version=version, manifest_path=str(manifest),
                             committed_at=time.time())


def prompts(seed: int = 1, batch: int = 4, length: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length)).astype(np.int64)


def grpo_batch(tokens: np.ndarray, behaviour_lp: np.ndarray, prompt_len: int = 4, seed: int = 2) -> Batch:
    """A GRPO batch (one group) over ``tokens``; ``behaviour_lp`` is ``[B, T-1]`` for tokens[:, 1:]."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=len(tokens))
    mean, std = float(rewards.mean()), float(rewards.std())
    items = []
    for i, toks in enumerate(tokens):
        n = len(toks)
        gen = np.arange(n) >= prompt_len
        lp = np.zeros(n, np.float32)
        lp[1:] = behaviour_lp[i]
        lp[~gen] = 0.0
        seq = Sequence.build(toks, gen, lp, np.where(gen, 0, -1), np.where(gen, 0, -1), rewards[i])
        items.append(BatchItem(sequence=seq, loss_mask=gen, group_mean=mean, group_std=std,
                               group_size=len(tokens), staleness=0, task_id=f"g/{i}"))
    return Batch(policy="p", version=0, items=tuple(items))


def hf_logprobs(hf_sd: dict, hf_config, tokens: np.ndarray) -> np.ndarray:
    """log p(tokens[:, t+1] | prefix) under the HF model of ``hf_config`` (Llama, Qwen2) holding
    ``hf_sd`` (strict load)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    model.load_state_dict(hf_sd, strict=True)
    t = torch.as_tensor(tokens)
    with torch.no_grad():
        logits = model(t[:, :-1]).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, t[:, 1:, None])[..., 0].numpy()


def torch_probe(hf_sd: dict, hf_config) -> dict:
    """The probe the torch backend publishes for weights ``hf_sd`` (``astraflow.probe.make_probe``
    on the HF model of ``hf_config``, the weights upcast to fp32)."""
    from transformers import AutoModelForCausalLM

    from astraflow.probe import make_probe

    return make_probe(AutoModelForCausalLM.from_config(hf_config).float(), hf_sd)


def keyword_num_tokens_loss(new_logprobs, old_logprobs, advantages, mask, clip_low, clip_high, *, num_tokens):
    """A loss of a user's with the documented contract (``num_tokens`` keyword-only, required),
    the built-in one underneath, plus a statistic that shows it ran."""
    from astraflow.training.grpo import grpo_loss

    loss, stats = grpo_loss(new_logprobs, old_logprobs, advantages, mask, clip_low, clip_high, num_tokens=num_tokens)
    return loss, {**stats, "user_loss_num_tokens": float(num_tokens)}
