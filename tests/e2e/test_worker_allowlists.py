"""Partition env variables and extra sbatch options outside the run's allowlists are refused by
`astraflow check` (the config) and `astraflow partitions add` (the run's saved config), exit 2
naming the variable or option and the fix; an entry the owner lists is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.control import read_desired_file
from schedulers.policy import DEFAULT_SBATCH_OPTIONS_ALLOWLIST, DEFAULT_WORKER_ENV_ALLOWLIST
from tests.e2e.test_partitions_cli import live_run

__all__ = ["live_run"]  # the fixture: a run directory whose control files say "running"
ROOT = Path(__file__).resolve().parents[2]


def _invoke(*args):
    res = CliRunner().invoke(main, list(args))
    assert "Traceback" not in res.output
    return res.exit_code, res.output


def _config(tmp_path, env=None, sbatch=(), cluster=None) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["partitions"] = [
        {"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"},
        {"name": "gpu", "role": "rollout", "scheduler": "slurm", "env": env or {}, "sbatch_options": list(sbatch)},
    ]
    data.setdefault("cluster", {}).update(cluster or {})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("env, sbatch, needle", [
    ({"LD_PRELOAD": "/tmp/evil.so"}, (), "partitions[gpu].env: LD_PRELOAD is not in cluster.worker_env_allowlist"),
    ({"PYTHONPATH": "/tmp/evil"}, (), "partitions[gpu].env: PYTHONPATH is not in cluster.worker_env_allowlist"),
    ({}, ("--export=ALL,LD_PRELOAD=x",),
     "partitions[gpu].sbatch_options: --export is not in cluster.sbatch_options_allowlist"),
    ({}, ("--chdir=/tmp",), "partitions[gpu].sbatch_options: --chdir is not in cluster.sbatch_options_allowlist"),
])
def test_check_refuses_what_the_allowlists_do_not_name(tmp_path, env, sbatch, needle):
    code, out = _invoke("check", str(_config(tmp_path, env, sbatch)))
    assert code == 2, out
    assert needle in out and "in the run's config" in out


def test_check_accepts_an_explicitly_allowlisted_variable_and_option(tmp_path):
    cluster = {"worker_env_allowlist": [*DEFAULT_WORKER_ENV_ALLOWLIST, "LD_LIBRARY_PATH"],
               "sbatch_options_allowlist": [*DEFAULT_SBATCH_OPTIONS_ALLOWLIST, "--chdir"]}
    cfg = _config(tmp_path, {"LD_LIBRARY_PATH": "/opt/site/lib", "OMP_NUM_THREADS": "2"}, ("--chdir=/scratch",),
                  cluster)
    code, out = _invoke("check", str(cfg))
    assert code == 0, out


def test_check_refuses_a_never_allowed_sbatch_option_in_the_allowlist(tmp_path):
    code, out = _invoke("check", str(_config(tmp_path, cluster={"sbatch_options_allowlist": ["--array"]})))
    assert code == 2 and "cluster.sbatch_options_allowlist: --array cannot be allowed" in out, out


@pytest.mark.parametrize("yaml_text, args, needle", [
    ("env: {LD_PRELOAD: /tmp/evil.so}\n", [], "LD_PRELOAD is not in cluster.worker_env_allowlist"),
    ("env: {PYTHONPATH: /tmp/evil}\n", [], "PYTHONPATH is not in cluster.worker_env_allowlist"),
    ("", ["--sbatch-option=--export=ALL,LD_PRELOAD=x"], "--export is not in cluster.sbatch_options_allowlist"),
    ("", ["--sbatch-option=--chdir=/tmp"], "--chdir is not in cluster.sbatch_options_allowlist"),
    ("", ["--sbatch-option=--comment=x --export=ALL"], "without blanks, quotes"),
])
def test_partitions_add_refuses_what_the_allowlists_do_not_name(live_run, tmp_path, yaml_text, args, needle):
    (tmp_path / "p.yaml").write_text(yaml_text or "{}\n")
    before = live_run.desired_partitions.read_text()
    code, out = _invoke("partitions", "add", str(live_run.root), "new", "--from-yaml", str(tmp_path / "p.yaml"),
                        "--wait", "0", *args)
    assert code == 2, out
    assert needle in out
    assert live_run.desired_partitions.read_text() == before


def test_partitions_add_uses_the_runs_saved_allowlists(live_run, tmp_path):
    (tmp_path / "p.yaml").write_text("env: {LD_LIBRARY_PATH: /opt/site/lib}\nsbatch_options: ['--chdir=/scratch']\n")
    add = ["partitions", "add", str(live_run.root), "site", "--from-yaml", str(tmp_path / "p.yaml"), "--wait", "0"]
    code, out = _invoke(*add)
    assert code == 2 and "LD_LIBRARY_PATH" in out and "--chdir" in out, out
    live_run.config.write_text(yaml.safe_dump({"cluster": {
        "worker_env_allowlist": ["LD_LIBRARY_PATH"], "sbatch_options_allowlist": ["--chdir"]}}))
    code, out = _invoke(*add)
    assert code == 0, out
    assert read_desired_file(live_run)[0]["site"].env == {"LD_LIBRARY_PATH": "/opt/site/lib"}
    live_run.config.write_text(yaml.safe_dump({"cluster": {"sbatch_options_allowlist": ["--wrap"]}}))
    code, out = _invoke("partitions", "add", str(live_run.root), "other", "--wait", "0")
    assert code == 2 and "--wrap cannot be allowed" in out and "restore the run's config" in out, out
