"""A node's engines start side by side (``engines.make_engines``): every engine process is
started before the node waits for the first to load its model, and an engine that fails to
start stops the others, loaded or still loading. Real engine processes on the CPU."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from astraflow.rollout.config import EngineConfig
from astraflow.rollout.engines import make_engines
from astraflow.rollout.process_engine import ProcessEngine


@pytest.fixture
def recorded(monkeypatch):
    """What ``ProcessEngine`` does, in order: ("launch", model, process) and ("ready", model)."""
    events = []
    launch, wait = ProcessEngine._launch, ProcessEngine.wait_started

    def recording_launch(self, version):
        launch(self, version)
        events.append(("launch", self._args[0], self._proc))

    def recording_wait(self):
        wait(self)
        events.append(("ready", self._args[0]))

    monkeypatch.setattr(ProcessEngine, "_launch", recording_launch)
    monkeypatch.setattr(ProcessEngine, "wait_started", recording_wait)
    return events


def _misshapen(tiny_model, where):
    """A copy of the tiny model whose config describes other shapes than its weights: the node's
    check passes, the engine process refuses it once it has built the model."""
    where.mkdir()
    for f in tiny_model.iterdir():
        (where / f.name).write_bytes(f.read_bytes())
    config = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    return where


@pytest.mark.timeout(180)
def test_the_engines_of_a_node_load_side_by_side_and_a_refused_one_stops_them_all(tiny_model, tmp_path, recorded):
    bad = _misshapen(tiny_model, tmp_path / "misshapen")
    with pytest.raises(ValueError, match="config.json does not describe the weights next to it"):
        make_engines(EngineConfig(device="cpu", max_batch=4), {"good": str(tiny_model), "bad": str(bad)})
    kinds = [e[0] for e in recorded]
    assert kinds == ["launch", "launch", "ready"], recorded  # both loading before the first is waited for
    procs = [e[2] for e in recorded if e[0] == "launch"]
    assert [e[1] for e in recorded if e[0] == "launch"] == [str(tiny_model), str(bad)]
    assert all(p.exitcode is not None for p in procs)  # the good engine, loaded, is stopped too
    assert not set(procs) & set(multiprocessing.active_children())


@pytest.mark.timeout(120)
def test_a_model_refused_before_its_process_starts_stops_an_engine_still_loading(tiny_model, tmp_path, recorded):
    with pytest.raises(ValueError, match="not an HF model directory"):
        make_engines(EngineConfig(device="cpu", max_batch=4),
                     {"good": str(tiny_model), "missing": str(tmp_path / "nowhere")})
    (kind, _, proc), = recorded  # never waited for: killed while it loaded
    assert kind == "launch" and proc.exitcode is not None
    assert proc not in multiprocessing.active_children()
