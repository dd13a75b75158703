"""Partial rollout end to end: a RaaS engine that loads a new weight version in the middle of
a long generation continues the in-flight sequences with the new weights (tokens carry mixed
versions and the exact log-probs of the weights that produced them), and the data layer
computes staleness from the oldest token."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest
import torch

from astraflow.dataflow.config import DataflowConfig

from astraflow.workloads.config import EvalConfig, WorkloadConfig
from astraflow.contracts import NOT_GENERATED, Provenance, Sequence, Trajectory, TrajectoryRef
from astraflow.dataflow.layer import BatchTimeout, DataLayer
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.training.grpo import token_logprobs

N_NEW = 48


def _perturbed(model, scale=0.05, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach().cpu() + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


async def _generate_across_a_swap(engine: HFEngine, prompts, new_sd, swap_after_steps=6):
    """Start generations, load version 1 once ``swap_after_steps`` decode steps ran."""
    params = SamplingParams(temperature=1.0, max_new_tokens=N_NEW)
    gens = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
    deadline = time.time() + 60
    while engine.stats()["decode_steps"] < swap_after_steps:
        assert time.time() < deadline, "the engine did not start decoding"
        await asyncio.sleep(0.001)
    engine.load_weights(new_sd, version=1)  # mid-decode: held pending, applied between steps
    return await asyncio.gather(*gens)


def _sequences(prompts, gens):
    out = []
    for p, g in zip(prompts, gens):
        n = len(g.tokens)
        out.append(Sequence.build(
            tokens=list(p) + list(g.tokens), loss_mask=[0] * len(p) + [1] * n,
            logprobs=[0.0] * len(p) + list(g.logprobs), policy_ids=[NOT_GENERATED] * len(p) + [0] * n,
            versions=[NOT_GENERATED] * len(p) + list(g.versions), reward=0.0, finish_reason=g.finish_reason,
        ))
    return out


@pytest.fixture(scope="module")
def swapped(tiny_model):
    engine = HFEngine(str(tiny_model), version=0, seed=3)
    old_sd = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    new_sd = _perturbed(engine.model)
    tok = engine.tokenizer
    prompts = [tok.encode(f"{a}+{b}=") for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    gens = asyncio.run(_generate_across_a_swap(engine, prompts, new_sd))
    engine.close()
    return tiny_model, prompts, gens, old_sd, new_sd


def test_in_flight_sequences_continue_with_new_weights_and_mixed_versions(swapped):
    model_dir, prompts, gens, old_sd, new_sd = swapped
    mixed = [g for g in gens if len(set(g.versions.tolist())) == 2]
    assert mixed, f"no sequence crossed the swap: lengths {[len(g.tokens) for g in gens]}"
    for g in gens:
        v = g.versions.tolist()
        assert v == sorted(v) and set(v) <= {0, 1}  # old tokens first, then new ones, never back
    # each token's log-prob is the one of the weights that generated it (teacher-forced check)
    from astraflow.models import load_model

    model, _ = load_model(str(model_dir))
    model.eval()
    for p, g in zip(prompts, gens):
        if len(set(g.versions.tolist())) < 2:
            continue
        ids = torch.tensor([list(p) + g.tokens.tolist()])
        att = torch.ones_like(ids)
        ref = {}
        for version, sd in ((0, old_sd), (1, new_sd)):
            model.load_state_dict(sd)
            with torch.no_grad():
                ref[version] = token_logprobs(model, ids, att)[0, len(p):].numpy()
        expect = np.where(g.versions == 0, ref[0], ref[1])
        np.testing.assert_allclose(g.logprobs, expect, atol=2e-4)
        # and the new weights really differ from the old ones on the swapped tokens
        after = g.versions == 1
        assert np.abs(ref[0][after] - ref[1][after]).max() > 1e-3


def test_data_layer_staleness_comes_from_the_oldest_token(swapped, tmp_path):
    _, prompts, gens, _, _ = swapped
    seqs = [s for s in _sequences(prompts, gens) if len(set(s.versions[s.versions >= 0].tolist())) == 2]
    assert seqs
    mixed = seqs[0]

    def layer(max_staleness):
        return DataLayer(
            dataflow=DataflowConfig(batch_size=2, max_staleness=max_staleness, prefetch_groups=0),
            workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": 5}, group_size=2,
                                    eval=EvalConfig(every=0, num_prompts=1)),
            policies=["p"], store_url=f"memory://{uuid.uuid4().hex}", metrics_path=None, max_steps=5,
        )

    async def fill(dl):
        tasks = await dl.lease("n0", 2)
        assert len(tasks) == 2
        trajs = []
        for i, t in enumerate(tasks):
            seq = Sequence.build(mixed.tokens, mixed.loss_mask, mixed.logprobs, mixed.policy_ids,
                                 mixed.versions, reward=float(i))
            trajs.append(Trajectory(t.task_id, t.group_id, t.policies, t.workflow, t.kind, t.attempt,
                                    (seq,), Provenance(node="n0")))
        rows = [r for tr in trajs for r in tr.to_stored()]
        refs = dl.store.writer("n0").write(rows)
        summaries = [TrajectoryRef.of(tr, [ref]) for tr, ref in zip(trajs, refs)]
        # the summary carries the oldest version (0), not the newest (1)
        assert all(s.sequences[0].policy_tokens["p"] == (int(mixed.loss_mask.sum()), 0) for s in summaries)
        await dl.complete(summaries)
        for v in (1, 2):
            await dl.published("p", v, {})

    async def go():
        # trainer at v2, bound 2: kept, with staleness 2 (from the v0 tokens, not the v1 ones)
        ok = layer(2)
        await fill(ok)
        batch = await ok.next_batch("p", 2, timeout=5)
        assert [it.staleness for it in batch.items] == [2, 2]
        assert batch.metrics["staleness_hist"] == {"2": 2}
        # bound 1: the newest token (v1) would pass, the oldest (v0) does not: dropped as stale
        strict = layer(1)
        await fill(strict)
        with pytest.raises(BatchTimeout):
            await strict.next_batch("p", 2, timeout=0.2)
        assert strict.counts["p"]["stale_dropped"] == 2
        assert strict.ledger.dropped_by_reason["stale"] == 2

    asyncio.run(go())


@pytest.mark.parametrize("swap_min_remaining", [0, N_NEW + 1])
def test_a_swap_near_the_end_of_a_batch_waits_for_it(tiny_model, swap_min_remaining):
    """With fewer than ``swap_min_remaining`` decoding steps left, a swap is not worth a
    re-encode of the batch: the batch finishes on its weights (every token v0, nothing
    re-encoded) and the next batch starts on the new ones. With 0 it lands mid-batch."""
    engine = HFEngine(str(tiny_model), version=0, seed=3, swap_min_remaining=swap_min_remaining)
    tok = engine.tokenizer
    prompts = [tok.encode(f"{a}+{b}=") for a, b in ((1, 2), (3, 4))]

    async def go():
        gens = await _generate_across_a_swap(engine, prompts, _perturbed(engine.model))
        after = await engine.generate(prompts[0], SamplingParams(temperature=1.0, max_new_tokens=2))
        return gens, after

    gens, after = asyncio.run(go())
    versions = {v for g in gens for v in g.versions.tolist()}
    if swap_min_remaining == 0:
        assert versions == {0, 1} and engine.stats()["reencoded_rows"] == len(prompts)
    else:
        assert versions == {0} and engine.stats()["reencoded_rows"] == 0
    assert engine.version == 1 and after.versions.tolist() == [1] * len(after.tokens)
