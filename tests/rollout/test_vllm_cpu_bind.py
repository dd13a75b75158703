"""``rollout.engine.vllm.cpu_bind``: the CPU build's thread placement, as environment for the
engine core vLLM spawns (no vLLM needed: the settings are computed before it is imported)."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from astraflow.rollout.config import EngineConfig
from astraflow.rollout.vllm_setup import cpu_environment


def test_cores_binds_the_threads_to_the_first_cpus_of_the_process():
    first = sorted(os.sched_getaffinity(0))[0]
    env = cpu_environment(1, 2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(first) and "OMP_NUM_THREADS" not in env
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_a_replica_binds_from_its_first_cpu_on_counting_round():
    cpus = sorted(os.sched_getaffinity(0))
    assert cpu_environment(1, 2, first=1)["VLLM_CPU_OMP_THREADS_BIND"] == str(cpus[1 % len(cpus)])
    many = cpu_environment(len(cpus) + 3, 2, first=len(cpus) - 1)["VLLM_CPU_OMP_THREADS_BIND"]
    assert many == ",".join(map(str, cpus))  # more threads than CPUs: each CPU once


def test_each_tensor_parallel_worker_gets_a_cpu_list_of_its_own():
    """vLLM's CPU build takes one ``|``-separated list per rank and refuses to start an engine of
    ``tensor_parallel`` 2 given a single list."""
    cpus = sorted(os.sched_getaffinity(0))
    lists = cpu_environment(1, 2, ranks=2)["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    assert lists == [str(cpus[0]), str(cpus[1 % len(cpus)])]
    later = cpu_environment(1, 2, first=2, ranks=2)["VLLM_CPU_OMP_THREADS_BIND"].split("|")
    assert later == [str(cpus[2 % len(cpus)]), str(cpus[3 % len(cpus)])]
    assert cpu_environment(2, 2, "none")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_replicas_of_a_tensor_parallel_engine_start_past_the_cpus_of_the_one_before(monkeypatch):
    from astraflow.rollout import engines, vllm_engine

    _Recorded.made = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", _Recorded)
    cfg = EngineConfig.model_validate({"type": "vllm", "device": "cpu", "replicas": 2, "threads": 4,
                                       "tensor_parallel": 2})
    engines.make_engines(cfg, {"solver": "/m/a"}, gpus=0)
    # two threads per replica, in each of its two workers: the second replica binds from CPU 4 on
    assert [first for _, _, first in _Recorded.made] == [0, 4]


def test_the_kv_cache_is_whole_gib_and_a_fraction_is_refused_naming_the_field():
    assert EngineConfig.model_validate({"type": "vllm", "vllm": {"cpu_kvcache_gib": 3}}).vllm.cpu_kvcache_gib == 3
    with pytest.raises(ValidationError, match="cpu_kvcache_gib"):
        EngineConfig.model_validate({"type": "vllm", "vllm": {"cpu_kvcache_gib": 0.5}})


def test_none_leaves_the_threads_to_the_operating_system_with_their_number():
    env = cpu_environment(3, 1, "none")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "3"


def test_an_unknown_binding_is_refused_with_the_choices():
    with pytest.raises(ValidationError, match="cores.*none"):
        EngineConfig.model_validate({"type": "vllm", "vllm": {"cpu_bind": "first"}})
    assert EngineConfig.model_validate({"type": "vllm", "vllm": {"cpu_bind": "none"}}).vllm.cpu_bind == "none"


class _Recorded:
    """Stands for ``VLLMEngine``: what a node would start each engine with."""

    made: list = []
    tokenizer = None

    def __init__(self, model_path, *, options, visible_devices, first_cpu, **_):
        self.made.append((options.gpu_memory_utilization, visible_devices, first_cpu))

    def close(self):
        pass


@pytest.mark.parametrize("gpus, replicas, device, expected", [
    # two policies on one GPU: each half of the fraction; on the CPU build, CPUs of their own
    (1, None, "auto", [(0.4, "0", 0), (0.4, "0", 1)]),
    # two policies, two GPUs, one replica each per GPU: two engines per GPU
    (2, None, "auto", [(0.4, "0", 0), (0.4, "1", 1), (0.4, "0", 2), (0.4, "1", 3)]),
    # three replicas on two GPUs: the first GPU holds two of each policy's, the second one
    (2, 3, "auto", [(0.2, "0", 0), (0.4, "1", 1), (0.2, "0", 2), (0.2, "0", 3), (0.4, "1", 4), (0.2, "0", 5)]),
    # an explicit GPU: every engine of the node on it
    (1, None, "cuda:0", [(0.4, "0", 0), (0.4, "0", 1)]),
    # no GPUs planned (a partition without gpus_per_node): both on the worker's default device
    (0, None, "auto", [(0.4, None, 0), (0.4, None, 1)]),
])
def test_engines_sharing_a_gpu_split_its_memory_and_take_cpus_of_their_own(monkeypatch, gpus, replicas, device,
                                                                              expected):
    import torch

    from astraflow.rollout import engines, vllm_engine

    _Recorded.made = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", _Recorded)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus))))
    cfg = EngineConfig.model_validate({"type": "vllm", "device": device, "replicas": replicas, "threads": 12,
                                       "vllm": {"gpu_memory_utilization": 0.8}})
    engines.make_engines(cfg, {"solver": "/m/a", "verifier": "/m/b"}, gpus=gpus)
    threads = 12 // (len(expected) // 2)  # each replica's share of the threads
    got = [(round(f, 6), v, first // threads) for f, v, first in _Recorded.made]
    assert got == expected
