"""The status files of a run without a cluster: what the orchestrator's `StatusWriter` writes is
what `run_status`, the status view and the text status read back, and every reader applies the
one liveness rule (process alive, snapshot younger than `STALE_AFTER_S`, no summary)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from astraflow.runtime.monitoring import (
    STALE_AFTER_S,
    RunNotRunning,
    StatusWriter,
    Tick,
    archive_summary,
    build_status_view,
    format_status,
    read_snapshot,
    run_status,
    write_orchestrator_info,
)
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet
from astraflow.runtime.stopping import Ending
from astraflow.runtime.workers import Fleet
from astraflow.config import ClusterConfig
from schedulers import JobRef, Partition
from storage.paths import RunPaths

PARTS = [Partition(name="data", role="data"), Partition(name="trainer", role="trainer"),
         Partition(name="rollout", role="rollout", nodes=2)]


def _writer(paths: RunPaths) -> tuple[StatusWriter, Fleet]:
    progress = Progress(enabled=False)
    parts = PartitionSet(PARTS, paths, ClusterConfig(), progress)
    fleet = Fleet(parts, placement=None, cluster=ClusterConfig(), progress=progress, place_node=lambda n, p: None)
    for i, part in enumerate(PARTS):
        name = f"{part.role}-{part.name}-local-cpu-0"
        fleet.add(JobRef(job_id=f"local-{100 + i}", partition=part.name, worker_name=name, kind="local", log=None),
                  part.name)
    fleet.workers["rollout-rollout-local-cpu-0"].enter("serving")
    return StatusWriter(paths, "astraflow.run.x", parts, fleet), fleet


def _tick(completed: int, read_at: float | None = None) -> Tick:
    node = {"partition": "rollout", "completed": completed, "versions": {"solver": 1}, "tokens": 10,
            "generated_tokens_per_s": 5.0, "episodes": 2, "last_seen": time.time()}
    return Tick(data_layer={"elapsed_s": 3.0, "episodes_per_s": 1.5, "generated_tokens_per_s": 20.0, "versions": {"solver": 1},
                            "nodes": {"rollout-rollout-local-cpu-0": node}, "eval": [], "ledger": {"states": {}}},
                trainers={"solver": {"version": 1, "done": False, "error": None, "last_metrics": {"reward_mean": 0.5},
                                     "wait_fraction": 0.25}}, read_at=time.time() if read_at is None else read_at)


def test_partition_rates_are_over_the_times_the_counts_were_read(tmp_path):
    """A tick tracked late (the orchestrator blocked on a job submission after reading it) is
    rated at the time it was read: 40 trajectories in 4 s is 10/s, however late it is tracked."""
    writer, _ = _writer(RunPaths(tmp_path / "run").make())
    t = time.time()
    writer.track(_tick(0, read_at=t - 20.0))
    writer.track(_tick(40, read_at=t - 16.0))
    assert writer.partitions()["rollout"]["episodes_per_s"] == 10.0


def test_a_worker_of_several_nodes_is_shown_as_its_nodes(tmp_path):
    """``rollout.nodes_per_worker``: a worker's nodes report as ``<worker>.n<i>``. The text line of
    the worker sums them (not 0 episodes); the view lists each node with its worker's job and
    state, and the worker not again as a node that generated nothing."""
    paths = RunPaths(tmp_path / "run").make()
    writer, _ = _writer(paths)
    write_orchestrator_info(paths, None, None)
    tick = _tick(3)
    worker = "rollout-rollout-local-cpu-0"
    node = tick.data_layer["nodes"].pop(worker)
    tick.data_layer["nodes"].update({
        f"{worker}.n0": {**node, "idle_fraction": 0.2},
        f"{worker}.n1": {**node, "completed": 5, "versions": {"solver": 2}, "idle_fraction": 0.4}})
    writer.track(tick)
    writer.write(tick)
    line = next(x for x in format_status(run_status(paths.root)).splitlines() if x.strip().startswith(worker))
    assert "2 nodes  versions {'solver': '1-2'}  8 episodes  10 generated tok/s  idle 30%" in line, line
    rollout = next(p for p in build_status_view(paths.root).partitions if p.name == "rollout")
    assert [n.name for n in rollout.nodes] == [f"{worker}.n0", f"{worker}.n1"], rollout.nodes
    job_state = run_status(paths.root)["workers"][worker]["state"]
    assert {(n.job_id, n.state) for n in rollout.nodes} == {("local-102", job_state)}, rollout.nodes


def test_a_trainer_or_data_layer_workers_line_says_what_it_runs(tmp_path):
    """Not a RaaS node's "versions - 0 episodes": a trainer worker's line names the policies it
    trains and their versions (``trainer_restarts``' ``worker``), the data layer's says so."""
    paths = RunPaths(tmp_path / "run").make()
    writer, _ = _writer(paths)
    write_orchestrator_info(paths, None, None)
    writer.trainer_restarts = lambda: {"solver": {"count": 0, "limit": 2, "worker": "trainer-trainer-local-cpu-0",
                                                  "restarts": []}}
    tick = _tick(3)
    writer.track(tick)
    writer.write(tick)
    lines = format_status(run_status(paths.root)).splitlines()
    line = next(x for x in lines if x.strip().startswith("trainer-trainer-local-cpu-0"))
    assert line.endswith("trainer of solver at v1") and "episodes" not in line, line
    line = next(x for x in lines if x.strip().startswith("data-data-local-cpu-0"))
    assert line.endswith("the data layer") and "episodes" not in line, line


def test_what_the_writer_writes_every_reader_reads_back(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    writer, fleet = _writer(paths)
    write_orchestrator_info(paths, "http://127.0.0.1:1/status", "tcp://127.0.0.1:2")
    writer.track(_tick(0))
    writer.track(_tick(4))
    writer.write(_tick(4))
    st = run_status(paths.root)
    assert st["running"] and st["orchestrator"]["dashboard"] == "http://127.0.0.1:1/status"
    assert st["tag"] == "astraflow.run.x"
    rollout = st["partitions"]["rollout"]
    assert rollout["completed"] == 4 and rollout["serving"] == 1 and rollout["live"] == 1
    assert rollout["episodes_per_s"] > 0 and rollout["first_trajectory_at"] is not None
    assert st["workers"]["rollout-rollout-local-cpu-0"]["phase"] == "serving"
    assert "rollout-rollout-local-cpu-0" in format_status(st)
    assert "throughput since start: 1.5 episodes/s" in format_status(st)  # the run's average, said to be
    assert "data layer: re-placed" not in format_status(st)
    writer.data_layer_restarts = lambda: {"count": 1, "limit": 2, "restarts": [
        {"worker": "data-data-local-cpu-0", "why": "job local-1 FAILED", "new_worker": "data-data-local-cpu-1"}]}
    writer.write(_tick(4))
    assert ("data layer: re-placed 1/2 time(s), last on data-data-local-cpu-1 (job local-1 FAILED)"
            in format_status(run_status(paths.root)))
    view = build_status_view(paths.root)
    assert view.running and not view.finished and view.age_s is not None and view.age_s < STALE_AFTER_S
    assert [p.name for p in view.partitions] == ["data", "trainer", "rollout"]
    assert all(p.capacity is None for p in view.partitions)  # the writer was told no capacities
    writer.capacity = lambda name: {"node_capacity": 200, "engine_max_batch": 256, "engines_per_node": 1} \
        if name == "rollout" else None
    writer.write(_tick(4))
    assert run_status(paths.root)["partitions"]["rollout"]["capacity"]["node_capacity"] == 200
    caps = {p.name: p.capacity for p in build_status_view(paths.root).partitions}
    assert caps["trainer"] is None and caps["rollout"].engine_max_batch == 256
    assert view.policies[0].reward_mean == 0.5
    # the final summary ends the run for every reader, and a second run keeps it aside
    writer.write_summary(ending=Ending("completed"), steps={"solver": 1}, ledger={}, ledger_closed=True, seconds=1.0,
                         nodes={}, trainers={}, data_layer=_tick(4).data_layer, iterations=[], stop_errors={})
    summary = json.loads(paths.summary.read_text())
    assert "eval" in summary and "eval" not in summary["data_layer"]  # the evaluations once
    assert summary["status"] == "completed" and summary["reason"] is None and not summary["interrupted"]
    assert summary["workers"]["rollout-rollout-local-cpu-0"]["served"] is False
    assert set(summary["partitions"]) == {"data", "trainer", "rollout"}
    assert build_status_view(paths.root).finished and not read_snapshot(paths.root).running
    with pytest.raises(RunNotRunning, match="is not running"):
        run_status(paths.root)
    archive_summary(paths)
    assert not paths.summary.exists() and len(list(paths.root.glob("summary.*.json"))) == 1


def test_a_stale_or_missing_snapshot_is_not_running(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    with pytest.raises(RunNotRunning, match="no run has started"):
        run_status(paths.root)
    with pytest.raises(ValueError, match="--run-dir"):
        build_status_view(paths.root)
    writer, _ = _writer(paths)
    write_orchestrator_info(paths, None, None)
    writer.write(_tick(0))
    written = json.loads(paths.status_file.read_text())
    for w in written["workers"].values():
        w["state"] = "RUNNING"  # as the scheduler said when the status was written
    paths.status_file.write_text(json.dumps(written))
    assert {n.state for part in build_status_view(paths.root).partitions for n in part.nodes} == {"RUNNING"}
    later = time.time() + STALE_AFTER_S + 1
    snap = read_snapshot(paths.root, now=later)
    assert snap.stale and not snap.running
    stale = build_status_view(paths.root, now=later)
    assert not stale.running
    # its jobs' states are as old as that status: not said to be running
    nodes = [n for part in stale.partitions for n in part.nodes]
    assert nodes and {n.state for n in nodes} == {"UNKNOWN"}, [(n.name, n.state) for n in nodes]
    info = json.loads(paths.orchestrator_file.read_text())
    paths.orchestrator_file.write_text(json.dumps({**info, "host": "elsewhere", "pid": 1}))
    assert read_snapshot(paths.root).running  # another host: only the age tells


def test_the_status_shows_the_latest_evaluations_per_policy():
    from astraflow.runtime.monitoring.text import SHOWN_EVALS, eval_lines

    one = [{"step": v, "policy": "solver", "eval_accuracy": v / 1000} for v in range(0, 400, 20)]
    (line,) = eval_lines(one)
    assert line.startswith("held-out accuracy: ..., ") and line.count("=") == SHOWN_EVALS and "v380=0.380" in line
    two = eval_lines(one[:2] + [{"step": 0, "policy": "critic", "eval_accuracy": 0.5}, {"step": 5, "policy": "x"}])
    assert two == ["held-out accuracy (solver): v0=0.000, v20=0.020", "held-out accuracy (critic): v0=0.500"]


def test_the_status_file_carries_the_latest_evaluations_of_each_policy():
    from astraflow.runtime.monitoring.writer import STATUS_EVALS, recent_evals

    evals = [{"step": s, "policy": p, "eval_accuracy": 0.1} for s in range(3 * STATUS_EVALS) for p in ("a", "b")]
    kept = recent_evals(evals)
    assert len(kept) == 2 * STATUS_EVALS and kept == evals[-2 * STATUS_EVALS:]
    assert recent_evals(evals[:4]) == evals[:4]


def test_summaries_archived_in_the_same_second_are_all_kept(tmp_path, monkeypatch):
    from astraflow.runtime.monitoring import snapshot

    paths = RunPaths(tmp_path / "run").make()
    monkeypatch.setattr(snapshot.time, "time", lambda: 1_700_000_000.5)
    for n in range(3):  # three incarnations ended within one second
        paths.summary.write_text(json.dumps({"incarnation": n}))
        archive_summary(paths)
    kept = sorted(json.loads(p.read_text())["incarnation"] for p in paths.root.glob("summary.*.json"))
    assert kept == [0, 1, 2] and not paths.summary.exists()


@pytest.mark.parametrize("closed", [True, False], ids=["data-layer-answered", "data-layer-lost"])
def test_the_summary_partitions_are_counted_from_the_final_state_not_the_last_tick(tmp_path, closed):
    """A run that fails at its deadline right after a tick keeps generating and training while
    it stops: the summary's partition table (what ``status`` shows of a finished run) is counted
    from the data layer's final state when it answered, and from the last tick only when not."""
    from click.testing import CliRunner

    from astraflow.cli import main

    paths = RunPaths(tmp_path / "run").make()
    writer, _ = _writer(paths)
    write_orchestrator_info(paths, "http://127.0.0.1:1/status", "tcp://127.0.0.1:2")
    writer.track(_tick(32))
    writer.write(_tick(32))  # the last periodic status
    final = _tick(61).data_layer
    final["nodes"]["rollout-rollout-local-cpu-0"]["versions"] = {"solver": 3}
    final["consumed_staleness_by_node"] = {"rollout-rollout-local-cpu-0": {"0": 16, "1": 32}}
    writer.write_summary(ending=Ending("failed", "run deadline of 3s passed (run.timeout_s)"), steps={"solver": 3},
                         ledger={"states": {}} if closed else {}, ledger_closed=closed, seconds=9.0, nodes={},
                         trainers={}, data_layer=final, iterations=[], stop_errors={})
    rollout = json.loads(paths.summary.read_text())["partitions"]["rollout"]
    want = (61, {"solver": [3]}, 48) if closed else (32, {"solver": [1]}, 0)
    assert (rollout["completed"], rollout["versions"], rollout["consumed"]) == want
    # what `astraflow status` says of the finished run, in text and in JSON, is the summary's
    (viewed,) = [p for p in build_status_view(paths.root).partitions if p.name == "rollout"]
    assert (viewed.versions, viewed.consumed) == want[1:]
    text = CliRunner().invoke(main, ["status", str(paths.root)]).output
    assert f"rollout (cpu): {want[0]} episodes" in text and f"solver:v{want[1]['solver'][0]} at the end" in text, text


def test_the_json_status_of_an_ended_run_says_how_it_ended_with_its_final_steps(tmp_path):
    """The last periodic status predates the end: the summary's outcome, reason and each
    trainer's final step are what ``status --json`` reports (a script tells failed from done)."""
    import socket

    paths = RunPaths(tmp_path / "run").make()
    now = time.time()
    paths.orchestrator_file.write_text(json.dumps({"pid": 2 ** 22 + 7, "host": socket.gethostname(),
                                                   "started": now - 100, "dashboard": "http://127.0.0.1:8787"}))
    part = {"scheduler": "local", "role": "rollout", "hardware": "cpu", "region": "local", "nodes": 1, "live": 1}
    paths.status_file.write_text(json.dumps({
        "written_at": now - 50, "data_layer": {"elapsed_s": 10.0, "versions": {"solver": 13}},
        "trainers": {"solver": {"version": 13, "done": False, "wait_fraction": 0.3}}, "partitions": {"rollout": part},
        "workers": {"rollout-0": {"partition": "rollout", "job_id": "local-1", "state": "RUNNING"}}}))
    paths.summary.write_text(json.dumps({
        "status": "failed", "reason": "run deadline of 12s passed (run.timeout_s)", "requeue": False,
        "steps": {"solver": 16}, "seconds": 14.0,
        "trainers": {"solver": {"policy": "solver", "version": 16, "done": False, "error": None}},
        "eval": [{"policy": "solver", "step": 16, "eval_accuracy": 0.5}],
        "data_layer": {"elapsed_s": 12.0, "versions": {"solver": 16}}}))
    view = build_status_view(paths.root)
    assert (view.policies[0].eval_step, view.policies[0].eval_accuracy) == (16, 0.5)  # kept once, beside data_layer
    assert view.finished and not view.running
    assert (view.outcome, view.requeue, view.seconds) == ("failed", False, 14.0) and "timeout_s" in view.reason
    assert view.policies[0].step == 16 and view.policies[0].wait_fraction == 0.3
    # the workers and the dashboard stopped with the run, whatever the last periodic status said
    (rollout,) = view.partitions
    assert rollout.live == 0 and [n.state for n in rollout.nodes] == ["ENDED"] and view.dashboard is None


def test_the_throughput_plot_of_two_policies_draws_the_run_wide_figures_once(tmp_path, monkeypatch):
    """Episodes/s and tokens/s are the run's, written on every policy's metrics line: one series
    each, in time order, not one per policy in the same colour (a zig-zag read as two curves)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from astraflow.runtime.monitoring.export import write_plots

    paths = RunPaths(tmp_path / "run").make()
    lines = [{"policy": p, "step": s, "elapsed_s": 2.0 * s + (p == "verifier"), "episodes_per_s": 10.0 + s,
              "generated_tokens_per_s": 100.0 + s, "reward_mean": 0.5}
             for s in (1, 2, 3) for p in ("solver", "verifier")]
    paths.metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    drawn = []
    real = Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **kw: drawn.append((kw.get("label"), list(a[0]))) or
                        real(ax, *a, **kw))
    write_plots(paths.root, tmp_path / "plots")
    throughput = {label: xs for label, xs in drawn if label and "/s" in label}
    assert set(throughput) == {"episodes/s (run)", "tokens/s (run)"}
    assert throughput["episodes/s (run)"] == sorted(throughput["episodes/s (run)"]) and \
        len(throughput["episodes/s (run)"]) == 6


@pytest.mark.parametrize("lines, said", [
    # every reward NaN (a reward function's NaN), an evaluation whose accuracy is NaN
    ([{"policy": "solver", "step": 1, "reward_mean": float("nan"), "episodes_per_s": float("inf"),
       "generated_tokens_per_s": float("nan")}, {"policy": "solver", "step": 1, "eval_accuracy": float("nan")}],
     {"reward": "no trainer step with a finite reward yet", "accuracy": "no evaluation with a finite accuracy yet",
      "throughput": "no trainer step with a finite throughput yet", "staleness": "no trajectory consumed yet"}),
    # an evaluation of v0 before the first step
    ([{"policy": "solver", "step": 0, "eval_accuracy": 0.25}],
     {"reward": "no trainer step with a finite reward yet",
      "throughput": "no trainer step with a finite throughput yet", "staleness": "no trajectory consumed yet"}),
])
def test_a_plot_with_nothing_to_draw_says_so_instead_of_a_blank_plot_with_a_legend(tmp_path, monkeypatch,
                                                                                  lines, said):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from astraflow.runtime.monitoring.export import PLOTS, write_plots

    paths = RunPaths(tmp_path / "run").make()
    paths.metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))  # NaN and Infinity, as json writes them
    texts, legends = [], []
    real_text, real_legend = Axes.text, Axes.legend
    monkeypatch.setattr(Axes, "text", lambda ax, x, y, s, *a, **kw: texts.append((ax.get_title(), s)) or
                        real_text(ax, x, y, s, *a, **kw))
    monkeypatch.setattr(Axes, "legend", lambda ax, *a, **kw: legends.append(ax.get_title()) or
                        real_legend(ax, *a, **kw))
    assert [p.stem for p in write_plots(paths.root, tmp_path / "plots")] == list(PLOTS)
    titles = {"reward": "mean reward per training batch", "accuracy": "held-out accuracy",
              "throughput": "throughput (cumulative average)", "staleness": "staleness of consumed trajectories"}
    assert dict(texts) == {titles[k]: v for k, v in said.items()}
    assert not set(legends) & {titles[k] for k in said}  # no legend of a series with no point


def test_plots_are_not_written_into_a_run_directory_another_user_can_change(tmp_path):
    """``plot`` writes into the run directory: one that others can write may hold their symlink
    (``plots/reward.png`` -> a file of ours), which would be overwritten. Refused, with the fix;
    ``--out`` elsewhere still works, and plots in a run directory of ours are owner-only."""
    pytest.importorskip("matplotlib")
    from astraflow.runtime.monitoring.export import write_plots

    paths = RunPaths(tmp_path / "run").make()
    paths.metrics.write_text(json.dumps({"policy": "p", "step": 1, "elapsed_s": 1.0, "reward_mean": 0.5}) + "\n")
    mine = tmp_path / "mine"
    mine.write_text("precious")
    paths.plots.mkdir()
    (paths.plots / "reward.png").symlink_to(mine)
    paths.root.chmod(0o777)
    with pytest.raises(ValueError, match="writable by group/others.*pass --out"):
        write_plots(paths.root)
    assert mine.read_text() == "precious"
    assert len(write_plots(paths.root, tmp_path / "elsewhere")) == 4
    (tmp_path / "elsewhere" / "accuracy.png").unlink()
    (tmp_path / "elsewhere" / "accuracy.png").symlink_to(mine)  # --out into a place others could write
    write_plots(paths.root, tmp_path / "elsewhere")
    assert mine.read_text() == "precious" and not (tmp_path / "elsewhere" / "accuracy.png").is_symlink()
    paths.root.chmod(0o700)
    (paths.plots / "reward.png").unlink()
    paths.plots.chmod(0o755)
    written = write_plots(paths.root)
    assert {f.stat().st_mode & 0o077 for f in written} == {0}


def test_a_run_before_its_first_status_is_starting_not_absent_nor_its_previous_incarnation(tmp_path):
    """A resumed run's orchestrator runs (workers joining, models loading) and has written no
    status yet: the previous incarnation's status.json is not shown as this run's, and status
    says the run is starting instead of 'no run' or 'not running'."""
    import os
    import socket

    paths = RunPaths(tmp_path / "run").make()
    now = time.time()
    paths.status_file.write_text(json.dumps({"written_at": now - 5, "data_layer": {"versions": {"p": 146}},
                                             "trainers": {}, "partitions": {}, "workers": {}}))
    paths.orchestrator_file.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                   "started": now - 2, "dashboard": None, "scheduler": None}))
    snap = read_snapshot(paths.root)
    assert snap.status is None and snap.starting and not snap.running
    with pytest.raises(ValueError, match="is starting .*ask again shortly"):
        build_status_view(paths.root)
    with pytest.raises(RunNotRunning, match="is starting"):
        run_status(paths.root)


def test_a_resume_before_its_orchestrator_file_is_starting_not_a_run_that_stopped(tmp_path):
    """A resume holds the run directory's lock and has archived the summary, but the files are
    still the dead previous incarnation's: status says the run is starting, not that it stopped
    without a summary."""
    import os
    import socket
    import subprocess
    import sys

    from astraflow.runtime.runlock import RunDirLock

    paths = RunPaths(tmp_path / "run").make()
    now = time.time()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    paths.status_file.write_text(json.dumps({"written_at": now - 30, "data_layer": {"versions": {"p": 146}},
                                             "trainers": {}, "partitions": {}, "workers": {}}))
    paths.orchestrator_file.write_text(json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(),
                                                   "started": now - 600, "dashboard": None, "scheduler": None}))
    with pytest.raises(RunNotRunning, match="stopped without a summary"):
        run_status(paths.root)  # nothing holds the directory: the previous run stopped
    with RunDirLock(paths.root):
        with pytest.raises(RunNotRunning, match=f"is starting \\(orchestrator pid {os.getpid()} "):
            run_status(paths.root)
        with pytest.raises(ValueError, match="is starting"):
            build_status_view(paths.root)
    with pytest.raises(RunNotRunning, match="stopped without a summary"):
        run_status(paths.root)  # let go again: the file is emptied
    # a resume on another host (a requeued head job on another node): said, hedged
    paths.run_lock.write_text(json.dumps({"pid": 4321, "host": "another-node", "started": now - 5}))
    with pytest.raises(RunNotRunning, match="held by an `astraflow run` on another-node \\(pid 4321, since \\d+s "
                                            "ago\\): a resume is likely starting there"):
        run_status(paths.root)
    paths.run_lock.write_text(json.dumps({"pid": 4321, "host": "another-node", "started": now - 900}))
    with pytest.raises(RunNotRunning, match="stopped without a summary"):
        run_status(paths.root)  # older than the orchestrator file: an earlier incarnation's leftover


def test_a_resume_of_a_finished_run_is_starting_not_the_summary_it_will_set_aside(tmp_path):
    """A resume of a finished run holds the run directory's lock while it builds models and checks
    the directory, before its orchestrator sets the previous summary aside: status says the run
    is starting (text and JSON), not that it finished."""
    import os
    import socket
    import subprocess
    import sys

    from click.testing import CliRunner

    from astraflow.cli import main
    from astraflow.runtime.runlock import RunDirLock

    paths = RunPaths(tmp_path / "run").make()
    now = time.time()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    paths.status_file.write_text(json.dumps({"written_at": now - 60, "data_layer": {"versions": {"p": 20}},
                                             "trainers": {}, "partitions": {}, "workers": {}}))
    paths.orchestrator_file.write_text(json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(),
                                                   "started": now - 600, "dashboard": None, "scheduler": None}))
    paths.summary.write_text(json.dumps({"status": "completed", "reason": None, "steps": {"p": 20}}))
    done = CliRunner().invoke(main, ["status", str(paths.root)])
    assert done.exit_code == 0 and "run finished: completed" in done.output
    assert build_status_view(paths.root).finished
    with RunDirLock(paths.root):
        with pytest.raises(RunNotRunning, match=f"is starting \\(orchestrator pid {os.getpid()} "):
            run_status(paths.root)
        with pytest.raises(ValueError, match="is starting"):
            build_status_view(paths.root)
        for json_flag in ([], ["--json"]):
            res = CliRunner().invoke(main, ["status", str(paths.root), *json_flag])
            assert res.exit_code == 2 and "is starting" in res.output and "completed" not in res.output, res.output
    assert "run finished: completed" in CliRunner().invoke(main, ["status", str(paths.root)]).output


def test_a_partition_being_removed_wants_no_nodes():
    """A removed partition's spec still says how many nodes it had: the view wants none."""
    part = {"scheduler": "local", "role": "rollout", "hardware": "cpu", "region": "local", "nodes": 2, "live": 1}
    for state, desired in (("active", 2), ("removing", 0), ("removed", 0)):
        view = _view_of_partition({**part, "state": state})
        assert view.desired == desired, state


def _view_of_partition(entry: dict):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(Path(tmp) / "run").make()
        paths.status_file.write_text(json.dumps({"written_at": time.time(), "data_layer": {}, "trainers": {},
                                                 "partitions": {"pool": entry}, "workers": {}}))
        return next(p for p in build_status_view(paths.root).partitions if p.name == "pool")


def test_a_restart_longer_than_the_staleness_limit_keeps_the_run_running(tmp_path):
    """While the orchestrator restarts a component (no ticks), the last status is written again
    with what it waits for: readers see a running run that says why its figures are old."""
    paths = RunPaths(tmp_path / "run").make()
    writer, _ = _writer(paths)
    write_orchestrator_info(paths, None, None)
    with writer.alive_while("before the first status"):  # nothing to write yet: the run is starting
        pass
    assert not paths.status_file.exists()
    writer.write(_tick(1))
    first = read_snapshot(paths.root).written_at
    with writer.alive_while("replacing the trainer worker t0 (job local-9 FAILED)", every_s=0.05):
        time.sleep(0.3)
        st = run_status(paths.root)
        assert st["written_at"] > first and st["waiting"]["what"].startswith("replacing the trainer worker t0")
        assert re.search(r"now: replacing the trainer worker t0 \(job local-9 FAILED\) \(for \d+s\)", format_status(st))
        assert build_status_view(paths.root).waiting == "replacing the trainer worker t0 (job local-9 FAILED)"
    time.sleep(0.1)
    after = run_status(paths.root)["written_at"]
    time.sleep(0.2)
    assert run_status(paths.root)["written_at"] == after  # the keeper stopped with the restart
    writer.write(_tick(2))
    assert "waiting" not in run_status(paths.root) and build_status_view(paths.root).waiting is None
