"""Monitoring room: the episode viewer's data, recent and sampled episodes of a run.

:class:`EpisodeReader` -> :class:`EpisodesView` for ``/astraflow/api/episodes.json``: the newest
stored episodes of the run's trajectory store plus a deterministic sample of older ones, each
with its turns (model text and weight versions, tool calls and results, observations, per-turn
and final rewards, truncation) when the workflow recorded an ``episode`` log, filtered by
workload, policy, kind and reward range.

Why it is cheap: everything but the reward and length of an entry lives in its batch's commit
record, so the reader counts batches from the segments' commit logs (only what was appended
since the last request is read), reads only the newest batches (``TrajectoryStore.batch``: two
small array reads, never tokens) and caches them, since a published batch never changes. Each request reads at most a bounded number of
batches it has not seen; the store is only read, so training is never slowed or blocked.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from astraflow.runtime.monitoring.view import SCHEMA_VERSION, _View
from storage.paths import RunPaths
from storage.trajectories import CommittedBatch, TrajectoryStore, open_trajectory_store

MAX_LIMIT = 100
TEXT_CLIP = 4000
"""Characters kept of one text (model output, tool result, observation) in the view."""


class EpisodeQuery(_View):
    """What the page asks for (the endpoint's query parameters)."""

    limit: int = Field(default=20, ge=1, le=MAX_LIMIT, description="newest matching episodes at most")
    sample: int = Field(default=10, ge=0, le=MAX_LIMIT, description="older matching episodes sampled at most")
    workload: str | None = Field(default=None, description="payload source, or the run's workload name")
    policy: str | None = Field(default=None, description="a policy that acted in the episode")
    kind: Literal["train", "eval"] | None = None
    min_reward: float | None = None
    max_reward: float | None = None


class CallView(_View):
    """One tool call of a model turn: a well-formed call with its result, or why it could not be read."""

    name: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    result: str | None = None
    valid: bool | None = None
    error: str | None = None


class MessageView(_View):
    role: str
    content: str


class TurnView(_View):
    """One turn: ``model`` (text, weight versions, finish) or ``observation``/``tool``/``env``
    (messages, reward, calls; ``done`` and ``info`` on the last one)."""

    kind: str
    start: int = Field(description="token span [start, end) in the episode's sequence")
    end: int
    text: str | None = None
    versions: list[int] = Field(default_factory=list, description="[oldest, newest] weight version of a model turn")
    finish: str | None = None
    messages: list[MessageView] = Field(default_factory=list)
    reward: float | None = None
    calls: list[CallView] = Field(default_factory=list)
    done: bool = False
    info: dict[str, Any] = Field(default_factory=dict)


class EpisodeView(_View):
    """One stored sequence; ``turns`` is empty for workflows without an episode log (single turn)."""

    id: str = Field(description="<segment>/<entry index>: where it is stored")
    written_at: float = Field(description="time.time() when its batch was published")
    task_id: str
    group_id: str
    seq_index: int
    num_sequences: int
    workload: str
    workflow: str
    kind: str
    policies: list[str]
    attempt: int
    node: str | None
    reward: float = Field(description="the stored reward (an agentic episode's return)")
    rewards: dict[str, float] = Field(description="its parts, e.g. final and turns")
    score: float | None
    stats: dict[str, float]
    finish_reason: str
    num_tokens: int
    task: dict[str, Any] | None = Field(description="the task payload (agentic episodes)")
    turns: list[TurnView]
    truncated: str | None = Field(description="max_turns | context | None")
    final_reward: float | None


class EpisodesView(_View):
    """The answer of ``/astraflow/api/episodes.json``."""

    schema_version: int
    run_dir: str
    store: str | None = Field(description="the trajectory store read, None when it cannot be read here")
    note: str | None = Field(description="why nothing is shown, when that is the case")
    workloads: list[str] = Field(description="workload names to filter by (config and episodes seen)")
    policies: list[str]
    batches: int = Field(description="published batches in the store")
    partial: bool = Field(description="the read budget ran out before `limit` newest matches were found")
    recent: list[EpisodeView] = Field(description="newest matching episodes, newest first")
    sampled: list[EpisodeView] = Field(description="matching episodes sampled evenly from older batches")


def _clip(x: Any) -> Any:
    """Untrusted text, bounded: long strings are cut (``…[+N chars]``), containers recursed."""
    if isinstance(x, str):
        return x if len(x) <= TEXT_CLIP else x[:TEXT_CLIP] + f"…[+{len(x) - TEXT_CLIP} chars]"
    if isinstance(x, dict):
        return {str(k): _clip(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clip(v) for v in x]
    return x


def _turn(t: dict[str, Any]) -> TurnView:
    calls = [CallView(name=c.get("name"), arguments=_clip(c.get("arguments") or {}), result=_clip(c.get("result")),
                      valid=c.get("valid"), error=_clip(c.get("error"))) for c in t.get("calls") or []]
    msgs = [MessageView(role=str(m.get("role", "")), content=_clip(str(m.get("content", ""))))
            for m in t.get("messages") or []]
    return TurnView(kind=str(t.get("kind", "?")), start=int(t.get("start", 0)), end=int(t.get("end", 0)),
                    text=_clip(t.get("text")), versions=[int(v) for v in t.get("versions") or []],
                    finish=t.get("finish"), messages=msgs, reward=t.get("reward"), calls=calls,
                    done=bool(t.get("done", False)), info=_clip(t.get("info") or {}))


def episode_views(batch: CommittedBatch, run_workload: str) -> list[EpisodeView]:
    """The entries of one published batch as views, in entry order."""
    out = []
    s = batch.strings
    for j in range(batch.end - batch.start):
        meta = json.loads(s["meta"][j])
        ep = meta.get("episode") or {}
        task = ep.get("task")
        source = task.get("source") if isinstance(task, dict) else None
        out.append(EpisodeView(
            id=f"{batch.segment}/{batch.start + j}", written_at=batch.written_at,
            task_id=s["task_id"][j], group_id=s["group_id"][j], seq_index=int(batch.index[j, 2]),
            num_sequences=int(batch.index[j, 3]),
            workload=str(source or run_workload), workflow=str(meta.get("workflow", "")),
            kind=str(meta.get("kind", "")), policies=[str(p) for p in meta.get("policies", [])],
            attempt=int(meta.get("attempt", 0)), node=(meta.get("provenance") or {}).get("node"),
            reward=float(batch.rewards[j]), rewards={k: float(v) for k, v in (meta.get("rewards") or {}).items()},
            score=meta.get("score"), stats={k: float(v) for k, v in (meta.get("stats") or {}).items()},
            finish_reason=s["finish_reason"][j], num_tokens=int(batch.index[j, 1]),
            task=_clip(task) if isinstance(task, dict) else None,
            turns=[_turn(t) for t in ep.get("turns") or []], truncated=ep.get("truncated"),
            final_reward=ep.get("final_reward"),
        ))
    return out


def matches(e: EpisodeView, q: EpisodeQuery) -> bool:
    return ((q.workload is None or e.workload == q.workload)
            and (q.policy is None or q.policy in e.policies)
            and (q.kind is None or e.kind == q.kind)
            and (q.min_reward is None or e.reward >= q.min_reward)
            and (q.max_reward is None or e.reward <= q.max_reward))


class EpisodeReader:
    """Reads episodes of one run directory; keeps the batches it read (they never change).
    Not thread-safe: the dashboard calls it from one thread."""

    def __init__(self, run_dir: str | Path, *, read_budget: int = 32, cache_entries: int = 4096):
        """``read_budget``: batches not yet cached read per request at most (half for the
        newest, plus one per segment, half for the sample); ``cache_entries``: entries kept
        (whole batches, least recently used dropped first: it bounds the memory used)."""
        self.paths = RunPaths(run_dir)
        self.read_budget = read_budget
        self.cache_entries = cache_entries
        self._cache: OrderedDict[tuple[str, int], list[EpisodeView]] = OrderedDict()
        self._cached = 0  # entries in the cache
        self._store: TrajectoryStore | None = None
        self._config: tuple[float, dict[str, Any]] | None = None
        self._workload = ""  # the run's workload name: an episode's workload when its payload names no source
        self._lowest: dict[str, int] = {}  # per segment, the oldest batch the last newest-first walk read

    def _run_config(self) -> dict[str, Any]:
        """The resolved config the run wrote (re-read when it changes; ``{}`` before it exists)."""
        try:
            mtime = self.paths.config.stat().st_mtime
        except FileNotFoundError:
            return {}
        if self._config is None or self._config[0] != mtime:
            self._config = (mtime, yaml.safe_load(self.paths.config.read_text()) or {})
        return self._config[1]

    def _batch(self, store: TrajectoryStore, key: tuple[str, int], budget: list[int]) -> list[EpisodeView] | None:
        """The views of batch ``key``; ``None`` when it is not cached and ``budget`` is spent."""
        got = self._cache.get(key)
        if got is not None:
            self._cache.move_to_end(key)
            return got
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        got = self._cache[key] = episode_views(store.batch(*key), self._workload)
        self._cached += len(got)
        while self._cached > self.cache_entries and len(self._cache) > 1:
            self._cached -= len(self._cache.popitem(last=False)[1])
        return got

    def view(self, q: EpisodeQuery) -> EpisodesView:
        cfg = self._run_config()
        wl = cfg.get("workload") or {}
        self._workload = str(wl.get("name", ""))
        workloads = {self._workload} | set(((wl.get("params") or {}).get("sources") or {}))
        policies = {str(p.get("name")) for p in cfg.get("policies") or [] if isinstance(p, dict)}
        url = (cfg.get("storage") or {}).get("trajectories") or str(self.paths.trajectories)
        empty = dict(schema_version=SCHEMA_VERSION, run_dir=str(self.paths.root), batches=0, partial=False,
                     recent=[], sampled=[])
        if str(url).startswith("memory://"):
            return EpisodesView(**empty, store=None, workloads=sorted(workloads - {""}), policies=sorted(policies),
                                note=f"the trajectory store {url} lives inside the run's processes: "
                                     "point storage.trajectories at a directory to view episodes here")
        if self._store is None:
            try:
                self._store = open_trajectory_store(url, mode="r")
            except FileNotFoundError:
                return EpisodesView(**empty, store=str(url), workloads=sorted(workloads - {""}),
                                    policies=sorted(policies), note="no trajectories stored yet")
        store = self._store
        counts = {seg: n for seg in store.segments() if (n := store.batch_count(seg))}
        budget = [self.read_budget - self.read_budget // 2 + len(counts)]  # the walk starts at every segment
        seen: list[EpisodeView] = []
        recent, partial = self._newest(store, counts, q, budget, seen)
        budget = [self.read_budget // 2]
        sampled = self._sample(store, counts, q, budget, seen)
        for e in seen:
            workloads.add(e.workload)
            policies.update(e.policies)
        return EpisodesView(**{**empty, "recent": recent, "sampled": sampled, "batches": sum(counts.values()),
                               "partial": partial}, store=store.url, note=None,
                            workloads=sorted(workloads - {""}), policies=sorted(policies))

    def _newest(self, store, counts, q, budget, seen) -> tuple[list[EpisodeView], bool]:
        """Walk the batches newest first across segments (a heap on publication time, seeded
        with each segment's last batch) until ``q.limit`` matches. The walk stops where the
        budget does, so what it returns is always the true newest (``partial``: fewer than
        asked; the next request, with these batches cached, goes further). Records in
        ``self._lowest`` the oldest batch walked per segment."""
        self._lowest = dict(counts)
        heap, out = [], []
        for seg, n in sorted(counts.items()):
            views = self._batch(store, (seg, n - 1), budget)
            if views is None:
                return [], True
            heapq.heappush(heap, (-views[0].written_at, seg, n - 1, views))
        while heap and len(out) < q.limit:
            _, seg, seqno, views = heapq.heappop(heap)
            self._lowest[seg] = seqno
            seen.extend(views)
            out.extend(e for e in reversed(views) if matches(e, q))
            if seqno > 0 and len(out) < q.limit:
                older = self._batch(store, (seg, seqno - 1), budget)
                if older is None:
                    return out, True
                heapq.heappush(heap, (-older[0].written_at, seg, seqno - 1, older))
        return out[:q.limit], False

    def _sample(self, store, counts, q, budget, seen) -> list[EpisodeView]:
        """``q.sample`` batches evenly spaced over the batches older than the newest walk (in
        segment, then publication order), one matching entry (the middle one) from each."""
        older = [(seg, self._lowest[seg]) for seg in sorted(counts) if self._lowest[seg] > 0]
        total = sum(n for _, n in older)
        k = min(q.sample, total)
        out = []
        for i in range(k):
            pos = (2 * i + 1) * total // (2 * k)
            for seg, n in older:
                if pos < n:
                    break
                pos -= n
            views = self._batch(store, (seg, pos), budget)
            if views is None:
                break
            seen.extend(views)
            hits = [e for e in views if matches(e, q)]
            if hits:
                out.append(hits[len(hits) // 2])
        return out
