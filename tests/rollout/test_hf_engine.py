import asyncio

import numpy as np
import pytest
import torch

from astraflow.models import load_model
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine

PROMPTS = ["1+2=", "12+34=", "7+88=", "hello world, longer prompt"]


def _prompts(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def _gather(engine, prompts, params):
    async def main():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])

    return asyncio.run(main())


def _teacher_forced(model, prompt, completion):
    full = torch.tensor([list(prompt) + list(completion)], device=model.device)  # the engine's device
    with torch.no_grad():
        logp = model(full).logits.float().log_softmax(-1)
    return logp[0, len(prompt) - 1 : -1].gather(-1, full[0, len(prompt):, None])[:, 0].cpu().numpy()


def test_logprobs_match_teacher_forcing(tiny_model):
    eng = HFEngine(tiny_model, seed=1)
    prompts = _prompts(eng.tokenizer)
    gens = _gather(eng, prompts, SamplingParams(max_new_tokens=12, temperature=1.3))
    assert eng.stats()["batches"] == 1  # all concurrent requests went into one batch
    for p, g in zip(prompts, gens):
        assert len(g.tokens) == len(g.logprobs) == len(g.versions) >= 1
        assert g.tokens.dtype == np.int32 and g.logprobs.dtype == np.float32
        np.testing.assert_allclose(g.logprobs, _teacher_forced(eng.model, p, g.tokens), atol=1e-4)
        assert (g.versions == -1).all()
        assert g.finish_reason in ("stop", "length")


def test_greedy_equals_hf_generate_and_batching_is_invisible(tiny_model):
    eng = HFEngine(tiny_model)
    prompts = _prompts(eng.tokenizer)
    params = SamplingParams(max_new_tokens=10, greedy=True)
    batched = _gather(eng, prompts, params)
    single = [_gather(eng, [p], params)[0] for p in prompts]
    model, tok = load_model(tiny_model)
    for p, b, s in zip(prompts, batched, single):
        ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):]
        assert b.tokens.tolist() == ref.tolist()
        assert b.tokens.tolist() == s.tokens.tolist()
        np.testing.assert_allclose(b.logprobs, s.logprobs, atol=1e-4)


def test_stop_token_ends_sequence(tiny_model):
    eng = HFEngine(tiny_model)
    p = _prompts(eng.tokenizer)[1]
    first = _gather(eng, [p], SamplingParams(max_new_tokens=5, greedy=True))[0]
    stop_at = int(first.tokens[2])
    g = _gather(eng, [p], SamplingParams(max_new_tokens=5, greedy=True, stop_token_ids=(stop_at,)))[0]
    assert g.finish_reason == "stop"
    assert int(g.tokens[-1]) == stop_at
    assert len(g.tokens) == list(first.tokens).index(stop_at) + 1
    assert first.finish_reason == "length" or int(first.tokens[-1]) == eng.tokenizer.eos_token_id


def test_weight_swap_mid_generation_tags_versions(tiny_model, tmp_path):
    from astraflow.models import init_model

    new_model, _ = load_model(init_model(tmp_path / "other", preset="tiny", seed=7))
    new_sd = new_model.state_dict()
    # 0: the swap lands at the next step however few are left (10 new tokens here; the default
    # would finish the batch first, see test_partial_rollout)
    eng = HFEngine(tiny_model, seed=3, swap_min_remaining=0)
    prompts = _prompts(eng.tokenizer)
    n_before = 4

    async def main():
        tasks = [asyncio.ensure_future(eng.generate(p, SamplingParams(max_new_tokens=10, temperature=1.0,
                                                                      stop_token_ids=())))
                 for p in prompts]
        # let the decode loop run a few steps, then publish version 5 while it is in flight
        while eng.stats()["decode_steps"] < n_before - 1:
            await asyncio.sleep(0.001)
        eng.load_weights(new_sd, version=5)
        assert eng.version == -1  # pending until the next step boundary
        return await asyncio.gather(*tasks)

    gens = asyncio.run(main())
    assert eng.version == 5
    old_model, _ = load_model(tiny_model)
    saw_mixed = False
    for p, g in zip(prompts, gens):
        v = g.versions.tolist()
        assert set(v) <= {-1, 5}
        assert v == sorted(v, key=lambda x: x != -1)  # old versions first, then new
        k = v.count(-1)
        assert k >= min(n_before - 1, len(v))  # a request may have stopped before the swap
        if 0 < k < len(v):
            saw_mixed = True
        # each token's log-prob is the teacher-forced log-prob of the weights that made it
        ref_old = _teacher_forced(old_model, p, g.tokens)
        ref_new = _teacher_forced(new_model, p, g.tokens)
        np.testing.assert_allclose(g.logprobs[:k], ref_old[:k], atol=1e-4)
        np.testing.assert_allclose(g.logprobs[k:], ref_new[k:], atol=1e-4)
    assert saw_mixed
    assert eng.stats()["weight_swaps"] == 1


def test_idle_load_weights_applies_now(tiny_model):
    eng = HFEngine(tiny_model)
    sd = {k: v.clone() for k, v in eng.model.state_dict().items()}
    eng.load_weights(sd, 3)
    assert eng.version == 3
    g = _gather(eng, _prompts(eng.tokenizer)[:1], SamplingParams(max_new_tokens=3, greedy=True))[0]
    assert (g.versions == 3).all()
    with pytest.raises(ValueError, match="HF parameter names"):
        eng.load_weights({"nope": torch.zeros(1)}, 4)


def test_bad_requests(tiny_model):
    eng = HFEngine(tiny_model)
    with pytest.raises(ValueError, match="empty"):
        _gather(eng, [[]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        _gather(eng, [[1, 2]], SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="positions"):
        _gather(eng, [[1, 2]], SamplingParams(max_new_tokens=10_000))
    with pytest.raises(ValueError, match="token id 400 is outside the model's vocabulary of 320"):
        _gather(eng, [[1, 400]], SamplingParams())
    for bad in (SamplingParams(top_p=0.0), SamplingParams(top_p=1.5), SamplingParams(temperature=float("nan"))):
        with pytest.raises(ValueError, match="top_p must be in|finite number > 0"):
            _gather(eng, [[1, 2]], bad)
    assert len(_gather(eng, [[1, 2]], SamplingParams(greedy=True, temperature=0.0, max_new_tokens=2))[0].tokens)


def test_a_tokenizer_without_pad_or_eos_tokens_still_decodes_a_batch(tiny_model):
    eng = HFEngine(tiny_model)
    eng.tokenizer.pad_token, eng.tokenizer.eos_token = None, None
    eng = HFEngine(eng.model, tokenizer=eng.tokenizer, device="cpu")
    out = _gather(eng, [[1, 2], [3, 4, 5, 6]], SamplingParams(max_new_tokens=3))
    assert [len(g.tokens) for g in out] == [3, 3]


def test_weights_that_do_not_fit_are_refused_when_handed_over_even_while_decoding(tiny_model):
    """A swap held until the running batch ends must not fail there (the batch's answers
    would never go out): it is checked when handed over."""
    eng = HFEngine(tiny_model)
    bad = {**{k: v.clone() for k, v in eng.model.state_dict().items()}, "model.extra.weight": torch.zeros(1)}
    before = eng.version
    eng._decoding = True  # as load_weights sees it from the weight watcher during a batch
    with pytest.raises(ValueError, match=r"unexpected \['model.extra.weight'\]"):
        eng.load_weights(bad, 4)
    eng._decoding = False
    assert eng._pending_weights is None and eng.version == before


def test_bf16_engine_samples_from_bf16_weights_and_casts_published_fp32_ones(tiny_model, tmp_path):
    """``dtype="bf16"``: the weights live in bf16, the behaviour log-probs are those of a bf16
    teacher-forced forward (fp32 log-softmax of its logits) and close to the fp32 model's; a
    published fp32 state dict is cast on load."""
    from astraflow.models import init_model

    eng = HFEngine(tiny_model, seed=1, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters())
    buffers = {n: b.dtype for n, b in eng.model.named_buffers() if b.is_floating_point()}
    assert any("inv_freq" in n for n in buffers) and set(buffers.values()) == {torch.float32}  # exact RoPE angles
    prompts = _prompts(eng.tokenizer)
    gens = _gather(eng, prompts, SamplingParams(max_new_tokens=12, temperature=1.3))
    fp32, _ = load_model(tiny_model)
    off_fp32 = 0.0
    for p, g in zip(prompts, gens):
        assert g.logprobs.dtype == np.float32 and np.isfinite(g.logprobs).all()
        # bf16 rounding: ~0.004 here for both
        np.testing.assert_allclose(g.logprobs, _teacher_forced(eng.model, p, g.tokens), atol=0.02)
        off = np.abs(g.logprobs - _teacher_forced(fp32, p, g.tokens))
        assert off.max() < 0.05
        off_fp32 = max(off_fp32, float(off.max()))
    assert off_fp32 > 1e-4  # computed in bf16 indeed (an fp32 engine matches to ~1e-6)

    new_sd = load_model(init_model(tmp_path / "other", preset="tiny", seed=7))[0].state_dict()
    eng.load_weights(new_sd, 4)
    assert eng.version == 4 and all(p.dtype == torch.bfloat16 for p in eng.model.parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(eng.model.state_dict()[name].cpu(), new_sd[name].to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype must be one of fp32, bf16"):
        HFEngine(tiny_model, dtype="fp16")


def test_bf16_on_a_cpu_without_native_bf16_warns_and_names_the_setting(monkeypatch, caplog):
    from astraflow.models import warn_if_bf16_is_emulated

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    with caplog.at_level("WARNING", logger="astraflow"):
        warn_if_bf16_is_emulated(cpu, "rollout.engine.dtype")
    assert caplog.records == []
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)  # e.g. a Skylake: AVX512 only
    with caplog.at_level("WARNING", logger="astraflow"):
        warn_if_bf16_is_emulated(cpu, "rollout.engine.dtype")
        warn_if_bf16_is_emulated(torch.device("cuda"), "rollout.engine.dtype")  # GPUs: not this check
    assert [r.getMessage() for r in caplog.records] == [
        "rollout.engine.dtype: bf16 on a CPU without native bf16 (AVX512-BF16 or AMX) is emulated and slower "
        "than fp32 here; set rollout.engine.dtype=fp32"]


def test_a_batch_that_repeats_prompts_forwards_each_once_with_the_same_numbers(tiny_model):
    """A group's samples share their prompt: the prefill runs once per distinct prompt and its
    logits and KV cache go to every row that has it; tokens and log-probs are what a forward of
    every row gives."""
    from dataclasses import replace

    base = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=())

    def run(share):
        eng = HFEngine(tiny_model, seed=1)
        eng.share_prefill = share
        prompts = _prompts(eng.tokenizer)[:2]
        rows = [(p, replace(base, seed=k)) for p in prompts for k in range(4)]  # two groups of four
        rows.append((prompts[0], replace(base, greedy=True)))
        gens = asyncio.run(_gather_each(eng, rows))
        return gens, eng.stats()

    shared, st = run(True)
    alone, st_alone = run(False)
    assert st["batches"] == st_alone["batches"] == 1
    assert (st["prefill_rows"], st_alone["prefill_rows"]) == (2, 9)
    for a, b in zip(shared, alone):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len({tuple(g.tokens.tolist()) for g in shared[:4]}) > 1  # the group's samples still differ


async def _gather_each(engine, rows):
    return await asyncio.gather(*[engine.generate(p, params) for p, params in rows])
