"""Multi-turn episodes in the loss: environment tokens carry no gradient, and per-turn rewards
enter the advantage through the episode's return."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from astraflow.batches import Batch, BatchItem
from astraflow.contracts import RolloutTask
from astraflow.models import load_model
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.agent import episode_sequence
from astraflow.rollout.workflows import make_workflow
from astraflow.training.grpo import collate, grpo_loss, token_logprobs
from tests.agents.test_episode import SumEnv, run, scripted
from tests.agents.toy import LookupWorkload


def test_environment_tokens_get_no_gradient(tiny_model):
    engine = HFEngine(str(tiny_model), version=0, seed=3)
    wf = make_workflow("agent", LookupWorkload(), SamplingParams(max_new_tokens=16), node="n")
    seqs = []
    for i in range(2):
        task = RolloutTask(task_id=f"g/{i}", group_id="g", policies=("p",), workflow="agent", prompt={"key": "k3"})
        seqs += asyncio.run(wf.run_episode({"p": engine}, task)).sequences
    engine.close()
    items = tuple(BatchItem(sequence=s, loss_mask=s.loss_mask, group_mean=0.0, group_std=1.0, group_size=2,
                            staleness=0, task_id=f"g/{i}") for i, s in enumerate(seqs))
    # rewards of an untrained model are 0: give the two episodes opposite advantages
    items = tuple(BatchItem(**{**it.__dict__, "group_mean": it.sequence.reward - (1 if i else -1)})
                  for i, it in enumerate(items))
    col = collate(Batch(policy="p", version=0, items=items), pad_id=0)
    model, _ = load_model(tiny_model)
    new = token_logprobs(model, col.tokens, col.attention_mask)
    new.retain_grad()
    loss, _ = grpo_loss(new, col.old_logprobs, col.advantages, col.loss_mask)
    loss.backward()
    env_tokens = (col.attention_mask.bool() & ~col.loss_mask)
    assert env_tokens.sum() > 20 and col.loss_mask.sum() > 0
    assert torch.all(new.grad[env_tokens] == 0)
    assert torch.all(new.grad[col.loss_mask] != 0)


def test_per_turn_rewards_enter_the_advantage_through_the_return():
    """Two episodes with the same final reward: the one with more shaped reward gets the
    higher advantage, on every one of its generated tokens."""
    from astraflow.models import build_tokenizer

    tok = build_tokenizer()
    logs = [run(scripted(tok, ["hmm", "hmm", "5"]), tok, SumEnv(shaped=0.1)),
            run(scripted(tok, ["5"]), tok, SumEnv(shaped=0.1))]
    seqs = [episode_sequence(log) for log in logs]
    assert [s.reward for s in seqs] == [1.2, 1.0] and [s.rewards["final"] for s in seqs] == [1.0, 1.0]
    mean, std = float(np.mean([s.reward for s in seqs])), float(np.std([s.reward for s in seqs]))
    items = [BatchItem(sequence=s, loss_mask=s.loss_mask, group_mean=mean, group_std=std, group_size=2,
                       staleness=0, task_id=f"g/{i}") for i, s in enumerate(seqs)]
    assert items[0].advantage > 0 > items[1].advantage
    col = collate(Batch(policy="p", version=0, items=tuple(items)), pad_id=0)
    assert col.advantages[0] > 0 > col.advantages[1]
