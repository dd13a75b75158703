"""``NodeIdentity``: who a RaaS node is. A module of its own, importing nothing heavy: the
identity travels in the arguments of the node's placing, which the Dask scheduler unpickles too,
and naming it must not make the scheduler import the node's module (torch, transformers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeIdentity:
    """Who the node is; stamped into every trajectory's provenance."""

    name: str
    partition: str | None = None
    region: str | None = None
    hardware: str | None = None
    #: the worker the node shares with others (``rollout.nodes_per_worker``); None: its own
    worker: str | None = None
