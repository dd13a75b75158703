"""Shared fixtures. Tests import the packages from the repository root."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 0.8M-parameter Qwen2 model with the local byte tokenizer (built once per session)."""
    from astraflow.models import init_model

    out = tmp_path_factory.mktemp("models") / "tiny"
    init_model(out, preset="tiny", arch="qwen2", seed=0)
    return out


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tests share 2 cores with the processes they start: one intra-op thread each."""
    import torch

    torch.set_num_threads(1)


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
