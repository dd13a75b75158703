"""Rendered worker job scripts, pinned by golden files (no Slurm needed).

Regenerate after an intended template change with
``ASTRAFLOW_UPDATE_GOLDEN=1 pytest tests/schedulers/test_slurm_render.py`` and review the diff.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from schedulers import Partition, TLSFiles
from schedulers.command import QUIET_DASK_ENV, worker_env
from schedulers.slurm import SlurmScheduler, run_tag
from schedulers.slurm_cli import normalise_state

GOLDEN = Path(__file__).with_name("golden")
UPDATE = os.environ.get("ASTRAFLOW_UPDATE_GOLDEN") == "1"

SITE = dict(
    job_dir="/shared/runs/demo/jobs",
    python="/opt/astraflow/venv/bin/python",
    setup_lines=("module load cuda/12.4", "source /opt/astraflow/venv/bin/activate"),
    interface="ib0",
    tag="demo-run",
)

CASES = {
    "rollout_h100": (
        Partition(name="h100", scheduler="slurm", slurm_partition="gpu-h100", nodes=4, cpus_per_node=16,
                  gpus_per_node=4, gres="gpu:h100:4", mem="64G", walltime="04:00:00", region="eu",
                  hardware="H100", role="rollout", sbatch_options=("--account=proj42", "--qos=high"),
                  env={"HF_HOME": "/shared/hf cache", "VLLM_USE_V1": "1"}),
        "/shared/runs/demo/scheduler.json", 3, SITE,
    ),
    "trainer_a100": (
        Partition(name="a100", scheduler="slurm", nodes=1, cpus_per_node=32, gpus_per_node=8,
                  walltime="1-00:00:00", region="us", hardware="A100", role="trainer",
                  resources={"trainer": 1, "policy_main": 1}),
        "tcp://10.1.2.3:8786", 0, SITE,
    ),
    # a multi-node Megatron trainer: 2 nodes x 4 GPUs, one job, the worker on the first node
    "trainer_2x4": (
        Partition(name="h100x2", scheduler="slurm", slurm_partition="gpu-h100", nodes=1, nodes_per_worker=2,
                  cpus_per_node=32, gpus_per_node=4, gres="gpu:h100:4", mem="256G", walltime="12:00:00",
                  region="eu", hardware="H100", role="trainer"),
        "/shared/runs/demo/scheduler.json", 0, SITE,
    ),
    "spaces_in_paths": (
        Partition(name="cpu", scheduler="slurm", nodes=1, role="rollout", sbatch_options=("--constraint=a100&ib",),
                  env={"NCCL_DEBUG": "it's \"INFO\" $HOME `x`"}),
        "/shared/runs/my run (50%)/scheduler.json", 1,
        dict(job_dir="/shared/runs/my run (50%)/jobs", python="/opt/my venv/bin/python",
             setup_lines=('source "/opt/my venv/bin/activate"',), interface="ib0", tag="astraflow.my_run.0123abcd",
             tls=TLSFiles(Path("/shared/runs/my run (50%)/security/ca.pem"),
                          Path("/shared/runs/my run (50%)/security/run.pem"),
                          Path("/shared/runs/my run (50%)/security/run-key.pem"))),
    ),
    "data_cpu": (
        Partition(name="cpu", scheduler="slurm", slurm_partition="cpu", nodes=1, role="data", region="eu"),
        "tcp://127.0.0.1:8786", 0, dict(job_dir="/tmp/run/jobs", python="/usr/bin/python3", host="127.0.0.1"),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_script_matches_golden(case, tmp_path, monkeypatch):
    for key in QUIET_DASK_ENV:  # the script exports them unless the submitting shell sets them
        monkeypatch.delenv(key, raising=False)
    partition, address, index, site = CASES[case]
    script, argv = SlurmScheduler(**site).render(partition, address, index)
    text = script + "# sbatch argv: " + shlex.join(argv) + "\n"
    golden = GOLDEN / f"{case}.sbatch"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}: run with ASTRAFLOW_UPDATE_GOLDEN=1 to create it"
    assert text == golden.read_text(), f"{case} changed: if intended, regenerate with ASTRAFLOW_UPDATE_GOLDEN=1"
    # and it is valid bash
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_script_with_spaces_in_paths_runs_the_worker_command_exactly(tmp_path, monkeypatch):
    """Run the rendered script with bash, its interpreter a stand-in that prints its argv: every
    path and value arrives as one argument, unchanged."""
    venv = tmp_path / "my venv" / "bin"
    venv.mkdir(parents=True)
    python = venv / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\nprintf "env=%s\\n" "$NCCL_DEBUG"\n')
    python.chmod(0o755)
    run = tmp_path / "my run $(touch pwned) 50%"
    part = Partition(name="cpu", scheduler="slurm", role="rollout", env={"NCCL_DEBUG": "a 'b' \"c\" $HOME `id`"})
    sched = SlurmScheduler(run / "jobs", python=str(python), host="127.0.0.1", tag="t")
    script, argv = sched.render(part, str(run / "scheduler.json"), 0)
    path = tmp_path / "job.sh"
    path.write_text(script)
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    lines = out.splitlines()
    assert lines[:5] == ["-m", "schedulers.dask_main", "worker", "--scheduler-file", str(run / "scheduler.json")]
    assert lines[-1] == "env=a 'b' \"c\" $HOME `id`"
    assert not (tmp_path / "pwned").exists()
    log = str(run / "jobs").replace("%", "%%") + "/rollout-cpu-local-cpu-0.%j.log"
    script_file = str(run / "jobs" / "rollout-cpu-local-cpu-0.sbatch")
    assert argv == ["sbatch", "--parsable", f"--output={log}", f"--error={log}", script_file]


def test_setup_lines_run_with_pythons_usual_path_rules_and_the_worker_with_the_safe_ones(tmp_path):
    """``astraflow`` sets PYTHONSAFEPATH for what it starts, and sbatch passes its environment on:
    a setup line's script still imports modules next to it, and the worker still runs without
    its working directory first on ``sys.path``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "helper.py").write_text("WORD = 'ready'\n")
    (site / "prepare.py").write_text("import helper\nprint('setup', helper.WORD)\n")
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\nprintf "worker PYTHONSAFEPATH=%s\\n" "$PYTHONSAFEPATH"\n')
    python.chmod(0o755)
    part = Partition(name="cpu", scheduler="slurm", role="rollout")
    sched = SlurmScheduler(tmp_path / "jobs", python=str(python), host="127.0.0.1", tag="t",
                           setup_lines=[f"{shlex.quote(sys.executable)} {shlex.quote(str(site / 'prepare.py'))}"])
    script, _ = sched.render(part, str(tmp_path / "scheduler.json"), 0)
    path = tmp_path / "job.sh"
    path.write_text(script)
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["setup ready", "worker PYTHONSAFEPATH=1"]


@pytest.mark.parametrize("bad", ["/tmp/a\nb", "/tmp/a\\b", "/tmp/a\rb"])
def test_job_dir_slurm_cannot_name_logs_in_is_refused(bad):
    with pytest.raises(ValueError, match="control character or a backslash"):
        SlurmScheduler(bad)


def test_render_refuses_local_partition():
    with pytest.raises(ValueError, match="scheduler: slurm"):
        SlurmScheduler("/tmp/j").render(Partition(name="x"), "tcp://127.0.0.1:1", 0)


@pytest.mark.parametrize(
    "raw, state",
    [("PENDING", "PENDING"), ("CONFIGURING", "PENDING"), ("RUNNING", "RUNNING"), ("COMPLETING", "RUNNING"),
     ("COMPLETED", "COMPLETED"), ("TIMEOUT", "FAILED"), ("NODE_FAIL", "FAILED"), ("OUT_OF_MEMORY", "FAILED"),
     ("CANCELLED by 0", "CANCELLED"), ("PREEMPTED", "CANCELLED"), ("SUSPENDED", "RUNNING"), ("", "UNKNOWN")],
)
def test_normalise_state(raw, state):
    assert normalise_state(raw) == state


def test_squeue_json_of_slurm_23_11_and_later_is_read(monkeypatch):
    """From Slurm 23.11 ``job_state`` is a list of flags and ``exit_code`` an object."""
    sched = SlurmScheduler("/tmp/j")
    name = "rollout-h100-eu-H100-0"
    base = {"comment": sched.tag, "name": name, "user_name": __import__("getpass").getuser()}
    records = [
        {**base, "job_id": 1, "job_state": ["RUNNING"], "nodes": "n1", "exit_code": {"status": ["SUCCESS"]}},
        {**base, "job_id": 2, "job_state": ["PENDING", "REQUEUED"]},
        {**base, "job_id": 3, "job_state": ["FAILED"], "state_reason": "NonZeroExitCode",
         "exit_code": {"status": ["EXIT"], "return_code": {"set": True, "infinite": False, "number": 3}}},
        {**base, "job_id": 4, "job_state": "RUNNING", "nodes": "n2", "exit_code": 0},  # 23.02 and earlier
    ]
    monkeypatch.setattr(sched, "_squeue", lambda: records)
    got = {s.job_id: s for s in sched.jobs()}
    assert [got[j].state for j in "1234"] == ["RUNNING", "PENDING", "FAILED", "RUNNING"]
    assert got["1"].active and got["2"].active and got["1"].node == "n1"
    assert got["3"].reason == "NonZeroExitCode; exit code 3"


def test_worker_env_quiets_dask_monitors_unless_set(monkeypatch):
    for key in QUIET_DASK_ENV:
        monkeypatch.delenv(key, raising=False)
    part = Partition(name="cpu", scheduler="local", role="data",
                     env={"DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "20ms"})
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "True")
    env = worker_env(part, "data-cpu-local-cpu-0")
    assert env["DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"] == "20ms"  # the partition's value wins
    assert "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED" not in env  # the shell's value is inherited
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL"] == "1s"
    assert env["ASTRAFLOW_ROLE"] == "data"


def test_the_dry_run_gives_workers_the_runs_certificates(tmp_path):
    """``python -m schedulers render`` with a run's scheduler file: the rendered worker joins
    with the certificates named in the run's ``security/tls.json``; without one, none."""
    import json

    from click.testing import CliRunner

    from schedulers.__main__ import main

    part = tmp_path / "part.yaml"
    part.write_text("name: cpu\nscheduler: slurm\nrole: rollout\n")
    run = tmp_path / "run"
    (run / "security").mkdir(parents=True)
    args = ["render", str(part), "--scheduler-address", str(run / "scheduler.json"), "--job-dir", str(run / "jobs")]
    assert "--tls-ca-file" not in CliRunner().invoke(main, args).output
    files = TLSFiles(run / "security" / "ca.pem", run / "security" / "run.pem", run / "security" / "run-key.pem")
    (run / "security" / "tls.json").write_text(json.dumps(files.to_json()))
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert f"--tls-ca-file {run}/security/ca.pem --tls-cert {run}/security/run.pem" in res.output
    # the jobs carry the run's own tag, as the run's would (the run finds its jobs by it)
    from astraflow.runtime.reconcile import run_tag
    from storage.paths import RunPaths

    assert f"--comment={run_tag(RunPaths(run))}\n" in res.output
    other = CliRunner().invoke(main, ["render", str(part), "--scheduler-address", "tcp://127.0.0.1:1",
                                      "--job-dir", str(run / "jobs")])
    assert "--comment=astraflow\n" in other.output


@pytest.mark.parametrize("text, needle", [("", "must hold one partition as a mapping"),
                                          ("- cpu\n", "not list"),
                                          ("name: [cpu\n", "is not valid YAML")])
def test_the_dry_run_names_a_partition_file_it_cannot_use(tmp_path, text, needle):
    from click.testing import CliRunner

    from schedulers.__main__ import main

    part = tmp_path / "part.yaml"
    part.write_text(text)
    res = CliRunner().invoke(main, ["render", str(part), "--scheduler-address", "tcp://127.0.0.1:1",
                                    "--job-dir", str(tmp_path / "jobs")])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output


def test_mem_0_asks_slurm_for_all_of_the_nodes_memory_and_the_worker_takes_what_it_has():
    script, _ = SlurmScheduler(**SITE).render(Partition(name="big", scheduler="slurm", mem="0"), "tcp://h:8786", 0)
    assert "#SBATCH --mem=0\n" in script and "--memory-limit auto" in script


def test_the_run_tag_of_a_directory_whose_name_is_not_utf8_text(tmp_path):
    """A name the locale cannot decode (a Latin-1 byte; any non-ASCII name with Python's UTF-8
    mode off under ``LC_ALL=C``) reaches Python with surrogates: its tag is made from its bytes,
    where a text encoding failed and the run never started. A UTF-8 name keeps its tag (a run
    started before finds its jobs)."""
    import hashlib

    raw = tmp_path / os.fsdecode(b"caf\xe9")
    raw.mkdir()
    assert run_tag(raw) == f"astraflow.caf_.{hashlib.sha1(os.fsencode(raw.resolve())).hexdigest()[:8]}"
    plain = tmp_path / "caf\u00e9"
    plain.mkdir()
    assert run_tag(plain) == f"astraflow.caf_.{hashlib.sha1(str(plain.resolve()).encode()).hexdigest()[:8]}"


def test_a_run_directory_reached_through_a_link_has_the_same_tag(tmp_path):
    """A run resumed through a symlink to its directory (``runs/latest``) is the same run: the
    same tag finds, and cancels, the worker jobs its previous incarnation left, which would
    otherwise join the new scheduler under the new incarnation's worker names."""
    run = tmp_path / "runs" / "sweep-lr1"
    run.mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to(run)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    assert run_tag(tmp_path / "runs" / "latest") == run_tag(run) == run_tag(tmp_path / "link" / "sweep-lr1")
    assert run_tag(run).startswith("astraflow.sweep-lr1.")


def test_job_names_tell_apart_the_same_worker_of_two_runs(tmp_path):
    """Two runs of one user (a sweep) have workers of the same names; ``squeue`` shows job names,
    not comments, so each job's name carries its run's tag: the sweep's runs are told apart, even
    two run directories of the same name."""
    from schedulers.sbatch_script import JOB_NAME_MAX, job_name, worker_of_job

    part = Partition(name="h100", scheduler="slurm", role="rollout", hardware="H100")
    names = []
    for run in (tmp_path / "sweep" / "lr1", tmp_path / "other" / "lr1", tmp_path / "sweep" / "lr2"):
        script, _ = SlurmScheduler(run / "jobs", host="127.0.0.1", tag=run_tag(run)).render(part, "tcp://x:1", 0)
        (line,) = [x for x in script.splitlines() if x.startswith("#SBATCH --job-name=")]
        names.append(line.removeprefix("#SBATCH --job-name="))
    assert len(set(names)) == 3, names
    assert all(n.startswith("rollout-h100-local-H100-0.astraflow.lr") for n in names), names
    # within Slurm's limits and safe characters, and read back as the worker's name
    longest = "rollout-" + "-".join(["p" * 40, "r" * 40, "h" * 40]) + "-123456"
    for worker, tag in [("rollout-h100-local-H100-0", "a:b c"), (longest, "astraflow." + "x" * 54)]:
        name = job_name(worker, tag)
        assert len(name) <= JOB_NAME_MAX and set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                               "0123456789_.-"), name
        assert worker_of_job(name, tag) == worker
    assert worker_of_job("rollout-h100-local-H100-0", "astraflow.a.0123abcd") == "rollout-h100-local-H100-0"
