"""RaaS-side weight pulling: full shards, sparse bf16 deltas, and the fallback to full shards
when a delta does not fit. The check compares the weights the engine actually serves."""

from __future__ import annotations

import pytest
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


def test_an_engine_process_applies_deltas_itself(tiny_model, tmp_path, monkeypatch):
    """With deltas, an engine in its own process reads each version itself (its last version
    plus the delta): no weights cross the pipe, and it serves exactly what an in-process
    engine fed by the node's puller serves. Its records reach the puller's history."""
    import asyncio
    import time

    import numpy as np

    from astraflow.rollout.engine import SamplingParams
    from astraflow.rollout.process_engine import ProcessEngine

    def no_pipe_copy(self, state_dict, version):
        raise AssertionError("the weights went through the pipe")

    monkeypatch.setattr(ProcessEngine, "load_weights", no_pipe_copy)
    torch.set_num_threads(1)  # as the engine process: the same kernels, the same greedy tokens
    store, sds = _versions(tiny_model, tmp_path)
    proc = ProcessEngine(str(tiny_model), max_batch_size=8, seed=0, device="cpu", version=-1)
    try:
        local = HFEngine(str(tiny_model), max_batch_size=8, seed=0, version=-1, device="cpu")
        remote_puller = WeightPuller(str(tmp_path), {"p": proc}, full_resync_every=10, use_deltas=True)
        local_puller = WeightPuller(str(tmp_path), {"p": local}, full_resync_every=10, use_deltas=True)

        def pull_both(version):
            assert remote_puller.poll() == 1 and local_puller.poll() == 1
            deadline = time.time() + 60
            while not any(r["version"] == version for r in remote_puller.history) and time.time() < deadline:
                time.sleep(0.05)
                remote_puller.poll()  # takes the engine process's records
            return [r for r in remote_puller.history if r["version"] == version][0]

        first = pull_both(2)
        assert first["mode"] == "full" and first["in_engine_process"]
        g = torch.Generator().manual_seed(3)
        sd3 = {k: t + 1e-2 * (torch.rand(t.shape, generator=g) < 0.05) for k, t in sds[-1].items()}
        store.publish("p", 3, sd3, meta={"layout": "hf"})
        write_version_delta(tmp_path, "p", 2, 3, sds[-1], sd3)
        rec = pull_both(3)
        assert rec["mode"] == "delta" and 0 < rec["delta_density"] < 1 and rec["load_s"] >= 0
        assert local_puller.history[-1]["mode"] == "delta"
        prompts = [proc.tokenizer(p)["input_ids"] for p in ("1+2=", "12+34=", "7+88=")]

        async def gen(engine):
            return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=8, greedy=True))
                                          for p in prompts])

        for a, b in zip(asyncio.run(gen(proc)), asyncio.run(gen(local))):
            assert a.tokens.tolist() == b.tokens.tolist() and set(a.versions.tolist()) == {3}
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    finally:
        proc.close()


def test_a_swap_pending_in_a_decoding_engine_is_not_read_again(tiny_model, tmp_path):
    """A version handed to an in-process engine while it decodes waits there as a pending swap
    (``engine.version`` still names the old one): the next poll does not read it again (with
    deltas that read would find nothing to apply), and the swap lands when the batch ends."""
    store, sds = _versions(tiny_model, tmp_path)
    engine = HFEngine(str(tiny_model), version=-1)
    puller = WeightPuller(str(tmp_path), {"p": engine}, full_resync_every=10, use_deltas=True)
    assert puller.poll() == 1 and engine.version == 2
    engine._decoding = True  # as between two decoding steps of a batch
    sd3 = {k: t * 1.01 for k, t in sds[-1].items()}
    store.publish("p", 3, sd3, meta={"layout": "hf"})
    write_version_delta(tmp_path, "p", 2, 3, sds[-1], sd3)
    assert puller.poll() == 1 and engine.version == 2  # handed over, pending
    assert puller.poll() == 0 and [r["version"] for r in puller.history] == [2, 3]
    engine._decoding = False
    served = _served(engine)  # the batch ended: the pending swap applies
    assert engine.version == 3
    for k, t in sd3.items():
        assert torch.equal(served[k], t.to(torch.bfloat16).to(served[k].dtype)), k


def test_a_version_read_again_with_deltas_is_served_and_a_failed_load_is_retried(tmp_path):
    """With deltas, a reader asked for the version it holds (a load that failed, retried; an
    engine re-created on the same version) serves it again instead of refusing; a policy that
    went back to an older version is read whole."""
    from astraflow.rollout.weight_sync import VersionReader

    store = WeightStore(tmp_path / "w", keep_last=10)
    torch.manual_seed(0)
    weights = {v: {"w": torch.randn(4, 4)} for v in range(3)}
    for v in (0, 1):
        store.publish("p", v, weights[v], meta={"layout": "hf"})
    reader = VersionReader(str(tmp_path / "w"), use_deltas=True)
    first, rec = reader.read("p", 1)
    again, rec2 = reader.read("p", 1)
    assert rec["mode"] == "full" and rec2["mode"] == "again" and torch.equal(first["w"], again["w"])
    back, rec3 = reader.read("p", 0)
    assert rec3["mode"] == "full" and torch.equal(back["w"], weights[0]["w"].to(torch.bfloat16))

    class FailsOnce:
        version, loads_versions_itself, fails = 0, False, 1

        def take_load_records(self):
            return []

        def load_weights(self, state, version):
            if self.fails:
                self.fails -= 1
                raise RuntimeError("a transient engine error")
            self.version = version

    engine = FailsOnce()
    puller = WeightPuller(str(tmp_path / "w"), {"p": engine}, use_deltas=True)
    store.publish("p", 2, weights[2], meta={"layout": "hf"})
    try:
        puller.poll()
    except RuntimeError:
        pass
    puller.poll()
    assert engine.version == 2


def test_a_policy_whose_engine_died_does_not_hold_back_the_others(tiny_model, tmp_path):
    """Two policies on a node, the first one's engine process dead: the second still gets its new
    version in the same poll, and the poll then raises the first one's error."""
    from astraflow.models import load_model
    from astraflow.rollout.process_engine import EngineProcessError

    class Dead:
        version = 3
        loads_versions_itself = True

        def load_version(self, *args, **kwargs):
            raise EngineProcessError("the engine process exited with code -9")

        def take_load_records(self):
            return []

    model, tok = load_model(tiny_model)
    store = WeightStore(tmp_path / "w")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for policy in ("solver", "verifier"):
        store.publish(policy, 4, sd, meta={"layout": "hf"})
    verifier = HFEngine(model, tokenizer=tok, device="cpu", version=3)
    puller = WeightPuller(str(tmp_path / "w"), {"solver": Dead(), "verifier": verifier})
    with pytest.raises(EngineProcessError):
        puller.poll()
    assert verifier.version == 4


def test_a_poll_loads_the_newer_version_when_the_one_it_found_was_retired_meanwhile(tmp_path):
    """The trainer commits (and retention retires the version the poll just found) between the
    poll's look at the latest version and its read: the poll loads the new latest, it does not
    fail (a node's start, or its engine recovery, would take that as a failed node)."""
    import torch

    from astraflow.rollout.weight_sync import WeightPuller
    from storage.weights import WeightStore

    class Engine:
        version, loads_versions_itself = -1, False

        def take_load_records(self):
            return []

        def load_weights(self, state, version):
            self.version = version

    trainer = WeightStore(tmp_path / "w", keep_last=1)
    trainer.publish("p", 0, {"w": torch.zeros(4)}, meta={"layout": "hf"})
    engine = Engine()
    puller = WeightPuller(str(tmp_path / "w"), {"p": engine})
    found = puller.store.latest

    def latest_then_a_commit(policy):
        got = found(policy)
        if got is not None and got.version == 0:
            trainer.publish("p", 1, {"w": torch.ones(4)}, meta={"layout": "hf"})  # retires v0
        return got

    puller.store.latest = latest_then_a_commit
    assert puller.poll() == 1 and engine.version == 1


@pytest.mark.parametrize("damage", ["truncated_json", "payload_missing", "json_without_key"])
def test_a_damaged_committed_delta_falls_back_to_full_shards(tmp_path, damage):
    """A delta that cannot be read (cut short, its payload lost) is no reason to stay behind:
    the version is read from its full shards, and the reason recorded."""
    import json

    import torch

    from astraflow.rollout.weight_sync import VersionReader
    from storage import paths
    from storage.deltas import DATA_FILE, META_FILE, write_version_delta
    from storage.weights import WeightStore

    root = tmp_path / "w"
    store = WeightStore(root, keep_last=10)
    sd0 = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    sd1 = {"w": sd0["w"] + 0.5 * (torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) < 0.1)}
    store.publish("p", 0, sd0, meta={"layout": "hf"})
    store.publish("p", 1, sd1, meta={"layout": "hf"})
    write_version_delta(root, "p", 0, 1, sd0, sd1)
    reader = VersionReader(str(root), use_deltas=True)
    assert reader.read("p", 0)[1]["mode"] == "full"
    ddir = paths.delta_dir(root, "p", 0, 1)
    if damage == "truncated_json":
        (ddir / META_FILE).write_text((ddir / META_FILE).read_text()[:40])
    elif damage == "payload_missing":
        (ddir / DATA_FILE).unlink()
    else:
        meta = json.loads((ddir / META_FILE).read_text())
        del meta["stats"]
        (ddir / META_FILE).write_text(json.dumps(meta))
    state, record = reader.read("p", 1)
    assert record["mode"] == "full" and record.get("delta_fallback")
    assert torch.equal(state["w"], sd1["w"].to(torch.bfloat16))


@pytest.mark.timeout(60)
def test_the_load_records_are_read_while_a_poll_loads_a_version(tmp_path):
    """``recent`` (the node's state, and its stop) answers while a poll holds the puller's lock
    through a whole read and load (held open here on a gate), and sees the load's record after."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    class HeldEngine:
        version, loads_versions_itself = -1, False
        loading, release = threading.Event(), threading.Event()

        def take_load_records(self):
            return []

        def load_weights(self, state, version):
            self.loading.set()
            assert self.release.wait(30), "the test never released the load"
            self.version = version

    WeightStore(tmp_path / "w").publish("p", 0, {"w": torch.zeros(4)}, meta={"layout": "hf"})
    engine = HeldEngine()
    puller = WeightPuller(str(tmp_path / "w"), {"p": engine})
    with ThreadPoolExecutor(2) as pool:
        poll = pool.submit(puller.poll)
        try:
            assert engine.loading.wait(30)
            assert pool.submit(puller.recent, 5).result(timeout=5) == []
        finally:
            engine.release.set()
        assert poll.result(30) == 1
    assert [r["version"] for r in puller.recent(5)] == [0]
