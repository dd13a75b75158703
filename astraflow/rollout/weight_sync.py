"""Pulling weights into a RaaS node's engines.

Asynchronous overlap "weight publish vs pull": trainers commit versions to the weight store
at their own pace; the node polls ``latest(policy)`` and loads the newest committed version (skipping those in between).
A reader never sees a partial version (it trusts only the commit marker) and holds the
version open while reading so retention cannot delete it under it. The engine applies the
loaded weights between two decoding steps.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

import torch

from astraflow.rollout.engine import InferenceEngine
from astraflow.weightconv import to_hf_state_dict
from storage import paths
from storage.deltas import DeltaMismatchError, apply_delta, choose_sync, read_stats
from storage.weights import VersionNotCommitted, WeightStore

#: times a poll looks again for the latest version when the one it found was retired meanwhile
RETIRED_RETRIES = 3


class VersionReader:
    """Reads committed versions for one engine, under their HF names: the full shards, or
    (``use_deltas``) the version it read last, held as bf16, plus the sparse delta between
    the two, with full shards every ``full_resync_every`` versions and whenever a delta does
    not fit. It runs where the weights are needed: in the node for an engine in the node's
    process, in the engine process for a ``ProcessEngine`` (then only a version number
    crosses the pipe, deltas or not)."""

    def __init__(self, weights_root: str, use_deltas: bool = False, full_resync_every: int = 10):
        self.store = WeightStore(weights_root)
        self.use_deltas = use_deltas
        self.full_resync_every = full_resync_every
        #: with deltas: the last version read per policy, in the store's layout, as bf16
        self._held: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}

    def read(self, policy: str, version: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(state_dict, record)``: the version's tensors and how they were read (``mode``
        ``full``/``delta``, or ``again`` for the version held, read again; the ``dtype`` the
        trainer published it in, delta statistics or the reason a delta was not used,
        ``load_s``, ``commit_to_serving_s`` as of the end of the read). A bf16 version comes
        back as bf16 tensors: the engine casts them on load."""
        t0 = time.time()
        with self.store.hold(policy, version):
            manifest = self.store.manifest(policy, version)
            delta_from = self.store.delta_from(policy, version) if self.use_deltas else None
            state, mode, extra = self._fetch(policy, version, delta_from)
        now = time.time()
        meta = manifest.get("meta", {})
        return to_hf_state_dict(state, meta), {
            "policy": policy, "version": version, "mode": mode, "dtype": meta.get("dtype", "fp32"),
            "load_s": now - t0,
            "commit_to_serving_s": now - float(manifest["committed_at"]), **extra}

    def _fetch(self, policy: str, version: int, delta_from: int | None) -> tuple[dict, str, dict]:
        """The tensors of ``version``: full shards, or the held version plus a delta (the held
        tensors themselves when ``version`` is the one held)."""
        if not self.use_deltas:
            return self.store.load(policy, version), "full", {}
        held = self._held.get(policy)
        if held is not None and held[0] == version:  # read again (a load that failed, retried)
            return held[1], "again", {}
        if held is not None and held[0] > version:  # the policy went back to an older version
            held = None
        kind = choose_sync(held[0] if held else None, version, self.full_resync_every,
                           delta_from is not None and held is not None and delta_from == held[0])
        if kind == "delta":
            ddir = paths.delta_dir(self.store.root, policy, held[0], version)
            try:
                state = apply_delta(held[1], ddir)
                stats = read_stats(ddir)
                self._held[policy] = (version, state)
                return state, "delta", {"delta_density": stats.density, "delta_bytes": stats.delta_bytes,
                                        "full_bytes": stats.full_bytes}
            except DeltaMismatchError as err:  # fall back to full shards; recorded in the history
                reason = str(err)
            except (OSError, ValueError, KeyError, TypeError) as err:  # a delta damaged or cut short
                reason = f"the delta {ddir} cannot be read ({type(err).__name__}: {err})"
        else:
            reason = None
        state = {k: v.to(torch.bfloat16) for k, v in self.store.load(policy, version).items()}
        self._held[policy] = (version, state)
        return state, "full", {"delta_fallback": reason} if reason else {}


class WeightPuller:
    """A node's weight watcher: loads every policy's newest committed version into its engine.
    An engine that ``loads_versions_itself`` (``ProcessEngine``) reads the version itself, with a
    ``VersionReader`` of the same settings in its own process; the records of those reads come
    back with the engine's replies and join ``history`` at the next poll."""

    def __init__(self, weights_root: str, engines: Mapping[str, InferenceEngine], full_resync_every: int = 10,
                 use_deltas: bool = False):
        self.store = WeightStore(weights_root)
        self.engines = engines
        self.full_resync_every = full_resync_every
        self.use_deltas = use_deltas
        self.reader = VersionReader(weights_root, use_deltas, full_resync_every)
        #: one record per load: policy, version, mode, load_s, commit_to_serving_s (and the
        #: delta's statistics); ``in_engine_process`` for a read done by the engine's process
        self.history: list[dict[str, Any]] = []
        #: the version last handed to each in-process engine: one that arrives mid-batch waits
        #: there as a pending swap while ``engine.version`` still names the old one
        self._handed: dict[str, int] = {}
        self._lock = threading.Lock()  # the watcher and an explicit refresh may poll at once
        #: guards ``history`` alone: ``recent`` (the node's state, its stop) never waits for a
        #: poll, which holds ``_lock`` through a whole read and load
        self._history_lock = threading.Lock()

    def recent(self, n: int = 5) -> list[dict[str, Any]]:
        """The last ``n`` load records (engine processes' records included as they arrive)."""
        with self._history_lock:
            self._take_engine_records()
            return self.history[-n:]

    def _take_engine_records(self) -> None:
        """Move the engines' records into ``history``; called holding ``_history_lock``."""
        for engine in self.engines.values():
            self.history.extend(engine.take_load_records())
        del self.history[:-100]  # the node reports the last few; keep memory flat on long runs

    def poll(self) -> int:
        """Load the latest committed version of every policy that has a newer one; returns how
        many versions were loaded."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        """Every policy in turn: one whose engine is dead or whose version cannot be read does
        not hold the others back; the first such error is raised once all were tried."""
        loaded = 0
        failed: BaseException | None = None
        with self._history_lock:
            self._take_engine_records()
        for policy, engine in self.engines.items():
            try:
                loaded += self._poll_one(policy, engine)
            except Exception as err:
                failed = failed or err
        if failed is not None:
            raise failed
        return loaded

    def _poll_one(self, policy: str, engine: Any) -> int:
        for attempt in range(RETIRED_RETRIES):
            try:
                return self._load_latest(policy, engine)
            except VersionNotCommitted:  # retired between finding it the latest and reading it
                if attempt == RETIRED_RETRIES - 1:
                    raise
        return 0

    def _load_latest(self, policy: str, engine: Any) -> int:
        latest = self.store.latest(policy)
        if latest is None or latest.version <= max(engine.version, self._handed.get(policy, -1)):
            return 0
        if engine.loads_versions_itself:
            # an engine in its own process reads the version itself: nothing to copy here
            before = engine.version
            engine.load_version(self.store.root, policy, latest.version, use_deltas=self.use_deltas,
                                full_resync_every=self.full_resync_every)
            return int(engine.version > before)  # a pool whose replicas are all dead loads nothing
        state, record = self.reader.read(policy, latest.version)
        engine.load_weights(state, latest.version)
        self._handed[policy] = latest.version
        with self._history_lock:
            self.history.append(record)
        return 1
