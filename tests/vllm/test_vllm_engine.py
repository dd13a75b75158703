"""``VLLMEngine`` against the HF engine and the trainer's own forward, through weight updates.

One engine serves the whole module, in order: generation on the initial weights, a partial
rollout across a full update, a finish-then-swap update, a delta update, an engine crash and
restart, a version retention would retire mid-update, an in-place update that changes nothing.
The tests share it because each engine start costs seconds on the CPU build.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (bash tests/run_vllm.sh runs this tier)")

from astraflow.models import load_model
from astraflow.probe import make_probe
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.process_engine import EngineProcessError
from astraflow.rollout.vllm_engine import VLLMEngine
from storage.deltas import write_version_delta
from storage.weights import WeightStore

from .conftest import (LOGPROB_ATOL, PROBE_ATOL, assert_greedy_agrees, bf16_exact, close_engine, engine_options,
                       publish, reference_logprobs)

PROMPTS = ["1+2=", "12+34=", "7+88=", "a longer prompt: 55+44="]
POLICY = "p"


def _gather(engine, prompts, params):
    async def main():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])

    return asyncio.run(main())


def _wait_loaded(engine, version: int, deadline_s: float = 300):
    """Until the engine serves ``version`` (an update runs on the engine's own thread)."""
    end = time.monotonic() + deadline_s
    while engine.serving_version < version:
        assert time.monotonic() < end, f"v{version} not loaded; records {engine.take_load_records()}"
        assert engine.dead is None, engine.dead
        time.sleep(0.05)


@pytest.fixture(scope="module")
def setup(vllm_models, tmp_path_factory):
    store = WeightStore(tmp_path_factory.mktemp("weights"), keep_last=10)
    m0, tok = load_model(vllm_models["v0"])
    publish(store, POLICY, 0, m0)
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(), max_batch_size=16, seed=0,
                        threads=2, swap_min_remaining=0)
    prompts = [tok.encode(p) for p in PROMPTS]
    yield engine, store, prompts, m0
    close_engine(engine)


def test_greedy_generation_equals_the_hf_engine_on_the_same_weights(setup, vllm_models):
    engine, _, prompts, _ = setup
    params = SamplingParams(max_new_tokens=24, greedy=True)
    hf = HFEngine(str(vllm_models["v0"]), version=0, device="cpu")
    want = _gather(hf, prompts, params)
    got = _gather(engine, prompts, params)
    m0, _ = load_model(vllm_models["v0"])
    for prompt, w, g in zip(prompts, want, got):
        assert_greedy_agrees(m0, prompt, g, w)
        assert (g.versions == 0).all()


def test_sampled_logprobs_are_the_trainers_teacher_forced_ones(setup):
    engine, _, prompts, m0 = setup
    outs = _gather(engine, prompts * 2, SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9))
    for prompt, out in zip(prompts * 2, outs):
        assert len(out.tokens) == len(out.logprobs) == len(out.versions) > 0
        np.testing.assert_allclose(out.logprobs, reference_logprobs(m0, prompt, out.tokens), atol=LOGPROB_ATOL)


def test_a_stop_token_ends_the_completion_and_is_kept(setup):
    engine, _, prompts, _ = setup
    free = _gather(engine, prompts[:1], SamplingParams(max_new_tokens=16, greedy=True))[0]
    stop = int(free.tokens[3])
    first = list(free.tokens).index(stop)
    out = _gather(engine, prompts[:1], SamplingParams(max_new_tokens=16, greedy=True, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop"
    np.testing.assert_array_equal(out.tokens, free.tokens[: first + 1])


def test_an_update_mid_generation_resumes_under_the_new_weights_with_per_token_versions(setup, vllm_models):
    """Partial rollout: the running request is aborted, v1 loaded in place and verified, the
    request resumed from its prefix; tokens before carry v0 and v0's log-probs, after v1's."""
    engine, store, prompts, m0 = setup
    m1, _ = load_model(vllm_models["v1"])
    publish(store, POLICY, 1, m1)
    params = SamplingParams(max_new_tokens=400, greedy=True)

    async def main():
        task = asyncio.ensure_future(engine.generate(prompts[0], params))
        while not any(engine._generated(rid) >= 8 for rid in list(engine._running)):
            assert not task.done()
            await asyncio.sleep(0.01)
        engine.load_version(str(store.root), POLICY, 1)
        return await task

    out = asyncio.run(main())
    _wait_loaded(engine, 1)
    switch = int(np.argmax(out.versions == 1))
    assert 8 <= switch < len(out.tokens) and set(out.versions[:switch]) == {0} and set(out.versions[switch:]) == {1}
    full = reference_logprobs(m0, prompts[0], out.tokens)
    np.testing.assert_allclose(out.logprobs[:switch], full[:switch], atol=LOGPROB_ATOL)
    after = reference_logprobs(m1, prompts[0], out.tokens)
    np.testing.assert_allclose(out.logprobs[switch:], after[switch:], atol=LOGPROB_ATOL)
    rec = [r for r in engine.take_load_records() if r["version"] == 1][0]
    assert rec["mode"] == "in_place" and rec["probe_error"] < PROBE_ATOL and rec["resumed_requests"] == 1


def test_near_its_end_a_request_finishes_on_its_weights_before_the_swap(setup, vllm_models):
    engine, store, prompts, _ = setup
    m2, _ = load_model(vllm_models["v2"])
    publish(store, POLICY, 2, m2)
    engine.swap_min_remaining = 10_000  # every running request is nearer its end than this
    params = SamplingParams(max_new_tokens=200, greedy=True)

    async def main():
        task = asyncio.ensure_future(engine.generate(prompts[1], params))
        while not any(engine._generated(rid) >= 4 for rid in list(engine._running)):
            await asyncio.sleep(0.01)
        engine.load_version(str(store.root), POLICY, 2, use_deltas=True, full_resync_every=100)
        late = await engine.generate(prompts[1], SamplingParams(max_new_tokens=8, greedy=True))
        return await task, late

    try:
        out, late = asyncio.run(main())
    finally:
        engine.swap_min_remaining = 0
    assert set(out.versions) == {1}  # finished on v1
    assert set(late.versions) == {2}  # submitted after load_version: generated by v2
    np.testing.assert_allclose(late.logprobs, reference_logprobs(m2, prompts[1], late.tokens), atol=LOGPROB_ATOL)
    rec = engine.take_load_records()[-1]
    assert rec["resumed_requests"] == 0 and rec["read"]["mode"] == "full"


def test_a_sparse_delta_update_serves_the_new_version(setup, vllm_models):
    engine, store, prompts, m0 = setup
    # v3 = v2 with a few weights changed: a delta from v2 applies to what the workers hold
    m3, _ = load_model(vllm_models["v2"])
    prev = {k: v.clone() for k, v in m3.state_dict().items()}
    for name, p in m3.named_parameters():
        if name.endswith("mlp.down_proj.weight"):
            p.data[:4] += 0.5
    new = publish(store, POLICY, 3, m3)
    write_version_delta(store.root, POLICY, 2, 3, prev, new)
    # the workers read v2 in full (deltas on) in the test before; now they apply the delta 2 -> 3
    engine.load_version(str(store.root), POLICY, 3, use_deltas=True, full_resync_every=100)
    _wait_loaded(engine, 3)
    out = _gather(engine, prompts[:2], SamplingParams(max_new_tokens=16, temperature=1.0))
    for prompt, o in zip(prompts[:2], out):
        assert set(o.versions) == {3}
        np.testing.assert_allclose(o.logprobs, reference_logprobs(m3, prompt, o.tokens), atol=LOGPROB_ATOL)
    rec = engine.take_load_records()[-1]
    assert rec["version"] == 3 and rec["probe_error"] < PROBE_ATOL
    assert rec["read"]["mode"] == "delta" and rec["read"]["delta_density"] < 0.5


def test_an_in_place_update_without_the_tied_head_serves_the_new_head(setup, vllm_models):
    """A tied-embedding version without ``lm_head.weight`` (as ``save_pretrained`` writes one):
    the head follows the embedding in place, no re-creation needed."""
    engine, store, prompts, _ = setup
    m1, _ = load_model(vllm_models["v1"])
    publish(store, POLICY, 4, m1, drop=("lm_head.weight",))
    engine.load_version(str(store.root), POLICY, 4)
    _wait_loaded(engine, 4)
    rec = engine.take_load_records()[-1]
    assert rec["mode"] == "in_place" and rec["probe_error"] < PROBE_ATOL and "fallback" not in rec
    out = _gather(engine, prompts[:1], SamplingParams(max_new_tokens=16, temperature=1.0))[0]
    np.testing.assert_allclose(out.logprobs, reference_logprobs(m1, prompts[0], out.tokens), atol=LOGPROB_ATOL)


def test_an_in_place_update_that_fails_part_way_leaves_the_engine_dead_until_restarted(setup, vllm_models):
    """A version whose last tensor does not fit the model: vLLM has begun the layerwise reload
    when the load raises, so the engine may hold two versions' tensors. It must not serve them."""
    engine, store, prompts, m0 = setup
    m2, _ = load_model(vllm_models["v2"])
    sd = bf16_exact(m2)
    sd["model.norm.weight"] = sd["model.norm.weight"][:-1].clone()  # one value short
    store.publish(POLICY, 5, sd, meta={"layout": "hf", "arch": m2.config.model_type, "probe": make_probe(m2)})
    engine.load_version(str(store.root), POLICY, 5)
    end = time.monotonic() + 300
    while not engine.dead:
        assert time.monotonic() < end, f"the failed load left the engine serving; records {engine.take_load_records()}"
        time.sleep(0.05)
    assert "half-updated" in engine.dead and engine.serving_version == 4 and engine.version == 4
    with pytest.raises(EngineProcessError):
        _gather(engine, prompts[:1], SamplingParams(max_new_tokens=4, greedy=True))
    engine.restart()
    out = _gather(engine, prompts[:1], SamplingParams(max_new_tokens=8, greedy=True))[0]
    assert engine.dead is None and set(out.versions) == {0}
    np.testing.assert_allclose(out.logprobs, reference_logprobs(m0, prompts[0], out.tokens), atol=LOGPROB_ATOL)


def test_a_dead_engine_core_fails_its_requests_and_restarts(setup):
    engine, _, prompts, m0 = setup
    params = SamplingParams(max_new_tokens=400, greedy=True)
    pid = engine.pid

    async def main():
        task = asyncio.ensure_future(engine.generate(prompts[0], params))
        while not engine._running:
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)  # the engine core we started, by its pid
        with pytest.raises(EngineProcessError):
            await task
        with pytest.raises(EngineProcessError):
            await engine.generate(prompts[0], params)

    asyncio.run(main())
    assert f"pid {pid} killed by SIGKILL" in engine.dead and engine.restartable  # how it ended, named
    engine.restart()
    assert engine.dead is None and engine.version == 0
    out = _gather(engine, prompts[:1], SamplingParams(max_new_tokens=8, greedy=True))[0]
    assert set(out.versions) == {0}
    np.testing.assert_allclose(out.logprobs, reference_logprobs(m0, prompts[0], out.tokens), atol=LOGPROB_ATOL)


def test_without_vllms_version_labels_the_engine_labels_a_partial_rollout_itself(setup, vllm_models):
    """A vLLM that does not label tokens with versions (``labels_versions`` false: builds before
    the labels, or forced here): every request reaches the engine core before the update's
    pause, so each segment's tokens carry the version served when it started, exactly."""
    engine, store, prompts, _ = setup
    m1, _ = load_model(vllm_models["v1"])
    publish(store, POLICY, 6, m1)
    labels, engine.labels_versions = engine.labels_versions, False
    params = SamplingParams(max_new_tokens=400, greedy=True)

    async def main():
        first = asyncio.ensure_future(engine.generate(prompts[0], params))
        while not any(engine._generated(rid) >= 8 for rid in list(engine._running)):
            await asyncio.sleep(0.01)
        engine.load_version(str(store.root), POLICY, 6)
        # submitted as the update begins: it joins after the update, under v6 only
        second = asyncio.ensure_future(engine.generate(prompts[1], SamplingParams(max_new_tokens=8, greedy=True)))
        return await first, await second

    try:
        out, late = asyncio.run(main())
    finally:
        engine.labels_versions = labels
    switch = int(np.argmax(out.versions == 6))
    assert 8 <= switch < len(out.tokens) and set(out.versions[:switch]) == {0} and set(out.versions[switch:]) == {6}
    np.testing.assert_allclose(out.logprobs[switch:], reference_logprobs(m1, prompts[0], out.tokens)[switch:],
                               atol=LOGPROB_ATOL)
    assert set(late.versions) == {6}
    np.testing.assert_allclose(late.logprobs, reference_logprobs(m1, prompts[1], late.tokens), atol=LOGPROB_ATOL)


def test_a_version_retention_retires_mid_update_is_held_and_loaded(setup, vllm_models, monkeypatch):
    """Retention (a trainer keeping one version) runs right after this process read v7's
    manifest, before vLLM's workers read v7: the update holds v7 from before it starts, so v7
    is kept and loaded (unheld, the workers found it gone inside the in-place protocol and the
    engine went dead)."""
    engine, store, prompts, m0 = setup
    m2, _ = load_model(vllm_models["v2"])
    publish(store, POLICY, 7, m2)
    publish(store, POLICY, 8, m0)
    read, retired = WeightStore.manifest, []

    def manifest(self, policy, version):
        out = read(self, policy, version)
        if version == 7 and not retired:
            retired.append(WeightStore(store.root, keep_last=1).apply_retention(POLICY))
        return out

    monkeypatch.setattr(WeightStore, "manifest", manifest)
    engine.load_version(str(store.root), POLICY, 7)
    _wait_loaded(engine, 7)
    monkeypatch.undo()
    assert 0 in retired[0] and 7 not in retired[0] and engine.dead is None
    out = _gather(engine, prompts[:1], SamplingParams(max_new_tokens=16, greedy=True))[0]
    assert set(out.versions) == {7}
    np.testing.assert_allclose(out.logprobs, reference_logprobs(m2, prompts[0], out.tokens), atol=LOGPROB_ATOL)


def test_an_in_place_update_that_changes_nothing_is_caught_though_the_versions_are_close(setup, vllm_models,
                                                                                         monkeypatch, caplog):
    """v9 is v7 with the final norm 10% larger: their probes are closer than the tolerance, so
    an engine left on v7 passes a check against v9 alone. Scored nearer v7's probe than v9's,
    the update is redone by re-creating the engine, and the build is named."""
    engine, store, prompts, _ = setup
    assert engine.serving_version == 7
    m9, _ = load_model(vllm_models["v2"])
    with torch.no_grad():
        m9.model.norm.weight.mul_(1.1)
    publish(store, POLICY, 9, m9)
    updater = engine.updater

    async def unchanged(root, policy, version, use_deltas, every):
        updater._changed = True  # returns as a load does, the workers still holding v7
        return {}

    monkeypatch.setattr(updater, "_in_place", unchanged)
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        engine.load_version(str(store.root), POLICY, 9)
        _wait_loaded(engine, 9)
    rec = engine.take_load_records()[-1]
    assert rec["probe_error"] < engine.options.probe_tolerance  # what a check against v9 alone saw
    assert rec["stale"] and rec["probe_held_version"] == 7 and rec["fallback"] == "recreate"
    assert rec["probe_error_after_fallback"] < PROBE_ATOL and updater.mode == "recreate"
    assert any(updater.build in r.getMessage() and "held version's weights" in r.getMessage() for r in caplog.records)
    out = _gather(engine, prompts[:1], SamplingParams(max_new_tokens=16, greedy=True))[0]
    assert set(out.versions) == {9}
    np.testing.assert_allclose(out.logprobs, reference_logprobs(m9, prompts[0], out.tokens), atol=LOGPROB_ATOL)


def test_a_start_vllm_refuses_fails_at_once_with_an_error_that_pickles(vllm_models):
    """A max_model_len above the model's positions: vLLM's pydantic error cannot be pickled,
    so a node's start raising it (or an error chained to it) never reported to the scheduler;
    the engine raises its message alone."""
    from distributed.protocol.pickle import dumps, loads  # Dask's, with tblib's support for causes

    from astraflow.rollout.config import VLLMConfig

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="starting the vLLM engine on .* failed: ValidationError") as info:
        VLLMEngine(str(vllm_models["v0"]), options=VLLMConfig(max_model_len=1_000_000, cpu_kvcache_gib=1),
                   max_batch_size=4, threads=1)
    assert "max_model_len" in str(loads(dumps(info.value)))
    assert time.monotonic() - t0 < 60
