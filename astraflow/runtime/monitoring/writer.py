"""Monitoring room: what the orchestrator writes about a run, in one place with its readers.

Each tick the orchestrator reads one `Tick` (the data layer's state and every trainer's) and
hands it to the terminal progress and to `StatusWriter.write` (``control/status.json``); at
the end `StatusWriter.write_summary` writes ``summary.json``. The partition table of both adds
what the orchestrator knows (states, live/serving workers, jobs) to the data layer's per-node
counts (`partition_stats`): trajectory and token rates over the last ~10 s, the staleness of
what its nodes generated and the trainers consumed, the versions its nodes serve.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from astraflow.runtime.monitoring.partition_stats import (ZERO_COUNTS, partition_counts, partition_versions,
                                                          staleness_summary)
from astraflow.runtime.monitoring.snapshot import write_status, write_summary
from storage.paths import RunPaths

if TYPE_CHECKING:
    from astraflow.runtime.reconcile import PartitionSet
    from astraflow.runtime.workers import Fleet
    from schedulers import JobStatus

#: seconds of history behind a partition's ``episodes_per_s``
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class Tick:
    """What the orchestrator reads from the components once per tick."""

    data_layer: dict[str, Any]
    """``DataLayer.state()``: versions, buffers, counts, ledger, per-node table, evaluations."""
    trainers: dict[str, dict[str, Any]]
    """``Trainer.state()`` per policy: version, done, error, last metrics, wait fraction."""
    read_at: float = field(default_factory=time.time)
    """When the data layer's state was read: the time its counts are rated at, however long the
    orchestrator's tick took before it tracked them (a blocking job submission, say)."""


#: evaluation records per policy that the status file carries (summary.json and metrics.jsonl
#: keep every one): what status and the dashboard show is the latest
STATUS_EVALS = 20


def recent_evals(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last ``STATUS_EVALS`` evaluation records of each policy, in their order."""
    seen: dict[Any, int] = {}
    keep = []
    for e in reversed(evals):
        p = e.get("policy") if isinstance(e, dict) else None
        seen[p] = seen.get(p, 0) + 1
        if seen[p] <= STATUS_EVALS:
            keep.append(e)
    return keep[::-1]


def job_placement(st: JobStatus | None, gone: bool) -> dict[str, str | None]:
    """Where a worker's job runs (``host``: the scheduler's node) and why it waits (``reason``:
    Slurm's, e.g. ``Resources`` or ``ReqNodeNotAvail``): what an operator otherwise looks up
    with ``squeue`` for a worker that stays PENDING. Both None once the worker is gone."""
    if st is None or gone or not st.active:
        return {"host": None, "reason": None}
    return {"host": st.node, "reason": st.reason if st.state == "PENDING" else None}


class StatusWriter:
    """Builds and writes ``control/status.json`` and ``summary.json`` of one run."""

    def __init__(self, paths: RunPaths, tag: str, parts: PartitionSet, fleet: Fleet):
        self.paths = paths
        self.tag = tag
        self.parts = parts
        self.fleet = fleet
        self._rates: deque[tuple[float, dict[str, int]]] = deque()
        #: the trainers' restarts per policy (set by the orchestrator; ``TrainerRestarts.record``)
        self.trainer_restarts: Callable[[], dict[str, Any]] = dict
        #: the data layer's re-placements (``DataLayerRestarts.record``)
        self.data_layer_restarts: Callable[[], dict[str, Any]] = dict
        #: the previous incarnation's worker jobs cancelled at start (``PreviousJobs.as_dict``)
        self.previous_jobs: dict[str, Any] = {"cancelled": [], "errors": {}}
        #: a rollout partition's capacity and engine batch by name (``partition_capacity``; None: unknown)
        self.capacity: Callable[[str], dict[str, int] | None] = lambda name: None
        #: the autoscaler's status entry (``AutoscaleDriver.status``; None: no autoscaler)
        self.autoscale: Callable[[], dict[str, Any] | None] = lambda: None
        #: free space on the run's filesystems (``DiskWatch.view``)
        self.disk: Callable[[], list[dict[str, Any]]] = list
        #: per partition: the weight versions its live nodes serve, per policy
        self._versions: dict[str, dict[str, list[int]]] = {}
        #: the last status written (``alive_while`` writes it again)
        self._last: dict[str, Any] | None = None

    def track(self, tick: Tick) -> None:
        """Per-partition counts from the data layer's node table (`partition_counts`), and the
        history the rates are computed from (the throughput `astraflow status` and the
        benchmarks report)."""
        counts = partition_counts(tick.data_layer, self.fleet, list(self.parts.partitions))
        now = tick.read_at
        for name, c in counts.items():
            ps = self.parts.state.get(name)
            if ps is not None and c["completed"] > 0 and ps.first_trajectory_at is None:
                ps.first_trajectory_at = now
        self._rates.append((now, counts))
        while len(self._rates) > 2 and now - self._rates[1][0] >= RATE_WINDOW_S:
            self._rates.popleft()
        self._versions = partition_versions(tick.data_layer, self.fleet)

    def partitions(self) -> dict[str, Any]:
        """The partition table: each partition's spec, state, workers, jobs and rate."""
        out = {}
        t1, last = self._rates[-1] if self._rates else (time.time(), {})
        t0, first = self._rates[0] if self._rates else (t1, {})
        for n, p in self.parts.partitions.items():
            ps = self.parts.state[n]
            mine = self.fleet.in_partition(n)
            now_c, then_c = last.get(n) or ZERO_COUNTS, first.get(n) or ZERO_COUNTS
            window = t1 - t0 if t1 > t0 and ps.state != "removed" else 0.0  # a removed one generates nothing
            rate = (now_c["completed"] - then_c["completed"]) / window if window else 0.0
            tok_rate = max(now_c["tokens"] - then_c["tokens"], 0) / window if window else 0.0
            out[n] = {
                **p.model_dump(mode="json"),
                "state": ps.state,
                "error": ps.error,
                "failures": ps.failures,
                "refill_in_s": max(ps.refill_at - time.time(), 0.0) if ps.refill_at and ps.state == "active" else None,
                "live": sum(1 for w in mine if not w.gone),
                "serving": sum(1 for w in mine if w.phase == "serving"),
                "draining": sum(1 for w in mine if w.draining),
                "workers": [w.name for w in mine if not w.gone],
                "jobs": {w.job.job_id: self.fleet.job_state(w) for w in mine if not w.gone},
                "completed": now_c["completed"],
                "episodes_per_s": rate,
                "tokens_per_s": tok_rate,
                **staleness_summary(now_c["staleness"]),
                "versions": self._versions.get(n, {}),
                "capacity": self.capacity(n),
                "seen_at": ps.seen_at,
                "first_trajectory_at": ps.first_trajectory_at,
                "removal_mode": ps.removal_mode,
                "removal_requested_at": ps.removal_requested_at,
                "removed_at": ps.removed_at,
                "drain_seconds": ((ps.removed_at - ps.removal_requested_at)
                                  if ps.removed_at and ps.removal_requested_at else None),
            }
        return out

    @contextlib.contextmanager
    def alive_while(self, what: str, every_s: float = 5.0) -> Iterator[None]:
        """While a long step of the orchestrator's own runs (a trainer's or the data layer's
        restart: placing a worker, loading a model), the last status is written again every
        ``every_s`` seconds (and once at the start) with ``waiting`` naming the step: the run is not
        taken for stopped, and says what it is doing."""
        if self._last is None:  # no status yet: `status` says the run is starting
            yield
            return
        stop, t0 = threading.Event(), time.time()

        def beat() -> None:
            while True:
                with contextlib.suppress(OSError):  # a full disk must not end the restart
                    write_status(self.paths, {**self._last, "written_at": time.time(),
                                              "waiting": {"what": what, "since": t0}})
                if stop.wait(every_s):
                    return

        keeper = threading.Thread(target=beat, name="astraflow-status-keepalive", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            stop.set()
            keeper.join(every_s + 5.0)

    def write(self, tick: Tick) -> None:
        """Publish ``control/status.json`` (what `read_snapshot` reads back)."""
        fleet = self.fleet
        self._last = {
            "written_at": time.time(),
            "run_dir": str(self.paths.root),
            "tag": self.tag,
            "data_layer": {**tick.data_layer, "eval": recent_evals(tick.data_layer.get("eval", []))},
            "trainers": tick.trainers,
            "trainer_restarts": self.trainer_restarts(),
            "data_layer_restarts": self.data_layer_restarts(),
            "previous_jobs": self.previous_jobs,
            "partitions": self.partitions(),
            "autoscale": self.autoscale(),
            "disk": self.disk(),
            "workers": {
                n: {"job_id": w.job.job_id, "partition": w.partition, "kind": w.job.kind,
                    "state": fleet.job_state(w), "phase": w.phase, "note": w.note,
                    "draining": w.draining, "actor": w.has_actor, "log": str(w.job.log) if w.job.log else None,
                    **job_placement(fleet.jobs.get(w.job.job_id), w.gone)}
                for n, w in fleet.workers.items()
            },
        }
        write_status(self.paths, self._last)

    def write_summary(self, *, ending: Any, steps: dict[str, int], ledger: dict[str, Any], ledger_closed: bool,
                      seconds: float, nodes: dict[str, Any], trainers: dict[str, Any], data_layer: dict[str, Any],
                      iterations: list[dict[str, float]], stop_errors: dict[str, str]) -> None:
        """Publish ``summary.json``: how the run ended (``status``: completed, interrupted or
        failed, its ``reason``, and ``requeue``: stopped to be resumed by a requeued head job),
        the final state of the run (``data_layer`` after every task ended; the last one read
        when the data layer was gone, then ``ledger_closed`` is false),
        what each node and trainer returned when stopped, the trainers' restarts per policy
        (``trainer_restarts``: count, limit, and per restart the lost worker, why, the versions
        resumed and the optimiser state's), the previous incarnation's jobs cancelled at start
        (``previous_jobs``), every worker, and what did not answer while the run stopped
        (``stop_errors``). The partition table is counted from ``data_layer`` when the data layer
        answered at the end (``ledger_closed``): a run that failed or was stopped between two ticks
        kept generating and training after the last one."""
        if ledger_closed and "nodes" in data_layer:
            self.track(Tick(data_layer=data_layer, trainers=trainers))
        write_summary(self.paths, {
            "status": ending.status, "reason": ending.reason, "requeue": ending.requeue,
            "steps": steps, "eval": data_layer.get("eval", []), "ledger": ledger, "ledger_closed": ledger_closed,
            "seconds": seconds, "interrupted": ending.status == "interrupted", "nodes": nodes, "trainers": trainers,
            "trainer_restarts": self.trainer_restarts(), "previous_jobs": self.previous_jobs,
            "data_layer_restarts": self.data_layer_restarts(),
            # its evaluations once, as ``eval`` above: a run with thousands of them kept them twice
            "data_layer": {k: v for k, v in data_layer.items() if k != "eval"}, "iterations": iterations,
            "stop_errors": stop_errors,
            "workers": {n: {"partition": w.partition, "job_id": w.job.job_id, "phase": w.phase, "note": w.note,
                            "gone": w.gone, "served": w.actor is not None}
                        for n, w in self.fleet.workers.items()},
            "partitions": self.partitions(),
            "autoscale": self.autoscale(),
        })
