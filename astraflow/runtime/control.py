"""Talking to a running run through its run directory.

The orchestrator writes ``control/orchestrator.json`` (pid, host, dashboard) once and
``control/status.json`` every tick; the CLI reads them, and changes a run only by writing its
desired partitions (``control/partitions.json``), which the orchestrator reconciles. Nothing
here needs a connection to the cluster, so ``astraflow status`` works from any login node that
sees the shared run directory.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from storage.paths import RunPaths

#: a status snapshot older than this means the orchestrator is not running any more.
STALE_AFTER_S = 30.0


class RunNotRunning(ValueError):
    """The run directory has no live orchestrator."""


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def write_orchestrator_info(paths: RunPaths, dashboard: str | None, scheduler: str | None) -> None:
    write_json_atomic(
        paths.orchestrator_file,
        {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
         "dashboard": dashboard, "scheduler": scheduler},
    )


def _alive(info: dict[str, Any]) -> bool:
    if info.get("host") != socket.gethostname():
        return True  # another host: only the status age can tell
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_status(run_dir: Path, require_running: bool = True) -> dict[str, Any]:
    """The latest status snapshot of the run in ``run_dir``."""
    paths = RunPaths(run_dir)
    if not paths.root.is_dir():
        raise RunNotRunning(f"{run_dir} is not a run directory: pass the --run-dir of `astraflow run`")
    if not paths.orchestrator_file.exists() or not paths.status_file.exists():
        if paths.summary.exists():
            raise RunNotRunning(f"the run in {run_dir} has finished; its final state is in {paths.summary}")
        raise RunNotRunning(f"no run has started in {run_dir} yet (no {paths.status_file.name})")
    info = json.loads(paths.orchestrator_file.read_text())
    status = json.loads(paths.status_file.read_text())
    age = time.time() - status.get("written_at", 0)
    running = _alive(info) and age < STALE_AFTER_S and not paths.summary.exists()
    status["running"] = running
    status["orchestrator"] = info
    if require_running and not running:
        hint = f"its final state is in {paths.summary}" if paths.summary.exists() else "it stopped without a summary"
        raise RunNotRunning(f"the run in {run_dir} is not running ({hint})")
    return status


def format_status(st: dict[str, Any]) -> str:
    dl = st.get("data_layer", {})
    lines = [
        f"run {st.get('run_dir')}  elapsed {dl.get('elapsed_s', 0):.0f}s  dashboard {st['orchestrator'].get('dashboard')}",
        "policies:",
    ]
    for p, t in st.get("trainers", {}).items():
        m = t.get("last_metrics", {})
        lines.append(
            f"  {p:<12} version {t['version']:>4}  reward {m.get('reward_mean', float('nan')):.3f}  "
            f"wait {t.get('wait_fraction', 0):.0%}  buffer {dl.get('buffers', {}).get(p, 0)}"
        )
    lines.append("partitions:")
    for name, part in st.get("partitions", {}).items():
        lines.append(f"  {name:<12} {part['scheduler']:<6} role {part['role']:<8} desired {part['nodes']}  live {part['live']}")
    lines.append("workers:")
    for name, w in st.get("workers", {}).items():
        node = dl.get("nodes", {}).get(name, {})
        lines.append(
            f"  {name:<36} {w['job_id']:<14} {w['state']:<9} versions {node.get('versions', '-')}  "
            f"{node.get('tokens_per_s', 0):.0f} tok/s"
        )
    lines.append(
        f"throughput: {dl.get('trajectories_per_s', 0):.1f} traj/s, {dl.get('tokens_per_s', 0):.0f} tok/s; "
        f"ledger {dl.get('ledger', {}).get('states', {})}"
    )
    evals = dl.get("eval", [])
    if evals:
        lines.append("held-out accuracy: " + ", ".join(f"v{e['step']}={e['eval_accuracy']:.3f}" for e in evals))
    return "\n".join(lines)
