"""Monitoring room: the curves of a run, read from ``metrics.jsonl``.

The data layer appends one JSON line per trainer step and per held-out evaluation; that file is
the durable record of a run. :class:`MetricsReader` -> :class:`MetricsView` turns it into curves
per policy for the AstraFlow page (``/astraflow/api/metrics.json``), ``astraflow status --json
--metrics`` and the plots, reading only the lines appended since its last call.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import Field

from astraflow.runtime.monitoring.view import SCHEMA_VERSION, _View
from storage.paths import RunPaths

log = logging.getLogger("astraflow.monitoring")


class PolicyCurves(_View):
    """Curves of one policy; the trainer lists share one index (one entry per step line)."""

    step: list[int] = Field(description="trainer step (weight version published)")
    time: list[float] = Field(description="seconds since the data layer started")
    reward_mean: list[float | None]
    loss: list[float | None]
    trainer_wait_fraction: list[float | None]
    staleness_mean: list[float | None] = Field(description="mean staleness of the step's batch")
    episodes_per_s: list[float | None] = Field(description="run-wide, cumulative average at that step")
    generated_tokens_per_s: list[float | None]
    filtered: list[int | None] = Field(description="cumulative counts at that step")
    stale_dropped: list[int | None]
    replayed: list[int | None]
    eval_step: list[int] = Field(description="versions evaluated on the held-out split")
    eval_time: list[float]
    eval_accuracy: list[float]
    staleness_hist: dict[str, int] = Field(description="staleness of every consumed trajectory, summed over steps")


class MetricsView(_View):
    """The curves of ``metrics.jsonl``: ``/astraflow/api/metrics.json`` and ``astraflow plot``."""

    schema_version: int
    run_dir: str
    lines: int = Field(description="lines of metrics.jsonl read (a partial last line is not counted)")
    skipped: int = Field(default=0, description="damaged lines skipped (not JSON, not a metrics record)")
    policies: dict[str, PolicyCurves]


_TRAINER_KEYS = {
    "reward_mean": "reward_mean", "loss": "loss", "trainer_wait_fraction": "trainer_wait_fraction",
    "staleness_mean": "data_staleness_mean", "episodes_per_s": "episodes_per_s",
    "generated_tokens_per_s": "generated_tokens_per_s", "filtered": "filtered", "stale_dropped": "stale_dropped",
    "replayed": "replayed",
}
#: the curves of counts (integers)
_COUNT_KEYS = ("filtered", "stale_dropped", "replayed")


def _is_record(rec: Any) -> bool:
    """A line a reader can use: a JSON object with an integer ``step`` (and a numeric
    ``eval_accuracy`` on an evaluation line)."""
    return (isinstance(rec, dict) and isinstance(rec.get("step"), int) and not isinstance(rec["step"], bool)
            and ("eval_accuracy" not in rec or _number(rec["eval_accuracy"]) is not None))


def is_eval_record(rec: dict[str, Any]) -> bool:
    """An evaluation round's line, not a trainer step's: one whose every task failed has no
    ``eval_accuracy``, but has ``eval_prompts`` (0)."""
    return "eval_accuracy" in rec or "eval_prompts" in rec


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def tail_lines(path: Path, offset: int) -> tuple[list[dict[str, Any]], int, int]:
    """The metrics records among the complete lines of ``path`` after byte ``offset``, how many
    lines were skipped (not UTF-8, not JSON, not a record: a damaged line never stops a reader),
    and the offset after them (a line still being written is left for the next call)."""
    if not path.exists():
        return [], 0, offset
    with path.open("rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], 0, offset
    records, skipped = [], 0
    for raw in chunk[: end + 1].splitlines():
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except ValueError:  # not UTF-8 or not JSON
            rec = None
        if _is_record(rec):
            records.append(rec)
        else:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d damaged line(s) after byte %d", path, skipped, offset)
    return records, skipped, offset + end + 1


def tail_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """`tail_lines` without the count of skipped lines."""
    records, _, offset = tail_lines(path, offset)
    return records, offset


class MetricsReader:
    """Reads ``metrics.jsonl`` incrementally: each :meth:`view` parses only lines appended since
    the previous call (the file only grows; a line being written is left for the next call)."""

    def __init__(self, run_dir: Path | str):
        self.paths = RunPaths(Path(run_dir))
        self._offset = 0
        self._lines = 0
        self._skipped = 0
        self._curves: dict[str, dict[str, Any]] = {}

    def _policy(self, name: str) -> dict[str, Any]:
        if name not in self._curves:
            self._curves[name] = {k: [] for k in PolicyCurves.model_fields if k != "staleness_hist"}
            self._curves[name]["staleness_hist"] = {}
        return self._curves[name]

    def _add(self, rec: dict[str, Any]) -> None:
        """Add one record (`_is_record`); a field of the wrong type reads as missing."""
        c = self._policy(str(rec.get("policy", "?")))
        when = float(_number(rec.get("time")) or 0.0)
        if is_eval_record(rec):
            if "eval_accuracy" not in rec:  # a round none of whose tasks completed: no point on the curve
                return
            c["eval_step"].append(rec["step"])
            c["eval_time"].append(when)
            c["eval_accuracy"].append(float(rec["eval_accuracy"]))
            return
        c["step"].append(rec["step"])
        c["time"].append(when)
        for key, src in _TRAINER_KEYS.items():
            value = _number(rec.get(src))
            c[key].append(value if key not in _COUNT_KEYS or isinstance(value, int) else None)
        hist = rec.get("data_staleness_hist")
        for k, v in (hist.items() if isinstance(hist, dict) else ()):
            if isinstance(v, int) and not isinstance(v, bool) and str(k).lstrip("-").isdigit():
                c["staleness_hist"][str(k)] = c["staleness_hist"].get(str(k), 0) + v

    def read(self) -> None:
        records, skipped, self._offset = tail_lines(self.paths.metrics, self._offset)
        self._skipped += skipped
        for rec in records:
            self._add(rec)
            self._lines += 1

    def view(self) -> MetricsView:
        self.read()
        return MetricsView(
            schema_version=SCHEMA_VERSION, run_dir=str(self.paths.root), lines=self._lines, skipped=self._skipped,
            policies={p: PolicyCurves(**c) for p, c in self._curves.items()},
        )


def read_metrics(run_dir: Path | str) -> MetricsView:
    return MetricsReader(run_dir).view()
