"""Structured results for each exit reason, the concurrency bound, deadlines under contention
and ``arun`` off the event loop, on the real bubblewrap sandbox."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from astraflow.sandbox import Sandbox, SandboxConfig, SandboxUnavailable, configure, default_sandbox

ADD = "def add(a, b):\n    return a + b\n"
LIMITS = dict(timeout_s=3.0, cpu_s=2.0, memory_mb=256, max_processes=16, max_output_bytes=4096)


@pytest.fixture(scope="module")
def sb():
    return Sandbox(SandboxConfig(**LIMITS))


def test_every_test_passes(sb):
    r = sb.run(ADD + "print('hello')\n", "def test_one():\n    assert add(1, 2) == 3\n\n"
               "def test_two():\n    assert add(-1, 1) == 0\n")
    assert (r.status, r.passed, r.total, r.all_passed, r.exit_code) == ("ok", 2, 2, True, 0)
    assert r.stdout == "hello\n" and [t.name for t in r.tests] == ["test_one", "test_two"]
    assert json.loads(json.dumps(r.to_json()))["passed"] == 2


def test_one_failing_test_fails_only_itself(sb):
    r = sb.run(ADD, "def test_ok():\n    assert add(1, 2) == 3\n\ndef test_bad():\n    assert add(1, 2) == 4\n\n"
               "def test_raises():\n    add(1)\n\ndef test_msg():\n    assert False, 'wrong sum'\n")
    assert r.status == "failure" and (r.passed, r.total) == (1, 4)
    errors = {t.name: t.error for t in r.tests}
    assert errors["test_ok"] is None
    assert errors["test_bad"] == "AssertionError: assert add(1, 2) == 4"
    assert errors["test_raises"].startswith("TypeError:")
    assert errors["test_msg"] == "AssertionError: wrong sum"


def test_tests_without_test_functions_are_one_test(sb):
    ok = sb.run(ADD, "assert add(2, 2) == 4\n")
    bad = sb.run(ADD, "assert add(2, 2) == 5\n")
    assert (ok.status, [(t.name, t.passed) for t in ok.tests]) == ("ok", [("tests", True)])
    assert (bad.status, [(t.name, t.passed) for t in bad.tests]) == ("failure", [("tests", False)])


def test_without_tests_the_exit_code_decides(sb):
    assert sb.run("pass\n").status == "ok"
    r = sb.run("import sys\nsys.exit(3)\n")
    assert (r.status, r.exit_code, r.tests) == ("failure", 3, ())
    r = sb.run("raise ValueError('boom')\n")
    assert r.status == "failure" and r.stderr.rstrip().endswith("ValueError: boom")
    assert "runner.py" not in r.stderr  # the traceback is the program's, not the runner's


def test_a_program_that_crashes_before_the_tests_fails_them_all(sb):
    r = sb.run("raise SystemExit(1)\n", "def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    assert r.status == "failure" and [(t.name, t.passed) for t in r.tests] == [("test_a", False), ("test_b", False)]


def test_a_program_that_exits_during_the_tests_fails_the_rest(sb):
    r = sb.run(ADD, "def test_a():\n    pass\n\ndef test_b():\n    import os\n    os._exit(0)\n\ndef test_c():\n    pass\n")
    assert r.status == "failure" and [t.passed for t in r.tests] == [True, False, False]


@pytest.mark.parametrize("body", ["raise SystemExit(0)", "import sys\n    sys.exit()"])
def test_a_program_that_exits_cleanly_during_the_tests_does_not_pass_them(sb, body):
    """The tests' asserts did not run: exit code 0 is no pass, with or without test_* functions."""
    prog = f"def add(a, b):\n    {body}\n"
    r = sb.run(prog, "assert add(1, 2) == 4\n")
    assert r.status == "failure" and not r.all_passed and [t.passed for t in r.tests] == [False], r
    r = sb.run(prog, "X = add(1, 2)\n\ndef test_a():\n    assert X == 4\n")
    assert r.status == "failure" and [t.passed for t in r.tests] == [False], r


def test_printing_a_fake_report_does_not_pass_the_tests(sb):
    fake = json.dumps({"nonce": "guess", "event": "test", "name": "test_a", "passed": True, "error": None})
    prog = f"import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, {fake!r}.encode() + b'\\n')\n    except OSError:\n        pass\nprint({fake!r})\nos._exit(0)\n"
    r = sb.run(prog, "def test_a():\n    assert False\n")
    assert r.status == "failure" and not r.tests[0].passed


def test_the_runners_module_gives_the_program_no_channel(sb):
    """``import __main__`` is the program's own module: the runner's pipe and nonce are not in it."""
    prog = ("import __main__, sys, os\n"
            "found = [t for v in vars(__main__).values() if isinstance(v, list) for t in v\n"
            "         if isinstance(t, tuple) and len(t) == 2]\n"
            "for out, nonce in found:\n"
            "    out.write(repr((nonce, 'program', True)) + '\\n')\n"
            "    for name in sys.argv[6:]:\n"
            "        out.write(repr((nonce, 'test', (name, True, None))) + '\\n')\n"
            "    out.write(repr((nonce, 'done', None)) + '\\n'); out.flush()\n"
            "    os._exit(0)\n"
            "def add(a, b):\n    return 0\n")
    r = sb.run(prog, "def test_a():\n    assert add(1, 2) == 3\n")
    assert r.status == "failure" and not r.tests[0].passed, r


@pytest.mark.parametrize("prog, status", [
    ("while True:\n    pass\n", "timeout"),
    ("x = bytearray(1 << 30)\n", "memory"),
    ("print('y' * 100000)\n", "output_limit"),
])
def test_each_limit_has_its_status(sb, prog, status):
    r = sb.run(prog, "def test_a():\n    pass\n", timeout_s=1.0)
    assert r.status == status and [(t.name, t.passed) for t in r.tests] == [("test_a", False)]


def test_a_broken_sandbox_is_a_sandbox_error_not_the_programs_fault():
    broken = Sandbox(SandboxConfig(**LIMITS, interpreter="/bin/false"))
    broken._checked = True  # past the start-up check, as if the interpreter broke later
    r = broken.run("print('fine')\n")
    assert r.status == "sandbox_error"


def test_missing_bubblewrap_names_the_fix():
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox(SandboxConfig(bwrap="/nonexistent/bwrap")).run("pass\n")


def test_a_bubblewrap_without_an_option_the_sandbox_uses_fails_the_start_up_check():
    """The check runs bubblewrap with every option an execution uses: one too old for
    ``--disable-userns`` (before 0.8) is refused at start, not by every program after."""
    import shutil

    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("no bubblewrap here")
    where = Path(tempfile.mkdtemp(prefix="old-bwrap-", dir="/tmp"))  # reachable by the sandbox's uid
    old = where / "bwrap"
    old.write_text('#!/bin/sh\nfor a in "$@"; do\n  if [ "$a" = "--disable-userns" ]; then\n'
                   '    echo "bwrap: Unknown option --disable-userns" >&2; exit 1\n  fi\ndone\n'
                   f'exec {real} "$@"\n')
    old.chmod(0o755)
    where.chmod(0o755)
    try:
        with pytest.raises(SandboxUnavailable, match="too old.*Unknown option --disable-userns.*0.8 or newer"):
            Sandbox(SandboxConfig(bwrap=str(old))).check()
    finally:
        shutil.rmtree(where)


def test_bad_arguments_are_errors(sb):
    with pytest.raises(ValueError, match="timeout_s"):
        sb.run("pass\n", timeout_s=0)
    with pytest.raises(TypeError):
        sb.run(None)


def test_the_pool_bounds_concurrency():
    n = 2
    sb = Sandbox(SandboxConfig(**{**LIMITS, "concurrency": n}))
    prog = "import time\nprint(time.time())\ntime.sleep(0.8)\nprint(time.time())\n"
    results = []
    threads = [threading.Thread(target=lambda: results.append(sb.run(prog))) for _ in range(n + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    assert len(spans) == n + 1
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most <= n, spans


def test_a_stuck_execution_cannot_hold_others_past_its_deadline():
    sb = Sandbox(SandboxConfig(**{**LIMITS, "concurrency": 1}))
    stuck = threading.Thread(target=sb.run, args=("while True:\n    pass\n",), kwargs={"timeout_s": 1.0})
    stuck.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    r = sb.run("print('next')\n")
    stuck.join()
    assert r.status == "ok" and time.monotonic() - t0 < 1.0 + 5.0  # its deadline, and a start under load


def test_arun_does_not_block_the_event_loop(sb):
    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        r = await sb.arun("import time\ntime.sleep(0.6)\n")
        ticker.cancel()
        return r, ticks

    r, ticks = asyncio.run(main())
    assert r.status == "ok" and ticks >= 10


def test_the_process_wide_sandbox_is_configured_once():
    first = configure(SandboxConfig(concurrency=1))
    assert default_sandbox() is first and first.cfg.concurrency == 1


def test_a_new_scratch_root_works_under_an_owner_only_umask():
    """A run works under umask 077: the scratch root it creates must still let the sandbox's
    unprivileged uid reach its execution directories."""
    import shutil
    import tempfile
    import uuid

    root = os.path.join(tempfile.gettempdir(), f"astraflow-sandbox-test-{uuid.uuid4().hex[:8]}")
    old = os.umask(0o077)
    try:
        result = Sandbox(SandboxConfig(scratch_root=root)).run("print(1)", None)
    finally:
        os.umask(old)
        shutil.rmtree(root, ignore_errors=True)
    assert result.status == "ok", result.stderr


def test_a_scratch_root_the_sandbox_cannot_reach_names_the_fix(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only a node running as root drops to another uid for the sandbox")
    tmp_path.chmod(0o700)
    with pytest.raises(SandboxUnavailable, match=r"cannot pass through .* set sandbox.scratch_root"):
        Sandbox(SandboxConfig(scratch_root=str(tmp_path / "sb"))).run("print(1)", None)


@pytest.mark.parametrize("prog, tests", [
    ("import sys\nsys.modules['traceback'] = None\nraise ValueError('x')\n", None),
    ("import sys\nsys.setrecursionlimit(12)\nraise ValueError('x')\n", None),
    ("import builtins\nbuiltins.isinstance = None\nraise ValueError('x')\n", None),
    (ADD, "def test_a():\n    import sys\n    sys.setrecursionlimit(12)\n    raise ValueError('x')\n"),
    (ADD, "class M:\n    def __eq__(self, o):\n        raise RuntimeError('boom')\n    __hash__ = object.__hash__\n\n"
          "class E(Exception):\n    __module__ = M()\n\ndef test_a():\n    raise E()\n"),
    ("class M:\n    def __eq__(self, o):\n        raise RuntimeError('boom')\n    __hash__ = object.__hash__\n\n"
     "class E(Exception):\n    __module__ = M()\n\nraise E()\n", "def test_a():\n    pass\n"),
])
def test_a_program_that_breaks_the_runners_reporting_fails_itself_not_the_sandbox(sb, prog, tests):
    """The program shares the runner's interpreter: a low recursion limit, a poisoned module or a
    hostile exception class when it fails is still the program's failure, never sandbox_error."""
    r = sb.run(prog, tests)
    assert r.status == "failure", (r.status, r.stderr[-500:])
    assert "sandbox runner failed" not in r.stderr and not any(t.passed for t in r.tests)


def test_a_byte_order_mark_is_not_code(sb):
    r = sb.run(b"\xef\xbb\xbf" + ADD.encode() + b"print('bom')\n", "\ufeffdef test_a():\n    assert add(1, 2) == 3\n")
    assert (r.status, r.stdout, [t.name for t in r.tests]) == ("ok", "bom\n", ["test_a"]), r.stderr


def test_the_host_parses_only_lines_that_carry_the_nonce(monkeypatch):
    """The program can write to the result pipe: its lines are dropped before any parsing (a
    literal can cost the host seconds of CPU), and so is an overlong line."""
    from astraflow.sandbox import result

    parsed = []
    real = result.ast.literal_eval
    monkeypatch.setattr(result.ast, "literal_eval", lambda s: parsed.append(s) or real(s))
    nonce = "ab" * 16
    good = repr((nonce, "test", ("test_a", True, None)))
    long = repr((nonce, "test", ("test_b", True, "x" * (result.MAX_EVENT_CHARS + 1))))
    channel = "\n".join(["{" + ",".join(["1"] * 1000) + "}", repr(("0" * 32, "done", None)), long, good])
    assert result.events(channel.encode(), nonce) == [("test", ("test_a", True, None))]
    assert parsed == [good]


def test_unittest_classes_run_as_the_docs_say(sb):
    """``unittest.main(exit=False)`` from a test_* function (docs/sandbox.md) sees the program's
    argv, not the runner's arguments, which it would load as test names (test_* itself among them)."""
    tests = ("import sys, unittest\n\nclass T(unittest.TestCase):\n    def test_add(self):\n"
             "        self.assertEqual(add(1, 2), 3)\n\ndef test_unittest():\n"
             "    assert sys.argv == ['/in/program.py'], sys.argv\n"
             "    assert unittest.main(exit=False).result.wasSuccessful()\n")
    r = sb.run("def add(a, b):\n    return a + b\n", tests)
    assert r.status == "ok" and r.all_passed, r
    r = sb.run("def add(a, b):\n    return a - b\n", tests)
    assert r.status == "failure" and "AssertionError" in r.tests[0].error, r
