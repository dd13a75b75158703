"""A user's own agentic workload, in a file of its own: find a secret digit with a probe tool.

Named in the config as ``examples.custom_env.guess:GuessWorkload`` (run from the repository
root); nothing in AstraFlow is edited. The model may call ``probe(n)`` (answers ``higher``,
``lower`` or ``yes``) and ends by answering the digit as a plain turn. Success is 1 when the
answer is right; a right answer's return is 1 less ``probe_cost`` per probe, so fewer probes
mean a higher return. A wrong answer and an episode that never answers (it runs out of turns)
both return 0: charging the probes of a wrong answer only would make not answering pay.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field

from astraflow.agents.env import Action, EnvironmentBase, StepResult
from astraflow.agents.tools import ToolBox, format_call, tool
from astraflow.agents.workload import AgentParams, AgentWorkload


class GuessParams(AgentParams):
    max_turns: int = Field(default=5, ge=1)
    max_context_tokens: int = Field(default=512, ge=16)
    probe_cost: float = Field(default=0.05, ge=0, lt=0.2)
    """What each probe takes off a right answer's return (below 0.2: five probes leave it positive)."""


class GuessEnv(EnvironmentBase):
    step_timeout_s = 5.0

    def __init__(self, probe_cost: float):
        super().__init__()
        self.probe_cost = probe_cost

        @tool(timeout_s=1)
        def probe(n: int) -> str:
            """Compare n with the secret digit."""
            self.probes += 1
            return "yes" if n == self.secret else "higher" if self.secret > n else "lower"

        self.tools = ToolBox([probe])

    async def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        self.secret, self.probes, self.lo, self.hi = int(task["secret"]), 0, 0, 9
        return [{"role": "user", "content": "Find the digit 0-9. probe(n) says higher/lower/yes."}]

    async def step(self, action: Action) -> StepResult:
        text = action.text.strip()
        ok = float(text.isdigit() and int(text) == self.secret)
        # the probes' cost is taken off a right answer only (module docstring)
        return StepResult([{"role": "user", "content": "right" if ok else "wrong"}],
                          reward=ok * (1.0 - self.probe_cost * self.probes), done=True, info={"success": ok})

    def expert_action(self) -> str:
        """Binary search: probe the middle of what is left until a probe says yes."""
        if self.lo == self.hi:
            return str(self.lo)
        mid = (self.lo + self.hi) // 2
        # the expert reads the answer it will get from the state it knows
        if self.secret > mid:
            self.lo = mid + 1
        elif self.secret < mid:
            self.hi = mid - 1
        else:
            self.lo = self.hi = mid
        return format_call("probe", {"n": mid})


class GuessWorkload(AgentWorkload):
    Params = GuessParams

    def tasks(self, split: str) -> list[dict[str, Any]]:
        rng = random.Random(f"{self.params.seed}:{split}")
        n = self.params.num_train if split == "train" else self.params.num_test
        return [{"secret": rng.randrange(10), "difficulty": 1} for _ in range(n)]

    def environment(self) -> GuessEnv:
        return GuessEnv(self.params.probe_cost)
