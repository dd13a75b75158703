"""The data layer's trainer-facing calls: batches served, versions committed, a trainer
replaced. A part of `DataLayer` (``layer.py``), kept in its own module; every name it uses on
``self`` is the data layer's.

Named asynchronous overlap, *served, then committed*: a batch served to a trainer at ``v`` is
consumed only when the trainer reports ``v + 1`` committed. A trainer that asks again at ``v``
never got the first batch (a trainer trains only on what it was answered, then moves to
``v + 1``): it is put back and served again; a trainer replaced after ``v`` gets back what
was served to its predecessor at ``v`` or later (``trainer_restarted``). Either way no sequence
is trained twice and none is dropped without a reason.

*Served by reference*: a batch names its rows in the trajectory store (``BatchRefs``) with
what only the data layer knows of them (group statistics, staleness, replay); the trainer's
side reads the rows in its own process (``astraflow.training.rows``). The data layer reads no
token array for a batch, so serving one costs it no store read while nodes wait on it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from astraflow.batches import BatchRefs
from astraflow.dataflow import admission
from astraflow.dataflow import record as rec

log = logging.getLogger("astraflow.dataflow")


class BatchTimeout(TimeoutError):
    """``next_batch`` found no full batch before its deadline."""


class TrainerFacing:
    """`DataLayer`'s trainer-facing methods (module docstring)."""

    async def next_batch(self, policy: str, version: int, timeout: float = 60.0) -> BatchRefs:
        """A batch of ``batch_size`` sequences for ``policy`` whose trainer is at ``version``,
        by reference (module docstring, *served by reference*).

        Waits until the buffer holds enough fresh sequences of every source's quota, at most
        ``timeout`` seconds, then raises ``BatchTimeout``."""
        if policy not in self.versions:
            raise ValueError(f"unknown policy {policy!r}; known: {self.policy_names}")
        t0 = time.time()
        pace = self.paces[policy]
        pace.asked(t0)
        pace.waiting += 1
        # asked again at ``version``: the batch served before (by this layer, or by the one it
        # replaced) never reached the trainer (its answer was lost or came past the call's
        # deadline, e.g. a trainer paused that long), so it is served again, not dropped
        self._in_doubt[policy].discard(version)
        self._put_back(policy, version)
        n_replay = self.cfg.replay_rows
        if n_replay and self.buffers.replayable(policy, version) < n_replay:
            n_replay = 0
        need = self.cfg.batch_size - n_replay
        quota, credit = self.mixer.quotas(policy, need)
        incarnation = self.trainer_restarts[policy]
        try:
            while True:
                self.leases.expire()
                self._refill()
                avail = self.buffers.drop_stale_by_source(policy, version, self.mixer.weights)
                short = {s: q - avail[s] for s, q in quota.items() if avail[s] < q}
                lockstep_ok = not self.cfg.lockstep or all(v >= version for v in self.versions.values())
                if not short and lockstep_ok and self.evals.initial_done():
                    break
                self.mixer.short[policy] = short  # lets _refill exceed a source's bound for this batch
                self.mixer.wanted[policy] = quota
                remaining = t0 + timeout - time.time()
                if remaining <= 0:
                    raise BatchTimeout(admission.no_batch_reason(self, policy, version, timeout, avail, quota, need))
                await self._wait(min(remaining, 0.5))
        finally:
            self.mixer.short.pop(policy, None)
            self.mixer.wanted.pop(policy, None)
            pace.waiting -= 1
        waited = time.time() - t0
        self.buffers.wait_s[policy] += waited
        if self.trainer_restarts[policy] != incarnation:  # asked by the trainer that was lost
            raise RuntimeError(f"the trainer of {policy} was replaced while this call waited: it serves nothing")
        self.mixer.credit[policy] = credit
        chosen, _ = self.buffers.take(policy, quota, self.ordering, version)
        batch = self.buffers.serve(policy, version, chosen, n_replay, waited,
                                   quota if self.mixer.mixing else None)
        self._notify()  # room for new groups: wakes the nodes' waiting lease calls
        await self._durable()  # a batch the next data layer does not know of is never trained
        return batch

    async def published(self, policy: str, version: int, metrics: dict[str, Any] | None = None,
                        batch_metrics: dict[str, Any] | None = None) -> None:
        """The trainer of ``policy`` committed ``version``: the batch it trained on is consumed,
        its metrics line is written (``record.step_record``) and the state saved.
        ``batch_metrics``: the ``Batch.metrics`` of the batch this version was trained on (the
        trainer reports a version after it fetched the next batch; without them, the last
        batch served is reported). Reporting a version again (a call retried after the data layer
        was re-placed) changes nothing."""
        if version <= self.versions[policy]:
            await self._durable()  # a retry after a failed commit returns only once it is in the log
            return
        self._committed(policy, version, metrics, batch_metrics)
        self._notify()
        await self._durable()
        self.retention.sweep_soon(self.buffers, lambda: self._durable(sync=True))  # what the batch held may be free

    def _committed(self, policy: str, version: int, metrics: dict[str, Any] | None,
                   batch_metrics: dict[str, Any] | None) -> None:
        self.versions[policy] = max(self.versions[policy], version)
        trained = self.buffers.commit(policy, version)  # the batch trained on is consumed
        self.mixer.consumed[policy].update(Counter(it.source for it in trained))
        by_source = ({"consumed_by_source": self.mixer.consumed_by_source(policy),
                      "groups_by_source": self.mixer.groups_by_source()} if self.mixer.mixing else None)
        failed = self.ledger.events["failed"]  # failed tasks since the previous step line, and the run's
        since, self._failed_recorded = failed - self._failed_recorded, failed
        self.metrics.write(rec.step_record(
            policy=policy, version=version, elapsed=time.time() - self._started, metrics=metrics or {},
            batch_metrics=batch_metrics or self.buffers.last_batch[policy], cfg=self.cfg,
            counts=self.buffers.counts[policy], staleness_hist=self.buffers.staleness_hist[policy],
            generated=self.generated, trainer_wait_s=self.buffers.wait_s[policy],
            node_versions={n: i.get("versions") for n, i in self.leases.nodes.items() if not i.get("gone")},
            by_source=by_source, failed_tasks=max(since, 0), failed_tasks_total=failed))
        if self._state_path is not None:
            rec.save(self._state_path, self.state_dict())
        if all(v >= self.max_steps for v in self.versions.values()):
            self.finished = True
        every = self.wcfg.eval.every
        if policy == self.policy_names[0] and every and (version % every == 0 or version >= self.max_steps):
            self._start_eval(version)

    async def trainer_restarted(self, policy: str, from_version: int, restart: bool = True) -> dict[str, Any]:
        """``policy``'s trainer was lost; a new one resumes from ``from_version``, the newest
        committed version (called before it starts). Versions up to it that the lost trainer
        committed without reporting are recorded now (their batches consumed, their metrics
        line marked ``recovered``); every batch served at ``from_version`` or later goes back to
        the buffer to be served again (``Buffers.put_back``): nothing is dropped as
        ``served_not_trained``, nothing is trained twice. A batch call the lost trainer still
        has pending serves nothing. ``restart`` False: a resumed run's trainer starts (the same
        recovery, not counted as a restart). A ``from_version`` below the layer's (a newer
        version was damaged and moved aside) takes the policy back to it: the versions after it
        are trained again, and their metrics lines written again. Returns
        ``{"put_back": n, "recovered": [versions]}``."""
        if restart:
            self.trainer_restarts[policy] += 1
        if from_version < self.versions[policy]:
            log.warning("the trainer of %s resumes from v%d, behind v%d the data layer recorded (a newer version "
                        "was moved aside): the versions after it are trained again", policy, from_version,
                        self.versions[policy])
            self.versions[policy] = from_version
            self.finished = False
        recovered = list(range(self.versions[policy] + 1, from_version + 1))
        for v in recovered:
            self._committed(policy, v, {"recovered": True}, {})
        back = self._put_back(policy, from_version)
        self._notify()
        await self._durable(sync=True)
        return {"put_back": len(back), "recovered": recovered}

    async def resume_evaluation(self) -> None:
        """A resumed run's first evaluation round, at the versions its trainers resume from (call
        after ``trainer_restarted``: a round started before would be labelled with the versions
        the change log had, but run on the newer weights the nodes load). Nothing when started."""
        if self._eval_at_start:
            self._eval_at_start = False
            self.evals.gate = self.versions[self.policy_names[0]]  # rounds measure the first policy
            self._start_eval(self.evals.gate)
            self._notify()
            await self._durable(sync=True)

    def _put_back(self, policy: str, from_version: int) -> list:
        return self.buffers.put_back(policy, from_version)

    async def open_iteration(self, groups: int) -> None:
        """Baseline (``run.mode: sync``, a gated data layer) control: allow exactly ``groups``
        more groups to be created (with several sources: of the sources the next batch lacks)."""
        self.budget = (self.budget or 0) + groups
        if self.budget_sources is not None:
            self.budget_sources.update(admission.iteration_sources(self, groups))
        self._refill()
        self._notify()
        await self._durable()

    async def ready(self, policy: str, version: int) -> int:
        """Sequences buffered for ``policy`` that a trainer at ``version`` could consume; with
        several sources, those its next batch can take (each source up to its quota of it), so
        that the batch is ready when this reaches ``batch_size``."""
        if not self.mixer.mixing:
            return self.buffers.drop_stale(policy, version)
        quota, _ = self.mixer.quotas(policy, self.cfg.batch_size)
        avail = self.buffers.drop_stale_by_source(policy, version, self.mixer.weights)
        return sum(min(avail[s], q) for s, q in quota.items())
