"""Monitoring room: the status view, the live state of a run as one typed JSON document.

:func:`build_status_view` -> :class:`StatusView`: partitions with their RaaS nodes, policies,
ledger totals, throughput, built from the run's status files (`read_snapshot`). The AstraFlow
page on the Dask dashboard (``/astraflow/api/status.json``, polled every ~2 s) and
``astraflow status --json`` both serve it, so they never disagree. Its schema is the pydantic
models below (``extra="forbid"``: a field added on one side and not documented here fails the
schema test).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import Field

# the partition and worker models and the base of every view (re-exported here)
from astraflow.runtime.monitoring.node_views import (  # noqa: F401
    SCHEMA_VERSION, BoundsView, CapacityView, NodeView, PartitionView, _View,
)
from astraflow.runtime.monitoring.partition_stats import worker_of
from astraflow.runtime.monitoring.snapshot import STALE_AFTER_S, damaged_run_files, orchestrator_alive, read_snapshot
from astraflow.runtime.monitoring.text import outcome as outcome_of
from storage.paths import RunPaths

# ---------------------------------------------------------------------------- status view

class PolicyView(_View):
    """One policy: its trainer and what the data layer did with its trajectories."""

    name: str
    step: int = Field(description="latest weight version the trainer published")
    max_steps: int | None = Field(description="run.max_steps; None when the config is unreadable")
    done: bool
    error: str | None = Field(description="the trainer's error; None while healthy")
    reward_mean: float | None = Field(description="mean reward of the last training batch; None before the first step")
    loss: float | None
    eval_accuracy: float | None = Field(description="latest held-out accuracy; None before the first evaluation")
    eval_step: int | None = Field(description="the version eval_accuracy was measured at")
    wait_fraction: float = Field(description="fraction of the trainer's time spent waiting for a batch")
    batch_wait_s: float = Field(default=0.0, description="how long its wait for the next batch has lasted (0: none, "
                                                         "and once the run finished)")
    buffer: int = Field(description="trajectories ready for this policy's next batch")
    accepted: int = Field(description="trajectories the data layer accepted")
    filtered: int = Field(description="trajectories the group filter removed")
    stale_dropped: int = Field(description="trajectories dropped as too stale")
    replayed: int = Field(description="trajectories replayed into batches")
    consumed: int = Field(description="trajectories consumed by the trainer")
    staleness_hist: dict[str, int] = Field(description="consumed trajectories by staleness (versions behind)")
    restarts: int = Field(default=0, description="times its trainer was restarted after its worker was lost "
                                                 "(at most cluster.trainer_restarts)")


class DecisionView(_View):
    """One decision of the autoscaler."""

    t: float = Field(description="unix time of the decision")
    action: str = Field(description="add | drain | hold")
    partition: str | None = Field(description="the partition changed; None for a hold")
    count: int = Field(description="workers added or drained")
    desired: int | None = Field(description="the partition's nodes before")
    target: int | None = Field(description="its nodes after")
    reason: str = Field(description="why, with the signal values against the band")
    signals: dict[str, float | None] = Field(description="trainer_wait, stale_fraction, evidence_s over the window")


class AutoscaleView(_View):
    """The run's autoscaler (``autoscale:`` in the config; docs/autoscaling.md)."""

    high_wait: float
    low_wait: float
    max_stale_fraction: float | None
    window_s: float
    step_nodes: int
    last: DecisionView | None = Field(description="the latest decision (often a hold, saying why)")
    changes: list[DecisionView] = Field(description="the recent adds and drains, oldest first")


class LedgerView(_View):
    """The task ledger: every task the data layer created, by state and by event."""

    tasks: int = Field(description="tasks created")
    open: int = Field(description="tasks not yet in a terminal state")
    states: dict[str, int] = Field(description="tasks per current state")
    totals: dict[str, int] = Field(description="event counts: created, leased, completed, requeued, failed, "
                                               "consumed, dropped, evaluated (0 when none happened)")
    dropped_by_reason: dict[str, int]
    failed_by_reason: dict[str, int]
    requeued_by_reason: dict[str, int] = Field(default_factory=dict, description="attempts run again, by why "
                                               "(at most 32 reasons by name, the rest together)")


class DiskView(_View):
    """A filesystem the run writes to (``monitoring.disk``)."""

    path: str = Field(description="where it was sampled (the run directory, or the nearest existing directory "
                                  "above a place not made yet)")
    places: list[str] = Field(description="what of the run is on it: run directory, trajectory store")
    free_bytes: int
    total_bytes: int
    falling_bytes_per_h: float | None = Field(description="how fast free space falls, fitted over the last half "
                                                          "hour (negative: it grows); None before a trend")
    full_in_s: float | None = Field(description="seconds until it is full at that rate; None when it does not fall")


class StatusView(_View):
    """Everything the AstraFlow page shows live; also ``astraflow status --json``."""

    schema_version: int = Field(description=f"{SCHEMA_VERSION}; bumped when a field changes meaning")
    run_dir: str
    running: bool = Field(description=f"the orchestrator is alive and wrote status within the last "
                                      f"{STALE_AFTER_S:.0f} s")
    finished: bool = Field(description="the run ended (summary.json exists)")
    outcome: str | None = Field(default=None, description="how the run ended: completed, failed or interrupted "
                                                          "(summary.json's status); None while it runs")
    reason: str | None = Field(default=None, description="why it failed or was interrupted; None otherwise")
    requeue: bool | None = Field(default=None, description="interrupted to be requeued (SIGUSR1); None while it runs")
    seconds: float | None = Field(default=None, description="the run's duration; None while it runs")
    written_at: float | None = Field(description="unix time of the status snapshot; None before the first")
    age_s: float | None = Field(description="seconds since the snapshot was written")
    elapsed_s: float = Field(description="seconds since the data layer started")
    dashboard: str | None = Field(description="the Dask dashboard address (None once the run finished)")
    slurm_job: str | None = Field(default=None, description="the Slurm job the orchestrator runs in (the head "
                                  "job: `scancel` it to stop the run from another host); None outside Slurm")
    episodes_per_s: float = Field(description="run-wide episodes per second")
    sequences_per_s: float = Field(description="run-wide stored sequences per second")
    generated_tokens_per_s: float = Field(description="run-wide sampled tokens per second")
    rollout_idle_fraction: float | None = Field(
        description="mean idle fraction of the live RaaS nodes; with the trainers' wait fractions it "
                    "says which side to grow (idle nodes: training is the bottleneck; waiting "
                    "trainers: rollout is). None before a node reported")
    policies: list[PolicyView]
    partitions: list[PartitionView]
    ledger: LedgerView
    autoscale: AutoscaleView | None = Field(default=None, description="the autoscaler; None when the run has none")
    waiting: str | None = Field(default=None, description="what the orchestrator is doing while the figures wait "
                                                          "(a trainer's or the data layer's restart); None otherwise")
    segments_deleted: int | None = Field(default=None, description="trajectory segments deleted since the data "
                                         "layer started (storage.keep_trajectories: false); None when all are kept")
    disk: list[DiskView] = Field(default_factory=list, description="free space on the filesystems the run writes "
                                 "to; empty before the first sample and once the run ended")
    data_layer_restarts: int = Field(default=0, description="times the data layer was re-placed on a new worker "
                                                            "after its worker was lost (at most "
                                                            "cluster.data_layer_restarts)")


LEDGER_EVENTS = ("created", "leased", "completed", "requeued", "failed", "consumed", "dropped", "evaluated")


def _max_steps(paths: RunPaths) -> int | None:
    if not paths.config.exists():
        return None
    import yaml

    try:  # the run's saved config: a damaged one leaves the page without the step target
        data = yaml.safe_load(paths.config.read_text()) or {}
        value = (data.get("run") or {}).get("max_steps")
        return int(value) if value is not None else None
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return None


def _node_view(name: str, worker: dict[str, Any], part: dict[str, Any], info: dict[str, Any], now: float,
               ended: str | None) -> NodeView:
    """``ended``: ENDED for a finished run (its last snapshot predates the shutdown, which
    cancelled every job), UNKNOWN for one that stopped without a summary (its jobs' states
    are as old as its last status); None while it runs."""
    state = str(worker.get("state", "UNKNOWN"))
    if info.get("gone") or state == "GONE":
        state = "GONE"
    elif ended is not None:
        state = ended
    elif worker.get("draining") or info.get("draining"):
        state = "DRAINING"
    tokens = int(info.get("tokens", 0))
    tok_s = float(info.get("generated_tokens_per_s", 0.0))
    episodes = int(info.get("episodes", 0))
    if "episodes_per_s" in info:
        ep_s = float(info["episodes_per_s"])
    else:  # heartbeats carry lifetime tokens and tokens/s: the node's age is their ratio
        ep_s = episodes * tok_s / tokens if tokens and tok_s else 0.0
    seen = info.get("last_seen")
    return NodeView(
        name=name, partition=worker.get("partition", info.get("partition", "?")), role=part.get("role", "?"),
        hardware=str(info.get("hardware", part.get("hardware", "?"))),
        region=str(info.get("region", part.get("region", "?"))),
        job_id=str(worker.get("job_id", "?")), state=state,
        versions={p: int(v) for p, v in (info.get("versions") or {}).items()},
        leased_now=int(info.get("inflight", 0)), leased_total=int(info.get("leased", 0)),
        completed_total=int(info.get("completed", 0)), episodes=episodes, tokens=tokens,
        episodes_per_s=ep_s, generated_tokens_per_s=tok_s,
        idle_fraction=float(info["idle_fraction"]) if "idle_fraction" in info else None,
        last_seen_s=(now - float(seen)) if seen is not None else None,
        phase=worker.get("phase") if ended is None else None,
        host=worker.get("host") if ended is None and state != "GONE" else None,
        reason=worker.get("reason") if ended is None and state == "PENDING" else None,
    )


def build_status_view(run_dir: Path | str, now: float | None = None) -> StatusView:
    """The live view of the run in ``run_dir`` (running or finished).

    Raises ``ValueError`` when ``run_dir`` holds no run yet (no status snapshot and no summary),
    or when a status file holds a field of a type its writer never writes (``UnreadableFile``).
    """
    try:
        return _build_status_view(run_dir, now)
    except (TypeError, AttributeError, KeyError) as err:
        raise damaged_run_files(run_dir, err) from None


def _build_status_view(run_dir: Path | str, now: float | None) -> StatusView:
    now = time.time() if now is None else now
    snap = read_snapshot(run_dir, now)
    paths, status, summary = snap.paths, snap.status, snap.summary
    if not paths.root.is_dir():
        raise ValueError(f"{run_dir} is not a run directory: pass the --run-dir of `astraflow run`")
    if status is None and summary is None and snap.starting:
        raise ValueError(snap.starting_message(run_dir))
    if not snap.running and (resuming := snap.new_incarnation()):
        # the files (a summary too, until the resume sets it aside) are the previous incarnation's
        raise ValueError(snap.starting_message(run_dir, resuming))
    if gone := snap.gone_before_first_status():
        raise ValueError(snap.gone_message(run_dir, gone))
    if status is None and summary is None:
        raise ValueError(f"no run has started in {run_dir} yet (no {paths.status_file}): "
                         f"pass the --run-dir of `astraflow run`")
    if status is None:  # ended before its first tick: what the summary says of its partitions and workers
        ended: dict[str, Any] = summary or {}
        status = {"data_layer": ended.get("data_layer", {}), "trainers": {},
                  "partitions": ended.get("partitions") or {}, "workers": ended.get("workers") or {}}
    # a finished run: the data layer's final state (every task ended) is in the summary, and the
    # partition table counted from it (the last periodic status predates the end)
    dl = (summary or {}).get("data_layer") or status.get("data_layer") or {}
    if (summary or {}).get("partitions"):
        status = {**status, "partitions": summary["partitions"]}
    written, age, running, info = snap.written_at, snap.age_s, snap.running, snap.info
    ended = "ENDED" if summary is not None else None if running else "UNKNOWN"
    partitions = _partition_views(status, dl, ended, now)
    policies = _policy_views(status, dl, summary, _max_steps(paths))
    return StatusView(
        schema_version=SCHEMA_VERSION, run_dir=str(paths.root), running=running, finished=summary is not None,
        outcome=None if summary is None else outcome_of(summary), reason=(summary or {}).get("reason"),
        requeue=(summary or {}).get("requeue"), seconds=(summary or {}).get("seconds"),
        written_at=written, age_s=age, elapsed_s=float(dl.get("elapsed_s", 0.0)),
        # it stops with the run, a killed one's too (on another host only the summary tells)
        dashboard=info.get("dashboard") if summary is None and info.get("pid") and orchestrator_alive(info) else None,
        slurm_job=info.get("slurm_job"),
        episodes_per_s=float(dl.get("episodes_per_s", 0.0)), sequences_per_s=float(dl.get("sequences_per_s", 0.0)),
        generated_tokens_per_s=float(dl.get("generated_tokens_per_s", 0.0)),
        rollout_idle_fraction=_mean_idle(partitions),
        policies=policies, partitions=partitions, ledger=_ledger_view(dl),
        autoscale=_autoscale_view((summary or {}).get("autoscale") or status.get("autoscale")),
        waiting=None if summary is not None else (status.get("waiting") or {}).get("what"),
        segments_deleted=(dl.get("retention") or {}).get("segments_deleted"),
        disk=[] if summary is not None else status.get("disk") or [],
        data_layer_restarts=int(((summary or {}).get("data_layer_restarts") or status.get("data_layer_restarts")
                                 or {}).get("count", 0)),
    )


def _partition_views(status: dict[str, Any], dl: dict[str, Any], ended: str | None,
                     now: float) -> list[PartitionView]:
    """Each configured partition with its nodes (the workers and the data layer's nodes), then
    any partition no longer configured that the data layer still knows nodes of; ``ended``: the
    state of every node not gone of a run that is not running (``_node_view``)."""
    finished = ended == "ENDED"
    dl_nodes = dl.get("nodes", {})
    workers = status.get("workers", {})
    parts_cfg = status.get("partitions", {})
    by_part: dict[str, list[NodeView]] = {n: [] for n in parts_cfg}
    # a worker whose nodes report under names of their own: listed as its nodes, each with its job
    hosting = {worker_of(n) for n in dl_nodes} - set(dl_nodes)
    for name in sorted((set(workers) - hosting) | set(dl_nodes)):
        w = workers.get(name) or workers.get(worker_of(name), {})
        node_info = dl_nodes.get(name, {})
        pname = w.get("partition", node_info.get("partition", "?"))
        by_part.setdefault(pname, []).append(_node_view(name, w, parts_cfg.get(pname, {}), node_info, now, ended))
    return [
        PartitionView(
            name=n, scheduler=str(p.get("scheduler", "?")), role=str(p.get("role", "?")),
            hardware=str(p.get("hardware", "?")), region=str(p.get("region", "?")),
            desired=0 if p.get("state") in ("removing", "removed") else int(p.get("nodes", 0)),
            live=0 if finished else int(p.get("live", 0)), serving=0 if finished else int(p.get("serving", 0)),
            nodes=by_part.get(n, []),
            state=str(p.get("state", "?")), failures=int(p.get("failures", 0)),
            refill_in_s=p.get("refill_in_s"), error=p.get("error"),
            **_partition_stats(p, rates=not finished),
        )
        for n, p in parts_cfg.items()
    ] + [
        PartitionView(name=n, scheduler="?", role="?", hardware="?", region="?", desired=0,
                      live=sum(1 for x in nodes if x.state not in ("GONE", "ENDED")), nodes=nodes)
        for n, nodes in by_part.items() if n not in parts_cfg
    ]


def _policy_views(status: dict[str, Any], dl: dict[str, Any], summary: dict[str, Any] | None,
                  max_steps: int | None) -> list[PolicyView]:
    """Each policy's progress, counts and last evaluation; a finished run's trainers as they
    stopped (the summary's word is final)."""
    trainers = dict(status.get("trainers", {}))
    if summary is not None:
        for p, final in (summary.get("trainers") or {}).items():
            if final:
                trainers[p] = {**trainers.get(p, {}), **final}
        for p, step in (summary.get("steps") or {}).items():
            trainers.setdefault(p, {})["version"] = step
    evals = dl.get("eval") or (summary or {}).get("eval") or []  # a summary keeps them once, beside its data_layer
    restarts = (summary or {}).get("trainer_restarts") or status.get("trainer_restarts") or {}
    policies = []
    for p in dict.fromkeys([*dl.get("versions", {}), *trainers]):
        t = trainers.get(p, {})
        m = t.get("last_metrics") or {}
        c = dl.get("counts", {}).get(p, {})
        ev = [e for e in evals if e.get("policy", p) == p and "eval_accuracy" in e]
        last_ev = max(ev, key=lambda e: e["step"]) if ev else None
        policies.append(PolicyView(
            name=p, step=int(t.get("version", dl.get("versions", {}).get(p, 0))), max_steps=max_steps,
            done=bool(t.get("done", summary is not None)), error=t.get("error"),
            reward_mean=m.get("reward_mean"), loss=m.get("loss"),
            eval_accuracy=last_ev["eval_accuracy"] if last_ev else None,
            eval_step=int(last_ev["step"]) if last_ev else None,
            wait_fraction=float(t.get("wait_fraction", 0.0)),
            # a finished run waits for nothing: a trainer stopped while it waited kept the wait's length
            batch_wait_s=0.0 if summary is not None else float(t.get("batch_wait_s") or 0.0),
            buffer=int(dl.get("buffers", {}).get(p, 0)),
            accepted=int(c.get("accepted", 0)), filtered=int(c.get("filtered", 0)),
            stale_dropped=int(c.get("stale_dropped", 0)), replayed=int(c.get("replayed", 0)),
            consumed=int(c.get("consumed", 0)),
            staleness_hist={str(k): int(v) for k, v in dl.get("staleness_hist", {}).get(p, {}).items()},
            restarts=int(restarts.get(p, {}).get("count", 0)),
        ))
    return policies


def _ledger_view(dl: dict[str, Any]) -> LedgerView:
    led = dl.get("ledger", {})
    events = led.get("events", {})
    return LedgerView(
        tasks=int(led.get("tasks", 0)), open=int(led.get("open", 0)),
        states={k: int(v) for k, v in led.get("states", {}).items()},
        totals={k: int(events.get(k, 0)) for k in LEDGER_EVENTS},
        dropped_by_reason={k: int(v) for k, v in led.get("dropped_by_reason", {}).items()},
        failed_by_reason={k: int(v) for k, v in led.get("failed_by_reason", {}).items()},
        requeued_by_reason={k: int(v) for k, v in (led.get("requeued_by_reason") or {}).items()},
    )


def _partition_stats(p: dict[str, Any], rates: bool) -> dict[str, Any]:
    """A partition's throughput, staleness, versions and bounds from its status entry; ``rates``
    False (a finished run): no throughput, its last window's rate is not what it does now."""
    return {"trajectories_per_s": float(p.get("episodes_per_s", 0.0)) if rates else 0.0,
            "tokens_per_s": float(p.get("tokens_per_s", 0.0)) if rates else 0.0,
            "consumed": int(p.get("consumed", 0)), "staleness_mean": p.get("staleness_mean"),
            "staleness_max": p.get("staleness_max"),
            "versions": {k: [int(x) for x in v] for k, v in (p.get("versions") or {}).items()},
            "autoscale": BoundsView(**p["autoscale"]) if p.get("autoscale") else None,
            "capacity": CapacityView(**p["capacity"]) if p.get("capacity") else None}


def _autoscale_view(a: dict[str, Any] | None) -> AutoscaleView | None:
    if not a:
        return None
    c = a.get("config", {})
    return AutoscaleView(
        high_wait=float(c.get("high_wait", 0.0)), low_wait=float(c.get("low_wait", 0.0)),
        max_stale_fraction=c.get("max_stale_fraction"), window_s=float(c.get("window_s", 0.0)),
        step_nodes=int(c.get("step_nodes", 1)),
        last=DecisionView(**a["last"]) if a.get("last") else None,
        changes=[DecisionView(**d) for d in a.get("changes", [])],
    )


def _mean_idle(partitions: list[PartitionView]) -> float | None:
    idle = [n.idle_fraction for part in partitions for n in part.nodes
            if n.idle_fraction is not None and n.state not in ("GONE", "ENDED")]
    return sum(idle) / len(idle) if idle else None


