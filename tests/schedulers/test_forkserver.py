"""The fork server local workers start from (``schedulers.forkserver``): a forked worker is the
process a fresh one would be (its own session, environment, log, exit status), it dies with the
server, and what the server cannot stand in for starts fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from schedulers import LocalScheduler, Partition
from schedulers.forkserver import FORK_SERVER_MARK, ForkedProcess, ForkServer, ForkServerError
from schedulers.local import start_fork_server
from schedulers.procs import process_argv
from tests.schedulers.dask_fixtures import wait_for_workers

#: a module each test child runs: says what it is, starts a grandchild in its group, exits as told
CHILD = '''
import os, subprocess, sys, time
import numpy
print("env", os.environ.get("ASTRAFLOW_PROBE"), "cwd", os.getcwd(), "sid", os.getsid(0) == os.getpid(), flush=True)
print("preloaded", "json.tool" in sys.modules, "argv", sys.argv[1:], "draw", numpy.random.randint(1 << 30), flush=True)
if sys.argv[1] == "sleep":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(60)
sys.exit(int(sys.argv[1]))
'''


def _server(tmp_path, **env) -> ForkServer:
    (tmp_path / "probe_child.py").write_text(CHILD)
    return ForkServer(sys.executable, ["json.tool", "numpy"], {**os.environ, **env}, tmp_path / "server.log")


def _wait(cond, deadline_s: float = 20.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def _running(pid: int) -> bool:
    """Whether `pid` is a process that is neither a zombie nor dead."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _stop_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(120)
def test_a_forked_child_has_its_own_session_environment_log_and_exit_status(tmp_path):
    server = _server(tmp_path)
    try:
        logs = [tmp_path / f"child{i}.log" for i in range(2)]
        kids = [server.start([sys.executable, "-m", "probe_child", "3"], {**server.env, "ASTRAFLOW_PROBE": f"p{i}"},
                             log, cwd=tmp_path) for i, log in enumerate(logs)]
        assert all(isinstance(k, ForkedProcess) for k in kids)
        assert [k.wait(timeout=30) for k in kids] == [3, 3] and kids[0].poll() == 3
        texts = [log.read_text() for log in logs]
        for i, text in enumerate(texts):
            assert f"env p{i} cwd {tmp_path} sid True" in text, text
            assert "preloaded True argv ['3']" in text, text  # the server's imports, the child's arguments
        draws = [t.split("draw ")[1].split()[0] for t in texts]
        assert draws[0] != draws[1], "the children share numpy's random state"
        # reaped once the exit was seen: no zombie keeps the pid
        assert _wait(lambda: not any(os.path.exists(f"/proc/{k.pid}") for k in kids))
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_children_die_with_the_server_and_it_refuses_to_start_more(tmp_path):
    server = _server(tmp_path)
    kid = server.start([sys.executable, "-m", "probe_child", "sleep"], server.env, tmp_path / "c.log", cwd=tmp_path)
    assert any(FORK_SERVER_MARK in a for a in process_argv(kid.pid))
    with pytest.raises(subprocess.TimeoutExpired):
        kid.wait(timeout=0.5)
    assert _wait(lambda: "argv ['sleep']" in (tmp_path / "c.log").read_text())
    os.kill(server._proc.pid, signal.SIGKILL)  # the server crashes
    assert kid.wait(timeout=20) == -signal.SIGKILL
    assert _wait(lambda: not _running(kid.pid))
    assert server.misfit([sys.executable, "-m", "probe_child", "0"], server.env) == "the fork server is gone"
    with pytest.raises(ForkServerError):
        server.start([sys.executable, "-m", "probe_child", "0"], server.env, tmp_path / "d.log", cwd=tmp_path)
    server.close()
    _stop_group(kid.pid)  # its grandchild, orphaned


def test_what_a_fork_cannot_stand_in_for_is_named(tmp_path):
    server = _server(tmp_path)
    try:
        argv = [sys.executable, "-m", "probe_child", "0"]
        assert server.misfit(argv, {**server.env, "ASTRAFLOW_ROLE": "x", "DASK_X": "1",
                                    "PYTEST_CURRENT_TEST": "t.py::test (call)"}) is None
        assert "OMP_NUM_THREADS" in server.misfit(argv, {**server.env, "OMP_NUM_THREADS": "7"})
        assert "PATH" in server.misfit(argv, {k: v for k, v in server.env.items() if k != "PATH"})
        assert "-m MODULE" in server.misfit(["/other/python", "-m", "x"], server.env)
        assert "-m MODULE" in server.misfit([sys.executable, "-c", "pass"], server.env)
    finally:
        server.close()


def _part(**kw) -> Partition:
    return Partition(**{"name": "cpu", "region": "home", "hardware": "cpu", "role": "rollout", "nodes": 1, **kw})


@pytest.mark.timeout(150)
def test_local_workers_are_forked_cancelled_with_their_group_and_others_start_fresh(dask_scheduler, tmp_path):
    address, _, client = dask_scheduler
    server = start_fork_server(tmp_path / "logs", ["distributed.cli.dask_worker"])
    sched = LocalScheduler(tmp_path / "logs", death_timeout=20, fork_server=server)
    try:
        (forked,) = sched.submit(_part(), address, count=1)
        (fresh,) = sched.submit(_part(name="gpu", env={"OMP_NUM_THREADS": "3"}), address, count=1)
        names = {forked.worker_name, fresh.worker_name}
        assert names <= wait_for_workers(client, names, present=True, deadline_s=60), \
            [r.log.read_text()[-800:] for r in (forked, fresh)]
        pids = {ref.worker_name: int(ref.job_id.removeprefix("local-")) for ref in (forked, fresh)}
        assert any(FORK_SERVER_MARK in a for a in process_argv(pids[forked.worker_name]))
        assert "schedulers.dask_main" in process_argv(pids[fresh.worker_name])
        assert "not forked: its environment sets OMP_NUM_THREADS otherwise" in fresh.log.read_text()
        seen = client.run(lambda: (os.environ["ASTRAFLOW_WORKER_NAME"], os.getpid(), os.getpgid(0)))
        assert {n: p for n, p, _ in seen.values()} == pids
        assert all(p == g for _, p, g in seen.values())  # each leads a process group of its own
        # a process the forked worker started is in its group: the cancel ends it too
        started = client.run(lambda: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid,
                             workers=[a for a, v in seen.items() if v[0] == forked.worker_name])
        sched.cancel([forked.job_id])
        assert {j.worker_name: j.state for j in sched.jobs()}[forked.worker_name] == "CANCELLED"
        assert not _running(pids[forked.worker_name]) and not _running(next(iter(started.values())))
    finally:
        sched.close()
    assert not server.alive and not _running(pids[fresh.worker_name])
    assert wait_for_workers(client, names, present=False, deadline_s=20).isdisjoint(names)


@pytest.mark.timeout(120)
def test_inside_a_slurm_job_the_server_and_its_workers_outlive_a_sigterm_to_the_job(dask_scheduler, tmp_path,
                                                                                     monkeypatch):
    """scancel's SIGTERM reaches every process of a head job, the fork server too: it must not end
    (and take the workers with it) before the run stopped them in order."""
    address, _, client = dask_scheduler
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    server = start_fork_server(tmp_path / "logs", ["distributed.cli.dask_worker"])
    sched = LocalScheduler(tmp_path / "logs", death_timeout=20, term_timeout=20, fork_server=server)
    (ref,) = sched.submit(_part(), address, count=1)
    pid = int(ref.job_id.removeprefix("local-"))
    try:
        assert ref.worker_name in wait_for_workers(client, {ref.worker_name}, present=True, deadline_s=40)
        assert any(FORK_SERVER_MARK in a for a in process_argv(pid))
        for pgid in (server._proc.pid, pid):
            os.killpg(pgid, signal.SIGTERM)
        time.sleep(1.5)
        assert server.alive and server._proc.poll() is None
        assert ref.worker_name in wait_for_workers(client, {ref.worker_name}, present=True, deadline_s=10)
        sched.cancel([ref.job_id])
        assert sched._procs[ref.job_id].popen.returncode == 0  # closed on SIGINT: no SIGKILL was needed
    finally:
        sched.close()
    assert not server.alive


@pytest.mark.timeout(120)
def test_a_server_whose_imports_initialised_cuda_forks_nothing_and_workers_start_fresh(dask_scheduler, tmp_path,
                                                                                        monkeypatch):
    """A forked child cannot use CUDA its parent initialised: such a server refuses, and the
    workers start as fresh processes (saying why in their log)."""
    address, _, client = dask_scheduler
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "cuda_at_import.py").write_text(  # what an import touching the GPU looks like to torch
        "import torch\ntorch.cuda.is_initialized = lambda: True\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'mods'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    server = start_fork_server(tmp_path / "logs", ["cuda_at_import"])
    sched = LocalScheduler(tmp_path / "logs", death_timeout=20, fork_server=server)
    try:
        (ref,) = sched.submit(_part(), address, count=1)
        assert "not forked: the fork server could not start" in ref.log.read_text()
        assert "initialised CUDA" in ref.log.read_text()
        assert "schedulers.dask_main" in process_argv(int(ref.job_id.removeprefix("local-")))
        assert ref.worker_name in wait_for_workers(client, {ref.worker_name}, present=True, deadline_s=40)
        assert not server.alive
    finally:
        sched.close()


def _mods(tmp_path, monkeypatch, **files: str):
    """Modules `files` (name: source) importable by the servers and children the test starts."""
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    for name, source in files.items():
        (mods / f"{name}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", f"{mods}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


#: a server's imports that fail every fork after the first (``fork`` refused for lack of memory, say)
ONE_FORK = '''
import errno, os
_fork, _forks = os.fork, []
def fork():
    _forks.append(1)
    if len(_forks) > 1:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    return _fork()
os.fork = fork
'''


@pytest.mark.timeout(120)
def test_a_fork_that_fails_starts_that_worker_fresh_and_leaves_the_forked_ones_running(tmp_path, monkeypatch):
    """The server still holds the workers it forked (they die with it): one fork it could not do
    must not end them."""
    import schedulers.local as local

    _mods(tmp_path, monkeypatch, one_fork=ONE_FORK, sleeper="import time\ntime.sleep(120)\n")
    monkeypatch.setattr(local, "partition_worker_command",
                        lambda part, address, name, **kw: [sys.executable, "-m", "sleeper", "--name", name])
    server = start_fork_server(tmp_path / "logs", ["one_fork"])
    sched = LocalScheduler(tmp_path / "logs", term_timeout=10, fork_server=server)
    try:
        (forked,) = sched.submit(_part(), "tcp://127.0.0.1:8786", count=1)
        assert any(FORK_SERVER_MARK in a for a in process_argv(int(forked.job_id.removeprefix("local-"))))
        (fresh,) = sched.submit(_part(), "tcp://127.0.0.1:8786", count=1, start_index=1)
        pids = {ref.worker_name: int(ref.job_id.removeprefix("local-")) for ref in (forked, fresh)}
        assert "not forked: the fork server could not start sleeper: OSError" in fresh.log.read_text()
        assert server.alive and _running(pids[forked.worker_name])
        assert {j.worker_name: j.state for j in sched.jobs()} == {forked.worker_name: "RUNNING",
                                                                  fresh.worker_name: "RUNNING"}
        (third,) = sched.submit(_part(), "tcp://127.0.0.1:8786", count=1, start_index=2)  # not asked again
        assert "not forked" not in third.log.read_text()
        assert "sleeper" in process_argv(int(third.job_id.removeprefix("local-")))
    finally:
        sched.close()
    assert not server.alive and not _running(pids[forked.worker_name])
    assert {j.state for j in sched.jobs()} == {"CANCELLED"}


#: a server's import that writes into its own environment the value it would use anyway, as
#: torch's does with its cache directory (``TORCHINDUCTOR_CACHE_DIR``)
SETS_ITS_CACHE_DIR = '''
import json
import os
os.environ["PROBE_CACHE_DIR"] = os.path.abspath(os.environ.get("PROBE_CACHE_DIR", "/tmp/probe-cache"))
'''


def test_what_an_import_set_in_the_environment_to_the_same_value_is_no_misfit(tmp_path, monkeypatch):
    """The run's own process imports the same libraries after the server started (a model built
    by the run: transformers, then torch's compiler set ``TORCHINDUCTOR_CACHE_DIR``), and every
    worker it starts then has that variable: where the server's imports set it to the same value,
    they worked with it, and a fork is what a fresh process would be."""
    _mods(tmp_path, monkeypatch, sets_cache_dir=SETS_ITS_CACHE_DIR)
    monkeypatch.delenv("PROBE_CACHE_DIR", raising=False)
    server = ForkServer(sys.executable, ["sets_cache_dir"], dict(os.environ), tmp_path / "server.log")
    try:
        argv = [sys.executable, "-m", "json.tool", "--help"]
        monkeypatch.setenv("PROBE_CACHE_DIR", "/tmp/probe-cache")  # the same import, here
        assert server.misfit(argv, dict(os.environ)) is None
        monkeypatch.setenv("PROBE_CACHE_DIR", "/elsewhere")
        assert "PROBE_CACHE_DIR" in server.misfit(argv, dict(os.environ))
        monkeypatch.setenv("PROBE_CACHE_DIR", "/tmp/probe-cache")
        assert "PROBE_OTHER" in server.misfit(argv, {**os.environ, "PROBE_OTHER": "1"})
    finally:
        server.close()


def test_dask_variables_read_when_dask_is_imported_must_match(tmp_path):
    """Dask's configuration is collected again in a child, but its files' places, logging and a
    few module constants were taken when the server imported Dask: a partition setting those starts
    fresh."""
    server = _server(tmp_path)
    try:
        argv = [sys.executable, "-m", "probe_child", "0"]
        assert server.misfit(argv, {**server.env, "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "True"}) is None
        for name in ("DASK_LOGGING__DISTRIBUTED", "DASK_CONFIG", "DASK_DISTRIBUTED__ADMIN__PDB_ON_ERR",
                     "DASK_DISTRIBUTED__COMM__OFFLOAD", "DASK_INTERNAL_INHERIT_CONFIG"):
            assert name in (server.misfit(argv, {**server.env, name: "x"}) or ""), name
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_forked_children_draw_from_torch_as_fresh_processes_do(tmp_path, monkeypatch):
    """torch's global generator is seeded once per process at import: each child gets its own
    seed, not the server's (every worker would otherwise draw the same numbers)."""
    _mods(tmp_path, monkeypatch, torch_draw="import torch\nprint('seed', torch.initial_seed(), flush=True)\n")
    server = ForkServer(sys.executable, ["torch"], dict(os.environ), tmp_path / "server.log")
    try:
        logs = [tmp_path / f"draw{i}.log" for i in range(2)]
        kids = [server.start([sys.executable, "-m", "torch_draw"], server.env, log, cwd=tmp_path) for log in logs]
        assert [k.wait(timeout=60) for k in kids] == [0, 0], [log.read_text() for log in logs]
        seeds = [log.read_text().split("seed ")[1].split()[0] for log in logs]
        assert seeds[0] != seeds[1], "the children share torch's random state"
    finally:
        server.close()


def test_a_request_is_sent_whole_when_the_pipe_takes_part_of_it(tmp_path):
    """A write to the server's pipe may take part of a long request (a signal while it waits for
    room): the rest follows, or the server reads a broken line."""
    server = _server(tmp_path)
    try:
        written = bytearray()

        class Partial:
            closed = False

            def write(self, data) -> int:
                written.extend(bytes(data)[:1000])
                return min(len(data), 1000)

        server._proc.stdin, real = Partial(), server._proc.stdin
        server._send({"id": 7, "env": {"X": "y" * 5000}})
        server._proc.stdin = real
        assert json.loads(written) == {"id": 7, "env": {"X": "y" * 5000}}
    finally:
        server.close()


#: a server's imports that make every fork after the first wait (a machine short of memory)
SLOW_FORK = '''
import os, time
_fork, _forks = os.fork, []
def fork():
    _forks.append(1)
    if len(_forks) > 1:
        time.sleep(float(os.environ.get("PROBE_FORK_DELAY", "0")))
    return _fork()
os.fork = fork
'''


@pytest.mark.timeout(120)
def test_a_child_forked_after_its_start_gave_up_is_killed(tmp_path, monkeypatch):
    """A worker `start` no longer waits for would run unknown to the scheduler (and the fresh
    one started in its place under the same name): the late answer kills it."""
    import schedulers.forkserver as forkserver

    _mods(tmp_path, monkeypatch, slow_fork=SLOW_FORK,
          pid_sleeper="import os, sys, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n")
    monkeypatch.setenv("PROBE_FORK_DELAY", "3")
    monkeypatch.setattr(forkserver, "FORK_TIMEOUT_S", 0.5)
    server = ForkServer(sys.executable, ["slow_fork"], dict(os.environ), tmp_path / "server.log")
    argv = [sys.executable, "-m", "pid_sleeper"]
    try:
        first = server.start(argv, server.env, tmp_path / "first.log", cwd=tmp_path)
        with pytest.raises(ForkServerError, match="hangs"):
            server.start(argv, server.env, tmp_path / "late.log", cwd=tmp_path)
        assert _wait(lambda: len(_children(server)) == 2)  # forked after all
        assert _wait(lambda: [k for k in _children(server) if k != first.pid and _running(k)] == []), \
            "the late child runs"
        assert first.poll() is None and _running(first.pid)
    finally:
        server.close()


def _children(server: ForkServer) -> list[int]:
    """The server's children, zombies included."""
    try:
        return [int(k) for k in open(f"/proc/{server._proc.pid}/task/{server._proc.pid}/children").read().split()]
    except OSError:
        return []


def test_a_closed_server_ends_without_tearing_its_imports_down(tmp_path, monkeypatch):
    """The interpreter's teardown of torch and transformers takes seconds the run's shutdown
    would wait for: the server skips it (its imports' exit handlers do not run)."""
    marker = tmp_path / "torn-down"
    _mods(tmp_path, monkeypatch, exit_marker=f"import atexit, pathlib\n"
                                             f"atexit.register(pathlib.Path({str(marker)!r}).touch)\n")
    server = ForkServer(sys.executable, ["exit_marker"], dict(os.environ), tmp_path / "server.log")
    with server._cond:
        assert server._cond.wait_for(lambda: server._ready, 60)
    server.close()
    assert server._proc.returncode == 0 and not marker.exists()
