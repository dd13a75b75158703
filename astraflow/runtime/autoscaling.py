"""Runtime room: the autoscaler in the orchestrator's loop.

Each tick `AutoscaleDriver.step` reads the signals the run already has from that tick's `Tick`
(each trainer's ``wait_total_s``; the data layer's ``stale_dropped`` and ``consumed`` counts),
hands them with the autoscaled partitions to the pure `Autoscaler`, and applies an add or a
drain the way ``astraflow partitions`` changes a run: it writes the partition's new ``nodes``
into ``control/partitions.json`` (`control.set_partition_nodes`), which the next reconcile
turns into submitted workers, or into drains of the newest ones (`reconcile`).

Every change is noted in the run's output and logged (with its reason and signal values),
appended to ``control/autoscale.jsonl``, and shown in ``status.json`` (``autoscale``: the
latest decision, hold or not, and the recent changes), hence on the dashboard page and in
``astraflow status``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from astraflow.runtime.autoscale import Autoscaler, Decision, Sample, Slot
from astraflow.runtime.control import PartitionError, set_partition_nodes
from astraflow.sections import AutoscaleConfig
from storage.paths import RunPaths

if TYPE_CHECKING:
    from astraflow.config import RunConfig
    from astraflow.runtime.monitoring import Tick
    from astraflow.runtime.progress import Progress
    from astraflow.runtime.reconcile import PartitionSet
    from astraflow.runtime.workers import Fleet

log = logging.getLogger("astraflow.runtime")

#: changes kept for the status (all of them are in ``control/autoscale.jsonl``)
RECENT = 20

#: the fields of a change as ``Decision.as_dict`` writes it (the status's views read exactly these)
RECORD_KEYS = {"t", "action", "partition", "count", "desired", "target", "reason", "signals"}

#: worker phases of a change that has not settled yet
SETTLING = ("submitted", "placing", "starting", "draining")


def sample_of(tick: Tick, now: float, since: dict[str, int] | None = None) -> Sample:
    """The autoscaler's counters in one tick: trainers still training, all policies' counts.
    ``since``: each policy's version when the autoscaler first saw its trainer (a resumed run's
    trainers start past v0): started once every training one has taken a step past it."""
    since = since or {}
    counts = tick.data_layer.get("counts", {})
    return Sample(
        t=now,
        wait_s={p: float(st.get("wait_total_s", st.get("wait_s", 0.0))) for p, st in tick.trainers.items()
                if not st.get("done")},
        stale_dropped=sum(int(c.get("stale_dropped", 0)) for c in counts.values()),
        consumed=sum(int(c.get("consumed", 0)) for c in counts.values()),
        started=all(int(st.get("version", 0)) > since.get(p, 0)
                    for p, st in tick.trainers.items() if not st.get("done")),
    )


def logged_changes(paths: RunPaths) -> list[dict[str, Any]]:
    """The changes ``control/autoscale.jsonl`` holds, oldest first (none without the file; a
    damaged line, such as one cut short by a killed run, is left out)."""
    try:
        lines = paths.autoscale_log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines[-4 * RECENT:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and set(record) == RECORD_KEYS and record["action"] in ("add", "drain"):
            out.append(record)
    return out


class AutoscaleDriver:
    """Feeds the `Autoscaler` each tick and applies its decisions (module docstring)."""

    def __init__(self, cfg: AutoscaleConfig, paths: RunPaths, parts: PartitionSet, fleet: Fleet,
                 progress: Progress):
        self.cfg = cfg
        self.paths = paths
        self.parts = parts
        self.fleet = fleet
        self.progress = progress
        self.scaler = Autoscaler(cfg)
        self.last: Decision | None = None
        # a resumed run (a requeued job) goes on showing the changes the runs before it made
        self.changes: deque[dict[str, Any]] = deque(logged_changes(paths), maxlen=RECENT)
        if parts is not None:
            self._note_resumed_sizes()
        #: each policy's version when its trainer was first seen: the start-up waits of a resumed
        #: run (its trainers past v0 from the start) are not a signal either
        self.first_versions: dict[str, int] = {}

    def _note_resumed_sizes(self) -> None:
        """A resumed run starts each partition at its config's ``nodes``: say so where the
        autoscaler had left one at another size (it scales from the config's size again)."""
        last = {c["partition"]: c["target"] for c in self.changes}
        for name, target in last.items():
            part = self.parts.partitions.get(name)
            if part is not None and part.autoscale is not None and part.nodes != target:
                self.progress.note(f"autoscale: partition {name} resumes at its config's {part.nodes} node(s); the "
                                   f"autoscaler had it at {target} before, and scales it from {part.nodes} again")

    def slots(self, now: float | None = None) -> list[Slot]:
        """The active rollout partitions with bounds, in the desired set's order; a worker still
        starting or draining, or one not even submitted yet, counts as settling; one submitted
        longer ago than ``cluster.worker_start_timeout_s`` and not joined (a queue that holds it)
        as stuck: the autoscaler grows another partition rather than wait for it for ever."""
        now = time.time() if now is None else now
        deadline = self.parts.cluster.worker_start_timeout_s
        out = []
        for name, part in self.parts.partitions.items():
            if part.autoscale is None or part.role != "rollout" or self.parts.state[name].state != "active":
                continue
            mine = [w for w in self.fleet.in_partition(name) if not w.gone]
            stuck = sum(1 for w in mine if w.phase == "submitted" and now - w.since > deadline)
            settling = sum(1 for w in mine if w.phase in SETTLING) - stuck
            shrunk = self.parts.state[name].shrunk_at
            if shrunk is not None and now - shrunk < self.cfg.memory_period_s:
                stuck = max(stuck, 1)  # its added workers kept failing: not grown again for a while
            unsubmitted = part.nodes - sum(1 for w in mine if not w.draining)  # e.g. refill backoff after a failure
            out.append(Slot(name, part.nodes, part.autoscale, settling + max(unsubmitted, 0), stuck))
        return out

    def fixed(self) -> int:
        """Workers wanted in the active rollout partitions without bounds, and those still serving
        in failed ones (not refilled, yet they roll out): they count in the pool size the
        autoscaler remembers, and a pool with them is not empty."""
        wanted = sum(p.nodes for name, p in self.parts.partitions.items()
                     if p.role == "rollout" and p.autoscale is None and self.parts.state[name].state == "active")
        left = sum(1 for name, p in self.parts.partitions.items()
                   if p.role == "rollout" and self.parts.state[name].state == "failed"
                   for w in self.fleet.in_partition(name) if not w.gone and not w.draining)
        return wanted + left

    def others_settling(self, now: float) -> int:
        """Workers of the rollout partitions without bounds, or no longer active (added or removed
        by hand), still placing, starting or draining, or submitted within the start deadline: the
        window's evidence predates them, and the pool size it would be remembered at is not the one
        that served. One a queue holds past the deadline is not waited for."""
        deadline = self.parts.cluster.worker_start_timeout_s
        scaled = {s.name for s in self.slots(now)}
        return sum(1 for name, p in self.parts.partitions.items() if p.role == "rollout" and name not in scaled
                   for w in self.fleet.in_partition(name)
                   if w.phase in SETTLING and not (w.phase == "submitted" and now - w.since > deadline))

    def step(self, tick: Tick, now: float | None = None) -> Decision:
        """Observe this tick (at the time it was read), decide, apply a change. Returns the decision."""
        now = tick.read_at if now is None else now
        for policy, st in tick.trainers.items():
            self.first_versions.setdefault(policy, int(st.get("version", 0)))
        self.scaler.observe(sample_of(tick, now, self.first_versions))
        decision = self.scaler.decide(now, self.slots(now), self.fixed(), self.others_settling(now))
        if decision.action != "hold":
            decision = self._apply(decision)
        self.last = decision
        return decision

    def _apply(self, d: Decision) -> Decision:
        """Write the partition's new ``nodes``; a failed write becomes a hold saying why."""
        try:
            written = set_partition_nodes(self.paths, d.partition, d.target)
        except (PartitionError, ValueError, OSError) as err:
            written, why = None, f"{type(err).__name__}: {err}"
        else:
            why = "it left the desired partitions"
        if written is None:
            self.progress.note(f"autoscale: could not {d.action} workers of {d.partition} ({why})")
            return Decision("hold", f"{d.reason}; not applied: {why}", d.signals, d.t)
        record = d.as_dict()
        self.changes.append(record)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in d.signals.items() if v is not None)
        self.progress.note(f"autoscale: {d.reason} (signals: {shown})")
        log.info("autoscale: %s", json.dumps(record))
        self.paths.control.mkdir(parents=True, exist_ok=True)
        with open(self.paths.autoscale_log, "a") as f:
            f.write(json.dumps(record) + "\n")
        return d

    def status(self) -> dict[str, Any]:
        """The ``autoscale`` entry of ``status.json``: the settings, the latest decision and signals,
        and the recent changes (oldest first)."""
        return {
            "config": self.cfg.model_dump(mode="json"),
            "last": self.last.as_dict() if self.last else None,
            "changes": list(self.changes),
        }


def autoscale_driver(cfg: RunConfig, paths: RunPaths, parts: PartitionSet, fleet: Fleet,
                     progress: Progress) -> AutoscaleDriver | None:
    """The run's driver; None when the config has no enabled ``autoscale`` section (bounds of
    a disabled one are ignored, which is noted)."""
    if cfg.autoscale is None:
        return None
    if not cfg.autoscale.enabled:
        bounded = [p.name for p in cfg.partitions if p.autoscale is not None]
        if bounded:
            progress.note(f"autoscale.enabled is false: the autoscale bounds of {bounded} are ignored")
        return None
    return AutoscaleDriver(cfg.autoscale, paths, parts, fleet, progress)
