"""Fake ``sbatch`` and ``scancel`` executables for tests (the process boundary to Slurm): they
record their calls in files; ``sbatch`` prints job ids 4101, 4102, ... and fails on a chosen call
as Slurm does."""

from __future__ import annotations

import os
import stat
from pathlib import Path

SBATCH = """#!/bin/sh
# counts its calls in {calls}; call number {fail_at} fails as sbatch does
n=$(( $(cat {calls} 2>/dev/null || echo 0) + 1 ))
echo $n > {calls}
if [ $n -eq {fail_at} ]; then
  echo "sbatch: error: Batch job submission failed: Requested node configuration is not available" >&2
  exit 1
fi
echo "$(( 4100 + n ));cluster"
"""

SCANCEL = """#!/bin/sh
echo "$@" >> {log}
exit {rc}
"""


def fake_slurm(tmp_path: Path, monkeypatch, fail_at: int = 3, scancel_rc: int = 0) -> Path:
    """Put the fakes first on PATH; returns the directory of their records (``calls``: how many
    ``sbatch`` calls; ``scancel.log``: one line of ids per ``scancel`` call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", SBATCH.format(calls=tmp_path / "calls", fail_at=fail_at)),
                       ("scancel", SCANCEL.format(log=tmp_path / "scancel.log", rc=scancel_rc))):
        exe = bin_dir / name
        exe.write_text(text)
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path
