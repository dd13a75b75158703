"""The ``agent`` workflow: multi-turn episodes of an agentic workload's environment.

Each episode gets a fresh environment from the workload and runs ``run_agent_episode`` on the
first policy's engine: the context is rendered with the tokenizer's chat template (plain text
without one), tool calls are run by the environment's tools, observations are appended as
untrained tokens. The episode is stored as one sequence whose reward is the episode's return
(final plus per-turn rewards), with its turns and statistics for evaluation, metrics and the
episode viewer.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Mapping

import numpy as np

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.episode import EpisodeLog, run_agent_episode
from astraflow.contracts import NOT_GENERATED, RolloutTask, Sequence, Trajectory
from astraflow.rollout.engine import InferenceEngine
from astraflow.rollout.workflows import WORKFLOWS, WorkflowBase, sampling_for


@WORKFLOWS.register("agent")
class AgentWorkflow(WorkflowBase):
    """Policy 0 acts in the workload's environment until it is done, out of turns or out of context."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not callable(getattr(self.workload, "environment", None)):
            raise ValueError(f"workflow 'agent' needs an agentic workload (one with environment()); "
                             f"{type(self.workload).__name__} has none")
        self._renderers: dict[int, ChatRenderer] = {}

    def prepare(self, engines: Mapping[str, InferenceEngine]) -> None:
        """At the node's start: a chat template the episodes cannot use fails the start (a
        ``ValueError`` naming the fix), not every episode."""
        for engine in engines.values():
            self.renderer(engine)

    def renderer(self, engine: InferenceEngine) -> ChatRenderer:
        key = id(engine.tokenizer)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(engine.tokenizer)
        return self._renderers[key]

    async def run_episode(self, engines: Mapping[str, InferenceEngine], task: RolloutTask) -> Trajectory:
        t0 = time.time()
        engine = engines[task.policies[0]]
        params = sampling_for(task, self.sampling)

        async def generate(tokens: list[int], max_new: int):
            return await engine.generate(tokens, replace(params, max_new_tokens=max_new))

        env = self.workload.environment()
        log = await run_agent_episode(generate, self.renderer(engine), env, task.prompt,
                                      self.workload.limits(params.max_new_tokens))
        traj = self.trajectory(task, [episode_sequence(log)], t0, log.engine_seconds)
        return replace(traj, score=log.success, stats=log.stats(),
                       episode={"task": dict(task.prompt), "turns": log.turns,
                                "truncated": log.truncated, "final_reward": log.final_reward})


def episode_sequence(log: EpisodeLog) -> Sequence:
    """The stored sequence of an episode: its reward is the episode's return (final plus
    per-turn rewards), which GRPO normalises within the group, so every generated token of the
    episode gets the same advantage; ``rewards`` keeps the two parts. It ended by ``length`` when
    the episode was truncated or its last model turn was cut by its token budget (an answer the
    environment graded cut short), as a single-turn completion cut so did."""
    arrays = log.arrays()
    policy_ids = np.where(arrays["loss_mask"], 0, NOT_GENERATED).astype(np.int16)
    return Sequence(tokens=arrays["tokens"], loss_mask=arrays["loss_mask"], logprobs=arrays["logprobs"],
                    policy_ids=policy_ids, versions=arrays["versions"], reward=log.reward,
                    rewards={"final": log.final_reward, "turns": float(sum(log.turn_rewards))},
                    finish_reason="length" if log.truncated or log.finish_reason == "length" else "stop")
