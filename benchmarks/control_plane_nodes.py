"""Emulated RaaS nodes for ``control_plane.py``: the node's calls, without a model.

An ``EmuNode`` does what a ``RaaSNode``'s loop does towards the data layer (its leases paced by
the node's own ``rollout.pacing.LeasePacing``): a heartbeat a
second (renewing the leases it holds, with its worker and weight versions), a lease of its
free slots, an "episode" per task (a short sleep), a tiny trajectory, and its ``complete``
once written. The trajectories of a worker's nodes are written together every ``flush_s``
through the real segment writer, one segment per emulated worker (``WorkerWriter``: one
segment per node would make this one process write thousands of times a second, a cost of the
store and of the emulation, not of the control plane); each node then completes its own
(``complete`` per node, or gathered by the ``Coalescer``). Many nodes share one
asyncio loop; their blocking actor calls go through ``transport.call`` (a thread each), as a
node group's do. ``grouped``: the nodes of one worker share a ``Coalescer`` (one gathered call
per kind, what ``RaaSNodeGroup`` uses); otherwise each node calls the actor itself (the
per-node call pattern).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.contracts import NOT_GENERATED, Provenance, RolloutTask, Sequence, Trajectory, TrajectoryRef
from astraflow.dataflow.config import DataflowConfig
from astraflow.transport import call
from astraflow.workloads.config import WorkloadConfig


def layer_kwargs(tmp: Path, batch_size: int, group_size: int, prefetch: int, durable: bool,
                 max_staleness: int = 2) -> dict:
    df = {"batch_size": batch_size, "prefetch_groups": prefetch, "lease_seconds": 30.0, "max_staleness": max_staleness}
    if "prefetch_covers_nodes" in DataflowConfig.model_fields:
        df["prefetch_covers_nodes"] = True
    ctl = tmp / "control"
    ctl.mkdir(parents=True, exist_ok=True)
    return dict(dataflow=DataflowConfig(**df),
                workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}, group_size=group_size),
                policies=["p"], store_url=str(tmp / "store"), metrics_path=str(ctl / "metrics.jsonl"),
                max_steps=10**9, snapshot_path=str(ctl / "dataflow.snapshot") if durable else None,
                journal_path=str(ctl / "ledger.jsonl") if durable else None)


def tiny_trajectory(task: RolloutTask, node: str, version: int, rng: random.Random) -> Trajectory:
    """A one-sequence trajectory of a few tokens (the data layer's cost does not depend on length)."""
    n_prompt, n_gen = 4, 8
    seq = Sequence.build(
        tokens=np.arange(n_prompt + n_gen), loss_mask=[0] * n_prompt + [1] * n_gen,
        logprobs=[0.0] * n_prompt + [-0.5] * n_gen, policy_ids=[NOT_GENERATED] * n_prompt + [0] * n_gen,
        versions=[NOT_GENERATED] * n_prompt + [version] * n_gen, reward=float(rng.random() < 0.5))
    return Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt,
                      (seq,), Provenance(node=node))


def refs_of(trajs: list[Trajectory], entry_refs: list) -> list[TrajectoryRef]:
    out, i = [], 0
    for t in trajs:
        out.append(TrajectoryRef.of(t, entry_refs[i : i + len(t.sequences)]))
        i += len(t.sequences)
    return out


#: per process: the emulated trainer's row reader of each store (``trainer_read``)
_READERS: dict[str, Any] = {}


def trainer_start() -> int:
    """The emulated trainer's process is up, with what it imports loaded; its pid."""
    import os

    try:
        import astraflow.training.rows  # noqa: F401
    except ImportError:  # a checkout whose data layer serves complete batches: nothing to read
        pass
    return os.getpid()


def trainer_read(store_url: str, served: Any) -> tuple[int, float]:
    """In the emulated trainer's own process: what ``Trainer`` does with a batch served by
    reference (read its rows from the store, make the ``Batch``). Returns (sequences, CPU
    seconds this took)."""
    from astraflow.training.rows import BatchRows

    t0 = time.thread_time()
    rows = _READERS.get(store_url)
    if rows is None:
        rows = _READERS[store_url] = BatchRows(store_url)
    batch = rows.batch(served)
    return len(batch), time.thread_time() - t0


class Latencies:
    """Call latencies by kind (seconds), kept only inside the measurement window."""

    def __init__(self) -> None:
        self.by_kind: dict[str, list[float]] = {}
        self.recording = False

    def add(self, kind: str, seconds: float) -> None:
        if self.recording:
            self.by_kind.setdefault(kind, []).append(seconds)

    def summary(self, kind: str) -> dict[str, float]:
        xs = np.asarray(self.by_kind.get(kind, []), dtype=float) * 1e3
        if not xs.size:
            return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan")}
        return {"n": int(xs.size), "p50_ms": float(np.percentile(xs, 50)), "p99_ms": float(np.percentile(xs, 99))}


class EmuNode:
    """One emulated RaaS node (module docstring)."""

    def __init__(self, name: str, worker: str, dl: Any, sink: "WorkerWriter", *, capacity: int, episode_s: float,
                 lease_wait: float, version: list[int], lat: Latencies, seed: int):
        self.name, self.worker, self.dl, self.sink = name, worker, dl, sink
        self.capacity, self.episode_s, self.lease_wait = capacity, episode_s, lease_wait
        #: the trainer's version, shared by every node (they "load" each version at once)
        self.version = version
        self.lat = lat
        self.rng = random.Random(seed)
        self.inflight: dict[str, RolloutTask] = {}
        self.writing: set[str] = set()
        self.completed = 0
        self.stop = False

    def _versions(self) -> dict[str, int]:
        return {"p": self.version[0]}

    async def _timed(self, kind: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = await call(method, *args, timeout=120, **kwargs)
        self.lat.add(kind, time.perf_counter() - t0)
        return out

    async def run(self) -> None:
        slot, never = asyncio.Event(), asyncio.Event()
        try:  # the node's own pacing of its leases (absent from older checkouts)
            from astraflow.rollout.pacing import LeasePacing
            pacing = LeasePacing(self.lease_wait)
        except ImportError:
            pacing = None
        last_beat = 0.0
        await asyncio.sleep(self.rng.random())  # nodes start spread over a second, as they do
        while not self.stop:
            now = time.time()
            if now - last_beat > 1.0:
                stats = {"holding": list(self.inflight.keys() | self.writing), "worker": self.worker,
                         "versions": self._versions(), "inflight": len(self.inflight)}
                await self._timed("heartbeat", self.dl.heartbeat, self.name, stats)
                last_beat = now
            free = self.capacity - len(self.inflight)
            if free > 0:
                t0 = time.perf_counter()
                tasks = await self._timed("lease", self.dl.lease, self.name, free, self.lease_wait,
                                          versions=self._versions())
                if pacing is not None:
                    pacing.leased(len(tasks), time.perf_counter() - t0)
                for task in tasks:
                    self.inflight[task.task_id] = task
                    asyncio.get_running_loop().create_task(self._episode(task, slot))
            slot.clear()
            if len(self.inflight) < self.capacity:
                if pacing is not None:  # too few tasks: ask again shortly, as a node does
                    await pacing.pause(never)  # (the emulated nodes' weights are never behind)
                else:
                    await asyncio.sleep(0.05)
            else:
                try:
                    await asyncio.wait_for(slot.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass

    async def _episode(self, task: RolloutTask, slot: asyncio.Event) -> None:
        await asyncio.sleep(self.episode_s * 2 * self.rng.random())
        self.inflight.pop(task.task_id, None)
        self.writing.add(task.task_id)
        self.sink.add(self, tiny_trajectory(task, self.name, self.version[0], self.rng))
        slot.set()

    async def complete(self, trajs: list[Trajectory], refs: list[TrajectoryRef]) -> None:
        await self._timed("complete", self.dl.complete, refs)
        self.completed += len(trajs)
        for t in trajs:
            self.writing.discard(t.task_id)


class WorkerWriter:
    """The segment of one emulated worker: what its nodes finished, written every ``flush_s``.
    As a node's writer does, each batch is staged at once and completed once its commit is
    durable, while the next ones are written (a checkout without ``submit`` waits for each)."""

    def __init__(self, writer: Any, flush_s: float):
        self.writer, self.flush_s = writer, flush_s
        self.finished: list[tuple[EmuNode, Trajectory]] = []

    def add(self, node: EmuNode, traj: Trajectory) -> None:
        self.finished.append((node, traj))

    async def run(self) -> None:
        committing: set[asyncio.Task] = set()
        submit = getattr(self.writer, "submit", None)
        while True:
            await asyncio.sleep(self.flush_s)
            for t in [t for t in committing if t.done()]:
                committing.discard(t)
                t.result()  # a failed commit or completion ends the writer (and the benchmark)
            if not self.finished:
                continue
            batch, self.finished = self.finished, []
            rows = [r for _, t in batch for r in t.to_stored()]
            if submit is None:
                await self._complete(batch, asyncio.to_thread(self.writer.write, rows))
                continue
            written = await asyncio.to_thread(submit, rows)
            committing.add(asyncio.get_running_loop().create_task(self._complete(batch, asyncio.wrap_future(written))))

    async def _complete(self, batch: list[tuple[EmuNode, Trajectory]], written: Any) -> None:
        trajs = [t for _, t in batch]
        entry_refs = await written
        per_node: dict[EmuNode, tuple[list, list]] = {}
        for (node, traj), ref in zip(batch, refs_of(trajs, entry_refs)):
            mine = per_node.setdefault(node, ([], []))
            mine[0].append(traj)
            mine[1].append(ref)
        await asyncio.gather(*(node.complete(ts, rs) for node, (ts, rs) in per_node.items()))
