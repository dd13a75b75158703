"""This process's fork server for local Megatron ranks (``launch.LocalRanks``): torch,
Megatron-core and the rank's modules imported once, every rank of every later backend of the
process forked from it, so a backend started again (a resume, a restart after a rank died)
starts its ranks in seconds.

The server stays in this process's group, as fresh ranks would be: what stops the group stops
the server, the ranks and what they started. It is started from a keeper thread that lives as
long as the process, since it dies with the thread that started it (``die_with_parent``) and a
backend may be built on a thread that ends first. It works in a directory of its own (nothing
there shadows what it imports; its log is kept there unless a backend names a ``log_dir``),
made in Dask's ``temporary-directory`` where one is set (a worker's private directory, removed
with it), else in ``$TMPDIR``, and removed when this process exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from schedulers.forkserver import ForkServer

RANK_MODULE = "astraflow.training.megatron.rank"
#: what the server imports once: the rank and what building a Megatron GPT model, its
#: optimiser and its checkpoints import
RANK_PRELOAD = (
    RANK_MODULE, "astraflow.training.megatron.model", "astraflow.training.grpo", "storage.ownership",
    "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.distributed",
    "megatron.core.dist_checkpointing", "megatron.core.transformer.transformer_config",
)

_lock = threading.Lock()
_server: ForkServer | None = None
_keeper: ThreadPoolExecutor | None = None
_directory: Path | None = None


def rank_fork_server(env: Mapping[str, str], log_dir: Path | None = None) -> ForkServer:
    """The server, started on first use with ``env`` (a launch whose ranks would differ starts
    them fresh, ``ForkServer.misfit``) and kept; its log goes to ``log_dir`` where given."""
    global _server, _keeper, _directory
    with _lock:
        if _server is None or not _server.alive:
            if _keeper is None:
                _keeper = ThreadPoolExecutor(1, thread_name_prefix="megatron-forkserver")
            if _directory is None or not _directory.is_dir():
                _directory = Path(tempfile.mkdtemp(prefix="astraflow-megatron-ranks-", dir=temporary_directory()))
                atexit.register(_remove, _directory, os.getpid())
            log = (log_dir or _directory) / "megatron-forkserver.log"
            _server = _keeper.submit(ForkServer, sys.executable, RANK_PRELOAD, env, log, False, _directory).result()
        return _server


def current() -> ForkServer | None:
    """The server the next launch forks from (None: the next launch starts one)."""
    return _server


def give_up(server: ForkServer, close: bool = False) -> None:
    """Stop handing out ``server`` (it failed, hangs or refuses to fork): the next launch starts
    another. Ranks already forked from it keep running; ``close`` stops one that forked none."""
    global _server
    with _lock:
        if _server is server:
            _server = None
    if close:  # in the background: a server busy importing takes a while to stop
        threading.Thread(target=server.close, name="megatron-forkserver-close", daemon=True).start()


def close_rank_fork_server() -> None:
    """Stop the server, if one runs (its ranks die with it), and remove its directory."""
    global _server, _directory
    with _lock:
        server, _server = _server, None
        directory, _directory = _directory, None
    if server is not None:
        server.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def temporary_directory() -> str | None:
    """Dask's ``temporary-directory`` where set: in a run's worker, its private directory (removed
    with it, or after a SIGKILL by the next worker on the node); None: ``$TMPDIR``."""
    dask = sys.modules.get("dask")
    return dask.config.get("temporary-directory", None) if dask is not None else None


def _remove(directory: Path, pid: int) -> None:
    """At this process's exit (not a forked child's, which runs the same exit functions)."""
    if os.getpid() == pid:
        shutil.rmtree(directory, ignore_errors=True)
