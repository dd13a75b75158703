"""Status files that are valid JSON objects but not what their writer writes (a field missing or
of a wrong type): ``astraflow status`` and ``astraflow partitions list`` exit 2 with one line
naming the file, the field and the fix, never a traceback; fields that may be null or absent
are shown without one."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.monitoring import write_orchestrator_info, write_status
from schedulers import Partition
from storage.paths import RunPaths

PARTS = [Partition(name="data", role="data"), Partition(name="trainer", role="trainer"),
         Partition(name="rollout", role="rollout", nodes=2, autoscale={"max_nodes": 4})]


def _decision(action: str, reason: str) -> dict[str, Any]:
    return {"t": time.time(), "action": action, "partition": "rollout", "count": 1, "desired": 2, "target": 3,
            "reason": reason, "signals": {"trainer_wait": 0.4}}


def _status(paths: RunPaths) -> dict[str, Any]:
    """A snapshot as the orchestrator writes it, every field the text status shows filled in."""
    return {
        "written_at": time.time(), "run_dir": str(paths.root), "tag": "t",
        "data_layer": {"elapsed_s": 12.0, "episodes_per_s": 1.5, "sequences_per_s": 3.0, "generated_tokens_per_s": 40.0,
                       "buffers": {"solver": 8}, "ledger": {"states": {"consumed": 4}},
                       "eval": [{"step": 2, "policy": "solver", "eval_accuracy": 0.5}],
                       "nodes": {"rollout-rollout-local-cpu-0": {
                           "partition": "rollout", "completed": 4, "generated_tokens_per_s": 40.0,
                           "idle_fraction": 0.1}}},
        "trainers": {"solver": {"version": 3, "wait_fraction": 0.2, "last_metrics": {"reward_mean": 0.5}}},
        "trainer_restarts": {"solver": {"count": 0, "limit": 2, "restarts": []}},
        "data_layer_restarts": {"count": 0, "limit": 2, "restarts": []},
        "partitions": {p.name: {**p.model_dump(mode="json"), "state": "active", "live": 1, "serving": 1, "failures": 0,
                                "jobs": {"local-1": "RUNNING"}, "completed": 4, "episodes_per_s": 1.5,
                                "tokens_per_s": 40.0, "refill_in_s": None, "staleness_mean": 0.5, "staleness_max": 1,
                                "consumed": 4, "versions": {"solver": [2, 3]}} for p in PARTS},
        "autoscale": {"config": {"low_wait": 0.05, "high_wait": 0.3, "window_s": 60.0, "max_stale_fraction": None},
                      "last": _decision("hold", "in band"),
                      "changes": [_decision("add", "trainer wait 40% > high_wait 30%")]},
        "workers": {"rollout-rollout-local-cpu-0": {"job_id": "local-1", "partition": "rollout", "state": "RUNNING",
                                                    "phase": "serving"}},
    }


def _run_dir(tmp_path: Path, status: Any = None, info: Any = None) -> tuple[RunPaths, dict[str, Any]]:
    """A running run (this process is its orchestrator), its status and orchestrator files
    replaced by ``status(st)`` and ``info(orchestrator)`` where given."""
    paths = RunPaths(tmp_path / "run").make()
    write_orchestrator_info(paths, "http://127.0.0.1:1/status", None)
    st = _status(paths)
    if status is not None:
        status(st)
    write_status(paths, st)
    if info is not None:
        orch = json.loads(paths.orchestrator_file.read_text())
        info(orch)
        paths.orchestrator_file.write_text(json.dumps(orch))
    return paths, st


def _invoke(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exc_info
    assert "Traceback" not in res.output
    return res.exit_code, res.output


def test_what_the_writer_writes_is_shown(tmp_path):
    paths, _ = _run_dir(tmp_path)
    code, out = _invoke("status", str(paths.root))
    assert code == 0 and "version    3" in out and "dashboard http://127.0.0.1:1/status" in out, out
    assert "autoscale 1..4 nodes" in out and "trainer wait 40% > high_wait 30%" in out
    code, out = _invoke("partitions", "list", str(paths.root))
    assert code == 0 and "rollout" in out, out


def _set(path: str, value: Any):
    """A change to a status dict: ``path``'s field (dotted) set to ``value``, or removed (``...``)."""
    def change(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            d = d[key]
        if value is ...:
            del d[last]
        else:
            d[last] = value
    return change


DAMAGED = {  # what is changed, and what the message says of it
    "orchestrator.json without a pid": (dict(info=_set("pid", ...)), "orchestrator.json", "pid is missing"),
    "orchestrator.json pid a string": (dict(info=_set("pid", "12")), "orchestrator.json",
                                       "pid is a string, not an integer"),
    "written_at a string": (dict(status=_set("written_at", "x")), "status.json",
                            "written_at is a string, not a number or null"),
    "partitions a list": (dict(status=_set("partitions", [])), "status.json", "partitions is a list, not an object"),
    "a trainer's version null": (dict(status=_set("trainers.solver.version", None)), "status.json",
                                 "trainers.solver.version is null, not an integer"),
    "a partition without nodes": (dict(status=_set("partitions.rollout.nodes", ...)), "status.json",
                                  "partitions.rollout.nodes is missing"),
    "a partition's versions a number": (dict(status=_set("partitions.rollout.versions", 3)), "status.json",
                                        "partitions.rollout.versions is an integer, not an object"),
    "a worker's state null": (dict(status=_set("workers.rollout-rollout-local-cpu-0.state", None)), "status.json",
                              "workers.rollout-rollout-local-cpu-0.state is null, not a string"),
    "the data layer null": (dict(status=_set("data_layer", None)), "status.json", "data_layer is null, not an object"),
    "an evaluation a number": (dict(status=_set("data_layer.eval", [0.5])), "status.json",
                               "data_layer.eval[0] is a number, not an object"),
    "a rate a boolean": (dict(status=_set("data_layer.episodes_per_s", True)), "status.json",
                         "data_layer.episodes_per_s is a boolean, not a number"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["partitions", "list"]])
def test_a_damaged_status_file_exits_2_naming_it(tmp_path, case, command):
    change, name, what = DAMAGED[case]
    paths, _ = _run_dir(tmp_path, **change)
    code, out = _invoke(*command, str(paths.root))
    lines = [x for x in out.splitlines() if x.strip()]
    assert code == 2, out
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    path = paths.orchestrator_file if name == "orchestrator.json" else paths.status_file
    assert f"{path} is damaged ({what}): " in out, out
    assert "if no run is running there, delete it" in out


@pytest.mark.parametrize("change", [
    _set("autoscale", None), _set("trainer_restarts", None), _set("data_layer_restarts", None),
    _set("data_layer_restarts", {"count": 1, "limit": 2}), _set("partitions.rollout.autoscale", None),
    _set("autoscale.last", None), _set("partitions.rollout.staleness_mean", None),
    _set("workers.rollout-rollout-local-cpu-0.phase", ...), _set("data_layer", {}), _set("trainers", {}),
], ids=["no autoscaler", "no trainer restarts", "no data layer restarts", "restarts without records",
        "unbounded partition", "no decision yet", "nothing consumed", "no phase", "empty data layer", "no trainers"])
def test_fields_that_may_be_null_or_absent_are_shown(tmp_path, change):
    paths, _ = _run_dir(tmp_path, status=change)
    for command in (["status"], ["status", "--json"], ["partitions", "list"]):
        code, out = _invoke(*command, str(paths.root))
        assert code == 0, out


@pytest.mark.parametrize("damage", [
    lambda st: st["data_layer"].update(counts=[]),
    lambda st: st["data_layer"]["ledger"].update(events=[]),
    lambda st: st["partitions"]["rollout"].update(capacity="64"),
    lambda st: st["data_layer"].update(versions=["solver"]),
])
def test_a_field_no_check_covers_is_named_as_damage_by_status_json(tmp_path, damage):
    paths, _ = _run_dir(tmp_path, status=damage)
    code, out = _invoke("status", str(paths.root), "--json")
    assert code == 2 and "is damaged (a field of an unexpected type" in out and "delete control/status.json" in out


def test_a_summary_with_a_field_of_another_type_is_named_as_damage(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    paths.summary.write_text(json.dumps({"status": "completed", "steps": ["solver"]}))
    code, out = _invoke("status", str(paths.root))
    assert code == 2 and "is damaged (a field of an unexpected type" in out
