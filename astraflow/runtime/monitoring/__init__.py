"""Monitoring room: what a person watching a run sees, built in one place from the run directory.

The orchestrator writes the status files (``control/orchestrator.json`` once,
``control/status.json`` every tick, ``summary.json`` at the end: `writer`, `snapshot`) and the
data layer appends one line per trainer step and per evaluation to ``metrics.jsonl``. Every
reader goes through this package, so they never disagree: the AstraFlow page on the Dask
dashboard and ``astraflow status --json`` (`view`), the ``astraflow status`` text (`text`), the
curves (`metrics`) and their plots and TensorBoard mirror (`export`). Nothing here talks to the
cluster: a run directory on shared storage is enough.

Reading order: `snapshot` (the files and the one rule for "running"), `writer` (with
`partition_stats`), `view`,
`metrics`, `text`, `export`.
"""

from astraflow.runtime.monitoring.export import PLOTS, export_tensorboard, write_plots
from astraflow.runtime.monitoring.metrics import MetricsReader, MetricsView, PolicyCurves, read_metrics, tail_records
from astraflow.runtime.monitoring.snapshot import (
    STALE_AFTER_S,
    RunNotRunning,
    Snapshot,
    archive_summary,
    read_snapshot,
    run_status,
    write_orchestrator_info,
    write_status,
    write_summary,
)
from astraflow.runtime.monitoring.text import format_partitions, format_status
from astraflow.runtime.monitoring.view import (
    SCHEMA_VERSION,
    AutoscaleView,
    DecisionView,
    LedgerView,
    NodeView,
    PartitionView,
    PolicyView,
    StatusView,
    build_status_view,
)
from astraflow.runtime.monitoring.writer import StatusWriter, Tick

__all__ = [
    "AutoscaleView", "DecisionView", "PLOTS", "SCHEMA_VERSION", "STALE_AFTER_S", "LedgerView", "MetricsReader",
    "MetricsView", "NodeView",
    "PartitionView", "PolicyCurves", "PolicyView", "RunNotRunning", "Snapshot", "StatusView", "StatusWriter",
    "Tick", "archive_summary", "build_status_view", "export_tensorboard", "format_partitions", "format_status",
    "read_metrics", "read_snapshot", "run_status", "tail_records", "write_orchestrator_info", "write_plots",
    "write_status", "write_summary",
]
