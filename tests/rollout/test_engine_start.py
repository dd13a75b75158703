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

    def recording_wait(self, patience=1.0):
        wait(self, patience)
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


class _Loading:
    """An engine whose process loads until ``wait_started`` (what ``make_engines`` sees of one)."""

    tokenizer = None

    def __init__(self, events, name):
        self.events, self.name = events, name
        events.append(("launch", name))

    def wait_started(self, patience=1.0):
        self.events.append(("ready", self.name))
        self.patience = patience

    def close(self):
        self.events.append(("close", self.name))


def test_no_more_engines_load_at_once_than_the_host_memory_holds(tiny_model, monkeypatch):
    from astraflow.rollout import engines

    events = []
    monkeypatch.setattr(engines, "_make_one", lambda cfg, path, plan, **_: _Loading(events, f"{path}#{plan.index}"))
    need = 2 * engines.weight_bytes(str(tiny_model))  # an fp32 copy of bf16 weights, at most
    assert need > 0
    cfg = EngineConfig(device="cpu", replicas=2)
    monkeypatch.setattr(engines, "available_bytes", lambda: int(need * 1.5 / engines.LOAD_MEMORY_SHARE))
    made = make_engines(cfg, {"a": str(tiny_model), "b": str(tiny_model)})
    assert [len(getattr(e, "replicas", [e])) for e in made.values()] == [2, 2]
    names = [f"{tiny_model}#{i}" for i in (0, 1)] * 2
    assert events == [("launch", names[0]), ("ready", names[0]), ("launch", names[1]), ("ready", names[1]),
                      ("launch", names[2]), ("ready", names[2]), ("launch", names[3]), ("ready", names[3])]
    events.clear()  # room for three: the fourth waits for the first
    monkeypatch.setattr(engines, "available_bytes", lambda: int(need * 3.2 / engines.LOAD_MEMORY_SHARE))
    make_engines(cfg, {"a": str(tiny_model), "b": str(tiny_model)})
    assert [e[0] for e in events] == ["launch"] * 3 + ["ready", "launch"] + ["ready"] * 3
    # three loading together: each may take three times the start timeout of one loading alone
    assert {r.patience for e in made.values() for r in e.replicas} == {1}
    again = make_engines(cfg, {"a": str(tiny_model)})
    assert {r.patience for r in again["a"].replicas} == {2}
    assert engines.load_slots([str(tiny_model)], 8) >= 1 and engines.load_slots(["/nonexistent"], 8) == 8


def test_the_room_a_cgroup_leaves_is_the_least_along_its_path(tmp_path):
    from astraflow.rollout.host_memory import cgroup_room

    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    job, task = root / "slurm" / "job_7", root / "slurm" / "job_7" / "step_0" / "task_0"
    task.mkdir(parents=True)
    (job / "memory.max").write_text("1000\n")  # the job's limit, set above the process's group
    (job / "memory.current").write_text("400\n")
    (task / "memory.max").write_text("max\n")
    (task / "memory.current").write_text("100\n")
    proc.write_text("0::/slurm/job_7/step_0/task_0\n")
    assert cgroup_room(proc, root) == 600
    (job / "memory.max").write_text("max\n")
    assert cgroup_room(proc, root) is None  # no limit anywhere
    v1 = root / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("5000")
    (v1 / "memory.usage_in_bytes").write_text("4200")
    proc.write_text("4:memory:/docker/abc\n3:cpu:/\n")
    assert cgroup_room(proc, root) == 800
    assert cgroup_room(tmp_path / "absent", root) is None
