"""The vLLM engine's decisions that need no vLLM: the probe check after an update, the
per-token version tags of a resumed request, the config checks of ``max_model_len``, what
a weight update leaves behind when it fails (against a stand-in for vLLM's ``AsyncLLM``). They run
everywhere (``tests/vllm`` covers the engine itself where vLLM is installed)."""

from __future__ import annotations

import math
from collections import namedtuple
from pathlib import Path

import pytest

from astraflow.probe import probe_error
from astraflow.rollout.vllm_engine import _versions
from astraflow.rollout.vllm_probe import check_probe, judge
from tests.conftest import tiny_config

#: the fields of vLLM's weight-version span that ``_versions`` reads
Span = namedtuple("Span", "start end version")


@pytest.mark.parametrize("bad", [math.nan, -math.inf, math.inf])
def test_a_probe_with_nan_or_infinite_log_probs_fails_every_tolerance(bad):
    expected = [-1.0, -2.0, -3.0]
    assert probe_error(expected, [-1.0, bad, -3.0]) == math.inf
    assert probe_error([-1.0, bad, -3.0], expected) == math.inf
    assert probe_error(expected, [-1.0, -2.5, -3.0]) == pytest.approx(0.5 / 3)


def test_judge_blames_the_update_only_when_a_fresh_engine_is_right():
    assert judge(2.0, 0.001, 0.05) == (0.05, True)  # in place wrong, fresh right: re-create from now on
    assert judge(0.12, 0.1, 0.05) == (0.2, False)  # both off alike: the engine's numerics, tolerance 2x
    assert judge(0.5, 0.1, 0.05) == (0.2, True)  # off by more than the numerics explain
    assert judge(0.01, 0.0, 0.05) == (0.05, False)
    assert judge(0.5, 0.4, 0.05) == (0.5, False)  # the raise stops at what a dtype explains
    assert judge(0.9, 0.8, 1.0) == (1.0, False)  # a tolerance configured higher is kept


#: two versions' probes of the same tokens, 0.02 nats apart (less than the default tolerance, 0.05)
HELD = {"tokens": [3, 1, 4, 1, 5], "logprobs": [-1.0, -2.0, -3.0, -4.0]}
NEW = {"tokens": [3, 1, 4, 1, 5], "logprobs": [-1.02, -1.98, -3.02, -3.98]}


def test_an_engine_left_on_the_held_version_is_stale_though_within_the_tolerance():
    check = check_probe(NEW, HELD["logprobs"], HELD, noise=1e-6)
    assert check.err == pytest.approx(0.02) and check.err_held == 0.0 and check.apart == pytest.approx(0.02)
    assert check.stale and not check.passed(0.05)
    assert check_probe(NEW, HELD["logprobs"]).passed(0.05)  # against the new version alone it would pass
    halfway = [(a + b) / 2 for a, b in zip(HELD["logprobs"], NEW["logprobs"])]
    assert not check_probe(NEW, halfway, HELD, noise=1e-6).passed(0.05)  # no nearer the new one: rejected


def test_an_engine_on_the_new_version_passes_the_relative_check():
    got = [x + 1e-6 for x in NEW["logprobs"]]
    check = check_probe(NEW, got, HELD, noise=1e-6)
    assert not check.stale and check.passed(0.05) and check.err_held == pytest.approx(0.02, abs=1e-5)
    assert not check_probe(NEW, [x + 0.1 for x in NEW["logprobs"]], HELD, noise=1e-6).passed(0.05)  # tolerance


def test_versions_closer_than_the_engines_noise_are_judged_by_the_tolerance_alone():
    """An engine 0.015 nats off each version it holds cannot tell two versions 0.02 apart."""
    check = check_probe(NEW, HELD["logprobs"], HELD, noise=0.015)
    assert not check.stale and check.passed(0.05) and check.apart == pytest.approx(0.02)
    assert check_probe(HELD, HELD["logprobs"], HELD, noise=0.0).passed(0.05)  # the same weights republished


def test_probes_of_other_tokens_are_not_compared():
    other = {"tokens": [2, 7, 1, 8, 2], "logprobs": HELD["logprobs"]}
    check = check_probe(NEW, HELD["logprobs"], other, noise=0.0)
    assert check.err_held is None and check.apart is None and not check.stale and check.passed(0.05)


def test_judge_blames_a_stale_update_only_when_the_fresh_engine_tells_the_versions_apart():
    assert judge(0.02, 0.0, 0.05, stale=True, fresh_stale=False) == (0.05, True)
    assert judge(0.02, 0.02, 0.05, stale=True, fresh_stale=True) == (0.05, False)  # indistinguishable


@pytest.mark.parametrize("fresh", [math.inf, math.nan, 2.9, 0.6])
def test_a_fresh_engine_off_past_any_dtype_keeps_the_check_on(fresh):
    """A broken version (a bad conversion, a wrong probe) scored far off or inf by both engines
    must not raise the tolerance past what numerics explain (every later update, however
    wrong, would then pass)."""
    tolerance, wrong = judge(math.inf, fresh, 0.05)
    assert tolerance == 0.05 and not wrong
    assert judge(2.0, 0.001, tolerance) == (0.05, True)  # a later wrong update is still caught


def test_resumed_segments_are_tagged_with_the_versions_that_sampled_them():
    assert _versions([Span(0, 3, "4"), Span(3, 5, "5")], 5, fallback=4) == [4, 4, 4, 5, 5]
    assert _versions(None, 3, fallback=7) == [7, 7, 7]  # a vLLM without spans: the serving version
    assert _versions([Span(0, 9, "2")], 4, fallback=1) == [2, 2, 2, 2]  # clipped to the segment
    assert _versions([Span(0, 2, "none"), Span(2, 3, "3")], 3, fallback=1) == [1, 1, 3]


def _vllm_config(tiny_model, **overrides):
    return tiny_config(tiny_model, rollout__engine__type="vllm", **overrides)


def test_a_max_model_len_without_room_for_the_generation_is_refused_at_load(tiny_model):
    from astraflow.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.engine.vllm.max_model_len 40: a request is its prompt plus "
                                          r"workload.sampling.max_new_tokens 40 tokens"):
        _vllm_config(tiny_model, rollout__engine__vllm__max_model_len=40, workload__sampling__max_new_tokens=40)
    # shorter than the probe every weight update is scored on: the updates could never be checked
    with pytest.raises(ConfigError, match=r"rollout.engine.vllm.max_model_len: Input should be greater than 32"):
        _vllm_config(tiny_model, rollout__engine__vllm__max_model_len=24, workload__sampling__max_new_tokens=8)
    assert _vllm_config(tiny_model, rollout__engine__vllm__max_model_len=64,
                        workload__sampling__max_new_tokens=32).rollout.engine.vllm.max_model_len == 64
    # the hf engine has no such setting: it is not judged
    tiny_config(tiny_model, rollout__engine__vllm__max_model_len=40, workload__sampling__max_new_tokens=40)


def test_a_partitions_own_max_model_len_is_checked_and_named(tiny_model):
    from astraflow.config import ConfigError

    parts = [{"name": "pool", "role": "rollout", "scheduler": "local",
              "rollout": {"engine": {"vllm": {"max_model_len": 40}}}},
             {"name": "trainer", "role": "trainer"}, {"name": "data", "role": "data"}]
    with pytest.raises(ConfigError, match=r"partitions\[pool\].rollout.engine.vllm.max_model_len 40"):
        _vllm_config(tiny_model, partitions=parts, workload__sampling__max_new_tokens=40)


def test_a_vllm_engine_on_an_explicit_gpu_sees_only_that_gpu():
    """vLLM takes its GPUs from ``CUDA_VISIBLE_DEVICES``, so ``cuda:N`` must become that."""
    from astraflow.rollout.config import EngineConfig
    from astraflow.rollout.engine_pool import plan_replicas
    from astraflow.rollout.engines import vllm_visible_devices

    def visible(device, node_visible, gpus=4, **kw):
        cfg = EngineConfig(type="vllm", device=device, **kw)
        return [vllm_visible_devices(p, node_visible) for p in plan_replicas(cfg, gpus, 4, node_visible)]

    assert visible("cuda:1", None) == ["1"]
    assert visible("cuda:1", "4,5,6,7") == ["5"]  # the node's GPU 1, as the machine numbers it
    assert visible("cuda:1", "4,5", replicas=2) == ["5", "5"]  # replicas share the named GPU
    assert visible("auto", "4,5,6,7", tensor_parallel=2) == ["4,5", "6,7"]  # the plan's groups, as before
    assert visible("cpu", None, gpus=0) == [None]
    with pytest.raises(ValueError, match=r"rollout.engine.device cuda:3: this node sees 2 GPU\(s\)"):
        visible("cuda:3", "4,5")


def test_tensor_parallel_over_one_named_gpu_is_refused():
    from pydantic import ValidationError

    from astraflow.rollout.config import EngineConfig

    with pytest.raises(ValidationError, match="device cuda:0 names one GPU and tensor_parallel 2 spans 2"):
        EngineConfig(type="vllm", device="cuda:0", tensor_parallel=2)


def test_an_agentic_episode_longer_than_max_model_len_is_refused_at_load(tmp_path):
    """An agent's later turns send the whole episode so far: max_context_tokens must fit."""
    import yaml

    from astraflow.config import ConfigError, load_config

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/calculator/config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "model")  # not built: validation needs none
    data["rollout"]["engine"] = {"type": "vllm", "vllm": {"max_model_len": 128}}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"rollout.engine.vllm.max_model_len 128: an episode's requests grow to "
                                          r"workload.params.max_context_tokens 256"):
        load_config(cfg, [])
    assert load_config(cfg, ["rollout.engine.vllm.max_model_len=256"]).rollout.engine.vllm.max_model_len == 256


class _LLM:
    """Stands in for vLLM's ``AsyncLLM`` (not installed here): records the calls an update
    makes and fails the weight reload when told to."""

    def __init__(self, fail_reload: bool):
        self.fail_reload, self.errored, self.calls = fail_reload, False, []

    async def pause_generation(self, mode, clear_cache):
        self.calls.append("pause")

    async def resume_generation(self):
        self.calls.append("resume")

    async def collective_rpc(self, method, kwargs=None):
        self.calls.append(method)
        if self.fail_reload:
            raise RuntimeError("worker 1 ran out of memory while loading")

    async def update_weight_version(self, version):
        self.calls.append(f"version {version}")


def _engine(tmp_path: Path, fail_reload: bool):
    import asyncio
    from types import SimpleNamespace

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return SimpleNamespace(
        options=SimpleNamespace(weight_update="reload", probe_tolerance=0.05), llm=_LLM(fail_reload),
        _gate=asyncio.Event(), _running={}, steps_left=lambda: 0, swap_min_remaining=8, model_path=str(model),
        version=0, serving_version=0, _dead=None, _stats={"weight_swaps": 0, "recreations": 0},
        reach_core=_reached, labels_versions=True)


async def _reached() -> None:
    """Nothing is running in the fake engine: every request has reached its core."""


def _update(tmp_path: Path, fail_reload: bool, publish: bool):
    import asyncio

    import torch

    from astraflow.rollout.vllm_updates import Updater
    from storage.weights import WeightStore

    root = tmp_path / "weights"
    if publish:
        WeightStore(root, keep_last=2).publish("actor", 1, {"w": torch.ones(4)}, meta={"layout": "hf"})
    else:
        root.mkdir()
    eng = _engine(tmp_path, fail_reload)
    updater = Updater(eng, build="a test build", native=False)

    async def go():
        try:
            await updater._update(1, store=(str(root), "actor", False, 1))
        finally:
            updater.close()

    return eng, go, asyncio.run


def test_a_reload_that_fails_part_way_leaves_the_engine_dead_not_serving_mixed_weights(tmp_path):
    eng, go, run = _update(tmp_path, fail_reload=True, publish=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        run(go())
    assert eng.llm.calls == ["pause", "reload_weights"]  # generation is not resumed on those weights
    assert "half-updated" in eng._dead and "v1" in eng._dead and "out of memory" in eng._dead
    assert eng.serving_version == 0 and eng._gate.is_set()  # waiting requests wake up and see it dead


def test_an_update_that_fails_before_touching_the_weights_keeps_serving_the_old_ones(tmp_path):
    eng, go, run = _update(tmp_path, fail_reload=False, publish=False)  # the version is not in the store
    from storage.weights import VersionNotCommitted

    with pytest.raises(VersionNotCommitted):
        run(go())
    assert eng._dead is None
    assert eng.llm.calls == [] and eng.serving_version == 0 and eng._gate.is_set()  # refused before pausing


def test_a_reload_that_succeeds_serves_the_new_version(tmp_path):
    eng, go, run = _update(tmp_path, fail_reload=False, publish=True)
    run(go())
    assert eng._dead is None and eng.serving_version == 1
    assert eng.llm.calls == ["pause", "reload_weights", "version 1", "resume"]
