"""The launcher scripts under jobs/ parse and refuse bad use with a message, and the head
script passes Slurm's walltime warning on and requeues its job only when the run stopped for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

JOBS = Path(__file__).parents[2] / "jobs"


def test_head_script_is_valid_bash_and_explains_misuse(tmp_path):
    head = JOBS / "astraflow-head.sbatch"
    subprocess.run(["bash", "-n", str(head)], check=True)
    text = head.read_text()
    assert "-m astraflow run \"$CONFIG\" --run-dir \"$RUN_DIR\" \"$@\"" in text
    no_args = subprocess.run(["bash", str(head)], capture_output=True, text=True, cwd=tmp_path)
    assert no_args.returncode != 0 and "usage: sbatch jobs/astraflow-head.sbatch" in no_args.stderr
    missing = subprocess.run(["bash", str(head), "nope.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2 and "config file 'nope.yaml' not found" in missing.stderr


def test_head_script_refuses_an_option_in_place_of_the_run_directory(tmp_path):
    """``CONFIG --set k=v`` would run in a directory named ``--set`` (``--run-dir --set``)."""
    (tmp_path / "c.yaml").write_text("run: {}\n")
    proc = subprocess.run(["bash", str(JOBS / "astraflow-head.sbatch"), "c.yaml", "--set", "run.max_steps=5"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "ASTRAFLOW_PYTHON": sys.executable})
    assert proc.returncode == 2 and "RUN_DIR '--set' is an option: give RUN_DIR" in proc.stderr, proc.stderr


def test_worker_template_link_points_at_the_rendered_template():
    link = JOBS / "worker.sbatch.j2"
    assert link.resolve() == (JOBS.parent / "schedulers" / "templates" / "worker.sbatch.j2").resolve()
    assert "#SBATCH --job-name={{ job_name }}" in link.read_text()


def test_head_script_refuses_an_interpreter_without_astraflow(tmp_path):
    (tmp_path / "c.yaml").write_text("run: {}\n")
    proc = subprocess.run(["bash", str(JOBS / "astraflow-head.sbatch"), "c.yaml"], capture_output=True, text=True,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "ASTRAFLOW_PYTHON": "/usr/bin/true-nope"})
    assert proc.returncode == 2 and "cannot import astraflow" in proc.stderr


# -- walltime warning and requeue: the script's decisions, with `astraflow run` and `scontrol`
# standing in as small scripts (the real path runs on the local Slurm: tests/slurm/test_requeue.py)

#: stands in for `$ASTRAFLOW_PYTHON`: `-c` runs the real interpreter (leaving `checked`); `-m astraflow run` says it
#: started, exits 75 on SIGUSR1 as astraflow does, and otherwise exits with $STUB_RC
STUB_PY = """#!/bin/bash
if [ "$1" = -c ]; then touch "$STUB_DIR/checked"; exec {python} "$@"; fi
trap 'kill $s 2>/dev/null; echo usr1 >> "$STUB_DIR/signals"; exit 75' USR1
echo "$@" > "$STUB_DIR/args.tmp" && mv "$STUB_DIR/args.tmp" "$STUB_DIR/args"  # after the trap: then it is ready
sleep "${{STUB_SLEEP:-0}}" & s=$!
wait $s
exit "${{STUB_RC:-0}}"
"""
STUB_SCONTROL = '#!/bin/sh\necho "$@" >> "$STUB_DIR/scontrol"\n'
#: `squeue -h -j ID -o %L`: the job's time left ($STUB_TIME_LEFT, a day by default)
STUB_SQUEUE = '#!/bin/sh\necho "${STUB_TIME_LEFT:-1-00:00:00}"\n'


def _head(tmp_path, *, restarts: int | None = None, **env: str) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("py", STUB_PY.format(python=sys.executable)), ("scontrol", STUB_SCONTROL),
                       ("squeue", STUB_SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "c.yaml").write_text("run: {}\n")
    full = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "PYTHONPATH": str(JOBS.parent), "STUB_DIR": str(tmp_path),
            "ASTRAFLOW_PYTHON": str(bin_dir / "py"), "SLURM_JOB_ID": "77", **env}
    if restarts is not None:
        full["SLURM_RESTART_COUNT"] = str(restarts)
    return subprocess.Popen(["bash", str(JOBS / "astraflow-head.sbatch"), "c.yaml", str(tmp_path / "run")],
                            cwd=tmp_path, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _catches_usr1(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGUSR1 (its ``SigCgt`` mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False


def _warned(tmp_path, proc: subprocess.Popen) -> tuple[int, str]:
    """Send the walltime warning to the script (as Slurm's ``B:USR1`` does) once astraflow runs
    (the stand-in sets its trap before it writes args) and the script has set its own trap."""
    deadline = time.monotonic() + 60
    while not ((tmp_path / "args").exists() and _catches_usr1(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, \
            "the head script did not run astraflow with its USR1 trap set (was SIGUSR1 ignored when it started?)"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


def test_head_script_asks_for_requeue_and_an_early_warning():
    text = (JOBS / "astraflow-head.sbatch").read_text()
    assert "#SBATCH --requeue\n" in text and "#SBATCH --signal=B:USR1@300\n" in text
    assert "#SBATCH --open-mode=append\n" in text  # both incarnations in one log
    assert "\nexec " not in text  # the shell must stay to pass the warning on and requeue


def test_the_warning_reaches_astraflow_and_the_job_requeues_itself(tmp_path):
    rc, out = _warned(tmp_path, _head(tmp_path, STUB_SLEEP="30"))
    assert (tmp_path / "signals").read_text() == "usr1\n"
    assert (tmp_path / "scontrol").read_text() == "requeue 77\n", out
    assert rc == 0 and "requeueing job 77 (requeue 1 of at most 10)" in out, out
    assert (tmp_path / "args").read_text().split()[:4] == ["-m", "astraflow", "run", "c.yaml"]


def test_requeues_stop_at_the_cap(tmp_path):
    rc, out = _warned(tmp_path, _head(tmp_path, restarts=2, STUB_SLEEP="30", ASTRAFLOW_MAX_REQUEUES="2"))
    assert rc == 75 and not (tmp_path / "scontrol").exists(), out
    assert "requeued 2 times already (ASTRAFLOW_MAX_REQUEUES=2)" in out, out


@pytest.mark.parametrize("stub_rc", ["0", "1", "130"])
def test_a_run_that_ended_otherwise_is_not_requeued(tmp_path, stub_rc):
    proc = _head(tmp_path, STUB_RC=stub_rc)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == int(stub_rc) and not (tmp_path / "scontrol").exists(), out


def test_a_requeued_job_whose_run_completed_does_not_run_again(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"status": "completed"}')
    proc = _head(tmp_path, restarts=1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "completed already" in out and not (tmp_path / "args").exists(), out
    (tmp_path / "run" / "summary.json").write_text('{"status": "interrupted", "requeue": true}')
    proc = _head(tmp_path, restarts=1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and (tmp_path / "args").exists() and "incarnation 2" in out, out


def test_a_bad_requeue_cap_is_refused_naming_the_fix(tmp_path):
    proc = _head(tmp_path, ASTRAFLOW_MAX_REQUEUES="many")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "ASTRAFLOW_MAX_REQUEUES='many': set it to a whole number" in out, out


def test_a_job_whose_time_limit_is_within_the_warning_ignores_it_instead_of_requeueing_forever(tmp_path):
    """Slurm sends the warning at once to a job that starts with less time left than the
    warning: stopping for a requeue then would requeue it again and again, never taking a step.
    The script says so, the warning does not reach astraflow, and the job is not requeued."""
    proc = _head(tmp_path, STUB_SLEEP="3", STUB_TIME_LEFT="1:58")
    deadline = time.monotonic() + 60
    while not (tmp_path / "args").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # the warning, at once
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and not (tmp_path / "signals").exists(), out
    assert not (tmp_path / "scontrol").exists(), out
    assert "starts with 118s left, within its walltime warning (--signal=B:USR1@300" in out, out
    assert "submit with a --time well over 360 s" in out, out


def test_a_warning_that_comes_before_astraflow_runs_does_not_kill_the_script(tmp_path):
    """SIGUSR1's default action ends a shell: the warning of a short job can come while the
    script still checks its interpreter."""
    proc = _head(tmp_path, STUB_TIME_LEFT="1:00")
    deadline = time.monotonic() + 60
    while not (tmp_path / "checked").exists():  # the script runs its interpreter's checks
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and (tmp_path / "args").exists(), out


def test_head_script_does_not_import_from_its_working_directory(tmp_path):
    """A job submitted from a directory others can write (a shared project directory): a module
    planted there must not run as the job's owner ahead of the installed ``astraflow``."""
    (tmp_path / "c.yaml").write_text("run: {}\n")
    marker = tmp_path / "planted-ran"
    (tmp_path / "astraflow.py").write_text(f"open({str(marker)!r}, 'w').close()\nimport sys\nsys.exit(0)\n")
    proc = subprocess.run(["bash", str(JOBS / "astraflow-head.sbatch"), "c.yaml", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(JOBS.parent),
                               "ASTRAFLOW_PYTHON": sys.executable})
    assert not marker.exists(), proc.stdout + proc.stderr
    assert proc.returncode == 2 and "invalid config" in proc.stderr, proc.stdout + proc.stderr  # the real one ran
