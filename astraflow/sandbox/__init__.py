"""Running model-written Python with tests in a bubblewrap sandbox: no network, a scratch
directory of its own, CPU, memory, process and output limits, everything killed at the end.

A leaf: it imports no component, no runtime and no run config, so the rollout side, the code
workload and the CLI can all use it. See docs/sandbox.md.
"""

from __future__ import annotations

import threading

from .bwrap import SandboxUnavailable
from .config import SandboxConfig
from .core import Sandbox, run_within
from .result import SandboxResult, TestOutcome

__all__ = ["Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailable", "TestOutcome",
           "configure", "default_sandbox", "run_within"]

_default: Sandbox | None = None
_lock = threading.Lock()


def configure(cfg: SandboxConfig) -> Sandbox:
    """Set the process-wide sandbox (a node calls this once with the run's ``sandbox:``)."""
    global _default
    with _lock:
        if _default is not None:
            _default.close()
        _default = Sandbox(cfg)
        return _default


def default_sandbox() -> Sandbox:
    """The process-wide sandbox; the defaults of SandboxConfig until ``configure`` is called."""
    global _default
    with _lock:
        if _default is None:
            _default = Sandbox(SandboxConfig())
        return _default
