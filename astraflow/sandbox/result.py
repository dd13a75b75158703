"""What one sandboxed execution returns: per-test outcomes and one status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
