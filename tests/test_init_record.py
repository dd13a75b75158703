"""A model directory built from a policy's ``init`` records that init, and a config whose
``init`` asks for another model is refused (exit 2, naming the directory and both inits)
instead of training the old model as if it were the new one. A directory without the record (a
user's checkpoint, one built by an older AstraFlow) is left alone."""

from __future__ import annotations

import json

import pytest

from astraflow.config import ConfigError, config_from_dict, load_config
from astraflow.preflight import check_models
from astraflow.training.config import ModelInit, PolicyConfig
from tests.test_cli_errors import _config, _invoke


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny example's model, built by ``prepare_models`` as ``astraflow run`` builds it."""
    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress

    tmp = tmp_path_factory.mktemp("init_record")
    path = _config(tmp)
    prepare_models(load_config(path), Progress(enabled=False))
    return tmp, path


def test_a_built_model_records_its_init(built):
    tmp, _ = built
    record = json.loads((tmp / "models" / "tiny" / "astraflow_init.json").read_text())
    assert ModelInit.model_validate(record) == ModelInit(preset="tiny", arch="qwen2", warm_start_seconds=0)


def test_the_same_init_checks(built):
    _, path = built
    res = _invoke("check", str(path))
    assert res.exit_code == 0, res.output


def test_another_init_is_refused_naming_both_and_the_fix(built):
    tmp, path = built
    res = _invoke("check", str(path), "--set", "policies.solver.init.preset=50m",
                  "--set", "policies.solver.init.arch=llama")
    assert res.exit_code == 2, res.output
    model = tmp / "models" / "tiny"
    text = " ".join(res.output.split())
    assert (f'policies[solver].model {model} was built with init {{preset: "tiny", arch: "qwen2"}}, the '
            f'config\'s init asks for {{preset: "50m", arch: "llama"}}: remove {model} to rebuild it, or drop '
            "init") in text, res.output


def test_without_init_the_directory_is_used_as_it_is(built):
    _, path = built
    data = load_config(path).model_dump(mode="json")
    data["policies"][0]["init"] = None
    check_models(config_from_dict(data))  # no error: the model there is trained


def test_a_directory_that_records_no_init_is_left_alone(tmp_path, built):
    """A user's checkpoint (here: the built model without its record) with any ``init``."""
    import shutil

    src, _ = built
    path = _config(tmp_path)
    shutil.copytree(src / "models" / "tiny", tmp_path / "models" / "tiny")
    (tmp_path / "models" / "tiny" / "astraflow_init.json").unlink()
    check_models(load_config(path, ["policies.solver.init.preset=mini"]))


def test_settings_a_build_does_not_use_are_no_difference(tmp_path):
    """Without a warm start its learning rate shapes nothing; with ``start_from`` the base's
    preset does: neither refuses a directory built with another value."""
    from astraflow.models import record_init
    from astraflow.preflight import check_built_from_init

    (tmp_path / "m").mkdir()
    record_init(tmp_path / "m", ModelInit(preset="tiny", warm_start_lr=1e-3).model_dump(mode="json"))
    check_built_from_init(PolicyConfig(name="p", model=tmp_path / "m", init={"preset": "tiny", "warm_start_lr": 0.1}))
    with pytest.raises(ConfigError, match=r"warm_start_steps: null.*warm_start_steps: 5"):
        check_built_from_init(PolicyConfig(name="p", model=tmp_path / "m", init={"preset": "tiny",
                                                                                "warm_start_steps": 5}))
    record_init(tmp_path / "m", ModelInit(preset="tiny", start_from="a").model_dump(mode="json"))
    check_built_from_init(PolicyConfig(name="p", model=tmp_path / "m", init={"preset": "mini", "start_from": "a"}))


def test_runs_started_together_build_a_missing_model_once(tmp_path):
    """A run that finds another building the model waits for it and then uses what it built,
    checked like any existing model: never built twice, never replaced under the other run."""
    import fcntl
    import os
    import threading

    from astraflow.models import record_init
    from astraflow.runtime.model_build import build_model, prepare_models
    from astraflow.runtime.progress import Progress

    cfg = load_config(_config(tmp_path))
    model = cfg.policies[0].model
    model.parent.mkdir(parents=True)
    fd = os.open(model.parent / f".{model.name}.build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # "another run" is building the model
    waiter = threading.Thread(target=prepare_models, args=(cfg, Progress(enabled=False)), daemon=True)
    try:
        waiter.start()
        waiter.join(3.0)
        assert waiter.is_alive() and not model.exists()  # it waits for the build it would repeat
        pol = cfg.policies[0]  # the other run's build, under its lock
        build_model(model, pol.init, cfg.workload)
        record_init(model, pol.init.model_dump(mode="json"))
        built = os.stat(model / "config.json")
    finally:
        os.close(fd)
    waiter.join(60)
    assert not waiter.is_alive()
    after = os.stat(model / "config.json")
    assert (after.st_ino, after.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)


def test_a_built_model_appears_with_its_record(tmp_path, monkeypatch):
    """A run that finds the model another run has just built checks it against its own ``init``
    by the record: the directory must never be seen without it (it would be taken for a user's
    checkpoint and trained whatever the init asks for)."""
    from pathlib import Path

    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress

    cfg = load_config(_config(tmp_path))
    model, seen = cfg.policies[0].model, []
    rename = Path.rename

    def watched(self, target):
        if Path(target) == model:  # the moment the model directory appears
            seen.append(sorted(p.name for p in Path(self).iterdir()))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", watched)
    prepare_models(cfg, Progress(enabled=False))
    assert len(seen) == 1 and "astraflow_init.json" in seen[0], seen
    assert ModelInit.model_validate(json.loads((model / "astraflow_init.json").read_text())) == cfg.policies[0].init


def test_a_models_directory_without_locks_still_builds(tmp_path, monkeypatch):
    """NFS mounted nolock, Lustre noflock: flock fails with ENOLCK; the model is built unguarded."""
    import errno
    import fcntl

    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cfg = load_config(_config(tmp_path))
    prepare_models(cfg, Progress(enabled=False))
    assert (cfg.policies[0].model / "config.json").is_file()


def test_without_locks_a_run_whose_build_lost_the_race_uses_the_other_runs_model(tmp_path, monkeypatch):
    """Runs started together on a file system without locks build the model twice: the one whose
    build finishes second finds the directory filled, and uses that model (checked against its
    init as any other) instead of failing; one that records another init is still refused."""
    import errno
    import fcntl
    import shutil

    from astraflow import models
    from astraflow.runtime import model_build
    from astraflow.runtime.progress import Progress

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cfg = load_config(_config(tmp_path))
    pol, other_init, building = cfg.policies[0], {}, []
    init_model = models.init_model

    def built_meanwhile(out, **kwargs):  # the other run's build ends while this one initialises
        if not building:
            building.append(out)
            init = other_init or pol.init.model_dump(mode="json")
            model_build.build_model(pol.model, ModelInit.model_validate(init), record=init)
        return init_model(out, **kwargs)

    monkeypatch.setattr(models, "init_model", built_meanwhile)
    notes = []
    progress = Progress(enabled=False)
    monkeypatch.setattr(progress, "note", notes.append)
    model_build.prepare_models(cfg, progress)
    assert any("built by another run meanwhile" in n for n in notes), notes
    assert ModelInit.model_validate(json.loads((pol.model / "astraflow_init.json").read_text())) == pol.init
    assert not [p for p in pol.model.parent.iterdir() if p.name.startswith(f".{pol.model.name}.") and p.is_dir()]

    shutil.rmtree(pol.model)
    building.clear()
    other_init.update(ModelInit(preset="tiny", arch="qwen2", seed=9).model_dump(mode="json"))
    with pytest.raises(ConfigError, match=r"was built with init \{seed: 9\}, the config's init asks for \{seed: 0\}"):
        model_build.prepare_models(cfg, progress)


def test_a_warm_start_trains_on_the_runs_split_and_a_run_on_other_problems_is_warned(tmp_path, monkeypatch):
    """The math warm start trains on the split of the run's ``workload.seed`` (a held-out problem
    of that seed is never a warm-start one), records what it trained on, and a later run whose
    workload draws other problems is warned that its held-out set may have been trained on."""
    import io

    from rich.console import Console

    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress
    from astraflow.workloads.math import MathConfig, make_dataset

    path = _config(tmp_path)
    sets = ["policies.solver.init.warm_start_steps=2", "workload.seed=3"]
    cfg = load_config(path, sets)
    seen = {}
    import astraflow.training.warmstart as ws

    real = ws.warm_start

    def spy(*args, workload=None, **kw):  # what the warm start is asked to train on
        seen["workload"] = workload
        return real(*args, workload=workload, **kw)

    monkeypatch.setattr(ws, "warm_start", spy)
    prepare_models(cfg, Progress(enabled=False))
    trained = {p["question"] for p in make_dataset(MathConfig.from_any(seen["workload"]), "train")}
    held_out = {p["question"] for p in make_dataset(MathConfig(digits=1, num_test=20, seed=3), "test")}
    assert trained and held_out and not trained & held_out
    record = json.loads((tmp_path / "models" / "tiny" / "astraflow_init.json").read_text())
    assert record["warm_started_on"] == {"name": "math", "params": {"digits": 1, "num_test": 20}, "seed": 3}

    def notes(*more):
        out = io.StringIO()
        prepare_models(load_config(path, sets + list(more)), Progress(console=Console(file=out, width=400)))
        return " ".join(out.getvalue().split())

    assert "warning" not in notes()  # the same problems: nothing to say, and the record still checks
    assert "warning" not in notes("workload.params.num_test=30")  # other problems, none of them taught
    said = notes("workload.seed=4")
    assert "the warm start of" in said and 'held-out prompts (warm-started on math {"seed": 3})' in said, said
    assert "Vary run.seed" in said
    # a model built before the record named its workload: a math warm start took seed 0's split
    del record["warm_started_on"]
    (tmp_path / "models" / "tiny" / "astraflow_init.json").write_text(json.dumps(record))
    assert 'held-out prompts (warm-started on math {"seed": 0})' in notes()


def test_a_build_removes_what_a_killed_build_left_beside_the_model(tmp_path):
    """A build killed before its cleanup ran (SIGKILL, a node lost) leaves its temporary sibling
    ``.<model>.XXXXXXXX``; the next build, holding the lock, removes it. Other names are kept."""
    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress

    cfg = load_config(_config(tmp_path))
    model = cfg.policies[0].model
    model.parent.mkdir(parents=True)
    left = model.parent / f".{model.name}.k1ll3d_x"
    (left / "init").mkdir(parents=True)
    (left / "init" / "model.safetensors").write_bytes(b"\0" * 1024)
    kept = [model.parent / f".{model.name}.notes", model.parent / f".{model.name}.abcdefgh.txt"]
    kept[0].mkdir()
    kept[1].write_text("mine")
    prepare_models(cfg, Progress(enabled=False))
    assert (model / "config.json").is_file()
    assert not left.exists()
    assert all(p.exists() for p in kept)
