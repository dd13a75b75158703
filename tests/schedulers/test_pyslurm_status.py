"""``pyslurm_status``: pyslurm is used only where its release matches the site's Slurm. The
package here is a real (empty) distribution on the import path with the version each case
needs; the Slurm release is the installed ``sinfo``'s, which needs no running controller."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from schedulers.slurm import pyslurm_status, slurm_version


def _install_pyslurm(root: Path, monkeypatch, version: str) -> None:
    """An importable ``pyslurm`` of ``version`` (a module and its dist-info) first on sys.path."""
    root.mkdir()
    (root / "pyslurm.py").write_text("")
    dist = root / f"pyslurm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pyslurm\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(root))


def test_without_pyslurm_the_cli_is_used():
    if importlib.util.find_spec("pyslurm") is not None:
        pytest.skip("pyslurm is installed here: its absence cannot be shown")
    assert pyslurm_status() == (False, "pyslurm is not installed")


@pytest.mark.skipif(shutil.which("sinfo") is None, reason="Slurm's sinfo is not installed (tests/run.sh installs it)")
def test_pyslurm_is_used_only_when_its_release_is_the_sites(tmp_path, monkeypatch):
    major, minor = slurm_version()
    _install_pyslurm(tmp_path / "other", monkeypatch, f"{major + 1}.{minor}.0")
    ok, why = pyslurm_status()
    assert not ok and why == f"pyslurm {major + 1}.{minor}.0 does not match Slurm {major}.{minor:02d}: the CLI " \
                              "backend is used", why
    monkeypatch.undo()
    _install_pyslurm(tmp_path / "same", monkeypatch, f"{major}.{minor}.1")
    assert pyslurm_status() == (True, f"pyslurm {major}.{minor}.1 matches Slurm {major}.{minor:02d}")


def test_pyslurm_without_a_slurm_to_ask_is_not_used(tmp_path, monkeypatch):
    _install_pyslurm(tmp_path / "site", monkeypatch, "22.5.0")
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sinfo on it
    ok, why = pyslurm_status()
    assert not ok and why.startswith("pyslurm 22.5.0 is installed but Slurm is not reachable: ") and "sinfo" in why, why
