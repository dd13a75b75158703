"""The orchestrator's parts alone, without a cluster: partition reconciliation against a
desired-partitions file, the failure rule that stops refilling a partition, the Slurm tag of a
run, and what each actor is built with."""

from __future__ import annotations

from types import SimpleNamespace

from astraflow.config import ClusterConfig
from astraflow.runtime.control import write_desired
from astraflow.runtime.placement import data_layer_kwargs, node_kwargs, trainer_kwargs
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import FAILURES_PER_NODE, PartitionSet, run_tag
from astraflow.runtime.workers import Worker
from schedulers import JobRef, Partition
from storage.paths import RunPaths

from tests.conftest import tiny_config


class _Fleet:
    """The two calls reconciliation makes on the worker state machine, recorded."""

    def __init__(self):
        self.workers: dict[str, Worker] = {}
        self.removed: list[tuple[str, bool]] = []

    def in_partition(self, name):
        return [w for w in self.workers.values() if w.partition == name]

    def remove(self, w, drain):
        self.removed.append((w.name, drain))
        w.enter("gone")


def _worker(part: str, i: int) -> Worker:
    name = f"rollout-{part}-local-cpu-{i}"
    return Worker(job=JobRef(job_id=f"local-{i}", partition=part, worker_name=name, kind="local", log=None),
                  partition=part, phase="serving")


def test_a_partition_left_out_of_the_desired_set_is_removed_with_its_mode(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    parts = [Partition(name="rollout", nodes=2), Partition(name="extra", nodes=1)]
    pset = PartitionSet(parts, paths, ClusterConfig(), Progress(enabled=False))
    fleet = _Fleet()
    for w in (_worker("rollout", 0), _worker("rollout", 1), _worker("extra", 0)):
        fleet.workers[w.name] = w
    write_desired(paths, parts[:1], {"extra": "now"})
    pset.reconcile(fleet, address_for=lambda part: "tcp://unused")  # nothing missing: nothing submitted
    assert fleet.removed == [("rollout-extra-local-cpu-0", False)]
    assert pset.state["extra"].state == "removing" and pset.state["extra"].removal_mode == "now"
    pset.reconcile(fleet, address_for=lambda part: "tcp://unused")
    assert pset.state["extra"].state == "removed" and pset.state["rollout"].state == "active"


def test_a_partition_whose_workers_keep_dying_is_marked_failed(tmp_path):
    pset = PartitionSet([Partition(name="rollout", nodes=2)], RunPaths(tmp_path), ClusterConfig(), Progress(enabled=False))
    for _ in range(FAILURES_PER_NODE * 2 - 1):
        pset.record_failure("rollout", "job FAILED")
    assert pset.refused() == {}
    pset.record_failure("rollout", "job FAILED")
    assert "last: job FAILED" in pset.refused()["rollout"]


def test_run_tag_is_readable_and_unique_per_directory(tmp_path):
    a, b = run_tag(RunPaths(tmp_path / "my run")), run_tag(RunPaths(tmp_path / "x" / "my run"))
    assert a.startswith("astraflow.my_run.") and a != b and a == run_tag(RunPaths(tmp_path / "my run"))


def test_each_actor_gets_its_own_section(tmp_path):
    cfg = tiny_config(tmp_path, **{"run.seed": 7})  # placement only names the model directory
    paths = RunPaths(tmp_path / "run")
    dl = SimpleNamespace(name="data layer handle")
    part = Partition(name="h100", region="eu", hardware="H100")
    node = node_kwargs(cfg, paths, "rollout-h100-eu-H100-0", part, dl)
    assert node["identity"].partition == "h100" and node["identity"].region == "eu"
    assert node["rollout"] is cfg.rollout and node["data_layer"] is dl
    assert node["store_url"] == str(paths.trajectories) and node["weights_root"] == str(paths.weights)
    # every node samples from a stream of its own (seeded by the run's seed and its name), fixed per name
    other = node_kwargs(cfg, paths, "rollout-h100-eu-H100-1", part, dl)
    assert node["seed"] != other["seed"] and node["seed"] == node_kwargs(cfg, paths, node["identity"].name, part,
                                                                          dl)["seed"]
    trainer = trainer_kwargs(cfg, paths, 1, cfg.policies[0], dl)
    assert trainer["seed"] == 8 and trainer["cfg"] is cfg.policies[0].trainer
    assert trainer["optimizer_path"] == str(paths.optimizer_state(cfg.policies[0].name))
    data = data_layer_kwargs(cfg, paths)
    assert data["dataflow"] is cfg.dataflow and data["gated"] is (cfg.run.mode == "sync")


def test_a_damaged_desired_file_keeps_the_partitions_the_run_has(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    parts = [Partition(name="rollout", nodes=1)]
    notes: list[str] = []
    progress = Progress(enabled=False)
    progress.note = notes.append
    pset = PartitionSet(parts, paths, ClusterConfig(), progress)
    fleet = _Fleet()
    w = _worker("rollout", 0)
    fleet.workers[w.name] = w
    paths.desired_partitions.write_bytes(b"\xff garbage")
    for _ in range(2):
        pset.reconcile(fleet, address_for=lambda part: "tcp://unused")
    assert fleet.removed == [] and pset.state["rollout"].state == "active"
    assert len(notes) == 1 and "not a valid desired-partitions file" in notes[0]  # said once


def test_a_resume_keeps_the_partitions_the_previous_run_added(tmp_path):
    """`partitions add` during a run, then a requeue: the resumed run's desired partitions are the
    config's (with the config's settings) and the added one, so the reconcile loop adds it again."""
    from types import SimpleNamespace

    from astraflow.runtime.control import read_desired_file, write_desired
    from astraflow.runtime.orchestrator import Orchestrator

    paths = RunPaths(tmp_path / "run").make()
    config = {p.name: p for p in (Partition(name="data", role="data"), Partition(name="rollout", nodes=2))}
    added = Partition(name="extra", scheduler="slurm", slurm_partition="h100", nodes=3)
    write_desired(paths, [Partition(name="data", role="data"), Partition(name="rollout", nodes=5), added])
    notes: list[str] = []
    progress = Progress(enabled=False)
    progress.note = notes.append
    Orchestrator._publish_desired(SimpleNamespace(paths=paths, partitions=config, progress=progress))
    parts, _ = read_desired_file(paths)
    assert sorted(parts) == ["data", "extra", "rollout"] and parts["rollout"].nodes == 2 and parts["extra"] == added
    assert any("partition extra" in n for n in notes)


def test_a_resume_does_not_bring_back_a_partition_of_the_config_that_was_removed(tmp_path):
    """`partitions remove` of a pool the config names, then a requeue (or a resume): the pool stays
    removed, for this incarnation and the next, and the run says so."""
    from types import SimpleNamespace

    from astraflow.runtime.control import read_desired_file, write_desired
    from astraflow.runtime.orchestrator import Orchestrator

    paths = RunPaths(tmp_path / "run").make()
    config = {p.name: p for p in (Partition(name="data", role="data"), Partition(name="h100", nodes=2),
                                  Partition(name="a100", nodes=1))}
    write_desired(paths, [config["data"], config["a100"]], {"h100": "drain"})
    for _ in range(2):  # a requeue, then another
        notes: list[str] = []
        progress = Progress(enabled=False)
        progress.note = notes.append
        Orchestrator._publish_desired(SimpleNamespace(paths=paths, partitions=config, progress=progress))
        parts, removals = read_desired_file(paths)
        assert sorted(parts) == ["a100", "data"] and removals == {"h100": "drain"}
        assert any(n.startswith("partition h100: removed from the previous run") for n in notes), notes

    # no other rollout pool left (both were removed; the config names only one): it comes back
    config.pop("a100")
    write_desired(paths, [config["data"]], {"h100": "drain", "a100": "now"})
    Orchestrator._publish_desired(SimpleNamespace(paths=paths, partitions=config, progress=progress))
    parts, removals = read_desired_file(paths)
    assert sorted(parts) == ["data", "h100"] and removals == {"a100": "now"}


def test_teardown_cancels_the_job_of_a_lost_worker_its_scheduler_still_runs(tmp_path):
    """A trainer worker that left the Dask scheduler (hung) while its Slurm job runs on: the run
    ends, and that job is cancelled with the others instead of holding its node."""
    from types import SimpleNamespace

    from astraflow.runtime.orchestrator import Orchestrator
    from schedulers import JobRef, JobStatus

    class Listed:
        kind = "slurm"

        def __init__(self):
            self.cancelled: list[str] = []

        def cancel(self, ids, wait=False):
            self.cancelled += list(ids)

        def close(self):
            pass

        def jobs(self):
            return [JobStatus("101", "trainer", "trainer-trainer-x-0", "RUNNING", None, None, "n1"),
                    JobStatus("102", "trainer", "trainer-trainer-x-1", "COMPLETED", None, None, None)]

    sched = Listed()
    workers = {}
    for job_id, name in (("101", "trainer-trainer-x-0"), ("102", "trainer-trainer-x-1")):
        workers[name] = SimpleNamespace(job=JobRef(job_id, "trainer", name, "slurm", None), gone=True)
    orc = Orchestrator.__new__(Orchestrator)
    orc.placement = SimpleNamespace(client=None, scheduler_proc=None)
    orc.parts = SimpleNamespace(schedulers={"slurm": sched}, uncancelled=lambda kind: [], fork_server=None)
    orc.fleet = SimpleNamespace(workers=workers)
    orc._teardown()
    assert sched.cancelled == ["101"]
