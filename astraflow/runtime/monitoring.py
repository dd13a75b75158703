"""What a person watching a run sees, built in one place from the run directory.

The orchestrator writes ``control/status.json`` every tick and the data layer appends one line
per trainer step (and per evaluation) to ``metrics.jsonl``. Three readers show those numbers —
the AstraFlow page on the Dask dashboard (``/astraflow/api/*.json``), ``astraflow status
--json`` and ``astraflow plot`` — and all of them go through this module, so they never
disagree. Nothing here talks to the cluster: a run directory on shared storage is enough.

Two views, both plain JSON whose schema is the pydantic models below (``extra="forbid"``, so a
field added on one side and not documented here fails the schema test):

* :func:`build_status_view` -> :class:`StatusView`: the live state — partitions with their
  RaaS nodes, policies, ledger totals, throughput. Cheap; the page polls it every ~2 s.
* :class:`MetricsReader` -> :class:`MetricsView`: the curves from ``metrics.jsonl`` per policy
  (trainer steps and held-out evaluations). It reads only the lines appended since the last call.

:func:`write_plots` renders the curves as PNGs with matplotlib (optional dependency ``plot``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from storage.paths import RunPaths

SCHEMA_VERSION = 1

#: a status snapshot older than this means the orchestrator is not running any more
#: (the same rule as ``astraflow status``).
STALE_AFTER_S = 30.0


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------- status view

class NodeView(_View):
    """One worker of the run (a RaaS node, the data layer or a trainer)."""

    name: str = Field(description="Dask worker name, e.g. rollout-rollout-local-cpu-0")
    partition: str = Field(description="partition the worker's job belongs to")
    role: str = Field(description="rollout | data | trainer")
    hardware: str = Field(description="the partition's hardware label (cpu, a100, ...)")
    region: str = Field(description="the partition's region label")
    job_id: str = Field(description="local pid-based id or Slurm job id")
    state: str = Field(description="job state from the scheduler (RUNNING, PENDING, ...); "
                                   "DRAINING while it finishes its leases; GONE once it left; "
                                   "ENDED when the run finished")
    versions: dict[str, int] = Field(description="weight version served per policy (RaaS nodes; empty otherwise)")
    leased_now: int = Field(description="tasks the node holds right now (in flight)")
    leased_total: int = Field(description="tasks leased to the node since it joined")
    completed_total: int = Field(description="tasks the node completed")
    episodes: int = Field(description="episodes the node generated")
    tokens: int = Field(description="response tokens the node generated")
    trajectories_per_s: float = Field(description="episodes per second over the node's lifetime")
    tokens_per_s: float = Field(description="response tokens per second over the node's lifetime")
    last_seen_s: float | None = Field(description="seconds since its last heartbeat; None: never (not a RaaS node)")


class PartitionView(_View):
    """A partition as configured (or added with ``astraflow partitions add``)."""

    name: str
    scheduler: str = Field(description="local | slurm")
    role: str = Field(description="rollout | data | trainer")
    hardware: str
    region: str
    desired: int = Field(description="nodes the partition should have")
    live: int = Field(description="its workers that are not gone")
    nodes: list[NodeView] = Field(description="its workers, by name")


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
    buffer: int = Field(description="trajectories ready for this policy's next batch")
    accepted: int = Field(description="trajectories the data layer accepted")
    filtered: int = Field(description="trajectories the group filter removed")
    stale_dropped: int = Field(description="trajectories dropped as too stale")
    replayed: int = Field(description="trajectories replayed into batches")
    consumed: int = Field(description="trajectories consumed by the trainer")
    staleness_hist: dict[str, int] = Field(description="consumed trajectories by staleness (versions behind)")


class LedgerView(_View):
    """The task ledger: every task the data layer created, by state and by event."""

    tasks: int = Field(description="tasks created")
    open: int = Field(description="tasks not yet in a terminal state")
    states: dict[str, int] = Field(description="tasks per current state")
    totals: dict[str, int] = Field(description="event counts: created, leased, completed, requeued, failed, "
                                               "consumed, dropped, evaluated (0 when none happened)")
    dropped_by_reason: dict[str, int]
    failed_by_reason: dict[str, int]


class StatusView(_View):
    """Everything the AstraFlow page shows live; also ``astraflow status --json``."""

    schema_version: int = Field(description=f"{SCHEMA_VERSION}; bumped when a field changes meaning")
    run_dir: str
    running: bool = Field(description="the orchestrator is alive and wrote status within the last 30 s")
    finished: bool = Field(description="the run ended (summary.json exists)")
    written_at: float | None = Field(description="unix time of the status snapshot; None before the first")
    age_s: float | None = Field(description="seconds since the snapshot was written")
    elapsed_s: float = Field(description="seconds since the data layer started")
    dashboard: str | None = Field(description="the Dask dashboard address")
    trajectories_per_s: float = Field(description="run-wide trajectories per second")
    tokens_per_s: float = Field(description="run-wide response tokens per second")
    policies: list[PolicyView]
    partitions: list[PartitionView]
    ledger: LedgerView


LEDGER_EVENTS = ("created", "leased", "completed", "requeued", "failed", "consumed", "dropped", "evaluated")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _max_steps(paths: RunPaths) -> int | None:
    if not paths.config.exists():
        return None
    import yaml

    data = yaml.safe_load(paths.config.read_text()) or {}
    value = (data.get("run") or {}).get("max_steps")
    return int(value) if value is not None else None


def _node_view(name: str, worker: dict[str, Any], part: dict[str, Any], info: dict[str, Any], now: float,
               finished: bool) -> NodeView:
    state = str(worker.get("state", "UNKNOWN"))
    if info.get("gone") or state == "GONE":
        state = "GONE"
    elif finished:  # the last snapshot predates shutdown, which cancelled every job
        state = "ENDED"
    elif worker.get("draining") or info.get("draining"):
        state = "DRAINING"
    tokens = int(info.get("tokens", 0))
    tok_s = float(info.get("tokens_per_s", 0.0))
    episodes = int(info.get("episodes", 0))
    if "trajectories_per_s" in info:
        traj_s = float(info["trajectories_per_s"])
    else:  # heartbeats carry lifetime tokens and tokens/s: the node's age is their ratio
        traj_s = episodes * tok_s / tokens if tokens and tok_s else 0.0
    seen = info.get("last_seen")
    return NodeView(
        name=name, partition=worker.get("partition", info.get("partition", "?")), role=part.get("role", "?"),
        hardware=str(info.get("hardware", part.get("hardware", "?"))), region=str(info.get("region", part.get("region", "?"))),
        job_id=str(worker.get("job_id", "?")), state=state,
        versions={p: int(v) for p, v in (info.get("versions") or {}).items()},
        leased_now=int(info.get("inflight", 0)), leased_total=int(info.get("leased", 0)),
        completed_total=int(info.get("completed", 0)), episodes=episodes, tokens=tokens,
        trajectories_per_s=traj_s, tokens_per_s=tok_s,
        last_seen_s=(now - float(seen)) if seen is not None else None,
    )


def build_status_view(run_dir: Path | str, now: float | None = None) -> StatusView:
    """The live view of the run in ``run_dir`` (running or finished).

    Raises ``ValueError`` when ``run_dir`` holds no run yet (no status snapshot and no summary).
    """
    paths = RunPaths(Path(run_dir))
    now = time.time() if now is None else now
    status = _read_json(paths.status_file)
    summary = _read_json(paths.summary)
    info = _read_json(paths.orchestrator_file) or {}
    if not paths.root.is_dir():
        raise ValueError(f"{run_dir} is not a run directory: pass the --run-dir of `astraflow run`")
    if status is None and summary is None:
        raise ValueError(f"no run has started in {run_dir} yet (no {paths.status_file}): "
                         f"pass the --run-dir of `astraflow run`")
    status = status or {"data_layer": summary.get("data_layer", {}), "trainers": {}, "partitions": {}, "workers": {}}  # type: ignore[union-attr]
    # a finished run: the data layer's final state (every task ended) is in the summary
    dl = (summary or {}).get("data_layer") or status.get("data_layer") or {}
    written = status.get("written_at")
    age = now - written if written is not None else None
    from astraflow.runtime.control import _alive

    running = bool(info) and _alive(info) and age is not None and age < STALE_AFTER_S and summary is None
    dl_nodes = dl.get("nodes", {})
    workers = status.get("workers", {})
    parts_cfg = status.get("partitions", {})
    by_part: dict[str, list[NodeView]] = {n: [] for n in parts_cfg}
    for name in sorted(set(workers) | set(dl_nodes)):
        w = workers.get(name, {})
        node_info = dl_nodes.get(name, {})
        pname = w.get("partition", node_info.get("partition", "?"))
        by_part.setdefault(pname, []).append(_node_view(name, w, parts_cfg.get(pname, {}), node_info, now,
                                                            summary is not None))
    partitions = [
        PartitionView(
            name=n, scheduler=str(p.get("scheduler", "?")), role=str(p.get("role", "?")),
            hardware=str(p.get("hardware", "?")), region=str(p.get("region", "?")),
            desired=int(p.get("nodes", 0)), live=int(p.get("live", 0)), nodes=by_part.get(n, []),
        )
        for n, p in parts_cfg.items()
    ] + [  # nodes the data layer knows in a partition no longer configured
        PartitionView(name=n, scheduler="?", role="?", hardware="?", region="?", desired=0,
                      live=sum(1 for x in nodes if x.state != "GONE"), nodes=nodes)
        for n, nodes in by_part.items() if n not in parts_cfg
    ]
    max_steps = _max_steps(paths)
    trainers = status.get("trainers", {})
    policy_names = list(dict.fromkeys([*dl.get("versions", {}), *trainers]))
    evals = dl.get("eval", [])
    policies = []
    for p in policy_names:
        t = trainers.get(p, {})
        m = t.get("last_metrics") or {}
        c = dl.get("counts", {}).get(p, {})
        ev = [e for e in evals if e.get("policy", p) == p]
        last_ev = max(ev, key=lambda e: e["step"]) if ev else None
        policies.append(PolicyView(
            name=p, step=int(t.get("version", dl.get("versions", {}).get(p, 0))), max_steps=max_steps,
            done=bool(t.get("done", summary is not None)), error=t.get("error"),
            reward_mean=m.get("reward_mean"), loss=m.get("loss"),
            eval_accuracy=last_ev["eval_accuracy"] if last_ev else None,
            eval_step=int(last_ev["step"]) if last_ev else None,
            wait_fraction=float(t.get("wait_fraction", 0.0)),
            buffer=int(dl.get("buffers", {}).get(p, 0)),
            accepted=int(c.get("accepted", 0)), filtered=int(c.get("filtered", 0)),
            stale_dropped=int(c.get("stale_dropped", 0)), replayed=int(c.get("replayed", 0)),
            consumed=int(c.get("consumed", 0)),
            staleness_hist={str(k): int(v) for k, v in dl.get("staleness_hist", {}).get(p, {}).items()},
        ))
    led = dl.get("ledger", {})
    events = led.get("events", {})
    ledger = LedgerView(
        tasks=int(led.get("tasks", 0)), open=int(led.get("open", 0)),
        states={k: int(v) for k, v in led.get("states", {}).items()},
        totals={k: int(events.get(k, 0)) for k in LEDGER_EVENTS},
        dropped_by_reason={k: int(v) for k, v in led.get("dropped_by_reason", {}).items()},
        failed_by_reason={k: int(v) for k, v in led.get("failed_by_reason", {}).items()},
    )
    return StatusView(
        schema_version=SCHEMA_VERSION, run_dir=str(paths.root), running=running, finished=summary is not None,
        written_at=written, age_s=age, elapsed_s=float(dl.get("elapsed_s", 0.0)), dashboard=info.get("dashboard"),
        trajectories_per_s=float(dl.get("trajectories_per_s", 0.0)), tokens_per_s=float(dl.get("tokens_per_s", 0.0)),
        policies=policies, partitions=partitions, ledger=ledger,
    )


# ---------------------------------------------------------------------------- metrics view

class PolicyCurves(_View):
    """Curves of one policy; the trainer lists share one index (one entry per step line)."""

    step: list[int] = Field(description="trainer step (weight version published)")
    time: list[float] = Field(description="seconds since the data layer started")
    reward_mean: list[float | None]
    loss: list[float | None]
    trainer_wait_fraction: list[float | None]
    staleness_mean: list[float | None] = Field(description="mean staleness of the step's batch")
    trajectories_per_s: list[float | None] = Field(description="run-wide, cumulative average at that step")
    tokens_per_s: list[float | None]
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
    policies: dict[str, PolicyCurves]


_TRAINER_KEYS = {
    "reward_mean": "reward_mean", "loss": "loss", "trainer_wait_fraction": "trainer_wait_fraction",
    "staleness_mean": "data_staleness_mean", "trajectories_per_s": "trajectories_per_s",
    "tokens_per_s": "tokens_per_s", "filtered": "filtered", "stale_dropped": "stale_dropped",
    "replayed": "replayed",
}


def tail_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete JSON lines of ``path`` after byte ``offset``, and the offset after them
    (a line still being written is left for the next call)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    end = chunk.rfind(b"\n")
    if end < 0:
        return [], offset
    return [json.loads(raw) for raw in chunk[: end + 1].splitlines() if raw.strip()], offset + end + 1


class MetricsReader:
    """Reads ``metrics.jsonl`` incrementally: each :meth:`view` parses only lines appended since
    the previous call (the file only grows; a line being written is left for the next call)."""

    def __init__(self, run_dir: Path | str):
        self.paths = RunPaths(Path(run_dir))
        self._offset = 0
        self._lines = 0
        self._curves: dict[str, dict[str, Any]] = {}

    def _policy(self, name: str) -> dict[str, Any]:
        if name not in self._curves:
            self._curves[name] = {k: [] for k in PolicyCurves.model_fields if k != "staleness_hist"}
            self._curves[name]["staleness_hist"] = {}
        return self._curves[name]

    def _add(self, rec: dict[str, Any]) -> None:
        c = self._policy(str(rec.get("policy", "?")))
        if "eval_accuracy" in rec:
            c["eval_step"].append(int(rec["step"]))
            c["eval_time"].append(float(rec.get("time", 0.0)))
            c["eval_accuracy"].append(float(rec["eval_accuracy"]))
            return
        c["step"].append(int(rec["step"]))
        c["time"].append(float(rec.get("time", 0.0)))
        for key, src in _TRAINER_KEYS.items():
            c[key].append(rec.get(src))
        for k, v in (rec.get("data_staleness_hist") or {}).items():
            c["staleness_hist"][str(k)] = c["staleness_hist"].get(str(k), 0) + int(v)

    def read(self) -> None:
        records, self._offset = tail_records(self.paths.metrics, self._offset)
        for rec in records:
            self._add(rec)
            self._lines += 1

    def view(self) -> MetricsView:
        self.read()
        return MetricsView(
            schema_version=SCHEMA_VERSION, run_dir=str(self.paths.root), lines=self._lines,
            policies={p: PolicyCurves(**c) for p, c in self._curves.items()},
        )


def read_metrics(run_dir: Path | str) -> MetricsView:
    return MetricsReader(run_dir).view()


# ---------------------------------------------------------------------------- TensorBoard

def _stale(paths: RunPaths) -> bool:
    status = _read_json(paths.status_file)
    return status is not None and time.time() - float(status.get("written_at", 0)) > STALE_AFTER_S


def export_tensorboard(run_dir: Path | str, logdir: Path | str | None = None, follow: bool = False,
                       poll_s: float = 2.0) -> int:
    """Mirror ``metrics.jsonl`` into TensorBoard event files (optional: needs the ``tensorboard``
    package; nothing in a run depends on it). Every numeric field of a trainer line becomes the
    scalar ``<policy>/<field>`` at its step, every evaluation field ``<policy>/eval/<field>``.

    ``follow=True`` keeps mirroring new lines until the run ends (``summary.json`` appears) or its
    orchestrator stops writing status (older than :data:`STALE_AFTER_S`). Returns lines written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("TensorBoard export needs the tensorboard package: pip install tensorboard") from None
    paths = RunPaths(Path(run_dir))
    if not paths.metrics.exists() and not follow:
        raise ValueError(f"{paths.metrics} does not exist: pass the --run-dir of a run that started")
    writer = SummaryWriter(log_dir=str(logdir if logdir is not None else paths.root / "tensorboard"))
    offset = written = 0
    try:
        while True:
            # decided before reading, so the lines written before the run ended are all read
            ended = not follow or paths.summary.exists() or _stale(paths)
            records, offset = tail_records(paths.metrics, offset)
            for rec in records:
                prefix = f"{rec.get('policy', '?')}/" + ("eval/" if "eval_accuracy" in rec else "")
                for key, value in rec.items():
                    if key not in ("step", "policy") and isinstance(value, (int, float)) and not isinstance(value, bool):
                        writer.add_scalar(prefix + key, value, global_step=int(rec["step"]))
                written += 1
            writer.flush()
            if ended:
                break
            time.sleep(poll_s)
    finally:
        writer.close()
    return written


# ---------------------------------------------------------------------------- plots

PLOTS = ("reward", "accuracy", "throughput", "staleness")


def write_plots(run_dir: Path | str, out: Path | str | None = None) -> list[Path]:
    """Write ``reward.png``, ``accuracy.png``, ``throughput.png`` and ``staleness.png`` from the
    run's ``metrics.jsonl`` into ``out`` (default ``<run>/plots``); returns the paths written."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("astraflow plot needs matplotlib: pip install 'astraflow[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    view = read_metrics(run_dir)
    if not view.policies:
        raise ValueError(f"{RunPaths(Path(run_dir)).metrics} has no metrics yet: plot a run that took a step")
    out_dir = Path(out) if out is not None else RunPaths(Path(run_dir)).root / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)

    def pts(xs: list, ys: list) -> tuple[list, list]:
        keep = [(x, y) for x, y in zip(xs, ys) if y is not None]
        return [x for x, _ in keep], [y for _, y in keep]

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for p, c in view.policies.items():
        ax.plot(*pts(c.step, c.reward_mean), marker=".", label=p)
    ax.set(title="mean reward per training batch", xlabel="trainer step", ylabel="reward")
    ax.legend(loc="best"), ax.grid(alpha=0.3)
    save(fig, "reward")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for p, c in view.policies.items():
        if c.eval_step:
            ax.plot(c.eval_step, c.eval_accuracy, marker="o", label=p)
    ax.set(title="held-out accuracy", xlabel="weight version", ylabel="accuracy", ylim=(-0.02, 1.02))
    if any(c.eval_step for c in view.policies.values()):
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    save(fig, "accuracy")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax2 = ax.twinx()
    for p, c in view.policies.items():
        ax.plot(*pts(c.time, c.trajectories_per_s), marker=".", color="tab:blue", label=f"{p} trajectories/s")
        ax2.plot(*pts(c.time, c.tokens_per_s), marker=".", color="tab:orange", linestyle="--",
                 label=f"{p} tokens/s")
    ax.set(title="throughput (cumulative average)", xlabel="seconds", ylabel="trajectories/s")
    ax2.set_ylabel("tokens/s")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="best"), ax.grid(alpha=0.3)
    save(fig, "throughput")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = len(view.policies)
    for i, (p, c) in enumerate(view.policies.items()):
        ks = sorted(c.staleness_hist, key=int)
        ax.bar([int(k) + (i - (n - 1) / 2) * 0.8 / n for k in ks], [c.staleness_hist[k] for k in ks],
               width=0.8 / n, label=p)
    ax.set(title="staleness of consumed trajectories", xlabel="versions behind", ylabel="trajectories")
    ax.legend(loc="best"), ax.grid(alpha=0.3, axis="y")
    save(fig, "staleness")
    return written
