"""How a RaaS node survives its engine processes dying: restart them within a budget.

A mixin of ``RaaSNode`` (``node``), kept apart from its lease loop: the loop only starts
``_recover`` when an episode failed with ``EngineProcessError`` or an idle engine is found
dead, and leases meanwhile where every policy still has a replica serving. A node that stops
restarts nothing (``scancel`` ends its engine processes with it): a recovery under way gives up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from astraflow.rollout.engine import InferenceEngine
from astraflow.rollout.engine_pool import dead_engines, replicas_of
from astraflow.rollout.process_engine import EngineProcessError

log = logging.getLogger("astraflow.rollout")


class EngineRecovery:
    """Engine restarts of a node; uses the node's ``engines``, ``cfg``, ``counters``,
    ``identity``, ``puller``, ``error``, ``draining``, ``_reviving`` and its stop event ``_stop``."""

    engines: dict[str, InferenceEngine]
    cfg: Any
    counters: dict[str, Any]
    identity: Any
    puller: Any
    error: str | None
    draining: bool
    _reviving: list[InferenceEngine]
    _stop: threading.Event

    async def _recover(self, err: EngineProcessError) -> None:
        """Engine processes died. Restart each (``rollout.engine_restarts`` times per node) and
        load the newest committed weights into it; the episodes it was running have failed and
        are requeued. The node leases meanwhile only where every policy still has a replica
        serving. Past the budget (or an engine that cannot be restarted) the node stops
        leasing, so that other nodes get the tasks instead of this one failing them one after
        another; its heartbeats carry the error, and the orchestrator replaces its worker.
        Once the node stops it returns: a stop does not wait for a model to load, and an engine
        closed under a restart is no error of the node."""
        if self._stop.is_set():
            return
        dead = dead_engines(self.engines)
        restartable = all(r.restartable for e in self.engines.values() for r in replicas_of(e))
        if not dead and restartable:
            return  # an episode of the process restarted before failed late: nothing to do
        budget = self.cfg.engine_restarts - self.counters["engine_restarts"]
        if not dead or not restartable or len(dead) > budget:
            log.error("node %s: %s; no engine restarts left (rollout.engine_restarts = %d): it stops leasing",
                      self.identity.name, err, self.cfg.engine_restarts)
            self.error, self.draining = str(err), True
            return
        self._reviving = [engine for _, engine in dead]
        try:
            for label, engine in dead:
                if self._stop.is_set():
                    return
                await self._restart_engine(label, engine)
            if self._stop.is_set():
                return
            self.counters["weight_loads"] += await asyncio.to_thread(self.puller.poll)
        except Exception as again:  # its starts spent (e.g. the model no longer loads), or the weights did not load
            if self._stop.is_set():  # the node closed the engine it was restarting
                log.info("node %s stops: the engine restart was given up (%s)", self.identity.name, again)
                return
            log.exception("node %s: restarting the engine process failed", self.identity.name)
            self.error, self.draining = f"{err}; restarting it failed: {type(again).__name__}: {again}", True
        finally:
            self._reviving = []

    async def _restart_engine(self, label: str, engine: InferenceEngine) -> None:
        """Start a new process for the dead ``engine`` (of policy ``label``), each start counted
        against ``rollout.engine_restarts``. A process that dies while it starts (killed, or out
        of memory while loading the model) is one more death: it is started again while the
        budget allows, and past it the error propagates (the node stops leasing)."""
        why = engine.dead
        while True:
            self.counters["engine_restarts"] += 1
            log.warning("node %s: the engine process of %s died (%s); restarting it (%d of %d)",
                        self.identity.name, label, why, self.counters["engine_restarts"], self.cfg.engine_restarts)
            try:
                await asyncio.to_thread(engine.restart)
                return
            except EngineProcessError as again:
                if self.counters["engine_restarts"] >= self.cfg.engine_restarts or self._stop.is_set():
                    raise
                why = str(again)
