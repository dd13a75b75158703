"""Contract checks a user's environment meets up front: a plain ``def close`` is accepted (as the
docs and the episode loop allow), a ``reset``/``step`` left to ``EnvironmentBase`` or a missing
``environment()`` is named, and a warm start warns of cut expert turns and leaves out demonstrations
whose cut turn is a tool call."""

from __future__ import annotations

import logging
import textwrap

import pytest

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.conformance import check_environment
from astraflow.agents.demos import demonstration_texts, demonstrations
from astraflow.agents.env import EnvironmentBase, signature_problems
from astraflow.agents.tools import format_call
from astraflow.agents.workload import AgentWorkload
from astraflow.models import build_tokenizer
from tests.agents.test_conformance import GOOD, USER_MODULE, _user_check
from tests.agents.toy import TABLE, LookupEnv, LookupWorkload


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class SyncCloseEnv(LookupEnv):
    def close(self) -> None:
        self.closed = getattr(self, "closed", 0) + 1


class SyncCloseWorkload(LookupWorkload):
    def environment(self) -> SyncCloseEnv:
        return SyncCloseEnv()


class NoStepEnv(EnvironmentBase):
    async def reset(self, task):
        return [{"role": "user", "content": "hi"}]


class NoResetEnv(EnvironmentBase):
    async def step(self, action):
        raise AssertionError("not run")


def test_a_plain_close_fits_the_contract():
    assert signature_problems(SyncCloseEnv) == []


def test_a_plain_close_conforms(tok):
    assert check_environment(SyncCloseWorkload(), n_tasks=2, tokenizer=tok) == []


def test_a_plain_close_passes_astraflow_check(tmp_path):
    module = USER_MODULE + "\n\nclass SyncEnv(MyEnv):\n    def close(self):\n        self.closed = True\n"
    module = module.replace("return MyEnv()", "return SyncEnv()")
    proc = _user_check(tmp_path, textwrap.dedent(module.format(**GOOD)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "must be 'async def'" not in out, out


@pytest.mark.parametrize("cls,needle", [(NoStepEnv, "NoStepEnv does not define step"),
                                        (NoResetEnv, "NoResetEnv does not define reset")])
def test_a_method_left_to_the_base_is_refused(cls, needle):
    assert any(needle in p for p in signature_problems(cls)), signature_problems(cls)


def test_the_base_step_says_what_is_missing():
    import asyncio

    with pytest.raises(NotImplementedError, match="NoStepEnv does not define step"):
        asyncio.run(NoStepEnv().step(None))


def test_a_workload_without_environment_names_the_method():
    class NoEnv(AgentWorkload):
        def tasks(self, split):
            return [{"i": 0}]

    with pytest.raises(NotImplementedError, match=r"NoEnv does not define environment\(self\)"):
        NoEnv().environment()
    with pytest.raises(NotImplementedError, match=r"does not define tasks\(self, split\)"):
        AgentWorkload().tasks("train")


class VerboseEnv(LookupEnv):
    """An expert whose lookup call is long for some keys: cut by a small turn budget."""

    def expert_action(self) -> str:
        self.turn += 1
        key = self.task["key"]
        pad = "x" * 200 if key in ("k1", "k2") else ""
        return format_call("lookup", {"key": key, "note": pad} if pad else {"key": key}) if self.turn == 1 \
            else TABLE[key]


class VerboseWorkload(LookupWorkload):
    def environment(self) -> VerboseEnv:
        return VerboseEnv()


def _budget(tok, wl) -> int:
    """A turn budget that holds the short expert turns but not the long ones."""
    renderer = ChatRenderer(tok)
    short = len(renderer.encode(format_call("lookup", {"key": "k10"}))) + 1
    long = len(renderer.encode(format_call("lookup", {"key": "k1", "note": "x" * 200}))) + 1
    assert short < long
    return short + 2, long


def test_demonstrations_with_a_cut_expert_turn_are_left_out_with_a_warning(tok, caplog):
    wl = VerboseWorkload()
    tasks = [{"key": k, "difficulty": 1} for k in ("k0", "k1", "k2", "k3")]
    budget, long = _budget(tok, wl)
    with caplog.at_level(logging.WARNING, logger="astraflow.agents.demos"):
        logs = demonstrations(wl, ChatRenderer(tok), tasks, wl.limits(budget))
    assert len(logs) == 2  # k1 and k2 cut, whether or not their episode still succeeded
    warned = [r.getMessage() for r in caplog.records if "cut" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "2 expert turn(s)" in warned[0] and f"longest expert turn has {long} tokens" in warned[0]
    assert f"workload.sampling.max_new_tokens ({budget}) to at least {long}" in warned[0]
    assert "2 successful demonstration(s) with a cut tool call are left out" in warned[0]


class LongAnswerEnv(LookupEnv):
    """An expert whose final answer (no tool call) is long: cut, but still a success."""

    async def step(self, action):
        from astraflow.agents.env import StepResult

        return StepResult([], reward=1.0, done=True, info={"success": 1.0})

    def expert_action(self) -> str:
        return "y" * 200


class LongAnswerWorkload(LookupWorkload):
    def environment(self) -> LongAnswerEnv:
        return LongAnswerEnv()


def test_a_cut_plain_turn_is_kept_with_a_warning(tok, caplog):
    wl = LongAnswerWorkload()
    with caplog.at_level(logging.WARNING, logger="astraflow.agents.demos"):
        logs = demonstrations(wl, ChatRenderer(tok), [{"key": "k0", "difficulty": 1}], wl.limits(32))
    assert len(logs) == 1
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "they are trained on as cut" in warned[0], warned
    assert "workload.sampling.max_new_tokens (32) to at least 201" in warned[0], warned


def test_every_demonstration_cut_is_an_error_naming_the_setting(tok):
    wl = VerboseWorkload()
    budget, _ = _budget(tok, wl)
    with pytest.raises(ValueError, match="workload.sampling.max_new_tokens"):
        demonstrations(wl, ChatRenderer(tok), [{"key": "k1", "difficulty": 1}], wl.limits(budget))


def test_a_tokenizer_corpus_keeps_cut_turns(tok, caplog):
    wl = VerboseWorkload()
    budget, _ = _budget(tok, wl)
    with caplog.at_level(logging.WARNING, logger="astraflow.agents.demos"):
        texts = demonstration_texts(wl, [{"key": "k0", "difficulty": 1}], tok, max_new_tokens=budget)
    assert len(texts) == 1 and not caplog.records
