"""User mistakes at the CLI and in config files: exit code 2 and a message that names the option
or key and the fix, never a traceback; and the help that explains each option. Fast: nothing
here builds or trains a model (a model to be built by ``init`` is only checked to be creatable)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _invoke(*args: str):
    res = CliRunner().invoke(main, list(args))
    assert "Traceback" not in res.output, res.output
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res


def _config(tmp_path: Path, **sections) -> Path:
    """The tiny example with its model (to be built by ``init``) in ``tmp_path``; ``sections``
    replace whole top-level sections."""
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "models" / "tiny")
    data.update(sections)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# -- model init options out of range ---------------------------------------------------------------

@pytest.mark.parametrize("option, value, needle", [
    ("--warm-start-seconds", "-5", "--warm-start-seconds -5: use 0 or more"),
    ("--warm-start-steps", "-1", "--warm-start-steps -1: use 1 or more"),
    ("--warm-start-lr", "nan", "--warm-start-lr nan: use a finite number"),
])
def test_model_init_option_out_of_range_names_the_option(tmp_path, option, value, needle):
    out = tmp_path / "m1"
    res = _invoke("model", "init", str(out), "--preset", "tiny", option, value)
    assert res.exit_code == 2 and needle in res.output, res.output
    assert not out.exists()


# -- a model directory that cannot be created --------------------------------------------------------

def test_check_and_run_refuse_a_model_under_a_file(tmp_path):
    cfg = _config(tmp_path)
    (tmp_path / "afile").write_text("")
    model = f"policies.solver.model={tmp_path / 'afile' / 'm'}"
    res = _invoke("check", str(cfg), "--set", model)
    assert res.exit_code == 2, res.output
    assert "policies[solver].model" in res.output and "is a file, not a directory" in res.output
    run_dir = tmp_path / "run"
    res = _invoke("run", str(cfg), "--run-dir", str(run_dir), "--set", model)
    assert res.exit_code == 2 and "policies[solver].model" in res.output, res.output
    assert not run_dir.exists()  # refused before the run directory (its control/) is made


def test_model_init_refuses_an_out_that_cannot_be_created(tmp_path):
    cfg = _config(tmp_path)
    res = _invoke("model", "init", str(cfg / "sub"), "--preset", "tiny")
    assert res.exit_code == 2 and f"OUT {cfg / 'sub'} cannot be created" in res.output, res.output
    assert "is a file, not a directory" in res.output


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_model_init_refuses_an_out_in_proc():
    res = _invoke("model", "init", "/proc/astraflow-nope", "--preset", "tiny")
    assert res.exit_code == 2 and "OUT /proc/astraflow-nope cannot be created" in res.output, res.output


def test_run_without_run_dir_where_runs_cannot_be_made_names_run_dir(tmp_path, monkeypatch):
    """Started without --run-dir where ``runs/`` cannot be made (a read-only working directory;
    here a file in its place): the one line names --run-dir, not only the errno."""
    cfg = _config(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")
    res = _invoke("run", str(cfg))
    assert res.exit_code == 2 and f"the run directory cannot be made in {tmp_path}" in res.output, res.output
    assert "pass --run-dir in a place you can write to" in res.output, res.output


def test_a_model_directory_whose_name_is_not_utf8_is_refused_naming_the_fix(tmp_path):
    """safetensors takes only UTF-8 paths: a Latin-1 name for ``model init``'s or ``export``'s
    OUT ended in a UnicodeEncodeError traceback after the model was built."""
    out = tmp_path / os.fsdecode(b"mod\xe8le")
    for args in (["model", "init", str(out), "--preset", "tiny"], ["export", str(tmp_path), str(out)]):
        res = _invoke(*args)
        assert res.exit_code == 2 and "the name is not UTF-8 text" in res.output, res.output
        assert "mod\\udce8le" in res.output and not out.exists(), res.output


def test_build_model_names_a_directory_it_cannot_create(tmp_path):
    """The fallback after the checks (a path that became unusable since): a ValueError, not an OSError."""
    from astraflow.runtime.model_build import ModelDirError, build_model
    from astraflow.training.config import ModelInit

    (tmp_path / "afile").write_text("")
    with pytest.raises(ModelDirError, match="afile/m cannot be created"):
        build_model(tmp_path / "afile" / "m", ModelInit(preset="tiny"))


def test_unbuildable_in_a_read_only_directory(tmp_path):
    from storage.ownership import unbuildable
    from tests.conftest import read_only_dir

    ro = tmp_path / "ro"
    ro.mkdir()
    with read_only_dir(ro):
        assert f"no directory can be created in {ro} (" in unbuildable(ro / "a" / "m")
        assert unbuildable(tmp_path / "a" / "m") is None and list(tmp_path.iterdir()) == [ro]  # probe removed
    assert not list(ro.iterdir())


# -- sections of the wrong type, --set into default lists, duplicate keys ---------------------------

def test_policies_not_a_list(tmp_path):
    cfg = _config(tmp_path)
    res = _invoke("check", str(cfg), "--set", "policies=3")
    assert res.exit_code == 2 and "policies: Input should be a valid list" in res.output, res.output
    res = _invoke("check", str(_config(tmp_path, policies=3)))
    assert res.exit_code == 2 and "policies: Input should be a valid list" in res.output, res.output


def test_set_addresses_a_default_partition_by_name(tmp_path):
    cfg = _config(tmp_path)
    assert "partitions" not in yaml.safe_load(cfg.read_text())
    res = _invoke("check", str(cfg), "--set", "partitions.rollout.nodes=1")
    assert res.exit_code == 0, res.output
    parts = {p["name"]: p for p in yaml.safe_load(res.stdout)["partitions"]}
    assert set(parts) == {"data", "trainer", "rollout"} and parts["rollout"]["nodes"] == 1
    assert parts["trainer"]["nodes"] == 1 and parts["data"]["role"] == "data"
    res = _invoke("check", str(cfg), "--set", "partitions.gpu.nodes=1")
    assert res.exit_code == 2, res.output
    assert "no list element named or numbered 'gpu' in partitions (it has data, trainer, rollout)" in res.output


def test_set_takes_a_list_element_as_the_errors_write_it(tmp_path):
    """Messages name elements as ``policies[solver]``: that path, copied into --set, sets the field."""
    res = _invoke("check", str(_config(tmp_path)), "--set", "policies[solver].trainer.lr=0.5",
                  "--set", "partitions[rollout].nodes=1")
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load(res.stdout)
    assert cfg["policies"][0]["trainer"]["lr"] == 0.5
    assert {p["name"]: p["nodes"] for p in cfg["partitions"]}["rollout"] == 1


def test_set_into_a_rule_the_file_names_alone(tmp_path):
    """``ordering: edf`` is the rule with its default params (docs/configuration.md): a --set of its
    type or a parameter reaches into it, as into ``{type: edf}``, instead of "not a section"."""
    dataflow = {"batch_size": 16, "ordering": "edf", "curator": "filter_solved"}
    res = _invoke("check", str(_config(tmp_path, dataflow=dataflow)), "--set", "dataflow.ordering.type=freshest",
                  "--set", "dataflow.curator.params.threshold=0.5")
    assert res.exit_code == 0, res.output
    got = yaml.safe_load(res.stdout)["dataflow"]
    assert got["ordering"]["type"] == "freshest"
    assert got["curator"]["type"] == "filter_solved" and got["curator"]["params"]["threshold"] == 0.5


def test_duplicate_key_in_a_config_file(tmp_path):
    cfg = _config(tmp_path)
    dup = tmp_path / "dup.yaml"
    dup.write_text("run:\n  name: first\n" + cfg.read_text())
    res = _invoke("check", str(dup))
    assert res.exit_code == 2, res.output
    assert "duplicate key run at line 3 (first at line 1)" in res.output


def test_duplicate_key_in_from_yaml(tmp_path):
    (tmp_path / "p.yaml").write_text("name: x\nnodes: 2\nnodes: 3\n")
    res = _invoke("partitions", "add", str(tmp_path), "--from-yaml", str(tmp_path / "p.yaml"))
    assert res.exit_code == 2 and "duplicate key nodes at line 3 (first at line 2)" in res.output, res.output


def test_yaml_merge_keys_still_load():
    from astraflow.configerrors import load_yaml

    assert load_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n") == {"a": {"b": 1}, "c": {"b": 1, "d": 2}}


def test_an_unquoted_walltime_stays_text(tmp_path):
    """YAML 1.1 reads ``12:00:00`` as the base-60 number 43200 (whose quoted form is 30 days)."""
    from astraflow.config import load_config
    from astraflow.configerrors import load_yaml
    from schedulers.partition import walltime_seconds

    assert load_yaml("a: 12:00:00\nb: -1:30\nc: 190:20:30.15\nd: 1_000\ne: 0x1f\nf: 1.5e+3\n") == {
        "a": "12:00:00", "b": "-1:30", "c": "190:20:30.15", "d": 1000, "e": 31, "f": 1500.0}
    assert yaml.safe_load("a: 12:00:00") == {"a": 43200}  # only the config loader reads it as text
    cfg = _config(tmp_path)
    text = cfg.read_text() + ("partitions:\n  - {name: data, role: data}\n  - {name: trainer, role: trainer}\n"
                              "  - name: h100\n    scheduler: slurm\n    walltime: 12:00:00\n")
    cfg.write_text(text)
    part = load_config(cfg).partitions[2]
    assert part.walltime == "12:00:00" and walltime_seconds(part.walltime) == 12 * 3600
    res = _invoke("check", str(cfg), "--set", "partitions.h100.walltime=1:30:00")
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(res.stdout)["partitions"][2]["walltime"] == "1:30:00"


def test_a_slurm_partition_the_cluster_does_not_have_is_refused_before_the_run_starts(tmp_path, monkeypatch):
    """``sbatch -p nosuch`` would refuse it only once the run had started its scheduler, data
    layer and trainer; ``sinfo`` (a stand-in on PATH, the process boundary) names those there are.
    Where ``sinfo`` does not answer nothing is checked: the submission says it."""
    parts = [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"},
             {"name": "h100", "role": "rollout", "scheduler": "slurm", "slurm_partition": "gpu-h100"}]
    cfg = _config(tmp_path, partitions=parts)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    sinfo.write_text("#!/bin/sh\nprintf 'h100\\na100\\ncpu\\n'\n")
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for command in ("check", "run"):
        res = _invoke(command, str(cfg), *(["--run-dir", str(tmp_path / "run")] if command == "run" else []))
        assert res.exit_code == 2, res.output
        assert ("partitions[h100].slurm_partition: 'gpu-h100' is not a partition of this Slurm cluster "
                "(sinfo lists a100, cpu, h100): set it to one of them") in res.output, res.output
    assert not (tmp_path / "run").exists()
    assert _invoke("check", str(cfg), "--set", "partitions.h100.slurm_partition=a100").exit_code == 0
    sinfo.write_text("#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller' >&2\nexit 1\n")
    assert _invoke("check", str(cfg)).exit_code == 0


# -- values YAML reads as another type ---------------------------------------------------------------

@pytest.mark.parametrize("value, needle", [
    ("no", "run.name: Input should be a valid string, got the boolean false"),
    ("2024", "run.name: Input should be a valid string, got the number 2024"),
])
def test_string_field_given_a_yaml_scalar_suggests_quotes(tmp_path, value, needle):
    res = _invoke("check", str(_config(tmp_path)), "--set", f"run.name={value}")
    assert res.exit_code == 2 and needle in res.output, res.output
    assert "--set run.name='\"" in res.output and 'name: "' in res.output


@pytest.mark.parametrize("key", ["run.max_steps", "policies.solver.init.warm_start_steps",
                                 "partitions.rollout.nthreads"])  # the last: Optional[Annotated[int, ...]]
def test_boolean_for_an_integer_is_refused(tmp_path, key):
    res = _invoke("check", str(_config(tmp_path)), "--set", f"{key}=true")
    assert res.exit_code == 2, res.output
    assert "Input should be an integer, got the boolean true" in res.output


@pytest.mark.parametrize("setting, needle", [
    ("workload.params.num_test=yes", "params.num_test: Input should be an integer, got the boolean true"),
    ("dataflow.curator={type: filter_solved, params: {threshold: true}}",
     "dataflow.curator.params.threshold: Input should be a number, got the boolean true"),
    ("partitions.rollout.rollout={capacity: true}",
     "partitions[rollout].rollout.capacity: Input should be an integer, got the boolean true"),
    ("policies.solver.trainer.sim_step_schedule={3: true}",
     "policies[solver].trainer.sim_step_schedule.3: Input should be a number, got the boolean true"),
    ("partitions.rollout.resources={GPU: true}",
     "partitions[rollout].resources.GPU: Input should be a number, got the boolean true"),
])
def test_boolean_for_a_number_is_refused_in_params_rules_and_partition_settings(tmp_path, setting, needle):
    res = _invoke("check", str(_config(tmp_path)), "--set", setting)
    assert res.exit_code == 2 and needle in res.output, res.output


def test_boolean_in_a_list_or_mapping_of_numbers_is_refused():
    from pydantic import BaseModel

    from astraflow.configerrors import bool_problems

    class Params(BaseModel):
        weights: list[int | float] = []
        by_step: dict[int, float] | None = None
        names: list[str] = []

    data = {"weights": [1, True, 0.5], "by_step": {2: 1.0, 5: False}, "names": ["a"]}
    assert [line.split(" (")[0] for line in bool_problems(data, Params, "params")] == [
        "params.weights.1: Input should be a number, got the boolean true",
        "params.by_step.5: Input should be a number, got the boolean false"]
    assert bool_problems({"weights": [1, 2.5], "by_step": {1: 0.0}}, Params) == []


def test_other_coercions_stay(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "run.max_steps='7'", "--set", "dataflow.lease_seconds=5")
    assert res.exit_code == 0, res.output
    resolved = yaml.safe_load(res.stdout)
    assert resolved["run"]["max_steps"] == 7 and resolved["dataflow"]["lease_seconds"] == 5.0


def test_wrong_value_is_shown(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "run.max_steps=many")
    assert res.exit_code == 2 and "run.max_steps: Input should be a valid integer" in res.output
    assert "got 'many'" in res.output


# -- partitions commands -------------------------------------------------------------------------

def test_partition_unknown_key_reads_as_in_a_config_file(tmp_path):
    (tmp_path / "p.yaml").write_text("name: x\nnodez: 3\n")
    res = _invoke("partitions", "add", str(tmp_path), "--from-yaml", str(tmp_path / "p.yaml"))
    assert res.exit_code == 2, res.output
    assert "nodez: unknown key; did you mean nodes?" in res.output and "Extra inputs" not in res.output


def test_partition_yaml_that_does_not_parse_is_named_where_in_one_line(tmp_path):
    (tmp_path / "p.yaml").write_text("name: x\nnodes: [2\n")
    res = _invoke("partitions", "add", str(tmp_path), "--from-yaml", str(tmp_path / "p.yaml"))
    assert res.exit_code == 2, res.output
    assert "p.yaml: not valid YAML at line 3, column 1: " in res.output and "<unicode string>" not in res.output


def test_partition_options_are_named_as_the_options_given(tmp_path):
    """A bad value from an option is named as that option; one from --from-yaml as its field."""
    (tmp_path / "p.yaml").write_text("name: x\nnodes: -2\n")
    res = _invoke("partitions", "add", str(tmp_path), "--from-yaml", str(tmp_path / "p.yaml"), "--cpus-per-node", "0")
    assert res.exit_code == 2, res.output
    assert "--cpus-per-node 0: use 1 or more" in res.output and "cpus_per_node" not in res.output, res.output
    assert "nodes: nodes is -2: use 0 or more" in res.output and "--nodes" not in res.output


def test_partition_boolean_nodes_is_refused(tmp_path):
    (tmp_path / "p.yaml").write_text("name: x\nnodes: true\n")
    res = _invoke("partitions", "add", str(tmp_path), "--from-yaml", str(tmp_path / "p.yaml"))
    assert res.exit_code == 2 and "nodes: Input should be an integer, got the boolean true" in res.output


def test_remove_drain_and_now_conflict(tmp_path, monkeypatch):
    import astraflow.runtime.control as control

    asked = []
    monkeypatch.setattr(control, "remove_partition", lambda run_dir, name, mode: asked.append(mode))
    res = _invoke("partitions", "remove", str(tmp_path), "extra", "--drain", "--now")
    assert res.exit_code == 2 and "--drain and --now conflict: give one of them" in res.output, res.output
    assert asked == []
    for flags, mode in [((), "drain"), (("--now",), "now"), (("--drain",), "drain")]:
        res = _invoke("partitions", "remove", str(tmp_path), "extra", *flags)
        assert res.exit_code == 0 and f"removal requested ({mode})" in res.output, res.output
    assert asked == ["drain", "now", "drain"]


# -- plot --out ------------------------------------------------------------------------------------

@pytest.fixture
def run_with_metrics(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "policy": "solver", "time": float(s), "loss": 0.1, "reward_mean": 0.5} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_plot_out_that_cannot_be_created(run_with_metrics, tmp_path, where):
    pytest.importorskip("matplotlib")
    if where == "in /proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    (tmp_path / "afile").write_text("")
    out = str(tmp_path / "afile" / "x") if where == "under a file" else "/proc/astraflow-nope/plots"
    res = _invoke("plot", str(run_with_metrics), "--out", out)
    assert res.exit_code == 2 and f"--out {out}: the plots directory cannot be created" in res.output, res.output


# -- help ---------------------------------------------------------------------------------------------

def test_help_describes_every_option():
    res = _invoke("check", "--help")
    assert res.exit_code == 0 and "Override a config value" in res.output
    res = _invoke("model", "init", "--help")
    assert res.exit_code == 0 and "None" not in res.output and "Unset: no bound in steps" in res.output
    bare = []  # every command of the tree has a text, and every option one beyond its "[default: ...]"

    def walk(cmd: click.Command, path: str) -> None:
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")
        if not (cmd.help or "").strip():
            bare.append(path)
        for p in cmd.params:
            text = (getattr(p, "help", None) or "").strip()
            if isinstance(p, click.Option) and (not text or text.startswith("[")):
                bare.append(f"{path} {p.opts[0]}")

    from schedulers.__main__ import main as schedulers_main

    walk(main, "astraflow")
    walk(schedulers_main, "python -m schedulers")
    assert not bare, bare
    res = _invoke("partitions", "add", "--help")
    assert "routing" not in res.output, res.output  # a region is a label: nothing routes by it
    assert "preset's timing" in " ".join(res.output.split())  # --hardware picks a sim pool's preset


# -- status of a finished run ----------------------------------------------------------------------

SUMMARY = {"status": "failed", "reason": "trainer solver failed", "requeue": False, "steps": {"solver": 3},
           "eval": [{"step": 3, "policy": "solver", "eval_accuracy": 0.5}], "seconds": 12.0,
           "ledger": {"tasks": 40, "states": {"consumed": 32, "dropped": 8}}, "ledger_closed": True,
           "trainer_restarts": {"solver": {"count": 1, "limit": 2, "restarts": []}},
           "data_layer_restarts": {"count": 0, "limit": 2, "restarts": []}}


@pytest.mark.parametrize("files", ["summary only", "with the last status"])
def test_status_of_a_finished_run_prints_its_final_state(tmp_path, files):
    (tmp_path / "summary.json").write_text(json.dumps(SUMMARY))
    if files == "with the last status":
        (tmp_path / "control").mkdir()
        (tmp_path / "control" / "orchestrator.json").write_text(json.dumps(
            {"pid": 2 ** 22 + 1, "host": "another-host", "started": time.time() - 60}))
        (tmp_path / "control" / "status.json").write_text(json.dumps({"written_at": time.time() - 5}))
    res = _invoke("status", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "run finished: failed (trainer solver failed) after 12s" in res.output
    assert "steps: solver 3" in res.output and "ledger: 40 tasks: consumed 32, dropped 8" in res.output
    assert "held-out accuracy: v3=0.500" in res.output
    assert "restarts: trainer solver 1" in res.output and "data layer" not in res.output


def test_status_of_a_run_that_stopped_without_a_summary(tmp_path):
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "orchestrator.json").write_text(json.dumps(
        {"pid": 1, "host": "another-host", "started": time.time() - 600}))
    (tmp_path / "control" / "status.json").write_text(json.dumps(
        {"written_at": time.time() - 300, "data_layer": {"elapsed_s": 90},
         "trainers": {"solver": {"version": 41, "last_metrics": {"reward_mean": 0.25}}}}))
    res = _invoke("status", str(tmp_path))
    assert res.exit_code == 2 and "stopped without a summary" in res.output, res.output
    # what it had done when it stopped, said to be its last status, and how to go on
    assert "solver       version   41  reward 0.250" in res.output, res.output
    assert "above is its last status, of 300s ago; `astraflow run` on the run directory resumes it" in res.output


def test_status_of_a_run_that_stopped_without_a_summary_or_a_time_in_its_status(tmp_path):
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "orchestrator.json").write_text(json.dumps(
        {"pid": 1, "host": "another-host", "started": time.time() - 600}))
    (tmp_path / "control" / "status.json").write_text(json.dumps({"written_at": None, "data_layer": {}}))
    res = _invoke("status", str(tmp_path))
    assert res.exit_code == 2 and "above is its last status, undated (it has no written_at)" in res.output, res.output


def _killed_run(run_dir, version: int, written_ago: float) -> None:
    """A run directory whose orchestrator is gone (its pid free), with its last status: solver at
    ``version``, written ``written_ago`` seconds ago."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    (run_dir / "control").mkdir()
    (run_dir / "control" / "orchestrator.json").write_text(json.dumps(
        {"pid": gone.pid, "host": socket.gethostname(), "started": time.time() - 60}))
    (run_dir / "control" / "status.json").write_text(json.dumps(
        {"written_at": time.time() - written_ago, "data_layer": {"elapsed_s": 50},
         "trainers": {"solver": {"version": version, "last_metrics": {"reward_mean": 0.5}}}}))


def test_status_right_after_the_run_was_killed_shows_its_last_status(tmp_path):
    """Its orchestrator is gone: the snapshot need not age before it is said to be the last."""
    _killed_run(tmp_path, 7, 2)
    res = _invoke("status", str(tmp_path))
    assert res.exit_code == 2 and "stopped without a summary" in res.output, res.output
    assert "solver       version    7  reward 0.500" in res.output, res.output
    assert re.search(r"above is its last status, of [2-9]s ago; `astraflow run` on the run directory resumes it",
                     res.output), res.output


def test_status_of_a_killed_run_offers_no_dashboard_nor_its_jobs_last_states(tmp_path):
    """The dashboard is served by the run's scheduler, which died with its orchestrator: neither
    the text nor `--json` sends the operator to its address."""
    _killed_run(tmp_path, 7, 2)
    info = json.loads((tmp_path / "control" / "orchestrator.json").read_text())
    info["dashboard"] = "http://127.0.0.1:39293/status"
    (tmp_path / "control" / "orchestrator.json").write_text(json.dumps(info))
    status = json.loads((tmp_path / "control" / "status.json").read_text())
    status["workers"] = {"rollout-r-local-cpu-0": {"job_id": "local-7", "partition": "r", "state": "RUNNING",
                                                   "phase": "serving", "host": "localhost"}}
    status["partitions"] = {"r": {"scheduler": "local", "role": "rollout", "nodes": 1, "jobs": {"local-7": "RUNNING"}}}
    (tmp_path / "control" / "status.json").write_text(json.dumps(status))
    res = _invoke("status", str(tmp_path))
    assert res.exit_code == 2 and "not running: its dashboard is gone" in res.output, res.output
    assert "39293" not in res.output, res.output
    # its jobs' states are as old as its last status: not said to be running (as --json says)
    assert "RUNNING" not in res.output and "local-7:UNKNOWN" in res.output, res.output
    res = _invoke("status", str(tmp_path), "--json")
    assert res.exit_code == 0, res.output
    view = json.loads(res.output)
    assert view["running"] is False and view["dashboard"] is None, view


def _wait_for_state(pid: int, stopped: bool) -> None:
    """Until the kernel has stopped (or let go on) ``pid``: a signal is delivered after kill returns."""
    for _ in range(200):
        if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T") == stopped:
            return
        time.sleep(0.01)


def test_status_of_a_run_whose_live_head_writes_no_status_does_not_say_to_resume_it(tmp_path):
    """Its `astraflow run` was suspended (Ctrl-Z) or hangs while its workers go on training: it
    still holds the run directory, so a resume would be refused. Status says so and what to do;
    once that process is gone, the resume is the way on."""
    import signal
    import subprocess
    import sys

    ready = tmp_path / "locked"
    code = ("import sys, time; from pathlib import Path; from astraflow.runtime.runlock import RunDirLock; "
            "lock = RunDirLock(sys.argv[1]).acquire(); Path(sys.argv[2]).touch(); time.sleep(120)")
    head = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run"), str(ready)])
    try:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.05)
        control = tmp_path / "run" / "control"
        (control / "orchestrator.json").write_text(json.dumps(
            {"pid": head.pid, "host": socket.gethostname(), "started": time.time() - 600}))
        (control / "status.json").write_text(json.dumps(
            {"written_at": time.time() - 45, "data_layer": {"elapsed_s": 90},
             "trainers": {"solver": {"version": 41, "last_metrics": {"reward_mean": 0.25}}}}))
        head.send_signal(signal.SIGSTOP)
        _wait_for_state(head.pid, stopped=True)
        res = _invoke("status", str(tmp_path / "run"))
        assert res.exit_code == 2 and "solver       version   41" in res.output, res.output
        assert f"(pid {head.pid}) is suspended" in res.output and f"kill -CONT {head.pid}" in res.output, res.output
        assert "stopped without a summary" not in res.output, res.output
        head.send_signal(signal.SIGCONT)
        _wait_for_state(head.pid, stopped=False)
        res = _invoke("status", str(tmp_path / "run"))
        assert res.exit_code == 2 and "still holds the run directory but is busy or hung" in res.output, res.output
    finally:
        head.kill()
        head.wait()
    res = _invoke("status", str(tmp_path / "run"))
    assert res.exit_code == 2 and "stopped without a summary" in res.output, res.output
    assert "`astraflow run` on the run directory resumes it" in res.output, res.output


def test_status_of_a_killed_run_says_where_a_resume_goes_on(tmp_path):
    """A killed run's last status is some steps behind what it committed: the line says the
    version the resume goes on from, from the weight store."""
    _killed_run(tmp_path, 24, 3)
    for v in (29, 30):
        (tmp_path / "weights" / "solver" / f"v{v:08d}").mkdir(parents=True)
        (tmp_path / "weights" / "solver" / f"v{v:08d}" / "COMMITTED").write_text("{}")
    (tmp_path / "weights" / "solver" / "v00000031").mkdir()  # never committed: not where it goes on
    res = _invoke("status", str(tmp_path))
    assert res.exit_code == 2 and "solver       version   24" in res.output, res.output
    assert "`astraflow run` on the run directory resumes it from solver v30 (the newest committed weights)" \
        in res.output, res.output


def test_a_stop_before_the_run_starts_exits_130_without_a_traceback(monkeypatch, tmp_path):
    """Ctrl-C or SIGTERM (scancel) while the data is checked or the models are built, before
    the run started: the documented 130 and one line, not click's "Aborted!" and 1."""
    from click.testing import CliRunner

    import astraflow.runtime.launch as launch_module
    import astraflow.runtime.stopping as stopping
    from astraflow.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    ignored = []
    monkeypatch.setattr(launch_module, "launch", interrupted)
    monkeypatch.setattr(stopping, "ignore_stop_signals", lambda: ignored.append(1))  # not in pytest's process
    res = CliRunner().invoke(main, ["run", "examples/tiny/config.yaml", "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 130 and ignored, res.output
    assert "stopped before the run started" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("ends, code", [("completed", 0), ("failed", 1)])
def test_a_finished_run_ignores_stop_signals_while_it_exits(monkeypatch, tmp_path, ends, code):
    """A completed or failed run's exit code (0, 1) survives a SIGTERM that arrives while the
    process exits (Python restores the default action late in its exit), as 130's does."""
    from click.testing import CliRunner

    import astraflow.runtime.launch as launch_module
    import astraflow.runtime.stopping as stopping
    from astraflow.cli import main
    from astraflow.runtime.shutdown import RunResult
    from astraflow.runtime.workers import RunFailed

    def launch(cfg, run_dir, quiet=False):
        if ends == "failed":
            raise RunFailed("a trainer error")
        return RunResult(run_dir, {"solver": 4}, [], {}, 1.0)

    ignored = []
    monkeypatch.setattr(launch_module, "launch", launch)
    monkeypatch.setattr(stopping, "ignore_stop_signals", lambda: ignored.append(1))  # not in pytest's process
    res = CliRunner().invoke(main, ["run", "examples/tiny/config.yaml", "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == code and ignored, res.output


def test_tilde_in_paths_is_the_home_directory(tmp_path, monkeypatch):
    """``--run-dir=~/x`` and quoted paths reach the program with ``~`` unexpanded: it is the
    home directory, not a directory named ``~``."""
    from astraflow.clibase import UserPath

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert UserPath(file_okay=False).convert("~/runs/a", None, None) == str(tmp_path / "runs" / "a")
    res = _invoke("status", "~/nowhere")
    assert str(tmp_path / "nowhere") in res.output and not (tmp_path / "~").exists()


@pytest.mark.parametrize("args, name", [(["run", "CFG", "--run-dir", ""], "'--run-dir'"),
                                        (["status", ""], "'RUN_DIR'"), (["model", "init", ""], "'OUT'"),
                                        (["check", " "], "'CONFIG'")])
def test_an_empty_path_is_refused_not_taken_as_the_working_or_a_default_directory(tmp_path, monkeypatch, args, name):
    """An unset variable (``--run-dir "$RUN_DIR"``) must not start a new run in a default directory
    instead of resuming, nor act on the working directory."""
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path)
    res = _invoke(*[str(cfg) if a == "CFG" else a for a in args])
    assert res.exit_code == 2 and f"Invalid value for {name}: the path is empty" in res.output, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"]


@pytest.mark.parametrize("command", [["check"], ["plan", "--pool", "h100=8"]])
def test_a_removed_working_directory_is_said_not_blamed_on_a_field(tmp_path, monkeypatch, command):
    """Relative paths are read against it: its removal is the error, not storage.trajectories nor a traceback."""
    cfg, gone = _config(tmp_path), tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    res = _invoke(command[0], str(cfg), *command[1:])
    assert res.exit_code == 2 and "the working directory was removed" in res.output, res.output
    assert "storage.trajectories" not in res.output


def test_default_run_directories_started_in_the_same_second_are_distinct(tmp_path, monkeypatch):
    from astraflow import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-120000")
    first, second = cli._default_run_dir("sim"), cli._default_run_dir("sim")
    assert first == Path("runs/sim-20260101-120000") and second == Path("runs/sim-20260101-120000-2")
    assert first.is_dir() and second.is_dir()  # claimed at once: a third run cannot take either


def test_a_run_refused_before_it_starts_leaves_no_default_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path, workload={"name": "dataset", "params": {"path": str(tmp_path / "nope.jsonl")}})
    res = _invoke("run", str(cfg))
    assert res.exit_code == 2 and "nope.jsonl" in res.output, res.output  # found only when the run starts
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("key", ["scheduler_interface", "worker_interface", "scheduler_host"])
@pytest.mark.parametrize("value", ["", "  ", "ib 0"])
def test_empty_or_spaced_addresses_and_interfaces_are_refused(tmp_path, key, value):
    cfg = _config(tmp_path, cluster={key: value})
    res = _invoke("check", str(cfg))
    assert res.exit_code == 2 and f"cluster.{key}" in res.output and "not an address or interface" in res.output


def test_a_run_dir_holding_files_but_no_run_is_refused_and_left_as_it_was(tmp_path):
    """A project folder given as --run-dir, holding a config.yaml a run would write over, is not
    filled with a run; a new, an empty, a run's own directory and one with other files are taken."""
    proj = tmp_path / "proj"
    proj.mkdir()
    cfg = _config(proj)
    cfg = cfg.rename(proj / "config.yaml")
    before = cfg.read_bytes()
    res = _invoke("run", str(cfg), "--run-dir", str(proj))
    assert res.exit_code == 2 and f"--run-dir {proj} is no run's directory (no control/) but holds config.yaml, " \
        "which a run would write over" in res.output, res.output
    assert cfg.read_bytes() == before and sorted(p.name for p in proj.iterdir()) == ["config.yaml"]
    from astraflow.cli import _not_someone_elses_files

    (tmp_path / "empty").mkdir()
    (tmp_path / "a_run" / "control").mkdir(parents=True)
    (tmp_path / "a_run" / "metrics.jsonl").write_text("")
    (tmp_path / "other" / "lost+found").mkdir(parents=True)
    (tmp_path / "other" / ".gitkeep").write_text("")
    (tmp_path / "other" / "head.1234.log").write_text("")
    for taken in ("new", "empty", "a_run", "other"):
        _not_someone_elses_files(tmp_path / taken)


@pytest.mark.parametrize("setting,said", [
    ("cluster.scheduler_interface=nope0", "cluster.scheduler_interface: 'nope0' is no network interface"),
    ("cluster.scheduler_host=no.such.host.invalid", "cluster.scheduler_host: 'no.such.host.invalid' does not resolve"),
    ("cluster.worker_interface=nope0", "cluster.worker_interface: 'nope0' is no network interface of this machine"),
])
def test_addresses_the_run_cannot_bind_here_are_refused_before_it_starts(tmp_path, setting, said):
    res = CliRunner().invoke(main, ["run", str(ROOT / "examples" / "tiny" / "config.yaml"), "--run-dir",
                                    str(tmp_path / "run"), "--quiet", "--set", setting])
    assert res.exit_code == 2 and said in res.output, res.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["my runs", "-run", "it's"])
def test_a_command_printed_to_paste_names_its_run_directory_whatever_its_name(tmp_path, monkeypatch, name):
    """The commands a run prints (``astraflow export DIR OUT``, ``astraflow episodes DIR``),
    pasted into a shell, reach the same directory: quoted where it has a space or a quote, after
    ``./`` where it starts with a dash (else the command takes it for an option)."""
    import shlex

    from astraflow.clibase import shell_arg

    monkeypatch.chdir(tmp_path)
    (tmp_path / name).mkdir()
    argv = shlex.split(f"astraflow status {shell_arg(name)}")
    assert len(argv) == 3 and Path(argv[2]).resolve() == (tmp_path / name).resolve(), argv
    res = _invoke(*argv[1:])
    assert res.exit_code == 2 and "no run has started in" in res.output, res.output
