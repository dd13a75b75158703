"""The launcher scripts under jobs/ parse and refuse bad use with a message."""

from __future__ import annotations

import subprocess
from pathlib import Path

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


def test_worker_template_link_points_at_the_rendered_template():
    link = JOBS / "worker.sbatch.j2"
    assert link.resolve() == (JOBS.parent / "schedulers" / "templates" / "worker.sbatch.j2").resolve()
    assert "#SBATCH --job-name={{ worker_name }}" in link.read_text()


def test_head_script_refuses_an_interpreter_without_astraflow(tmp_path):
    (tmp_path / "c.yaml").write_text("run: {}\n")
    proc = subprocess.run(["bash", str(JOBS / "astraflow-head.sbatch"), "c.yaml"], capture_output=True, text=True,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "ASTRAFLOW_PYTHON": "/usr/bin/true-nope"})
    assert proc.returncode == 2 and "cannot import astraflow" in proc.stderr
