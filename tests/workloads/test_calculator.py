"""The calculator workload: generated problems, the safe ``calc`` tool, the environment and its
expert driven through the real agent loop with scripted turns."""

from __future__ import annotations

import asyncio

import pytest

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.tools import ToolCall, format_call
from astraflow.models import build_tokenizer
from astraflow.workloads.base import make_workload
from astraflow.workloads.calculator import MAX_EXPRESSION_CHARS, CalcError, calc, evaluate
from tests.agents.test_episode import scripted


def workload(seed=0, **params):
    return make_workload("calculator", {"num_train": 300, "num_test": 50, **params}, seed=seed)


def test_problems_are_deterministic_disjoint_and_correct():
    w = workload()
    train, test = w.tasks("train"), w.tasks("eval")
    assert train == workload().tasks("train") and test == workload().tasks("eval")
    assert train != workload(seed=1).tasks("train")
    assert len(train) == 300 and len(test) == 50
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert len({t["question"] for t in train}) == 300
    for t in train + test:
        assert t["answer"] == str(evaluate(t["question"]))
        assert t["difficulty"] == sum(t["question"].count(op) for op in "+-*") in (1, 2)
    # a split's problems do not depend on how many are asked for
    assert workload(num_train=100).tasks("train") == train[:100]


def test_params_are_checked():
    with pytest.raises(ValueError, match="min_operands"):
        workload(min_operands=4, max_operands=3)
    with pytest.raises(ValueError, match="num_train=300 is more than half"):
        workload(digits=1, max_operands=2, ops=["+"])
    with pytest.raises(ValueError, match="split must be"):
        workload().tasks("test")


@pytest.mark.parametrize("expression,value", [
    ("37*12+5", "449"), ("(1+2)*3", "9"), ("7/2", "3.5"), ("6/3", "2"), ("-3+1", "-2"), (" 2 * ( 3 - 5 ) ", "-4"),
])
def test_calc_evaluates_arithmetic(expression, value):
    assert calc.fn(expression) == value


@pytest.mark.parametrize("expression,why", [
    ("(1).real", "not 'aelr'"),                    # attribute access
    ("().__class__", "only numbers"),
    ("x+1", "not 'x'"),                            # names
    ("__import__('os')", "only numbers"),
    ("2**99999", "Pow is not allowed"),            # huge powers
    ("9**9**9**9", "Pow is not allowed"),
    ("1" * (MAX_EXPRESSION_CHARS + 1), "longer than"),  # long input
    ("'a'*5", "only numbers"),
    ("1;2", "only numbers"),
    ("1//2", "FloorDiv is not allowed"),
    ("()", "Tuple is not allowed"),
    ("1 2", "not a valid expression"),
    ("1/0", "division by zero"),
    ("", "not a valid expression"),
])
def test_calc_refuses_with_an_error_result(expression, why):
    with pytest.raises(CalcError):
        evaluate(expression)
    out = calc.fn(expression)
    assert out.startswith("error: ") and why in out


def test_wrong_arguments_are_an_error_observation():
    env = workload().environment()
    res = asyncio.run(env.tools.run(ToolCall("calc", {"expression": 12})))
    assert not res.valid and res.content.startswith("error: wrong arguments for calc")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def episode(tok, w, task, turns):
    from astraflow.agents.episode import run_agent_episode

    env = w.environment()
    if turns is None:  # the expert, one turn per model turn
        async def gen(tokens, max_new):
            return await scripted(tok, [env.expert_action()])(tokens, max_new)
    else:
        gen = scripted(tok, turns)
    return asyncio.run(run_agent_episode(gen, ChatRenderer(tok), env, task, w.limits(64)))


def test_expert_succeeds_through_the_agent_loop(tok):
    w = workload()
    for task in w.tasks("eval")[:5]:
        log = episode(tok, w, task, None)
        assert log.done and log.success == 1.0 and log.reward == 1.0
        assert log.tool_calls == 1 and log.invalid_calls == 0 and log.truncated is None
        tool_turn = next(t for t in log.turns if t["kind"] == "tool")
        assert tool_turn["messages"] == [{"role": "tool", "content": task["answer"]}]
        assert len(log.tokens) < w.params.max_context_tokens


def test_wrong_answer_and_bad_calc_are_learnable(tok):
    w = workload()
    task = w.tasks("train")[0]
    log = episode(tok, w, task, [format_call("calc", {"expression": "2**9"}), task["answer"] + "0"])
    tool_turn = next(t for t in log.turns if t["kind"] == "tool")
    assert tool_turn["messages"][0]["content"].startswith("error: Pow is not allowed")
    assert log.done and log.success == 0.0 and log.reward == 0.0
    w = workload(instructions=True)
    log = episode(tok, w, task, [task["answer"]])
    assert log.turns[0]["messages"][0]["role"] == "system" and log.success == 1.0
