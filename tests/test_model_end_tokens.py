"""A model with no token to end a generation on (a base LM saved without its eos): every turn
runs to max_new_tokens, which ``astraflow check`` and ``run`` say per policy."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from astraflow.preflight import models_that_never_stop
from tests.conftest import tiny_config


def _no_end_model(out):
    vocab = {c: i for i, c in enumerate("0123456789+= ")} | {"[UNK]": 13}  # no special token but unk
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(out)
    config = GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=None, eos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def test_a_model_without_an_end_token_is_named_with_the_fix(tmp_path):
    model = _no_end_model(tmp_path / "gpt2-no-eos")
    assert json.loads((model / "config.json").read_text()).get("eos_token_id") is None
    lines = models_that_never_stop(tiny_config(model))
    assert len(lines) == 1 and lines[0].startswith(f"policy solver: {model} has no end-of-sequence token")
    assert "runs to workload.sampling.max_new_tokens (4)" in lines[0] and "eos_token" in lines[0]


def test_a_model_with_an_end_token_says_nothing(tiny_model):
    assert models_that_never_stop(tiny_config(tiny_model)) == []
