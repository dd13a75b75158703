"""Talking to a running run through its run directory.

The orchestrator writes ``control/orchestrator.json`` (pid, host, dashboard) once and
``control/status.json`` every tick; the CLI reads them, and changes a run only by writing its
desired partitions (``control/partitions.json``), which the orchestrator reconciles. Nothing
here needs a connection to the cluster, so ``astraflow status`` works from any login node that
sees the shared run directory.

The desired-partitions file is the only way the CLI changes a run::

    {"partitions": [<Partition fields>...], "removals": {"<name>": "drain" | "now"}}

``partitions`` is the desired set (the config's partitions at start, then whatever
``astraflow partitions add/remove`` made of it); ``removals`` says how each partition that
left the set is to be stopped. Writers hold ``control/partitions.lock`` (flock) for the whole
read-modify-write and publish with an atomic rename, so the orchestrator, which only reads,
never sees a partial file and two CLI calls never lose each other's change.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from schedulers.partition import Partition
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


# -- desired partitions (written by the CLI, read by the orchestrator) ------------------------

REMOVAL_MODES = ("drain", "now")


class PartitionError(ValueError):
    """A partitions request that cannot be applied (unknown name, duplicate, wrong role)."""


def write_desired(paths: RunPaths, partitions: list[Partition], removals: dict[str, str] | None = None) -> None:
    """Publish the desired partitions atomically (callers that read first hold `desired_lock`)."""
    data = {"partitions": [p.model_dump(mode="json") for p in partitions], "removals": dict(removals or {})}
    write_json_atomic(paths.desired_partitions, data)


def read_desired_file(paths: RunPaths) -> tuple[dict[str, Partition], dict[str, str]]:
    """The desired partitions by name and the removal mode of each removed one."""
    f = paths.desired_partitions
    if not f.exists():
        return {}, {}
    data = json.loads(f.read_text())
    parts = {p["name"]: Partition.model_validate(p) for p in data.get("partitions", [])}
    return parts, dict(data.get("removals", {}))


@contextlib.contextmanager
def desired_lock(paths: RunPaths, timeout: float = 10.0) -> Iterator[None]:
    """Exclusive lock for a read-modify-write of the desired file (deadline: `timeout`)."""
    paths.control.mkdir(parents=True, exist_ok=True)
    with open(paths.control / "partitions.lock", "w") as fh:
        deadline = time.time() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    raise PartitionError(
                        f"another `astraflow partitions` call holds {paths.control / 'partitions.lock'} "
                        f"for more than {timeout:.0f}s: wait for it, or remove the lock file if no such call runs"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def add_partition(run_dir: Path, part: Partition) -> None:
    """Add `part` to the desired set of the running run in `run_dir`.

    Only rollout partitions can join a running run (data and trainer are placed at start).
    Raises `RunNotRunning` or `PartitionError` (a duplicate name, a wrong role).
    """
    run_status(run_dir)
    if part.role != "rollout":
        raise PartitionError(
            f"partition {part.name!r} has role {part.role!r}: only rollout partitions can be added to a "
            "running run (data and trainer workers are placed when the run starts; put them in the config)"
        )
    paths = RunPaths(run_dir)
    with desired_lock(paths):
        parts, removals = read_desired_file(paths)
        if part.name in parts:
            raise PartitionError(
                f"partition {part.name!r} already exists in this run: choose another name or remove it first"
            )
        status = json.loads(paths.status_file.read_text())
        old = status.get("partitions", {}).get(part.name)
        if old is not None and old.get("state") not in ("removed", "failed"):
            raise PartitionError(
                f"partition {part.name!r} is still being removed ({old.get('state')}): wait until "
                "`astraflow partitions list` shows it removed, or choose another name"
            )
        removals.pop(part.name, None)
        write_desired(paths, [*parts.values(), part], removals)


def remove_partition(run_dir: Path, name: str, mode: str = "drain") -> Partition:
    """Remove partition `name` from the desired set (`mode`: ``drain`` or ``now``); returns it."""
    if mode not in REMOVAL_MODES:
        raise PartitionError(f"removal mode {mode!r}: use one of {REMOVAL_MODES}")
    run_status(run_dir)
    paths = RunPaths(run_dir)
    with desired_lock(paths):
        parts, removals = read_desired_file(paths)
        if name not in parts:
            known = ", ".join(sorted(parts)) or "none"
            raise PartitionError(f"no partition {name!r} in this run: known partitions are {known}")
        part = parts.pop(name)
        if part.role != "rollout":
            raise PartitionError(
                f"partition {name!r} has role {part.role!r}: only rollout partitions can be removed from a "
                "running run (stop the run to remove the data layer or a trainer)"
            )
        removals[name] = mode
        write_desired(paths, list(parts.values()), removals)
    return part


def wait_partition(run_dir: Path, name: str, timeout: float, until: str = "submitted") -> dict[str, Any]:
    """Poll status.json until the orchestrator acted on partition `name`: its jobs were
    submitted (`until="submitted"`), a worker serves (``"serving"``), or it was removed
    (``"removed"``); returns its status entry, which has ``error`` set when sbatch refused it.
    Raises TimeoutError after `timeout` seconds (the run may simply be slow to tick)."""
    deadline = time.time() + timeout
    entry: dict[str, Any] = {}
    while True:
        st = run_status(run_dir)
        entry = st.get("partitions", {}).get(name) or {}
        if entry.get("error"):
            return entry
        if until == "submitted" and entry.get("jobs"):
            return entry
        if until == "serving" and entry.get("serving", 0) > 0:
            return entry
        if until == "removed" and entry.get("state") == "removed":
            return entry
        if time.time() > deadline:
            raise TimeoutError(
                f"partition {name!r} not {until} within {timeout:.0f}s (state {entry.get('state', 'not seen yet')}); "
                "check `astraflow status` again"
            )
        time.sleep(0.2)


def format_partitions(st: dict[str, Any]) -> str:
    """One line per partition: kind, role, state, desired/live/serving workers, rate, error."""
    lines = [f"{'partition':<14} {'scheduler':<9} {'slurm':<8} {'role':<8} {'state':<9} "
             f"{'desired':>7} {'live':>4} {'serving':>7} {'traj':>6} {'traj/s':>6}  jobs"]
    for name, p in st.get("partitions", {}).items():
        jobs = " ".join(f"{j}:{s}" for j, s in p.get("jobs", {}).items()) or "-"
        lines.append(
            f"{name:<14} {p['scheduler']:<9} {p.get('slurm_partition') or '-':<8} {p['role']:<8} "
            f"{p.get('state', '?'):<9} {p['nodes']:>7} {p.get('live', 0):>4} {p.get('serving', 0):>7} "
            f"{p.get('completed', 0):>6} {p.get('trajectories_per_s', 0.0):>6.1f}  {jobs}"
        )
        if p.get("error"):
            lines.append(f"  error: {p['error']}")
    return "\n".join(lines)


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
    lines += ["  " + x for x in format_partitions(st).splitlines()]
    lines.append("workers:")
    for name, w in st.get("workers", {}).items():
        node = dl.get("nodes", {}).get(name, {})
        lines.append(
            f"  {name:<36} {w['job_id']:<14} {w['state']:<9} {w.get('phase', '-'):<9} "
            f"versions {node.get('versions', '-')}  {node.get('completed', 0)} traj  "
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
