"""One simulated run of a plan and what it measured.

The run is ``astraflow run`` of the sim config in a process of its own (a clean Dask cluster
each time, nothing left in this process); its progress is read from ``metrics.jsonl`` while it
runs. The numbers come from the run's own records: the trainers' per-step ``wait_s`` /
``train_s`` / ``publish_s``, the data layer's cumulative counts and staleness histogram, and the
nodes' counters in ``summary.json``. The first steps (start-up, the first weight loads) are left
out: every rate, fraction and count (the dropped samples: the counts' growth) is over the
steady part of the run, rates converted to simulated time with the run's ``time_scale``.

The child's PID is written to ``run.pid`` in the work dir. Ctrl-C (SIGINT), SIGTERM or SIGHUP (a
closed terminal) to the planning process stops the child with SIGTERM (it stops cleanly on it);
a child still there after ``STOP_DEADLINE_S`` is killed. Further stop signals are only noted
while that runs, so a second Ctrl-C cannot cut it short: a stopped plan leaves no run behind.
Then ``KeyboardInterrupt`` reaches the caller, with the stop signals still held off (the plan is
on its way out)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from astraflow.runtime.monitoring.metrics import tail_records
from storage.paths import RunPaths

#: steps left out at the start of a run (and at least this share of them)
WARMUP_STEPS, WARMUP_SHARE = 2, 0.2
#: the dropped samples reported, and the data layer's cumulative count of each in a step record
DROP_COUNTS = {"stale": "stale_dropped", "overflow": "overflow_dropped", "filtered": "filtered"}
#: seconds a simulated run has to stop after SIGTERM before it is killed
STOP_DEADLINE_S = 60.0
#: the signals that stop a plan (and its simulated run): SIGHUP too, or a closed terminal would
#: leave the run (and its temporary directory) behind
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SimFailed(RuntimeError):
    """The simulated run did not complete; the message has its last output."""


@dataclass
class SimResult:
    """What one simulated run measured (rates in simulated time, over its steady part)."""

    pools: dict[str, int]
    """GPUs per pool kind."""
    steps: int
    steps_per_s: float
    trajectories_per_s: float
    """Sequences generated per second, all pools."""
    tokens_per_s: float
    trained_per_s: float
    """Sequences consumed by trainers per second."""
    trainer_wait: float
    """Share of the trainer's wall time spent waiting for a batch (first policy)."""
    staleness: dict[str, int]
    """Version lag of trained sequences: p50, p90, max."""
    dropped: dict[str, int]
    """Sequences the data layer dropped in the steady part: stale, overflow, filtered (first
    policy, as the wait)."""
    dropped_fraction: dict[str, float] = field(default_factory=dict)
    """The same over the training sequences every policy generated in the steady part (runs of
    different lengths compare by it; with one policy, its own share)."""
    per_pool: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per pool kind: trajectories/s, tokens/s, share of the generated sequences."""
    real_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_sim(data: dict[str, Any], workdir: Path, pools: dict[str, int], time_scale: float,
            progress: Callable[[str], None] | None = None, deadline_s: float | None = None) -> SimResult:
    """Run the sim config ``data`` in ``workdir`` and measure it (SimFailed when it fails)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg, run_dir = workdir / "config.yaml", workdir / "run"
    if run_dir.exists():  # `astraflow run` would resume it, mixing an earlier run's steps into these numbers
        raise ValueError(f"{run_dir} exists: a simulated run starts in a fresh directory")
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    steps = data["run"]["max_steps"]
    t0 = time.time()
    log = (workdir / "run.log").open("w")
    limit = deadline_s or data["run"]["timeout_s"] + 120
    shown = -1
    counted = _StepCount(run_dir)
    stop = _StopSignals()
    installed = threading.current_thread() is threading.main_thread()  # handlers are set there only
    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS} if installed else {}  # before the child exists
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir),
                                 "--quiet"], stdout=log, stderr=subprocess.STDOUT)
        (workdir / "run.pid").write_text(f"{proc.pid}\n")
        stop.arm()  # a signal while the child started is acted on now that it is known
        while proc.poll() is None:
            if time.time() - t0 > limit:
                _stop(proc)
                tail = (workdir / "run.log").read_text(errors="replace")[-2000:]  # the directory may be temporary
                raise SimFailed(f"the simulated run passed its deadline of {limit:.0f}s; the end of its log:\n{tail}")
            done = counted()
            if progress and done != shown:
                progress(f"step {done}/{steps}")
                shown = done
            time.sleep(1.0)
    finally:
        stop.disarm()  # from here signals are only noted: none cuts the stop below short (it is bounded)
        log.close()
        if proc is not None and proc.poll() is None:  # a signal or an exception above: end the run we started
            _stop(proc)
        if stop.signum is None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if stop.signum is not None:  # the handlers stay: further signals must not break the plan's own exit
        raise KeyboardInterrupt(f"signal {stop.signum}")
    if proc.returncode != 0:
        done, timeout = counted(), data["run"]["timeout_s"]
        if time.time() - t0 >= timeout and steps / 2 <= done < steps:  # the trainer kept up: real time ran out
            raise SimFailed(f"the simulated trainer took {done} of its {steps} steps by the simulated run's deadline "
                            f"({timeout:.0f}s real): the pools kept it going, but the run is slower in real time "
                            f"than planned (the engines' timeline at time scale {time_scale:.3g}); give a larger "
                            "--time-scale (or fewer --minutes)")
        if time.time() - t0 >= timeout and done < steps:  # the run's own deadline ended it
            raise SimFailed(f"the simulated trainer took {done} of its {steps} steps by the simulated run's deadline "
                            f"({timeout:.0f}s real, many times what a trainer that never waits needs): these pools "
                            "deliver far too little for this config, the trainer would wait nearly all the time; "
                            "plan larger pools")
        tail = (workdir / "run.log").read_text(errors="replace")[-2000:]
        raise SimFailed(f"the simulated run exited with {proc.returncode}:\n{tail}")
    result = measure(run_dir, pools, time_scale)
    result.real_seconds = time.time() - t0
    return result


class _StopSignals:
    """The handler of the stop signals while a simulated run is up. Armed, the first signal
    raises ``KeyboardInterrupt`` (the caller's cleanup stops the run); disarmed (while the child
    starts, and while it is being stopped) signals are only noted; after the first, every one is."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            sys.stderr.write(f"plan: already stopping the simulated run (signal {signum} ignored): it gets "
                             f"{STOP_DEADLINE_S:.0f}s to stop, then it is killed\n")
            return
        self.signum = signum
        if self.armed:
            raise KeyboardInterrupt(f"signal {signum}")

    def arm(self) -> None:
        self.armed = True
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {self.signum}")

    def disarm(self) -> None:
        self.armed = False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``, then SIGKILL if it is still there after ``STOP_DEADLINE_S``."""
    proc.terminate()
    try:
        proc.wait(STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _step_records(run_dir: Path) -> list[dict[str, Any]]:
    """The trainer step records (those with a ``loss``) of the run's ``metrics.jsonl``, every
    policy's; a damaged line is skipped, a line still being written is left out."""
    records, _ = tail_records(RunPaths(run_dir).metrics, 0)
    return [x for x in records if "loss" in x]


class _StepCount:
    """The trainer steps recorded so far in a run's ``metrics.jsonl``, read from where the last
    call stopped (re-reading the whole file every poll would cost its length each time)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunPaths(run_dir).metrics
        self.offset = self.steps = 0

    def __call__(self) -> int:
        records, self.offset = tail_records(self.path, self.offset)
        self.steps += sum(1 for x in records if "loss" in x)
        return self.steps


def measure(run_dir: Path, pools: dict[str, int], time_scale: float) -> SimResult:
    """The `SimResult` of a finished run in ``run_dir`` (first policy's steps)."""
    records = _step_records(run_dir)
    policy = records[0]["policy"]
    steps = [x for x in records if x["policy"] == policy]
    skip = min(max(WARMUP_STEPS, int(len(steps) * WARMUP_SHARE)), len(steps) - 2)
    assert skip >= 0, f"{run_dir}: at least 2 steps are needed to measure a rate"
    a, b = steps[skip], steps[-1]
    span = max((b["time"] - a["time"]) * time_scale, 1e-9)  # simulated seconds
    window = steps[skip + 1:]
    # the wait over the trainer's wall time: a publish that overlaps the next step (the torch
    # backend's) must not count twice, as a sum of wait, train and publish times would
    wall = max(b["time"] - a["time"], 1e-9)
    generated = b["sequences_generated"] - a["sequences_generated"]
    tokens = b["generated_tokens_per_s"] * b["time"] - a["generated_tokens_per_s"] * a["time"]
    hist = {int(k): v - a["staleness_hist"].get(k, 0) for k, v in b["staleness_hist"].items()}
    dropped = {name: b[key] - a[key] for name, key in DROP_COUNTS.items()}
    # training sequences only (evaluation's are never dropped); older records lack the split
    gen_key = "rollouts_generated" if "rollouts_generated" in a and "rollouts_generated" in b else "sequences_generated"
    train_generated = max(b[gen_key] - a[gen_key], 0)
    # the sequences the steps after ``a`` trained on: the data layer's ``consumed`` may already
    # count the batch the trainer took for its next step, one batch ahead at one end only
    trained = (sum(s["num_sequences"] for s in window) if all("num_sequences" in s for s in window)
               else b["consumed"] - a["consumed"])
    result = SimResult(
        pools=pools, steps=len(steps),
        steps_per_s=(b["step"] - a["step"]) / span,
        trajectories_per_s=generated / span,
        tokens_per_s=tokens / span,
        trained_per_s=trained / span,
        trainer_wait=min(sum(s["wait_s"] for s in window) / wall, 1.0),
        staleness=staleness_quantiles(hist),
        dropped=dropped,
        dropped_fraction={k: n / train_generated if train_generated else 0.0 for k, n in dropped.items()},
    )
    result.per_pool = _per_pool(run_dir, result)
    return result


def staleness_quantiles(hist: dict[int, int]) -> dict[str, int]:
    """p50, p90 and max of a ``{lag: count}`` histogram (zeros when it is empty)."""
    total = sum(c for c in hist.values() if c > 0)
    out = {"p50": 0, "p90": 0, "max": max((k for k, c in hist.items() if c > 0), default=0)}
    for name, q in (("p50", 0.5), ("p90", 0.9)):
        seen = 0
        for lag in sorted(hist):
            seen += max(hist[lag], 0)
            if total and seen >= q * total:
                out[name] = lag
                break
    return out


def _pool_of(partition: Any) -> str | None:
    """The pool kind of a planner partition (``pool_KIND``, or ``pool_KIND.rest`` for a pool's
    last workers: the same pool); None for any other partition."""
    part = str(partition or "")
    return part.removeprefix("pool_").split(".")[0] if part.startswith("pool_") else None


def _per_pool(run_dir: Path, result: SimResult) -> dict[str, dict[str, float]]:
    """Each pool's share of what the nodes generated (their counters in ``summary.json``),
    applied to the run's steady rates, and how stale its sequences were when trained on (over
    the whole run: the data layer counts them per node)."""
    summary = json.loads(RunPaths(run_dir).summary.read_text())
    episodes: dict[str, float] = {}
    for st in summary.get("nodes", {}).values():
        if (kind := _pool_of(st.get("partition"))) is not None:
            episodes[kind] = episodes.get(kind, 0) + st.get("counters", {}).get("episodes", 0)
    dl = summary.get("data_layer") or {}
    hists: dict[str, dict[int, int]] = {}
    for node, hist in (dl.get("consumed_staleness_by_node") or {}).items():
        kind = _pool_of((dl.get("nodes") or {}).get(node, {}).get("partition"))
        if kind in episodes:
            into = hists.setdefault(kind, {})
            for lag, n in hist.items():
                into[int(lag)] = into.get(int(lag), 0) + int(n)
    total = sum(episodes.values()) or 1.0
    return {kind: {"share": n / total, "trajectories_per_s": result.trajectories_per_s * n / total,
                   "tokens_per_s": result.tokens_per_s * n / total,
                   **{f"staleness_{q}": v if hists.get(kind) else None  # None: nothing of it was trained on
                      for q, v in staleness_quantiles(hists.get(kind, {})).items()}}
            for kind, n in sorted(episodes.items())}
