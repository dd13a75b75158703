"""Checks shared by the benchmarks, so that they refuse to measure what is not what they claim.

* ``require_completed``: ``launch`` stops cleanly on Ctrl-C, SIGTERM or ``astraflow stop`` and
  returns; a benchmark that runs it in-process must not report a cut-short run as a finished one.
* ``cuda_problem``: a ``--device cuda...`` on a machine without that GPU would fail in a child
  process with a traceback; the benchmark says so at argument parsing instead.
* ``at_least``, ``above``, ``counts``: argparse types for counts and durations, so that ``--reps 0``
  is an argument error (exit 2, one line) rather than a traceback or a RESULT divided by zero
  after a run.

No side effects on import (the benchmarks set their own environment before importing them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable


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


def at_least(low: float, kind: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)``, refused with a one-line argument error when it is not a
    number of that kind or is below ``low``."""
    return _bounded(kind, lambda v: v >= low, f"at least {low}")


def above(low: float, kind: Callable[[str], Any] = float) -> Callable[[str], Any]:
    """As ``at_least``, for a value that must be greater than ``low`` (a duration above 0)."""
    return _bounded(kind, lambda v: v > low, f"above {low}")


def counts(low: int = 1) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each at least ``low`` (``--tokens 12,512``)."""
    one = at_least(low)
    return lambda text: [one(x.strip()) for x in text.split(",")]


def _bounded(kind: Callable[[str], Any], ok: Callable[[Any], bool], said: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {said}, got {text}")
        return value

    return parse
