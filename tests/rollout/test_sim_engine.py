"""The simulated engine honours its hardware profile and its response-length distribution.

Its timeline runs on a virtual clock, so the checks are exact or statistical on simulated
time, never on the wall clock."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from astraflow.rollout.config import EngineConfig
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.engines import make_engine
from astraflow.rollout.sim_clock import VirtualClock
from astraflow.rollout.sim_config import PRESETS, SimEngineConfig
from astraflow.rollout.sim_engine import SimEngine
from astraflow.rollout.sim_tokenizer import EOS_ID


def _cfg(**kw) -> SimEngineConfig:
    base = dict(hardware="h100", single_tokens_per_s=100.0, peak_tokens_per_s=1000.0, ttft_s=0.5,
                prefill_tokens_per_s=1000.0, max_batch=32, load_seconds=2.0, length_mean=100.0, length_sigma=0.0)
    return SimEngineConfig(**{**base, **kw})


def _run(engine: SimEngine, prompts: int, max_new: int = 10_000, prompt_len: int = 0):
    async def main():
        params = SamplingParams(max_new_tokens=max_new)
        return await asyncio.gather(*(engine.generate([5] * prompt_len, params) for _ in range(prompts)))
    return asyncio.run(main())


def test_one_request_takes_ttft_prefill_and_tokens_over_the_single_rate():
    clock = VirtualClock()
    eng = SimEngine(_cfg(), clock=clock)
    [gen] = _run(eng, 1, prompt_len=200)
    # 0.5 s to the first token + 200 prompt tokens / 1000/s + 100 tokens at 100 tokens/s
    assert gen.engine_seconds == pytest.approx(0.5 + 0.2 + 1.0)
    assert len(gen.tokens) == 100 and gen.finish_reason == "stop" and gen.tokens[-1] == EOS_ID
    assert gen.logprobs.dtype == np.float32 and (gen.logprobs <= 0).all() and (gen.logprobs >= -3).all()
    assert (gen.versions == 0).all() and len(gen.versions) == 100


def test_a_batch_shares_the_peak_rate_and_the_rest_queue():
    # 20 together: min(20 * 100, 1000) = 1000 tokens/s shared, 50 tokens/s each
    clock = VirtualClock()
    gens = _run(SimEngine(_cfg(), clock=clock), 20)
    assert clock.now() == pytest.approx(0.5 + 100 / 50)
    assert all(g.engine_seconds == pytest.approx(2.5) for g in gens)
    # 5 together stay below the knee: each at its single rate
    clock = VirtualClock()
    _run(SimEngine(_cfg(), clock=clock), 5)
    assert clock.now() == pytest.approx(0.5 + 1.0)
    # 64 with max_batch 32: two rounds of 32 at 1000/32 tokens/s each
    clock = VirtualClock()
    gens = _run(SimEngine(_cfg(), clock=clock), 64)
    one_round = 0.5 + 100 / (1000 / 32)
    assert clock.now() == pytest.approx(2 * one_round)
    assert sorted(g.engine_seconds for g in gens)[-1] == pytest.approx(2 * one_round)
    # aggregate throughput over the whole run: the tokens over simulated time, near the peak
    assert 64 * 100 / clock.now() == pytest.approx(1000 * 3.2 / 3.7, rel=1e-6)


def test_response_lengths_follow_the_lognormal_and_the_cap():
    cfg = _cfg(length_mean=200.0, length_sigma=0.8, peak_tokens_per_s=1e6, max_batch=4000)
    gens = _run(SimEngine(cfg, seed=3, clock=VirtualClock()), 3000)
    n = np.array([len(g.tokens) for g in gens], dtype=float)
    assert n.mean() == pytest.approx(200, rel=0.06)
    # the log of the lengths has the configured sigma and mu = log(mean) - sigma^2 / 2
    assert np.log(n).std() == pytest.approx(0.8, rel=0.06)
    assert np.log(n).mean() == pytest.approx(math.log(200) - 0.32, abs=0.05)
    capped = _run(SimEngine(cfg, seed=3, clock=VirtualClock()), 2000, max_new=150)
    lengths = np.array([len(g.tokens) for g in capped])
    reasons = np.array([g.finish_reason for g in capped])
    assert lengths.max() == 150 and (reasons[lengths == 150] == "length").all()
    assert (reasons[lengths < 150] == "stop").all()
    # P(length >= 150) of the lognormal
    expect = 0.5 * math.erfc((math.log(149.5) - (math.log(200) - 0.32)) / (0.8 * math.sqrt(2)))
    assert (lengths == 150).mean() == pytest.approx(expect, abs=0.04)


def test_seeded_and_tokens_from_the_vocabulary():
    a = _run(SimEngine(_cfg(length_sigma=0.5, vocab_size=500), seed=7, clock=VirtualClock()), 20)
    b = _run(SimEngine(_cfg(length_sigma=0.5, vocab_size=500), seed=7, clock=VirtualClock()), 20)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    toks = np.concatenate([g.tokens for g in a])
    assert toks.min() >= 0 and toks.max() < 500


def test_tokens_after_a_weight_load_carry_the_new_version():
    clock = VirtualClock(max_step=0.25)
    eng = SimEngine(_cfg(length_mean=400.0), clock=clock)

    async def main():
        task = asyncio.ensure_future(eng.generate([], SamplingParams(max_new_tokens=1000)))
        while clock.now() < 0.5 + 2.0:  # 200 tokens in
            await asyncio.sleep(0)
        eng.load_weights({}, 7)
        return await task

    gen = asyncio.run(main())
    assert len(gen.versions) == 400 and gen.versions[0] == 0 and gen.versions[-1] == 7
    assert (np.diff(gen.versions) >= 0).all() and int((gen.versions == 0).sum()) == 200


def test_the_factory_builds_sim_engines_and_presets_validate():
    eng = make_engine(EngineConfig(type="sim", replicas=1), "unused", seed=1)
    assert isinstance(eng, SimEngine) and eng.version == 0 and eng.profile == PRESETS["h100"]
    pool = make_engine(EngineConfig(type="sim", replicas=3), "unused", seed=1)
    assert len(pool.replicas) == 3
    assert SimEngineConfig(hardware="a100", ttft_s=1.0).profile().ttft_s == 1.0
    assert SimEngineConfig(hardware="A100").hardware == "a100"  # written as partitions label it
    with pytest.raises(ValueError, match="peak_tokens_per_s"):
        SimEngineConfig(single_tokens_per_s=500, peak_tokens_per_s=100)


@pytest.mark.parametrize("field", ["time_scale", "length_mean", "single_tokens_per_s", "load_seconds"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_rate_length_or_time_that_is_not_finite_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"{field}\n.*finite number"):
        SimEngineConfig(**{field: value})


def test_a_cancelled_request_frees_its_slot():
    clock = VirtualClock()
    eng = SimEngine(_cfg(max_batch=1), clock=clock)

    async def main():
        first = asyncio.ensure_future(eng.generate([], SamplingParams(max_new_tokens=10_000)))
        await asyncio.sleep(0)
        first.cancel()
        return await eng.generate([], SamplingParams(max_new_tokens=10_000))

    gen = asyncio.run(main())
    assert gen.engine_seconds == pytest.approx(0.5 + 1.0)  # it did not queue behind the cancelled one


def test_requests_in_prefill_take_no_share_of_the_decode_rate_and_prefilling_halves_it():
    # one request decodes alone (1000 tokens at 100/s: 10 s); one with 2000 prompt tokens holds a
    # slot meanwhile and makes no tokens. Its prompt and the decoder share the engine's time:
    # 4 s of prefill at 500/s, the decoder at 50/s (200 tokens); then both decode at 100/s
    clock = VirtualClock()
    eng = SimEngine(_cfg(ttft_s=0.0, length_mean=1000.0), clock=clock)

    async def main():
        params = SamplingParams(max_new_tokens=10_000)
        return await asyncio.gather(eng.generate([], params), eng.generate([5] * 2000, params))

    first, second = asyncio.run(main())
    assert first.engine_seconds == pytest.approx(4.0 + 800 / 100)
    assert second.engine_seconds == pytest.approx(4.0 + 1000 / 100)
    assert eng.stats()["tokens"] == 2 * 1000


def test_prompts_admitted_together_are_prefilled_one_after_another():
    # four 1000-token prompts at 1000 prompt tokens/s reach their first tokens 1 s apart (the
    # engine's prefill throughput is one, not one per request); decoding one token is instant here
    fast = dict(ttft_s=0.25, length_mean=1.0, single_tokens_per_s=1e7, peak_tokens_per_s=1e9)
    gens = _run(SimEngine(_cfg(**fast), clock=VirtualClock()), 4, prompt_len=1000)
    assert sorted(g.engine_seconds for g in gens) == pytest.approx([1.25, 2.25, 3.25, 4.25], rel=1e-4)
    # alone: ttft_s and its prompt, as the profile says
    [gen] = _run(SimEngine(_cfg(**fast), clock=VirtualClock()), 1, prompt_len=1000)
    assert gen.engine_seconds == pytest.approx(1.25, rel=1e-4)


def test_a_request_cancelled_in_its_prefill_gives_the_prefill_to_the_next_at_once():
    # A's 3000-token prompt (3 s at 1000 tokens/s) is cancelled after 0.5 s: B's 10 tokens are
    # prefilled from then, not after A's whole prompt
    clock = VirtualClock(max_step=0.5)
    eng = SimEngine(_cfg(ttft_s=0.0, length_mean=1.0, single_tokens_per_s=1e7, peak_tokens_per_s=1e9), clock=clock)

    async def main():
        a = asyncio.ensure_future(eng.generate([5] * 3000, SamplingParams(max_new_tokens=10)))
        b = asyncio.ensure_future(eng.generate([5] * 10, SamplingParams(max_new_tokens=10)))
        while clock.now() < 0.5:
            await asyncio.sleep(0)
        a.cancel()
        return await b

    gen = asyncio.run(main())
    assert gen.engine_seconds == pytest.approx(0.5 + 0.01, abs=1e-3)
