"""The vLLM engine's weight updates against a stand-in for vLLM's ``AsyncLLM`` (not installed
here): the probe check that catches an engine left on the version it held, the hold that keeps
a version from retention while it is loaded, the log line naming the update path, and a failed
start's error. ``tests/vllm`` covers the same with vLLM itself where it is installed."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astraflow.rollout.vllm_updates import Updater
from storage.weights import WeightStore
from tests.rollout.test_vllm_decisions import _LLM as _RecordingLLM

POLICY = "actor"
TOKENS = [5, 9, 2, 7, 1]


def _probe(shift: float) -> dict:
    """A probe of ``TOKENS``; versions differ by ``shift`` nats per token, less than the tolerance."""
    return {"tokens": TOKENS, "logprobs": [-1.0 - shift, -2.0 - shift, -3.0 + shift, -0.5 - shift]}


class _LLM(_RecordingLLM):
    """Holds one version's weights: scores that version's probe exactly; ``reload_weights``
    loads the directory's version unless ``stale`` (an update that returns but changes nothing)."""

    def __init__(self, holds: int, probes: dict[int, dict], stale: bool = False):
        super().__init__(fail_reload=False)
        self.holds, self.probes, self.stale = holds, probes, stale

    async def collective_rpc(self, method, kwargs=None):
        await super().collective_rpc(method, kwargs)
        if not self.stale:
            self.holds = int(Path(kwargs["weights_path"]).name[1:])  # the update's directory: v<version>

    def score(self) -> list[float]:
        return list(self.probes.get(self.holds, _probe(-1.0))["logprobs"])


def _engine(tmp_path: Path, probes: dict[int, dict], stale: bool = False, weight_update: str = "reload"):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    eng = SimpleNamespace(
        options=SimpleNamespace(weight_update=weight_update, probe_tolerance=0.05), llm=_LLM(0, probes, stale),
        _gate=asyncio.Event(), _running={}, steps_left=lambda: 0, swap_min_remaining=8, model_path=str(model),
        version=0, serving_version=0, _dead=None, _stats={"weight_swaps": 0, "recreations": 0},
        reach_core=_nothing, labels_versions=True, dead=None)

    async def start(model_dir, version):  # a re-created engine holds the directory's weights
        eng.llm = _LLM(version, probes)

    eng._start, eng._shutdown = start, _nothing
    return eng


async def _nothing() -> None:
    """Nothing to wait for or shut down in the stand-in."""


def _store(tmp_path: Path, probes: dict[int, dict], keep_last: int = 10) -> WeightStore:
    store = WeightStore(tmp_path / "weights", keep_last=keep_last)
    for v, probe in probes.items():
        store.publish(POLICY, v, {"w": torch.full((4,), float(v))}, meta={"layout": "hf", "probe": probe})
    return store


def _updater(eng, native: bool = False) -> Updater:
    updater = Updater(eng, build="a test build", native=native)

    async def score(probe):
        return eng.llm.score()

    updater._score = score
    return updater


def _load(updater: Updater, store: WeightStore, version: int) -> None:
    asyncio.run(updater._update(version, store=(str(store.root), POLICY, False, 1)))


def test_an_update_that_leaves_the_engine_on_the_held_version_is_caught_and_redone(tmp_path, caplog):
    """v1 and v2 are closer than the tolerance: an engine still on v1 passes a check against v2
    alone. Scored nearer v1's probe than v2's, it is re-created on v2, and the build is blamed."""
    probes = {1: _probe(0.0), 2: _probe(0.01)}
    store, eng = _store(tmp_path, probes), _engine(tmp_path, probes)
    updater = _updater(eng)
    try:
        _load(updater, store, 1)  # nothing verified held before it: the tolerance alone judges
        assert eng.llm.holds == 1 and "stale" not in updater.take_records()[-1]
        eng.llm.stale = True
        with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
            _load(updater, store, 2)
    finally:
        updater.close()
    rec = updater.take_records()[-1]
    assert rec["probe_error"] == pytest.approx(0.01) and rec["probe_error_held"] == 0.0
    assert rec["stale"] and rec["probe_held_version"] == 1 and rec["fallback"] == "recreate"
    assert rec["probe_error_after_fallback"] == 0.0 and eng.llm.holds == 2 and eng.serving_version == 2
    assert updater.mode == "recreate" and eng._stats["recreations"] == 1
    assert any("a test build served the held version's weights" in r.getMessage() for r in caplog.records)


def test_an_update_that_loads_the_new_version_is_accepted_in_place(tmp_path):
    probes = {1: _probe(0.0), 2: _probe(0.01), 3: _probe(0.02)}
    store, eng = _store(tmp_path, probes), _engine(tmp_path, probes)
    updater = _updater(eng)
    try:
        for v in (1, 2, 3):
            _load(updater, store, v)
    finally:
        updater.close()
    rec = updater.take_records()[-1]
    assert rec["probe_held_version"] == 2 and rec["probe_error"] == 0.0 and "fallback" not in rec
    assert updater.mode == "reload" and eng.serving_version == 3 and eng._stats["recreations"] == 0


def test_a_version_retired_before_its_update_is_refused_before_generation_stops(tmp_path):
    """Nothing is paused or aborted for a version that is gone: the engine keeps serving."""
    from storage.weights import VersionNotCommitted

    probes = {1: _probe(0.0)}
    store, eng = _store(tmp_path, probes), _engine(tmp_path, probes)
    updater = _updater(eng)
    try:
        with pytest.raises(VersionNotCommitted):
            _load(updater, store, 2)
    finally:
        updater.close()
    assert eng.llm.calls == [] and eng.serving_version == 0 and eng._dead is None and eng._gate.is_set()


def test_retention_during_an_update_keeps_the_version_being_loaded(tmp_path):
    """Retention (``keep_last`` 1, v2 newer) runs while the update stops generation: the update
    holds v1, so v1 stays and is loaded, rather than vanishing before it is read."""
    probes = {1: _probe(0.0), 2: _probe(0.01)}
    store, eng = _store(tmp_path, probes), _engine(tmp_path, probes)
    updater = _updater(eng)
    pause = eng.llm.pause_generation

    async def pause_and_retire(mode, clear_cache):
        assert WeightStore(store.root, keep_last=1).apply_retention(POLICY) == []
        await pause(mode, clear_cache)

    eng.llm.pause_generation = pause_and_retire
    try:
        _load(updater, store, 1)
    finally:
        updater.close()
    assert eng.serving_version == 1 and eng.llm.holds == 1 and eng._dead is None
    assert WeightStore(store.root).held_versions(POLICY) == set()  # the hold is released after the update
    assert WeightStore(store.root, keep_last=1).apply_retention(POLICY) == [1]


@pytest.mark.parametrize("wanted, native, mode, why", [
    ("auto", True, "in_place", "auto: the build has vLLM's weight-transfer protocol"),
    ("auto", False, "recreate", "auto: the build lacks vLLM's weight-transfer protocol"),
    ("reload", True, "reload", "rollout.engine.vllm.weight_update asks for it"),
])
def test_the_update_path_is_logged_with_its_reason(tmp_path, caplog, wanted, native, mode, why):
    with caplog.at_level(logging.INFO, logger="astraflow.rollout"):
        updater = Updater(_engine(tmp_path, {}, weight_update=wanted), build="a test build", native=native)
    updater.close()
    assert updater.mode == mode
    assert f"vLLM engine: weight updates {mode} on a test build ({why})" in caplog.messages


def test_a_failed_start_raises_an_error_the_scheduler_can_pickle(tiny_model, monkeypatch):
    """vLLM's config errors are pydantic ``ValidationError``s holding unpicklable inputs: raised
    as they are, or as the cause or context of another error (Dask pickles those too), a node's
    start never reported its failure and its run waited for a timeout."""
    from distributed.protocol.pickle import dumps, loads  # Dask's, with tblib's support for causes
    from pydantic import model_validator
    from pydantic.dataclasses import dataclass

    from astraflow.rollout import vllm_setup
    from astraflow.rollout.vllm_engine import VLLMEngine

    @dataclass
    class ModelConfig:  # as vLLM's: a pydantic dataclass whose validator refuses the length
        max_model_len: int

        @model_validator(mode="after")
        def fits(self):
            raise ValueError(f"max_model_len {self.max_model_len} is above the model's 2048 positions")

    def make_async_llm(model_dir, options, **kwargs):
        ModelConfig(max_model_len=100_000)

    monkeypatch.setattr(vllm_setup, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_setup, "labels_versions", lambda: True)
    monkeypatch.setattr(vllm_setup, "make_async_llm", make_async_llm)
    with pytest.raises(RuntimeError) as info:
        VLLMEngine(str(tiny_model), options=SimpleNamespace())
    err = loads(dumps(info.value))
    assert "starting the vLLM engine on" in str(err) and "above the model's 2048 positions" in str(err)
    assert "ValidationError" in str(err)
