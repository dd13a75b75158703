"""What the data layer writes into the run directory: metrics lines and its saved state.

* ``metrics.jsonl``: one line per policy and trainer step (``step_record``) and one per
  finished evaluation round, appended (a line-buffered append, not an atomic rewrite: the file
  only grows and a reader skips a torn last line).
* ``dataflow_state.json``: what a resumed run needs (``snapshot`` / ``restore``), rewritten
  atomically and durably at every committed step (``save``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from astraflow.contracts import TrajectoryRef
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.evals import episode_sums, summary_of_sums
from astraflow.dataflow.mixing import Mixer
from astraflow.dataflow.rules import plain_state
from storage.atomic import UnreadableFile, read_json_object, write_json

if TYPE_CHECKING:
    from astraflow.dataflow.layer import DataLayer

log = logging.getLogger("astraflow.dataflow")

#: the rule stages of ``DataflowConfig``, each saved under its own key
RULE_STAGES = ("curator", "group_filter", "ordering")
#: key of the rules' ``type`` names in the saved state (its name predates "rules"; kept so that
#: a run saved before still resumes)
RULE_TYPES_KEY = "policy_types"


@dataclass
class Generated:
    """What the RaaS nodes generated, for throughput and the rollout cost of the data."""

    #: completed trajectories (episodes)
    episodes: int = 0
    sequences: int = 0
    #: sequences of training rollouts only (evaluation excluded): the cost of the data
    train_sequences: int = 0
    #: tokens a policy sampled (prompt and tool/environment tokens are not counted)
    tokens: int = 0

    #: per policy: the training episodes since its last step record, as (count, sums of their
    #: statistics); a policy's window starts with the run (``for_policies``)
    episode_stats: dict[str, tuple[int, dict[str, float]]] = field(default_factory=dict)

    @classmethod
    def for_policies(cls, policies: list[str]) -> "Generated":
        return cls(episode_stats={p: (0, {}) for p in policies})

    def add(self, ref: TrajectoryRef) -> None:
        if ref.stats and ref.kind != "eval":
            for policy, window in self.episode_stats.items():
                n, sums = window if isinstance(window, tuple) else episode_sums(window)
                for k, v in ref.stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                self.episode_stats[policy] = (n + 1, sums)
        self.episodes += 1
        self.sequences += len(ref.sequences)
        if ref.kind != "eval":
            self.train_sequences += len(ref.sequences)
        self.tokens += sum(n for s in ref.sequences for n, _ in s.policy_tokens.values())

    def take_episode_stats(self, policy: str) -> tuple[int, dict[str, float]]:
        """The training episodes since ``policy``'s previous call: (count, statistics' sums)."""
        window = self.episode_stats.get(policy, (0, {}))
        self.episode_stats[policy] = (0, {})
        return window if isinstance(window, tuple) else episode_sums(window)  # a list: saved by an earlier release

    def rates(self, elapsed: float) -> dict[str, float]:
        """The throughput names of ``astraflow.contracts``, averaged over ``elapsed`` seconds."""
        elapsed = max(elapsed, 1e-9)
        return {"episodes_per_s": self.episodes / elapsed, "sequences_per_s": self.sequences / elapsed,
                "generated_tokens_per_s": self.tokens / elapsed}


class ServiceTimes:
    """How long the data layer's node-facing calls took inside it (entry to answer, snapshot
    wait included), the most recent ``keep`` of each kind: what ``state()["service_ms"]`` reports."""

    def __init__(self, keep: int = 4096):
        self._keep = keep
        self.by_kind: dict[str, deque] = {}

    def add(self, kind: str, seconds: float) -> None:
        self.by_kind.setdefault(kind, deque(maxlen=self._keep)).append(seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for kind, xs in self.by_kind.items():
            ordered = sorted(xs)
            pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
            out[kind] = {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99)}
        return out


def finite_json(value: Any) -> Any:
    """``value`` with every float that is not finite (a skipped step's nan loss, an inf) as None
    and numpy scalars as Python ones, so that its JSON is strict (no NaN/Infinity literals)."""
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # a numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _plain_number(value: Any) -> Any:
    """JSON for a numpy scalar (``finite_json``'s conversion); a non-finite float raises below."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return float(value)


def _as_finite_float(value: Any) -> float | None:
    """JSON for an object json does not know (a number type of another library)."""
    f = float(value)
    return f if math.isfinite(f) else None


def cut_torn_line(path: Path) -> None:
    """Cut a last line a crash left without its newline (the next line appended would join it)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            back = min(size, 1 << 20)
            f.seek(size - back)
            tail = f.read(back)
            f.truncate(size - back + tail.rfind(b"\n") + 1)
    except FileNotFoundError:
        return


class AppendLog:
    """A JSON-lines file of the run directory opened for appending (``path`` None: nothing is
    written), its last line cut first if a crash left it torn. A write or flush that fails (a
    full disk) calls ``on_error`` before it propagates: the state that line recorded moved in
    memory, and the call that moved it stops half way."""

    def __init__(self, path: str | Path | None, buffering: int,
                 on_error: Callable[[BaseException], None] | None = None):
        if path:
            cut_torn_line(Path(path))
        self._file = open(path, "a", buffering=buffering) if path else None
        self.on_error = on_error

    def _append(self, line: str) -> None:
        try:
            self._file.write(line)
        except OSError as err:
            self._failed(err)
            raise

    def _failed(self, err: BaseException) -> None:
        if self.on_error is not None:
            self.on_error(err)

    def flush(self) -> int:
        """Flush to the kernel; the file's length in bytes, everything written so far included."""
        if self._file is None:
            return 0
        try:
            self._file.flush()
        except OSError as err:
            self._failed(err)
            raise
        return os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class MetricsLog(AppendLog):
    """``metrics.jsonl``, line-buffered. Every line is strict JSON: a value that is not finite is
    written as null."""

    def __init__(self, path: str | None):
        super().__init__(path, buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:  # nearly every line is finite: encoded as it is, without a copy of the record
            line = json.dumps(record, default=_plain_number, allow_nan=False)
        except ValueError:  # a value that is not finite: written as null
            line = json.dumps(finite_json(record), default=_as_finite_float, allow_nan=False)
        self._append(line + "\n")


def step_record(*, policy: str, version: int, elapsed: float, metrics: dict[str, Any],
                batch_metrics: dict[str, Any], cfg: DataflowConfig, counts: Counter,
                staleness_hist: Counter, generated: Generated, trainer_wait_s: float,
                node_versions: dict[str, Any], by_source: dict[str, dict[str, int]] | None,
                failed_tasks: int = 0, failed_tasks_total: int = 0) -> dict[str, Any]:
    """The metrics line of ``policy``'s step ``version`` (one per policy and step).

    It holds the trainer's own ``metrics``, the batch's (``data_*``: wait, staleness histogram
    of the batch, replays), the rules in use and the policy's cumulative dataflow counts:
    ``accepted`` / ``filtered`` (group filter) / ``stale_dropped`` / ``overflow_dropped`` /
    ``replayed`` / ``consumed`` sequences (``replayed``, ``consumed``, ``staleness_hist`` and
    ``consumed_by_source``: of the versions committed so far, not the batch a trainer holds
    ahead), ``curator_skipped`` prompts (the curator runs before
    rollout, for all policies: counted on the first), ``admission_refused`` (times a new group
    was refused because it could not have been trained on; on the first policy too),
    ``staleness_hist`` over every consumed sequence, ``trainer_wait_s`` and
    ``rollouts_per_consumed`` (this policy's training sequences ingested per sequence it
    consumed: the price of filtering and staleness; ``rollouts_generated`` is run-wide, every
    policy's), ``failed_tasks`` (rollout tasks of any policy that failed since the previous step
    line) and ``failed_tasks_total`` (the run's), so that failing episodes show while it runs. With
    several sources
    (``mix``, ``by_source``): ``consumed_by_source`` (cumulative sequences of each source
    consumed by this policy) and ``groups_by_source`` (train groups created). Multi-turn runs
    add ``episode_turns``, ``episode_tool_calls``, ``episode_invalid_call_rate``,
    ``episode_truncated_frac`` and ``episode_env_time_fraction`` (``evals.episode_summary``), and
    ``episode_success`` (the success rate of those episodes: their return may be shaped)."""
    return {
        "step": version,
        "policy": policy,
        "time": elapsed,
        **metrics,
        **{f"data_{k}": v for k, v in batch_metrics.items()},
        "dataflow": {"curator": cfg.curator.type, "group_filter": cfg.group_filter.type,
                     "ordering": cfg.ordering.type, "replay_ratio": cfg.replay_ratio,
                     "max_staleness": cfg.max_staleness, "admission": cfg.admission},
        "accepted": counts["accepted"],
        "filtered": counts["filtered"],
        "stale_dropped": counts["stale_dropped"],
        "overflow_dropped": counts["overflow_dropped"],
        "replayed": counts["replayed"],
        "consumed": counts["consumed"],
        "curator_skipped": counts["curator_skipped"],
        "admission_refused": counts["admission_refused"],
        "failed_tasks": failed_tasks,
        "failed_tasks_total": failed_tasks_total,
        "staleness_hist": {str(k): v for k, v in sorted(staleness_hist.items())},
        "sequences_generated": generated.sequences,
        "rollouts_generated": generated.train_sequences,
        "rollouts_per_consumed": counts["sequences_ingested"] / max(counts["consumed"], 1),
        **generated.rates(elapsed),
        # multi-turn episodes: means over the training episodes since the previous step
        **_train_episode_summary(*generated.take_episode_stats(policy)),
        "trainer_wait_s": trainer_wait_s,
        "node_versions": node_versions,
        **(by_source or {}),
    }


def _train_episode_summary(n: int, sums: dict[str, float]) -> dict[str, float]:
    """``episode_*`` means of a step's training episodes, with their success rate: the reward
    of a multi-turn episode is its return (shaping included), so it does not show success."""
    out = summary_of_sums(n, sums, prefix="episode_")
    if n and "turns" in sums and "success" in sums:
        out["episode_success"] = sums["success"] / n
    return out


def snapshot(*, versions: dict[str, int], cfg: DataflowConfig, rules: dict[str, Any], mixer: Mixer,
             group_seq: int, orders: bool = True) -> dict[str, Any]:
    """What a resumed run needs: the trainers' versions, the rules' own state (random streams
    included) with their ``type`` names, the prompt order of each source and the shuffling
    stream, and the batch-time mixing credit. Leases and buffers are not saved: the tasks of
    an interrupted run end as ``run_ended`` (``DataLayer.finish`` puts the prompts of its groups
    in rollout back at the head of the orders). ``orders`` False: without
    the prompt orders and the shuffling stream (the change log keeps them apart)."""
    out = {
        "versions": dict(versions),
        RULE_TYPES_KEY: {stage: getattr(cfg, stage).type for stage in RULE_STAGES},
        **{stage: plain_state(rules[stage]) for stage in RULE_STAGES},
        **mixer.state_dict(orders),
        "group_seq": group_seq,
    }
    if orders:
        version, internal, gauss = mixer.rng.getstate()
        out["rng_state"] = [version, list(internal), gauss]
    return out


def restore(state: dict[str, Any], *, versions: dict[str, int], cfg: DataflowConfig, rules: dict[str, Any],
            mixer: Mixer) -> int:
    """Load a ``snapshot`` into the parts; returns the saved group counter. A rule whose
    ``type`` changed in the config since the state was saved starts fresh (with a warning)
    instead of loading foreign state."""
    versions.update({p: v for p, v in state["versions"].items() if p in versions})
    saved_types = state.get(RULE_TYPES_KEY, {})
    for stage in RULE_STAGES:
        current = getattr(cfg, stage).type
        if saved_types.get(stage, current) != current:
            log.warning("dataflow.%s changed from %r to %r since the run was saved: it starts fresh",
                        stage, saved_types[stage], current)
            continue
        rules[stage].load_state_dict(state[stage])
    mixer.load_state_dict(state)
    if "rng_state" in state:
        version, internal, gauss = state["rng_state"]
        mixer.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
    return state["group_seq"]


def load(path: Path) -> dict[str, Any] | None:
    """The saved state at ``path`` (``snapshot``), or None when there is none; a ValueError
    naming the file and the fix when it is not one."""
    if not path.exists():
        return None
    fix = ("move it aside to resume without it (the trainers continue from their weights; the prompt "
           "order and the rules' state start afresh), or start a new run directory")
    try:
        state = read_json_object(path)
    except UnreadableFile as err:
        raise ValueError(f"{err}: {fix}") from None
    missing = [k for k in ("versions", "group_seq", "order", "epoch", *RULE_STAGES) if k not in state]
    if missing or not isinstance(state["versions"], dict) or not isinstance(state["group_seq"], int):
        what = f"lacks {', '.join(missing)}" if missing else "has versions or group_seq of the wrong type"
        raise ValueError(f"{path} is damaged (it {what}): {fix}")
    return state


def save(path: Path, state: dict[str, Any]) -> None:
    write_json(path, state, default=float)


def layer_status(dl: DataLayer, evals: int | None = None) -> dict[str, Any]:
    """The data layer's JSON-able snapshot (``DataLayer.state``): versions, queues, sources,
    buffers and counts, throughput, the per-node table, evaluations (the last ``evals``, or
    all), the ledger, rule state."""
    now = time.time()
    elapsed = now - dl._started
    held = Counter(node for node, _ in dl.leases.held.values())
    return {
        "elapsed_s": elapsed,
        "finished": dl.finished,
        "versions": dict(dl.versions),
        "pending": len(dl.leases.pending),
        "eval_pending": len(dl.leases.eval_pending),
        "leased": len(dl.leases.held),
        "outstanding_groups": len(dl.buffers.rolling),
        "budget": dl.budget,  # groups a gated data layer (run.mode: sync) may still create
        "sources": {s: {"weight": w, "groups_created": dl.mixer.groups_created[s],
                        "consumed": {p: dl.mixer.consumed[p][s] for p in dl.policy_names},
                        "mix_credit": {p: dl.mixer.credit[p][s] for p in dl.policy_names}}
                    for s, w in dl.mixer.weights.items()},
        **dl.buffers.status(),  # buffers, counts, staleness_hist, trainer_wait_s
        "trainer_restarts": dict(dl.trainer_restarts),
        "restored": dl.restored,  # what this data layer continued from (a re-placed or resumed one)
        "snapshots": dl.durability.log.stats(),
        "service_ms": dl.service.summary(),
        "episodes_generated": dl.generated.episodes,
        "sequences_generated": dl.generated.sequences,
        "tokens_generated": dl.generated.tokens,
        **dl.generated.rates(elapsed),
        # silent_s: since the node's last call (the orchestrator replaces a node whose loop went silent)
        "nodes": {n: {**i, "leases_held": held.get(n, 0), "silent_s": now - i.get("last_seen", now)}
                  for n, i in dl.leases.nodes.items() if not i.get("stock")},
        # the workers' lease stocks (``rollout.lease_ahead``): tasks leased ahead, not yet taken
        "lease_stocks": {n: {"worker": i.get("worker"), "leases_held": held.get(n, 0), "leased": i.get("leased", 0)}
                         for n, i in dl.leases.nodes.items() if i.get("stock")},
        "eval": list(dl.evals.results if evals is None else dl.evals.results[-evals:] if evals > 0 else []),
        "ledger": dl.ledger.summary(),
        **({"retention": dl.retention.status()} if dl.retention.enabled else {}),
        **({"rule_error": dl.rule_error} if dl.rule_error else {}),
        "rules_state": {"curator": dl.curator.state_dict(), "group_filter": dl.group_filter.state_dict()},
    }
