"""The engine in its own process (``ProcessEngine``) behaves exactly like ``HFEngine`` in the
node process: same tokens, log-probs and versions for the same seed and batch, weights sent
before a request are the weights that generate it, and a dead engine process fails its
requests with an error that says so instead of hanging the node."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import torch

from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.process_engine import EngineProcessError, ProcessEngine

PROMPTS = ["1+2=", "12+34=", "7+88=", "a longer prompt: 55+44="]


def _gather(engine, prompts, params):
    async def main():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])

    return asyncio.run(main())


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.versions, y.versions)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        assert x.finish_reason == y.finish_reason


@pytest.fixture(scope="module")
def pair(tiny_model):
    torch.set_num_threads(1)
    proc = ProcessEngine(str(tiny_model), max_batch_size=16, seed=5, device="cpu")
    local = HFEngine(str(tiny_model), max_batch_size=16, seed=5, version=0, device="cpu")
    yield proc, local
    proc.close()
    assert not proc._proc.is_alive()


@pytest.mark.timeout(120)
def test_same_generations_as_in_process(pair):
    proc, local = pair
    prompts = [proc.tokenizer(p)["input_ids"] for p in PROMPTS]
    for params in (SamplingParams(max_new_tokens=10, greedy=True), SamplingParams(max_new_tokens=10, temperature=1.2)):
        _same(_gather(proc, prompts, params), _gather(local, prompts, params))
    st = proc.stats()
    assert st["requests"] == 2 * len(PROMPTS) and st["batches"] == 2  # one batch per gather, as in process


@pytest.mark.timeout(120)
def test_weights_sent_before_a_request_generate_it(pair):
    proc, local = pair
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in local.model.state_dict().items()}
    proc.load_weights(new, 7)
    local.load_weights(new, 7)
    assert proc.version == 7
    prompts = [proc.tokenizer(p)["input_ids"] for p in PROMPTS]
    gens = _gather(proc, prompts, SamplingParams(max_new_tokens=8, greedy=True))
    _same(gens, _gather(local, prompts, SamplingParams(max_new_tokens=8, greedy=True)))
    assert all(set(g.versions.tolist()) == {7} for g in gens)


@pytest.mark.timeout(120)
def test_a_dead_engine_process_fails_its_requests(tiny_model):
    eng = ProcessEngine(str(tiny_model), max_batch_size=4, seed=0, device="cpu")
    prompt = eng.tokenizer("1+1=")["input_ids"]

    async def main():
        fut = asyncio.ensure_future(eng.generate(prompt, SamplingParams(max_new_tokens=400, temperature=1.0)))
        await asyncio.sleep(0.2)
        os.kill(eng.pid, signal.SIGKILL)  # our own child, by PID
        t0 = time.time()
        with pytest.raises(EngineProcessError, match="exited with code -9"):
            await asyncio.wait_for(fut, 30)
        assert time.time() - t0 < 30
        with pytest.raises(EngineProcessError, match="exited"):
            await eng.generate(prompt, SamplingParams(max_new_tokens=2))

    asyncio.run(main())
    eng.close()


@pytest.mark.timeout(120)
def test_a_model_that_cannot_load_is_a_start_error(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model.iterdir():  # config and tokenizer load here; the missing weights fail there
        if not f.name.endswith(".safetensors"):
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(EngineProcessError, match="failed to start"):
        ProcessEngine(str(broken), max_batch_size=4, device="cpu")
    # not a model directory at all: refused before any process starts
    with pytest.raises(ValueError, match="not an HF model directory"):
        ProcessEngine(str(tmp_path / "nowhere"), max_batch_size=4, device="cpu")
