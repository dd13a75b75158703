"""A RaaS node's own loop against a real data layer: any exception of a workflow or a reward,
of any type, fails that task (requeued up to ``dataflow.max_attempts``, then failed) and
releases its lease; a reward that hangs fails its episode at ``rollout.reward_timeout_s``
without freezing the node; an engine call that hangs fails its episode at
``rollout.episode_timeout_s``; a node whose loop dies says so in a last heartbeat and its leases
stop being renewed.

The data layer runs in this process on an event loop of its own, behind `LocalActor`, which
stands in for the Dask actor handle (the process boundary); everything else is real: the
node's loop, a tiny HF engine, the Zarr trajectory store, the leases and the ledger."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import pytest

from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.rollout.config import RolloutConfig
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.rollout import workflows
from astraflow.rollout.weight_sync import WeightPuller
from astraflow.rollout.workflows import SingleTurn, workflow_class
from astraflow.runtime.stopping import disk_full, full_disk_of
from astraflow.workloads.base import make_workload
from astraflow.workloads.config import SamplingConfig, WorkloadConfig
from storage.trajectories import open_trajectory_store

MATH = {"digits": 1, "num_test": 10}


class LocalActor:
    """An object's async methods run on an event loop thread of their own; each call returns a
    ``concurrent.futures.Future`` (what a Dask actor handle's calls give a RaaS node)."""

    def __init__(self, obj: Any):
        self.obj = obj
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __getattr__(self, name: str):
        method = getattr(self.obj, name)
        return lambda *args, **kwargs: asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self.loop)

    def read(self, fn):
        """``fn(obj)`` run on the object's loop (its state is never touched from another thread)."""
        async def on_loop():
            return fn(self.obj)
        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Weird(BaseException):
    """Not an ``Exception``: ``except Exception`` lets it through."""


class OddError(Exception):
    pass


class Scripted(SingleTurn):
    """``single_turn`` whose episodes fail in turn: raised by the workflow itself (a
    ``BaseException`` subclass, ``SystemExit``, a user's exception type) or by its reward."""

    FAILURES = ("Weird", "SystemExit", "OddError", "KeyError", "RuntimeError")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.n = 0

    async def run_episode(self, engines, task):
        kind = self.FAILURES[self.n % len(self.FAILURES)]
        self.n += 1
        if kind == "Weird":
            raise Weird("a BaseException from the workflow")
        if kind == "SystemExit":
            raise SystemExit(3)
        if kind == "OddError":
            raise OddError("a user's exception type")
        self.workload.fails_with = kind
        return await super().run_episode(engines, task)


class MathWithReward:
    """The math workload whose reward raises ``fails_with`` (``KeyError``, ``RuntimeError``)
    or, with ``hang``, waits until the test releases it."""

    def __init__(self):
        self.wl = make_workload("math", MATH, 0)
        self.fails_with: str | None = None
        self.hang: threading.Event | None = None

    def render_prompt(self, payload):
        return self.wl.render_prompt(payload)

    def reward(self, completion, payload):
        if self.hang is not None:
            self.hang.wait(60)  # released at the end of the test, so no pool thread outlives it
        if self.fails_with == "KeyError":
            raise KeyError("answer")
        if self.fails_with == "RuntimeError":
            raise RuntimeError("the reward's checker crashed")
        return self.wl.reward(completion, payload)


def _rig(tmp_path, tiny_model, workflow_cls, reward_timeout_s: float = 30.0, max_attempts: int = 2,
         episode_timeout_s: float = 600.0):
    """A data layer behind `LocalActor` and a node serving it with ``workflow_cls`` (a class, or
    a workflow name such as ``module:name``). Leases last far longer than the test: a lease
    released during it was released by a failure report."""
    if isinstance(workflow_cls, str):
        workflow_cls = workflow_class(workflow_cls)
    url = str(tmp_path / "trajectories")
    layer = DataLayer(dataflow=DataflowConfig(batch_size=8, lease_seconds=300, max_attempts=max_attempts),
                      workload=WorkloadConfig(name="math", params=MATH, group_size=4), policies=["p"],
                      store_url=url, metrics_path=str(tmp_path / "metrics.jsonl"), max_steps=5)
    dl = LocalActor(layer)
    node = RaaSNode(identity=NodeIdentity(name="n0"),
                    rollout=RolloutConfig(capacity=4, reward_timeout_s=reward_timeout_s,
                                          episode_timeout_s=episode_timeout_s),
                    models={}, workload_name="math", workload_params=MATH, workload_seed=0,
                    workflow="single_turn", sampling=SamplingConfig(max_new_tokens=4), store_url=url,
                    weights_root=str(tmp_path / "weights"), data_layer=dl)
    # what ``start`` does on a Dask worker, with the test's workflow and an in-process engine
    node.store = open_trajectory_store(url, "a")
    node.writer = node.store.writer("n0", batch_size=16)
    node.engines.update({"p": HFEngine(str(tiny_model), version=0)})  # as ``start`` fills them
    node.puller = WeightPuller(str(tmp_path / "weights"), node.engines)
    workload = MathWithReward()
    node.workflow = workflow_cls(workload=workload, sampling=SamplingParams(max_new_tokens=4), node="n0",
                                 reward_timeout_s=reward_timeout_s)
    node._thread = threading.Thread(target=node._run, daemon=True)
    node._thread.start()
    return layer, dl, node, workload


def _wait(what: str, cond, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _last_seen(dl: LocalActor, node: str = "n0") -> float:
    """When the data layer last heard from ``node`` (a lease or a heartbeat), on its own clock."""
    return dl.state().result(10)["nodes"][node]["last_seen"]


def _calls_again(dl: LocalActor, node: str = "n0") -> None:
    """Wait until ``node`` calls the data layer again: its loop is not blocked."""
    seen = _last_seen(dl, node)
    _wait(f"node {node} to call the data layer again", lambda: _last_seen(dl, node) > seen)


def _ledger(dl: LocalActor) -> dict:
    return dl.read(lambda layer: layer.ledger.summary())


def _held(dl: LocalActor) -> dict:
    return dl.read(lambda layer: dict(layer.leases.held))


def _reasons(summary: dict) -> str:
    return " ".join(list(summary["requeued_by_reason"]) + list(summary["failed_by_reason"]))


@pytest.fixture
def stop_after():
    """Stops what a test started (node, data layer), also when the test fails."""
    started: list = []
    yield started.append
    for node, dl in started:
        node.stop(timeout=10)
        dl.close()


@pytest.mark.timeout(120)
def test_any_exception_of_a_workflow_or_reward_fails_its_task_and_releases_the_lease(tmp_path, tiny_model, stop_after):
    _, dl, node, _ = _rig(tmp_path, tiny_model, Scripted)
    stop_after((node, dl))
    # every kind fails a task; with two attempts each, tasks end as failed
    _wait("every kind of failure to be reported",
          lambda: all(k in _reasons(_ledger(dl)) for k in Scripted.FAILURES) and _ledger(dl)["states"].get("failed"))
    assert node._thread.is_alive() and node.error is None, node.error  # the node goes on serving
    node.stop(timeout=10)
    # a stopped node's writer is closed: its committer thread ended, its segment released
    assert node.stopped and node.writer._closed
    assert node.writer._committer is None or not node.writer._committer.is_alive()
    summary = _ledger(dl)
    # nothing expired (leases last 300 s): every failure was reported and released its lease
    assert not _held(dl), "a lease was left held"
    assert summary["events"].get("requeued_lease_expired", 0) == 0
    assert all(r.endswith(" (after 2 attempts)") for r in summary["failed_by_reason"]), summary
    assert node.counters["failed"] >= len(Scripted.FAILURES)


class ByName(SingleTurn):
    """A user's workflow that takes its engine by a hard-coded policy name."""

    async def run_episode(self, engines, task):
        engines["verifier"]
        return await super().run_episode(engines, task)


@pytest.mark.timeout(120)
def test_an_engine_asked_for_by_a_policy_name_the_run_has_not_fails_naming_the_runs_policies(
        tmp_path, tiny_model, stop_after):
    """A workflow written for a run whose second policy is ``verifier``, in a run that names it
    otherwise: the failure reason (what the run stops with) names the run's policies and the fix,
    not only ``KeyError: 'verifier'``."""
    _, dl, node, _ = _rig(tmp_path, tiny_model, ByName)
    stop_after((node, dl))
    _wait("the episodes to fail", lambda: _ledger(dl)["failed_by_reason"])
    reason = _reasons(_ledger(dl))
    assert ("UnknownPolicy: engines['verifier']: the run has no policy named 'verifier' (its policies: p); take a "
            "role's policy as task.policies[i]") in reason, reason


@pytest.mark.timeout(120)
def test_a_hanging_reward_fails_its_episode_at_its_deadline_and_the_node_goes_on(tmp_path, tiny_model, stop_after,
                                                                                  monkeypatch):
    armed: list[float | None] = []  # the deadline each reward call was given
    pool_call = workflows._REWARD_THREADS.call

    async def call(fn, timeout_s, queue=None):
        armed.append(timeout_s)
        return await pool_call(fn, timeout_s, queue)

    monkeypatch.setattr(workflows._REWARD_THREADS, "call", call)
    release = threading.Event()
    try:
        _, dl, node, workload = _rig(tmp_path, tiny_model, SingleTurn, reward_timeout_s=0.5)
        workload.hang = release
        stop_after((node, dl))
        _wait("a reward past its deadline", lambda: "RewardTimeout" in _reasons(_ledger(dl)))
        # its own deadline fired (the reward is still held), the one configured
        assert not release.is_set() and armed and set(armed) == {0.5}, armed
        assert "ran past its 0.5 s deadline (rollout.reward_timeout_s)" in _reasons(_ledger(dl))
        # the node's loop was never blocked: it keeps calling the data layer and holds no stale lease
        _calls_again(dl)
        assert node.error is None
        node.stop(timeout=10)
        assert not _held(dl)
    finally:
        release.set()


@pytest.mark.timeout(120)
def test_an_episode_whose_engine_call_hangs_is_failed_at_its_deadline_and_requeued(tmp_path, tiny_model, stop_after):
    _, dl, node, _ = _rig(tmp_path, tiny_model, "tests.rollout.hanging_workflow:hanging_engine_call_test",
                          episode_timeout_s=2.0)
    stop_after((node, dl))
    _wait("the hung episode to fail at its deadline", lambda: "EpisodeTimeout" in _reasons(_ledger(dl)))
    assert "episode ran past its 2 s deadline (rollout.episode_timeout_s)" in _reasons(_ledger(dl))
    [hung] = node.workflow.hung
    # requeued (attempt 2 of 2), not failed for good: another attempt of the same task completes
    def state():
        return dl.read(lambda layer: layer.ledger.tasks[hung].state)
    _wait("the requeued task to be done", lambda: state() not in ("pending", "leased"))
    assert state() in ("completed", "evaluated", "consumed"), state()
    summary = _ledger(dl)
    assert summary["events"].get("requeued_lease_expired", 0) == 0  # released by the failure report
    assert "rollout.episode_timeout_s" in _reasons(summary)
    assert node.counters["failed"] >= 1 and node.counters["episodes"] >= 2
    assert node._thread.is_alive() and node.error is None, node.error  # the node goes on serving
    _calls_again(dl)
    node.stop(timeout=10)
    assert not _held(dl)


class _FullDisk:
    """A trajectory writer on a full disk: writing a batch's bytes fails."""

    def submit(self, rows):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass

    def close(self):  # a stopped node closes its writer
        pass


class _FullDiskAtCommit(_FullDisk):
    """The disk fills up in the flush round: the batch's commit fails, after ``submit`` returned."""

    def submit(self, rows):
        failed: concurrent.futures.Future = concurrent.futures.Future()
        failed.set_exception(OSError(28, "No space left on device"))
        return failed


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's error, re-raised
@pytest.mark.parametrize("writer", [_FullDisk, _FullDiskAtCommit])
def test_a_node_whose_loop_dies_reports_it_and_stops_renewing_its_leases(tmp_path, tiny_model, stop_after, writer):
    _, dl, node, _ = _rig(tmp_path, tiny_model, SingleTurn)
    node.writer = writer()
    stop_after((node, dl))
    _wait("the node's loop to end", lambda: not node._thread.is_alive())
    assert "No space left on device" in node.error
    report = dl.state().result(10)["nodes"]["n0"]
    assert "No space left on device" in report["error"]  # its last heartbeat: the orchestrator replaces it
    assert disk_full(full_disk_of(report))  # ... or, as here, stops the run: a new node would hit the full disk too
    held = _held(dl)
    assert held, "its finished episodes, never written, still hold their leases"
    assert dl.node_gone("n0").result(10) == len(held) and not _held(dl)  # what replacing the node does


class NeverEnds(SingleTurn):
    """An episode that would run forever (a tool that hangs, a long multi-turn episode)."""

    async def run_episode(self, engines, task):
        await asyncio.get_running_loop().create_future()


def test_episodes_a_stopping_node_gives_up_on_are_failed_back_not_renewed(tmp_path, tiny_model):
    """A node that stops before its episodes end reports their tasks failed, so they are
    requeued at once; its last heartbeat does not renew their leases for another full term."""
    layer, dl, node, _ = _rig(tmp_path, tiny_model, NeverEnds)
    try:
        _wait("four episodes in flight", lambda: len(node.inflight) == 4 and len(_held(dl)) == 4)
        node.stop(timeout=2.0)
        assert _held(dl) == {}, "the abandoned episodes' leases are still held"
        summary = _ledger(dl)
        assert summary["events"].get("requeued", 0) >= 4, summary
    finally:
        node.stop(timeout=10)
        dl.close()
