"""A config's ``module:name`` imports from the directory `astraflow` runs in, as the README's
custom workflow does, without that directory shadowing an installed module: it goes last on the
import path of the CLI and of every process the run starts (``ASTRAFLOW_USER_DIR``, appended by
``storage.ownership.add_user_dir``; never ``PYTHONPATH``, whose entries come first, and
``PYTHONSAFEPATH`` so that ``python -m`` does not put it first either), and only when no other
user can change it (the run directory's rule): otherwise a module of the config that does not
import says which directory was left out, why, and the fix.

The CLI runs as ``python -P -m astraflow``: like the ``astraflow`` command, that does not put the
working directory first itself. Modules planted in it stand for what another user would plant;
each records its import and then loads the real one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 65534
SITE = Path(yaml.__file__).resolve().parents[1]
#: a module planted under an installed module's name: it records its import, then loads the real one
SHIM = '''import importlib, os, sys
open(os.path.join({marks!r}, __name__), "w").write(str(os.getpid()))
_here = os.path.dirname(os.path.abspath(__file__))
del sys.modules[__name__]
_saved = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
try:
    sys.modules[__name__] = importlib.import_module(__name__)
finally:
    sys.path[:] = _saved
'''


def _project(tmp_path: Path, tiny_model: Path, parent: Path | None = None) -> tuple[Path, Path]:
    """A user's project directory (0700) with the README's workflow as ``userflows.flows`` and
    a config naming it, plus planted modules under the names of the installed packages; and
    the directory where those record their imports."""
    proj, marks = (parent or tmp_path) / "proj", tmp_path / "marks"
    (proj / "userflows").mkdir(parents=True)
    marks.mkdir()
    proj.chmod(0o700)
    (proj / "userflows" / "__init__.py").write_text("")
    (proj / "userflows" / "flows.py").write_text((ROOT / "examples" / "custom_workflow" / "flows.py").read_text())
    names = {p.name.split(".")[0].split("-")[0] for p in SITE.iterdir() if not p.name.endswith((".dist-info", ".pth"))}
    for name in sorted(n for n in names if n.isidentifier() and n not in ("userflows", "astraflow")):
        (proj / f"{name}.py").write_text(SHIM.format(marks=str(marks)))
    data = yaml.safe_load((ROOT / "examples" / "custom_workflow" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init", None)
    data["workload"]["workflow"] = "userflows.flows:two_tries"
    data["run"]["max_steps"] = 1
    (proj / "config.yaml").write_text(yaml.safe_dump(data))
    return proj, marks


def _cli(proj: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASTRAFLOW_USER_DIR", "PYTHONSAFEPATH")}
    return subprocess.run([sys.executable, "-P", "-m", "astraflow", *args], cwd=proj, env=env,
                          capture_output=True, text=True, timeout=240)


def test_a_process_appends_the_user_dir_it_is_given_after_the_installed_packages(tmp_path, tiny_model):
    proj, marks = _project(tmp_path, tiny_model)
    probe = ("import sys; from storage.ownership import add_user_dir; add_user_dir(); import zarr, userflows.flows; "
             "print(sys.path[-1]); print(zarr.__file__)")
    env = {**os.environ, "ASTRAFLOW_USER_DIR": str(proj), "PYTHONSAFEPATH": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=proj, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [str(proj), str(SITE / "zarr" / "__init__.py")]
    assert not list(marks.iterdir())


@pytest.mark.parametrize("sticky_parent", [False, True])
def test_check_imports_the_users_workflow_and_nothing_that_shadows_an_installed_module(tmp_path, tiny_model,
                                                                                      sticky_parent):
    proj, marks = _project(tmp_path, tiny_model, tmp_path / "tmp" if sticky_parent else None)
    if sticky_parent:  # like /tmp: others cannot rename what is ours in it
        (tmp_path / "tmp").chmod(0o1777)
    proc = _cli(proj, "check", "config.yaml")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "workflow: userflows.flows:two_tries" in proc.stdout
    assert sorted(p.name for p in marks.iterdir()) == []


CASES = {"writable by others": "", "inside a directory others can rename entries in": "shared",
         "owned by another user": "theirs"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_working_directory_others_can_change_is_left_out_and_the_error_says_why(tmp_path, tiny_model, case):
    if case == "owned by another user" and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    parent = tmp_path / CASES[case] if CASES[case] else None
    proj, marks = _project(tmp_path, tiny_model, parent)
    if case == "writable by others":
        proj.chmod(0o777)
        why = f"the working directory {proj} is writable by group/others (mode 0777)"
    elif case == "owned by another user":
        proj.chmod(0o755)
        os.chown(proj, OTHER_UID, OTHER_UID)
        why = f"the working directory {proj} is owned by uid {OTHER_UID}"
    else:
        parent.chmod(0o777)
        why = f"the working directory {proj} is inside {parent}, which group/others can write without the sticky bit"
    proc = _cli(proj, "check", "config.yaml")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot import 'userflows.flows'" in proc.stderr and why in proc.stderr, proc.stderr
    assert ("so it is not on the import path (a module there would run as you): run from a directory only you "
            "can change, or install the module's package") in proc.stderr
    assert "Traceback" not in proc.stderr and not list(marks.iterdir())


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_processes_a_run_starts_import_the_users_workflow_but_not_the_working_directory_first(
        tmp_path, tiny_model):
    proj, marks = _project(tmp_path, tiny_model)
    proc = _cli(proj, "run", "config.yaml", "--run-dir", str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()
    assert sorted(p.name for p in marks.iterdir()) == []  # no process of the run imported a planted module


@pytest.mark.parametrize("safe_path", [False, True])
def test_a_user_module_named_like_an_installed_one_is_refused_by_check_as_the_run_would(tmp_path, safe_path):
    """``python -m`` puts the working directory first, where the run's processes put it last:
    check resolves the config's modules as they will, and says which module won and why."""
    proj = tmp_path / "proj"
    proj.mkdir(mode=0o700)
    (proj / "code.py").write_text((ROOT / "examples" / "custom_workflow" / "flows.py").read_text())
    data = yaml.safe_load((ROOT / "examples" / "custom_workflow" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "model")
    data["workload"]["workflow"] = "code:two_tries"
    (proj / "config.yaml").write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k not in ("ASTRAFLOW_USER_DIR", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(ROOT)
    flags = ["-P"] if safe_path else []
    proc = subprocess.run([sys.executable, *flags, "-m", "astraflow", "check", "config.yaml"], cwd=proj, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"not your {proj / 'code.py'}: an installed module of that name comes before" in proc.stderr, proc.stderr
