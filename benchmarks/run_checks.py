"""Checks shared by the benchmarks, so that they refuse to measure what is not what they claim.

* ``require_completed``: ``launch`` stops cleanly on Ctrl-C, SIGTERM or ``astraflow stop`` and
  returns; a benchmark that runs it in-process must not report a cut-short run as a finished one.
* ``cuda_problem``: a ``--device cuda...`` on a machine without that GPU would fail in a child
  process with a traceback; the benchmark says so at argument parsing instead.

No side effects on import (the benchmarks set their own environment before importing them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def stopped_early(summary: dict[str, Any] | None, steps: int, result: Any = None) -> str | None:
    """Why a run did not complete ``steps`` trainer steps for every policy, in a few words; None
    when it did. ``summary``: its ``summary.json`` (None when missing); ``result``: what ``launch``
    returned (None when it started nothing: the directory held a completed run already)."""
    if result is not None:
        ending = getattr(result, "ending", None)
        status = getattr(ending, "status", None)
        if getattr(result, "interrupted", False) or status != "completed":
            return f"{status or 'interrupted'}: {getattr(ending, 'reason', None) or 'no reason given'}"
    if not summary:
        return "no summary.json: the run did not end normally"
    if summary.get("status") != "completed":
        return f"summary status {summary.get('status')!r}: {summary.get('reason') or 'no reason given'}"
    done = getattr(result, "steps", None) or summary.get("steps") or {}
    least = min(done.values(), default=0)
    return f"{least} of {steps} trainer steps taken" if least < steps else None


def require_completed(result: Any, run_dir: Path, steps: int, what: str) -> dict[str, Any]:
    """The run's ``summary.json``; exits with status 1 and one line naming ``what`` stopped early
    and why (no RESULT follows) when the run did not complete ``steps`` steps."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    why = stopped_early(summary if isinstance(summary, dict) else None, steps, result)
    if why:
        raise SystemExit(f"{what} stopped early ({why}): no RESULT from a cut-short run")
    return summary


def cuda_problem(device: str, flag: str = "--device") -> str | None:
    """What is wrong with ``device`` here, as an argument error naming the fix; None when it can be
    used (the CPU, or a CUDA device this process sees)."""
    if device == "cpu":
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        return f"{flag} {device}: not a device torch knows ({err}); use cpu or cuda:N"
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return (f"{flag} {device}: no CUDA GPU is visible here (torch.cuda.is_available() is false); "
                f"run it on a machine with a GPU (and a CUDA build of torch), or use {flag} cpu")
    count = torch.cuda.device_count()
    if (dev.index or 0) >= count:
        return f"{flag} {device}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
    return None
