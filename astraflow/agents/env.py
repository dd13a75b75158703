"""The environment contract of an agentic episode.

An *environment* is one episode's world. The agent workflow builds a fresh one per episode
(``AgentWorkload.environment()``), then::

    messages = await env.reset(task)          # the first observation: chat messages
    while not done:
        action = <one model turn>
        if action has tool calls:  <the workflow runs env.tools, appends their results>
        else:  result = await env.step(action)   # observation, reward, done, info
    await env.close()                          # always, also after an error or a timeout

Every ``reset``/``step`` runs under ``step_timeout_s``; ``close`` releases per-episode resources
(processes, files, connections) and is awaited whatever happened (a plain ``def close`` is
called once instead). An environment that raises,
hangs past its deadline or returns something that is not a ``StepResult`` fails the episode
(``EpisodeError``): the data layer retries the task up to its attempt limit.

Rewards: every ``StepResult.reward`` before the final one is a *per-turn* (shaped) reward, the
one with ``done=True`` the *final* reward. The episode's return, which GRPO normalises within
the group, is their sum (``docs/agents.md``). ``info["success"]``, when given on the final
step, is what evaluation counts; otherwise the final reward is.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Protocol, runtime_checkable

#: a chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``
Message = dict[str, str]

#: the roles an observation may use (the model's own turns are ``assistant``)
OBSERVATION_ROLES = ("system", "user", "tool")


class EpisodeError(RuntimeError):
    """The episode cannot go on: its environment or a tool raised, hung past its deadline or
    returned garbage. The RaaS node fails the task (retried up to the attempt limit)."""


class ToolError(Exception):
    """Raised by a tool for a call the model got wrong (a key that is not there, a value out of
    range): its message becomes the call's error observation and the call counts as invalid, as
    a call that does not fit the tool's schema does. Any other exception a tool raises fails the
    episode (an ``EpisodeError``: resampled, never scored), which suits faults of the tool
    itself, not of the model's call."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model wrote: the tool's name and its JSON arguments."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class Action:
    """One model turn as the environment sees it."""

    #: the turn's text (decoded, without the end-of-turn token)
    text: str
    #: the well-formed tool calls in the turn, in order (empty: a plain action/answer)
    tool_calls: tuple[ToolCall, ...] = ()
    #: why a tool call in the turn could not be read (malformed syntax or JSON)
    errors: tuple[str, ...] = ()
    #: every call as written, in the text's order: ``(True, i)`` is ``tool_calls[i]``,
    #: ``(False, j)`` is ``errors[j]`` (empty: the errors, then the calls)
    order: tuple[tuple[bool, int], ...] = ()

    def in_order(self) -> list[ToolCall | str]:
        """The turn's calls as written: each a ``ToolCall``, or why it could not be read."""
        order = self.order or ([(False, j) for j in range(len(self.errors))]
                               + [(True, i) for i in range(len(self.tool_calls))])
        return [self.tool_calls[k] if ok else self.errors[k] for ok, k in order]


@dataclass(frozen=True)
class StepResult:
    """What ``Environment.step`` returns."""

    #: messages appended to the context (never trained on); may be empty when ``done``
    observation: list[Message] = field(default_factory=list)
    #: this step's reward: per-turn (shaped) before the end, the final reward with ``done``
    reward: float = 0.0
    #: whether the episode is over
    done: bool = False
    #: anything to record: ``success`` (0/1) on the final step is what evaluation counts
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's world (see the module docstring for the loop that drives it)."""

    #: the tools the model may call this episode (``astraflow.agents.tools.ToolBox``)
    tools: Any
    #: deadline of one ``reset`` or ``step`` call, in seconds
    step_timeout_s: ClassVar[float]

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        """Start the episode of ``task`` (the workload's payload); the first observation."""

    async def step(self, action: Action) -> StepResult:
        """Apply a model turn that called no tool."""

    async def close(self) -> None:
        """Release the episode's resources; called exactly once, whatever happened."""


class EnvironmentBase:
    """A convenient base: no tools, a 30 s step deadline, nothing to close."""

    step_timeout_s: ClassVar[float] = 30.0

    def __init__(self) -> None:
        from astraflow.agents.tools import ToolBox

        self.tools = ToolBox([])

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        raise NotImplementedError(f"{type(self).__name__} does not define reset(self, task)")

    async def step(self, action: Action) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} does not define step(self, action)")

    async def close(self) -> None:
        return None


def signature_problems(cls: type) -> list[str]:
    """What keeps ``cls`` from being an ``Environment``: missing methods (``reset`` and ``step``
    left to ``EnvironmentBase``'s, which only raise), methods that are not ``async def`` or take
    the wrong arguments. ``close`` may be a plain ``def`` (the loop calls it once). Empty when it
    fits; ``astraflow check`` reports these before a run starts."""
    problems = []
    for name, nargs in (("reset", 1), ("step", 1), ("close", 0)):
        fn = getattr(cls, name, None)
        if fn is None:
            problems.append(f"{cls.__name__} has no {name}()")
            continue
        if name != "close" and fn is getattr(EnvironmentBase, name):
            arg = "task" if name == "reset" else "action"
            problems.append(f"{cls.__name__} does not define {name}: add 'async def {name}(self, {arg})'")
            continue
        if name != "close" and not inspect.iscoroutinefunction(fn):
            problems.append(f"{cls.__name__}.{name} must be 'async def'")
            continue
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
        if len(params) != nargs + 1:  # + self
            want = "(self" + (", task)" if name == "reset" else ", action)" if name == "step" else ")")
            problems.append(f"{cls.__name__}.{name} must take {want}")
    timeout = getattr(cls, "step_timeout_s", None)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        problems.append(f"{cls.__name__}.step_timeout_s must be a positive number of seconds")
    return problems


def tools_problems(env: Any) -> list[str]:
    """What keeps the environment instance ``env`` from offering its tools: no ``tools``
    attribute, or one that is not a ``ToolBox``. Empty when it fits (``astraflow check``)."""
    name = type(env).__name__
    try:
        tools = env.tools
    except AttributeError:
        return [f"{name} has no tools: set self.tools = ToolBox([...]) in __init__ (ToolBox([]) for none; "
                "astraflow.agents.tools), or subclass astraflow.agents.env.EnvironmentBase"]
    if not callable(getattr(tools, "schemas", None)):
        return [f"{name}.tools is a {type(tools).__name__}, not an astraflow.agents.tools.ToolBox"]
    return []


def check_messages(messages: Any, where: str) -> list[Message]:
    """``messages`` if it is a list of ``{"role", "content"}`` string dicts with an observation
    role, else ``EpisodeError`` naming ``where`` it came from."""
    if not isinstance(messages, list):
        raise EpisodeError(f"{where} returned {type(messages).__name__}, not a list of messages")
    for m in messages:
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)):
            raise EpisodeError(f"{where} returned a message that is not {{'role': str, 'content': str}}: {m!r}")
        if m["role"] not in OBSERVATION_ROLES:
            raise EpisodeError(f"{where} returned a message with role {m['role']!r}; "
                               f"observations use {OBSERVATION_ROLES}")
        try:  # stored with the episode as sorted JSON: a key that fails it would fail the node's whole write
            json.dumps(m, sort_keys=True, default=str)
        except (TypeError, ValueError, RecursionError) as err:
            raise EpisodeError(f"{where} returned a message that cannot be stored as JSON ({type(err).__name__}: "
                               f"{err}); give every key as a str and every value as JSON") from None
    return messages
