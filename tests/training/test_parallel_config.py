"""``trainer.data_parallel``: checked by the trainer's config (torch and sim backends: 1 only) and
against the run (every batch splits over the replicas; a GPU trainer partition gives every rank a
GPU; a multi-node one, ``nodes_per_worker x gpus_per_node`` ranks exactly, reported by ``astraflow
check``), as ``astraflow check`` checks the Megatron backend against the machine (installed) and the
model ``init`` will build (``tensor_parallel`` shards it). No model is built: the policy's model is
left to its ``init`` section."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from astraflow.config import ConfigError, _set_path, config_from_dict
from astraflow.training.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _config(**overrides):
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = "/nonexistent/model"  # built by its init section
    data["policies"][0]["trainer"] = {"backend": "megatron"}
    for key, value in overrides.items():
        _set_path(data, key, value)
    return config_from_dict(data)


def test_data_parallel_needs_the_megatron_backend():
    assert TrainerConfig().data_parallel == 1
    assert TrainerConfig(backend="megatron", data_parallel=2, tensor_parallel=2).data_parallel == 2
    with pytest.raises(ValidationError, match="data_parallel 2 needs trainer.backend: megatron"):
        TrainerConfig(data_parallel=2)
    with pytest.raises(ValidationError, match="data_parallel"):
        TrainerConfig(backend="megatron", data_parallel=0)


def test_every_batch_must_reach_every_replica():
    assert _config(**{"policies.0.trainer.data_parallel": 16}).policies[0].trainer.data_parallel == 16
    with pytest.raises(ConfigError, match=r"data_parallel 32 splits every batch.*dataflow.batch_size is 16: "
                                          r"raise dataflow.batch_size to at least 32"):
        _config(**{"policies.0.trainer.data_parallel": 32})


def test_a_gpu_trainer_partition_needs_a_gpu_per_rank():
    parts = [{"name": "data", "role": "data"}, {"name": "rollout", "role": "rollout"},
             {"name": "gpu", "role": "trainer", "gpus_per_node": 2}]
    ok = _config(partitions=parts, **{"policies.0.trainer.tensor_parallel": 2})
    assert ok.policies[0].trainer.tensor_parallel == 2
    with pytest.raises(ConfigError, match=r"tensor_parallel 2 x data_parallel 2 = 4 ranks, one GPU each, and "
                                          r"partition 'gpu' gives a trainer 2 GPU\(s\) per node: .* or span 2 nodes "
                                          r"with nodes_per_worker: 2"):
        _config(partitions=parts, **{"policies.0.trainer.tensor_parallel": 2, "policies.0.trainer.data_parallel": 2})
    cpu = [dict(p, gpus_per_node=0) for p in parts]  # CPU trainers run any number of gloo ranks
    assert _config(partitions=cpu, **{"policies.0.trainer.data_parallel": 4}).policies[0].trainer.data_parallel == 4


MULTI = [{"name": "data", "role": "data"}, {"name": "rollout", "role": "rollout"},
         {"name": "big", "role": "trainer", "scheduler": "slurm", "nodes_per_worker": 2, "gpus_per_node": 4}]


def test_a_multi_node_trainer_partition_needs_exactly_one_rank_per_gpu():
    """World size = nodes_per_worker x gpus_per_node; TP x DP must equal it (not only fit in it)."""
    ok = _config(partitions=MULTI, **{"policies.0.trainer.tensor_parallel": 2, "policies.0.trainer.data_parallel": 4})
    assert ok.partitions[2].ranks_per_worker == 8
    with pytest.raises(ConfigError, match=r"tensor_parallel 2 x data_parallel 2 = 4 ranks, but trainer partition 'big' "
                                          r"spans nodes_per_worker 2 x gpus_per_node 4 = 8 ranks .*set "
                                          r"policies\[solver\].trainer.data_parallel: 4, or change the partition"):
        _config(partitions=MULTI, **{"policies.0.trainer.tensor_parallel": 2, "policies.0.trainer.data_parallel": 2})
    with pytest.raises(ConfigError, match=r"3 x data_parallel 1 = 3 ranks.*choose tensor_parallel x data_parallel = 8"):
        _config(partitions=MULTI, **{"policies.0.trainer.tensor_parallel": 3})
    cpu = [dict(p, gpus_per_node=0) if p["name"] == "big" else p for p in MULTI]  # one gloo rank per node
    assert _config(partitions=cpu, **{"policies.0.trainer.data_parallel": 2}).policies[0].trainer.data_parallel == 2
    torch_trainer = {"policies.0.trainer.backend": "torch"}
    with pytest.raises(ConfigError, match=r"the torch backend trains on one node, and trainer partition\(s\) \['big'\]"):
        _config(partitions=MULTI, **torch_trainer)


def test_only_a_slurm_trainer_partition_spans_nodes():
    from schedulers import Partition

    with pytest.raises(ValidationError, match="nodes_per_worker 2 spans Slurm nodes .* this one is a slurm rollout"):
        Partition(name="r", role="rollout", scheduler="slurm", nodes_per_worker=2)
    with pytest.raises(ValidationError, match="this one is a local trainer partition"):
        Partition(name="t", role="trainer", nodes_per_worker=2)
    with pytest.raises(ValidationError, match="rendered from the partition: set gpus_per_node"):
        Partition(name="t", role="trainer", scheduler="slurm", sbatch_options=("--ntasks-per-node=2",))


def test_check_reports_the_mismatch_and_exits_2(tmp_path):
    from click.testing import CliRunner

    from astraflow.cli import main

    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "model")  # built by its init section
    data["policies"][0]["trainer"] = {"backend": "megatron", "tensor_parallel": 2, "data_parallel": 2}
    data["partitions"] = MULTI
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["check", str(tmp_path / "c.yaml")])
    assert res.exit_code == 2, res.output
    assert "= 4 ranks, but trainer partition 'big' spans nodes_per_worker 2 x gpus_per_node 4 = 8" in res.output
    assert "Traceback" not in res.output


def test_the_sim_backend_refuses_parallel_sizes_too():
    """Only the Megatron backend has ranks: the sim one would accept the sizes and ignore them."""
    with pytest.raises(ValidationError, match=r"trainer.tensor_parallel 2 needs trainer.backend: megatron \(the "
                                              r"sim backend trains no model\); set tensor_parallel: 1 or backend: "
                                              r"megatron"):
        TrainerConfig(backend="sim", tensor_parallel=2)
    with pytest.raises(ValidationError, match=r"trainer.data_parallel 4 needs trainer.backend: megatron \(the sim "
                                              r"backend trains no model\); set data_parallel: 1 or backend: megatron"):
        TrainerConfig(backend="sim", data_parallel=4)
    with pytest.raises(ValidationError, match=r"\(the torch backend trains on one device\); set tensor_parallel: 1"):
        TrainerConfig(tensor_parallel=2)
    assert TrainerConfig(backend="sim").tensor_parallel == 1


def test_check_refuses_a_tensor_parallel_that_cannot_shard_the_model_init_builds(tmp_path):
    """The preset's model (tiny: 4 heads, 2 KV heads) does not exist yet: its planned shape is
    checked as an existing model's would be, before the run builds anything."""
    from astraflow.preflight import check_models

    model = {"policies.0.model": str(tmp_path / "model")}
    check_models(_config(**model, **{"policies.0.trainer.tensor_parallel": 2}))
    with pytest.raises(ConfigError, match=r"^policies\[solver\].trainer.tensor_parallel: .*model \(to be built by "
                                          r"init\): tensor-parallel size 4 must divide num_attention_heads=4 and "
                                          r"num_key_value_heads=2: choose a TP size that divides both"):
        check_models(_config(**model, **{"policies.0.trainer.tensor_parallel": 4}))
    assert not (tmp_path / "model").exists()


def test_check_refuses_the_megatron_backend_without_megatron_core(monkeypatch):
    """``astraflow check`` / ``run`` exit 2 with the install command (as for a missing vLLM),
    not a failure once the run has started. The import is made unavailable for megatron only."""
    import importlib.util

    from astraflow.preflight import check_engine

    check_engine(_config())  # installed here
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "megatron" or name.startswith("megatron."):
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"^policies\[solver\].trainer.backend: megatron needs megatron-core, which "
                                          r"is not installed here; install it with pip install -e '.\[megatron\]'"):
        check_engine(_config())
    check_engine(_config(**{"policies.0.trainer.backend": "torch"}))  # a torch trainer does not need it
