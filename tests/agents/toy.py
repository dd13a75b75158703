"""A small agentic workload for tests: look a key up with a tool, answer its value."""

from __future__ import annotations

from typing import Any

from astraflow.agents.env import Action, EnvironmentBase, StepResult
from astraflow.agents.tools import ToolBox, format_call, tool
from astraflow.agents.workload import AgentParams, AgentWorkload

TABLE = {f"k{i}": f"v{(i * 7) % 10}" for i in range(40)}


@tool(timeout_s=2)
def lookup(key: str) -> str:
    """The value of a key."""
    return TABLE.get(key, "none")


class LookupEnv(EnvironmentBase):
    step_timeout_s = 5.0

    def __init__(self) -> None:
        super().__init__()
        self.tools = ToolBox([lookup])
        self.turn = 0

    async def reset(self, task):
        self.task = task
        return [{"role": "user", "content": f"value of {task['key']}?"}]

    async def step(self, action: Action) -> StepResult:
        ok = float(action.text.strip() == TABLE[self.task["key"]])
        return StepResult([{"role": "user", "content": "right" if ok else "wrong"}], reward=ok, done=True,
                          info={"success": ok})

    def expert_action(self) -> str:
        self.turn += 1
        return format_call("lookup", {"key": self.task["key"]}) if self.turn == 1 else TABLE[self.task["key"]]


class LookupParams(AgentParams):
    max_turns: int = 3
    max_context_tokens: int = 256


class LookupWorkload(AgentWorkload):
    Params = LookupParams

    def tasks(self, split: str) -> list[dict[str, Any]]:
        keys = sorted(TABLE)
        picked = keys[:30] if split == "train" else keys[30:]
        return [{"key": k, "difficulty": 1} for k in picked]

    def environment(self) -> LookupEnv:
        return LookupEnv()


class BrokenEnv(LookupEnv):
    async def reset(self, task):
        if task["key"].startswith("k3"):
            raise KeyError("the environment broke")
        return await super().reset(task)


class BrokenWorkload(LookupWorkload):
    """The lookup workload whose environment raises ``KeyError`` in ``reset`` on keys ``k3*``."""

    def environment(self) -> LookupEnv:
        return BrokenEnv()


class NoHeldOutWorkload(LookupWorkload):
    """The lookup workload whose held-out split cannot be read (a user's bug in ``tasks``)."""

    def tasks(self, split: str) -> list[dict[str, Any]]:
        if split == "eval":
            raise KeyError("eval_file")
        return super().tasks(split)
