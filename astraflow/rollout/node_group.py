"""``RaaSNodeGroup``: the ``rollout.nodes_per_worker`` RaaS nodes of one rollout worker, as one
Dask actor with the node's actor API.

Each node is a full ``RaaSNode`` (its own leases, heartbeats, trajectory segment, engines and
weight watcher) named ``<worker>.n<i>``; all of them run on the process's shared event loop
(``shared_loop``). The group answers for them: ``start`` returns the lowest version each policy
is served at, ``stop`` stops them together and sums their counters, ``reconnect``, ``refresh``
and ``drain`` go to every node. The data layer knows each node by its own name and the worker
they share (heartbeat ``worker``), so draining or losing the worker reaches all of them.
Their heartbeats, leases and completions reach the data layer gathered, one call per kind at
a time for the whole group (``coalesce.Coalescer``), and their leases are served first from
the worker's lease stock (``rollout.lease_ahead``, ``lease_stock.py``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from astraflow.rollout.coalesce import Coalescer
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.transport import Link, bind


def member_name(worker: str, index: int) -> str:
    """The name of node ``index`` of ``worker`` (its data-layer name, and the base of its segments' names)."""
    return f"{worker}.n{index}"


class RaaSNodeGroup:
    """Dask actor: ``rollout.nodes_per_worker`` RaaS nodes on one shared event loop."""

    def __init__(self, *, identity: NodeIdentity, **node_kwargs: Any):
        count = node_kwargs["rollout"].nodes_per_worker
        self.identity = identity
        self._data_layer = node_kwargs["data_layer"]
        seed = node_kwargs.pop("seed", 0)
        self.nodes = [RaaSNode(identity=replace(identity, name=member_name(identity.name, i), worker=identity.name),
                               seed=seed * 100_003 + i, **node_kwargs) for i in range(count)]
        self.coalescer: Coalescer | None = None
        if count > 1:  # one handle for all: their calls are gathered, their leases served from a stock
            rollout = node_kwargs["rollout"]
            self.coalescer = Coalescer(Link(self._data_layer, "the data layer"), worker=identity.name,
                                       lease_ahead=rollout.lease_ahead, lease_wait_s=rollout.lease_wait_seconds)
            for node in self.nodes:
                node.dl = self.coalescer

    def _each(self, fn) -> list[Any]:
        with ThreadPoolExecutor(max_workers=min(len(self.nodes), 16)) as pool:
            return list(pool.map(fn, self.nodes))

    def start(self) -> dict[str, int]:
        bind(self._data_layer)
        # one after the other: opening segment writers of one store at once is not safe, and a
        # sim node starts in milliseconds
        return _lowest([n.start() for n in self.nodes])

    def refresh(self) -> dict[str, int]:
        return _lowest(self._each(lambda n: n.refresh()))

    def versions(self) -> dict[str, int]:
        return _lowest([n.versions() for n in self.nodes])

    def reconnect(self, data_layer: Any) -> None:
        for n in self.nodes:
            n.reconnect(data_layer)

    def data_layer_lost(self) -> None:
        for n in self.nodes:
            n.data_layer_lost()

    def drain(self) -> None:
        for n in self.nodes:
            n.drain()
        if self.coalescer is not None:  # what the nodes will not take goes back now
            self.coalescer.drain()

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        merged = _merged(self.identity.name, self._each(lambda n: n.stop(timeout=timeout)))
        if self.coalescer is not None:
            self.coalescer.drain()
        return merged

    def state(self) -> dict[str, Any]:
        return _merged(self.identity.name, [n.state() for n in self.nodes])


def _lowest(per_node: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for versions in per_node:
        for policy, v in versions.items():
            out[policy] = min(out.get(policy, v), v)
    return out


def _merged(name: str, states: list[dict[str, Any]]) -> dict[str, Any]:
    """The group's state: the first node's shape, counters and rates summed, every error kept."""
    out = dict(states[0], node=name, members=[s["node"] for s in states])
    out["counters"] = {k: sum(s["counters"].get(k, 0) for s in states) for k in states[0]["counters"]}
    for key in ("inflight", "writing", "generated_tokens_per_s", "episodes_per_s"):
        out[key] = sum(s[key] for s in states)
    out["versions"] = _lowest([s["versions"] for s in states])
    out["stopped"] = all(s["stopped"] for s in states)
    errors = [f"{s['node']}: {s['error']}" for s in states if s["error"]]
    out["error"] = "; ".join(errors) or None
    return out
