"""How the conformance suite watches an environment's calls: each ``reset``, ``step``, ``close``
and tool call timed for a stretch that holds the event loop (a blocking call in an ``async
def``), and what they return checked for JSON, as an episode stores it with its log.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from astraflow.agents.tools import ToolBox

#: seconds an environment call may run without giving the event loop back: a longer stretch is
#: a blocking call, which stalls every episode and the heartbeats of the node that runs it (far
#: above what a busy machine's scheduler alone adds to a short stretch)
BLOCKING_S = 1.0


class _Stretches:
    """Awaits ``coro`` timing each stretch it runs without giving the event loop back (from one
    of its waits to the next): ``longest`` is what a blocking call in it held the loop for."""

    def __init__(self, coro: Any):
        self.coro, self.longest = coro, 0.0

    def __await__(self):
        inner = self.coro.__await__()
        resume = functools.partial(inner.send, None)
        while True:
            t0 = time.perf_counter()
            try:
                waiting = resume()
            except StopIteration as stop:
                return stop.value
            finally:
                self.longest = max(self.longest, time.perf_counter() - t0)
            try:
                answer = yield waiting
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as err:  # a cancellation or an error for the awaited: passed on
                resume = functools.partial(inner.throw, err)
            else:
                resume = functools.partial(inner.send, answer)


class Counted:
    """An environment seen through a wrapper that counts ``close`` calls, keeps what a ``close``
    raised (the loop swallows it so as not to hide the episode's own outcome), and notes in
    ``findings`` (by key, each once) a call that blocked the event loop and a payload that is
    not JSON."""

    def __init__(self, env: Any, findings: dict[str, str]):
        self.env, self.closes, self.close_error, self.findings = env, 0, None, findings
        self.step_timeout_s = env.step_timeout_s

    @property
    def tools(self) -> Any:
        return _TimedTools(self.env.tools, self)

    async def timed(self, what: str, call: Any) -> Any:
        """``await call``, noting a stretch past ``BLOCKING_S`` that ``what`` held the loop for."""
        if not inspect.isawaitable(call):
            return call
        stretches = _Stretches(call)
        try:
            return await stretches
        finally:
            if stretches.longest > BLOCKING_S:
                self.note(f"blocked {what}", blocking_problem(type(self.env).__name__, what, stretches.longest))

    def note(self, key: str, problem: str) -> None:
        self.findings.setdefault(key, problem)

    async def reset(self, task: Mapping[str, Any]):
        first = await self.timed("reset", self.env.reset(task))
        if isinstance(first, list):
            for i, m in enumerate(first):
                self.note_json("reset", f"observation message {i}", m)
        return first

    async def step(self, action):
        result = await self.timed("step", self.env.step(action))
        for i, m in enumerate(getattr(result, "observation", None) or []):
            self.note_json("step", f"observation message {i}", m)
        info = getattr(result, "info", None)
        if isinstance(info, Mapping):
            self.note_json("step", "info", info)
        return result

    def note_json(self, method: str, what: str, value: Any) -> None:
        problem = json_problem(f"{type(self.env).__name__}.{method}", what, value)
        if problem is not None:
            self.note(f"json {method} {what.split(' ')[0]}", problem)

    async def close(self) -> None:
        self.closes += 1
        try:
            await self.timed("close", self.env.close())  # a plain (synchronous) close has run already
        except Exception as err:  # any error of the code under test is a finding
            self.close_error = f"{type(err).__name__}: {err}"
            raise


class _TimedTools:
    """An environment's ``ToolBox`` whose calls are timed as its own calls are (``Counted``)."""

    def __init__(self, tools: Any, counted: Counted):
        self._tools, self._counted = tools, counted

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tools, name)

    async def run(self, call: Any) -> Any:
        """The call as ``ToolBox.run`` makes it, an ``async def`` tool's own coroutine timed: it
        runs as a task of its own (``call_threads.awaited``), out of sight of a timing of ``run``."""
        t = getattr(self._tools, "tools", {}).get(call.name)
        if t is None or not inspect.iscoroutinefunction(t.fn):
            return await self._tools.run(call)

        async def timed_fn(**kwargs: Any) -> Any:
            return await self._counted.timed(f"tool {call.name}", t.fn(**kwargs))

        return await ToolBox([replace(t, fn=timed_fn)]).run(call)


def blocking_problem(env: str, what: str, seconds: float) -> str:
    """The problem of ``env``'s call ``what`` that held the event loop ``seconds`` without awaiting."""
    where = f"{env}'s {what}" if what.startswith("tool ") else f"{env}.{what}"
    thread = "make the tool a plain def (it then runs on a thread of its own), or " if what.startswith("tool ") else ""
    return (f"{where} blocked the event loop for {seconds:.2f} s without awaiting (time.sleep, or a request, "
            "file or subprocess call without await, in an async def): every episode on the node waits meanwhile; "
            f"use 'await asyncio.sleep(...)' and async clients, or {thread}run the blocking work in a thread: "
            "'await asyncio.to_thread(fn, ...)'")


def json_problem(call: str, what: str, value: Any) -> str | None:
    """The problem of ``call`` (``Env.step``) returning ``what`` (``info``) that is not JSON, or None."""
    where = not_json(value)
    if where is None:
        return None
    return (f"{call} returned {what}{where[0]} of type {where[1]}, which is not JSON: observations and info "
            "are stored with the episode as JSON (the episode viewer, metrics); give str keys and only str, "
            "finite numbers, booleans, None, lists and dicts")


def not_json(value: Any, path: str = "") -> tuple[str, str] | None:
    """``(where, type name)`` of the first part of ``value`` that is not JSON (a NumPy scalar is
    taken as the number it holds), or None when all of it is."""
    if isinstance(value, np.generic) and not isinstance(value, (np.str_, np.bytes_, np.void)):
        value = value.item()
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"float ({value})")
    if isinstance(value, (list, tuple)):
        return next((w for i, v in enumerate(value) if (w := not_json(v, f"{path}[{i}]")) is not None), None)
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path} (key {k!r})", type(k).__name__
            if (w := not_json(v, f"{path}[{k!r}]")) is not None:
                return w
        return None
    return path, type(value).__name__


class ProcessState:
    """The working directory and environment variables of the process, which every episode on a
    RaaS node shares (and the node itself): an environment or tool that changes them changes them
    for all. Variables an import adds (``torch`` sets some) are not counted; changed or removed
    ones and the directory are, and are put back so that the suite goes on as it started."""

    def __init__(self) -> None:
        self.cwd, self.environ = os.getcwd(), dict(os.environ)

    def problems(self, env: str) -> list[str]:
        """What ``env`` (its class name) changed since this was made, each put back."""
        out, cwd = [], os.getcwd()
        if cwd != self.cwd:
            os.chdir(self.cwd)
            out.append(f"{env} (or a tool of it) changed the process's working directory from {self.cwd} to "
                       f"{cwd} (os.chdir): every episode on the node runs in that process and sees it; use "
                       "absolute paths, or cwd= in subprocess calls, instead")
        changed = sorted(k for k, v in self.environ.items() if os.environ.get(k) != v)
        if changed:
            os.environ.update({k: self.environ[k] for k in changed})
            out.append(f"{env} (or a tool of it) changed or removed os.environ[{', '.join(map(repr, changed[:5]))}]"
                       f"{' ...' if len(changed) > 5 else ''}: every episode on the node runs in that process and "
                       "sees it; pass env= to subprocess calls instead")
        return out
