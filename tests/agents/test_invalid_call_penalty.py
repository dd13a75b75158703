"""``invalid_call_penalty``: each invalid tool call takes the penalty off the episode's return,
as a per-turn reward of the turn that made it, so RL can learn to stop writing garbled calls;
0 by default (an invalid call then costs only its turn, as before)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from astraflow.agents.tools import format_call
from astraflow.agents.workload import AgentParams
from astraflow.rollout.agent import episode_sequence
from astraflow.workloads.base import make_workload
from astraflow.models import build_tokenizer
from tests.agents.test_episode import SumEnv, run, scripted

@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


#: one turn with a good call and two invalid ones (an unknown tool, a call that is not JSON)
MIXED = format_call("add", {"a": 2, "b": 3}) + format_call("nope", {}) + "<tool_call>{bad}</tool_call>"


def test_each_invalid_call_costs_the_penalty(tok):
    log = run(scripted(tok, [MIXED, format_call("add", {"a": 1}), "5"]), tok, SumEnv(), invalid_call_penalty=0.25,
              max_new_tokens=256, max_context_tokens=2048)
    assert log.invalid_calls == 3 and log.success == 1.0 and log.final_reward == 1.0
    assert log.turn_rewards == [-0.5, -0.25]
    assert log.reward == pytest.approx(0.25)
    tool_turns = [t for t in log.turns if t["kind"] == "tool"]
    assert [t["reward"] for t in tool_turns] == [-0.5, -0.25]  # the episode viewer shows where it was taken
    seq = episode_sequence(log)
    assert seq.reward == pytest.approx(0.25) and seq.rewards == {"final": 1.0, "turns": -0.75}


def test_without_the_penalty_invalid_calls_cost_nothing(tok):
    log = run(scripted(tok, [MIXED, "5"]), tok, SumEnv(), max_new_tokens=256, max_context_tokens=2048)
    assert log.invalid_calls == 2 and log.turn_rewards == [] and log.reward == 1.0


def test_the_penalty_counts_on_a_truncated_episode(tok):
    log = run(scripted(tok, [format_call("nope", {})] * 2), tok, SumEnv(), max_turns=2, invalid_call_penalty=0.1)
    assert log.truncated == "max_turns" and log.reward == pytest.approx(-0.2)


def test_the_workload_param_reaches_the_episode_limits():
    work = make_workload("examples.custom_env.guess:GuessWorkload", {"invalid_call_penalty": 0.05}, seed=0)
    assert work.limits(40).invalid_call_penalty == 0.05
    assert make_workload("examples.custom_env.guess:GuessWorkload", {}, seed=0).limits(40).invalid_call_penalty == 0


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), float("inf")])
def test_a_penalty_out_of_bounds_is_refused(value):
    assert AgentParams(invalid_call_penalty=1.0).invalid_call_penalty == 1.0  # the bound itself is allowed
    with pytest.raises(ValidationError, match="invalid_call_penalty"):
        AgentParams(invalid_call_penalty=value)


def test_the_bounds_hold_where_a_workload_gives_its_own_default():
    class Params(AgentParams):
        invalid_call_penalty: float = 2.0

    with pytest.raises(ValidationError, match="invalid_call_penalty 2.0: give a number from 0 to 1"):
        Params()


def test_an_answer_cut_by_its_budget_is_stored_as_cut(tok):
    """The environment graded (and ended on) a final answer the token budget cut short: the
    sequence ended by ``length``, as a cut single-turn completion does (what an overlong filter
    reads); one that ended on its stop token ended by ``stop``."""
    cut = run(scripted(tok, ["5" * 40]), tok, SumEnv(), max_new_tokens=4)
    assert cut.done and cut.truncated is None and episode_sequence(cut).finish_reason == "length"
    whole = run(scripted(tok, ["5"]), tok, SumEnv(), max_new_tokens=4)
    assert whole.done and episode_sequence(whole).finish_reason == "stop"
