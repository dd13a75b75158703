"""``astraflow sandbox run``: the summary, --json, and exit 2 with the fix for bad input."""

from __future__ import annotations

import json

from click.testing import CliRunner

from astraflow.cli import main


def _files(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text("def add(a, b):\n    return a + b\nprint('hi')\n")
    tests = tmp_path / "tests.py"
    tests.write_text("def test_a():\n    assert add(1, 2) == 3\n\ndef test_b():\n    assert add(1, 2) == 4\n")
    return prog, tests


def test_run_prints_a_summary_and_exits_0_whatever_the_program_did(tmp_path):
    prog, tests = _files(tmp_path)
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--tests", str(tests)])
    assert r.exit_code == 0, r.output
    assert "status: failure (1/2 tests passed" in r.output and "FAIL test_b: AssertionError" in r.output


def test_shared_tests_run_in_the_programs_namespace(tmp_path):
    """Tests that reach the program's globals by name: only in its own namespace."""
    prog = tmp_path / "prog.py"
    prog.write_text("SEEN = []\ndef add(a, b):\n    SEEN.append(a)\n    return a + b\n")
    tests = tmp_path / "tests.py"
    tests.write_text("def test_a():\n    add(1, 2)\n    assert SEEN == [1]\n")
    shared = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--tests", str(tests), "--shared-tests", "--json"])
    isolated = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--tests", str(tests), "--json"])
    assert json.loads(shared.output)["status"] == "ok", shared.output
    assert json.loads(isolated.output)["status"] == "failure", isolated.output  # a copy of SEEN, made before


def test_run_json(tmp_path):
    prog, tests = _files(tmp_path)
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--json", "--timeout", "5"])
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "ok"


def test_bad_input_exits_2_naming_the_fix(tmp_path, monkeypatch):
    prog, _ = _files(tmp_path)
    r = CliRunner().invoke(main, ["sandbox", "run", str(tmp_path / "missing.py")])
    assert r.exit_code == 2 and "give the path of a Python file" in r.output
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--timeout", "0"])
    assert r.exit_code == 2 and "positive, finite number of seconds" in r.output
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog)])
    assert r.exit_code == 2 and "apt-get install -y bubblewrap" in r.output


def test_an_infinite_timeout_is_refused(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("print(1)\n")
    res = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--timeout", "inf"])
    assert res.exit_code == 2 and "--timeout inf: give a positive, finite number" in res.output


def test_bubblewrap_and_the_interpreter_can_be_given_as_options(tmp_path, monkeypatch):
    """The fix the message names is one this command can apply: --bwrap (and --interpreter)."""
    import shutil

    from astraflow.sandbox import SandboxConfig, bwrap

    real, python = shutil.which("bwrap"), bwrap.interpreter(SandboxConfig())  # the base python3, not a venv
    prog, _ = _files(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog)])
    assert r.exit_code == 2 and "set --bwrap to its path" in r.output and "sandbox.bwrap" not in r.output
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--bwrap", real, "--interpreter", python, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "ok", r.output
    plain = tmp_path / "bwrap-copy"
    plain.write_bytes(b"")  # a file there, not a program
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--bwrap", str(plain)])
    assert r.exit_code == 2 and "is not executable" in r.output and f"chmod +x {plain}" in r.output, r.output


def test_the_programs_output_cannot_rewrite_the_summary_on_a_terminal(tmp_path):
    """Cursor moves and line erases in its output or exception line are shown, not acted on."""
    prog = tmp_path / "p.py"
    prog.write_text("print('\\x1b[1A\\x1b[2Kstatus: ok\\r')\ndef add(a, b):\n    raise ValueError('\\x1b[2K\\x9b1A')\n")
    tests = tmp_path / "t.py"
    tests.write_text("def test_a():\n    assert add(1, 2) == 3\n")
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--tests", str(tests)], color=True)  # as on a tty
    assert r.exit_code == 0 and "status: failure" in r.output, r.output
    assert not any(c in r.output for c in "\x1b\x9b\r"), r.output
    assert "\\x1b[1A\\x1b[2Kstatus: ok\\x0d" in r.output and "ValueError: \\x1b[2K\\x9b1A" in r.output, r.output


def test_a_command_started_with_its_standard_input_closed_runs_the_program(tmp_path):
    """``<&-`` (a daemon's child, a cron job): the seccomp filter's pipe would take descriptor 0,
    and bubblewrap's stdin overwrote it there (it then refused the filter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    prog, tests = _files(tmp_path)
    out = subprocess.run([sys.executable, "-m", "astraflow", "sandbox", "run", str(prog), "--tests", str(tests),
                          "--json"], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
                         timeout=120, preexec_fn=lambda: os.close(0))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert (res["status"], res["passed"], res["total"]) == ("failure", 1, 2), res


def test_a_temp_directory_it_cannot_use_is_named_with_the_option_that_moves_it(tmp_path, monkeypatch):
    """$TMPDIR full, read-only, or holding a file where the scratch root goes: the fix named is
    --scratch-root, which this command takes (the run config's ``sandbox.scratch_root``)."""
    import os
    import shutil
    import tempfile
    import uuid

    prog, _ = _files(tmp_path)
    scratch = os.path.join(tempfile.gettempdir(), f"astraflow-sandbox-test-{uuid.uuid4().hex[:8]}")  # reachable
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / f"astraflow-sandbox-{os.geteuid()}").write_text("")  # a file where its directory goes
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read $TMPDIR again
    r = CliRunner().invoke(main, ["sandbox", "run", str(prog)])
    assert r.exit_code == 2 and "set --scratch-root to a directory" in r.output, r.output
    assert "sandbox.scratch_root" not in r.output, r.output
    try:
        r = CliRunner().invoke(main, ["sandbox", "run", str(prog), "--scratch-root", scratch, "--json"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "ok", r.output
