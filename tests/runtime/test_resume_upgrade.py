"""Resuming a run directory an older AstraFlow wrote: its weights get the architecture check
(from their manifests, then recorded), a trajectory store of a layout this code cannot read is
refused before anything starts, and the resume's note names the user's changes, not the
settings new in this version."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.resume_checks import check_resumable, check_same_models
from storage.paths import RunPaths
from storage.trajectories import open_trajectory_store
from storage.weights import WeightStore
from tests.conftest import tiny_config
from tests.runtime.test_resume_model import _variant

ROOT = Path(__file__).resolve().parents[2]


def _old_run(tiny_model: Path, run: Path, layout: str = "hf") -> Path:
    """A run directory with committed weights and no ``control/models.json``, as versions before
    the record left it: the manifest's meta holds the model config the weights were trained as."""
    config = json.loads((tiny_model / "config.json").read_text())
    meta = {"layout": "hf", "config": config} if layout == "hf" else {"layout": "megatron", "hf_config": config}
    store = WeightStore(run / "weights")
    for v in (1, 2):
        store.publish("solver", v, {"w": torch.zeros(2)}, meta=meta)
    return run


def _cli_config(tmp_path: Path, model: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "cfg.yaml"


def _never_started(monkeypatch):
    """A run that gets as far as starting its workers fails the test at once."""
    import astraflow.runtime.launch as launch

    def started(*args, **kwargs):
        raise AssertionError("the run started its workers")

    monkeypatch.setattr(launch, "Orchestrator", started)


@pytest.mark.parametrize("layout", ["hf", "megatron"])
def test_weights_without_a_record_are_checked_against_their_manifest_and_recorded(tiny_model, tmp_path, layout):
    run = _old_run(tiny_model, tmp_path / "run", layout)
    hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    wider = _variant(tiny_model, tmp_path / "wider", hidden_size=2 * hidden)
    refused = rf"wider is not the architecture this run directory's weights were trained as \(hidden_size {hidden} -> "
    with pytest.raises(ValueError, match=rf"policies\[solver\]\.model: .*{refused}{2 * hidden}"):
        check_same_models(tiny_config(wider), run)
    recorded = json.loads((run / "control" / "models.json").read_text())
    assert recorded["solver"]["hidden_size"] == hidden  # from the weights, not from the refused model
    check_same_models(tiny_config(tiny_model), run)
    with pytest.raises(ValueError, match="hidden_size"):  # from the record now
        check_same_models(tiny_config(wider), run)


def test_weights_whose_manifest_has_no_model_config_stay_unchecked(tiny_model, tmp_path):
    run = tmp_path / "run"
    WeightStore(run / "weights").publish("solver", 1, {"w": torch.zeros(2)}, meta={"sim": True})
    check_same_models(tiny_config(_variant(tiny_model, tmp_path / "wider", hidden_size=512)), run)
    assert not (run / "control" / "models.json").exists()


def test_astraflow_run_refuses_an_old_run_directory_on_another_architecture_before_workers_start(
        tiny_model, tmp_path, monkeypatch):
    run = _old_run(tiny_model, tmp_path / "run")
    RunPaths(run).make()
    _never_started(monkeypatch)
    from astraflow.models import init_model

    untied = init_model(tmp_path / "untied", preset="tiny", arch="qwen2", tie_word_embeddings=False)
    res = CliRunner().invoke(main, ["run", str(_cli_config(tmp_path, untied)), "--run-dir", str(run)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "not the architecture this run directory's weights were trained as (tie_word_embeddings True -> " \
           "False" in res.output, res.output


def _store_of_layout(root: Path, version: int) -> None:
    """A trajectory store whose layout record says ``version`` (as a newer AstraFlow leaves it)."""
    open_trajectory_store(str(root), "a")
    layout = root / "astraflow_store.json"
    layout.write_text(json.dumps({**json.loads(layout.read_text()), "layout_version": version}))


def test_a_store_layout_this_code_cannot_read_is_refused_before_anything_starts(tiny_model, tmp_path):
    run = tmp_path / "run"
    paths = RunPaths(run).make()
    check_resumable(tiny_config(tiny_model), run)  # no store yet: the run creates it
    open_trajectory_store(str(paths.trajectories), "a")
    check_resumable(tiny_config(tiny_model), run)  # this version's layout
    _store_of_layout(paths.trajectories, 99)
    with pytest.raises(ValueError, match=r"storage\.trajectories: .*layout version 99.*new run directory"):
        check_resumable(tiny_config(tiny_model), run)
    elsewhere = tmp_path / "store"
    _store_of_layout(elsewhere, 99)  # the store storage.trajectories names is the one checked
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match=r"storage\.trajectories: .*layout version 99"):
        check_resumable(tiny_config(tiny_model, storage__trajectories=str(elsewhere)), fresh)


def test_astraflow_run_on_an_unreadable_store_exits_2_and_leaves_the_summary(tiny_model, tmp_path, monkeypatch):
    run = tmp_path / "run"
    paths = RunPaths(run).make()
    _store_of_layout(paths.trajectories, 99)
    paths.summary.write_text(json.dumps({"status": "interrupted"}))
    _never_started(monkeypatch)
    res = CliRunner().invoke(main, ["run", str(_cli_config(tmp_path, tiny_model)), "--run-dir", str(run)])
    assert res.exit_code == 2 and "storage.trajectories" in res.output and "Traceback" not in res.output, res.output
    assert json.loads(paths.summary.read_text()) == {"status": "interrupted"}
    assert not (run / "jobs" / "submitted.json").exists()


def _flat_count(section: dict) -> int:
    from astraflow.runtime.resuming import _flat

    return len(_flat(section))


def test_the_resume_note_names_the_users_changes_first_and_counts_the_new_settings(tiny_model, tmp_path):
    from astraflow.config import dump_config
    from astraflow.runtime.resuming import MAX_NAMED, resume_note

    run = tmp_path / "run"
    first = tiny_config(tiny_model)
    RunPaths(run).make()
    dump_config(first, run / "config.yaml")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    new_here = _flat_count(saved.pop("sandbox")) + 1  # as a version before these settings wrote it
    del saved["cluster"]["stop_grace_s"]
    del saved["dataflow"]["direct_lane"]  # set to a value of the user's below: a change
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    WeightStore(run / "weights").publish("solver", 3, {"w": torch.zeros(2)})

    moved = shutil.copytree(tiny_model, tmp_path / "moved")
    overrides = {f"rollout__{k}": v for k, v in (("capacity", 8), ("weight_poll_seconds", 0.5),
                                                   ("episode_timeout_s", 99.0), ("reward_timeout_s", 40.0))}
    now = tiny_config(moved, run__max_steps=9, run__seed=first.run.seed + 1, dataflow__lease_seconds=33,
                      dataflow__direct_lane=not first.dataflow.direct_lane, cluster__trainer_restarts=5,
                      workload__sampling__max_new_tokens=8, **overrides)
    going_on, changed, new = resume_note(now, run)
    named = changed.removeprefix("settings changed since its last start: ").split("; ")
    assert named[0].startswith("policies.solver.model "), named
    assert named[1] == "workload.sampling.max_new_tokens 4 -> 8", named
    # ten changed values and dataflow.direct_lane, which the saved config lacks and the user set
    assert len(named) == MAX_NAMED + 1 and named[-1] == "and 3 more", named
    assert "(unset)" not in changed and "sandbox" not in changed and "stop_grace_s" not in changed
    assert new == f"{new_here} settings new in this AstraFlow version, at their defaults"


def test_the_resume_note_tells_a_changed_default_from_a_change_of_the_users(tiny_model, tmp_path):
    """An older version wrote its defaults into the saved config; where this version's default
    differs and the config leaves the setting unset, the user changed nothing: the note says so
    on a line of its own, and a long list says what it adds instead of two cut-short prefixes."""
    from astraflow.config import config_from_dict, dump_config
    from astraflow.runtime.resuming import resume_note

    run = tmp_path / "run"
    RunPaths(run).make()
    dump_config(tiny_config(tiny_model), run / "config.yaml")
    saved = yaml.safe_load((run / "config.yaml").read_text())
    added = saved["cluster"]["worker_env_allowlist"].pop()  # the older default lacked one
    saved["rollout"]["capacity"] = 32  # the older default; the tiny example sets it: left unset below
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    WeightStore(run / "weights").publish("solver", 3, {"w": torch.zeros(2)})

    data = yaml.safe_load(_cli_config(tmp_path, tiny_model).read_text())
    del data["rollout"]["capacity"]
    data["run"]["max_steps"] = 9
    going_on, changed, defaults = resume_note(config_from_dict(data), run)
    assert changed == "settings changed since its last start: run.max_steps 4 -> 9", changed
    assert defaults.startswith("settings the config leaves unset, at this AstraFlow version's defaults"), defaults
    assert f'cluster.worker_env_allowlist adds ["{added}"]' in defaults, defaults
    assert "rollout.capacity 32 -> (unset)" in defaults and "max_steps" not in defaults, defaults
