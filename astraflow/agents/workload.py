"""The base of agentic workloads: tasks, a fresh environment per episode, and an expert.

An agentic workload is a ``Workload`` (``astraflow.workloads.base``) run by the ``agent``
workflow: instead of a prompt and a reward it gives each episode an ``Environment``. Its
``Params`` include the episode limits (``AgentParams``). Its environments may offer
``expert_action()``, the next turn of a scripted expert, called once per model turn in order
(tool-call turns included, which never reach ``step``: the expert keeps its own count): the
source of the demonstrations a warm start trains on and of the conformance check that the
expert succeeds.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import Field, model_validator

from astraflow.agents.env import Environment
from astraflow.agents.episode import AgentLimits
from astraflow.configbase import Strict


#: the largest ``invalid_call_penalty``: rewards are mostly 0/1, and a penalty past the reward of
#: a success would teach the policy to stop calling tools rather than to call them right
MAX_INVALID_CALL_PENALTY = 1.0


class AgentParams(Strict):
    """Parameters every agentic workload has (a workload's ``Params`` extends it)."""

    max_turns: int = Field(default=6, ge=1)
    """Model turns per episode at most (then the episode is truncated)."""
    max_context_tokens: int = Field(default=1024, ge=16)
    """Tokens per episode at most, observations included (then it is truncated)."""
    max_observation_chars: int = Field(default=16_000, ge=64)
    """Characters of one tool result or observation message at most: a longer one is cut, with a
    note of how much, before it is tokenised (a huge result would stall the node and end the
    episode at the context limit without the model seeing any of it)."""
    invalid_call_penalty: float = Field(default=0.0, ge=0.0, le=MAX_INVALID_CALL_PENALTY)
    """Taken off an episode's return per invalid tool call (unreadable, an unknown tool, wrong
    arguments), so RL learns to write calls that run; 0 (the default): an invalid call costs only
    its turn. In the units of the environment's rewards, at most a success's usual 1."""
    num_train: int = Field(default=2000, ge=1)
    """Tasks in the train split."""
    num_test: int = Field(default=200, ge=1)
    """Tasks in the held-out split (disjoint from train)."""
    seed: int = 0
    """Seed of the generated data (``workload.seed`` unless set here)."""

    @model_validator(mode="after")
    def _limits_kept(self) -> "AgentParams":
        """The bounds above, also where a workload's ``Params`` gives a field a new default
        without them (``max_turns: int = 5`` drops ``ge=1``): an episode with no model turn
        trains nothing, and a run of them would never end."""
        for name, least in (("max_turns", 1), ("max_context_tokens", 16), ("max_observation_chars", 64)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} {getattr(self, name)}: give at least {least}")
        penalty = self.invalid_call_penalty  # a subclass's own field may have dropped the bounds
        if not 0.0 <= penalty <= MAX_INVALID_CALL_PENALTY:
            raise ValueError(f"invalid_call_penalty {penalty}: give a number from 0 to {MAX_INVALID_CALL_PENALTY:g}")
        return self


class AgentWorkload:
    """Base class: set ``Params``, implement ``tasks`` and ``environment``."""

    Params: type[AgentParams] = AgentParams
    #: the workflow that runs it
    workflow = "agent"

    def __init__(self, seed: int = 0, **params: Any):
        self.params = self.Params.model_validate({"seed": seed, **params})

    def limits(self, max_new_tokens: int) -> AgentLimits:
        return AgentLimits(max_turns=self.params.max_turns, max_context_tokens=self.params.max_context_tokens,
                           max_new_tokens=max_new_tokens, max_observation_chars=self.params.max_observation_chars,
                           invalid_call_penalty=self.params.invalid_call_penalty)

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """Payloads of ``"train"`` or ``"eval"``; a ``difficulty`` key is reported per level."""
        raise NotImplementedError(f"{type(self).__name__} does not define tasks(self, split): return the "
                                  "task payloads of 'train' or 'eval'")

    def environment(self) -> Environment:
        """A fresh environment for one episode."""
        raise NotImplementedError(f"{type(self).__name__} does not define environment(self): return a fresh "
                                  "Environment per episode (docs/agents.md)")

    def source_weights(self) -> dict[str, float]:
        return {"": 1.0}

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        raise TypeError(f"{type(self).__name__} is an agentic workload: set workload.workflow: agent")

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        raise TypeError(f"{type(self).__name__} is an agentic workload: set workload.workflow: agent")


def is_agentic(workload_cls: type) -> bool:
    """Whether a workload class gives environments (runs under the ``agent`` workflow)."""
    return callable(getattr(workload_cls, "environment", None))
