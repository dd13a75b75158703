"""Evaluation rounds: held-out accuracy of the first policy at chosen versions.

A round at version ``v`` is ``k`` evaluation tasks per held-out prompt (greedy when ``k`` is
1), leased before any training task. A round may run on ``v`` or newer weights (nodes never go
back; ``eval_version_min``/``max`` record which); the first round, and a resumed run's first,
gate training, so they measure exactly the weights training starts from. Rounds overlap and a
later one can finish first: records are written in version order, a finished round waiting for
every earlier one (``write``).
Only rounds not yet written are held; a written round leaves its record (``results``, the run's
eval history) and its version (a version is evaluated once), so that neither the layer's memory
nor its snapshot grows with the prompts of every round ever run.
"""

from __future__ import annotations

import bisect
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from astraflow.contracts import RolloutTask, TrajectoryRef

log = logging.getLogger("astraflow.dataflow")


@dataclass
class EvalRound:
    version: int
    policy: str
    k: int
    rewards: dict[str, list[float]] = field(default_factory=dict)  # prompt -> rewards
    remaining: int = 0
    started: float = field(default_factory=time.time)
    #: when a node first leased one of its tasks: ``eval_seconds`` counts from there, not from
    #: ``started`` (the first round's tasks wait for the run's nodes to load their models)
    leased_at: float | None = None
    #: the first policy's oldest version of each answer (what a round saved by an earlier
    #: AstraFlow recorded; ``version_range`` now)
    versions_used: list[int] = field(default_factory=list)
    #: per policy, the oldest and the newest weight version that generated the answers
    version_range: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: eval group id -> source of its prompt (mixtures only)
    sources: dict[str, str] = field(default_factory=dict)
    #: eval group id -> the prompt's ``difficulty`` (payloads that have one)
    difficulty: dict[str, str] = field(default_factory=dict)
    #: episode statistics of the round's episodes (``TrajectoryRef.stats``)
    stats: list[dict[str, float]] = field(default_factory=list)
    #: eval group id -> the second evaluation set of its prompt (payloads with ``eval_set``)
    sets: dict[str, str] = field(default_factory=dict)
    #: episode statistics of each second evaluation set
    set_stats: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    #: the finished record; written once every earlier round of the policy is written too
    result: dict[str, Any] | None = None
    written: bool = False
    #: the round's tasks that failed (their prompts are left out of its accuracy)
    failed: int = 0


def _ranges(rnd: EvalRound) -> dict[str, tuple[int, int]]:
    """``rnd.version_range``, made where a round saved by an earlier AstraFlow has none."""
    return rnd.__dict__.setdefault("version_range", {})


class EvalRounds:
    """Rounds by version, their tasks, and the records of finished rounds."""

    def __init__(self, payloads: list[dict[str, Any]], sources: list[str], *, k: int, policies: list[str],
                 workflow: str, by_source: bool, started: float, write: Callable[[dict[str, Any]], None],
                 final: int | None = None):
        self.payloads, self.sources = payloads, sources
        #: prompts of second evaluation sets (an ``eval_set`` tag: HumanEval next to a held-out
        #: split) run only in the first round and in rounds at ``final`` or later, which bounds
        #: their cost; they are reported apart (``eval_sets``), not in ``eval_accuracy``
        self.final = final
        self.by_source = by_source  # records add ``eval_accuracy_by_source`` (several sources)
        self.k = k
        self.policies = list(policies)
        self.workflow = workflow
        self.started = started  # the data layer's start: records' ``time``
        self._write = write
        #: versions of the rounds written (a record, or none for a round with no prompt), ascending:
        #: all that a written round leaves besides its record
        self._finished = array("q")
        self._rounds: dict[int, EvalRound] = {}
        self._results: list[dict[str, Any]] = []
        #: the version of a resumed run's first round, which training waits for as for the run's first
        self.gate: int | None = None

    @property
    def rounds(self) -> dict[int, EvalRound]:
        """The rounds not yet written, by version."""
        return self._rounds

    @rounds.setter
    def rounds(self, rounds: dict[int, EvalRound]) -> None:
        """Restored rounds; the written ones of an earlier AstraFlow's snapshot leave only their version."""
        for v in [v for v, r in rounds.items() if r.written]:
            del rounds[v]
            self._finish(v)
        self._rounds = rounds

    @property
    def results(self) -> list[dict[str, Any]]:
        """The records written, in version order: the run's eval history (``state()["eval"]``)."""
        return self._results

    @results.setter
    def results(self, results: list[dict[str, Any]]) -> None:
        """Restored records: their versions are finished."""
        self._results = results
        for r in results:
            if isinstance(r.get("step"), int):
                self._finish(r["step"])

    def _finish(self, version: int) -> None:
        i = bisect.bisect_left(self._finished, version)
        if i == len(self._finished) or self._finished[i] != version:
            self._finished.insert(i, version)

    def start(self, version: int, taken: Callable[[str], bool] = lambda task_id: False) -> list[RolloutTask]:
        """The tasks of a new round at ``version`` (none if it exists or is written). ``taken(task_id)``:
        whether the ledger knows a task of that id (a round at this version that an earlier run's end
        cut short): the new round's ids then carry ``.N``, the first N free."""
        if version in self.rounds or self.done(version):
            return []
        first = not self.rounds and not self._finished
        with_sets = first or (self.final is not None and version >= self.final)
        chosen = [(i, p) for i, p in enumerate(self.payloads) if with_sets or "eval_set" not in p]
        prefix, n = f"eval-v{version}", 0
        while any(taken(f"{prefix}-{i}/0") for i, _ in chosen):
            n += 1
            prefix = f"eval-v{version}.{n}"
        # no held-out prompt to evaluate (an empty test split): the round is over before it starts,
        # with no record (an accuracy of nothing would read as 0)
        if not chosen:
            self._finish(version)
            return []
        rnd = EvalRound(version=version, policy=self.policies[0], k=self.k, remaining=len(chosen) * self.k)
        self.rounds[version] = rnd
        sampling = {"greedy": True} if self.k == 1 else None
        tasks = []
        for i, payload in chosen:
            gid = f"{prefix}-{i}"
            if "eval_set" in payload:
                rnd.sets[gid] = str(payload["eval_set"])
            rnd.sources[gid] = self.sources[i]
            if "difficulty" in payload:
                rnd.difficulty[gid] = str(payload["difficulty"])
            tasks += [RolloutTask(task_id=f"{gid}/{j}", group_id=gid, policies=tuple(self.policies),
                                  workflow=self.workflow, prompt=payload, kind="eval", sampling=sampling,
                                  min_version=version)
                      for j in range(self.k)]
        return tasks

    def initial_done(self) -> bool:
        """Training waits for the first round, and for a resumed run's first (``gate``), so that
        it measures exactly the weights training starts from (no newer version exists before the
        first batch is served)."""
        if not self.rounds:
            return True
        held = self.rounds.get(self.gate) if self.gate is not None else None
        if held is not None:
            return held.remaining <= 0
        low = min(self.rounds)
        return self.rounds[low].remaining <= 0 or (len(self._finished) > 0 and self._finished[0] < low)

    def done(self, version: int) -> bool:
        """Whether the round at ``version`` is written (with no held-out prompt, every round is
        over before it starts: also after a restore, which finds no record of one)."""
        if not self.payloads:
            return True
        i = bisect.bisect_left(self._finished, version)
        return i < len(self._finished) and self._finished[i] == version

    def leased(self, task: RolloutTask) -> None:
        """A node leased an evaluation task: its round's clock starts with the first."""
        rnd = self.rounds.get(task.min_version)
        if rnd is not None and getattr(rnd, "leased_at", None) is None:  # a round saved before the field
            rnd.leased_at = time.time()

    def record(self, task: RolloutTask, ref: TrajectoryRef) -> None:
        """An evaluation task completed."""
        rnd = self.rounds.get(task.min_version)
        if rnd is None:  # its round is written or forgotten already
            return
        rnd.rewards.setdefault(task.group_id, []).append(ref.score)
        if ref.stats:
            extra = rnd.sets.get(task.group_id)
            (rnd.stats if extra is None else rnd.set_stats.setdefault(extra, [])).append(dict(ref.stats))
        newest, ranges = ref.newest or {}, _ranges(rnd)
        for s in ref.sequences:
            for p, (_, oldest) in s.policy_tokens.items():
                lo, hi = ranges.get(p, (oldest, oldest))
                ranges[p] = (min(lo, oldest), max(hi, oldest, newest.get(p, oldest)))
        rnd.remaining -= 1
        self._maybe_finish(task.min_version)

    def failed(self, task: RolloutTask) -> None:
        """An evaluation task ended as failed: its round finishes without it."""
        if int(task.min_version) in self.rounds:
            self.rounds[int(task.min_version)].remaining -= 1
            self.rounds[int(task.min_version)].failed += 1
            self._maybe_finish(int(task.min_version))

    def _maybe_finish(self, version: int) -> None:
        rnd = self.rounds[version]
        if rnd.remaining > 0 or rnd.result is not None:
            return
        per_prompt = [r for gid, r in rnd.rewards.items() if gid not in rnd.sets]
        # a round none of whose prompts was scored (every task failed) has no accuracy, not 0
        scores = {}
        if per_prompt:
            avg = float(np.mean([np.mean(r) for r in per_prompt]))
            scores = {"eval_accuracy": avg, f"eval_avg@{rnd.k}": avg,
                      f"eval_pass@{rnd.k}": float(np.mean([max(r) > 0 for r in per_prompt]))}
        ranges = _ranges(rnd)
        # a round saved by an earlier AstraFlow holds its first answers' oldest versions as a list
        seen = [*ranges.get(rnd.policy, ()), *rnd.versions_used]
        first_range = (min(seen, default=version), max(seen, default=version))
        result = {
            "step": version,
            "policy": rnd.policy,
            "time": time.time() - self.started,
            **scores,
            "eval_prompts": len(per_prompt),
            "eval_failed_tasks": rnd.failed,
            # an evaluation requested at v runs on v or newer weights (nodes never go back);
            # the first one gates training, so it always runs on exactly the starting weights
            "eval_version_min": first_range[0],
            "eval_version_max": first_range[1],
            "eval_seconds": time.time() - (getattr(rnd, "leased_at", None) or rnd.started),
        }
        if len(ranges) > 1:  # several policies answered: the weights of each
            result["eval_versions"] = {p: list(r) for p, r in sorted(ranges.items())}
        result.update(episode_summary(rnd.stats, prefix="eval_"))
        if rnd.sets:
            result["eval_sets"] = self._sets(rnd)
        if rnd.difficulty:
            levels: dict[str, list[list[float]]] = {}
            for gid, r in rnd.rewards.items():
                if gid in rnd.sets:
                    continue
                levels.setdefault(rnd.difficulty.get(gid, "?"), []).append(r)
            result["eval_by_difficulty"] = {
                d: {"accuracy": float(np.mean([np.mean(r) for r in rs])),
                    f"pass@{rnd.k}": float(np.mean([max(r) > 0 for r in rs])), "prompts": len(rs)}
                for d, rs in sorted(levels.items())}
        if self.by_source:
            by_source: dict[str, list[float]] = {}
            for gid, r in rnd.rewards.items():
                if gid in rnd.sets:
                    continue
                by_source.setdefault(rnd.sources[gid], []).append(float(np.mean(r)))
            result["eval_accuracy_by_source"] = {s: float(np.mean(v)) for s, v in by_source.items()}
        rnd.result = result
        # what only the record needed: a round held back behind an earlier one keeps its record alone
        rnd.rewards, rnd.sources, rnd.difficulty, rnd.sets = {}, {}, {}, {}
        rnd.stats, rnd.set_stats, rnd.versions_used, rnd.version_range = [], {}, [], {}
        self.write()

    @staticmethod
    def _sets(rnd: EvalRound) -> dict[str, dict[str, Any]]:
        """Accuracy, pass@k, prompts and episode statistics of each second evaluation set."""
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(set(rnd.sets.values())):
            rs = [r for gid, r in rnd.rewards.items() if rnd.sets.get(gid) == name]
            out[name] = {"accuracy": float(np.mean([np.mean(r) for r in rs])) if rs else 0.0,
                         f"pass@{rnd.k}": float(np.mean([max(r) > 0 for r in rs])) if rs else 0.0,
                         "prompts": len(rs), **episode_summary(rnd.set_stats.get(name, []), prefix="")}
        return out

    def drop_unfinishable(self, alive: Callable[[int], bool] | None = None) -> list[int]:
        """Forget the unfinished rounds that can no longer finish, and write the records held back
        behind them. A round's tasks ended without it when the run ended with it open (``alive``
        None: every unfinished round) or, on a resume, when none of its tasks is left to run
        (``alive(version)`` false): the resumed run would wait for it forever. Returns the versions
        forgotten."""
        dead = [v for v, r in sorted(self.rounds.items()) if r.result is None and (alive is None or not alive(v))]
        for v in dead:
            log.warning("the held-out evaluation of v%d was cut short by the run's end: it is not recorded", v)
            del self.rounds[v]
        self.write()
        return dead

    def write(self, past_unfinished: bool = False) -> None:
        """Write finished records in version order: a finished round waits for the earlier
        ones unless ``past_unfinished`` (at the end of the run, when an unfinished round never
        will finish). A written round is forgotten but for its version (``done``)."""
        for r in sorted(self.rounds.values(), key=lambda r: r.version):
            if r.result is None:
                if past_unfinished:
                    continue
                break
            r.written = True
            del self.rounds[r.version]
            self._finish(r.version)
            self.results.append(r.result)
            self._write(r.result)


#: the statistics of multi-turn episodes (``agents.episode``), summarised as rates below
MULTI_TURN = ("turns", "tool_calls", "invalid_calls", "truncated", "success", "engine_s", "tool_s", "env_s")


def episode_sums(stats: list[dict[str, float]]) -> tuple[int, dict[str, float]]:
    """``(episodes, per-statistic sums)`` of episode statistics: what ``summary_of_sums`` needs."""
    sums: dict[str, float] = {}
    for st in stats:
        for k, v in st.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return len(stats), sums


def episode_summary(stats: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Means of episode statistics (none when episodes report none). Multi-turn episodes:
    turns per episode, tool calls per episode, the invalid-call rate (invalid calls per call
    attempted, malformed ones included), the truncated fraction and the share of episode time
    spent in tools and environments. Any other statistic (a workload's own, ``code_timeout``
    say) is its mean over the episodes, as ``<prefix><name>``."""
    return summary_of_sums(*episode_sums(stats), prefix=prefix)


def summary_of_sums(n: int, sums: dict[str, float], prefix: str) -> dict[str, float]:
    """``episode_summary`` of ``n`` episodes from their statistics' sums (``episode_sums``)."""
    if not n:
        return {}
    means = {f"{prefix}{k}": sums[k] / n for k in sorted(set(sums) - set(MULTI_TURN))}
    if "turns" not in sums:
        return means
    total = {k: sums.get(k, 0.0) for k in ("turns", "tool_calls", "invalid_calls", "truncated", "engine_s",
                                           "tool_s", "env_s")}
    busy = total["engine_s"] + total["tool_s"] + total["env_s"]
    return {f"{prefix}turns": total["turns"] / n, f"{prefix}tool_calls": total["tool_calls"] / n,
            f"{prefix}invalid_call_rate": total["invalid_calls"] / max(total["tool_calls"], 1.0),
            f"{prefix}truncated_frac": total["truncated"] / n,
            f"{prefix}env_time_fraction": (total["tool_s"] + total["env_s"]) / busy if busy > 0 else 0.0, **means}
