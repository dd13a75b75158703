"""Every benchmark script, as a user runs it (``python benchmarks/<name>.py`` from the repository
root): it measures the checkout it sits in, not another copy of AstraFlow installed in the venv,
and its arguments are checked before anything starts."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"astraflow", "storage", "schedulers", "benchmarks"}
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def _first_project_import_before_path(path: Path) -> str | None:
    """The first module-level import of a project package that comes before the script puts its
    checkout on ``sys.path`` (None when there is none)."""
    seen_insert = False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Expr, ast.If)) and "sys.path.insert" in ast.unparse(node):
            seen_insert = True
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        hit = next((n for n in names if n.split(".")[0] in PROJECT), None)
        if hit and not seen_insert:
            return hit
    return None


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_puts_its_checkout_first_before_importing_the_project(script):
    assert _first_project_import_before_path(script) is None


def test_a_benchmark_runs_its_checkouts_code_when_another_copy_comes_first(tmp_path):
    shadow = tmp_path / "astraflow"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the other copy of astraflow')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sampler.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=env)
    assert res.returncode == 0 and "other copy" not in res.stderr, res.stderr[-2000:]
