"""Shipped workflows. Each is a class registered by name; a RaaS node calls
``run_episode(engines, task)`` and knows nothing else about it."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Mapping

import numpy as np

from astraflow.contracts import NOT_GENERATED, Provenance, RolloutTask, Sequence, Trajectory
from astraflow.rollout.engine import Generation, InferenceEngine, SamplingParams
from astraflow.workloads.base import WORKFLOWS, Workload


def sampling_for(task: RolloutTask, default: SamplingParams) -> SamplingParams:
    """The task's sampling overrides applied to the node's defaults."""
    if not task.sampling:
        return default
    return replace(default, **dict(task.sampling))


def turn_sequence(prompt: list[int], gen: Generation, policy_index: int, reward: float) -> Sequence:
    """A prompt + one generated turn as a ``Sequence`` (prompt tokens carry no loss)."""
    n_p, n_g = len(prompt), len(gen.tokens)
    return Sequence.build(
        tokens=np.concatenate([np.asarray(prompt, dtype=np.int32), gen.tokens]),
        loss_mask=np.r_[np.zeros(n_p, bool), np.ones(n_g, bool)],
        logprobs=np.r_[np.zeros(n_p, np.float32), gen.logprobs],
        policy_ids=np.r_[np.full(n_p, NOT_GENERATED, np.int16), np.full(n_g, policy_index, np.int16)],
        versions=np.r_[np.full(n_p, NOT_GENERATED, np.int32), gen.versions],
        reward=reward,
        finish_reason=gen.finish_reason,
    )


class _Base:
    def __init__(self, workload: Workload, sampling: SamplingParams, node: str):
        self.workload = workload
        self.sampling = sampling
        self.node = node

    def _trajectory(self, task: RolloutTask, seqs: list[Sequence], t0: float, engine_s: float) -> Trajectory:
        return Trajectory(
            task_id=task.task_id,
            group_id=task.group_id,
            policies=task.policies,
            workflow=task.workflow,
            kind=task.kind,
            attempt=task.attempt,
            sequences=tuple(seqs),
            provenance=Provenance(node=self.node, started_at=t0, finished_at=time.time(), engine_seconds=engine_s),
        )


@WORKFLOWS.register("single_turn")
class SingleTurn(_Base):
    """One policy answers the prompt once; the workload's reward scores the answer."""

    async def run_episode(self, engines: Mapping[str, InferenceEngine], task: RolloutTask) -> Trajectory:
        t0 = time.time()
        policy = task.policies[0]
        engine = engines[policy]
        prompt = engine.tokenizer.encode(self.workload.render_prompt(task.prompt))
        gen = await engine.generate(prompt, sampling_for(task, self.sampling))
        text = engine.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        reward = self.workload.reward(text, task.prompt)
        return self._trajectory(task, [turn_sequence(prompt, gen, 0, reward)], t0, gen.engine_seconds)
