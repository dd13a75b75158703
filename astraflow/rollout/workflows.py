"""Workflows: the episode logic a RaaS node runs (the rollout side of a workload).

A *workflow* drives one or more policies' engines over a task (``single_turn``,
``solver_verifier``, ``solver_selector``, ``solver_testgen``) and scores the result with the task's workload; it is
registered by name and chosen in the config (``workload.workflow``), and a user's workflow is
``package.module:name``. A RaaS node calls ``run_episode(engines, task)`` and knows nothing else
about it.

A workflow scores with ``await self.score(text, payload)``: the workload's reward runs on a
thread under a deadline, off the node's event loop (a reward that hangs fails its episode
instead of freezing the node, heartbeats included; its thread is abandoned, so hung rewards
never hold up the healthy ones).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import time
from dataclasses import replace
from typing import Any, ClassVar, Mapping, Protocol

import numpy as np

from astraflow.agents.chat import prompt_ids
from astraflow.contracts import NOT_GENERATED, Provenance, RolloutTask, Sequence, Trajectory
from astraflow.agents.call_threads import CallDeadline, CallThreads
from astraflow.rollout.engine import Generation, InferenceEngine, SamplingParams
from astraflow.registry import Registry
from astraflow.workloads.base import Workload
from astraflow.workloads.rewards import RewardError
from astraflow.workloads.prompts import (  # noqa: F401  (re-exported)
    SELECT_NEW_TOKENS, VERIFY_NEW_TOKENS, parse_pick, parse_verdict, retry_prompt, select_prompt, verify_prompt,
)


class Workflow(Protocol):
    """Episode logic. ``engines`` maps every policy of the task to its engine."""

    #: how many policies the workflow drives, in ``RolloutTask.policies`` order (the run's
    #: ``policies`` list must name one per role).
    num_policies: ClassVar[int]

    async def run_episode(
        self, engines: Mapping[str, InferenceEngine], task: RolloutTask
    ) -> Trajectory: ...


class UnknownPolicy(KeyError):
    """A workflow asked for the engine of a policy the run does not train."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0])


class PolicyEngines(dict):
    """A node's engines by policy name, as its workflow gets them: a name the run's config does not
    list (a workflow that hard-codes ``engines["verifier"]`` in a run whose policy is ``judge``)
    fails the episode naming the run's policies and the portable way to pick one."""

    def __missing__(self, key: Any) -> InferenceEngine:
        raise UnknownPolicy(f"engines[{key!r}]: the run has no policy named {key!r} (its policies: "
                            f"{', '.join(self) or 'none'}); take a role's policy as task.policies[i], in the "
                            "order of the config's policies")


WORKFLOWS: Registry = Registry("workflow")

#: deadline of one reward call when none is given (``rollout.reward_timeout_s`` sets it)
REWARD_TIMEOUT_S = 30.0

#: shared by the reward calls of every workflow of the process: each call on a daemon thread of its
#: own; a reward past its deadline is abandoned and gives its slot back (a thread cannot be killed),
#: so rewards that hang never starve the healthy ones
_REWARD_THREADS = CallThreads(32, name="astraflow-reward")


class RewardTimeout(TimeoutError):
    """A reward call ran past its deadline (the episode fails and its task is retried)."""


def not_a_workflow(obj: Any) -> str | None:
    """Why ``obj`` (what ``workload.workflow`` names) cannot be a node's workflow, or None: a
    node builds it with ``workload``, ``sampling`` and ``node`` and awaits its ``run_episode``."""
    if not isinstance(obj, type):
        return f"is a {type(obj).__name__}, not a class"
    n = getattr(obj, "num_policies", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"has num_policies {n!r}, not the number of policies it drives (1 or more)"
    if not inspect.iscoroutinefunction(getattr(obj, "run_episode", None)):
        return "has no async run_episode(engines, task)"
    try:
        inspect.signature(obj).bind(workload=None, sampling=None, node=None)
    except TypeError:
        return "cannot be built with workload=, sampling= and node= keywords"
    except ValueError:  # no signature to read: building it will tell
        pass
    return None


def workflow_class(name: str) -> type[Workflow]:
    """The workflow class registered as ``name``. ``"package.module:name"`` imports a user
    module first (which registers its workflows), so a new workflow needs no change here."""
    # the workflows that build on this module register on import: "agent", "solver_testgen", "sim"
    for module in ("astraflow.rollout.agent", "astraflow.rollout.testgen", "astraflow.rollout.sim_workflow"):
        importlib.import_module(module)

    return WORKFLOWS.resolve(name)


def make_workflow(name: str, workload: Workload, sampling: SamplingParams, node: str,
                  reward_timeout_s: float = REWARD_TIMEOUT_S) -> Workflow:
    """Workflow ``name``, built with these keywords (``reward_timeout_s`` only for a
    ``WorkflowBase`` subclass: a workflow class of its own takes the first three)."""
    cls = workflow_class(name)
    extra = {"reward_timeout_s": reward_timeout_s} if isinstance(cls, type) and issubclass(cls, WorkflowBase) else {}
    return cls(workload=workload, sampling=sampling, node=node, **extra)


def sampling_for(task: RolloutTask, default: SamplingParams) -> SamplingParams:
    """The task's sampling overrides applied to the node's defaults."""
    if not task.sampling:
        return default
    return replace(default, **dict(task.sampling))


def turn_sequence(prompt: list[int], gen: Generation, policy_index: int, reward: float) -> Sequence:
    """A prompt + one generated turn as a ``Sequence`` (prompt tokens carry no loss)."""
    n_p, n = len(prompt), len(prompt) + len(gen.tokens)
    tokens = np.empty(n, np.int32)
    tokens[:n_p], tokens[n_p:] = prompt, gen.tokens
    loss_mask = np.zeros(n, bool)
    loss_mask[n_p:] = True
    logprobs = np.zeros(n, np.float32)
    logprobs[n_p:] = gen.logprobs
    policy_ids = np.full(n, NOT_GENERATED, np.int16)
    policy_ids[n_p:] = policy_index
    versions = np.full(n, NOT_GENERATED, np.int32)
    versions[n_p:] = gen.versions
    return Sequence(tokens=tokens, loss_mask=loss_mask, logprobs=logprobs, policy_ids=policy_ids,
                    versions=versions, reward=float(reward), finish_reason=gen.finish_reason)


class WorkflowBase:
    """The base of a workflow: built with the run's workload, the node's sampling defaults and
    the node's name; ``score`` runs the workload's reward under ``reward_timeout_s``;
    ``trajectory`` wraps an episode's sequences with the task's identity and the node's provenance."""

    #: how many policies the workflow drives (``RolloutTask.policies`` order).
    num_policies = 1

    def __init__(self, workload: Workload, sampling: SamplingParams, node: str,
                 reward_timeout_s: float = REWARD_TIMEOUT_S):
        self.workload = workload
        self.sampling = sampling
        self.node = node
        self.reward_timeout_s = reward_timeout_s

    async def score(self, completion: str, payload: Mapping) -> float:
        """``workload.reward(completion, payload)`` off the event loop, as a float; ``RewardTimeout``
        past ``reward_timeout_s``; ``RewardError`` naming the workload when it raises or returns
        something that is not a finite number."""
        return self._number(await self._in_pool(self.workload.reward, completion, payload), "reward")

    async def score_and_stats(self, completion: str, payload: Mapping) -> tuple[float, dict[str, float]]:
        """The reward and the episode statistics of a workload that reports them
        (``reward_and_stats``: how a program ended, say), else ``score`` and no statistics."""
        fn = getattr(self.workload, "reward_and_stats", None)
        if fn is None:
            return await self.score(completion, payload), {}
        out = await self._in_pool(fn, completion, payload, "reward_and_stats")
        try:
            reward, stats = out
            stats = {k: float(v) for k, v in stats.items()}
        except (TypeError, ValueError, AttributeError):
            raise RewardError(f"{type(self.workload).__name__}.reward_and_stats returned {repr(out)[:60]}, "
                              "not a (reward, {name: number}) pair") from None
        return self._number(reward, "reward_and_stats"), stats

    def _number(self, out: Any, method: str) -> float:
        """A reward as a float; ``RewardError`` naming the workload's ``method`` when it is not a finite number."""
        try:
            value = float(out)
        except (TypeError, ValueError, OverflowError):
            value, what = math.nan, "a number"
        else:
            what = "a finite number"
        if not math.isfinite(value):
            raise RewardError(f"{type(self.workload).__name__}.{method} returned {repr(out)[:60]}, not {what}")
        return value

    async def _in_pool(self, fn, completion: str, payload: Mapping, method: str = "reward"):
        """``fn(completion, payload)`` (the workload's ``method``) on a reward thread under
        ``reward_timeout_s``; its errors become a ``RewardError`` naming it."""
        name = f"{type(self.workload).__name__}.{method}"
        queue = None
        if getattr(self.workload, "uses_sandbox", False):
            # waiting for a sandbox slot behind other programs is not this reward running long
            from astraflow.sandbox import default_sandbox

            queue = default_sandbox()
        try:
            return await _REWARD_THREADS.call(lambda: fn(completion, payload), self.reward_timeout_s, queue)
        except CallDeadline:
            raise RewardTimeout(f"{name} ran past its {self.reward_timeout_s:g} s "
                                "deadline (rollout.reward_timeout_s)") from None
        except RewardError:  # already names whose reward failed (a dataset workload's own reward)
            raise
        except Exception as err:
            raise RewardError(f"{name} raised {type(err).__name__}: {err}") from err

    def trajectory(self, task: RolloutTask, seqs: list[Sequence], t0: float, engine_s: float) -> Trajectory:
        """The episode of ``task`` made of ``seqs``, started at ``t0``, ``engine_s`` seconds in engines."""
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
class SingleTurn(WorkflowBase):
    """One policy answers the prompt once; the workload's reward scores the answer (with the
    workload's episode statistics, where it reports them, on the trajectory)."""

    async def run_episode(self, engines: Mapping[str, InferenceEngine], task: RolloutTask) -> Trajectory:
        t0 = time.time()
        policy = task.policies[0]
        engine = engines[policy]
        prompt = prompt_ids(engine.tokenizer, self.workload, task.prompt)
        gen = await engine.generate(prompt, sampling_for(task, self.sampling))
        text = engine.tokenizer.decode(gen.tokens, skip_special_tokens=True)
        reward, stats = await self.score_and_stats(text, task.prompt)
        traj = self.trajectory(task, [turn_sequence(prompt, gen, 0, reward)], t0, gen.engine_seconds)
        return replace(traj, stats=stats) if stats else traj


def _gen_text(engine: InferenceEngine, gen: Generation) -> str:
    return engine.tokenizer.decode(gen.tokens, skip_special_tokens=True)


@WORKFLOWS.register("solver_verifier")
class SolverVerifier(WorkflowBase):
    """Policy 0 (solver) answers; policy 1 (verifier) judges the answer: it may write its
    working first, its verdict is the last Y/N (``parse_verdict``); on a reject the solver gets
    one retry that sees the rejected answer. Solver reward: correctness of the final answer (on
    each of its turns); verifier reward: whether its verdict was right."""

    num_policies = 2

    async def run_episode(self, engines: Mapping[str, InferenceEngine], task: RolloutTask) -> Trajectory:
        t0 = time.time()
        solver, verifier = engines[task.policies[0]], engines[task.policies[1]]
        params = sampling_for(task, self.sampling)
        q = self.workload.render_prompt(task.prompt)
        p1 = solver.tokenizer.encode(q)
        g1 = await solver.generate(p1, params)
        a1 = _gen_text(solver, g1)
        ok1 = await self.score(a1, task.prompt)
        pv = verifier.tokenizer.encode(verify_prompt(q, a1))
        gv = await verifier.generate(pv, replace(params, max_new_tokens=VERIFY_NEW_TOKENS))
        verdict = parse_verdict(_gen_text(verifier, gv))
        turns = [(p1, g1, 0)]
        final = ok1
        if verdict is False:
            p2 = solver.tokenizer.encode(retry_prompt(q, a1))
            g2 = await solver.generate(p2, params)
            final = await self.score(_gen_text(solver, g2), task.prompt)
            turns.append((p2, g2, 0))
        verifier_right = float(verdict is not None and verdict == (ok1 > 0))
        seqs = [turn_sequence(p, g, i, final) for p, g, i in turns]
        seqs.insert(1, turn_sequence(pv, gv, 1, verifier_right))
        secs = sum(g.engine_seconds for _, g, _ in turns) + gv.engine_seconds
        traj = self.trajectory(task, seqs, t0, secs)
        return replace(traj, score=final)


@WORKFLOWS.register("solver_selector")
class SolverSelector(WorkflowBase):
    """Policy 0 (solver) answers twice; policy 1 (selector) picks one, 1 or 2: it may write its
    working first, its pick follows the last ``>`` (``parse_pick``). Solver reward: each
    attempt's own correctness; selector reward: 1 when exactly one attempt was correct and it
    picked that one, 0 when it picked the wrong one or no pick could be read, 0.5 when the pick
    could not matter. The episode's score is the correctness of the picked answer (the first
    attempt's when no pick could be read).

    Under greedy sampling (evaluation) only the first attempt is greedy; the second samples
    at the node's temperature: two greedy attempts are the same answer, which leaves nothing to
    pick from, and the evaluation would measure the solver alone."""

    num_policies = 2

    async def run_episode(self, engines: Mapping[str, InferenceEngine], task: RolloutTask) -> Trajectory:
        t0 = time.time()
        solver, selector = engines[task.policies[0]], engines[task.policies[1]]
        params = sampling_for(task, self.sampling)
        q = self.workload.render_prompt(task.prompt)
        p = solver.tokenizer.encode(q)
        second = replace(params, greedy=False) if params.greedy else params
        g1, g2 = await asyncio.gather(solver.generate(p, params), solver.generate(p, second))
        a1, a2 = _gen_text(solver, g1), _gen_text(solver, g2)
        ok1, ok2 = await asyncio.gather(self.score(a1, task.prompt), self.score(a2, task.prompt))
        ps = selector.tokenizer.encode(select_prompt(q, a1, a2))
        gs = await selector.generate(ps, replace(params, max_new_tokens=SELECT_NEW_TOKENS))
        pick = parse_pick(_gen_text(selector, gs))
        picked_ok = ok2 if pick == 2 else ok1
        if pick is None:
            sel_reward = 0.0
        else:
            sel_reward = (1.0 if picked_ok > 0 else 0.0) if ok1 != ok2 else 0.5
        seqs = [turn_sequence(p, g1, 0, ok1), turn_sequence(p, g2, 0, ok2), turn_sequence(ps, gs, 1, sel_reward)]
        secs = g1.engine_seconds + g2.engine_seconds + gs.engine_seconds
        return replace(self.trajectory(task, seqs, t0, secs), score=picked_ok)
