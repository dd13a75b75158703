"""Emulated RaaS nodes for ``control_plane.py``: the node's calls, without a model.

An ``EmuNode`` does what a ``RaaSNode``'s loop does towards the data layer (its leases paced by
the node's own ``rollout.pacing.LeasePacing``): a heartbeat a
second (renewing the leases it holds, with its worker and weight versions), a lease of its
free slots, an "episode" per task (a timer), a tiny trajectory, and its ``complete``
once written. The trajectories of a worker's nodes are written by a node's rule (at once
when the node has nothing else in flight, else ``flush_s`` after its oldest), together,
through the real segment writer, one segment per emulated worker (``WorkerWriter``: one
segment per node would make this one process write thousands of times a second, a cost of the
store and of the emulation, not of the control plane); each node then completes its own
(``complete`` per node, or gathered by the ``Coalescer``). Many nodes share one
asyncio loop; their blocking actor calls go through ``transport.call`` (a thread each), as a
node group's do. ``grouped``: the nodes of one worker share a ``Coalescer`` (one gathered call
per kind, what ``RaaSNodeGroup`` uses); otherwise each node calls the actor itself (the
per-node call pattern). Every caller holds the data layer through a ``transport.Link``, as
nodes and trainers do: the calls it serves on its direct lane go there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.contracts import (NOT_GENERATED, Provenance, RolloutTask, Sequence, SequenceSummary, Trajectory,
                                 TrajectoryRef)
from astraflow.dataflow.config import DataflowConfig
from astraflow.transport import Link, call
from astraflow.workloads.config import WorkloadConfig


def layer_kwargs(tmp: Path, batch_size: int, group_size: int, prefetch: int, durable: bool,
                 max_staleness: int = 2, lane: bool = True) -> dict:
    df = {"batch_size": batch_size, "prefetch_groups": prefetch, "lease_seconds": 30.0, "max_staleness": max_staleness}
    if "prefetch_covers_nodes" in DataflowConfig.model_fields:
        df["prefetch_covers_nodes"] = True
    if "direct_lane" in DataflowConfig.model_fields:  # the nodes' calls on the direct lane, or all through Dask
        df["direct_lane"] = lane
    ctl = tmp / "control"
    ctl.mkdir(parents=True, exist_ok=True)
    return dict(dataflow=DataflowConfig(**df),
                workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}, group_size=group_size),
                policies=["p"], store_url=str(tmp / "store"), metrics_path=str(ctl / "metrics.jsonl"),
                max_steps=10**9, snapshot_path=str(ctl / "dataflow.snapshot") if durable else None,
                journal_path=str(ctl / "ledger.jsonl") if durable else None)


#: the emulated sequences by (version, reward): sequences are frozen, so trajectories share them
_SEQUENCES: dict[tuple[int, float], Sequence] = {}


def tiny_trajectory(task: RolloutTask, node: str, version: int, rng: random.Random) -> Trajectory:
    """A one-sequence trajectory of a few tokens (the data layer's cost does not depend on length)."""
    reward = float(rng.random() < 0.5)
    seq = _SEQUENCES.get((version, reward))
    if seq is None:
        n_prompt, n_gen = 4, 8
        seq = _SEQUENCES[version, reward] = Sequence.build(
            tokens=np.arange(n_prompt + n_gen), loss_mask=[0] * n_prompt + [1] * n_gen,
            logprobs=[0.0] * n_prompt + [-0.5] * n_gen, policy_ids=[NOT_GENERATED] * n_prompt + [0] * n_gen,
            versions=[NOT_GENERATED] * n_prompt + [version] * n_gen, reward=reward)
    return Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt,
                      (seq,), Provenance(node=node))


#: ``TrajectoryRef.of`` of a trajectory of each shared sequence (``refs_of`` reuses its summary)
_REFS: dict[int, TrajectoryRef] = {}


def refs_of(trajs: list[Trajectory], entry_refs: list) -> list[TrajectoryRef]:
    """``TrajectoryRef.of`` of each trajectory (one sequence each) and its entry: what it computes
    from the sequence is computed once per shared sequence."""
    out = []
    for t, entry in zip(trajs, entry_refs, strict=True):
        seq = t.sequences[0]
        first = _REFS.get(id(seq))
        if first is None:  # shared sequences live as long as the process: an id is never reused
            first = _REFS[id(seq)] = TrajectoryRef.of(t, [entry])
        s = first.sequences[0]
        out.append(TrajectoryRef(t.task_id, t.group_id, t.kind, t.attempt, t.provenance.node,
                                 (SequenceSummary(entry, s.reward, s.policy_tokens, s.num_tokens, s.finish_reason),),
                                 first.score, {}))
    return out


#: per process: the emulated trainer's row reader of each store (``trainer_read``)
_READERS: dict[str, Any] = {}


def trainer_start() -> int:
    """The emulated trainer's process is up, with what it imports loaded; its pid. (Every process
    of the benchmark's pools runs it first: each then prints its threads' stacks on SIGUSR1, as
    the benchmark's own process does, so a run that hangs shows where each of them waits.)"""
    import faulthandler
    import os
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
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
        #: set while the node waits for a free slot (``_slot_free``)
        self._slot: asyncio.Future | None = None

    def _versions(self) -> dict[str, int]:
        return {"p": self.version[0]}

    async def _timed(self, kind: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = await call(method, *args, timeout=120, **kwargs)
        self.lat.add(kind, time.perf_counter() - t0)
        return out

    async def run(self) -> None:
        never = asyncio.Event()
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
                         "versions": self._versions(), "inflight": len(self.inflight), "slots": self.capacity}
                await self._timed("heartbeat", self.dl.heartbeat, self.name, stats)
                last_beat = now
            free = self.capacity - len(self.inflight)
            if free > 0:
                t0 = time.perf_counter()
                tasks = await self._timed("lease", self.dl.lease, self.name, free, self.lease_wait,
                                          versions=self._versions())
                if not tasks:  # answered with nothing (how often, next to how fast)
                    self.lat.add("lease_empty", time.perf_counter() - t0)
                if pacing is not None:
                    pacing.leased(len(tasks), time.perf_counter() - t0)
                loop = asyncio.get_running_loop()
                for task in tasks:  # an episode is a timer (a task each would cost the emulator more)
                    self.inflight[task.task_id] = task
                    loop.call_later(self.episode_s * 2 * self.rng.random(), self._episode, task)
            if len(self.inflight) < self.capacity:
                if pacing is not None:  # too few tasks: ask again shortly, as a node does
                    await pacing.pause(never)  # (the emulated nodes' weights are never behind)
                else:
                    await asyncio.sleep(0.05)
            else:
                await self._slot_free(1.0)

    async def _slot_free(self, timeout: float) -> None:
        """Until an episode ends or ``timeout`` passes (a future and a timer: ``wait_for`` costs
        a task each time, and the emulator runs a thousand of these loops)."""
        loop = asyncio.get_running_loop()
        self._slot = loop.create_future()
        timer = loop.call_later(timeout, self._wake)
        try:
            await self._slot
        finally:
            timer.cancel()
            self._slot = None

    def _wake(self) -> None:
        if self._slot is not None and not self._slot.done():
            self._slot.set_result(None)

    def _episode(self, task: RolloutTask) -> None:
        if self.stop:
            return
        self.inflight.pop(task.task_id, None)
        self.writing.add(task.task_id)
        self.sink.add(self, tiny_trajectory(task, self.name, self.version[0], self.rng))
        self._wake()

    async def complete(self, trajs: list[Trajectory], refs: list[TrajectoryRef]) -> None:
        await self._timed("complete", self.dl.complete, refs)
        self.completed += len(trajs)
        for t in trajs:
            self.writing.discard(t.task_id)


#: trajectories (or node calls) a writer handles before it lets its process's other work run
SLICE = 64
#: seconds an emulator process waits for its cancelled nodes and writers once its window closed
TEARDOWN_S = 15.0


class WorkerWriter:
    """The segment of one emulated worker: what its nodes finished, written by a node's rule
    (``flush_seconds`` after a node's oldest finished trajectory, at once when the node has
    nothing else in flight), the due nodes' trajectories together in one write. As a node's
    writer does, each batch is staged at once and completed once its commit is durable, while
    the next ones are written (a checkout without ``submit`` waits for each)."""

    def __init__(self, writer: Any, flush_s: float):
        self.writer, self.flush_s = writer, flush_s
        #: node -> (when its oldest finished, what it finished), in the order they finished
        self.finished: dict[EmuNode, tuple[float, list[Trajectory]]] = {}
        self._due: asyncio.Event | None = None

    def add(self, node: EmuNode, traj: Trajectory) -> None:
        if self._due is None:
            self._due = asyncio.Event()
        since, trajs = self.finished.setdefault(node, (time.monotonic(), []))
        trajs.append(traj)
        if not node.inflight:  # nothing else to wait for: the node writes at once
            self._due.set()

    async def _wait_due(self) -> list[tuple[EmuNode, Trajectory]]:
        """Until some node's trajectories are due; takes them."""
        if self._due is None:
            self._due = asyncio.Event()
        while True:
            now = time.monotonic()
            due = [n for n, (since, _) in self.finished.items() if not n.inflight or now - since >= self.flush_s]
            if due:
                return [(n, t) for n in due for t in self.finished.pop(n)[1]]
            first = min((since for since, _ in self.finished.values()), default=now)
            self._due.clear()
            try:
                await asyncio.wait_for(self._due.wait(), max(first + self.flush_s - now, 0.001))
            except asyncio.TimeoutError:
                pass

    async def run(self) -> None:
        committing: set[asyncio.Task] = set()
        submit = getattr(self.writer, "submit", None)
        while True:
            batch = await self._wait_due()
            for t in [t for t in committing if t.done()]:
                committing.discard(t)
                t.result()  # a failed commit or completion ends the writer (and the benchmark)
            rows = []
            for i in range(0, len(batch), SLICE):  # in slices: the nodes' calls are answered between
                rows += [r for _, t in batch[i:i + SLICE] for r in t.to_stored()]
                await asyncio.sleep(0)
            if submit is None:
                await self._complete(batch, asyncio.to_thread(self.writer.write, rows))
                continue
            written = await asyncio.to_thread(submit, rows)
            committing.add(asyncio.get_running_loop().create_task(self._complete(batch, asyncio.wrap_future(written))))

    async def _complete(self, batch: list[tuple[EmuNode, Trajectory]], written: Any) -> None:
        entry_refs = await written
        per_node: dict[EmuNode, tuple[list, list]] = {}
        for i in range(0, len(batch), SLICE):
            part = batch[i:i + SLICE]
            for (node, traj), ref in zip(part, refs_of([t for _, t in part], entry_refs[i:i + SLICE])):
                mine = per_node.setdefault(node, ([], []))
                mine[0].append(traj)
                mine[1].append(ref)
            await asyncio.sleep(0)
        calls = []
        for j, (node, (ts, rs)) in enumerate(per_node.items()):
            calls.append(asyncio.ensure_future(node.complete(ts, rs)))
            if j % SLICE == SLICE - 1:
                await asyncio.sleep(0)
        await asyncio.gather(*calls)


def build(dl: Any, store: Any, first: int, count: int, per_worker: int, grouped: bool, opts: dict,
          version: list[int], lat: Latencies) -> tuple[list[EmuNode], list[WorkerWriter], list[Any]]:
    """Nodes ``first .. first+count-1`` of the run, ``per_worker`` to an emulated worker (its
    segment writer, and with ``grouped`` its ``Coalescer``); returns the nodes, the writers and
    the coalescers."""
    handles: dict[str, Any] = {}
    sinks: dict[str, WorkerWriter] = {}
    nodes = []
    for i in range(first, first + count):
        worker = f"w{i // per_worker}"
        if worker not in sinks:
            sinks[worker] = WorkerWriter(store.writer(worker, batch_size=4096), opts["flush_s"])
            if grouped:
                from astraflow.rollout.coalesce import Coalescer
                handles[worker] = Coalescer(dl, worker=worker, lease_ahead=opts.get("lease_ahead", 0))
        nodes.append(EmuNode(f"{worker}.n{i % per_worker}", worker, handles[worker] if grouped else dl,
                             sinks[worker], capacity=opts["capacity"], episode_s=opts["episode_s"],
                             lease_wait=opts["lease_wait"], version=version, lat=lat, seed=i))
    return nodes, list(sinks.values()), list(handles.values())


async def loop_lag(lat: Latencies, every: float = 0.005) -> None:
    """How late this process's event loop runs a timer: every call the nodes make waits at
    least that long for its answer to be handled (kind ``loop_lag``)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every
        await asyncio.sleep(every)
        lat.add("loop_lag", loop.time() - due)


async def follow_versions(dl: Any, version: list[int], every: float = 0.1) -> None:
    """In an emulator process of its own: the trainer's version, polled as a node polls for
    new weights (the nodes "load" it at once)."""
    while True:
        progress = await call(dl.progress, timeout=30)
        version[0] = progress.get("version_p", version[0])
        await asyncio.sleep(every)


def gathered(coalescers: list[Any]) -> dict[str, list[int]]:
    """Per kind: gathered calls sent and node calls they carried, over ``coalescers``."""
    out = {k: [sum(h.gatherers[k].calls for h in coalescers), sum(h.gatherers[k].carried for h in coalescers)]
           for k in ("lease", "heartbeat")}
    stocks = [h.stock for h in coalescers if getattr(h, "stock", None) is not None]
    if stocks:  # node leases served by the stocks, and the stocks' own refill calls
        out["stock"] = [sum(s.counts["refills"] for s in stocks), sum(s.counts["handed"] for s in stocks)]
        out["stock_miss"] = [sum(s.counts["misses"] for s in stocks) + sum(s.counts["handed"] for s in stocks),
                             sum(s.counts["misses"] for s in stocks)]
    return out


def emulate(address: str, dl_pickled: bytes, store_url: str, first: int, count: int, per_worker: int,
            grouped: bool, opts: dict, start_at: float, seconds: float) -> dict:
    """An emulator process of its own (``--emulator-procs``): its nodes run from now until
    ``start_at + seconds`` (wall clock), latencies kept from ``start_at``. Returns the
    latencies by kind, this process's CPU seconds in the window and its coalescers' counts."""
    import psutil
    from distributed import Client

    from storage.trajectories import open_trajectory_store

    with Client(address, direct_to_workers=True):  # as a node group's worker calls: direct
        dl = Link(pickle.loads(dl_pickled), "the data layer")  # as nodes hold it (its lane, if it has one)
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(_emulate(dl, open_trajectory_store(store_url, "a"), first, count, per_worker,
                                                    grouped, opts, start_at, seconds, psutil.Process()))
        finally:  # not ``asyncio.run``: a call's thread still waiting on the data layer is not joined here
            loop.close()


async def _emulate(dl: Any, store: Any, first: int, count: int, per_worker: int, grouped: bool, opts: dict,
                   start_at: float, seconds: float, me: Any) -> dict:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=4 * count + 32))
    lat, version = Latencies(), [0]
    nodes, sinks, coalescers = build(dl, store, first, count, per_worker, grouped, opts, version, lat)
    running = ([loop.create_task(n.run()) for n in nodes] + [loop.create_task(w.run()) for w in sinks]
               + [loop.create_task(loop_lag(lat)), loop.create_task(follow_versions(dl, version))])
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu0, lat.recording = sum(me.cpu_times()[:2]), True
    await asyncio.sleep(seconds)
    cpu1, lat.recording = sum(me.cpu_times()[:2]), False
    dead = [t for t in running if t.done() and not t.cancelled() and t.exception() is not None]
    for n in nodes:
        n.stop = True
    for t in running:
        t.cancel()
    await asyncio.wait(running, timeout=TEARDOWN_S)  # the figures are taken: a straggler does not hold them
    if dead:  # a node or writer that died would leave the figures quietly low
        raise RuntimeError(f"an emulated node or writer failed in emulator process {os.getpid()}") \
            from dead[0].exception()
    return {"lat": lat.by_kind, "cpu_s": cpu1 - cpu0, "gathered": gathered(coalescers) if grouped else {}}


def probe(address: str, dl_pickled: bytes, start_at: float, seconds: float, every: float = 0.02) -> list[float]:
    """An idle caller of its own process: a trivial call (``progress``) every ``every`` seconds
    in the window; its latencies are what the data layer's worker adds under the nodes' load
    (its queue, its stretches between awaits), without an emulator's own delays."""
    from distributed import Client

    with Client(address, direct_to_workers=True):
        dl = Link(pickle.loads(dl_pickled), "the data layer")
        dl.progress().result(60)
        time.sleep(max(0.0, start_at - time.time()))
        out = []
        while time.time() < start_at + seconds:
            t0 = time.perf_counter()
            dl.progress().result(60)
            out.append(time.perf_counter() - t0)
            time.sleep(every)
        return out
