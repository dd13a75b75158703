"""A ``vllm`` engine's context length, judged before anything starts: a ``max_model_len`` past
the model's positions (vLLM refuses it at engine start, where the run would only see a timeout),
prompts measured against the tightest engine's limit, and a partition added mid-run held to the
same checks as the config's own partitions. None of it needs vLLM installed."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from astraflow.config import ConfigError
from astraflow.context_fit import model_limits, prompts_that_do_not_fit
from astraflow.preflight import check_models
from astraflow.runtime.orchestrator import Orchestrator
from astraflow.workloads.base import make_workload
from schedulers.partition import Partition
from tests.conftest import tiny_config

PARTS = [{"name": "trainer", "role": "trainer"}, {"name": "data", "role": "data"}]


def _vllm(model, **overrides):
    return tiny_config(model, rollout__engine__type="vllm", **overrides)


def test_a_max_model_len_past_the_models_positions_is_refused_naming_both(tiny_model, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    positions = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"rollout.engine.vllm.max_model_len {positions + 1}: the model of "
                                          rf"policy solver .* has {positions} positions.*lower it to {positions}"):
        check_models(_vllm(tiny_model, rollout__engine__vllm__max_model_len=positions + 1))
    check_models(_vllm(tiny_model, rollout__engine__vllm__max_model_len=positions))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override: its user's choice
    check_models(_vllm(tiny_model, rollout__engine__vllm__max_model_len=positions + 1))


def test_rope_scaling_stretches_the_positions_a_max_model_len_may_use(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    positions = config["max_position_embeddings"]
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (model / "config.json").write_text(json.dumps(config))
    check_models(_vllm(model, rollout__engine__vllm__max_model_len=4 * positions))
    with pytest.raises(ConfigError, match=rf"has {4 * positions} positions \({positions} before rope scaling\)"):
        check_models(_vllm(model, rollout__engine__vllm__max_model_len=4 * positions + 1))
    # yarn stretches its original positions; llama3 counts them stretched already (as vLLM does)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": positions // 2}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"has {2 * positions} positions"):
        check_models(_vllm(model, rollout__engine__vllm__max_model_len=2 * positions + 1))
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": positions // 8}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"has {positions} positions,"):
        check_models(_vllm(model, rollout__engine__vllm__max_model_len=positions + 1))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "false")  # vLLM reads only 1 or true as set
    with pytest.raises(ConfigError, match="refuses a longer max_model_len"):
        check_models(_vllm(model, rollout__engine__vllm__max_model_len=positions + 1))


def test_prompts_are_measured_against_a_partitions_own_engine_limit(tiny_model):
    """The run's engine has no limit here; the one partition's engine leaves 3 tokens for a prompt."""
    parts = [{"name": "pool", "role": "rollout", "scheduler": "local",
              "rollout": {"engine": {"vllm": {"max_model_len": 33}}}}] + PARTS
    cfg = _vllm(tiny_model, partitions=parts, workload__sampling__max_new_tokens=30)
    wl = make_workload(cfg.workload.name, cfg.workload.params, cfg.workload.seed)
    with pytest.raises(ValueError, match=r"partitions\[pool\].rollout.engine.vllm.max_model_len 33 less "
                                         r"workload.sampling.max_new_tokens 30.*no train prompt fits; .*raise "
                                         r"partitions\[pool\].rollout.engine.vllm.max_model_len"):
        prompts_that_do_not_fit(cfg, wl)
    # an hf engine beside it leaves the model's positions to its own requests: the tighter limit counts
    parts.append({"name": "hf", "role": "rollout", "scheduler": "local", "rollout": {"engine": {"type": "hf"}}})
    cfg = _vllm(tiny_model, partitions=parts, workload__sampling__max_new_tokens=30)
    with pytest.raises(ValueError, match=r"max_model_len 33 less"):
        prompts_that_do_not_fit(cfg, wl)
    assert prompts_that_do_not_fit(_vllm(tiny_model, workload__sampling__max_new_tokens=30), wl) == []


def test_a_partition_added_mid_run_is_held_to_the_configs_checks(tiny_model):
    cfg = _vllm(tiny_model, workload__sampling__max_new_tokens=48)
    short = Partition(name="short", role="rollout", scheduler="local", nodes=1,
                      rollout={"engine": {"vllm": {"max_model_len": 40}}})
    with pytest.raises(ValueError, match=r"partitions\[short\].rollout.engine.vllm.max_model_len 40: a request is "
                                         r"its prompt plus workload.sampling.max_new_tokens 48"):
        cfg.check_added(short, cfg.episode_tokens())
    cfg.check_added(Partition(name="ok", role="rollout", scheduler="local", nodes=1,
                              rollout={"engine": {"vllm": {"max_model_len": 64}}}), None)


def _run_of(cfg):
    """What `Orchestrator._check_partition` reads of a run."""
    return SimpleNamespace(cfg=cfg, _episode_tokens=cfg.episode_tokens(), _limits=model_limits(cfg))


def test_the_run_refuses_a_vllm_partition_where_vllm_is_not_installed(tiny_model):
    """``partitions add`` from another environment may pass; the run's own workers would fail at
    every start, so the orchestrator refuses it with the install command."""
    pytest.importorskip("astraflow.rollout.vllm_setup")
    from astraflow.rollout.vllm_setup import vllm_available

    if vllm_available():
        pytest.skip("vLLM is installed here: nothing to refuse")
    run = _run_of(tiny_config(tiny_model))
    part = Partition(name="gpu", role="rollout", scheduler="local", nodes=1, rollout={"engine": {"type": "vllm"}})
    with pytest.raises(ValueError, match=r"partitions\[gpu\].rollout.engine.type: vllm needs vLLM.*pip install"):
        Orchestrator._check_partition(run, part)
    Orchestrator._check_partition(run, Partition(name="cpu", role="rollout", scheduler="local", nodes=1))


def test_an_added_vllm_partition_past_the_models_positions_is_refused(tiny_model, monkeypatch):
    """The run judges an added partition's ``max_model_len`` against its models as the config's."""
    import astraflow.rollout.vllm_setup as vllm_setup

    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.setattr(vllm_setup, "vllm_available", lambda: True)  # the install is judged apart
    positions = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    run = _run_of(tiny_config(tiny_model))
    big = Partition(name="gpu", role="rollout", scheduler="local", nodes=1,
                    rollout={"engine": {"type": "vllm", "vllm": {"max_model_len": 100 * positions}}})
    with pytest.raises(ConfigError, match=rf"partitions\[gpu\].rollout.engine.vllm.max_model_len {100 * positions}: "
                                          rf"the model of policy solver .* has {positions} positions"):
        Orchestrator._check_partition(run, big)
    Orchestrator._check_partition(run, Partition(name="fits", role="rollout", scheduler="local", nodes=1, rollout={
        "engine": {"type": "vllm", "vllm": {"max_model_len": positions}}}))


def test_vllm_nodes_get_minutes_to_start_unless_the_config_says_otherwise(tiny_model):
    """A real model's vLLM start (load, profile, compile) outlasts the HF engine's deadline."""
    from astraflow.sections import VLLM_PLACEMENT_TIMEOUT_S

    assert tiny_config(tiny_model).cluster.placement_timeout_s == 120.0
    assert _vllm(tiny_model).cluster.placement_timeout_s == VLLM_PLACEMENT_TIMEOUT_S
    assert _vllm(tiny_model, cluster__placement_timeout_s=90).cluster.placement_timeout_s == 90
    parts = [{"name": "gpu", "role": "rollout", "scheduler": "local", "rollout": {"engine": {"type": "vllm"}}}] + PARTS
    assert tiny_config(tiny_model, partitions=parts).cluster.placement_timeout_s == VLLM_PLACEMENT_TIMEOUT_S
