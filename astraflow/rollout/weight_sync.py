"""Pulling weights into a RaaS node's engines.

Asynchronous overlap "weight publish vs pull": trainers commit versions to the weight store
at their own pace; the node polls ``latest(policy)`` and loads each newer committed version.
A reader never sees a partial version (it trusts only the commit marker) and holds the
version open while reading so retention cannot delete it under it. The engine applies the
loaded weights between two decoding steps.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping

import torch

from astraflow.weightconv import to_hf_state_dict
from storage import paths
from storage.deltas import DeltaMismatchError, apply_delta, choose_sync, read_stats
from storage.weights import WeightStore


def read_full_version(store: WeightStore, policy: str, version: int) -> dict[str, torch.Tensor]:
    """A committed version's full shards under their HF names (held while read)."""
    with store.hold(policy, version):
        meta = store.manifest(policy, version).get("meta", {})
        return to_hf_state_dict(store.load(policy, version), meta)


class WeightPuller:
    def __init__(self, weights_root: str, engines: Mapping[str, Any], full_resync_every: int = 10,
                 use_deltas: bool = False):
        self.store = WeightStore(weights_root)
        self.engines = engines
        self.full_resync_every = full_resync_every
        self.use_deltas = use_deltas
        #: with deltas: the last loaded version per policy, in the store's layout, as bf16
        self._held: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        #: one record per load: policy, version, mode, bytes, seconds, commit_to_serving_s
        self.history: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # the watcher and an explicit refresh may poll at once

    def poll(self) -> int:
        """Load the latest committed version of every policy that has a newer one; returns how
        many versions were loaded."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        loaded = 0
        for policy, engine in self.engines.items():
            latest = self.store.latest(policy)
            if latest is None or latest.version <= engine.version:
                continue
            t0 = time.time()
            if not self.use_deltas and hasattr(engine, "load_version"):
                # an engine in its own process reads the version itself: nothing to copy here
                engine.load_version(self.store.root, policy, latest.version)
                self.history.append({"policy": policy, "version": latest.version, "mode": "full",
                                     "in_engine_process": True, "load_s": time.time() - t0})
                loaded += 1
                continue
            with self.store.hold(policy, latest.version):
                manifest = self.store.manifest(policy, latest.version)
                state, mode, extra = self._fetch(policy, latest.version, latest.delta_from)
            hf = to_hf_state_dict(state, manifest.get("meta", {}))
            engine.load_weights(hf, latest.version)
            now = time.time()
            self.history.append(
                {
                    "policy": policy,
                    "version": latest.version,
                    "mode": mode,
                    "load_s": now - t0,
                    "commit_to_serving_s": now - latest.committed_at,
                    **extra,
                }
            )
            loaded += 1
        return loaded

    def _fetch(self, policy: str, version: int, delta_from: int | None) -> tuple[dict, str, dict]:
        """The tensors of ``version``: full shards, or the held version plus a delta."""
        if not self.use_deltas:
            return self.store.load(policy, version), "full", {}
        held = self._held.get(policy)
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
        else:
            reason = None
        state = {k: v.to(torch.bfloat16) for k, v in self.store.load(policy, version).items()}
        self._held[policy] = (version, state)
        return state, "full", {"delta_fallback": reason} if reason else {}
