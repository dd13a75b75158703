"""Monitoring room: the episode viewer's data, recent and sampled episodes of a run.

:class:`EpisodeReader` -> :class:`EpisodesView` for ``/astraflow/api/episodes.json``: the newest
stored episodes of the run's trajectory store plus a deterministic sample of older ones, each
with its turns (model text and weight versions, tool calls and results, observations, per-turn
and final rewards, truncation) when the workflow recorded an ``episode`` log, filtered by
workload, policy, kind and reward range.

Why it is cheap: everything but the reward and length of an entry lives in its batch's commit
record, so the reader counts batches from the segments' commit logs (only what was appended
since the last request is read), reads only the newest batches (``TrajectoryStore.batch``: two
small array reads, never tokens) and caches them, since a published batch never changes. Each
request reads at most a bounded number of batches it has not seen; the store is only read, so
training is never slowed or blocked. Per filter, the reader remembers how far its newest-first
walk got and what it matched, so that a rare filter's walk goes on where the last request
stopped (the cache may have dropped those batches) and ends, even on a store far larger than
the cache.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from astraflow.runtime.monitoring.view import SCHEMA_VERSION, _View
from storage.atomic import UnreadableFile
from storage.paths import RunPaths
from storage.trajectories import CommittedBatch, TrajectoryStore, open_trajectory_store

MAX_LIMIT = 100
CACHE_ENTRIES = 4096
"""Entries of whole batches an :class:`EpisodeReader` keeps by default."""
MAX_WALKS = 8
"""Filters whose walk an :class:`EpisodeReader` remembers (least recently used dropped first)."""
TEXT_CLIP = 4000
"""Characters kept of one text (model output, tool result, observation) in the view."""


class EpisodeQuery(_View):
    """What the page asks for (the endpoint's query parameters)."""

    limit: int = Field(default=20, ge=1, le=MAX_LIMIT, description="newest matching episodes at most")
    sample: int = Field(default=10, ge=0, le=MAX_LIMIT, description="older matching episodes sampled at most")
    workload: str | None = Field(default=None, description="payload source, or the run's workload name")
    policy: str | None = Field(default=None, description="a policy that acted in the episode")
    kind: Literal["train", "eval"] | None = None
    min_reward: float | None = Field(default=None, allow_inf_nan=False)
    max_reward: float | None = Field(default=None, allow_inf_nan=False)

    @model_validator(mode="after")
    def _range(self) -> EpisodeQuery:
        """An empty reward range is a mistake, not a filter that matches nothing."""
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ValueError(f"min_reward {self.min_reward} is above max_reward {self.max_reward}")
        return self

    def filter_key(self) -> tuple:
        """What selects the episodes (``limit`` and ``sample`` only say how many)."""
        return self.workload, self.policy, self.kind, self.min_reward, self.max_reward


class CallView(_View):
    """One tool call of a model turn: a well-formed call with its result, or why it could not be read."""

    name: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    result: str | None = None
    valid: bool | None = Field(default=None, description="False for a call the tool refused and for one that "
                               "could not be read (both count in the episode's invalid_calls)")
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
                      valid=c.get("valid", False if c.get("error") else None),  # unreadable: counted invalid
                      error=_clip(c.get("error"))) for c in t.get("calls") or []]
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
        # a single-turn episode has no episode log: its source is in the meta (``Trajectory.source``)
        source = task.get("source") if isinstance(task, dict) else meta.get("source")
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


@dataclass
class _Walk:
    """How far the newest-first walk of one filter got: per segment the batch count when it
    began (``top``) and the oldest batch walked (``low``); ``hits``: the matches of the batches
    walked, newest first (the newest `MAX_LIMIT` at most)."""

    top: dict[str, int]
    low: dict[str, int]
    hits: list[EpisodeView]


class EpisodeReader:
    """Reads episodes of one run directory; keeps the batches it read (they never change).
    Not thread-safe: the dashboard calls it from one thread."""

    def __init__(self, run_dir: str | Path, *, read_budget: int = 32, cache_entries: int | None = None):
        """``read_budget``: batches not yet cached read per request at most (half for the
        newest, plus one per segment, half for the sample); ``cache_entries``: entries kept
        (whole batches, least recently used dropped first: it bounds the memory used;
        `CACHE_ENTRIES` when not given)."""
        self.paths = RunPaths(run_dir)
        self.read_budget = read_budget
        self.cache_entries = CACHE_ENTRIES if cache_entries is None else cache_entries
        self._cache: OrderedDict[tuple[str, int], list[EpisodeView]] = OrderedDict()
        self._cached = 0  # entries in the cache
        self._store: TrajectoryStore | None = None
        self._config: tuple[float, dict[str, Any]] | None = None
        self._workload = ""  # the run's workload name: an episode's workload when its payload names no source
        self._lowest: dict[str, int] = {}  # per segment, the oldest batch the last newest-first walk read
        self._walks: OrderedDict[tuple, _Walk] = OrderedDict()
        self._names: tuple[set[str], set[str]] = (set(), set())  # workloads and policies of the episodes read

    def _run_config(self) -> dict[str, Any]:
        """The resolved config the run wrote (re-read when it changes; ``{}`` before it exists).
        One that is no YAML mapping is an `UnreadableFile` naming it, not a parser's traceback."""
        try:
            mtime = self.paths.config.stat().st_mtime
        except FileNotFoundError:
            return {}
        if self._config is None or self._config[0] != mtime:
            try:
                cfg = yaml.safe_load(self.paths.config.read_text(encoding="utf-8")) or {}
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
                cfg = err
            if not isinstance(cfg, dict):
                why = (f"{type(cfg).__name__}: {(str(cfg).splitlines() or [''])[0]}" if isinstance(cfg, Exception)
                       else f"a YAML {type(cfg).__name__}, not a mapping")
                raise UnreadableFile(f"{self.paths.config} is not the config a run writes ({why}): restore it from "
                                     "a copy (`astraflow run` writes it at its start)")
            self._config = (mtime, cfg)
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
        try:
            return self._view(q)
        except OSError:  # a segment deleted while it was read (storage.keep_trajectories: false): once more
            self._store = None  # its cached views go: the store is listed afresh
            self._walks.clear()
            return self._view(q)

    def _view(self, q: EpisodeQuery) -> EpisodesView:
        cfg = self._run_config()
        wl = cfg.get("workload") or {}
        self._workload = str(wl.get("name", ""))
        # a mixture's episodes carry their source, never the mixture's own name (which is added
        # below only where stored episodes bear it): offering it would filter to nothing
        workloads = set(((wl.get("params") or {}).get("sources") or {})) or {self._workload}
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
        for e in seen + recent:
            self._names[0].add(e.workload)
            self._names[1].update(e.policies)
        workloads |= self._names[0]
        policies |= self._names[1]
        return EpisodesView(**{**empty, "recent": recent, "sampled": sampled, "batches": sum(counts.values()),
                               "partial": partial}, store=store.url, note=None,
                            workloads=sorted(workloads - {""}), policies=sorted(policies))

    def _newest(self, store, counts, q, budget, seen) -> tuple[list[EpisodeView], bool]:
        """The newest ``q.limit`` matches, walking the batches newest first (`_walk`). The walk of
        this filter goes on from where the last request left it; batches published since are
        walked first. What it returns is always the true newest (``partial``: fewer than asked;
        the next request goes further). Sets ``self._lowest`` to the oldest batch walked."""
        key = q.filter_key()
        w = self._walks.pop(key, None)
        if w is None or any(counts.get(seg, 0) < n for seg, n in w.top.items()):  # new, or another store
            w = _Walk(top={}, low={}, hits=[])
        if counts != w.top:  # batches published since: newer than every one walked
            low = dict(counts)
            new, ended = self._walk(store, low, w.top, q, q.limit, budget, seen)
            if ended:
                w = _Walk(top=dict(counts), low={s: min(n, w.low.get(s, n)) for s, n in low.items()},
                          hits=(new + w.hits)[:MAX_LIMIT])
            else:  # a walk from the top that has not reached the batches walked before: it starts over
                w = _Walk(top=dict(counts), low=low, hits=new[:MAX_LIMIT])
        ended = all(n <= 0 for n in w.low.values())
        if len(w.hits) < q.limit and not ended:
            more, ended = self._walk(store, w.low, {}, q, q.limit - len(w.hits), budget, seen)
            w.hits = (w.hits + more)[:MAX_LIMIT]
        self._walks[key] = w
        while len(self._walks) > MAX_WALKS:
            self._walks.popitem(last=False)
        self._lowest = dict(w.low)
        return w.hits[:q.limit], len(w.hits) < q.limit and not ended

    def _walk(self, store, low, floor, q, want, budget, seen) -> tuple[list[EpisodeView], bool]:
        """Walk newest first across segments (a heap on publication time) the batches of each
        segment below ``low[seg]`` and not below ``floor[seg]``, moving ``low`` down, until
        ``want`` matches or the budget is spent. Returns the matches, newest first, and whether
        every such batch was walked."""
        heap, out = [], []
        for seg, n in sorted(low.items()):
            if n > floor.get(seg, 0):
                views = self._batch(store, (seg, n - 1), budget)
                if views is None:
                    return out, False
                heapq.heappush(heap, (-views[0].written_at, seg, n - 1, views))
        while heap and len(out) < want:
            _, seg, seqno, views = heapq.heappop(heap)
            low[seg] = seqno
            seen.extend(views)
            out.extend(e for e in reversed(views) if matches(e, q))
            if seqno > floor.get(seg, 0) and len(out) < want:
                older = self._batch(store, (seg, seqno - 1), budget)
                if older is None:
                    return out, False
                heapq.heappush(heap, (-older[0].written_at, seg, seqno - 1, older))
        return out, all(n <= floor.get(seg, 0) for seg, n in low.items())

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
