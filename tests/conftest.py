"""Shared fixtures. Tests import the packages from the repository root."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# processes the tests start (Dask workers, schedulers) import the packages from this checkout
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


# Groups for parallel runs (`ASTRAFLOW_TEST_WORKERS=N bash tests/run.sh`: xdist, --dist loadgroup): the tests of a
# group run one after another on one worker, never beside each other; every other test is a
# group of its own. "slurm": the one local Slurm cluster and its few nodes. "sandbox":
# tests/sandbox counts the live sandbox processes of the whole machine, so no other test may run
# the sandbox meanwhile. Chosen by path on the controller, which sees node ids only (xdist's own
# xdist_group marks need a node-id rewrite that the pytest this project uses no longer takes).
XDIST_GROUPS = {
    "slurm": ("tests/slurm/",),
    "sandbox": ("tests/sandbox/", "tests/workloads/test_code_sandbox.py", "tests/rollout/test_testgen_workflow.py",
                "tests/e2e/test_code_cli.py", "tests/e2e/test_testgen_cli.py"),
}


#: modules whose tests share an expensive module-scoped fixture (Megatron ranks trained a few
#: steps, engine processes): each module is a group, so that fixture is built on one worker only
MODULE_GROUPS = ("tests/megatron/", "tests/rollout/test_engine_pool.py", "tests/rollout/test_process_engine.py")


def xdist_group_of(nodeid: str) -> str | None:
    """The group of the test ``nodeid`` (relative to the repository root), or None."""
    named = next((name for name, prefixes in XDIST_GROUPS.items() if nodeid.startswith(prefixes)), None)
    if named is None and nodeid.startswith(MODULE_GROUPS):
        return nodeid.split("::", 1)[0]
    return named


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with the groups above (other --dist modes are xdist's own)."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class PathGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid) or super()._split_scope(nodeid)

    return PathGroupScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 0.8M-parameter Qwen2 model with the local byte tokenizer (built once per session)."""
    from astraflow.models import init_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    init_model(out, preset="tiny", arch="qwen2", seed=0)
    return out


@pytest.fixture(scope="session", autouse=True)
def _own_check_cache(tmp_path_factory):
    """The remembered model checks (``astraflow.checked``) of this session's processes, the
    ones the tests start included, kept apart from the user's own."""
    before = os.environ.get("ASTRAFLOW_CACHE_DIR")
    os.environ["ASTRAFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("astraflow-cache"))
    yield
    if before is None:
        os.environ.pop("ASTRAFLOW_CACHE_DIR", None)
    else:
        os.environ["ASTRAFLOW_CACHE_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def _rank_fork_server_stopped():
    """The rank fork server a Megatron test started in this process (kept for the later ones,
    ``astraflow.training.megatron.rank_server``) is stopped when the session ends."""
    yield
    rank_server = sys.modules.get("astraflow.training.megatron.rank_server")
    if rank_server is not None:
        rank_server.close_rank_fork_server()


#: the signals that stop a run (``astraflow.runtime.stopping``)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_dispositions_kept():
    """A command run in-process (click's ``CliRunner``) may set the run's stop signals to be
    ignored as the process exits (``runtime.stopping.ignore_stop_signals``): restored after each
    test, since a process started later would inherit them ignored (a shell cannot trap those)."""
    kept = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in kept.items():
        if handler is not None and signal.getsignal(signum) != handler:
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tests share 2 cores with the processes they start: one intra-op thread each."""
    import torch

    torch.set_num_threads(1)


@contextlib.contextmanager
def read_only_dir(path: Path):
    """``path`` (a directory) that this process cannot write in while the block runs: mode 0o500,
    or for root, whom permissions do not stop, a read-only bind mount over it (unmounted after)."""
    if os.geteuid() != 0:
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)
        return
    for args in (["--bind", str(path), str(path)], ["-o", "remount,bind,ro", str(path)]):
        res = subprocess.run(["mount", *args], capture_output=True, text=True)
        if res.returncode != 0:
            subprocess.run(["umount", str(path)], capture_output=True)
            pytest.skip(f"root here cannot bind-mount {path} read-only: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def tiny_config(model: Path, **overrides):
    """The tiny example config pointed at ``model``, with ``section.key`` overrides."""
    from astraflow.config import config_from_dict, _set_path
    import yaml

    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    for key, value in overrides.items():
        _set_path(data, key.replace("__", "."), value)
    return config_from_dict(data)


def run_in_thread(orchestrator):
    """Run ``orchestrator.run()`` in a daemon thread; returns ``(thread, box)`` where ``box``
    receives ``result`` or the ``error`` the run raised (re-raised by the test that joins)."""
    import threading

    box: dict = {}

    def target():
        try:
            box["result"] = orchestrator.run()
        except BaseException as err:  # handed to the test thread
            box["error"] = err

    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th, box
