"""What a Dask process AstraFlow starts (``schedulers.dask_main``) keeps from other users of its node.

Its local directory is a new 0700 directory of its own, not Dask's ``$TMPDIR/dask-scratch-space``
(which Dask reuses whoever made it, and puts first on ``sys.path``), and it is gone once the
process ends. A worker's HTTP server (Dask's health and metrics routes, no token) listens on the
worker's own address only, and serves none of them. Checked on real processes: a local worker,
a Slurm worker's rendered job script run with bash on this host, and the run's scheduler.

Each attack is mimicked by a ``$TMPDIR`` in which "another user" already made a world-writable
``dask-scratch-space``."""

from __future__ import annotations

import copy
import os
import shlex
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import dask
import psutil
import pytest

from schedulers import LocalScheduler, Partition, worker_name
from schedulers.dask_main import option, prepare, private_directory, remove_private_directory
from schedulers.slurm import SlurmScheduler
from tests.schedulers.dask_fixtures import wait_for_workers

REPO = Path(__file__).resolve().parents[2]


def _shared_tmp(tmp_path: Path) -> Path:
    """A node's ``/tmp`` (sticky, open to all) where another user made ``dask-scratch-space`` first."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    (tmp / "dask-scratch-space").mkdir()
    (tmp / "dask-scratch-space").chmod(0o777)
    return tmp


def _private_root(tmp: Path, local_directory: str) -> Path:
    """The directory directly under `tmp` that holds `local_directory`."""
    return tmp / Path(local_directory).relative_to(tmp).parts[0]


def _check_private(tmp: Path, before: set[str], local_directory: str, path0: str) -> Path:
    root = _private_root(tmp, local_directory)
    assert root.name != "dask-scratch-space" and root.name not in before, root
    st = os.lstat(root)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert Path(path0).is_relative_to(root), "the directory Dask puts first on sys.path is the private one"
    assert os.listdir(tmp / "dask-scratch-space") == [], "nothing of ours in the one another user made"
    return root


def _check_removed(tmp: Path, root: Path) -> None:
    deadline = time.monotonic() + 10
    while root.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not root.exists(), "the private directory is removed when the process ends"
    assert os.listdir(tmp) == ["dask-scratch-space"] and os.listdir(tmp / "dask-scratch-space") == []


def _worker_facts(client) -> tuple[str, int, str]:
    ((_, facts),) = client.run(lambda dask_worker: (dask_worker.local_directory, dask_worker.http_server.port,
                                                    sys.path[0])).items()
    return facts


def _check_http_on(pid: int, port: int, host: str) -> None:
    """The process listens on `host` only, its HTTP `port` among those; that port serves no route."""
    listening = [c.laddr for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert port in {a.port for a in listening}
    assert {a.ip for a in listening} == {host}, listening
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10)
    assert err.value.code == 404
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and a.address != host and not a.address.startswith("127.")]
    for address in others[:1]:  # another address of this machine, where another host would connect
        with pytest.raises(OSError), socket.create_connection((address, port), timeout=5):
            pass


@pytest.mark.timeout(120)
def test_a_local_worker_works_in_a_private_directory_and_serves_http_on_its_host_only(
        dask_scheduler, tmp_path, monkeypatch):
    address, _, client = dask_scheduler
    tmp = _shared_tmp(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp))
    before = set(os.listdir(tmp))
    sched = LocalScheduler(tmp_path / "logs", death_timeout=20)
    (ref,) = sched.submit(Partition(name="cpu", role="rollout", nodes=1), address, count=1)
    try:
        assert ref.worker_name in wait_for_workers(client, {ref.worker_name}, present=True, deadline_s=60), \
            ref.log.read_text()[-2000:]
        local_directory, http_port, path0 = _worker_facts(client)
        root = _check_private(tmp, before, local_directory, path0)
        _check_http_on(int(ref.job_id.removeprefix("local-")), http_port, "127.0.0.1")
    finally:
        sched.close()
    _check_removed(tmp, root)


@pytest.mark.timeout(120)
def test_a_slurm_workers_job_script_makes_the_private_directory_on_its_node(dask_scheduler, tmp_path):
    """The rendered job script, run by bash as Slurm would on the worker's node (``interface: lo``)."""
    address, _, client = dask_scheduler
    tmp = _shared_tmp(tmp_path)
    before = set(os.listdir(tmp))
    slurm = SlurmScheduler(tmp_path / "jobs", python=sys.executable, interface="lo", death_timeout=20)
    part = Partition(name="cpu", scheduler="slurm", role="rollout", nodes=1)
    script, _ = slurm.render(part, address, 0)
    exec_line = next(line for line in script.splitlines() if line.startswith("exec "))
    assert "--local-directory" not in shlex.split(exec_line), "made on the node by the worker itself"
    (tmp_path / "w.sbatch").write_text(script)
    with open(tmp_path / "w.log", "wb") as log:
        proc = subprocess.Popen(["bash", str(tmp_path / "w.sbatch")], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "TMPDIR": str(tmp)})
    try:
        name = worker_name(part, 0)
        assert name in wait_for_workers(client, {name}, present=True, deadline_s=60), (tmp_path / "w.log").read_text()
        local_directory, http_port, path0 = _worker_facts(client)
        root = _check_private(tmp, before, local_directory, path0)
        _check_http_on(proc.pid, http_port, "127.0.0.1")  # bash exec'd the worker: the same pid
        proc.terminate()  # scancel's SIGTERM
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _check_removed(tmp, root)


@pytest.mark.timeout(120)
def test_the_runs_scheduler_works_in_a_private_directory(tmp_path, monkeypatch):
    from distributed import Client

    from astraflow.runtime.cluster import SchedulerProcess
    from storage.paths import RunPaths

    tmp = _shared_tmp(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp))
    before = set(os.listdir(tmp))
    proc = SchedulerProcess(RunPaths(tmp_path / "run").make(), dashboard_port=0)
    address = proc.start()
    try:
        with Client(address, timeout=20) as client:
            local_directory, path0 = client.run_on_scheduler(
                lambda dask_scheduler: (dask_scheduler.local_directory, sys.path[0]))
        root = _check_private(tmp, before, local_directory, path0)
    finally:
        proc.stop()
    _check_removed(tmp, root)


def test_a_base_that_others_could_change_is_refused(tmp_path):
    open_base = tmp_path / "open"
    open_base.mkdir()
    open_base.chmod(0o777)  # no sticky bit: anyone could rename our directory and put theirs there
    with pytest.raises(PermissionError, match="sticky"):
        private_directory(str(open_base))
    assert os.listdir(open_base) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        private_directory(str(tmp_path / "file"))
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    path = Path(private_directory(str(sticky)))
    assert path.parent == sticky and stat.S_IMODE(path.stat().st_mode) == 0o700
    remove_private_directory(str(path))
    assert not path.exists()


def test_a_base_that_others_could_swap_from_above_is_refused(tmp_path):
    """A base of our own inside a directory others can write without the sticky bit (``$TMPDIR``
    in a shared project directory): they could rename it away, with our directory in it, and put
    theirs in its place, with modules for the sys.path entry Dask makes of it."""
    above = tmp_path / "project"
    above.mkdir()
    above.chmod(0o777)
    base = above / "mine"
    base.mkdir(mode=0o700)
    with pytest.raises(PermissionError, match=f"{base} is inside {above}, which group/others can write without "
                                              "the sticky bit"):
        private_directory(str(base))
    assert os.listdir(base) == []


def test_a_dask_temporary_directory_others_could_change_stops_the_worker(tmp_path):
    """Dask's ``temporary-directory`` setting chooses where the private directory is made, never
    a directory to use as it is: one that others could change is refused before Dask starts, with
    the setting to change named."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    out = subprocess.run([sys.executable, "-m", "schedulers.dask_main", "worker", "tcp://127.0.0.1:1", "--name", "w",
                          "--no-nanny", "--death-timeout", "2"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DASK_TEMPORARY_DIRECTORY": str(shared)})
    assert out.returncode == 1 and "no private local directory" in out.stderr and "sticky" in out.stderr, out.stderr
    assert "the directory is Dask's temporary-directory (DASK_TEMPORARY_DIRECTORY" in out.stderr, out.stderr
    assert os.listdir(shared) == []


def test_only_a_directory_of_ours_is_removed(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    (tmp_path / "link").symlink_to(target)
    remove_private_directory(str(tmp_path / "link"))  # a link put in its place: left alone, and what it names
    remove_private_directory(str(tmp_path / "gone"))  # nothing there: nothing to do
    assert (target / "keep").read_text() == "x" and (tmp_path / "link").is_symlink()


def test_the_directories_of_processes_killed_outright_are_removed_by_the_next_one(tmp_path):
    """A process killed with SIGKILL cannot remove its directory; the next process on the node
    removes it, and leaves those of live processes and directories it did not make."""
    base = tmp_path / "node-tmp"
    base.mkdir()
    code = ("import sys, time; from schedulers.dask_main import private_directory; "
            "print(private_directory(sys.argv[1]), flush=True); time.sleep(120)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(base)], stdout=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(2)]
    try:
        killed, alive = (Path(p.stdout.readline().strip()) for p in procs)
        procs[0].kill()
        procs[0].wait(30)
        foreign = base / "astraflow-dask-notours"  # made some other way (no hold file): not ours to judge
        foreign.mkdir()
        mine = Path(private_directory(str(base)))
        assert not killed.exists() and alive.is_dir() and foreign.is_dir() and mine.is_dir()
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    remove_private_directory(str(mine))


@pytest.fixture
def dask_config():
    """`prepare` changes this process's Dask config: put it back afterwards."""
    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


def test_prepare_gives_the_command_its_private_directory_and_http_address(tmp_path, dask_config, monkeypatch):
    monkeypatch.delenv("DASK_DISTRIBUTED__WORKER__HTTP__ROUTES", raising=False)
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    private, args = prepare("worker", ["tls://h:1", "--host", "127.0.0.2", "--local-directory", str(base)])
    try:
        assert Path(private).parent == base and stat.S_IMODE(os.stat(private).st_mode) == 0o700
        assert option(args, "--local-directory") == (private, ["tls://h:1", "--host", "127.0.0.2",
                                                               "--dashboard-address", "127.0.0.2:0"])
        assert args.count("--local-directory") == 1
        assert dask.config.get("temporary-directory") == private
        assert dask.config.get("distributed.worker.http.routes") == []
    finally:
        remove_private_directory(private)
    monkeypatch.setenv("TMPDIR", str(base))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read $TMPDIR again
    dask.config.set({"temporary-directory": None})
    private, args = prepare("scheduler", ["--interface", "lo", "--port", "0"])
    try:
        assert Path(private).parent.resolve() == base.resolve() and "--local-directory" not in args
        assert option(args, "--dashboard-address")[0] == "127.0.0.1:0"  # the address of lo
    finally:
        remove_private_directory(private)
    dask.config.set({"temporary-directory": None})
    private, args = prepare("scheduler", ["--host", "0.0.0.0", "--dashboard-address=10.0.0.1:8787"])
    remove_private_directory(private)
    assert args == ["--host", "0.0.0.0", "--dashboard-address=10.0.0.1:8787"]  # the owner's address stays


def test_option_reads_both_spellings():
    assert option(["a", "--x", "1", "--x=2", "b"], "--x") == ("2", ["a", "b"])
    assert option(["--xy", "1"], "--x") == (None, ["--xy", "1"])


def test_a_base_not_there_yet_is_made_for_this_user_only(tmp_path):
    """``DASK_TEMPORARY_DIRECTORY`` (or a partition's local directory) naming a directory not made
    yet: made, as Dask makes its own, instead of the run's scheduler failing to start."""
    base = tmp_path / "scratch" / "dask"
    path = Path(private_directory(str(base)))
    try:
        assert path.parent == base and stat.S_IMODE(base.stat().st_mode) == 0o700
    finally:
        remove_private_directory(str(path))
