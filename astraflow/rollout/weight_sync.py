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

from astraflow.weightconv import to_hf_state_dict
from storage.weights import WeightStore


class WeightPuller:
    def __init__(self, weights_root: str, engines: Mapping[str, Any], full_resync_every: int = 10):
        self.store = WeightStore(weights_root)
        self.engines = engines
        self.full_resync_every = full_resync_every
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
            with self.store.hold(policy, latest.version):
                manifest = self.store.manifest(policy, latest.version)
                state = self.store.load(policy, latest.version)
            state = to_hf_state_dict(state, manifest.get("meta", {}))
            engine.load_weights(state, latest.version)
            now = time.time()
            self.history.append(
                {
                    "policy": policy,
                    "version": latest.version,
                    "mode": "full",
                    "load_s": now - t0,
                    "commit_to_serving_s": now - latest.committed_at,
                }
            )
            loaded += 1
        return loaded
