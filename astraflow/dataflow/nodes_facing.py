"""The data layer's RaaS-node-facing calls: leases (one node's, a node group's gathered ones,
a lease stock's), completions, failures, heartbeats, drains. A part of `DataLayer`
(``layer.py``), kept in its own module; every name it uses on ``self`` is the data layer's.

Every call that changed the state waits for its change record before it answers
(``self._durable``): a node never acts on a lease or a completion the next data layer would
not know of."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from astraflow.contracts import RolloutTask, TrajectoryRef, lease_stock_name
from astraflow.dataflow import admission
from astraflow.dataflow.rules import RuleError
from astraflow.transport import Packed, PackedDict

#: completions recorded before ``complete`` lets other calls run (a gathered completion of a
#: node group can carry thousands)
COMPLETE_SLICE = 64


def _dropped(info: dict[str, Any], was_gone: bool) -> bool:
    """Whether a node that asked for leases may no longer get any: it is draining, or was
    declared gone after its call began (a long poll wakes after either)."""
    return info["draining"] or (info.get("gone", False) and not was_gone)


class NodeFacing:
    """The RaaS-node-facing calls of ``DataLayer`` (module docstring)."""

    async def lease(self, node: str, capacity: int, wait: float = 0.0,
                    versions: dict[str, int] | None = None) -> list[RolloutTask]:
        """Up to ``capacity`` tasks for ``node`` (evaluation tasks first). ``wait``: when there
        are none, wait up to this many seconds for some (a long poll: the node gets the tasks
        of a batch the moment the trainer's request makes room for them, with one call).
        ``versions``: the weight version the node holds per policy (admission by version);
        while admission refuses new groups because a node's weights are too old, the call
        returns at once, so that the node asks again with the weights it loads next."""
        return (await self._lease([(node, capacity, versions)], wait))[node]

    async def lease_many(self, requests: list[tuple[str, int, dict[str, int] | None]],
                         wait: float = 0.0) -> dict[str, list[RolloutTask]]:
        """``lease`` for several nodes in one call (the nodes of one rollout worker): each
        ``(node, capacity, versions)`` gets what its own ``lease`` would, in the order given;
        the long poll ends when any of them can be served."""
        return await self._lease(requests, wait)

    async def _lease(self, requests: list, wait: float) -> dict[str, list[RolloutTask]]:
        t0 = time.perf_counter()
        try:
            return await self._lease_now(requests, wait)
        except RuleError as err:  # a curator's bug: the run ends naming it, no node is blamed
            self.rule_error = self.rule_error or str(err)
            raise
        finally:
            self.service.add("lease", time.perf_counter() - t0)

    async def _lease_now(self, requests: list, wait: float) -> dict[str, list[RolloutTask]]:
        mark = self._mark()
        self.leases.expire()
        now = time.time()
        out: dict[str, list[RolloutTask]] = PackedDict()
        asking = []
        for node, capacity, versions in requests:
            out[node] = Packed()
            info = self.leases.node(node)
            info["last_seen"] = now
            info["capacity"] = capacity
            if versions is not None:
                info["versions"] = dict(versions)
                self.oldest.saw(versions)
            if not info["draining"] and capacity > 0:
                asking.append((node, capacity, info, info.get("gone", False)))
        if not asking:
            await self._durable(mark)
            return out
        self._refill()
        deadline = now + wait
        while (not self.leases.waiting() and not self.finished
               and not all(_dropped(info, gone) for _, _, info, gone in asking)):
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            # (a lease stock has no weights of its own to load: it waits)
            if self.mixer.refused and any(admission.lags(info.get("versions"), self.versions)
                                          for _, _, info, _ in asking if not info.get("stock")):
                break
            # woken by _notify (a batch served, trajectories ingested, a version published)
            await self._wait(min(remaining, 0.1))
            self.leases.expire()
            self._refill()
        for node, capacity, info, gone in asking:  # a node named twice gets both shares (none is orphaned)
            if not _dropped(info, gone):  # drained or declared gone while the call waited: nothing
                taken = self.leases.take(node, capacity)
                for task in taken:  # evaluation tasks come first
                    if task.kind != "eval":
                        break
                    self.evals.leased(task)
                out[node].extend(taken)
        await self._durable(mark)  # a node never runs a task the next data layer does not know
        return out

    async def lease_ahead(self, worker: str, capacity: int, wait: float = 0.0) -> list[RolloutTask]:
        """``lease`` for the lease stock of ``worker`` (``lease_stock_name``): tasks its nodes
        take without a call here, each moving to its node when that node's heartbeat names it
        among those it holds, or completes it. The stock drains and goes with its worker. Its
        heartbeat, not this call, reports the weight versions its nodes hold."""
        name = lease_stock_name(worker)
        self.leases.node(name).update(stock=True, worker=worker)
        return (await self._lease([(name, capacity, None)], wait))[name]

    async def return_leases(self, worker: str, task_ids: list[str]) -> int:
        """Tasks the lease stock of ``worker`` leased and never handed out go back to the front
        of their queue, no attempt counted. Returns how many it still held."""
        n, holder = 0, lease_stock_name(worker)
        for tid in reversed(task_ids):  # each goes to the front: their order is kept
            if self.leases.held.get(tid, (None,))[0] == holder:
                self.leases.unlease(tid)
                n += 1
        if n:
            self._notify()
            await self._durable()
        return n

    async def complete(self, refs: list[TrajectoryRef]) -> int:
        """Record committed trajectories; returns how many were new (others were duplicates).
        A long list is taken in slices, other calls (a lease, a heartbeat) answered between."""
        t0 = time.perf_counter()
        mark = self._mark()
        new = 0
        for i, ref in enumerate(refs):
            if i and not i % COMPLETE_SLICE:
                await asyncio.sleep(0)
            task = self.leases.complete(ref)
            if task is None:
                continue
            new += 1
            self.generated.add(ref)
            if ref.kind == "eval":
                self.ledger.end(task.task_id, "evaluated")
                self.evals.record(task, ref)
            else:
                grp = self.buffers.rolling[task.group_id]
                grp.results[ref.task_id] = ref
                if grp.done():
                    try:
                        self._ingest(grp)
                    except RuleError as err:  # a group filter's or curator's bug: the run ends naming it
                        self.rule_error = self.rule_error or str(err)
                        raise
        await self._durable(mark)
        self.service.add("complete", time.perf_counter() - t0)
        return new

    async def segments_done(self, segments: list[str]) -> None:
        """A node will neither write to ``segments`` nor complete rows of them again: they are
        deleted once no held row is in them (``retention``; only with
        ``storage.keep_trajectories: false``)."""
        self.retention.segments_done(segments)

    async def fail(self, task_id: str, reason: str, attempt: int | None = None) -> None:
        """A node could not run a task; it is requeued (or fails after ``max_attempts``).
        ``attempt``: the attempt the node ran (``RolloutTask.attempt``); a report of an earlier
        one (its lease expired and the task went to another node) changes nothing."""
        task = self.leases.tasks.get(task_id)
        if attempt is not None and task is not None and task.attempt != attempt:
            return
        if task_id in self.leases.held:
            self.leases.give_back(task_id, f"failed:{reason}")
            await self._durable()

    async def heartbeat(self, node: str, stats: dict[str, Any]) -> dict[str, Any]:
        """Renew the node's leases and record its stats; tells the node whether to drain.
        ``stats["holding"]``: the ids of the tasks the node still works on (only their leases
        are renewed; absent: all of the node's)."""
        return PackedDict((await self.heartbeat_many({node: stats}))[node])

    async def heartbeat_many(self, beats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``heartbeat`` for several nodes in one call: node -> its stats; node -> its answer."""
        t0 = time.perf_counter()
        mark = self._mark()
        now = time.time()
        infos = {}
        newer = False
        for node, stats in beats.items():
            holding = stats.pop("holding", None)
            info = infos[node] = self.leases.node(node)
            # a lease stock's parked refills re-check admission when its nodes' weights move on
            # (nodes' own leases would have, each time they asked)
            newer = newer or bool(stats.get("stock") and stats.get("versions") != info.get("versions"))
            info.update(stats)
            if not stats.get("stocked"):  # a stocked node's versions reach here through its stock
                self.oldest.saw(stats.get("versions"))
            info["last_seen"] = now
            self.leases.renew(node, None if holding is None else set(holding))
        self.leases.expire()
        if newer:
            self._notify()
        await self._durable(mark)
        self.service.add("heartbeat", time.perf_counter() - t0)
        return PackedDict((node, self._beat_reply(info)) for node, info in infos.items())

    def _beat_reply(self, info: dict[str, Any]) -> dict[str, Any]:
        reply = {"draining": info["draining"], "finished": self.finished}
        if info.get("stock"):  # what a stock needs to answer its waiting nodes as ``lease`` would
            reply.update(versions=dict(self.versions), refused=bool(self.mixer.refused))
        return reply

    async def drain(self, node: str) -> None:
        """Stop leasing to ``node`` and the nodes sharing its worker (they finish what they hold)."""
        for name in self.leases.on_worker(node):
            self.leases.node(name)["draining"] = True
            self.leases.touch_node(name)
        await self._durable()

    async def node_gone(self, node: str) -> int:
        """The node's worker is gone: its leases return to the queue now. Returns how many."""
        n = self.leases.node_gone(node)
        await self._durable()
        return n
