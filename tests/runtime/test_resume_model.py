"""A resume loads the committed weights into each policy's model: a model of another architecture
is refused before any worker starts, naming what differs; the same architecture elsewhere is fine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.resume_checks import check_same_models
from storage.weights import WeightStore
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _variant(tiny_model: Path, out: Path, **changes) -> Path:
    """A copy of the tiny model whose config.json says ``changes`` (only config.json is read)."""
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_a_resume_on_a_model_of_another_shape_is_refused_and_the_same_shape_elsewhere_is_not(tiny_model, tmp_path):
    run = tmp_path / "run"
    check_same_models(tiny_config(tiny_model), run)  # the first start records the signature
    recorded = json.loads((run / "control" / "models.json").read_text())
    assert recorded["solver"]["hidden_size"] == json.loads((tiny_model / "config.json").read_text())["hidden_size"]
    wider = _variant(tiny_model, tmp_path / "wider", hidden_size=2 * recorded["solver"]["hidden_size"])
    check_same_models(tiny_config(wider), run)  # nothing committed yet: a new model is taken (and recorded)
    check_same_models(tiny_config(tiny_model), run)

    WeightStore(run / "weights").publish("solver", 1, {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"policies\[solver\]\.model: .*wider is not the architecture this run "
                                         r"directory's weights were trained as \(hidden_size \d+ -> \d+; recorded in"):
        check_same_models(tiny_config(wider), run)
    moved = shutil.copytree(tiny_model, tmp_path / "moved")
    check_same_models(tiny_config(moved), run)  # the same architecture at another path
    resaved = _variant(tiny_model, tmp_path / "resaved")
    config = json.loads((resaved / "config.json").read_text())
    del config["tie_word_embeddings"]  # a key one save leaves to its default: not a difference
    (resaved / "config.json").write_text(json.dumps(config))
    check_same_models(tiny_config(resaved), run)

    old = tmp_path / "old_run"  # weights from before the record existed: no record is made, nothing refused
    WeightStore(old / "weights").publish("solver", 1, {"w": torch.zeros(2)})
    check_same_models(tiny_config(wider), old)
    assert not (old / "control" / "models.json").exists()
    check_same_models(tiny_config(tiny_model), old)


def test_astraflow_run_refuses_the_resume_with_exit_2_before_workers_start(tiny_model, tmp_path):
    run = tmp_path / "run"
    check_same_models(tiny_config(tiny_model), run)
    WeightStore(run / "weights").publish("solver", 1, {"w": torch.zeros(2)})
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    # a whole model of another architecture: a config.json edited alone fails the model's own checks first
    from astraflow.models import init_model

    data["policies"][0]["model"] = str(init_model(tmp_path / "untied", preset="tiny", tie_word_embeddings=False))
    data["policies"][0].pop("init", None)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["run", str(tmp_path / "cfg.yaml"), "--run-dir", str(run)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "weights were trained as (tie_word_embeddings True -> False" in res.output, res.output
    assert not (run / "jobs" / "submitted.json").exists()


def test_running_again_a_run_that_completed_at_max_steps_starts_nothing(tiny_model, tmp_path):
    from astraflow.runtime.launch import already_done

    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    check_same_models(tiny_config(tiny_model), run)
    store = WeightStore(run / "weights")
    for v in (0, 2):
        store.publish("solver", v, {"w": torch.zeros(2)})
    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    assert already_done(tiny_config(tiny_model, run__max_steps=3), run) is None  # more to train
    said = already_done(tiny_config(tiny_model, run__max_steps=2), run)
    assert said is not None and "has completed already (solver v2; run.max_steps 2): nothing to do" in said
    (run / "summary.json").write_text(json.dumps({"status": "failed"}))
    assert already_done(tiny_config(tiny_model, run__max_steps=2), run) is None  # resumed to finish its work

    (run / "summary.json").write_text(json.dumps({"status": "completed"}))
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init", None)
    data["run"]["max_steps"] = 2
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["run", str(tmp_path / "cfg.yaml"), "--run-dir", str(run)])
    assert res.exit_code == 0 and "has completed already" in res.output, res.output
    assert not (run / "jobs" / "submitted.json").exists() and json.loads((run / "summary.json").read_text()) == \
        {"status": "completed"}


def test_a_resume_says_where_each_policy_goes_on_and_which_settings_changed(tiny_model, tmp_path):
    from astraflow.config import dump_config
    from astraflow.runtime.resuming import resume_note

    run = tmp_path / "run"
    first = tiny_config(tiny_model, run__max_steps=6)
    assert resume_note(first, run) == []  # a new run directory: nothing to say
    (run / "control").mkdir(parents=True)
    dump_config(first, run / "config.yaml")  # what the first start saved
    WeightStore(run / "weights").publish("solver", 4, {"w": torch.zeros(2)})
    assert resume_note(first, run) == [f"resuming the run in {run}: solver from v4 (the newest committed weights)"]

    more = tiny_config(tiny_model, run__max_steps=9, dataflow__batch_size=first.dataflow.batch_size * 2)
    going_on, changed = resume_note(more, run)
    assert f"dataflow.batch_size {first.dataflow.batch_size} -> {2 * first.dataflow.batch_size}" in changed
    assert "run.max_steps 6 -> 9" in changed and changed.count("->") == 2

    tuned = tiny_config(tiny_model, policies__0__trainer__lr=first.policies[0].trainer.lr * 2)
    assert not any("open tasks" in line for line in resume_note(tuned, run))  # a policy's settings mean no task anew
    regrouped = tiny_config(tiny_model, workload__group_size=first.workload.group_size * 2)
    *_, meaning = resume_note(regrouped, run)
    assert "open tasks mean: they are dropped (config_changed)" in meaning
