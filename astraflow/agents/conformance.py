"""The conformance suite: the checks every agentic environment, built-in or a user's, passes.

A run finds a broken environment only when its episodes fail on a RaaS node, retried task by
task. This suite finds it in seconds, on this machine, with scripted model turns instead of a
model: the same loop (``run_agent_episode``), the same tokenizer and chat layout as a run.

    from astraflow.agents.conformance import assert_conforms
    assert_conforms(MyWorkload())                  # in a test: fails listing every problem
    problems = check_environment(MyWorkload())     # or: the problems as a list (empty: conforms)

What it checks, on ``n_tasks`` tasks drawn from both splits:

* the environment class fits the contract (``signature_problems``) and ``environment()``
  returns a fresh instance per call;
* ``tasks(split)`` is a non-empty, deterministic list of JSON-serialisable payloads;
* ``reset`` returns a non-empty list of valid messages, the same for the same task;
* the tools' schemas are JSON-schema objects with unique names;
* garbage turns (random text, an empty turn, malformed tool calls, an unknown tool, wrong
  arguments) never fail the episode: they become a ``StepResult`` or an error observation;
* every episode ends within ``max_turns`` model turns and its deadline, ``close`` is called
  exactly once and does not raise;
* no ``reset``, ``step``, ``close`` or tool call holds the event loop (a blocking call in an
  ``async def``), and observations and ``info`` are JSON;
* the process's working directory and ``os.environ`` are left as they were (``ProcessState``);
* with ``expert_action()``, replaying the expert succeeds on every task, each tool call it writes valid;
  with ``explore_action(rng)``, an episode of its random commands runs like any other.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import string
from typing import Any, Mapping

from astraflow.agents.call_threads import run_abandoning
from astraflow.agents.chat import ChatRenderer
from astraflow.agents.conformance_watch import Counted, ProcessState, json_problem
from astraflow.agents.demos import scripted_turn
from astraflow.agents.env import EpisodeError, check_messages, signature_problems, tools_problems
from astraflow.agents.episode import AgentLimits, EpisodeLog, _capped_messages, start_tokens, timed, run_agent_episode
from astraflow.agents.tools import format_call


def check_environment(workload: Any, n_tasks: int = 4, seed: int = 0, max_new_tokens: int = 256,
                      tokenizer: Any = None) -> list[str]:
    """The problems that keep ``workload``'s environments from running (empty: it conforms).

    ``n_tasks`` tasks are drawn (by ``seed``) from the train and eval splits;
    ``max_new_tokens`` is a model turn's budget (the run's ``workload.sampling.max_new_tokens``);
    ``tokenizer`` defaults to the one ``astraflow model init`` builds."""
    if tokenizer is None:
        from astraflow.models import build_tokenizer

        tokenizer = build_tokenizer()
    return run_abandoning(_Suite(workload, tokenizer, random.Random(seed), max_new_tokens).run(n_tasks))


def assert_conforms(workload: Any, **kwargs: Any) -> None:
    """``check_environment`` for a test: an ``AssertionError`` listing every problem."""
    problems = check_environment(workload, **kwargs)
    if problems:
        raise AssertionError(f"{type(workload).__name__} does not conform:\n  - " + "\n  - ".join(problems))


def _attempt(problems: list[str], what: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``None`` with a problem naming ``what`` when it raises: the suite reports
    every error of the code under test instead of stopping at the first."""
    try:
        return fn(*args)
    except Exception as err:  # any error of the code under test is a finding
        problems.append(f"{what} raised {type(err).__name__}: {err}")
        return None


def schema_problems(schemas: Any) -> list[str]:
    """What is wrong with a ``ToolBox.schemas()`` list: each must be a JSON-serialisable
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` whose
    parameters are an object schema, names unique."""
    if not isinstance(schemas, list):
        return [f"tools.schemas() returned {type(schemas).__name__}, not a list"]
    problems, names = [], []
    for s in schemas:
        fn = s.get("function") if isinstance(s, dict) else None
        if not isinstance(fn, dict) or s.get("type") != "function" or not isinstance(fn.get("name"), str):
            problems.append(f"tool schema {s!r} is not {{'type': 'function', 'function': {{'name': ...}}}}")
            continue
        names.append(fn["name"])
        params = fn.get("parameters")
        where = f"tool {fn['name']}"
        if not isinstance(fn.get("description"), str) or not fn["description"]:
            problems.append(f"{where} has no description (the model reads it)")
        if not isinstance(params, dict) or params.get("type") != "object":
            problems.append(f"{where}: parameters must be a JSON schema of type 'object'")
            continue
        props, required = params.get("properties", {}), params.get("required", [])
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            problems.append(f"{where}: parameters.properties must map each argument to a schema")
        elif not isinstance(required, list) or not set(required) <= set(props):
            problems.append(f"{where}: parameters.required names arguments that are not in properties")
        try:
            json.dumps(s)
        except (TypeError, ValueError) as err:
            problems.append(f"{where}: the schema is not JSON-serialisable ({err})")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"tool names must be unique; repeated: {dup}")
    return problems


class _Suite:
    def __init__(self, workload: Any, tokenizer: Any, rng: random.Random, max_new_tokens: int):
        self.workload, self.tok, self.rng = workload, tokenizer, rng
        self.renderer = ChatRenderer(tokenizer)
        limits = getattr(workload, "limits", None)
        self.limits = limits(max_new_tokens) if callable(limits) else AgentLimits(max_new_tokens=max_new_tokens)
        self.problems: list[str] = []
        #: what the episodes' environments did wrong without failing them (``Counted.note``)
        self.findings: dict[str, str] = {}
        self.env_name = "the environment"

    async def run(self, n_tasks: int) -> list[str]:
        state = ProcessState()
        problems = await self._run(n_tasks)
        return problems + state.problems(self.env_name)

    async def _run(self, n_tasks: int) -> list[str]:
        p = self.problems
        env = _attempt(p, "environment()", self.workload.environment)
        if env is None:
            return p
        self.env_name = type(env).__name__
        p += signature_problems(type(env)) + tools_problems(env)
        if p:
            return p  # an environment off the contract cannot be driven
        if _attempt(p, "environment()", self.workload.environment) is env:
            p.append("environment() returned the same instance twice; return a fresh one per episode")
        tasks = self.tasks(n_tasks)
        reset_ok = [await self.check_reset(i, task) for i, task in enumerate(tasks)]
        if not all(reset_ok):
            return p  # every episode would only repeat what reset got wrong
        if tasks:
            await self.check_garbage(tasks[0])
        if tasks and hasattr(env, "expert_action"):
            for i, task in enumerate(tasks):
                await self.check_expert(i, task)
        if tasks and hasattr(env, "explore_action"):
            rng = random.Random(0)
            await self.episode("playing explore_action's random commands", tasks[0],
                               lambda env: env.explore_action(rng))
        return p + list(self.findings.values())

    def tasks(self, n: int) -> list[Mapping[str, Any]]:
        """``n`` tasks drawn from both splits, after checking the splits."""
        drawn: list[Mapping[str, Any]] = []
        for split in ("train", "eval"):
            tasks = _attempt(self.problems, f"tasks({split!r})", self.workload.tasks, split)
            if tasks is None:
                continue
            if not isinstance(tasks, list) or not tasks:
                self.problems.append(f"tasks({split!r}) must return a non-empty list, got {type(tasks).__name__}"
                                     + ("" if tasks else " (empty)"))
                continue
            if _attempt(self.problems, f"tasks({split!r})", self.workload.tasks, split) != tasks:
                self.problems.append(f"tasks({split!r}) differs between two calls; make it deterministic by seed")
            for i, t in enumerate(tasks):
                try:
                    same = isinstance(t, dict) and json.loads(json.dumps(t)) == t
                except (TypeError, ValueError):
                    same = False
                if not same:
                    self.problems.append(f"tasks({split!r})[{i}] is not a JSON object that survives a round "
                                         f"trip (payloads are stored and sent between processes): {t!r}"[:300])
                    break
            drawn += self.rng.sample(tasks, min(len(tasks), max(1, n // 2)))
        return drawn[:max(1, n)]

    async def check_reset(self, i: int, task: Mapping[str, Any]) -> bool:
        """Two fresh environments reset on ``task``: valid, fitting and equal first observations.
        False when a reset failed."""
        firsts = []
        for _ in range(2):
            env = self.workload.environment()
            timeout = float(env.step_timeout_s)
            try:
                first, _ = await timed(env.reset(task), timeout, f"reset(task {i})")
                check_messages(first, f"reset(task {i})")
                if not first:
                    raise EpisodeError(f"reset(task {i}) returned no message")
                for j, m in enumerate(first):
                    if (problem := json_problem(f"{type(env).__name__}.reset", f"observation message {j}", m)):
                        raise EpisodeError(problem)
                firsts.append(first)
                n = len(start_tokens(self.renderer, env, _capped_messages(first, self.limits.max_observation_chars)))
                if n >= self.limits.max_context_tokens:
                    raise EpisodeError(f"reset(task {i}): the first observation has {n} tokens, not less than "
                                       f"max_context_tokens ({self.limits.max_context_tokens}); raise it")
                if len(firsts) == 1:
                    self.check_tools(env)
            except EpisodeError as err:
                if str(err) not in self.problems:  # a problem of every task is said once
                    self.problems.append(str(err))
                return False
            finally:
                await self.close_after_reset(env, timeout, i)
        if firsts[0] != firsts[1]:
            self.problems.append(f"reset(task {i}) returned different messages for the same task; make it "
                                 "deterministic (seed any randomness from the task)")
        return True

    async def close_after_reset(self, env: Any, timeout: float, i: int) -> None:
        """Close ``env`` after a reset (a plain ``def close`` or an ``async`` one); a failure is a problem."""
        what = f"close after reset(task {i})"
        try:
            closing = env.close()
            if inspect.isawaitable(closing):
                await timed(closing, timeout, what)
        except EpisodeError as err:
            self.problems.append(str(err))
        except Exception as err:  # any error of the code under test is a finding
            self.problems.append(f"{what} raised {type(err).__name__}: {err}")

    def check_tools(self, env: Any) -> None:
        missing = tools_problems(env)
        if missing:
            self.problems += missing
            return
        listed = _attempt(self.problems, "tools.schemas()", env.tools.schemas)
        if listed is not None:
            self.problems += schema_problems(listed)

    def garbage(self, env: Any) -> dict[str, str]:
        """Turns a policy may write: none of them may fail the episode."""
        letters = string.ascii_letters + string.digits + " .,;:!?'\"{}[]"
        turns = {"random text": "".join(self.rng.choice(letters) for _ in range(32)),
                 "an empty turn": "",
                 "an unclosed tool call": '<tool_call>{"name": "x", "arguments": {}}',
                 "a tool call that is not JSON": "<tool_call>{name: calc(1)}</tool_call>",
                 "an unknown tool": format_call("no_such_tool_", {})}
        for name in getattr(getattr(env, "tools", None), "tools", {}):
            turns[f"{name} with wrong arguments"] = format_call(name, {"no_such_argument_": [1, {}]})
        return turns

    async def check_garbage(self, task: Mapping[str, Any]) -> None:
        probe = self.workload.environment()
        for what, text in self.garbage(probe).items():
            log = await self.episode(f"on {what} ({text!r})", task, lambda env, t=text: t)
            if log is not None and what != "random text" and what != "an empty turn" and not log.invalid_calls:
                self.problems.append(f"on {what} ({text!r}) the model got no error observation")

    async def check_expert(self, i: int, task: Mapping[str, Any]) -> None:
        async def expert(env: Any) -> str:
            turn = env.expert_action()
            return await turn if inspect.isawaitable(turn) else turn

        log = await self.episode(f"replaying the expert on task {i}", task, expert)
        if log is not None and not (log.done and log.success == 1.0):
            why = f"it was truncated ({log.truncated})" if log.truncated else f"success {log.success}"
            self.problems.append(f"replaying the expert on task {i} did not succeed: {why}; "
                                 f"turns: {[t.get('text') for t in log.turns if t['kind'] == 'model']}"[:400])
        elif log is not None and log.invalid_calls:  # the tool never ran; a warm start drops such demonstrations
            cut = any(t.get("finish") == "length" for t in log.turns if t["kind"] == "model")
            self.problems.append(f"replaying the expert on task {i}: {log.invalid_calls} of its tool calls were "
                                 "invalid and never ran the tool; " + (f"a turn was cut at workload.sampling."
                                 f"max_new_tokens ({self.limits.max_new_tokens}): raise it" if cut else "fix them"))

    async def episode(self, what: str, task: Mapping[str, Any], turn: Any) -> EpisodeLog | None:
        """One episode of a fresh environment whose model turns are ``turn(env)``; the log, or
        ``None`` with a problem when it failed, overran, or closed other than once."""
        inner = self.workload.environment()
        # named like the environment's class: the loop's messages name it
        env = type(type(inner).__name__, (Counted,), {})(inner, self.findings)
        tok, eos = self.tok, self.renderer.end_id

        async def generate(tokens: list[int], max_new: int) -> Any:
            text = turn(env.env)
            text = await text if inspect.isawaitable(text) else text
            if not isinstance(text, str):
                raise EpisodeError(f"the scripted turn is {type(text).__name__}, not text")
            ids = list(tok.encode(text, add_special_tokens=False)) + ([eos] if eos is not None else [])
            return scripted_turn(ids[:max_new], "stop" if len(ids) <= max_new else "length")

        tools = getattr(getattr(env.env, "tools", None), "tools", {})
        tool_s = max([float(t.timeout_s) for t in tools.values()], default=0.0) * max(1, len(tools))
        deadline = (self.limits.max_turns + 1) * (float(env.step_timeout_s) + tool_s) + 5.0
        try:
            log = await asyncio.wait_for(run_agent_episode(generate, self.renderer, env, task, self.limits), deadline)
        except asyncio.TimeoutError:
            self.problems.append(f"{what}: the episode did not end within {deadline:g} s")
            return None
        except EpisodeError as err:
            self.problems.append(f"{what}: the episode failed: {err}")
            log = None
        except Exception as err:  # any error of the code under test is a finding
            self.problems.append(f"{what}: the episode raised {type(err).__name__}: {err}")
            log = None
        if env.closes != 1:
            self.problems.append(f"{what}: close() was called {env.closes} times, not once")
        if env.close_error:
            self.problems.append(f"{what}: close() raised {env.close_error}")
        if log is not None:
            model_turns = sum(1 for t in log.turns if t["kind"] == "model")
            if model_turns > self.limits.max_turns or not (log.done or log.truncated):
                self.problems.append(f"{what}: the episode took {model_turns} turns (max_turns "
                                     f"{self.limits.max_turns}) and ended neither done nor truncated")
        return log
