"""Runtime room: changing a running run through its run directory.

The CLI (and the orchestrator's autoscaler, `set_partition_nodes`) changes a run only by writing
its desired partitions (``control/partitions.json``),
which the orchestrator reconciles on its next tick and reports back in ``control/status.json``
(read through `astraflow.runtime.monitoring`). Nothing here needs a connection to the cluster,
so ``astraflow partitions`` works from any login node that sees the shared run directory.

The desired-partitions file::

    {"partitions": [<Partition fields>...], "removals": {"<name>": "drain" | "now"}}

``partitions`` is the desired set (the config's partitions at start, then whatever
``astraflow partitions add/remove`` made of it); ``removals`` says how each partition that
left the set is to be stopped. Writers hold ``control/partitions.lock`` (flock) for the whole
read-modify-write and publish with an atomic rename, so the orchestrator, which only reads,
never sees a partial file and two CLI calls never lose each other's change.

A partition's ``env`` and ``sbatch_options`` must pass the run's allowlists
(`schedulers.policy`): `add_partition` checks them against the run's saved config, and the
orchestrator checks every partition it reads from the file against its own config.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args

from astraflow.partition_settings import check_partition, effective_rollout
from astraflow.rollout.config import RolloutConfig
from astraflow.runtime.monitoring.snapshot import run_status
from schedulers.partition import Partition
from schedulers.policy import WorkerPolicy
from storage.atomic import read_json_object, write_json
from storage.ownership import check_owner_only
from storage.paths import RunPaths

# -- desired partitions (written by the CLI, read by the orchestrator) ------------------------

RemovalMode = Literal["drain", "now"]
"""How a partition leaves a running run (see `REMOVAL_HELP`)."""
REMOVAL_MODES: tuple[str, ...] = get_args(RemovalMode)
DEFAULT_REMOVAL: RemovalMode = "drain"
REMOVAL_HELP: dict[str, str] = {
    "drain": "nodes stop leasing and finish what they hold, then the jobs are cancelled",
    "now": "cancel the jobs at once; their leased tasks are requeued",
}
assert set(REMOVAL_HELP) == set(REMOVAL_MODES)


class PartitionError(ValueError):
    """A partitions request that cannot be applied (unknown name, duplicate, wrong role)."""


def write_desired(paths: RunPaths, partitions: list[Partition], removals: dict[str, str] | None = None) -> None:
    """Publish the desired partitions atomically (callers that read first hold `desired_lock`)."""
    data = {"partitions": [p.model_dump(mode="json") for p in partitions], "removals": dict(removals or {})}
    write_json(paths.desired_partitions, data, indent=2)


def read_desired_file(paths: RunPaths) -> tuple[dict[str, Partition], dict[str, str]]:
    """The desired partitions by name and the removal mode of each removed one. A damaged file
    raises `PartitionError` naming it (the orchestrator then keeps the partitions it has)."""
    f = paths.desired_partitions
    if not f.exists():
        return {}, {}
    try:
        data = read_json_object(f)
        entries, removals = data.get("partitions", []), data.get("removals", {})
        if not isinstance(entries, list) or not isinstance(removals, dict):
            raise ValueError("'partitions' must be a list and 'removals' a mapping")
        parts = {}
        for entry in entries:
            part = Partition.model_validate(entry)  # a ValidationError is a ValueError
            parts[part.name] = part
        bad = {k: v for k, v in removals.items() if v not in REMOVAL_MODES}
        if bad:
            raise ValueError(f"removal modes {bad}: use one of {REMOVAL_MODES}")
    except ValueError as err:
        raise PartitionError(
            f"{f} is not a valid desired-partitions file ({' '.join(str(err).split())[:300]}); the running run "
            "ignores it and keeps its partitions. Restore it as {\"partitions\": [...], \"removals\": {}} with "
            "the entries `astraflow partitions list --json` shows"
        ) from None
    return parts, {str(k): str(v) for k, v in removals.items()}


def run_worker_policy(paths: RunPaths) -> WorkerPolicy:
    """The allowlists of the run's saved config (``<run>/config.yaml``); the defaults when the run
    has no saved config or its config leaves them out. Raises `PartitionError` for a config that
    cannot be read or whose allowlists are invalid."""
    import yaml

    f = paths.config
    if not f.exists():
        return WorkerPolicy()
    try:
        data = yaml.safe_load(f.read_bytes().decode("utf-8")) or {}
        cluster = data.get("cluster") if isinstance(data, dict) else None
        cluster = cluster if isinstance(cluster, dict) else {}
        return WorkerPolicy.of(cluster.get("worker_env_allowlist"), cluster.get("sbatch_options_allowlist"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError, TypeError) as err:
        raise PartitionError(
            f"{f}: the run's allowlists (cluster.worker_env_allowlist, cluster.sbatch_options_allowlist) cannot "
            f"be read from it ({' '.join(str(err).split())[:300]}); restore the run's config"
        ) from None


def run_rollout(paths: RunPaths) -> RolloutConfig:
    """The ``rollout`` section of the run's saved config (the defaults when it has none).
    Raises `PartitionError` for a config that cannot be read."""
    import yaml

    f = paths.config
    try:
        data = (yaml.safe_load(f.read_bytes().decode("utf-8")) or {}) if f.exists() else {}
        section = data.get("rollout") if isinstance(data, dict) else None
        return RolloutConfig.model_validate(section if isinstance(section, dict) else {})
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as err:
        raise PartitionError(f"{f}: the run's rollout section cannot be read from it "
                             f"({' '.join(str(err).split())[:300]}); restore the run's config") from None


def run_autoscales(paths: RunPaths) -> bool:
    """Whether the run's saved config has an enabled ``autoscale`` section (False without a config)."""
    import yaml

    f = paths.config
    try:
        data = (yaml.safe_load(f.read_bytes().decode("utf-8")) or {}) if f.exists() else {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise PartitionError(f"{f}: the run's autoscale section cannot be read from it "
                             f"({' '.join(str(err).split())[:300]}); restore the run's config") from None
    section = data.get("autoscale") if isinstance(data, dict) else None
    return isinstance(section, dict) and section.get("enabled", True) is not False


@contextlib.contextmanager
def desired_lock(paths: RunPaths, timeout: float = 10.0) -> Iterator[None]:
    """Exclusive lock for a read-modify-write of the desired file (deadline: `timeout`)."""
    paths.control.mkdir(parents=True, exist_ok=True)
    with open(paths.partitions_lock, "w") as fh:
        deadline = time.time() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    raise PartitionError(
                        f"another `astraflow partitions` call holds {paths.partitions_lock} "
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
    Raises `UnsafeRunDir` (other users can change the run directory), `RunNotRunning` or
    `PartitionError` (a duplicate name, a wrong role, an env variable or sbatch option outside
    the run's allowlists, ``rollout:`` settings that do not fit the run's rollout section,
    autoscale bounds in a run without an enabled autoscaler).
    """
    check_owner_only(run_dir)
    run_status(run_dir)
    if part.role != "rollout":
        raise PartitionError(
            f"partition {part.name!r} has role {part.role!r}: only rollout partitions can be added to a "
            "running run (data and trainer workers are placed when the run starts; put them in the config)"
        )
    paths = RunPaths(run_dir)
    problems = run_worker_policy(paths).problems(part)
    if problems:
        raise PartitionError("partition refused:\n  " + "\n  ".join(problems))
    try:  # its ``rollout:`` settings over the run's own rollout section
        rollout = run_rollout(paths)
        check_partition(part, rollout, {})
        if effective_rollout(rollout, part).engine.type == "vllm":  # its nodes would fail to start
            from astraflow.rollout.vllm_setup import require_vllm

            require_vllm(f"partition {part.name}: rollout.engine.type")
    except ValueError as err:
        raise PartitionError(f"partition refused: {err}") from None
    if part.autoscale is not None and not run_autoscales(paths):
        raise PartitionError(f"partition {part.name!r} has autoscale bounds but the run has no enabled autoscale "
                             "section, so nothing would scale it: remove the bounds (or start the run with one)")
    with desired_lock(paths):
        parts, removals = read_desired_file(paths)
        if part.name in parts:
            raise PartitionError(
                f"partition {part.name!r} already exists in this run: choose another name or remove it first"
            )
        status = read_json_object(paths.status_file)
        old = status.get("partitions", {}).get(part.name)
        if old is not None and old.get("state") != "removed":
            raise PartitionError(  # its removal was asked for; its workers still drain
                f"partition {part.name!r} is being removed ({old.get('state')}): add it again once "
                f"`astraflow partitions list RUN_DIR` shows it removed, or choose another name"
            )
        removals.pop(part.name, None)
        write_desired(paths, [*parts.values(), part], removals)


def remove_partition(run_dir: Path, name: str, mode: RemovalMode = DEFAULT_REMOVAL, *,
                     keep_one: bool = True) -> Partition:
    """Remove partition `name` from the desired set (`mode`: one of `REMOVAL_MODES`); returns it.
    ``keep_one``: refuse to remove the run's last rollout partition that serves (off for
    withdrawing one that never served). Raises like `add_partition`."""
    if mode not in REMOVAL_MODES:
        raise PartitionError(f"removal mode {mode!r}: use one of {REMOVAL_MODES}")
    check_owner_only(run_dir)
    states = {n: (p or {}).get("state") for n, p in ((run_status(run_dir).get("partitions") or {}).items())}
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
        # another that serves: with nodes, and not failed (a 0-node or failed one generates nothing)
        if keep_one and not any(p.role == "rollout" and p.nodes > 0 and states.get(n) != "failed"
                                for n, p in parts.items()):
            raise PartitionError(f"partition {name!r} is the run's last rollout partition with nodes: without one "
                                 "the trainers wait for rollouts until run.timeout_s; add another first (partitions "
                                 "add), or stop the run")
        removals[name] = mode
        write_desired(paths, list(parts.values()), removals)
    return part


def set_partition_nodes(paths: RunPaths, name: str, nodes: int) -> Partition | None:
    """Set ``nodes`` of the desired partition ``name`` (the autoscaler's change; the orchestrator
    reconciles it like an added or removed partition: workers submitted, or the newest drained).
    Returns the partition as written; None when it is no longer in the desired set. Raises
    `PartitionError` when the file is damaged or locked, ValueError when ``nodes`` leaves its
    autoscale bounds."""
    with desired_lock(paths):
        parts, removals = read_desired_file(paths)
        if name not in parts:
            return None
        part = parts[name] = Partition.model_validate({**parts[name].model_dump(), "nodes": nodes})
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
        if entry.get("state") == "removed" and until != "removed":
            entry = {}  # an earlier partition of that name: this one is not seen yet
        if entry.get("error") and until != "removed":
            return entry
        if until == "submitted" and entry.get("jobs"):
            return entry
        if until == "serving" and entry.get("serving", 0) > 0:
            return entry
        if until == "removed" and entry.get("state") == "removed":
            return entry
        if time.time() > deadline:
            queued = [f"{w.get('job_id')} ({w['reason']})" for w in (st.get("workers") or {}).values()
                      if w.get("partition") == name and w.get("reason")]
            raise TimeoutError(
                f"partition {name!r} not {until} within {timeout:.0f}s (state {entry.get('state', 'not seen yet')})"
                + (f"; its job(s) wait in the Slurm queue: {', '.join(queued)}" if queued else "")
                + "; check `astraflow status` again"
            )
        time.sleep(0.2)
