"""A run whose filesystem fills up, on a real small tmpfs, or turns read-only: it stops with one
line that names the filesystem and the way on (no traceback), and once there is space again (or
it takes writes again) the same command resumes it to the end, with its metrics continuing where
they stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli import ROOT, _write_config


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")


def _run(cfg: Path, run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), "--quiet",
                           "--set", f"run.max_steps={steps}", "--set", "workload.eval.every=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_full_disk_stops_the_run_in_one_line_and_it_resumes(tiny_model, tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "12m")  # room for the first weight versions of the tiny model, not for 400 steps
    try:
        cfg, run_dir = _write_config(tmp_path, tiny_model), mnt / "run"
        full = _run(cfg, run_dir, 400)
        assert full.returncode == 1, full.stdout[-2000:] + full.stderr[-3000:]
        lines = [x for x in full.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
        assert lines[0].startswith(f"Error: the run failed: no space left on the filesystem of {run_dir}")
        assert "run `astraflow run` again on this directory to resume" in lines[0]

        subprocess.run(["mount", "-o", "remount,size=96m", str(mnt)], check=True)
        before = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if x.strip() and '"loss"' in x]
        resumed = _run(cfg, run_dir, max(before, default=0) + 4)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                 if x.strip() and '"loss"' in x]
        assert steps == list(range(1, steps[-1] + 1)) and steps[-1] == max(before, default=0) + 4, steps
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_run_directory_made_read_only_stops_the_run_in_one_line_and_it_resumes(tiny_model, tmp_path):
    """The run directory's filesystem turns read-only mid-run (a remount, or the kernel's after
    an I/O error; here a read-only bind mount over it): one line naming it and the way on, no
    traceback though not even ``summary.json`` can be written; writable again, it resumes."""
    cfg, run_dir = _write_config(tmp_path, tiny_model), tmp_path / "run"
    cmd = [sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), "--quiet",
           "--set", "run.max_steps=400", "--set", "workload.eval.every=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mounted = False
    try:
        deadline = time.time() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"loss"' in metrics.read_text()) and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        for args in (["--bind", str(run_dir), str(run_dir)], ["-o", "remount,bind,ro", str(run_dir)]):
            res = subprocess.run(["mount", *args], capture_output=True, text=True)
            if res.returncode != 0:
                pytest.skip(f"cannot bind-mount read-only here (needs root): {res.stderr.strip()}")
            mounted = True
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 1, err[-3000:]
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert lines[0].startswith(f"Error: the run failed: read-only filesystem at {run_dir}"), lines[0]
        assert "run `astraflow run` again on this directory to resume" in lines[0]
        subprocess.run(["umount", str(run_dir)], check=True)
        mounted = False
        before = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip() and '"loss"' in x]
        resumed = _run(cfg, run_dir, max(before) + 4)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip() and '"loss"' in x]
        assert steps == list(range(1, max(before) + 5)), steps
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if mounted:
            subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)
