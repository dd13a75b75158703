"""A RaaS node whose loop fails logs the error once: ``RaaS node ... failed`` with its traceback,
then its last heartbeat carries it to the orchestrator. The error is not raised on out of the
node's thread, where Python's thread-exception handler would log it a second time. What the
node still counted of its failed episodes is said as it ends."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from types import SimpleNamespace

import pytest

from astraflow.rollout.config import RolloutConfig
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.workloads.config import SamplingConfig


class Refuses:
    """The data layer's side of a node's calls: every heartbeat fails; ``beats`` records them."""

    def __init__(self):
        self.beats: list[dict] = []

    def heartbeat(self, node, stats):
        self.beats.append(dict(stats))
        fut = concurrent.futures.Future()
        fut.set_exception(RuntimeError("the data layer refused n0"))
        return fut


def _failing_node(tmp_path) -> tuple[RaaSNode, Refuses]:
    dl = Refuses()
    node = RaaSNode(identity=NodeIdentity(name="n0"), models={}, workload_name="math",
                    rollout=RolloutConfig(capacity=4), workload_params={}, workload_seed=0, workflow="single_turn",
                    sampling=SamplingConfig(), store_url=str(tmp_path / "trajectories"),
                    weights_root=str(tmp_path / "weights"), data_layer=dl)
    node.writer = SimpleNamespace(flush=lambda: None)
    node.puller = SimpleNamespace(poll=lambda: 0)
    return node, dl


def _run_in_its_thread(node: RaaSNode) -> None:
    """What ``start`` does: the node's loop on a thread of its own."""
    thread = threading.Thread(target=node._run, name="raas-n0", daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


@pytest.mark.timeout(60)
def test_a_node_whose_loop_fails_logs_it_once_and_reports_it_in_its_last_heartbeat(tmp_path, caplog, monkeypatch):
    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    node, dl = _failing_node(tmp_path)
    with caplog.at_level(logging.INFO):
        _run_in_its_thread(node)
    assert not raised, f"raised out of the node's thread (logged again): {raised}"
    assert node.error == "RuntimeError: the data layer refused n0" and node.draining
    said = [r for r in caplog.records if "the data layer refused n0" in r.getMessage()
            or (r.exc_info and "the data layer refused n0" in str(r.exc_info[1]))]
    assert [r.getMessage() for r in said if r.exc_info] == ["RaaS node n0 failed"], [r.getMessage() for r in said]
    assert dl.beats[-1]["error"] == node.error  # the last word: the orchestrator replaces the node


@pytest.mark.timeout(60)
def test_the_failed_episodes_a_node_counted_are_said_as_it_ends(tmp_path, caplog):
    node, _ = _failing_node(tmp_path)
    for i in range(3):
        node._failure_log.failed(f"g/{i}", KeyError("missing"))
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        _run_in_its_thread(node)
    assert "node n0: 2 more episodes failed in the last" in caplog.text and ": KeyError: 'missing'" in caplog.text
