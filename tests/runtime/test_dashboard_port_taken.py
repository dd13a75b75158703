"""A dashboard port that is taken: Dask serves the dashboard on another port, and the run says
so next to its address. On a shared login node the configured port (8787 by default) may be
another user's: a tunnel to it, and the token sent through it, would reach their program."""

from __future__ import annotations

import io
import socket

from rich.console import Console

from astraflow.config import ClusterConfig
from astraflow.runtime.placement import Placement
from astraflow.runtime.progress import Progress
from storage.paths import RunPaths


def test_a_taken_dashboard_port_is_said_with_the_port_used_instead(tmp_path):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    out = io.StringIO()
    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(dashboard_port=taken),
                          Progress(console=Console(file=out, width=400)))
    try:
        placement.start()
        used = placement.client.scheduler_info()["services"]["dashboard"]
    finally:
        if placement.client is not None:
            placement.client.close()
        if placement.scheduler_proc is not None:
            placement.scheduler_proc.stop()
        squatter.close()
    said = out.getvalue()
    assert used != taken
    assert (f"cluster.dashboard_port {taken} is taken on this machine, so the dashboard is on port {used}" in said
            and "never send it the run's token" in said), said


def test_a_free_dashboard_port_is_used_without_a_word(tmp_path):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    free = probe.getsockname()[1]
    probe.close()
    out = io.StringIO()
    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(dashboard_port=free),
                          Progress(console=Console(file=out, width=400)))
    try:
        placement.start()
    finally:
        if placement.client is not None:
            placement.client.close()
        if placement.scheduler_proc is not None:
            placement.scheduler_proc.stop()
    assert f":{free}/status" in out.getvalue() and "is taken" not in out.getvalue(), out.getvalue()
