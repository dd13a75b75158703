"""The three components on a real local Dask cluster, placed by the orchestrator: tasks,
trajectories and weights flow; a RaaS worker killed mid-lease loses no task."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from astraflow.runtime.monitoring.view import build_status_view
from astraflow.runtime.orchestrator import Orchestrator
from storage.trajectories import open_trajectory_store
from storage.weights import WeightStore

from tests.conftest import run_in_thread, tiny_config


def _status(run_dir):
    f = run_dir / "control" / "status.json"
    return json.loads(f.read_text()) if f.exists() else None


def _holds_leases_after(run_dir, node: str, since: float, wait_s: float = 20.0) -> bool:
    """Whether the first status written a moment after ``since`` has ``node`` holding leases."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            st = _status(run_dir)
        except ValueError:  # being replaced right now
            st = None
        if st and st.get("written_at", 0) > since + 1.0:
            return st["data_layer"]["nodes"].get(node, {}).get("leases_held", 0) > 0
        time.sleep(0.1)
    return False


@pytest.mark.timeout(300)
def test_nodes_move_to_new_segments_as_each_fills_and_the_trainer_reads_across_them(tiny_model, tmp_path):
    """``rollout.segment_max_entries``: each node's trajectories go to a series of segments
    (``<node>.<id>``, then ``.1``, ``.2``, ...), every full one past the bound, and training reads
    the rows wherever they are."""
    cfg = tiny_config(tiny_model, **{"run.max_steps": 3, "rollout.segment_max_entries": 8,
                                     "rollout.write_batch": 4})
    result = Orchestrator(cfg, tmp_path / "run").run()
    assert result.steps == {"solver": 3} and result.ledger["open"] == 0
    store = open_trajectory_store(str(tmp_path / "run" / "trajectories"), "r")
    counts = {s: store.count(s) for s in store.segments()}
    bases = sorted(s for s in counts if s.count(".") == 1)
    assert len(bases) == 2  # one series per node
    rotated = 0
    for base in bases:
        series = sorted((s for s in counts if s == base or s.startswith(base + ".")), key=lambda s: (len(s), s))
        assert series == [base] + [f"{base}.{k}" for k in range(1, len(series))]
        assert all(counts[s] >= 8 for s in series[:-1])  # a segment is left only once full
        # a node that wrote past the bound moved on (on a loaded machine one node may get few tasks)
        assert len(series) >= 2 or sum(counts[s] for s in series) <= 8 + 4, (base, counts)
        rotated += len(series) >= 2
    assert rotated >= 1 and sum(counts.values()) >= 3 * cfg.dataflow.batch_size


@pytest.mark.timeout(300)
def test_without_keep_trajectories_finished_segments_no_row_is_held_in_are_deleted(tiny_model, tmp_path):
    """``storage.keep_trajectories: false``: the segments nodes filled are deleted once the data
    layer holds none of their rows; training goes on reading the rest."""
    cfg = tiny_config(tiny_model, **{"run.max_steps": 4, "rollout.segment_max_entries": 8,
                                     "rollout.write_batch": 4, "storage.keep_trajectories": False})
    result = Orchestrator(cfg, tmp_path / "run").run()
    assert result.steps == {"solver": 4} and result.ledger["open"] == 0
    store = open_trajectory_store(str(tmp_path / "run" / "trajectories"), "r")
    present = set(store.segments())
    status = json.loads((tmp_path / "run" / "summary.json").read_text())["data_layer"]["retention"]
    assert status["segments_deleted"] >= 2
    series: dict[str, int] = {}  # per node: the highest segment number still stored
    for s in present:
        base, k = (s, 0) if s.count(".") == 1 else (s.rsplit(".", 1)[0], int(s.rsplit(".", 1)[1]))
        series[base] = max(series.get(base, 0), k)
    gaps = sum(k + 1 for k in series.values()) - len(present)  # segments of a series no longer there
    assert 2 <= gaps <= status["segments_deleted"]
    assert build_status_view(tmp_path / "run").segments_deleted == status["segments_deleted"]


@pytest.mark.timeout(300)
def test_components_exchange_tasks_trajectories_and_weights(tiny_model, tmp_path):
    cfg = tiny_config(tiny_model, **{"run.max_steps": 4})
    result = Orchestrator(cfg, tmp_path / "run").run()
    assert result.steps == {"solver": 4}
    # weights: every version committed and retention kept the newest
    ws = WeightStore(tmp_path / "run" / "weights")
    assert ws.latest("solver").version == 4
    # trajectories: both nodes wrote their own segment
    store = open_trajectory_store(str(tmp_path / "run" / "trajectories"), "r")
    assert len(store.segments()) == 2
    assert sum(store.count(s) for s in store.segments()) >= 4 * cfg.dataflow.batch_size
    # nodes served versions newer than 0 (they pulled weights)
    served = [h for n in result.nodes.values() for h in n["weight_sync"]]
    assert served and max(h["version"] for h in served) >= 1
    # ledger: every task ended exactly once
    assert result.ledger["open"] == 0
    assert result.ledger["states"]["consumed"] == 4 * cfg.dataflow.batch_size
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4]
    assert {x["policy"] for x in lines} == {"solver"}
    assert any("eval_accuracy" in x for x in lines)


@pytest.mark.timeout(300)
def test_killed_rollout_worker_loses_no_task_and_is_replaced(tiny_model, tmp_path):
    # paced episodes (>= 0.5 s each): a node seen holding leases still holds them when it is
    # killed a moment later (a fast node could finish them in between and lose nothing to requeue)
    cfg = tiny_config(tiny_model, **{"run.max_steps": 8, "dataflow.lease_seconds": 5,
                                     "workload.eval.every": 0,
                                     "workload.workflow": "tests.slurm.slow_workflow:slow_single_turn_test"})
    run_dir = tmp_path / "run"
    orch = Orchestrator(cfg, run_dir)
    th, box = run_in_thread(orch)
    victim = None
    deadline = time.time() + 180
    while time.time() < deadline and victim is None:
        st = _status(run_dir)
        if st:
            nodes = st["data_layer"]["nodes"]
            for name, w in st["workers"].items():
                if name.startswith("rollout") and nodes.get(name, {}).get("leases_held", 0) > 0:
                    pid = int(w["job_id"].split("-")[1])
                    # stopped, it finishes nothing more: kill it only if a status written after
                    # the stop still has it holding leases (on a busy machine it may have finished
                    # them since the status it was picked from)
                    os.kill(pid, signal.SIGSTOP)
                    if _holds_leases_after(run_dir, name, time.time()):
                        victim = (name, pid)
                    else:
                        os.kill(pid, signal.SIGCONT)
                    break
        time.sleep(0.2)
    assert victim, "no rollout node had tasks in flight"
    os.kill(victim[1], signal.SIGKILL)
    th.join(240)
    assert not th.is_alive(), "the run did not finish after a worker was killed"
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.steps == {"solver": 8}
    ev = result.ledger["events"]
    assert ev.get("requeued_node_gone", 0) + ev.get("requeued_lease_expired", 0) > 0
    assert result.ledger["open"] == 0
    # the partition was refilled with a new worker (it may join after the last step on a busy machine)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert victim[0] not in summary["nodes"] and summary["workers"][victim[0]]["gone"]
    assert _refilled_or_about_to(summary)


@pytest.mark.timeout(300)
def test_a_node_whose_engine_keeps_dying_is_replaced(tiny_model, tmp_path):
    """With no engine restarts allowed, killing a node's engine process (by the PID the node
    reports) makes the node stop leasing; the orchestrator replaces its worker and the run
    finishes with every task ended once."""
    cfg = tiny_config(tiny_model, **{"run.max_steps": 8, "workload.eval.every": 0, "rollout.engine_restarts": 0,
                                     "rollout.engine.process": True,  # the tiny example runs none
                                     "workload.workflow": "tests.slurm.slow_workflow:slow_single_turn_test"})
    run_dir = tmp_path / "run"
    th, box = run_in_thread(Orchestrator(cfg, run_dir))
    victim = None
    deadline = time.time() + 180
    while time.time() < deadline and victim is None:
        st = _status(run_dir)
        for name, info in (st or {}).get("data_layer", {}).get("nodes", {}).items():
            if info.get("engine_pids") and info.get("leases_held", 0) > 0:
                victim = (name, info["engine_pids"]["solver"])
                break
        time.sleep(0.2)
    assert victim, "no rollout node with an engine process had tasks in flight"
    os.kill(victim[1], signal.SIGKILL)  # the engine process this run started, by its PID
    th.join(240)
    assert not th.is_alive(), "the run did not finish after an engine process was killed"
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.steps == {"solver": 8} and result.ledger["open"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    gone = summary["workers"][victim[0]]
    assert gone["gone"] and "RaaS node failed" in gone["note"] and "exited with code -9" in gone["note"]
    assert _refilled_or_about_to(summary)


@pytest.mark.timeout(300)
def test_a_node_whose_loop_hangs_is_replaced(tiny_model, tmp_path, monkeypatch):
    """A node whose loop stops calling the data layer (here: an episode that blocks it) for
    ``dataflow.lease_seconds`` is replaced like a lost worker, though its Dask worker is alive:
    its job is cancelled, its leases requeued, its partition refilled; the run finishes."""
    # the other node holds its episodes until the first one hangs; a capacity below the
    # rollout-ahead bound leaves tasks for the first node to lease however late it starts
    monkeypatch.setenv("ASTRAFLOW_TEST_STUCK_MARK", str(tmp_path / "hung"))
    cfg = tiny_config(tiny_model, **{"run.max_steps": 4, "workload.eval.every": 0, "dataflow.lease_seconds": 5,
                                     "rollout.capacity": 4,
                                     "workload.workflow": "tests.integration.stuck_workflow:stuck_first_node_test"})
    run_dir = tmp_path / "run"
    result = Orchestrator(cfg, run_dir).run()
    assert result.steps == {"solver": 4} and result.ledger["open"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    stuck = next(w for n, w in summary["workers"].items() if n.startswith("rollout") and n.endswith("-0"))
    assert stuck["gone"] and "has not called the data layer" in stuck["note"], stuck
    # counted as a failure of its partition, which is refilled after a short backoff (the run
    # may have finished on the other node before that)
    assert summary["partitions"]["rollout"]["failures"] == 1 and _refilled_or_about_to(summary)


def _refilled_or_about_to(summary: dict) -> bool:
    """The rollout partition got a new worker, or was to get one after its failure backoff when
    the run ended (on a busy machine the other node may finish the run first)."""
    refilled = any(n.startswith("rollout-rollout") and n.endswith("-2") for n in summary["workers"])
    return refilled or summary["partitions"]["rollout"]["refill_in_s"] is not None


@pytest.mark.timeout(300)
def test_resume_continues_from_committed_weights_and_dataflow_state(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(tiny_model, **{"run.max_steps": 2, "workload.eval.every": 0,
                                     "dataflow.curator": {"type": "filter_solved", "params": {"threshold": 0.5}}})
    Orchestrator(cfg, run_dir).run()
    saved = json.loads((run_dir / "control" / "dataflow_state.json").read_text())
    assert saved["versions"] == {"solver": 2} and "success" in saved["curator"]
    optimizer = run_dir / "trainer_state" / "solver" / "optimizer.pt"
    assert torch.load(optimizer, weights_only=True)["version"] == 2  # saved when the trainer stopped
    cfg2 = tiny_config(tiny_model, **{"run.max_steps": 4, "workload.eval.every": 0,
                                      "dataflow.curator": {"type": "filter_solved", "params": {"threshold": 0.5}}})
    result = Orchestrator(cfg2, run_dir).run()
    assert result.steps == {"solver": 4}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4]
    assert WeightStore(run_dir / "weights").latest("solver").version == 4
    # the resumed trainer continued with the first run's AdamW moments, and saved its own
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainers"]["solver"]["optimizer_resumed_from"] == 2
    assert torch.load(optimizer, weights_only=True)["version"] == 4
    assert list(run_dir.glob("summary.*.json")), "the first run's summary is kept"


@pytest.mark.timeout(300)
def test_admission_by_version_keeps_stale_drops_below_the_bound(tiny_model, tmp_path):
    """Two RaaS nodes with room for many episodes and a tight staleness bound: rollout outpaces
    the trainer, yet almost nothing generated ages past the bound, and the trainers' wait and
    the nodes' idle fractions reach the status view."""
    from astraflow.runtime.monitoring import build_status_view

    cfg = tiny_config(tiny_model, **{"run.max_steps": 20, "dataflow.max_staleness": 1, "dataflow.prefetch_groups": 16,
                                     "rollout.capacity": 32, "workload.eval.every": 0})
    assert cfg.dataflow.admission == "version"
    result = Orchestrator(cfg, tmp_path / "run").run()
    assert result.steps == {"solver": 20}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in lines if "loss" in x][-1]
    # the groups-ahead bound drops most of what it generates here; under this rule only a node
    # that lags in loading new weights (a loaded machine) ages a few groups past the bound
    assert last["stale_dropped"] <= 0.2 * last["rollouts_generated"], last
    assert last["admission_refused"] > 0  # the rule, not luck, kept them fresh
    view = build_status_view(tmp_path / "run")
    nodes = [n for p in view.partitions for n in p.nodes if n.role == "rollout"]
    assert nodes and all(n.idle_fraction is not None and 0 <= n.idle_fraction <= 1 for n in nodes)
    assert 0 <= view.policies[0].wait_fraction <= 1
