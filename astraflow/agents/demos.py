"""Expert demonstrations and local greedy episodes, for warm starts and evaluation.

* ``demonstration``: one episode in which the environment's scripted expert
  (``env.expert_action()``) writes every model turn. The result has the exact token layout of
  a RaaS rollout (``run_agent_episode`` builds both), so a warm start trains on what RL will
  continue from: loss on the expert's turns only. With ``noise`` the expert is epsilon-greedy:
  that share of its turns is the environment's ``explore_action(rng)`` instead (a random
  plausible command), and the expert recovers from where it led.
* ``greedy_success``: held-out success of a local model, its episodes run concurrently and their
  turns decoded greedily in one batch per round (lockstep), so a warm start can stop at a
  target competence.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from astraflow.agents.call_threads import run_abandoning
from astraflow.agents.chat import ChatRenderer
from astraflow.agents.episode import AgentLimits, EpisodeLog, run_agent_episode
from astraflow.agents.tools import CALL_OPEN

logger = logging.getLogger(__name__)


@dataclass
class _Turn:
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    engine_seconds: float = 0.0


def scripted_turn(ids: list[int], finish: str) -> _Turn:
    """A model turn that was not sampled (an expert's, a test's): the shape ``generate`` returns."""
    n = len(ids)
    return _Turn(np.asarray(ids, np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32), finish)


async def demonstration(workload: Any, renderer: ChatRenderer, task: Mapping[str, Any],
                        limits: AgentLimits, noise: float = 0.0, rng: random.Random | None = None,
                        cut: list[tuple[int, bool]] | None = None) -> EpisodeLog:
    """The scripted expert's episode of ``task`` (the environment must offer ``expert_action``,
    and ``explore_action`` when ``noise`` > 0). A turn longer than its token budget is cut, as a
    model's would be; ``cut`` collects ``(full length, whether it holds a tool call)`` of each."""
    env = workload.environment()
    if not callable(getattr(env, "expert_action", None)):
        raise ValueError(f"{type(env).__name__} has no expert_action(): it cannot make demonstrations")
    if noise > 0 and not callable(getattr(env, "explore_action", None)):
        raise ValueError(f"{type(env).__name__} has no explore_action(rng): demonstrations with noise need "
                         "one; set init.demo_noise: 0")
    rng = rng or random.Random(0)

    async def generate(tokens: list[int], max_new: int) -> _Turn:
        turn = env.explore_action(rng) if noise > 0 and rng.random() < noise else env.expert_action()
        ids = renderer.encode(turn) + [renderer.end_id]
        if len(ids) > max_new and cut is not None:
            cut.append((len(ids), CALL_OPEN in turn))
        return scripted_turn(ids[:max_new], "stop" if len(ids) <= max_new else "length")

    return await run_agent_episode(generate, renderer, env, task, limits)


def demonstrations(workload: Any, renderer: ChatRenderer, tasks: list[Mapping[str, Any]],
                   limits: AgentLimits, noise: float = 0.0, seed: int = 0,
                   keep_cut: bool = False) -> list[EpisodeLog]:
    """``demonstration`` of each task (successful ones only: an expert that fails teaches
    nothing; with ``noise``, the episodes its detours made fail are left out too).

    Expert turns cut to their token budget are reported in one warning naming the setting to
    raise. An episode with a cut tool-call turn is left out too, unless ``keep_cut``: it would
    teach a broken call (a ``ValueError`` when that leaves no demonstration at all)."""
    rng = random.Random(f"demonstrations:{seed}")
    cuts: list[list[tuple[int, bool]]] = [[] for _ in tasks]

    async def all_of() -> list[EpisodeLog]:
        return [await demonstration(workload, renderer, t, limits, noise, rng, cut)
                for t, cut in zip(tasks, cuts)]

    logs = run_abandoning(all_of())
    if keep_cut or not any(cuts):
        return [log for log in logs if log.success > 0]
    broken = [any(call for _, call in cut) for cut in cuts]
    ok = [log for log, bad in zip(logs, broken) if log.success > 0 and not bad]
    dropped = sum(1 for log, bad in zip(logs, broken) if log.success > 0 and bad)
    why = _cut_warning(workload, limits, cuts, dropped)
    if not ok and dropped:
        raise ValueError(why)
    logger.warning("%s", why)
    return ok


def _cut_warning(workload: Any, limits: AgentLimits, cuts: list[list[tuple[int, bool]]], dropped: int) -> str:
    """What the cut expert turns were, what was left out, and which setting to raise."""
    n, longest = sum(len(c) for c in cuts), max(n for c in cuts for n, _ in c)
    if longest > limits.max_new_tokens:
        fix = f"raise workload.sampling.max_new_tokens ({limits.max_new_tokens}) to at least {longest}"
    else:  # cut by what was left of the episode's context, not by the turn budget
        fix = f"raise workload.params.max_context_tokens ({limits.max_context_tokens})"
    left = (f"{dropped} successful demonstration(s) with a cut tool call are left out (it would teach a "
            "broken call)" if dropped else "they are trained on as cut")
    return (f"{type(workload).__name__}: {n} expert turn(s) in {sum(1 for c in cuts if c)} demonstration(s) were "
            f"cut to their token budget (the longest expert turn has {longest} tokens); {left}: {fix}")


def demonstration_texts(workload: Any, tasks: list[Mapping[str, Any]], tokenizer: Any,
                        max_new_tokens: int = 1024) -> list[str]:
    """The text of each successful expert episode of ``tasks`` (special and tool-call tokens
    left out): the corpus a tokenizer for this workload is trained on, so that observations,
    tool results and the expert's turns all merge into few tokens."""
    renderer = ChatRenderer(tokenizer)
    # a cut turn's text still teaches the tokenizer the workload's words
    logs = demonstrations(workload, renderer, tasks, workload.limits(max_new_tokens), keep_cut=True)
    tags = [t for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if not t.special]
    texts = [tokenizer.decode(log.tokens, skip_special_tokens=True) for log in logs]
    for tag in tags:
        texts = [t.replace(tag.content, " ") for t in texts]
    return texts


class _Lockstep:
    """A ``generate`` shared by concurrent episodes: requests wait until every live episode has
    one, then are decoded greedily in one left-padded batch."""

    def __init__(self, model: Any, tok: Any, stop_ids: frozenset[int] | set[int]):
        self.model, self.tok = model, tok
        #: the end-of-turn tokens the engines stop on (the renderer's), not only the eos
        self.stop_ids = set(stop_ids) or {tok.eos_token_id}
        self.pending: list[tuple[list[int], int, asyncio.Future]] = []

    async def __call__(self, tokens: list[int], max_new: int) -> _Turn:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((tokens, max_new, fut))
        return await fut

    def flush(self) -> None:
        import torch

        from astraflow.models import pad_id

        batch, self.pending = self.pending, []
        T = max(len(t) for t, _, _ in batch)
        pad = pad_id(self.tok)  # the pad token, else eos: many tokenizers have none
        ids = torch.full((len(batch), T), pad, dtype=torch.long)
        att = torch.zeros((len(batch), T), dtype=torch.long)
        for i, (t, _, _) in enumerate(batch):
            ids[i, T - len(t):] = torch.tensor(t)
            att[i, T - len(t):] = 1
        max_new = max(m for _, m, _ in batch)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                                      eos_token_id=sorted(self.stop_ids), pad_token_id=pad)
        for i, (_, m, fut) in enumerate(batch):
            row = out[i, T:].tolist()[:m]
            end = next((k for k, t in enumerate(row) if t in self.stop_ids), None)
            if end is not None:
                fut.set_result(scripted_turn(row[: end + 1], "stop"))
            else:
                fut.set_result(scripted_turn(row, "length"))


def greedy_success(model: Any, tok: Any, workload: Any, tasks: list[Mapping[str, Any]],
                   limits: AgentLimits) -> float:
    """Mean success of greedy episodes of ``model`` on ``tasks`` (0 for an episode that fails)."""
    if not tasks:
        return 0.0
    was_training = model.training
    model.eval()
    renderer = ChatRenderer(tok)
    gen = _Lockstep(model, tok, renderer.stop_ids)

    async def one(task: Mapping[str, Any]) -> float:
        try:
            log = await run_agent_episode(gen, renderer, workload.environment(), task, limits)
        except Exception:  # an environment error fails the episode, as on a RaaS node
            return 0.0
        return log.success

    async def all_of() -> list[float]:
        jobs = [asyncio.ensure_future(one(t)) for t in tasks]
        while not all(j.done() for j in jobs):
            live = sum(not j.done() for j in jobs)
            if gen.pending and len(gen.pending) >= live:
                gen.flush()
            await asyncio.sleep(0 if gen.pending else 0.001)
        return [j.result() for j in jobs]

    try:
        return float(np.mean(run_abandoning(all_of())))
    finally:
        model.train(was_training)
