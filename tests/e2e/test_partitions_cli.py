"""`astraflow partitions` bad-input paths through click's runner: exit code 2, one message that
names the fix, no traceback, and the run's desired partitions left as they were.

The CLI talks to a run only through its run directory, so a run directory whose control files
say "running" (written by this process with the orchestrator's own writers, pid = this test)
is the real boundary; the accepted paths against a live orchestrator are in tests/slurm.
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.control import read_desired_file, write_desired
from astraflow.runtime.monitoring import write_orchestrator_info, write_status
from schedulers import Partition
from storage.paths import RunPaths


@pytest.fixture
def live_run(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    parts = [Partition(name="data", role="data"), Partition(name="trainer", role="trainer"),
             Partition(name="h100", scheduler="slurm", slurm_partition="h100", role="rollout")]
    write_desired(paths, parts)
    write_orchestrator_info(paths, None, "tcp://127.0.0.1:1")
    write_status(paths, {
        "written_at": time.time(), "run_dir": str(paths.root), "data_layer": {}, "trainers": {},
        "partitions": {p.name: {**p.model_dump(mode="json"), "state": "active", "live": 1, "serving": 1, "jobs": {}}
                       for p in parts},
        "workers": {},
    })
    return paths


def _invoke(*args):
    res = CliRunner().invoke(main, list(args))
    assert "Traceback" not in res.output
    return res.exit_code, res.output


@pytest.mark.parametrize("args, needle", [
    (["--nodes", "-1"], "--nodes -1: use 0 or more"),
    (["--walltime", "99:99"], "--walltime 99:99: seconds must be < 60"),
    (["--mem", "lots"], "--mem lots: use a number"),
    (["--gres", "gpu:h100:x:y"], "--gres gpu:h100:x:y: use Slurm's"),
    (["--sbatch-option=--time=10"], "set walltime instead"),
    (["--scheduler", "local", "--slurm-partition", "a100"], "slurm_partition is a Slurm setting but scheduler is 'local'"),
    (["--role", "trainer"], "only rollout partitions can be added"),
])
def test_add_with_bad_options_exits_2_naming_the_field(live_run, args, needle):
    before = live_run.desired_partitions.read_text()
    code, out = _invoke("partitions", "add", str(live_run.root), "new", "--wait", "0", *args)
    assert code == 2, out
    assert needle in out
    assert live_run.desired_partitions.read_text() == before


def test_add_bad_name_and_duplicate(live_run):
    code, out = _invoke("partitions", "add", str(live_run.root), "a-b", "--wait", "0")
    assert code == 2 and "name: name 'a-b' is not usable in worker names" in out
    code, out = _invoke("partitions", "add", str(live_run.root), "h100", "--wait", "0")
    assert code == 2 and "already exists" in out


def test_add_writes_the_desired_file(live_run, tmp_path):
    (tmp_path / "p.yaml").write_text("name: a100\nslurm_partition: a100\nnodes: 2\nhardware: A100\n")
    code, out = _invoke("partitions", "add", str(live_run.root), "--from-yaml", str(tmp_path / "p.yaml"),
                        "--mem", "4G", "--sbatch-option", "--qos=high", "--wait", "0")
    assert code == 0, out
    parts, _ = read_desired_file(live_run)
    a100 = parts["a100"]
    assert (a100.scheduler, a100.nodes, a100.mem, a100.sbatch_options) == ("slurm", 2, "4G", ("--qos=high",))


def test_an_added_partition_takes_the_scheduler_of_the_runs_rollout_partitions(live_run):
    """An embedded run (every rollout partition local) gets a local partition, not a Slurm job
    sent to whatever Slurm this machine has; options only Slurm has still mean Slurm."""
    parts, _ = read_desired_file(live_run)
    write_desired(live_run, [parts["data"], parts["trainer"], Partition(name="cpu", role="rollout")])
    code, out = _invoke("partitions", "add", str(live_run.root), "more", "--wait", "0")
    assert code == 0 and "1 local worker(s)" in out, out
    code, out = _invoke("partitions", "add", str(live_run.root), "gpu", "--slurm-partition", "h100", "--wait", "0")
    assert code == 0, out
    parts, _ = read_desired_file(live_run)
    assert (parts["more"].scheduler, parts["gpu"].scheduler) == ("local", "slurm")
    code, out = _invoke("partitions", "add", str(live_run.root), "--help")
    assert "the scheduler of the run's rollout" in " ".join(out.split())


def test_partitions_add_takes_settings_and_refuses_bad_ones(live_run, tmp_path):
    (tmp_path / "bad.yaml").write_text("name: a100\nrollout: {engine: {max_batch: 0}}\n")
    code, out = _invoke("partitions", "add", str(live_run.root), "--from-yaml", str(tmp_path / "bad.yaml"), "--wait", "0")
    assert code == 2 and "partitions[a100].rollout.engine.max_batch" in out, out
    (tmp_path / "bad.yaml").write_text("name: a100\nregion: no\n")  # the command has no --set to suggest
    code, out = _invoke("partitions", "add", str(live_run.root), "--from-yaml", str(tmp_path / "bad.yaml"),
                        "--wait", "0")
    assert code == 2 and 'quote the text: region: "..." in the file' in out and "--set" not in out, out
    (tmp_path / "good.yaml").write_text("name: a100\nrollout: {capacity: 64, engine: {max_batch: 32}}\n")
    code, out = _invoke("partitions", "add", str(live_run.root), "--from-yaml", str(tmp_path / "good.yaml"),
                        "--wait", "0")
    assert code == 0, out
    parts, _ = read_desired_file(live_run)
    assert parts["a100"].rollout == {"capacity": 64, "engine": {"max_batch": 32}}


def test_remove_unknown_lists_known_and_refuses_core_roles(live_run):
    code, out = _invoke("partitions", "remove", str(live_run.root), "nope")
    assert code == 2 and "known partitions are data, h100, trainer" in out
    code, out = _invoke("partitions", "remove", str(live_run.root), "trainer")
    assert code == 2 and "only rollout partitions can be removed" in out
    parts, _ = read_desired_file(live_run)
    write_desired(live_run, [*parts.values(), Partition(name="a100", scheduler="slurm", slurm_partition="a100")])
    code, out = _invoke("partitions", "remove", str(live_run.root), "h100", "--now")
    assert code == 0, out
    parts, removals = read_desired_file(live_run)
    assert "h100" not in parts and removals == {"h100": "now"}


def test_not_running_run_exits_2(live_run, tmp_path):
    st = json.loads(live_run.status_file.read_text())
    st["written_at"] = time.time() - 3600  # the orchestrator stopped writing an hour ago
    write_status(live_run, st)
    info = json.loads(live_run.orchestrator_file.read_text())
    live_run.orchestrator_file.write_text(json.dumps({**info, "started": time.time() - 7200}))  # before that
    for args in (["partitions", "list", str(live_run.root)],
                 ["partitions", "add", str(live_run.root), "x", "--wait", "0"],
                 ["partitions", "remove", str(live_run.root), "h100"],
                 ["status", str(live_run.root)]):
        code, out = _invoke(*args)
        assert code == 2 and "is not running" in out, (args, out)
    code, out = _invoke("partitions", "list", str(tmp_path / "nowhere"))
    assert code == 2 and "is not a run directory" in out


def test_list_shows_partitions(live_run):
    code, out = _invoke("partitions", "list", str(live_run.root))
    assert code == 0 and "h100" in out and "slurm" in out
    code, out = _invoke("partitions", "list", str(live_run.root), "--json")
    assert code == 0 and set(json.loads(out)) == {"data", "trainer", "h100"}


def _reported_later(paths, name: str, entry: dict, after_s: float = 0.5, workers: dict | None = None):
    """The orchestrator's side: after ``after_s``, status.json reports partition ``name`` as ``entry``
    (and ``workers``, the workers' entries, where given)."""
    import threading

    def report():
        time.sleep(after_s)
        st = json.loads(paths.status_file.read_text())
        own = Partition(name=name, scheduler="slurm", slurm_partition=name, role="rollout")
        st["partitions"][name] = {**own.model_dump(mode="json"), **entry}
        st["workers"].update(workers or {})
        st["written_at"] = time.time()
        write_status(paths, st)

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("entry, code, needle", [
    ({"state": "active", "jobs": {"101": "RUNNING"}, "serving": 1}, 0,
     "serving: 1 of 1 worker(s) (jobs: 101 (RUNNING))"),
    ({"state": "failed", "jobs": {"101": "FAILED"}, "error": "3 workers failed before serving"}, 2,
     "partition a100 failed: 3 workers failed before serving"),
])
def test_add_until_serving_waits_for_a_serving_node_or_its_failure(live_run, entry, code, needle):
    thread = _reported_later(live_run, "a100", entry)
    got, out = _invoke("partitions", "add", str(live_run.root), "a100", "--slurm-partition", "a100",
                       "--until", "serving", "--wait", "20")
    thread.join()
    assert got == code, out
    assert needle in out
    parts, removals = read_desired_file(live_run)
    assert ("a100" in parts) == (code == 0)  # a failed partition is withdrawn: the run is unaffected


def test_add_until_serving_that_times_out_exits_1_and_stays_requested(live_run):
    """A job Slurm holds in its queue: the timeout says so, with Slurm's reason."""
    queued = {"rollout-a100-local-cpu-0": {"partition": "a100", "job_id": "101", "state": "PENDING",
                                           "reason": "Resources"}}
    thread = _reported_later(live_run, "a100", {"state": "active", "jobs": {"101": "PENDING"}, "serving": 0},
                             workers=queued)
    got, out = _invoke("partitions", "add", str(live_run.root), "a100", "--slurm-partition", "a100",
                       "--until", "serving", "--wait", "1.5")
    thread.join()
    assert got == 1 and "partition 'a100' not serving within 2s (state active)" in out, out
    assert "its job(s) wait in the Slurm queue: 101 (Resources)" in out, out
    assert "a100" in read_desired_file(live_run)[0]


def test_add_with_no_nodes_returns_at_once_without_a_warning(live_run, monkeypatch):
    from astraflow.runtime import control

    waited = []
    monkeypatch.setattr(control, "wait_partition", lambda *args, **kwargs: waited.append(args) or {"jobs": {}})
    got, out = _invoke("partitions", "add", str(live_run.root), "z0", "--slurm-partition", "a100", "--nodes", "0",
                       "--wait", "20")
    assert got == 0 and "nothing to wait for" in out and "warning" not in out, out
    assert waited == [], "it waited for a partition with no worker to start"
    assert "z0" in read_desired_file(live_run)[0]


def _status_entry(paths, name, **entry):
    status = json.loads(paths.status_file.read_text())
    part = Partition(name=name, scheduler="slurm", slurm_partition="h100", role="rollout")
    status["partitions"][name] = {**part.model_dump(mode="json"), "state": "active", "live": 0, "serving": 0,
                                  "jobs": {}, **entry}
    write_status(paths, status)


def test_a_failed_partition_is_added_again_only_once_removed(live_run):
    _status_entry(live_run, "old", state="failed", error="submitting workers failed: invalid partition")
    code, out = _invoke("partitions", "add", str(live_run.root), "old", "--wait", "0")
    assert code == 2 and "is being removed (failed): add it again once" in out


def test_waits_ignore_what_an_earlier_partition_of_the_name_left(live_run):
    """The status of a removed partition that failed: adding one of that name again waits for
    the new one (its old error is not this one's), and removing one waits until it is removed."""
    _status_entry(live_run, "old", state="removed", error="submitting workers failed: invalid partition")
    code, out = _invoke("partitions", "add", str(live_run.root), "old", "--wait", "0.5")
    assert code == 0 and "not submitted within" in out and "withdrawn" not in out
    assert "old" in read_desired_file(live_run)[0]  # not withdrawn
    _status_entry(live_run, "h100", state="failed", error="3 workers failed")
    code, out = _invoke("partitions", "remove", str(live_run.root), "h100", "--wait", "0.5")
    assert "not removed within" in out and " removed in " not in out


def test_the_last_rollout_partition_is_not_removed_and_a_wait_must_be_finite(live_run):
    code, out = _invoke("partitions", "remove", str(live_run.root), "h100")
    assert code == 2 and "is the run's last rollout partition" in out
    code, out = _invoke("partitions", "add", str(live_run.root), "a100", "--wait", "nan")
    assert code == 2 and "give a finite number of seconds" in out
    # another rollout partition with no nodes, or a failed one, serves nothing: h100 is still the last
    parts, removals = read_desired_file(live_run)
    broken = Partition(name="broken", scheduler="slurm", slurm_partition="x", role="rollout")
    write_desired(live_run, [*parts.values(), Partition(name="empty", role="rollout", nodes=0), broken], removals)
    _status_entry(live_run, "broken", state="failed", error="3 workers failed")
    code, out = _invoke("partitions", "remove", str(live_run.root), "h100")
    assert code == 2 and "is the run's last rollout partition with nodes" in out


def test_adding_a_partition_again_while_its_removal_drains_says_to_wait(live_run):
    """Right after ``partitions remove X`` (X has left the desired set, its workers drain) the
    refusal says to wait for the removal, not to remove X again (which would fail)."""
    _status_entry(live_run, "x", state="removing")
    code, out = _invoke("partitions", "add", str(live_run.root), "x", "--wait", "0")
    assert code == 2 and "'x' is being removed (removing)" in out and "partitions list" in out, out
    code, out = _invoke("partitions", "remove", str(live_run.root), "x")
    assert code == 2 and "no partition 'x' in this run" in out  # what the old advice led to
