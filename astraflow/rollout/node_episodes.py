"""A leased task's way out of a RaaS node: its episode runs, then its trajectory is written
and completed, or the task is failed.

A mixin of ``RaaSNode`` (``node``), kept apart from the lease loop, which only decides when to
lease and starts ``_episode`` per task. Here: the episode's deadline
(``rollout.episode_timeout_s``), the node's identity stamped into the trajectory's provenance,
failure containment (an exception of any type fails that task only, and a dead engine process
starts ``_recover`` unless the node is stopping; the failures are logged by ``failure_log``),
and the writer that writes finished trajectories to the node's segment in batches and reports
them with ``complete`` only once their commit is durable.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from astraflow.contracts import RolloutTask, Trajectory, TrajectoryRef
from astraflow.rollout.engine import InferenceEngine, confirmed_version
from astraflow.rollout.failure_log import FailureLog
from astraflow.rollout.process_engine import EngineProcessError
from astraflow.rollout.seeds import episode_seeds
from astraflow.transport import call
from storage.trajectories import StoredSequence

log = logging.getLogger("astraflow.rollout")


#: batches a node's writer has written and waits to see committed before it holds the next one back
WRITE_AHEAD = 4


class EpisodeTimeout(TimeoutError):
    """An episode ran past ``rollout.episode_timeout_s``: it was cancelled and its task failed."""


class NodeEpisodes:
    """Episodes and trajectory writes of a node; uses the node's ``engines``, ``cfg``,
    ``counters``, ``identity``, ``dl``, ``workflow``, ``writer``, ``inflight``, ``writing``, the
    lease loop's ``_slot_free`` and the writer's queue (``_finished``, ``_finished_event``,
    ``_closing``, ``_segment_batches``, ``_segments_closed``), ``_failure_log``, the stop event
    ``_stop``, ``run_seed`` (the episodes' sampling seeds) and ``_recovery``/``_recover``
    (``engine_recovery``)."""

    engines: dict[str, InferenceEngine]
    cfg: Any
    counters: dict[str, Any]
    identity: Any
    dl: Any
    workflow: Any
    writer: Any
    inflight: dict[str, RolloutTask]
    writing: set[str]
    _slot_free: asyncio.Event
    _finished: list[tuple[Trajectory, list[StoredSequence]]]  # generated, and its rows to write
    _finished_event: asyncio.Event
    _closing: bool
    _segment_batches: collections.Counter
    _segments_closed: list[str]
    _recovery: asyncio.Task | None
    _stop: threading.Event
    run_seed: int = 0
    #: the failed episodes' lines: a traceback per reason, then counts (``failure_log``)
    _failure_log: FailureLog

    async def _generate(self, task: RolloutTask) -> Trajectory:
        """The episode of ``task``: wait for the weight version it needs, then run the workflow."""
        if task.min_version >= 0:
            await self._wait_for_version(task.policies[0], task.min_version, timeout=120)
        with episode_seeds(self.run_seed, task.task_id, task.attempt):
            traj = await self.workflow.run_episode(self.engines, task)
        if not isinstance(traj, Trajectory):
            what = "None" if traj is None else f"a {type(traj).__name__}"
            how = "self.trajectory(...)" if hasattr(self.workflow, "trajectory") else "astraflow.contracts.Trajectory"
            raise TypeError(f"{type(self.workflow).__name__}.run_episode returned {what}, not a Trajectory "
                            f"(build one with {how})")
        return traj

    async def _episode(self, task: RolloutTask) -> None:
        try:
            deadline = asyncio.timeout(self.cfg.episode_timeout_s)
            try:
                async with deadline:
                    traj = await self._generate(task)
            except TimeoutError:
                if not deadline.expired():
                    raise  # a deadline inside the episode (a reward's, a tool's): its own message
                raise EpisodeTimeout(f"episode ran past its {self.cfg.episode_timeout_s:g} s deadline "
                                     "(rollout.episode_timeout_s); it was cancelled") from None
            source = task.prompt.get("source") if isinstance(task.prompt, dict) else None
            traj = replace(
                traj,
                source=source if isinstance(source, str) else traj.source,
                provenance=replace(
                    traj.provenance,
                    node=self.identity.name,
                    partition=self.identity.partition,
                    region=self.identity.region,
                    hardware=self.identity.hardware,
                ),
            )
            rows = traj.to_stored()  # here, not in the writer: what cannot be stored fails its own episode
            self.writing.add(task.task_id)
            self._finished.append((traj, rows))
            self._finished_event.set()
        except GeneratorExit:  # the coroutine is closed with the node's loop: nothing left to report to
            raise
        except BaseException as err:  # of any type, or the asyncio task (or the loop) ends with the lease held
            self.counters["failed"] += 1
            self._failure_log.failed(task.task_id, err)
            # a node that stops (scancel ends its engine processes too) does not restart them
            if (isinstance(err, EngineProcessError) and not self._stop.is_set()
                    and (self._recovery is None or self._recovery.done())):
                self._recovery = asyncio.get_running_loop().create_task(self._recover(err))
            await self._fail(task, f"{type(err).__name__}: {err}")
            if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the episode itself was cancelled: the cancellation goes on
        finally:
            self.inflight.pop(task.task_id, None)
            self._slot_free.set()

    async def _fail(self, task: RolloutTask, reason: str) -> None:
        """Tell the data layer ``task`` failed (it is requeued up to its attempt limit). When the
        call does not get through, the task is no longer reported as held, so its lease expires."""
        try:
            await call(self.dl.fail, task.task_id, reason, attempt=task.attempt, timeout=30)
        except Exception as err:  # an actor call fails with whatever the transport or the actor raised
            log.warning("node %s: reporting the failure of %s failed (%s); its lease will expire",
                        self.identity.name, task.task_id, err)

    async def _wait_for_version(self, policy: str, version: int, timeout: float) -> None:
        deadline = time.time() + timeout
        while confirmed_version(self.engines[policy]) < version:  # accepted, not only sent
            if time.time() > deadline:
                raise TimeoutError(f"weights {policy} v{version} not loaded within {timeout:.0f}s")
            await asyncio.sleep(0.1)

    async def _writer(self) -> None:
        """Write finished trajectories in batches to this node's segment, then complete them.

        A batch is written when it is full (``write_batch``), when its oldest trajectory has
        waited ``flush_seconds``, or at once when nothing else is being generated. One wake-up
        takes every trajectory finished since the last: the engine yields to the event loop
        only between decoding steps, so waiting per trajectory would starve the writer. A
        batch's bytes are written at once and it is completed when its commit is durable; up to
        ``WRITE_AHEAD`` batches wait for their commits meanwhile (the writer groups them into
        one flush round), so the next batch is not held up by the disk."""
        committing: collections.deque[asyncio.Task] = collections.deque()
        while True:
            while committing and committing[0].done():
                committing.popleft().result()  # a failed commit or completion ends the writer
            if not self._finished:
                if self._closing:
                    break
                self._finished_event.clear()
                await self._finished_event.wait()
                continue
            oldest = time.time()
            while (len(self._finished) < self.cfg.write_batch and self.inflight and not self._closing
                   and time.time() - oldest < self.cfg.flush_seconds):
                self._finished_event.clear()
                try:
                    await asyncio.wait_for(self._finished_event.wait(),
                                           timeout=self.cfg.flush_seconds - (time.time() - oldest))
                except asyncio.TimeoutError:
                    break
            while len(committing) >= WRITE_AHEAD:
                await asyncio.wait([committing[0]])
                committing.popleft().result()
            pending = self._finished[: self.cfg.write_batch]
            del self._finished[: len(pending)]
            t0 = time.time()
            batch = [traj for traj, _ in pending]
            rows = [row for _, stored in pending for row in stored]
            written = await asyncio.to_thread(self.writer.submit, rows)
            segment = getattr(self.writer, "segment", "")  # the one these rows went to (only this loop submits)
            self._segment_batches[segment] += 1
            self.counters["write_s"] += time.time() - t0
            done = asyncio.create_task(self._complete_written(batch, written, t0, segment))
            done.add_done_callback(lambda _: self._finished_event.set())  # a failure is seen at once
            committing.append(done)
        for done in committing:
            await done
        await asyncio.to_thread(self.writer.flush)

    async def _complete_written(self, batch: list[Trajectory], written: Any, t0: float, segment: str) -> None:
        """Once the commit of ``batch`` (``written``: the writer's future of its refs) is durable,
        report it with one ``complete``."""
        refs = await asyncio.wrap_future(written)
        self.counters["commit_s"] += time.time() - t0
        out, i = [], 0
        for traj in batch:
            n = len(traj.sequences)
            out.append(TrajectoryRef.of(traj, refs[i : i + n]))
            i += n
            self.counters["episodes"] += 1
            self.counters["sequences"] += n
            self.counters["tokens"] += sum(s.num_generated() for s in traj.sequences)
        await call(self.dl.complete, out, timeout=60)
        self.counters["complete_calls"] += 1
        for traj in batch:
            self.writing.discard(traj.task_id)
        self._segment_batches[segment] -= 1
        await self._report_done_segments()

    async def _report_done_segments(self) -> None:
        """Tell the data layer which segments this node will neither write nor complete rows of
        again: those the writer filled and closed, once every batch written there was completed.
        The data layer may delete them once it holds none of their rows
        (``storage.keep_trajectories``). The segment a node ends with is not reported (a call while
        the node stops would hold up its stop): the next run incarnation takes it as done."""
        take = getattr(self.writer, "take_closed", None)
        self._segments_closed.extend(take() if take is not None else ())
        done = [s for s in self._segments_closed if self._segment_batches[s] == 0]
        if not done:
            return
        self._segments_closed = [s for s in self._segments_closed if s not in done]
        for s in done:  # never written again: a long run keeps only its open segments' counts
            del self._segment_batches[s]
        try:
            await call(self.dl.segments_done, done, timeout=60)
        except Exception as err:  # only space is at stake: the segments are kept
            log.warning("node %s: reporting finished segments %s failed (%s); they are kept", self.identity.name,
                        done, err)
