"""A user's own workflow, kept outside AstraFlow and named in the config as
``examples.custom_workflow.flows:two_tries``: the policy answers; a wrong answer gets one more
try, and the episode keeps both turns (each a sequence rewarded by its own correctness)."""

from __future__ import annotations

import time

from astraflow.rollout.workflows import WORKFLOWS, WorkflowBase, prompt_ids, sampling_for, turn_sequence


@WORKFLOWS.register("two_tries")
class TwoTries(WorkflowBase):
    async def run_episode(self, engines, task):
        t0, engine = time.time(), engines[task.policies[0]]
        # the prompt as the built-in workflows make it: through the chat template where the model has one
        prompt = prompt_ids(engine.tokenizer, self.workload, task.prompt)
        seqs, secs = [], 0.0
        for _ in range(2):
            gen = await engine.generate(prompt, sampling_for(task, self.sampling))
            # the reward runs off the node's event loop, under rollout.reward_timeout_s
            reward = await self.score(engine.tokenizer.decode(gen.tokens, skip_special_tokens=True), task.prompt)
            seqs.append(turn_sequence(prompt, gen, 0, reward))
            secs += gen.engine_seconds
            if reward > 0:
                break
        return self.trajectory(task, seqs, t0, secs)
