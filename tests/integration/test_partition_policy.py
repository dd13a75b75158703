"""The orchestrator's side of the allowlists: a partition written into ``control/partitions.json``
by hand (not through ``astraflow partitions add``) with an env variable or sbatch option the
run's config does not allow is never started; the refusal is in the status. Worker jobs go to a
fake ``sbatch`` on PATH (the process boundary to Slurm)."""

from __future__ import annotations

from astraflow.config import ClusterConfig
from astraflow.runtime.control import write_desired
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet
from astraflow.runtime.workers import Fleet
from schedulers import Partition
from storage.paths import RunPaths

from tests.integration.test_partition_backoff import _calls, _reconcile, _status_text
from tests.schedulers.fake_slurm import fake_slurm

GPU = Partition(name="gpu", scheduler="slurm", nodes=1, role="rollout")


def _setup(tmp_path, cluster: ClusterConfig | None = None):
    paths = RunPaths(tmp_path / "run").make()
    progress = Progress(enabled=False)
    notes: list[str] = []
    progress.note = notes.append  # type: ignore[method-assign]
    pset = PartitionSet([GPU], paths, cluster or ClusterConfig(), progress)
    fleet = Fleet(pset, placement=None, cluster=ClusterConfig(), progress=progress, place_node=lambda n, p: None)
    return paths, pset, fleet, notes


def test_a_partition_with_a_loader_variable_is_not_started_and_the_status_says_why(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=99)
    paths, pset, fleet, notes = _setup(tmp_path)
    evil = Partition(name="evil", scheduler="slurm", role="rollout", env={"LD_PRELOAD": "/tmp/x.so"})
    write_desired(paths, [GPU, evil])
    _reconcile(pset, fleet)
    _reconcile(pset, fleet)
    assert _calls(rec) == 1  # gpu only
    assert {w.partition for w in fleet.workers.values()} == {"gpu"}
    ps = pset.state["evil"]
    assert ps.state == "failed" and "LD_PRELOAD is not in cluster.worker_env_allowlist" in ps.error
    assert "refused by the run's allowlists" in _status_text(paths, pset, fleet)
    assert len([n for n in notes if "partition evil" in n]) == 1  # noted once


def test_a_running_partition_changed_to_a_disallowed_option_keeps_its_spec(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=99)
    paths, pset, fleet, notes = _setup(tmp_path)
    write_desired(paths, [GPU])
    _reconcile(pset, fleet)
    changed = GPU.model_copy(update={"nodes": 2, "sbatch_options": ("--chdir=/tmp",)})
    write_desired(paths, [changed])
    _reconcile(pset, fleet)
    assert _calls(rec) == 1  # not resized either: the change is refused as a whole
    assert pset.partitions["gpu"] == GPU and pset.state["gpu"].state == "active"
    assert any("--chdir is not in cluster.sbatch_options_allowlist" in n and "keeps the partition as it was" in n
               for n in notes)


def test_a_variable_the_config_names_is_accepted(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=99)
    cluster = ClusterConfig(worker_env_allowlist=["LD_LIBRARY_PATH"])
    paths, pset, fleet, _ = _setup(tmp_path, cluster)
    site = Partition(name="site", scheduler="slurm", role="rollout", env={"LD_LIBRARY_PATH": "/opt/site/lib"})
    write_desired(paths, [GPU, site])
    _reconcile(pset, fleet)
    assert _calls(rec) == 2 and pset.state["site"].state == "active"
    script = (paths.jobs / "rollout-site-local-cpu-0.sbatch").read_text()
    assert "export LD_LIBRARY_PATH=/opt/site/lib" in script


def test_a_partition_whose_settings_do_not_fit_the_run_is_not_started(tmp_path, monkeypatch):
    """Written into the file by hand with a rollout setting the run's config does not have
    (``astraflow partitions add`` refuses it before): never started, the status says why."""
    from astraflow.partition_settings import check_partition
    from astraflow.rollout.config import RolloutConfig

    rec = fake_slurm(tmp_path, monkeypatch, fail_at=99)
    paths, pset, fleet, notes = _setup(tmp_path)
    pset.check_settings = lambda part: check_partition(part, RolloutConfig(), {})
    bad = Partition(name="bad", scheduler="slurm", role="rollout", rollout={"engine": {"max_bach": 8}})
    write_desired(paths, [GPU, bad])
    _reconcile(pset, fleet)
    assert _calls(rec) == 1 and {w.partition for w in fleet.workers.values()} == {"gpu"}
    assert pset.state["bad"].state == "failed"
    assert "partitions[bad].rollout.engine.max_bach: unknown key" in pset.state["bad"].error
