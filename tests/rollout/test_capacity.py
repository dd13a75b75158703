"""A node's lease capacity follows its partition's hardware: unset, a sim node leases twice its
engines' useful batch (the knee ``peak / single`` of its hardware preset, at most ``max_batch``),
so faster hardware leases more at once; an explicit ``capacity`` (the run's or a partition's)
wins; a real engine keeps the default. ``astraflow check`` prints each rollout partition's."""

from __future__ import annotations

from click.testing import CliRunner
import yaml

from astraflow.cli import main
from astraflow.partition_settings import effective_rollout, partition_capacity
from astraflow.rollout.config import RolloutConfig
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.rollout.sim_config import PRESETS
from schedulers import Partition


def _sim(hardware: str, **over) -> RolloutConfig:
    return RolloutConfig(engine={"type": "sim", "sim": {"hardware": hardware}}, **over)


def test_sim_capacity_is_twice_the_knee_per_engine():
    h100 = PRESETS["h100"]
    knee = round(h100.peak_tokens_per_s / h100.single_tokens_per_s)
    assert _sim("h100").node_capacity(0) == 2 * knee
    assert _sim("h100").node_capacity(4) == 4 * 2 * knee  # one engine per GPU
    two = RolloutConfig(engine={"type": "sim", "replicas": 2})
    assert two.node_capacity(8) == 2 * 2 * 100
    cpu = PRESETS["cpu"]
    assert _sim("cpu").node_capacity(0) == 2 * min(cpu.max_batch, round(cpu.peak_tokens_per_s / cpu.single_tokens_per_s))


def test_faster_hardware_leases_more():
    caps = [_sim(hw).node_capacity(1) for hw in ("h100", "a100", "cpu")]
    assert caps[0] > caps[1] > caps[2] >= 2


def test_max_batch_caps_the_knee():
    cfg = RolloutConfig(engine={"type": "sim", "sim": {"hardware": "h100", "max_batch": 8}})
    assert cfg.node_capacity(1) == 16


def test_explicit_capacity_wins_and_real_engines_take_twice_their_batch():
    assert _sim("h100", capacity=24).node_capacity(8) == 24
    assert RolloutConfig(capacity=256).node_capacity(8) == 256
    # one engine per GPU (hf), one per tensor_parallel GPUs (vllm), the replicas asked for, one on a CPU
    assert RolloutConfig(engine={"max_batch": 16}).node_capacity(0) == 32
    assert RolloutConfig(engine={"max_batch": 16}).node_capacity(4) == 2 * 16 * 4
    vllm = RolloutConfig(engine={"type": "vllm", "max_batch": 128, "tensor_parallel": 2})
    assert vllm.node_capacity(8) == 2 * 128 * 4
    assert RolloutConfig(engine={"max_batch": 16, "replicas": 3}).node_capacity(0) == 2 * 16 * 3
    assert RolloutConfig(engine={"max_batch": 16, "device": "cpu"}).node_capacity(4) == 32


def test_a_partitions_hardware_sets_its_nodes_capacity():
    run = _sim("a100")
    h100 = effective_rollout(run, Partition(name="h100", rollout={"engine": {"sim": {"hardware": "h100"}}}))
    pinned = effective_rollout(run, Partition(name="p", rollout={"capacity": 12}))
    assert h100.node_capacity(1) > run.node_capacity(1)
    assert pinned.node_capacity(1) == 12


def test_a_node_leases_up_to_its_derived_capacity():
    node = RaaSNode(identity=NodeIdentity(name="n"), rollout=_sim("a100"), models={"solver": "sim"}, gpus=2,
                    workload_name="sim", workload_params={}, workload_seed=0, workflow="sim",
                    sampling=_sampling(), store_url="unused", weights_root="unused", data_layer=None)
    assert node.capacity == _sim("a100").node_capacity(2) == 2 * 2 * 67


def _sampling():
    from astraflow.workloads.config import SamplingConfig

    return SamplingConfig()


def test_check_prints_each_partitions_capacity(tmp_path):
    data = yaml.safe_load(open("examples/sim/config.yaml"))
    del data["rollout"]["capacity"]
    data["partitions"] = [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"},
                          {"name": "h100", "role": "rollout", "gpus_per_node": 2},
                          {"name": "a100", "role": "rollout", "rollout": {"engine": {"sim": {"hardware": "a100"}}}},
                          {"name": "fixed", "role": "rollout", "rollout": {"capacity": 40}}]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["check", str(cfg)])
    assert res.exit_code == 0, res.output
    lines = {x.split()[1]: x for x in res.output.splitlines() if x.startswith("partition ")}
    assert "capacity 400 episodes per node (derived from the hardware; sim h100 max_batch 256 x 2 engine(s))" \
        in lines["h100"]
    assert "capacity 134 episodes per node (derived from the hardware; sim a100" in lines["a100"]
    assert "capacity 40 episodes per node (rollout.capacity;" in lines["fixed"]


def test_status_shows_each_rollout_partitions_capacity_and_engine_batch():
    run = RolloutConfig(engine={"type": "sim"})

    def on(hardware: str) -> dict:
        return partition_capacity(run, Partition(name=hardware, gpus_per_node=4,
                                                 rollout={"engine": {"sim": {"hardware": hardware}}}))

    h100, a100 = on("h100"), on("a100")
    assert h100["engines_per_node"] == a100["engines_per_node"] == 4
    assert h100["node_capacity"] > a100["node_capacity"]  # faster hardware leases more at once
    assert h100["engine_max_batch"] == PRESETS["h100"].max_batch
    pinned = partition_capacity(RolloutConfig(),
                                Partition(name="p", rollout={"capacity": 12, "engine": {"max_batch": 48}}))
    assert pinned == {"node_capacity": 12, "engine_max_batch": 48, "engines_per_node": 1}
    assert partition_capacity(run, Partition(name="t", role="trainer")) is None
