"""The two shipped multi-policy workflows' rules: what each policy sees, how the second role's
answer is read, and who is rewarded for what.

The engines are scripted (they answer each prompt with a fixed text, through the real
tokenizer): the rules are about what happens for a given answer, which a sampling model cannot
be made to give on demand. That the workflows run on real engines is covered by the
multi-policy end-to-end test (``tests/e2e/test_multi_policy_cli.py``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from astraflow.contracts import RolloutTask
from astraflow.models import load_model
from astraflow.rollout.engine import Generation, SamplingParams
from astraflow.workloads.base import make_workload
from astraflow.rollout.workflows import (
    SELECT_NEW_TOKENS, VERIFY_NEW_TOKENS, SolverSelector, SolverVerifier, retry_prompt, select_prompt, verify_prompt,
)

ITEM = {"question": "12+34", "answer": 46}
Q = "12+34="


class Scripted:
    """An engine whose answer to a prompt is the next of the texts scripted for it."""

    def __init__(self, tok, answers: dict[str, list[str]]):
        self.tokenizer, self.answers, self.version = tok, {k: list(v) for k, v in answers.items()}, 0
        self.seen: list[tuple[str, int]] = []  # (prompt text, max_new_tokens)
        self.greedy: list[bool] = []

    async def generate(self, prompt, params: SamplingParams) -> Generation:
        text = self.tokenizer.decode(prompt, skip_special_tokens=True)
        self.seen.append((text, params.max_new_tokens))
        self.greedy.append(params.greedy)
        ids = self.tokenizer.encode(self.answers[text].pop(0)) + [self.tokenizer.eos_token_id]
        n = len(ids)
        return Generation(tokens=np.asarray(ids, np.int32), logprobs=np.full(n, -0.5, np.float32),
                          versions=np.zeros(n, np.int32), finish_reason="stop")


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_model(tiny_model)[1]


def run(workflow_cls, engines, sampling=None):
    wf = workflow_cls(make_workload("math", {"digits": 2}, 0), SamplingParams(max_new_tokens=5), "n")
    task = RolloutTask(task_id="g/0", group_id="g", policies=("solver", "second"), workflow="w",
                       prompt=ITEM, kind="train", sampling=sampling)
    return asyncio.run(wf.run_episode(engines, task))


def rewards_by_policy(traj) -> list[tuple[int, float]]:
    """(policy index of the sequence's generated tokens, reward) per sequence."""
    return [(int(s.policy_ids[s.loss_mask][0]), s.reward) for s in traj.sequences]


@pytest.mark.parametrize("first, verdict, retry, solver_r, verifier_r", [
    ("46", "46Y", None, 1.0, 1.0),   # right, accepted: no retry
    ("47", "46N", "46", 1.0, 1.0),   # wrong, rejected, the retry is right
    ("47", "46N", "45", 0.0, 1.0),   # wrong, rejected, the retry is wrong too
    ("47", "47Y", None, 0.0, 0.0),   # wrong, accepted: the verifier was wrong
    ("46", "46N", "46", 1.0, 0.0),   # right, rejected: the verifier was wrong, the retry still counts
    ("47", "46", None, 0.0, 0.0),    # no verdict can be read: the answer stands, no reward for the verifier
])
def test_solver_verifier_rules(tok, first, verdict, retry, solver_r, verifier_r):
    solver_answers = {Q: [first]}
    if retry is not None:
        solver_answers[retry_prompt(Q, first)] = [retry]
    solver, verifier = Scripted(tok, solver_answers), Scripted(tok, {verify_prompt(Q, first): [verdict]})
    traj = run(SolverVerifier, {"solver": solver, "second": verifier})
    # the verifier may write its working: it gets the budget for it
    assert verifier.seen == [(verify_prompt(Q, first), VERIFY_NEW_TOKENS)]
    expected = [(0, solver_r), (1, verifier_r)] + ([(0, solver_r)] if retry is not None else [])
    assert rewards_by_policy(traj) == expected
    assert traj.score == solver_r


@pytest.mark.parametrize("a1, a2, pick, picked_ok, selector_r", [
    ("46", "47", "46>1", 1.0, 1.0),   # exactly one right, picked
    ("46", "47", "46>2", 0.0, 0.0),   # exactly one right, the wrong one picked
    ("45", "46", "46>2", 1.0, 1.0),
    ("46", "46", "46>2", 1.0, 0.5),   # both right: the pick cannot matter
    ("45", "47", "46>1", 0.0, 0.5),   # both wrong
    ("46", "47", "1", 1.0, 1.0),      # a bare pick is read as well
    ("45", "46", "46", 0.0, 0.0),     # no pick can be read: the first answer, no reward
])
def test_solver_selector_rules(tok, a1, a2, pick, picked_ok, selector_r):
    solver = Scripted(tok, {Q: [a1, a2]})
    selector = Scripted(tok, {select_prompt(Q, a1, a2): [pick]})
    traj = run(SolverSelector, {"solver": solver, "second": selector})
    assert selector.seen == [(select_prompt(Q, a1, a2), SELECT_NEW_TOKENS)]
    ok = [float(a == "46") for a in (a1, a2)]
    assert rewards_by_policy(traj) == [(0, ok[0]), (0, ok[1]), (1, selector_r)]
    assert traj.score == picked_ok


def test_a_greedy_selector_episode_samples_its_second_attempt(tok):
    """Evaluation is greedy; two greedy attempts would be one answer twice, nothing to pick."""
    solver = Scripted(tok, {Q: ["46", "47"]})
    selector = Scripted(tok, {select_prompt(Q, "46", "47"): ["46>1"]})
    run(SolverSelector, {"solver": solver, "second": selector}, sampling={"greedy": True})
    assert solver.greedy == [True, False]
    solver = Scripted(tok, {Q: ["46", "47"]})
    run(SolverSelector, {"solver": solver, "second": Scripted(tok, {select_prompt(Q, "46", "47"): ["1"]})})
    assert solver.greedy == [False, False]
