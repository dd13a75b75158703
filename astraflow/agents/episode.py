"""The multi-turn agent loop, independent of the inference engine.

``run_agent_episode`` drives one environment with one policy: model turn -> tool calls (run by
the environment's ``ToolBox``) or an environment step -> the observation appended as untrained
tokens -> next turn, until the environment says ``done``, ``max_turns`` model turns were taken
or the context budget is spent (a *truncation*: recorded, not an error). It returns an
``EpisodeLog``: one token sequence with its loss mask, behaviour log-probs and per-token weight
versions, the rewards, the turns (for the episode viewer) and the episode's statistics.

The engine enters only through ``generate(tokens, max_new_tokens)``, an async callable
returning an object with ``tokens``, ``logprobs``, ``versions``, ``finish_reason`` and
``engine_seconds`` (a RaaS node's engine, or a local model in a warm start).
"""

from __future__ import annotations

import collections
import inspect
import logging
import math
import numbers
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Mapping

import numpy as np

from astraflow.agents.call_threads import CANCEL_STUCK, CallAbandoned, CallDeadline, awaited
from astraflow.agents.chat import ChatRenderer
from astraflow.agents.env import Environment, EpisodeError, StepResult, check_messages
from astraflow.agents.tools import parse_action

Generate = Callable[[list[int], int], Awaitable[Any]]

logger = logging.getLogger("astraflow.agents")


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 8
    """Model turns at most; an episode that reaches it without ``done`` is truncated."""
    max_context_tokens: int = 1024
    """Tokens of the whole episode at most; one that would pass it is truncated."""
    max_new_tokens: int = 64
    """Token budget of one model turn."""
    max_observation_chars: int = 16_000
    """Characters of one tool result or observation message at most; a longer one is cut
    (with a note of how much) before it is tokenised, so the model still sees a result."""
    invalid_call_penalty: float = 0.0
    """Taken off the episode's return per invalid tool call, as a per-turn reward of the turn
    that made it (0: invalid calls cost only the turn)."""


def capped(text: str, cap: int) -> str:
    """``text`` cut to ``cap`` characters, with a note the model can read."""
    if len(text) <= cap:
        return text
    return f"{text[:cap]}\n[... {len(text) - cap} more characters cut: the result had {len(text)}]"


def _capped_messages(messages: list[dict], cap: int) -> list[dict]:
    return [{**m, "content": capped(m["content"], cap)}
            if isinstance(m.get("content"), str) and len(m["content"]) > cap else m for m in messages]


def start_tokens(renderer: ChatRenderer, env: Environment, first: list[dict]) -> list[int]:
    """The tokens an episode starts from: the first observation ``first`` (capped already) with
    the schemas of ``env``'s tools, which the template may list in its system prompt."""
    schemas = getattr(env.tools, "schemas", None)
    return renderer.start(first, tools=schemas() if schemas else None)


@dataclass
class EpisodeLog:
    """What one episode produced (see the module docstring)."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: the turns in order: ``{"kind": "observation" | "model" | "tool" | "env", "start", "end",
    #: ...}`` with token spans into ``tokens`` (what the episode viewer renders)
    turns: list[dict[str, Any]] = field(default_factory=list)
    final_reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    success: float = 0.0
    done: bool = False
    truncated: str | None = None  # "max_turns" | "context" | None
    finish_reason: str = "stop"
    tool_calls: int = 0  # call attempts, malformed ones included
    invalid_calls: int = 0
    engine_seconds: float = 0.0
    tool_seconds: float = 0.0
    env_seconds: float = 0.0

    @property
    def reward(self) -> float:
        """The episode's return: the final reward plus every per-turn reward."""
        return self.final_reward + float(sum(self.turn_rewards))

    def stats(self) -> dict[str, float]:
        model_turns = sum(1 for t in self.turns if t["kind"] == "model")
        return {"turns": float(model_turns), "tool_calls": float(self.tool_calls),
                "invalid_calls": float(self.invalid_calls), "truncated": float(self.truncated is not None),
                "success": float(self.success), "engine_s": self.engine_seconds,
                "tool_s": self.tool_seconds, "env_s": self.env_seconds}

    def append(self, ids: list[int], *, kind: str, **info: Any) -> None:
        """Untrained tokens (observation, closing) as a turn of ``kind`` (``None``: no turn)."""
        start = len(self.tokens)
        self.tokens += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        if kind:
            self.turns.append({"kind": kind, "start": start, "end": len(self.tokens), **info})

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": np.asarray(self.tokens, np.int32), "loss_mask": np.asarray(self.loss_mask, bool),
                "logprobs": np.asarray(self.logprobs, np.float32), "versions": np.asarray(self.versions, np.int32)}


async def timed(coro: Awaitable[Any], timeout: float, what: str) -> tuple[Any, float]:
    """``(result, seconds)`` of an environment call, any failure or a missed deadline an ``EpisodeError``."""
    t0 = time.perf_counter()
    try:
        out = await awaited(coro, timeout)
    except CallAbandoned:
        raise EpisodeError(f"{what} ran past its {timeout:g} s deadline and {CANCEL_STUCK}") from None
    except CallDeadline:  # not a TimeoutError the call raised itself
        raise EpisodeError(f"{what} ran past its {timeout:g} s deadline") from None
    except EpisodeError:
        raise
    except (Exception, SystemExit) as err:  # sys.exit in an environment ends its episode, not the process
        raise EpisodeError(f"{what} raised {type(err).__name__}: {err}") from err
    return out, time.perf_counter() - t0


async def run_agent_episode(generate: Generate, renderer: ChatRenderer, env: Environment,
                            task: Mapping[str, Any], limits: AgentLimits) -> EpisodeLog:
    """One episode of ``env`` on ``task``; ``env.close()`` is awaited whatever happens (one that fails
    is logged as a warning: the episode's own outcome stands)."""
    log = EpisodeLog()
    timeout = float(env.step_timeout_s)
    try:
        first, secs = await timed(env.reset(task), timeout, f"{type(env).__name__}.reset")
        log.env_seconds += secs
        first = _capped_messages(check_messages(first, f"{type(env).__name__}.reset"), limits.max_observation_chars)
        if not first:  # else a template's own error about an empty conversation would name the template
            raise EpisodeError(f"{type(env).__name__}.reset returned no message: return the first observation, "
                               "at least one message (the task for the model)")
        log.append(start_tokens(renderer, env, first), kind="observation", messages=first)
        # kept free for the closing a turn cut by its budget gets: the stored episode stays in the budget
        reserve = len(renderer.close_turn(False))
        if len(log.tokens) + reserve >= limits.max_context_tokens:
            raise EpisodeError(f"the first observation has {len(log.tokens)} tokens, more than the "
                               f"context budget of {limits.max_context_tokens} leaves for a turn: raise "
                               "workload.params.max_context_tokens, or lower max_observation_chars or "
                               f"shorten what {type(env).__name__}.reset returns")
        for turn in range(limits.max_turns):
            room = limits.max_context_tokens - len(log.tokens) - reserve
            gen = await generate(list(log.tokens), min(limits.max_new_tokens, room))
            action, ended = _record_model_turn(log, gen, renderer)
            closing = renderer.close_turn(ended)
            if action.tool_calls or action.errors:
                result, calls = await _run_tools(env, action, log, limits)
                kind = "tool"
            else:
                result, secs = await timed(env.step(action), timeout, f"{type(env).__name__}.step")
                log.env_seconds += secs
                result, kind, calls = _checked_step(result, type(env).__name__, limits), "env", []
            if result.done:
                _record_end(log, result, kind, calls, type(env).__name__)
                break
            if result.reward:
                log.turn_rewards.append(float(result.reward))
            if turn == limits.max_turns - 1:  # no turn follows: its observation would be context no one reads
                _record_unread(log, "max_turns", closing, kind, result, calls)
                break
            try:
                obs = closing + renderer.observation(result.observation)
            except Exception as err:  # the template's own error (jinja2's): this episode's failure
                raise EpisodeError(f"the chat template cannot render {type(env).__name__}'s observation "
                                   f"({type(err).__name__}: {err})") from err
            if len(log.tokens) + len(obs) + reserve >= limits.max_context_tokens:
                _record_unread(log, "context", closing, kind, result, calls)
                break
            log.append(obs, kind=kind, messages=result.observation, reward=float(result.reward), calls=calls)
        return log
    finally:
        name = type(env).__name__
        try:
            closing = env.close()
            if inspect.isawaitable(closing):  # a plain (synchronous) close has run already
                await timed(closing, timeout, f"{name}.close")
        except (Exception, SystemExit) as err:  # a failing close must not hide the episode's outcome: logged
            _close_failed(name, err)


#: per environment class and error type: how many closes failed in this process
_CLOSE_FAILURES: collections.Counter = collections.Counter()


def _close_failed(name: str, err: BaseException) -> None:
    """A failed ``close``, logged without flooding the node's log (a close that always fails
    fails every episode): the first with its traceback, then at the 10th, 100th, ... time."""
    n = _CLOSE_FAILURES[name, type(err).__name__] = _CLOSE_FAILURES[name, type(err).__name__] + 1
    if str(n).rstrip("0") != "1":  # neither the first nor a power of ten
        return
    why = err if isinstance(err, EpisodeError) else f"{name}.close raised {type(err).__name__}: {err}"
    logger.warning("%s (the episode's own outcome stands; what the environment holds may not be released)%s",
                   why, f" [{n} times in this process]" if n > 1 else "", exc_info=err if n == 1 else None)


def _record_model_turn(log: EpisodeLog, gen: Any, renderer: ChatRenderer) -> tuple[Any, bool]:
    """Append the engine's answer as a trained model turn; ``(the action it asks for, whether the
    turn ended on its own end-of-turn token)``."""
    log.engine_seconds += float(gen.engine_seconds)
    gen_ids = [int(t) for t in gen.tokens]
    ended = renderer.ended(gen_ids, gen.finish_reason)
    start = len(log.tokens)
    log.tokens += gen_ids
    log.loss_mask += [True] * len(gen_ids)
    log.logprobs += [float(x) for x in gen.logprobs]
    vs = [int(v) for v in gen.versions]
    log.versions += vs
    log.finish_reason = gen.finish_reason
    text = renderer.tok.decode(gen_ids[:-1] if ended else gen_ids, skip_special_tokens=False)
    log.turns.append({"kind": "model", "start": start, "end": len(log.tokens), "text": text,
                      "versions": [min(vs), max(vs)] if vs else [], "finish": gen.finish_reason})
    return parse_action(text), ended


async def _run_tools(env: Environment, action: Any, log: EpisodeLog,
                     limits: AgentLimits) -> tuple[StepResult, list[dict[str, Any]]]:
    """Run the turn's tool calls through ``env.tools``: their results as one observation (in the
    order the calls were written; a call that could not be read answered with its error), with
    the turn's reward (``invalid_call_penalty`` per invalid call, negated), and the calls as the
    episode viewer shows them."""
    messages, calls, invalid = [], [], log.invalid_calls
    for call in action.in_order():
        log.tool_calls += 1
        if isinstance(call, str):  # a call that could not be read still counts as one
            log.invalid_calls += 1
            messages.append({"role": "tool", "content": f"error: {call}"})
            calls.append({"error": call, "valid": False})
            continue
        res = await env.tools.run(call)
        log.tool_seconds += res.seconds
        log.invalid_calls += 0 if res.valid else 1
        content = capped(res.content, limits.max_observation_chars)
        messages.append({"role": "tool", "content": content})
        calls.append({"name": call.name, "arguments": dict(call.arguments), "result": content, "valid": res.valid})
    penalty = limits.invalid_call_penalty * (log.invalid_calls - invalid)
    return StepResult(observation=messages, reward=-penalty if penalty else 0.0), calls


def _checked_step(result: Any, name: str, limits: AgentLimits) -> StepResult:
    """``env.step``'s answer checked (an ``EpisodeError`` naming what is wrong), its observation
    capped and its ``done`` a plain boolean."""
    if not isinstance(result, StepResult):
        raise EpisodeError(f"{name}.step returned {type(result).__name__}, not a StepResult")
    check_messages(result.observation, f"{name}.step")
    reward, info = _plain(result.reward), result.info
    if isinstance(reward, bool):  # "not a finite number" would puzzle whoever wrote reward=(answer == secret)
        raise EpisodeError(f"{name}.step returned reward {reward!r}, a bool: give a number, "
                           f"reward=float(...), and the bool as info['success']")
    if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EpisodeError(f"{name}.step returned reward {reward!r}, not a finite number")
    if not isinstance(info, Mapping):
        raise EpisodeError(f"{name}.step returned info of type {type(info).__name__}, not a mapping (a dict)")
    done = _plain(result.done)  # a string such as "no" would be true, and end the episode
    if isinstance(done, int) and done in (0, 1):
        done = bool(done)
    if not isinstance(done, bool):
        raise EpisodeError(f"{name}.step returned done {done!r} of type {type(result.done).__name__}, not a "
                           "boolean (True or False)")
    return replace(result, done=done, observation=_capped_messages(result.observation, limits.max_observation_chars))


def _record_unread(log: EpisodeLog, truncated: str, closing: list[int], kind: str, result: StepResult,
                   calls: list[dict[str, Any]]) -> None:
    """The episode ends, ``truncated``, on the model turn's ``closing``: the environment's answer
    is recorded for the viewer (as a done episode's last observation is) but not tokenised."""
    log.truncated = truncated
    log.append(closing, kind="")
    log.turns.append({"kind": kind, "start": len(log.tokens), "end": len(log.tokens), "messages": result.observation,
                      "reward": float(result.reward), "calls": calls})


def _record_end(log: EpisodeLog, result: StepResult, kind: str, calls: list[dict[str, Any]], name: str) -> None:
    """The environment said ``done``: its reward and success are the episode's, and its last
    observation is recorded for the viewer (nothing follows it, so it is not tokenised)."""
    log.final_reward, log.done = float(result.reward), True
    success = _plain(result.info.get("success", result.reward))
    if not isinstance(success, numbers.Real) or not math.isfinite(float(success)):
        raise EpisodeError(f"{name}.step returned info['success'] {success!r}, not a finite number or a boolean")
    log.success = float(success)
    log.turns.append({"kind": kind, "start": len(log.tokens), "end": len(log.tokens), "messages": result.observation,
                      "reward": float(result.reward), "done": True, "calls": calls, "info": _jsonable(result.info)})


def _plain(value: Any) -> Any:
    """A NumPy scalar (``np.float32``, ``np.bool_``: what comparing arrays gives) as the Python
    number it holds; anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _jsonable(info: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in info.items():
        v = _plain(v)
        out[str(k)] = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
    return out
