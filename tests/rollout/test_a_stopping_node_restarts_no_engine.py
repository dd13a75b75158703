"""A node that stops does not take its dead engine processes for a crash to recover from:
``scancel`` sends SIGTERM to every process of the job, engine processes included, and a reload
of the model would hold up the stop (and the shared ``cluster.stop_grace_s`` of every other
component). So a stopping node starts no restart, a restart under way gives up without an
error, and closing an engine does not wait for a model being loaded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from astraflow.contracts import RolloutTask
from astraflow.rollout.config import RolloutConfig
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.rollout.process_engine import EngineProcessError, ProcessEngine
from astraflow.workloads.config import SamplingConfig
from tests.rollout.test_node_writer import _node

DIED = "the engine process exited with code -15; see the worker log"


class Dead:
    """A dead engine process's stand-in; ``on_restart(engine)`` runs as its restart does."""

    version, pid, restartable, tokenizer, loads_versions_itself = 0, None, True, None, True

    def __init__(self, on_restart=None):
        self.dead: str | None = DIED
        self.starts = 0
        self.on_restart = on_restart

    def restart(self):
        self.starts += 1
        if self.on_restart is not None:
            self.on_restart(self)
        self.dead = None

    def load_version(self, *args, **kwargs):
        pass

    def take_load_records(self):
        return []

    def stats(self):
        return {}

    def close(self):
        pass


class DiesWithTheJob:
    """A workflow whose engine call fails as the engine process's SIGTERM makes it fail."""

    async def run_episode(self, engines, task):
        raise EngineProcessError(DIED)


def _task():
    return RolloutTask(task_id="g0/0", group_id="g0", policies=("p",), workflow="w", prompt={}, kind="train")


def test_an_episode_failed_by_a_dead_engine_on_a_stopping_node_starts_no_restart(tmp_path):
    node, dl = _node(tmp_path)
    engine = Dead()
    node.engines, node.workflow = {"p": engine}, DiesWithTheJob()
    node._stop.set()  # ``stop`` was called
    task = _task()
    node.inflight[task.task_id] = task

    async def run():
        node._slot_free = asyncio.Event()
        await node._episode(task)
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert [t for t, _ in dl.failed] == ["g0/0"]  # the task is still failed back (requeued at once)
    assert node._recovery is None and engine.starts == 0
    assert node.error is None and node.counters["engine_restarts"] == 0


class StopsOnHeartbeat:
    """The data layer's side of a node's calls: the node is stopped while its heartbeat is under
    way (``stop`` arrives from the Dask worker's thread), and there are no tasks."""

    def __init__(self):
        self.node: RaaSNode | None = None

    @staticmethod
    def _answer(value):
        fut = concurrent.futures.Future()
        fut.set_result(value)
        return fut

    def heartbeat(self, node, stats):
        self.node._stop.set()
        return self._answer({"draining": False, "finished": False})

    def lease(self, node, capacity, wait, versions=None):
        return self._answer([])


@pytest.mark.timeout(60)
def test_an_engine_found_dead_while_the_node_stops_is_not_restarted(tmp_path):
    dl = StopsOnHeartbeat()
    node = RaaSNode(identity=NodeIdentity(name="n0"), models={}, workload_name="math",
                    rollout=RolloutConfig(capacity=4, lease_wait_seconds=0.1), workload_params={}, workload_seed=0,
                    workflow="single_turn", sampling=SamplingConfig(), store_url=str(tmp_path / "trajectories"),
                    weights_root=str(tmp_path / "weights"), data_layer=dl)
    dl.node = node
    node.writer = SimpleNamespace(flush=lambda: None)
    node.puller = SimpleNamespace(poll=lambda: 0)
    engine = Dead()
    node.engines = {"p": engine}
    asyncio.run(node._guarded())  # the loop's turn sees the dead engine after the stop
    assert engine.starts == 0 and node.error is None and node.counters["engine_restarts"] == 0


def test_a_restart_under_way_gives_up_when_the_node_stops(tmp_path):
    """Two engines died; the node stops while the first reloads: the second is not restarted
    and no weights are loaded."""
    node, _ = _node(tmp_path)
    first, second = Dead(on_restart=lambda _: node._stop.set()), Dead()
    node.engines = {"p": first, "q": second}
    polls = []
    node.puller = SimpleNamespace(poll=lambda: polls.append(1) or 1)
    asyncio.run(node._recover(EngineProcessError(DIED)))
    assert first.starts == 1 and second.starts == 0 and not polls
    assert node.error is None and not node.draining


def test_an_engine_closed_under_its_restart_is_no_error_of_the_stopping_node(tmp_path):
    """The stop closed the engine being restarted: its restart fails, and is neither tried again
    nor taken for an engine that cannot be restarted."""
    node, _ = _node(tmp_path, engine_restarts=3)

    def closed(engine):
        node._stop.set()
        raise EngineProcessError("the engine was closed while its process started")

    engine = Dead(on_restart=closed)
    node.engines = {"p": engine}
    node.puller = SimpleNamespace(poll=lambda: 1)
    asyncio.run(node._recover(EngineProcessError(DIED)))
    assert engine.starts == 1 and node.error is None and not node.draining


def never_ready(conn, *args):
    """An engine process whose model takes longer to load than the test runs."""
    time.sleep(120)


@pytest.mark.timeout(120)
def test_closing_a_process_engine_does_not_wait_for_the_model_its_restart_loads(tiny_model, monkeypatch):
    from astraflow.rollout import process_engine

    engine = ProcessEngine(str(tiny_model), max_batch_size=4, device="cpu")
    try:
        dead_pid = engine.pid
        os.kill(dead_pid, signal.SIGKILL)  # our own child, by its PID
        deadline = time.monotonic() + 30
        while not engine.dead:
            assert time.monotonic() < deadline, "the killed engine process is not seen dead"
            time.sleep(0.02)
        monkeypatch.setattr(process_engine, "engine_main", never_ready)
        errors: list[BaseException] = []

        def restart():
            try:
                engine.restart()
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        while engine.pid == dead_pid:  # the new process is loading
            assert time.monotonic() < deadline, "the restart started no process"
            time.sleep(0.02)
        closer = threading.Thread(target=engine.close, daemon=True)
        closer.start()
        closer.join(30)  # the model never loads (``never_ready``): a close that waits for it never returns
        assert not closer.is_alive(), "close waited for the model its restart loads"
        thread.join(10)
        assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], EngineProcessError), errors
        assert "closed" in str(errors[0]) and not engine._proc.is_alive()  # the loading process is stopped
        with pytest.raises(EngineProcessError, match="closed"):
            engine.restart()  # none starts after
    finally:
        engine.close()
