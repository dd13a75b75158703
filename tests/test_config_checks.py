"""Config checks that must refuse a bad value with exit 2 and a message naming the field and the
fix (never a traceback), and accept what is valid: a partition's own engine settings, a
``workload.workflow`` that is not a workflow class, a null model, non-finite sim step times."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from tests.test_cli_errors import _config, _invoke

ROOT = Path(__file__).resolve().parents[1]

SIM = {
    "run": {"name": "tp", "max_steps": 2},
    "policies": [{"name": "solver", "model": "sim", "trainer": {"backend": "sim", "sim_step_seconds": 0.3}}],
    "workload": {"name": "sim", "workflow": "sim", "params": {"num_train": 200, "num_test": 8, "prompt_tokens": 64},
                 "group_size": 4},
    "dataflow": {"batch_size": 16},
    "rollout": {"engine": {"type": "sim", "tensor_parallel": 2}},
}


def _sim_config(tmp_path, small: dict) -> str:
    """A sim run whose rollout partitions are ``big`` (8 GPUs) and ``small``."""
    parts = [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"},
             {"name": "big", "role": "rollout", "gpus_per_node": 8},
             {"name": "small", "role": "rollout", "gpus_per_node": 1, **small}]
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump({**SIM, "partitions": parts}, sort_keys=False))
    return str(path)


def test_a_partitions_own_tensor_parallel_is_the_one_checked(tmp_path):
    res = _invoke("check", _sim_config(tmp_path, {"rollout": {"engine": {"tensor_parallel": 1}}}))
    assert res.exit_code == 0, res.output
    assert "partition small (rollout, 1 node(s), 1 GPU(s) each)" in res.output


@pytest.mark.parametrize("small, field", [
    ({}, "rollout.engine.tensor_parallel 2"),
    ({"rollout": {"engine": {"tensor_parallel": 2}}}, "partitions[small].rollout.engine.tensor_parallel 2"),
])
def test_an_engine_wider_than_a_partitions_gpus_names_the_partition(tmp_path, small, field):
    res = _invoke("check", _sim_config(tmp_path, small))
    assert res.exit_code == 2, res.output
    assert f"{field} shards each engine over 2 GPUs, and partition 'small' gives a rollout worker 1" in res.output


def test_a_wide_engine_only_on_the_partition_that_fits_it(tmp_path):
    """The run's engine is 1 GPU wide; ``big`` shards its engines over 4 of its 8."""
    path = _sim_config(tmp_path, {})
    res = _invoke("check", path, "--set", "rollout.engine.tensor_parallel=1",
                  "--set", "partitions.big.rollout={engine: {tensor_parallel: 4}}")
    assert res.exit_code == 0, res.output


NOT_WORKFLOWS = '''
def a_function(workload, sampling, node):
    pass


class NoEpisode:
    num_policies = 1


class SyncEpisode:
    num_policies = 1

    def __init__(self, workload, sampling, node):
        pass

    def run_episode(self, engines, task):
        pass


class NoPolicies:
    num_policies = 0

    async def run_episode(self, engines, task):
        pass


class NoKeywords:
    num_policies = 1

    async def run_episode(self, engines, task):
        pass
'''


@pytest.mark.parametrize("name, why", [
    ("os:path", "is a module, not a class"),
    ("not_workflows_test:a_function", "is a function, not a class"),
    ("not_workflows_test:NoEpisode", "has no async run_episode(engines, task)"),
    ("not_workflows_test:SyncEpisode", "has no async run_episode(engines, task)"),
    ("not_workflows_test:NoPolicies", "has num_policies 0, not the number of policies it drives (1 or more)"),
    ("not_workflows_test:NoKeywords", "cannot be built with workload=, sampling= and node= keywords"),
])
def test_a_workflow_that_is_not_a_workflow_class_is_refused(tmp_path, monkeypatch, name, why):
    (tmp_path / "not_workflows_test.py").write_text(NOT_WORKFLOWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = _invoke("check", str(_config(tmp_path)), "--set", f"workload.workflow={name}")
    assert res.exit_code == 2, res.output
    assert f"workload.workflow: {name!r} {why}; name a workflow class" in res.output


def test_a_users_workflow_class_is_accepted(tmp_path):
    flows = "examples.custom_workflow.flows:two_tries"
    res = _invoke("check", str(_config(tmp_path)), "--set", f"workload.workflow={flows}")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("value", ["null", ""])
def test_a_null_or_empty_model_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    res = _invoke("check", str(_config(tmp_path)), "--set", f"policies.solver.model={value}")
    assert res.exit_code == 2, res.output
    assert "policies[solver].model: empty; give the path of an HF model directory" in res.output
    assert "None" not in res.output


def test_a_sim_policys_model_is_a_name_even_where_a_directory_of_that_name_exists(monkeypatch):
    monkeypatch.chdir(ROOT / "examples")  # examples/sim is a directory, not a model
    res = _invoke("check", "sim/config.yaml")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("key, value, needle", [
    ("sim_step_seconds", ".inf", "policies[solver].trainer.sim_step_seconds: Input should be a finite number, got inf"),
    ("sim_seconds_per_token", ".inf", "policies[solver].trainer.sim_seconds_per_token: Input should be a finite number"),
    ("sim_step_seconds", ".nan", "policies[solver].trainer.sim_step_seconds: nan is not a number; use a finite one"),
    ("sim_step_schedule", "{2: .inf}", "policies[solver].trainer.sim_step_schedule.2: Input should be a finite number"),
    # any number of any section: an infinite timeout would reach Dask or a sleep
    ("batch_timeout_s", ".inf", "policies[solver].trainer.batch_timeout_s: Input should be a finite number"),
])
def test_a_non_finite_sim_step_time_is_refused(tmp_path, key, value, needle):
    res = _invoke("check", str(_config(tmp_path)), "--set", f"policies.solver.trainer.{key}={value}")
    assert res.exit_code == 2, res.output
    assert needle in res.output


def test_a_reward_deadline_shorter_than_the_sandbox_limit_is_refused():
    from astraflow.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="reward_timeout_s 5 leaves no room.*at least 12"):
        config_from_dict({"workload": {"name": "code"}, "rollout": {"reward_timeout_s": 5},
                          "policies": [{"name": "solver", "model": "unused"}]})


def test_a_reward_deadline_shorter_than_a_mixed_code_sources_limit_is_refused():
    from astraflow.config import ConfigError, config_from_dict

    sources = {"code": {"workload": "code", "params": {"timeout_s": 20}}, "math": {"workload": "math"}}
    with pytest.raises(ConfigError, match="reward_timeout_s 15 leaves no room.*20 s sandbox limit"):
        config_from_dict({"workload": {"name": "mix", "params": {"sources": sources}},
                          "rollout": {"reward_timeout_s": 15}, "policies": [{"name": "solver", "model": "unused"}]})


def test_a_model_path_under_home_is_expanded(tmp_path):
    from pathlib import Path

    from astraflow.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=f"policies\\[solver\\].model: {Path.home()}/no-such-model does not exist"):
        config_from_dict({"policies": [{"name": "solver", "model": "~/no-such-model"}]}, base_dir=tmp_path)


@pytest.mark.parametrize("init, needle", [
    ({"warm_start_target": 0.5}, "warm_start_target stops a warm start early, and there is none"),
    ({"vocab_size": 512}, "vocab_size sizes a BPE tokenizer; with tokenizer: byte it is fixed"),
])
def test_model_init_settings_that_would_change_nothing_are_refused(init, needle):
    from astraflow.training.config import ModelInit

    with pytest.raises(ValueError, match=needle):
        ModelInit(**init)


def test_micro_batch_is_refused_for_the_megatron_backend():
    from astraflow.training.config import TrainerConfig

    with pytest.raises(ValueError, match="trainer.micro_batch 16: the megatron backend trains each data-parallel"):
        TrainerConfig(backend="megatron", micro_batch=16)
    TrainerConfig(backend="megatron")  # the default is not a choice


def test_an_in_process_trajectory_store_is_refused_for_a_run(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "storage.trajectories=memory://x")
    assert res.exit_code == 2, res.output
    assert "memory://x is a store inside one process" in res.output
    assert "point storage.trajectories at a directory" in res.output


def test_a_module_attribute_that_is_not_a_workload_is_a_config_error(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "workload.name=tests.dataflow.user_rules:EveryNth")
    assert res.exit_code == 2, res.output
    assert "workload tests.dataflow.user_rules:EveryNth is not a workload class" in res.output


def test_a_check_across_fields_is_said_without_a_location_prefix(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "policies=[]")
    assert res.exit_code == 2 and "policies: name at least one policy" in res.output
    assert "(top level)" not in res.output


def _sim(**sections) -> dict:
    """The SIM run (no model anywhere) with one-GPU-wide sim engines; ``sections`` replace whole sections."""
    return {**copy.deepcopy(SIM), "rollout": {"engine": {"type": "sim"}}, **sections}


def test_policy_names_are_bounded_as_run_names_are():
    from astraflow.config import ConfigError, config_from_dict
    from astraflow.sections import RUN_NAME_MAX

    pol = SIM["policies"][0]
    config_from_dict(_sim(policies=[{**pol, "name": "p" * RUN_NAME_MAX}]))
    with pytest.raises(ConfigError, match=rf"policies.0.name: policy name 'pppp.*\.\.\. \(300 characters\): use "
                                          rf"1-{RUN_NAME_MAX} letters"):
        config_from_dict(_sim(policies=[{**pol, "name": "p" * 300}]))
    with pytest.raises(ConfigError, match=r"policies.0.name: policy name 'solver\\n': use "):
        config_from_dict(_sim(policies=[{**pol, "name": "solver\n"}]))  # a name '$' alone would let through


def test_a_walltime_with_a_trailing_newline_is_refused():
    from schedulers.partition import walltime_seconds

    assert walltime_seconds("01:00:00") == 3600
    with pytest.raises(ValueError, match="is not a Slurm time limit"):
        walltime_seconds("01:00:00\n")


@pytest.mark.parametrize("rollout, trainer, part, needle", [
    ({"type": "sim"}, "torch", {}, "rollout.engine.type: sim engines generate no tokens of a model, and "
                                   "policies[solver].trainer.backend is 'torch'"),
    ({"type": "sim"}, "sim", {"engine": {"type": "hf"}}, "policies[solver].trainer.backend: sim publishes versions "
                                                         "without weights, which only the sim engine can take, and "
                                                         "partitions[rollout].rollout.engine.type is 'hf'"),
    ({"type": "hf"}, "torch", {"engine": {"type": "sim"}}, "partitions[rollout].rollout.engine.type: sim engines "
                                                           "generate no tokens"),
])
def test_engines_and_trainers_are_sim_on_both_sides_or_on_neither(tmp_path, rollout, trainer, part, needle):
    from astraflow.config import ConfigError, config_from_dict

    pol = {"name": "solver", "model": str(tmp_path), "trainer": {"backend": trainer}}  # a directory that exists
    parts = [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"},
             {"name": "rollout", "role": "rollout", "rollout": part}]
    with pytest.raises(ConfigError) as err:
        config_from_dict(_sim(policies=[pol], rollout={"engine": rollout}, partitions=parts))
    assert needle in str(err.value) and "Traceback" not in str(err.value)


@pytest.mark.parametrize("role, nodes, needle", [
    ("data", 0, "partitions: the data layer runs on exactly one worker, and the data partitions have 0 node(s)"),
    ("data", 2, "the data partitions have 2 node(s) in all ('data' (2)): set nodes: 1 on partition 'data'"),
    ("trainer", 0, "partitions: the trainers need one worker at least, and the trainer partitions have 0 node(s)"),
])
def test_the_data_layer_has_one_worker_and_the_trainers_one_at_least(role, nodes, needle):
    from astraflow.config import ConfigError, config_from_dict

    parts = [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"},
             {"name": "rollout", "role": "rollout", "nodes": 0}]  # rollout may start empty
    config_from_dict(_sim(partitions=parts))
    parts[0 if role == "data" else 1]["nodes"] = nodes
    with pytest.raises(ConfigError, match=re.escape(needle)):
        config_from_dict(_sim(partitions=parts))


def test_a_lease_spans_a_few_node_heartbeats():
    from astraflow.config import ConfigError, config_from_dict
    from astraflow.dataflow.config import MIN_LEASE_SECONDS, DataflowConfig
    from astraflow.rollout.node import HEARTBEAT_SECONDS

    assert MIN_LEASE_SECONDS >= 3 * HEARTBEAT_SECONDS
    with pytest.raises(ConfigError, match=r"dataflow.lease_seconds 0.05: RaaS nodes renew their leases by a "
                                          r"heartbeat .* set dataflow.lease_seconds: 5 or more"):
        config_from_dict(_sim(dataflow={"batch_size": 16, "lease_seconds": 0.05}))
    config_from_dict(_sim(dataflow={"batch_size": 16, "lease_seconds": MIN_LEASE_SECONDS}))
    DataflowConfig(lease_seconds=0.05)  # a data layer tested without nodes may lease for less


def test_relative_paths_are_made_absolute_as_model_paths_are(tmp_path):
    from astraflow.config import config_from_dict
    from astraflow.runtime.security import create_run_certificates

    create_run_certificates(tmp_path / "site")
    tls = {"ca_file": "site/ca.pem", "cert_file": "site/run.pem", "key_file": "site/run-key.pem"}
    cfg = config_from_dict(_sim(storage={"trajectories": "traj"}, sandbox={"scratch_root": "~/scratch"},
                                cluster={"tls": tls}), base_dir=tmp_path)
    assert cfg.storage.trajectories == str(tmp_path / "traj")
    assert cfg.sandbox.scratch_root == str(Path.home() / "scratch")
    assert cfg.cluster.tls.key_file == tmp_path / "site" / "run-key.pem"
    url = "file:///shared/traj"  # a URL is kept as written
    assert config_from_dict(_sim(storage={"trajectories": url}), base_dir=tmp_path).storage.trajectories == url


def test_a_module_that_calls_sys_exit_on_import_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import_test.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = _invoke("check", str(_config(tmp_path)), "--set", "workload.workflow=exits_on_import_test:Flow")
    assert res.exit_code == 2, res.output
    assert ("workflow exits_on_import_test:Flow: importing 'exits_on_import_test' called sys.exit(3): guard it "
            "with if __name__ == '__main__'") in res.output
