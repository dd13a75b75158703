"""Per-partition settings (``partitions[].rollout`` / ``partitions[].trainer``): merged over the
run's sections for the workers of the partition, validated like them, an unknown key named
with the keys allowed there; ``astraflow check`` exits 2 on a bad one and prints what each
partition runs with (``astraflow partitions add`` with settings: tests/e2e/test_partitions_cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.partition_settings import check_partition, effective_rollout, effective_trainer
from astraflow.rollout.config import RolloutConfig
from astraflow.training.config import TrainerConfig
from schedulers import Partition
from tests.e2e.test_cli import _write_config

ROOT = Path(__file__).resolve().parents[1]
RUN = RolloutConfig(capacity=32, engine={"max_batch": 16, "threads": 4})


def test_rollout_settings_merge_over_the_runs_nested():
    part = Partition(name="h100", gpus_per_node=4, rollout={"capacity": 256, "engine": {"max_batch": 128}})
    got = effective_rollout(RUN, part)
    assert (got.capacity, got.engine.max_batch, got.engine.threads) == (256, 128, 4)  # threads: the run's
    assert effective_rollout(RUN, Partition(name="cpu")) is RUN


def test_trainer_settings_merge_over_each_policys():
    part = Partition(name="a100", role="trainer", trainer={"micro_batch": 8})
    got = effective_trainer(TrainerConfig(lr=1e-4, micro_batch=64), part)
    assert (got.micro_batch, got.lr) == (8, 1e-4)


@pytest.mark.parametrize("part, needle", [
    (Partition(name="h100", rollout={"engine": {"maxbatch": 8}}),
     "partitions[h100].rollout.engine.maxbatch: unknown key; a partition may set type, sim, max_batch,"),
    (Partition(name="h100", rollout={"capasity": 8}), "partitions[h100].rollout.capasity: unknown key"),
    (Partition(name="h100", rollout={"engine": {"max_batch": 0}}),
     "partitions[h100].rollout.engine.max_batch: Input should be greater than or equal to 1"),
    (Partition(name="h100", rollout={"engine": 3}), "partitions[h100].rollout.engine: Input should be"),
    (Partition(name="t", role="trainer", trainer={"lr": 0.1}),
     "partitions[t].trainer.lr: unknown key; a partition may set micro_batch, threads, device"),
    (Partition(name="t", role="trainer", rollout={"capacity": 8}),
     "partitions[t].rollout: settings for rollout workers on a partition of role 'trainer'"),
    (Partition(name="h100", rollout={"engine": {"tensor_parallel": 2}}),
     "the hf engine runs each engine on one device"),
])
def test_bad_settings_name_the_field_and_the_fix(part, needle):
    with pytest.raises(ValueError) as err:
        check_partition(part, RUN, {"solver": TrainerConfig()})
    assert needle in str(err.value)


def _config(tmp_path, tiny_model, partitions):
    cfg = _write_config(tmp_path, tiny_model)
    data = yaml.safe_load(cfg.read_text())
    data["partitions"] = partitions
    cfg.write_text(yaml.safe_dump(data))
    return cfg


PARTS = [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer", "trainer": {"micro_batch": 8}},
         {"name": "cpu", "role": "rollout", "rollout": {"engine": {"replicas": 2, "threads": 4}}},
         {"name": "h100", "role": "rollout", "scheduler": "slurm", "gpus_per_node": 4,
          "rollout": {"capacity": 256, "engine": {"max_batch": 128}}}]


def test_check_prints_what_each_partition_runs_with(tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "astraflow", "check", str(_config(tmp_path, tiny_model, PARTS))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["partitions"][3]["rollout"] == PARTS[3]["rollout"]  # the config as given
    lines = proc.stderr.splitlines()
    assert "partition trainer (trainer, 1 node(s), 0 GPU(s) each); trainer.micro_batch=8" in lines
    assert ("partition cpu (rollout, 1 node(s), 0 GPU(s) each): 2 engine(s) per policy, on auto, 2 thread(s) each; "
            "rollout.engine.threads=4, rollout.engine.replicas=2; capacity 16 episodes per node (rollout.capacity; engine "
            "max_batch 64 x 2 engine(s))") in lines
    h100 = next(x for x in lines if x.startswith("partition h100"))
    assert "4 engine(s) per policy, 1 GPU(s) each" in h100 and "rollout.capacity=256" in h100
    assert "rollout.engine.max_batch=128" in h100
    assert "capacity 256 episodes per node (rollout.capacity; engine max_batch 128 x 4 engine(s))" in h100


def test_check_exits_2_on_an_unknown_partition_setting(tiny_model, tmp_path):
    bad = [*PARTS[:3], {**PARTS[3], "rollout": {"engine": {"max_batchh": 128}}}]
    res = CliRunner().invoke(main, ["check", str(_config(tmp_path, tiny_model, bad))])
    assert res.exit_code == 2, res.output
    assert "partitions[h100].rollout.engine.max_batchh: unknown key; a partition may set" in res.output
    assert "Traceback" not in res.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_a_partitions_own_gpu_is_judged_by_where_that_partition_runs(tiny_model, tmp_path):
    from astraflow.config import ConfigError, load_config
    from astraflow.preflight import check_devices

    cfg = load_config(_config(tmp_path, tiny_model, PARTS), ["partitions.cpu.rollout.engine.device=cuda:3"])
    with pytest.raises(ConfigError, match=r"partitions\[cpu\].rollout.engine.device: 'cuda:3' asked for"):
        check_devices(cfg)
    check_devices(load_config(_config(tmp_path, tiny_model, PARTS), ["partitions.h100.rollout.engine.device=cuda:3"]))
    # the run's device reaches the local partition even with a Slurm rollout partition beside it
    with pytest.raises(ConfigError, match=r"rollout.engine.device: 'cuda' asked for"):
        check_devices(load_config(_config(tmp_path, tiny_model, PARTS), ["rollout.engine.device=cuda"]))
    # a local partition that sets its own device back to the CPU is fine
    check_devices(load_config(_config(tmp_path, tiny_model, PARTS), [
        "rollout.engine.device=cuda", "partitions.cpu.rollout.engine.device=cpu"]))
    check_devices(load_config(_config(tmp_path, tiny_model, PARTS), [
        "policies.solver.trainer.device=cuda", "partitions.trainer.trainer={micro_batch: 8, device: cpu}"]))


def test_placement_gives_a_partitions_workers_its_settings(tmp_path):
    """A RaaS node of a partition gets the run's rollout section with the partition's settings
    over it and the partition's GPUs (one engine each); a trainer its partition's micro-batch."""
    from types import SimpleNamespace

    from astraflow.runtime.placement import node_kwargs, trainer_kwargs
    from storage.paths import RunPaths
    from tests.integration.test_orchestrator_parts import tiny_config

    cfg = tiny_config(tmp_path, **{"rollout.capacity": 24})
    part = Partition(name="h100", hardware="H100", gpus_per_node=4, rollout={"engine": {"max_batch": 128}})
    kw = node_kwargs(cfg, RunPaths(tmp_path / "run"), "rollout-h100-local-H100-0", part, SimpleNamespace())
    assert kw["rollout"].engine.max_batch == 128 and kw["rollout"].capacity == 24 and kw["gpus"] == 4
    assert kw["rollout"].engine.threads == cfg.rollout.engine.threads
    assert isinstance(kw["rollout"], RolloutConfig)
    a100 = Partition(name="a100", role="trainer", trainer={"micro_batch": 4})
    kw = trainer_kwargs(cfg, RunPaths(tmp_path / "run"), 0, cfg.policies[0], SimpleNamespace(), a100)
    assert kw["cfg"].micro_batch == 4 and kw["cfg"].lr == cfg.policies[0].trainer.lr


def test_check_counts_sim_engines_as_the_nodes_build_them():
    """``check``'s partition line and the capacity line agree on a sim partition's engines."""
    from astraflow.cli import main
    from click.testing import CliRunner

    res = CliRunner().invoke(main, ["check", str(ROOT / "examples" / "sim" / "config.yaml"), "--set",
                                    "partitions.rollout.gpus_per_node=8", "--set", "rollout.engine.device=cpu"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("partition rollout"))
    assert "8 engine(s) per policy" in line and "x 8 engine(s)" in line, line


@pytest.mark.parametrize("part, run, trainers", [
    (Partition(name="gpu", scheduler="slurm", rollout={"engine": {"device": "cuda"}}), RUN, {}),
    (Partition(name="gpu", scheduler="slurm"), RolloutConfig(engine={"device": "cuda:0"}), {}),
    (Partition(name="gpu", scheduler="slurm", role="trainer"), RUN, {"solver": TrainerConfig(device="cuda")}),
])
def test_a_slurm_partition_asked_for_cuda_without_gpus_is_refused(part, run, trainers):
    with pytest.raises(ValueError, match=r"partitions\[gpu\]: .*needs a GPU.*set gpus_per_node"):
        check_partition(part, run, trainers)


def test_cuda_with_gpus_and_auto_without_are_accepted():
    check_partition(Partition(name="gpu", scheduler="slurm", gpus_per_node=1),
                    RolloutConfig(engine={"device": "cuda"}), {})
    check_partition(Partition(name="cpu", scheduler="slurm"), RUN, {"solver": TrainerConfig()})
    check_partition(Partition(name="here", rollout={"engine": {"device": "cuda"}}), RUN, {})  # local: the host's GPUs


def test_a_partition_whose_engine_is_sim_only_in_a_sim_run():
    """``astraflow partitions add`` checks without the trainers: the run's engine type stands for them."""
    sim = RolloutConfig(engine={"type": "sim"})
    with pytest.raises(ValueError, match=r"partitions\[h100\].rollout.engine.type 'hf': the run's "
                                         r"rollout.engine.type is 'sim' .* set partitions\[h100\].rollout.engine.type"):
        check_partition(Partition(name="h100", rollout={"engine": {"type": "hf"}}), sim, {})
    with pytest.raises(ValueError, match=r"partitions\[h100\].rollout.engine.type: sim engines generate no tokens"):
        check_partition(Partition(name="h100", rollout={"engine": {"type": "sim"}}), RUN, {"solver": TrainerConfig()})
    check_partition(Partition(name="h100", rollout={"engine": {"type": "vllm"}}), RUN, {"solver": TrainerConfig()})
    check_partition(Partition(name="h100"), sim, {"solver": TrainerConfig(backend="sim")})


@pytest.mark.parametrize("label, own, expected", [
    ("A100", {}, "a100"),  # the label names a preset: its timing
    ("h100", {}, "h100"),
    ("cpu", {}, "h100"),  # the default label keeps the run's preset
    ("H200", {}, "h100"),  # a label without a preset too
    ("a100", {"engine": {"sim": {"hardware": "cpu"}}}, "cpu"),  # the partition's own setting wins
])
def test_a_sim_partitions_hardware_label_picks_its_preset(label, own, expected):
    base = RolloutConfig.model_validate({"engine": {"type": "sim", "sim": {"hardware": "h100"}}})
    part = Partition(name="p", scheduler="local", role="rollout", hardware=label, rollout=own)
    got = effective_rollout(base, part)
    assert got.engine.sim.hardware == expected
    assert got.node_capacity(0) == effective_rollout(base.model_copy(update={"engine": base.engine.model_copy(
        update={"sim": base.engine.sim.model_copy(update={"hardware": expected})})}), None).node_capacity(0)
    # a real engine's settings do not follow the label
    hf = RolloutConfig()
    assert effective_rollout(hf, part.model_copy(update={"rollout": {}})) is hf


def test_lease_ahead_is_refused_where_a_worker_runs_one_node():
    """``rollout.lease_ahead`` stocks tasks for the nodes of a worker that runs several; a worker
    of one node is a plain RaaS node that leases from the data layer itself, so there the
    setting would do nothing: refused, naming where it comes from and the fix."""
    sim = {"type": "sim"}
    trainers = {"solver": TrainerConfig(backend="sim")}
    with pytest.raises(ValueError, match=r"^rollout\.lease_ahead 8: .* partition 'r' runs one node per worker"):
        check_partition(Partition(name="r"), RolloutConfig(engine=sim, lease_ahead=8), trainers)
    with pytest.raises(ValueError, match=r"^partitions\[r\]\.rollout\.lease_ahead 4: .*drop lease_ahead"):
        check_partition(Partition(name="r", rollout={"lease_ahead": 4}), RolloutConfig(engine=sim), trainers)
    # several nodes per worker, the run's or the partition's own: the stock serves them
    check_partition(Partition(name="r"), RolloutConfig(engine=sim, lease_ahead=8, nodes_per_worker=3), trainers)
    check_partition(Partition(name="r", rollout={"nodes_per_worker": 3}), RolloutConfig(engine=sim, lease_ahead=8),
                    trainers)
    check_partition(Partition(name="r", rollout={"lease_ahead": 0}), RolloutConfig(engine=sim, lease_ahead=8),
                    trainers)


def test_deltas_that_no_node_would_apply_are_refused():
    """``storage.deltas`` with every rollout partition loading full shards at every version
    (``full_resync_every: 1``): the trainers would write a delta per version that no node applies."""
    from astraflow.config import config_from_dict
    from astraflow.configerrors import ConfigError
    from astraflow.partition_settings import check_deltas

    every_version = RolloutConfig(full_resync_every=1)
    parts = [Partition(name="data", role="data"), Partition(name="a"), Partition(name="b")]
    with pytest.raises(ValueError, match=r"^storage\.deltas: true .* rollout\.full_resync_every 1 .*set "
                                         r"full_resync_every to 2 or more \(default 10\), or storage\.deltas: false"):
        check_deltas(True, every_version, parts)
    check_deltas(False, every_version, parts)
    check_deltas(True, every_version, [*parts[:2], Partition(name="b", rollout={"full_resync_every": 5})])
    check_deltas(True, RolloutConfig(), parts)
    data = {"policies": [{"name": "solver", "model": "sim", "trainer": {"backend": "sim"}}],
            "workload": {"name": "sim", "workflow": "sim", "group_size": 4, "eval": {"every": 0}},
            "dataflow": {"batch_size": 8}, "rollout": {"engine": {"type": "sim"}, "full_resync_every": 1},
            "storage": {"deltas": True}}
    with pytest.raises(ConfigError, match="none would ever apply one"):
        config_from_dict(data)
