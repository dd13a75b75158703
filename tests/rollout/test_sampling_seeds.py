"""An episode's sampled tokens depend on the run's seed, its task and attempt, and the weights;
not on which requests share its batches or in which order they came."""

import asyncio
from dataclasses import replace

import numpy as np
import pytest
import torch

from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.seeds import episode_seeds, seeded, uniforms

PROMPTS = ["1+2=", "12+34=", "7+88=", "hello world, longer prompt", "5+5="]
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.5, stop_token_ids=())


def _episode(engine, prompt, task_id, attempt=0):
    async def one():
        with episode_seeds(7, task_id, attempt):
            first = await engine.generate(prompt, PARAMS)
            second = await engine.generate(prompt + first.tokens.tolist(), PARAMS)  # a second turn
        return first.tokens.tolist() + second.tokens.tolist()

    return one()


def test_an_episode_samples_the_same_tokens_alone_and_in_any_batch(tiny_model):
    eng = HFEngine(tiny_model, seed=1)
    prompts = [eng.tokenizer(p)["input_ids"] for p in PROMPTS]
    alone = asyncio.run(_episode(eng, prompts[0], "g0/0"))

    async def crowded(order):
        return await asyncio.gather(*(_episode(eng, prompts[i], f"g{i}/0") for i in order))

    forward = asyncio.run(crowded(range(len(prompts))))
    backward = asyncio.run(crowded(reversed(range(len(prompts)))))
    assert forward[0] == alone == backward[-1]
    assert forward[::-1] == backward
    # another task, or the same task leased again, samples afresh
    assert asyncio.run(_episode(eng, prompts[0], "g0/1")) != alone
    assert asyncio.run(_episode(eng, prompts[0], "g0/0", attempt=1)) != alone


def test_requests_outside_an_episode_are_seeded_by_the_engine(tiny_model):
    prompt = HFEngine(tiny_model).tokenizer("1+2=")["input_ids"]

    def tokens(seed):
        eng = HFEngine(tiny_model, seed=seed)
        return [asyncio.run(eng.generate(prompt, PARAMS)).tokens.tolist() for _ in range(3)]

    same, other = tokens(3), tokens(4)
    assert same == tokens(3) and same != other
    assert len({tuple(t) for t in same}) > 1  # each request draws its own seed


def test_an_episode_scope_numbers_its_requests_and_leaves_explicit_seeds_alone():
    params = SamplingParams()
    assert seeded(params) is params  # no episode open
    with episode_seeds(0, "g/0", 0):
        a = [seeded(params).seed for _ in range(3)]
        assert seeded(SamplingParams(seed=5)).seed == 5
    with episode_seeds(0, "g/0", 0):
        assert [seeded(params).seed for _ in range(3)] == a
    assert len(set(a)) == 3 and all(0 <= s < 2**63 for s in a)


def test_the_sampler_follows_the_distribution_with_top_p(tiny_model):
    eng = HFEngine(tiny_model)
    n = 40_000
    probs = torch.tensor([0.05, 0.25, 0.1, 0.6])
    logits = probs.log().repeat(n, 1)
    seeds = np.arange(n, dtype=np.uint64) * np.uint64(7919)
    u = uniforms(seeds, np.zeros(n, dtype=np.uint64))
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(float(u.mean()) - 0.5) < 0.01

    def freq(top_p):
        tok, lp = eng._sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.bool), torch.full((n,), top_p), u)
        np.testing.assert_allclose(lp.numpy(), probs.log()[tok].numpy(), rtol=1e-5)
        return np.bincount(tok.numpy(), minlength=4) / n

    np.testing.assert_allclose(freq(1.0), probs.numpy(), atol=0.01)
    # top-p 0.8 keeps 0.6 and 0.25, renormalised; the rest is never drawn
    np.testing.assert_allclose(freq(0.8), [0.0, 0.25 / 0.85, 0.0, 0.6 / 0.85], atol=0.01)
    tok, _ = eng._sample(logits[:2], torch.ones(2), torch.tensor([True, False]), torch.ones(2), u[:2])
    assert int(tok[0]) == 3  # greedy rows take the argmax


def test_any_integer_seed_names_a_stream_and_a_wrong_one_fails_only_its_request(tiny_model):
    eng = HFEngine(tiny_model)
    prompt = eng.tokenizer("1+2=")["input_ids"]

    async def main():
        return await asyncio.gather(eng.generate(prompt, replace(PARAMS, seed=-3)),
                                    eng.generate(prompt, replace(PARAMS, seed="3")), return_exceptions=True)

    negative, wrong = asyncio.run(main())
    same = asyncio.run(eng.generate(prompt, replace(PARAMS, seed=2**64 - 3)))  # -3 mod 2**64
    assert negative.tokens.tolist() == same.tokens.tolist()
    assert isinstance(wrong, ValueError) and "seed must be an integer" in str(wrong)


def test_logits_that_are_not_finite_fail_the_step(tiny_model):
    eng = HFEngine(tiny_model)
    logits = torch.tensor([[0.1, float("nan"), 0.3], [0.1, 0.2, 0.3]])
    u = uniforms(np.arange(2, dtype=np.uint64), np.zeros(2, dtype=np.uint64))
    with pytest.raises(ValueError, match="logits are not finite"):
        eng._sample(logits, torch.ones(2), torch.zeros(2, dtype=torch.bool), torch.ones(2), u)


def test_a_node_seeds_each_episode_from_the_run_seed_and_the_engine_process_takes_it(tiny_model):
    """A RaaS node opens the scope around each episode (its run seed, the task, the attempt), and
    an engine in its own process samples as the one in the node's would."""
    from astraflow.contracts import RolloutTask
    from astraflow.rollout.node_episodes import NodeEpisodes
    from astraflow.rollout.process_engine import ProcessEngine

    class Seen:
        async def run_episode(self, engines, task):
            self.seed = seeded(SamplingParams()).seed
            return self.seed

    node, workflow = NodeEpisodes(), Seen()
    node.run_seed, node.workflow, node.engines = 11, workflow, {}
    task = RolloutTask(task_id="g/2", group_id="g", policies=("p",), workflow="w", prompt={}, attempt=1)
    with pytest.raises(TypeError):  # not a Trajectory; the seed it took is what matters here
        asyncio.run(node._generate(task))
    with episode_seeds(11, "g/2", 1):
        assert workflow.seed == seeded(SamplingParams()).seed

    local = HFEngine(tiny_model, seed=1)
    prompt = local.tokenizer("12+34=")["input_ids"]
    remote = ProcessEngine(str(tiny_model), max_batch_size=4, seed=2, device="cpu")
    try:
        assert asyncio.run(_episode(remote, prompt, "g/0")) == asyncio.run(_episode(local, prompt, "g/0"))
    finally:
        remote.close()
