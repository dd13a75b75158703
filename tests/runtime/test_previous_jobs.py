"""A resumed run cancels the worker jobs its previous incarnation left, and nothing else: a real
local worker process recorded by the previous incarnation is stopped, while a process that now
holds a recorded pid (a recycled pid) or a recorded pid whose command line is not that worker
is left alone. Jobs are recorded durably as they are submitted."""

from __future__ import annotations

import subprocess
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from astraflow.runtime.jobrecords import JobRecords, cancel_previous_jobs, read_job_records
from astraflow.runtime.progress import Progress
from astraflow.sections import ClusterConfig
from schedulers import JobRef, LocalScheduler, Partition, local
from schedulers.procs import process_identity
from storage.atomic import write_json
from storage.paths import RunPaths

#: an address nothing listens on: the worker keeps trying to join until its death timeout
NOWHERE = "tcp://127.0.0.1:9"


class Notes(Progress):
    def __init__(self):
        super().__init__(enabled=False)
        self.lines: list[str] = []

    def note(self, msg: str) -> None:
        self.lines.append(msg)


def _alive(proc: subprocess.Popen) -> bool:
    return process_identity(proc.pid) is not None


@pytest.mark.timeout(90)
def test_a_resume_stops_the_previous_worker_and_spares_recycled_pids(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    part = Partition(name="pool", role="rollout")
    previous = LocalScheduler(paths.jobs, death_timeout=120)  # stands in for the dead incarnation
    [worker] = previous.submit(part, NOWHERE, 1)
    assert worker.identity == process_identity(int(worker.job_id.removeprefix("local-")))
    other = subprocess.Popen(["sleep", "120"])  # an unrelated process whose pid gets recorded
    try:
        ident = process_identity(other.pid)
        host, boot, start = ident.split("/")
        recycled = JobRef(f"local-{other.pid}", "pool", "rollout-pool-local-cpu-1", "local", None,
                          identity=f"{host}/{boot}/{int(start) - 1}")  # its pid, an older process's start
        same_pid_not_a_worker = replace(recycled, worker_name="rollout-pool-local-cpu-2", identity=ident)
        JobRecords(paths).add([worker])
        JobRecords(paths).add([recycled, same_pid_not_a_worker])  # a second writer appends
        assert [r.job_id for r in read_job_records(paths)] == [worker.job_id, recycled.job_id, recycled.job_id]

        notes = Notes()
        found = cancel_previous_jobs(paths, ClusterConfig(), [part], notes)

        assert [j["job_id"] for j in found.cancelled] == [worker.job_id] and not found.errors
        assert found.cancelled[0]["worker"] == worker.worker_name and found.cancelled[0]["kind"] == "local"
        assert len(notes.lines) == 1 and worker.job_id in notes.lines[0] and "previous incarnation" in notes.lines[0]
        popen = previous._procs[worker.job_id].popen
        popen.wait(timeout=15)  # stopped (SIGTERM to its group), and reaped here, its parent's
        assert _alive(other), "a process holding a recorded pid was signalled"
        assert not paths.job_records.exists()  # settled: the next incarnation starts a fresh record
        assert cancel_previous_jobs(paths, ClusterConfig(), [part], notes).cancelled == []
    finally:
        other.kill()
        other.wait()
        previous.close()


def test_damaged_records_are_skipped_not_fatal(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    good = JobRef("local-1", "pool", "rollout-pool-local-cpu-0", "local", paths.jobs / "w.log",
                  identity="h/b/1")
    write_json(paths.job_records, {"jobs": [{"job_id": "x"}, "nonsense",
                                            {**good.__dict__, "log": str(good.log)}]})
    assert read_job_records(paths) == [good]
    paths.job_records.write_text("{not json")
    assert read_job_records(paths) == []
    found = cancel_previous_jobs(paths, ClusterConfig(), [Partition(name="pool")], Notes())
    assert found.cancelled == [] and not paths.job_records.exists()


def test_a_worker_that_exited_is_not_signalled_again(tmp_path, monkeypatch):
    """Its pid may be anyone's by now: with no process of that identity, nothing is sent and
    nothing is waited for (no signal, no pause of the wait for it to end)."""
    signals: list[tuple[int, int]] = []
    pauses: list[float] = []
    monkeypatch.setattr(local, "_killpg", lambda pid, sig: signals.append((pid, sig)))
    monkeypatch.setattr(local, "time", SimpleNamespace(monotonic=time.monotonic, sleep=pauses.append))
    proc = subprocess.Popen(["sleep", "0"])
    ident = process_identity(proc.pid)
    proc.wait()
    ref = JobRef(f"local-{proc.pid}", "pool", "rollout-pool-local-cpu-0", "local", None, identity=ident)
    found = LocalScheduler(tmp_path).cancel_previous([ref])
    assert signals == [] and pauses == []
    assert found == []
