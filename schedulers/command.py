"""The one command line that starts an AstraFlow Dask worker, for every backend.

Both `LocalScheduler` (a subprocess) and `SlurmScheduler` (the last line of the job script) run
exactly `worker_command(...)`, so a worker behaves the same wherever it starts.

No nanny (``--no-nanny``): the process the backend started *is* the worker. Killing it (SIGTERM
from `cancel`/`scancel`, or a crash) kills the worker and the actors it holds, and nothing
restarts it under the same name. A nanny would restart a dead worker with the same name but
without its actors, so the orchestrator would see a live worker that hosts nothing; actor
recovery is the orchestrator's job (re-place, reload state), which needs the loss to be visible.

No worker dashboard pages (``--no-dashboard``): the scheduler's dashboard is the one users open.
The process entry (``schedulers.dask_main``, on the worker's own node) gives the worker a private
local directory and keeps its HTTP server on the worker's address, without Dask's routes.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from schedulers.partition import Partition, parse_worker_name
from schedulers.tls import TLSFiles

#: the module every Dask process AstraFlow starts runs (``dask worker|scheduler``, then a quick exit)
DASK_MAIN = "schedulers.dask_main"

#: Dask settings for the processes AstraFlow starts (as ``DASK_*`` variables, which Dask reads
#: at import). Dask's defaults poll for dashboards we do not use at rates made for short tasks:
#: a statistical profiler sampling every thread, a fast event-loop tick, memory and system
#: monitors several times a second: on a small machine running a scheduler and several workers
#: a noticeable share of its CPU (``benchmarks/dask_overhead.py`` measures it). A variable
#: already set (in the shell, or a partition's ``env``) wins, e.g.
#: ``DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=True`` for the dashboard's Profile page.
QUIET_DASK_ENV = {
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "2s",
    "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "1s",
    # AstraFlow's own lines in a worker's log formatted as Dask's (time, level, logger), INFO on
    "DASK_LOGGING__ASTRAFLOW": "info",
    # no progress bars (a model's "Loading weights") drawn into log files
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name a server binds to) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_address(interface: str, key: str) -> str:
    """The IPv4 address of network interface ``interface`` on this machine; a ``ValueError``
    naming config ``key`` and the interfaces there are when it has none."""
    from distributed.utils import get_ip_interface

    try:
        return get_ip_interface(interface)
    except (KeyError, ValueError):
        import psutil

        known = ", ".join(sorted(psutil.net_if_addrs())) or "none"
        raise ValueError(f"{key}: {interface!r} is no network interface with an IPv4 address on this machine "
                         f"(there are: {known}); name one of them, or unset it") from None


def quiet_dask_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``QUIET_DASK_ENV`` entries that ``environ`` does not set already."""
    return {k: v for k, v in QUIET_DASK_ENV.items() if k not in environ}


def _format_amount(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def worker_command(
    scheduler_address: str,
    name: str,
    resources: Mapping[str, float],
    *,
    nthreads: int = 1,
    memory_limit: str = "auto",
    python: str = sys.executable,
    host: str | None = None,
    interface: str | None = None,
    death_timeout: float = 60,
    local_directory: str | Path | None = None,
    tls: TLSFiles | None = None,
) -> list[str]:
    """argv of a Dask worker named `name` joining `scheduler_address`.

    `scheduler_address` is ``tcp://host:port`` (passed as is) or the path of a scheduler file
    written by ``dask scheduler --scheduler-file`` / ``astraflow run`` (``--scheduler-file``; the
    worker reads the address when it starts, so a queued job survives a scheduler restart).
    `host` (e.g. ``127.0.0.1``) or `interface` (e.g. ``lo``, ``ib0``) chooses the address the
    worker listens on; give at most one. `death_timeout`: seconds a worker waits for an
    unreachable scheduler before it exits. `tls`: the run's certificates, for a ``tls://`` scheduler.
    `local_directory`: where the worker makes its private directory (default: its node's ``$TMPDIR``;
    ``schedulers.dask_main`` makes a new 0700 directory under it and removes it at exit).
    """
    if host is not None and interface is not None:
        raise ValueError("give either host (an IP address) or interface (e.g. 'ib0') for the worker, not both")
    if nthreads < 1:
        raise ValueError(f"nthreads is {nthreads}: use 1 or more")
    cmd = [python, "-m", DASK_MAIN, "worker"]
    if "://" in scheduler_address:
        cmd.append(scheduler_address)
    elif scheduler_address.endswith(".json"):
        cmd += ["--scheduler-file", str(scheduler_address)]
    else:
        raise ValueError(
            f"scheduler address {scheduler_address!r}: give 'tcp://host:port' or the path of a scheduler file "
            "ending in .json"
        )
    cmd += ["--name", name, "--nthreads", str(nthreads), "--memory-limit", memory_limit]
    if resources:
        cmd += ["--resources", " ".join(f"{k}={_format_amount(v)}" for k, v in sorted(resources.items()))]
    cmd += ["--no-nanny", "--no-dashboard", "--death-timeout", _format_amount(death_timeout)]
    if host is not None:
        cmd += ["--host", host]
    if interface:
        cmd += ["--interface", interface]
    if local_directory is not None:
        cmd += ["--local-directory", str(local_directory)]
    if tls is not None:
        cmd += tls.args()
    return cmd


def partition_worker_command(
    partition: Partition,
    scheduler_address: str,
    name: str,
    *,
    python: str = sys.executable,
    host: str | None = None,
    interface: str | None = None,
    death_timeout: float = 60,
    local_directory: str | Path | None = None,
    tls: TLSFiles | None = None,
) -> list[str]:
    """`worker_command` with threads, memory limit and resources taken from `partition`."""
    return worker_command(
        scheduler_address,
        name,
        partition.worker_resources,
        nthreads=partition.worker_threads,
        memory_limit=partition.worker_memory_limit,
        python=python,
        host=host,
        interface=interface,
        death_timeout=death_timeout,
        local_directory=local_directory,
        tls=tls,
    )


def worker_env(partition: Partition, name: str) -> dict[str, str]:
    """Variables every worker process gets: the partition's `env`, `QUIET_DASK_ENV` where
    neither it nor this process's environment sets a value, plus who it is.

    ``ASTRAFLOW_WORKER_NAME``, ``ASTRAFLOW_PARTITION``, ``ASTRAFLOW_ROLE``, ``ASTRAFLOW_REGION``,
    ``ASTRAFLOW_HARDWARE`` let code on the worker know its role without asking the scheduler.
    """
    fields = parse_worker_name(name)
    env = quiet_dask_env({**os.environ, **partition.env})
    env.update(partition.env)
    env.update(
        ASTRAFLOW_WORKER_NAME=name,
        ASTRAFLOW_PARTITION=partition.name,
        ASTRAFLOW_ROLE=str(fields["role"]),
        ASTRAFLOW_REGION=partition.region,
        ASTRAFLOW_HARDWARE=partition.hardware,
    )
    return env
