"""RaaS-side weight pulling: full shards, sparse bf16 deltas, and the fallback to full shards
when a delta does not fit. The check compares the weights the engine actually serves."""

from __future__ import annotations

import torch

from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.weight_sync import WeightPuller
from storage import paths
from storage.deltas import write_version_delta
from storage.weights import WeightStore


def _served(engine: HFEngine) -> dict[str, torch.Tensor]:
    engine._take_pending_weights()  # the engine applies a swap between decoding steps
    return {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}


def _versions(model_dir, root, n=3):
    store = WeightStore(root, keep_last=10)
    model = HFEngine(str(model_dir)).model
    base = {k: t.detach().cpu() for k, t in model.named_parameters()}  # a tied head appears once (as the embedding)
    sds = []
    g = torch.Generator().manual_seed(0)
    for v in range(n):
        sd = {k: t.detach() + (1e-2 * v) * torch.randn(t.shape, generator=g) * (torch.rand(t.shape, generator=g) < 0.1)
              for k, t in base.items()}
        store.publish("p", v, sd, meta={"layout": "hf"})
        if v:
            write_version_delta(root, "p", v - 1, v, sds[-1], sd)
        sds.append(sd)
    return store, sds


def test_delta_pull_serves_bf16_of_the_full_version(tiny_model, tmp_path):
    store, sds = _versions(tiny_model, tmp_path)
    engine = HFEngine(str(tiny_model), version=-1)
    puller = WeightPuller(str(tmp_path), {"p": engine}, full_resync_every=10, use_deltas=True)
    # the first pull has nothing held: full shards of the newest version
    assert puller.poll() == 1 and puller.history[-1]["mode"] == "full"
    assert engine.version == 2
    # a new version one step ahead with a committed delta is applied as a delta
    sd3 = {k: t + 1e-2 * (torch.rand(t.shape) < 0.05) for k, t in sds[-1].items()}
    store.publish("p", 3, sd3, meta={"layout": "hf"})
    write_version_delta(tmp_path, "p", 2, 3, sds[-1], sd3)
    assert puller.poll() == 1
    rec = puller.history[-1]
    assert rec["mode"] == "delta" and 0 < rec["delta_density"] < 1
    served = _served(engine)
    for k, t in sd3.items():
        assert torch.equal(served[k], t.to(torch.bfloat16).to(served[k].dtype)), k


def test_corrupt_delta_falls_back_to_full_shards(tiny_model, tmp_path):
    store, sds = _versions(tiny_model, tmp_path)
    engine = HFEngine(str(tiny_model), version=-1)
    puller = WeightPuller(str(tmp_path), {"p": engine}, full_resync_every=10, use_deltas=True)
    puller.poll()
    sd3 = {k: t * 1.01 for k, t in sds[-1].items()}
    store.publish("p", 3, sd3, meta={"layout": "hf"})
    write_version_delta(tmp_path, "p", 2, 3, sds[0], sd3)  # written against the wrong base
    puller.poll()
    rec = puller.history[-1]
    assert rec["mode"] == "full" and rec["delta_fallback"]
    served = _served(engine)
    for k, t in sd3.items():
        assert torch.equal(served[k], t.to(torch.bfloat16).to(served[k].dtype)), k


def test_without_deltas_the_engine_serves_exact_full_weights(tiny_model, tmp_path):
    store, sds = _versions(tiny_model, tmp_path)
    engine = HFEngine(str(tiny_model), version=-1)
    WeightPuller(str(tmp_path), {"p": engine}).poll()
    served = _served(engine)
    assert all(torch.equal(served[k], t) for k, t in sds[-1].items())
    assert paths.delta_dir(tmp_path, "p", 1, 2).exists()
