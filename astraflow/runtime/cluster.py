"""The Dask scheduler of a run: started as a subprocess that writes its address to the run's
scheduler file, so the orchestrator, the CLI, and workers started by Slurm jobs all find it
the same way (and an sbatch head job can start it exactly like a laptop does)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from astraflow.runtime.dashboard import ACCESS_ENV, HTTPS_ENV, RUN_DIR_ENV, TOKEN_FILE_ENV
from schedulers.command import DASK_MAIN, TLSFiles, interface_address, quiet_dask_env
from schedulers.procs import die_with_parent, stop_env, stop_signal
from storage.paths import RunPaths


class SchedulerProcess:
    def __init__(self, paths: RunPaths, dashboard_host: str = "127.0.0.1", dashboard_port: int = 8787,
                 host: str | None = "127.0.0.1", interface: str | None = None, tls: TLSFiles | None = None,
                 dashboard_token_file: Path | None = None, dashboard_https: bool | None = None):
        """`tls`: the run's certificates (mutual TLS on every connection; None: plain TCP).
        `dashboard_token_file`: serve the dashboard to requests that carry this file's token
        only; `dashboard_https` (default: whenever there is a token) over HTTPS with `tls`'s
        certificate, required when it binds beyond loopback."""
        https = dashboard_token_file is not None if dashboard_https is None else dashboard_https
        if https and tls is None:
            raise ValueError("a dashboard served over HTTPS needs the run's TLS files too")
        if interface:  # listen on the interface's address (e.g. ib0 on the head node)
            # as an address: Dask's scheduler refuses an interface together with the TLS protocol
            host = interface_address(interface, "cluster.scheduler_interface")
        self.paths = paths
        self.dashboard = f"{dashboard_host}:{dashboard_port}"
        self.host = host
        self.interface = interface
        self.tls = tls
        self.dashboard_token_file = dashboard_token_file
        self.dashboard_https = https
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> str:
        """Start the scheduler; returns its address once it wrote the scheduler file."""
        self.paths.scheduler_file.unlink(missing_ok=True)
        log = open(self.paths.log("scheduler"), "ab")
        written_from = log.seek(0, os.SEEK_END)
        cmd = [
            sys.executable, "-m", DASK_MAIN, "scheduler",
            "--host", str(self.host), "--port", "0",
            "--dashboard-address", self.dashboard,
            "--scheduler-file", str(self.paths.scheduler_file),
            "--preload", "astraflow.runtime.dashboard",
            *(["--protocol", "tls", *self.tls.args()] if self.tls else []),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
            env=worker_env({RUN_DIR_ENV: str(self.paths.root.resolve()), **self._dashboard_env(), **stop_env()}),
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                try:  # what this start wrote (the log keeps earlier incarnations' too)
                    with open(self.paths.log("scheduler"), "rb") as f:
                        f.seek(written_from)
                        lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
                except OSError:
                    lines = []
                raise RuntimeError(f"the Dask scheduler exited with code {self.proc.returncode} while starting: "
                                   f"{last_error_line(lines)[:300]}; see {self.paths.log('scheduler')}")
            if self.paths.scheduler_file.exists():
                try:
                    return json.loads(self.paths.scheduler_file.read_text())["address"]
                except (json.JSONDecodeError, KeyError):
                    pass  # the file is being written; read it again
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the Dask scheduler did not start within {timeout:.0f}s; see {self.paths.log('scheduler')}")

    def _dashboard_env(self) -> dict[str, str]:
        """What the dashboard preload needs beyond the run directory: the token, and HTTPS when
        the dashboard is reachable from other machines."""
        if self.dashboard_token_file is None:
            return {}
        bound = self.dashboard.rsplit(":", 1)[0]
        if not self.dashboard_https:
            return {TOKEN_FILE_ENV: str(self.dashboard_token_file),
                    ACCESS_ENV: f"this machine only ({bound}), with the run's token"}
        env = {TOKEN_FILE_ENV: str(self.dashboard_token_file), HTTPS_ENV: "1",
               ACCESS_ENV: f"HTTPS, with the run's token (bound to {bound})",
               "DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__CERT": str(self.tls.cert_file)}
        if self.tls.key_file is not None:
            env["DASK_DISTRIBUTED__SCHEDULER__DASHBOARD__TLS__KEY"] = str(self.tls.key_file)
        return env

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, stop_signal())
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)


def last_error_line(lines: list[str]) -> str:
    """The line of a worker's log that says why it ended: the last exception, or the one that
    caused it (Dask wraps a worker's failure to start in ``RuntimeError: Worker failed to
    start``); else the last line."""
    errors = [i for i, x in enumerate(lines) if _EXCEPTION_LINE.match(x)]
    if not errors:
        return lines[-1].strip() if lines else "its log is empty"
    last = errors[-1]
    causes = [i for i in errors[:-1] if any(_CAUSE in x for x in lines[i:last])]
    return lines[causes[-1] if causes else last].strip()


#: a line a Python traceback ends with (``ValueError: ...``, ``socket.gaierror: ...``)
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:[Ee]rror|Exception|Exit|Interrupt)(?::|$)")
_CAUSE = "The above exception was the direct cause of the following exception"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def export_repo_path() -> None:
    """Put this checkout first on ``PYTHONPATH`` (once), so that every process started from here
    on imports AstraFlow from it, as this one does."""
    root, now = str(repo_root()), os.environ.get("PYTHONPATH", "")
    if now.split(os.pathsep)[0] != root:
        os.environ["PYTHONPATH"] = root + (os.pathsep + now if now else "")


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of processes we start: AstraFlow importable (actor classes must be
    importable on every worker), one BLAS thread and Dask's monitors slowed down
    (``QUIET_DASK_ENV``) unless told otherwise."""
    env = dict(os.environ)
    root = str(repo_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(quiet_dask_env(env))
    env.update(extra or {})
    return env


def connected_workers(client) -> dict[str, dict]:
    """``{address: info}`` of every worker connected to the scheduler now, from a fresh query.

    Not ``Client.scheduler_info()``: that returns the client's cached identity, which a
    background refresh (every ``distributed.client.scheduler-info-interval``) overwrites with a
    copy that lists *no* workers; read in between, every worker looks gone (seen as a run failing
    with "worker left the Dask scheduler" on a loaded 2-core machine)."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
