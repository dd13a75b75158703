"""Monitoring room: per-partition views built from the data layer's per-node table.

A RaaS node's heartbeat carries its partition, its lifetime episode and token counts and the
weight versions it serves; the data layer counts each node's completed tasks and, per node, the
staleness (versions behind the consuming trainer) of every sequence a trainer consumed
(``consumed_staleness_by_node``). Summed per partition, these give each partition's
throughput, the staleness of what it generated, and the versions it serves, so a slow or far
partition shows up as such. `StatusWriter` turns the counts into rates over its window.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from schedulers import parse_worker_name

if TYPE_CHECKING:
    from astraflow.runtime.workers import Fleet

#: the counts of a partition none of whose nodes reported yet
ZERO_COUNTS: dict[str, Any] = {"completed": 0, "tokens": 0, "staleness": Counter()}


def worker_of(node: str) -> str:
    """The worker hosting ``node``: several nodes of one worker (``rollout.nodes_per_worker``) are
    named ``<worker>.n<i>``; a worker's only node has the worker's name."""
    head, dot, index = node.rpartition(".n")
    return head if dot and index.isdigit() else node


def node_partition(node: str, info: dict[str, Any], fleet: Fleet) -> str | None:
    """The partition of ``node``: from its heartbeat, else from its worker (several nodes per
    worker are named ``<worker>.n<i>``), else from its worker's name (a node of an earlier
    incarnation, whose consumption the data layer keeps); None when none is known."""
    if info.get("partition"):
        return str(info["partition"])
    worker = worker_of(node)
    w = fleet.workers.get(node) or fleet.workers.get(str(info.get("worker", ""))) or fleet.workers.get(worker)
    if w is not None:
        return w.partition
    try:
        return str(parse_worker_name(worker)["partition"])
    except ValueError:
        return None


def partition_counts(dl_state: dict[str, Any], fleet: Fleet, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per partition (``names`` first, then any other a node reports): completed tasks, sampled
    tokens and the staleness histogram of consumed sequences, all cumulative over the run."""
    out: dict[str, dict[str, Any]] = {n: {"completed": 0, "tokens": 0, "staleness": Counter()} for n in names}
    nodes = dl_state.get("nodes", {})

    def of(node: str) -> dict[str, Any] | None:
        p = node_partition(node, nodes.get(node, {}), fleet)
        if p is None:
            return None
        return out.setdefault(p, {"completed": 0, "tokens": 0, "staleness": Counter()})

    for node, info in nodes.items():
        c = of(node)
        if c is not None:
            c["completed"] += int(info.get("completed", 0))
            c["tokens"] += int(info.get("tokens", 0))
    for node, hist in dl_state.get("consumed_staleness_by_node", {}).items():
        c = of(node)
        if c is not None:
            c["staleness"].update({int(k): int(v) for k, v in hist.items()})
    return out


def staleness_summary(hist: Counter) -> dict[str, Any]:
    """``consumed`` sequences of a partition and their mean and max staleness (None when none)."""
    n = sum(hist.values())
    return {"consumed": n,
            "staleness_mean": sum(k * v for k, v in hist.items()) / n if n else None,
            "staleness_max": max((k for k, v in hist.items() if v > 0), default=None)}


def partition_versions(dl_state: dict[str, Any], fleet: Fleet) -> dict[str, dict[str, list[int]]]:
    """Per partition, per policy: the distinct weight versions its live nodes serve now."""
    out: dict[str, dict[str, set[int]]] = {}
    for node, info in dl_state.get("nodes", {}).items():
        if info.get("gone"):
            continue
        p = node_partition(node, info, fleet)
        if p is None:
            continue
        for policy, v in (info.get("versions") or {}).items():
            out.setdefault(p, {}).setdefault(policy, set()).add(int(v))
    return {p: {pol: sorted(vs) for pol, vs in by.items()} for p, by in out.items()}
