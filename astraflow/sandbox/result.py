"""What one sandboxed execution returns: per-test outcomes and one status, read from the runner's
report lines and how its process ended."""

from __future__ import annotations

import ast
import signal
import time
from dataclasses import dataclass
from typing import Literal

MAX_EVENT_CHARS = 1 << 14  # one report line: a test's name and its truncated exception line
CPU_SIGNALS = (128 + signal.SIGXCPU, 128 + signal.SIGKILL)  # the CPU limit's soft and hard ends

Status = Literal["ok", "failure", "timeout", "memory", "output_limit", "sandbox_error"]


@dataclass(frozen=True)
class TestOutcome:
    """One ``test_*`` function of the tests (or the whole tests source, named "tests")."""

    __test__ = False  # not a pytest class

    name: str
    passed: bool
    error: str | None  # the exception line (``AssertionError: ...``), truncated; None if passed


@dataclass(frozen=True)
class SandboxResult:
    """``status``: ok (the program and every test ran and passed), failure (it ran but raised,
    a test failed, not valid Python or not UTF-8), timeout (wall-clock or CPU limit), memory,
    output_limit, sandbox_error (the sandbox itself failed: not the program's fault)."""

    status: Status
    tests: tuple[TestOutcome, ...]
    stdout: str
    stderr: str
    exit_code: int | None
    wall_s: float

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def all_passed(self) -> bool:
        return self.status == "ok" and self.passed == self.total

    def to_json(self) -> dict:
        return {"status": self.status, "passed": self.passed, "total": self.total,
                "tests": [{"name": t.name, "passed": t.passed, "error": t.error} for t in self.tests],
                "stdout": self.stdout, "stderr": self.stderr, "exit_code": self.exit_code,
                "wall_s": round(self.wall_s, 4)}


def events(channel: bytes, nonce: str) -> list[tuple[str, object]]:
    """(event, payload) of the runner's lines that carry the nonce; anything else is ignored
    (the program can write to the pipe too), and before it is parsed: a long or nested literal
    costs the host CPU time."""
    events = []
    prefix = f"('{nonce}', "  # how the runner's repr((nonce, event, payload)) begins (a hex nonce)
    for line in channel.decode("utf-8", "replace").splitlines():
        if len(line) > MAX_EVENT_CHARS or not line.startswith(prefix):
            continue
        try:
            event = ast.literal_eval(line)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
        if isinstance(event, tuple) and len(event) == 3 and event[0] == nonce:
            events.append((str(event[1]), event[2]))
    return events


def judged(code: int | None, out: bytes, err: bytes, events: list[tuple[str, object]],
           killed: str | None, expected: list[str], start: float, cpu_s: float) -> SandboxResult:
    """The result of an execution. Killed by SIGXCPU or SIGKILL is a timeout only once the
    execution has lasted ``cpu_s``: the program can send either signal to itself, and one
    process needs at least that long to spend its CPU time."""
    kinds = {kind for kind, _ in events}
    outcomes = {}
    for kind, payload in events:
        if kind == "test" and isinstance(payload, tuple) and len(payload) == 3:
            name, passed, error = payload
            outcomes.setdefault(str(name), TestOutcome(
                str(name), bool(passed), None if error is None else str(error)))
    why = {"timeout": "not run: the execution timed out", "output_limit": "not run: output limit"}
    program_ok = any(kind == "program" and payload is True for kind, payload in events)
    default = ("not run: the program failed" if not program_ok
               else "not run: the program exited before this test")
    missing = why.get(killed or "", default)
    results = tuple(outcomes.get(n) or TestOutcome(n, False, missing) for n in expected)
    if killed:
        status = killed
    elif "start" not in kinds or "runner_error" in kinds:
        status = "sandbox_error"
    elif code in CPU_SIGNALS and time.monotonic() - start >= cpu_s:
        status = "timeout"
    elif "memory" in kinds:
        status = "memory"
    elif code == 0 and "done" in kinds and all(t.passed for t in results):
        status = "ok"
    else:
        status = "failure"
    return result(status, results, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                   code, start)


def result(status, tests, stdout, stderr, code, start) -> SandboxResult:
    return SandboxResult(status=status, tests=tuple(tests), stdout=stdout, stderr=stderr,
                         exit_code=code, wall_s=time.monotonic() - start)
