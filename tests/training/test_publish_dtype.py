"""Versions published in the training dtype (``trainer.publish_dtype``): the master weights stay
fp32, the published parameters are cast, and every reader takes them: bf16 engines as they are,
fp32 engines upcast, sparse deltas on a bf16 base, an engine process, and a resumed trainer."""

from __future__ import annotations

import pytest
import torch

from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.weight_sync import VersionReader
from astraflow.training.config import TrainerConfig
from astraflow.training.torch_backend import TorchBackend
from storage.deltas import write_version_delta
from storage.weights import WeightStore
from tests.training.test_torch_backend import _batch


def _trained(tiny_model, **kw) -> TorchBackend:
    be = TorchBackend(tiny_model, lr=3e-3, **kw)
    be.train_step(_batch(be.model, be.tokenizer))  # weights that are not the initial ones
    return be


def _params(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in engine.model.named_parameters()}


def test_auto_follows_the_training_dtype_and_bad_values_name_the_field():
    from pydantic import ValidationError

    assert TrainerConfig().resolved_publish_dtype == "fp32"
    assert TrainerConfig(precision="bf16").resolved_publish_dtype == "bf16"
    assert TrainerConfig(precision="bf16", publish_dtype="fp32").resolved_publish_dtype == "fp32"
    assert TrainerConfig(publish_dtype="bf16").resolved_publish_dtype == "bf16"
    assert TrainerConfig(backend="megatron").resolved_publish_dtype == "fp32"  # its parameters are fp32
    assert TrainerConfig(backend="megatron", publish_dtype="bf16").resolved_publish_dtype == "bf16"
    with pytest.raises(ValidationError, match=r"publish_dtype\n.*'auto', 'fp32' or 'bf16'"):
        TrainerConfig(publish_dtype="fp16")


def test_a_bad_publish_dtype_in_a_run_config_names_the_field(tiny_model):
    from astraflow.config import ConfigError
    from tests.conftest import tiny_config

    with pytest.raises(ConfigError,
                       match=r"policies\[solver\]\.trainer\.publish_dtype: Input should be 'auto', 'fp32' or 'bf16'"):
        tiny_config(tiny_model, **{"policies.0.trainer.publish_dtype": "half"})


def test_a_bf16_version_is_half_the_bytes_and_leaves_buffers_and_integers_alone(tiny_model, tmp_path):
    be32 = _trained(tiny_model)
    be16 = _trained(tiny_model, publish_dtype="bf16")
    sizes = {}
    for name, be in (("fp32", be32), ("bf16", be16)):
        store = WeightStore(tmp_path / name)
        be.publish(store, "p", 1)
        man = store.manifest("p", 1)
        assert man["meta"]["dtype"] == name
        assert {t["dtype"] for t in man["tensors"].values()} == {"float32" if name == "fp32" else "bfloat16"}
        sizes[name] = sum(f["bytes"] for f in man["files"].values())
    assert 0.49 < sizes["bf16"] / sizes["fp32"] < 0.52
    assert all(p.dtype == torch.float32 for p in be16.model.parameters())  # the master weights
    # a float buffer and an integer tensor go out as they are
    be16.model.register_buffer("scale", torch.full((3,), 1 / 3))
    be16.model.register_buffer("count", torch.arange(3))
    be16.publish(WeightStore(tmp_path / "buffers"), "p", 1)
    back = WeightStore(tmp_path / "buffers").load("p", 1)
    assert back["scale"].dtype == torch.float32 and torch.equal(back["scale"], torch.full((3,), 1 / 3))
    assert back["count"].dtype == torch.int64
    assert back["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_the_snapshot_is_what_gets_published(tiny_model):
    be = _trained(tiny_model, precision="bf16")  # auto: bf16
    snap = be.snapshot()
    master = be.state_dict()
    assert be.publish_dtype == "bf16"
    for k, v in snap.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, master[k].to(torch.bfloat16)), k


@pytest.mark.parametrize("engine_dtype", ["bf16", "fp32"])
def test_a_bf16_version_loads_exactly_into_an_engine(tiny_model, tmp_path, engine_dtype):
    """A bf16 engine serves the trainer's weights cast to bf16, bit for bit; an fp32 engine
    serves exactly those bf16 values upcast."""
    be = _trained(tiny_model, publish_dtype="bf16")
    be.publish(WeightStore(tmp_path), "p", 1)
    engine = HFEngine(str(tiny_model), dtype=engine_dtype, device="cpu")
    state, record = VersionReader(str(tmp_path)).read("p", 1)
    assert record["dtype"] == "bf16" and record["mode"] == "full"
    engine.load_weights(state, 1)
    want = torch.bfloat16 if engine_dtype == "bf16" else torch.float32
    master = be.state_dict()
    served = _params(engine)
    for k, v in served.items():
        assert v.dtype == want and torch.equal(v, master[k].to(torch.bfloat16).to(want)), k
    assert any(not torch.equal(v.float(), master[k]) for k, v in served.items())  # rounded, not fp32


def test_deltas_from_a_bf16_base_rebuild_the_bf16_version(tiny_model, tmp_path):
    """The trainer writes the delta v0 -> v1 from the committed bf16 versions; a reader holding
    v0 applies it and gets v1's bf16 weights exactly."""
    store = WeightStore(tmp_path, keep_last=5)
    be = TorchBackend(tiny_model, lr=3e-3, publish_dtype="bf16")
    be.publish(store, "p", 0)
    be.train_step(_batch(be.model, be.tokenizer))
    be.publish(store, "p", 1)
    v0, v1 = store.load("p", 0), store.load("p", 1)
    stats = write_version_delta(tmp_path, "p", 0, 1, v0, v1)
    assert 0 < stats.density <= 1
    reader = VersionReader(str(tmp_path), use_deltas=True)
    assert reader.read("p", 0)[1]["mode"] == "full"
    state, record = reader.read("p", 1)
    assert record["mode"] == "delta" and record["dtype"] == "bf16"
    master = be.state_dict()
    for k, v in state.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, master[k].to(torch.bfloat16)), k


def test_an_engine_process_serves_a_bf16_version_like_an_engine_in_process(tiny_model, tmp_path):
    import asyncio

    import numpy as np

    from astraflow.rollout.engine import SamplingParams
    from astraflow.rollout.process_engine import ProcessEngine

    be = _trained(tiny_model, publish_dtype="bf16")
    be.publish(WeightStore(tmp_path), "p", 1)
    local = HFEngine(str(tiny_model), dtype="bf16", device="cpu", seed=0)
    local.load_weights(VersionReader(str(tmp_path)).read("p", 1)[0], 1)
    proc = ProcessEngine(str(tiny_model), max_batch_size=8, seed=0, device="cpu", dtype="bf16", version=0)
    try:
        proc.load_version(str(tmp_path), "p", 1)
        prompts = [proc.tokenizer(p)["input_ids"] for p in ("1+2=", "12+34=")]

        async def gen(engine):
            return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=6, greedy=True))
                                          for p in prompts])

        for a, b in zip(asyncio.run(gen(proc)), asyncio.run(gen(local))):
            assert set(a.versions.tolist()) == {1}
            assert a.tokens.tolist() == b.tokens.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    finally:
        proc.close()


def test_a_resumed_trainer_continues_from_the_fp32_master_weights(tiny_model, tmp_path):
    """The published versions are bf16; the optimiser checkpoint of the same version keeps the
    fp32 master weights, and a resumed trainer continues from them. Without that checkpoint it
    continues from the published version, upcast."""
    from astraflow.training.trainer import Trainer
    from tests.training.test_trainer_loop import _DataLayer

    ref = TorchBackend(tiny_model)
    dl = _DataLayer(_batch(ref.model, ref.tokenizer))
    opt = tmp_path / "trainer_state" / "p" / "optimizer.pt"

    def trainer():
        return Trainer(policy="p", cfg=TrainerConfig(lr=1e-3, publish_dtype="bf16"), model_path=tiny_model,
                       weights_root=str(tmp_path / "weights"), keep_versions=5, data_layer=dl, max_steps=5,
                       optimizer_path=str(opt))

    first = trainer()
    first.start(run_loop=False)
    first.step()
    first.step()
    master = first.backend.state_dict()
    first.stop()
    published = WeightStore(tmp_path / "weights").load("p", 2)
    assert all(v.dtype == torch.bfloat16 for v in published.values())
    assert any(not torch.equal(published[k].float(), v) for k, v in master.items())

    resumed = trainer()
    assert resumed.start(run_loop=False) == 2 and resumed.state()["optimizer_resumed_from"] == 2
    assert all(torch.equal(resumed.backend.state_dict()[k], v) for k, v in master.items())

    opt.unlink()
    rounded = trainer()
    assert rounded.start(run_loop=False) == 2 and rounded.state()["optimizer_resumed_from"] is None
    assert rounded.state()["resumed_from_rounded"] and not resumed.state()["resumed_from_rounded"]
    assert "optimizer_checkpoint_every" in rounded.state()["optimizer_fresh_why"]
    assert all(torch.equal(rounded.backend.state_dict()[k], published[k].float()) for k in master)


def test_under_deltas_nodes_serve_exactly_the_committed_versions_and_fp32_is_refused(tiny_model, tmp_path):
    """``storage.deltas``: nodes serve every version rebuilt in bf16, so the trainer placed for the
    run publishes bf16 (``auto``) and the weights each version's tokens were sampled with are its
    committed ones, bit for bit (a version read in full, then ones rebuilt from deltas)."""
    from astraflow.config import ConfigError
    from astraflow.rollout.weight_sync import WeightPuller
    from astraflow.runtime.placement import trainer_kwargs
    from storage.paths import RunPaths
    from tests.conftest import tiny_config

    cfg = tiny_config(tiny_model, **{"storage.deltas": True})
    paths = RunPaths(tmp_path / "run")
    tcfg = trainer_kwargs(cfg, paths, 0, cfg.policies[0], None)["cfg"]
    assert tcfg.resolved_publish_dtype == "bf16"
    be = TorchBackend(tiny_model, lr=3e-3, publish_dtype=tcfg.resolved_publish_dtype)
    store = WeightStore(paths.weights, keep_last=5)
    be.publish(store, "p", 0)
    engine = HFEngine(str(tiny_model), version=0, device="cpu")
    puller = WeightPuller(str(paths.weights), {"p": engine}, use_deltas=True)
    modes = []
    for v in (1, 2, 3):
        be.train_step(_batch(be.model, be.tokenizer))
        be.publish(store, "p", v)
        write_version_delta(paths.weights, "p", v - 1, v, store.load("p", v - 1), store.load("p", v))
        assert puller.poll() == 1 and engine.version == v
        modes.append(puller.history[-1]["mode"])
        committed = store.load("p", v)
        for k, t in _params(engine).items():
            assert torch.equal(t, committed[k].to(t.dtype)), (v, k)
    assert modes == ["full", "delta", "delta"]
    with pytest.raises(ConfigError, match=r"publish_dtype: fp32 with storage\.deltas.*set publish_dtype: bf16"):
        tiny_config(tiny_model, **{"storage.deltas": True, "policies.0.trainer.publish_dtype": "fp32"})
