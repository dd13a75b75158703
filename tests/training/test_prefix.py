"""The trainer forwards each distinct prompt once (``training.prefix``): the same log-probs and
gradients as the plain forward, on any layout of prompts and completions; off, with a warning,
where a model's cache cannot be repeated by row or its cached forward disagrees."""

from __future__ import annotations

import logging

import pytest
import torch

from astraflow.models import build_tokenizer
from astraflow.training.grpo import token_logprobs
from astraflow.training.prefix import PrefixSharing, layout, shared_logprobs


def _model(config_cls, **kw):
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(
        vocab_size=320, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **kw)).eval()


def _llama():
    from transformers import LlamaConfig

    return _model(LlamaConfig, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _batch(groups=((7, 3), (12, 4), (3, 2)), seed=0, multi_turn=False):
    """Right-padded rows: per group ``(prompt length, samples)``, completions of 1-6 tokens; one
    row without any loss token; ``multi_turn``: an untrained observation inside each completion."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for plen, n in groups:
        prompt = torch.randint(5, 300, (plen,), generator=g)
        for _ in range(n):
            comp = torch.randint(5, 300, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
            mask = torch.ones(len(comp), dtype=torch.bool)
            if multi_turn:
                obs = torch.randint(5, 300, (3,), generator=g)
                comp, mask = torch.cat([comp, obs, comp]), torch.cat([mask, torch.zeros(3, dtype=torch.bool), mask])
            rows.append((prompt, comp, mask))
    rows.append((torch.randint(5, 300, (5,), generator=g), torch.tensor([9, 9]), torch.zeros(2, dtype=torch.bool)))
    T = max(len(p) + len(c) for p, c, _ in rows)
    tok, att, lm = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long), \
        torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (p, c, m) in enumerate(rows):
        n = len(p) + len(c)
        tok[i, :n], att[i, :n], lm[i, len(p):n] = torch.cat([p, c]), 1, m
    return tok, att, lm


def _after_prefix(lay, att, lm):
    """Every position after the prefix of each row with loss tokens (where shared log-probs are
    defined; a row without any is 0 throughout)."""
    return (torch.arange(att.shape[1]) >= lay.start[:, None]) & att.bool() & lm.any(-1, keepdim=True)


@pytest.mark.parametrize("multi_turn", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_shared_logprobs_and_gradients_match_the_plain_forward(arch, multi_turn):
    from transformers import GPT2Config, Qwen2Config

    model = {"llama": _llama,
             "qwen2": lambda: _model(Qwen2Config, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2),
             "gpt2": lambda: _model(GPT2Config, n_embd=64, n_layer=2, n_head=4, n_positions=256)}[arch]()
    tok, att, lm = _batch(multi_turn=multi_turn)
    lay = layout(tok, att, lm)
    assert lay.prefixes.shape[0] == 4 and lay.forwarded() < tok.numel()  # three shared prompts, one alone

    def grads(fn):
        model.zero_grad()
        lp = fn()
        (lp * lm).sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    plain, g_plain = grads(lambda: token_logprobs(model, tok, att))
    shared, g_shared = grads(lambda: shared_logprobs(model, lay, tok.shape[1]))
    where = _after_prefix(lay, att, lm)
    assert torch.equal(where & lm, lm)  # every loss token is after its row's prefix
    assert torch.allclose(shared[where], plain[where], atol=1e-5)
    assert torch.all(shared[~where] == 0)
    assert float((g_shared - g_plain).norm() / g_plain.norm()) < 1e-5


def test_it_shares_only_where_it_saves_work():
    model = _llama()
    tok, att, lm = _batch(groups=((4, 1), (5, 1), (6, 1)))  # every prompt its own: nothing to share
    sharing = PrefixSharing()
    out = sharing.logprobs(model, tok, att, lm)
    assert sharing.forwarded == tok.numel() and torch.equal(out, token_logprobs(model, tok, att))
    tok, att, lm = _batch()
    sharing.logprobs(model, tok, att, lm)  # the first shared micro-batch: checked against the plain forward
    before = sharing.forwarded
    sharing.logprobs(model, tok, att, lm)
    lay = layout(tok, att, lm)
    assert sharing.enabled and sharing.forwarded - before == lay.forwarded() < tok.numel()


def test_a_model_whose_cache_holds_states_is_forwarded_whole(caplog):
    from transformers import MambaConfig

    model = _model(MambaConfig, hidden_size=64, num_hidden_layers=2, state_size=8)
    tok, att, lm = _batch()
    sharing = PrefixSharing()
    with caplog.at_level(logging.WARNING, logger="astraflow.training"):
        out = sharing.logprobs(model, tok, att, lm)
    assert not sharing.enabled and "prompts not shared" in caplog.text
    assert torch.allclose(out, token_logprobs(model, tok, att), atol=1e-6)


def test_a_sliding_window_is_forwarded_whole(caplog):
    from transformers import Qwen2Config

    model = _model(Qwen2Config, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    tok, att, lm = _batch()
    sharing = PrefixSharing()
    with caplog.at_level(logging.WARNING, logger="astraflow.training"):
        sharing.logprobs(model, tok, att, lm)
    assert not sharing.enabled and "cannot be repeated by row" in caplog.text


def test_a_cached_forward_that_disagrees_turns_it_off(caplog):
    model = _llama()
    tok, att, lm = _batch()
    sharing = PrefixSharing(atol=-1.0)  # no gap passes: as a model whose cached forward is off
    with caplog.at_level(logging.WARNING, logger="astraflow.training"):
        out = sharing.logprobs(model, tok, att, lm)
    assert not sharing.enabled and "differ from the plain forward" in caplog.text
    # the check's two forwards, then the plain one
    assert torch.equal(out, token_logprobs(model, tok, att))
    assert sharing.forwarded == layout(tok, att, lm).forwarded() + 2 * tok.numel()


def test_a_sliding_window_the_rows_fit_in_is_shared():
    from transformers import Qwen2Config

    model = _model(Qwen2Config, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    tok, att, lm = _batch()
    sharing = PrefixSharing()
    out = sharing.logprobs(model, tok, att, lm)
    assert sharing.enabled and torch.allclose(out[lm], token_logprobs(model, tok, att)[lm], atol=1e-5)


def test_rows_without_tokens_or_loss_tokens_are_zero():
    model = _llama()
    tok = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 0], [5, 6, 7, 11, 12], [0, 0, 0, 0, 0], [13, 14, 0, 0, 0]])
    att = (torch.arange(5) < torch.tensor([5, 4, 5, 0, 2])[:, None]).long()
    lm = torch.zeros_like(att, dtype=torch.bool)
    lm[:3, 3:] = att[:3, 3:].bool()  # three samples of one prompt; an empty row; a row without loss tokens
    lay = layout(tok, att, lm)
    out = shared_logprobs(model, lay, tok.shape[1])
    assert torch.all(out[3:] == 0) and torch.all(out[:3, :3] == 0)
    assert torch.allclose(out[lm], token_logprobs(model, tok, att)[lm], atol=1e-5)


def test_the_check_waits_for_a_micro_batch_with_loss_tokens():
    model = _llama()
    tok, att, lm = _batch()
    sharing = PrefixSharing(atol=-1.0)
    same = tok[:1].repeat(4, 1), att[:1].repeat(4, 1)  # one sequence four times: worth sharing
    sharing.logprobs(model, *same, torch.zeros_like(lm[:4]))  # no loss token to compare: not checked yet
    assert sharing.enabled
    sharing.logprobs(model, tok, att, lm)
    assert not sharing.enabled


class _Plain(torch.nn.Module):
    """A model whose forward takes no cache (as some remote-code models): ``fp32``: False, it
    also runs only under autocast (as flash attention runs only in half precision)."""

    def __init__(self, inner, fp32: bool = True):
        super().__init__()
        self.inner, self.fp32 = inner, fp32

    def forward(self, input_ids, attention_mask, position_ids, **kw):
        if not self.fp32 and not torch.is_autocast_enabled("cpu"):
            raise RuntimeError("runs only in half precision")
        if self.fp32 and kw:
            raise TypeError(f"forward() got unexpected keyword arguments {sorted(kw)}")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)


def test_a_model_that_takes_no_cache_is_forwarded_whole_even_before_its_check(caplog):
    model = _Plain(_llama())
    tok, att, lm = _batch()
    sharing = PrefixSharing()
    sharing.logprobs(model, tok, att, torch.zeros_like(lm))  # no loss token: forwarded whole, nothing raised
    with caplog.at_level(logging.WARNING, logger="astraflow.training"):
        out = sharing.logprobs(model, tok, att, lm)
    assert not sharing.enabled and "cached forward raised TypeError" in caplog.text
    assert torch.equal(out, token_logprobs(model, tok, att))


def test_a_model_that_runs_only_in_half_precision_is_checked_as_it_runs():
    model = _Plain(_llama(), fp32=False)
    tok, att, lm = _batch()
    sharing = PrefixSharing()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sharing.logprobs(model, tok, att, lm)
        plain = token_logprobs(model, tok, att)
    assert sharing.enabled and float((out - plain)[lm].abs().max()) < 5e-2
