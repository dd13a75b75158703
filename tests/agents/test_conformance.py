"""The conformance suite, run on every agentic workload in the registry (a workload added to
``BUILTIN_MODULES`` is picked up here with no change), on deliberately broken environments
(each must be reported), and through ``astraflow check`` on a user's module in ``tmp_path``.

To check your own environment, in a test of yours::

    from astraflow.agents.conformance import assert_conforms
    assert_conforms(MyWorkload())
"""

from __future__ import annotations

import asyncio
import importlib
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from astraflow.agents.conformance import assert_conforms, check_environment
from astraflow.agents.env import Action, EnvironmentBase, StepResult
from astraflow.agents.tools import ToolBox, format_call, tool
from astraflow.agents.workload import AgentWorkload, is_agentic
from astraflow.models import build_tokenizer
from astraflow.workloads.base import BUILTIN_MODULES, WORKLOADS, make_workload

ROOT = Path(__file__).resolve().parents[2]


def agentic_workloads() -> list[str]:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return [n for n in WORKLOADS.names() if is_agentic(WORKLOADS.get(n))]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("name", agentic_workloads())
def test_every_registered_agentic_workload_conforms(name, tok):
    assert_conforms(make_workload(name, {}, seed=0), n_tasks=4, tokenizer=tok)


@pytest.mark.parametrize("name", ["tests.agents.toy:LookupWorkload", "examples.custom_env.guess:GuessWorkload"])
def test_user_workloads_named_by_module_conform(name, tok):
    """The test's toy and the README's user example, loaded as a config names them."""
    assert_conforms(make_workload(name, {}, seed=0), n_tasks=6, tokenizer=tok)


# -- a small good environment, and broken variants of it -------------------------------------------


@tool
def echo(text: str) -> str:
    """Repeat the text."""
    return text


class EchoEnv(EnvironmentBase):
    """Say the task's word; an ``echo`` tool helps."""

    step_timeout_s = 1.0

    def __init__(self):
        super().__init__()
        self.tools = ToolBox([echo])

    async def reset(self, task):
        self.task, self.turn = task, 0
        return [{"role": "user", "content": f"say {task['word']}"}]

    async def step(self, action: Action) -> StepResult:
        ok = float(action.text.strip() == self.task["word"])
        return StepResult(reward=ok, done=True, info={"success": ok})

    def expert_action(self) -> str:
        self.turn += 1
        return format_call("echo", {"text": self.task["word"]}) if self.turn == 1 else self.task["word"]


class EchoWorkload(AgentWorkload):
    env_cls = EchoEnv

    def tasks(self, split):
        return [{"word": w} for w in (["alpha", "beta", "gamma"] if split == "train" else ["delta"])]

    def environment(self):
        return self.env_cls()


def broken(**methods):
    """``EchoWorkload`` with its environment's ``methods`` replaced."""
    env_cls = type("Broken", (EchoEnv,), methods)
    return type("BrokenWorkload", (EchoWorkload,), {"env_cls": env_cls})()


async def _raise_on_garbage(self, action):
    if action.text.strip() not in ("alpha", "beta", "gamma", "delta"):
        raise ValueError("cannot parse the answer")
    return await EchoEnv.step(self, action)


async def _hang(self, action):
    await asyncio.sleep(30)


async def _random_reset(self, task):
    self.task, self.turn = task, 0
    return [{"role": "user", "content": f"say {task['word']} #{random.random()}"}]


async def _no_messages(self, task):
    self.task = task
    return []


async def _bad_close(self):
    raise OSError("socket already closed")


async def _never_done(self, action):
    return StepResult(observation=[{"role": "user", "content": "again"}])


class _DuplicateTools:
    tools: dict = {}

    def schemas(self):
        s = {"type": "function", "function": {"name": "t", "description": "d", "parameters": {"type": "object"}}}
        return [s, s, {"type": "function", "function": {"name": "u", "description": "", "parameters": {}}}]


class Shared(EchoWorkload):
    def __init__(self):
        super().__init__()
        self.env = EchoEnv()

    def environment(self):
        return self.env


class NotJson(EchoWorkload):
    def tasks(self, split):
        return [{"word": "alpha", "tags": {"a"}}]


class Unstable(EchoWorkload):
    """Tasks that change with every call (a generator seeded by the clock, say)."""

    calls = 0

    def tasks(self, split):
        Unstable.calls += 1
        return [{"word": f"w{Unstable.calls}"}, {"word": "beta"}]


def test_a_good_environment_conforms(tok):
    assert check_environment(EchoWorkload(), tokenizer=tok) == []


@pytest.mark.parametrize("workload,needle", [
    (broken(step=_raise_on_garbage), "on random text ('"),
    (broken(step=_raise_on_garbage), "the episode failed: Broken.step raised ValueError: cannot parse"),
    (broken(step=_hang), "ran past its 1 s deadline"),
    (broken(reset=_random_reset), "reset(task 0) returned different messages"),
    (broken(reset=_no_messages), "reset(task 0) returned no message"),
    (broken(close=_bad_close), "close() raised OSError: socket already closed"),
    (broken(step=_never_done), "replaying the expert on task 0 did not succeed: it was truncated (max_turns)"),
    (broken(expert_action=lambda self: "omega"), "replaying the expert on task 0 did not succeed: success 0.0"),
    (broken(__init__=lambda self: (EchoEnv.__init__(self), setattr(self, "tools", _DuplicateTools()))[0]),
     "tool names must be unique; repeated: ['t']"),
    (broken(__init__=lambda self: (EchoEnv.__init__(self), setattr(self, "tools", _DuplicateTools()))[0]),
     "tool u: parameters must be a JSON schema of type 'object'"),
    (broken(step=lambda self, action: StepResult(done=True)), "Broken.step must be 'async def'"),
    (broken(__init__=lambda self: None), "Broken has no tools: set self.tools = ToolBox([...]) in __init__"),
    (broken(__init__=lambda self: setattr(self, "tools", [echo])), "Broken.tools is a list, not an astraflow"),
    (Shared(), "environment() returned the same instance twice"),
    (NotJson(), "tasks('train')[0] is not a JSON object that survives a round trip"),
    (Unstable(), "tasks('train') differs between two calls"),
])
def test_a_broken_environment_is_reported(workload, needle, tok):
    problems = check_environment(workload, n_tasks=2, tokenizer=tok)
    assert any(needle in p for p in problems), problems
    with pytest.raises(AssertionError, match="does not conform"):
        assert_conforms(workload, n_tasks=2, tokenizer=tok)


@pytest.mark.parametrize("workload,max_new,needle", [
    (EchoWorkload(), 8, "invalid and never ran the tool; a turn was cut at workload.sampling.max_new_tokens (8)"),
    (broken(expert_action=lambda self: (setattr(self, "turn", self.turn + 1), "<tool_call>{echo}</tool_call>"
                                        if self.turn == 1 else self.task["word"])[1]), 256,
     "1 of its tool calls were invalid and never ran the tool; fix them"),
])
def test_an_expert_whose_tool_calls_never_run_is_reported(workload, max_new, needle, tok):
    """The expert still succeeds, but its tools were never exercised: a budget too small cuts its
    calls (a tool that raises would pass unseen), and a warm start would drop every demonstration."""
    problems = check_environment(workload, n_tasks=2, max_new_tokens=max_new, tokenizer=tok)
    assert any(needle in p for p in problems), problems


async def _long_reset(self, task):
    self.task, self.turn = task, 0
    return [{"role": "user", "content": f"say {task['word']}" + " ." * 2000}]


def test_a_first_observation_is_measured_as_an_episode_caps_it(tok):
    """A long first observation that max_observation_chars cuts to fit the context conforms, as
    its episodes run; one that does not fit after the cut is reported with the cut's length."""
    workload = broken(reset=_long_reset)
    workload.params = workload.Params(max_context_tokens=512, max_observation_chars=200)
    assert check_environment(workload, n_tasks=2, tokenizer=tok) == []
    workload.params = workload.Params(max_context_tokens=512, max_observation_chars=1000)
    problems = check_environment(workload, n_tasks=2, tokenizer=tok)
    assert any("the first observation has" in p and "tokens, not less than max_context_tokens (512)" in p
               and int(p.split(" has ")[1].split()[0]) < 1200 for p in problems), problems


# -- a user's environment, written only here, through `astraflow check` ---------------------------

USER_MODULE = '''
from astraflow.agents.env import EnvironmentBase, StepResult
from astraflow.agents.workload import AgentWorkload


class MyEnv(EnvironmentBase):
    {reset}
        self.task = task
        return [{{"role": "user", "content": "say hi"}}]

    {step}
        return StepResult(reward=float(action.text == "hi"), done=True)


class MyWorkload(AgentWorkload):
    def tasks(self, split):
        return [{{"id": 0}}]

    def environment(self):
        return MyEnv()
'''

GOOD = {"reset": "async def reset(self, task):", "step": "async def step(self, action):"}


def _user_check(tmp_path: Path, module: str, name: str = "mymod") -> subprocess.CompletedProcess:
    (tmp_path / f"{name}.py").write_text(module)
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "model")
    data["workload"] = {"name": f"{name}:MyWorkload", "workflow": "agent", "group_size": 4}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    return subprocess.run([sys.executable, "-m", "astraflow", "check", "config.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("methods,code,needle", [
    (GOOD, 0, "name: mymod:MyWorkload"),
    ({**GOOD, "step": "def step(self, action):"}, 2, "MyEnv.step must be 'async def'"),
    ({**GOOD, "reset": "async def reset(self):\n        task = None"}, 2, "MyEnv.reset must take (self, task)"),
    ({**GOOD, "reset": "import no_such_module_\n\n    async def reset(self, task):"}, 2,
     "'mymod' was found, but it imports 'no_such_module_', which is not installed"),
    ({**GOOD, "reset": "async def reset(self, task)"}, 2, "importing 'mymod' raised SyntaxError"),
    ({**GOOD, "reset": "def __init__(self):\n        pass\n\n    async def reset(self, task):"}, 2,
     "MyEnv has no tools: set self.tools = ToolBox([...]) in __init__"),
])
def test_user_environment_through_astraflow_check(tmp_path, methods, code, needle):
    proc = _user_check(tmp_path, textwrap.dedent(USER_MODULE.format(**methods)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert needle in out and "Traceback" not in out, out


def test_the_guess_example_never_pays_for_not_answering(tok):
    """A right answer after probes returns less than one without; a wrong answer and no answer
    at all (out of turns) both return 0, so running out the turns never beats answering."""
    import asyncio

    from astraflow.agents.chat import ChatRenderer
    from astraflow.agents.episode import run_agent_episode
    from tests.agents.test_episode import scripted

    work = make_workload("examples.custom_env.guess:GuessWorkload", {}, seed=0)
    task = {"secret": 7, "difficulty": 1}
    probes = [format_call("probe", {"n": n}) for n in (4, 6, 8, 7)]

    def returns(turns):
        log = asyncio.run(run_agent_episode(scripted(tok, turns), ChatRenderer(tok), work.environment(), task,
                                            work.limits(40)))
        return log.final_reward, log.truncated

    assert returns(["7"]) == (1.0, None)
    assert returns(probes + ["7"])[0] == pytest.approx(0.8)
    assert returns(probes + ["3"]) == (0.0, None)
    assert returns(probes + [format_call("probe", {"n": 1})]) == (0.0, "max_turns")


def test_a_workload_whose_tasks_raise_is_named_with_its_fix():
    """A user's ``tasks("eval")`` raising ``KeyError``: a ValueError naming the method and
    ``astraflow check``, which the CLI turns into exit 2, not a traceback."""
    from astraflow.runtime.launch import check_data
    from astraflow.workloads.config import WorkloadConfig

    with pytest.raises(ValueError, match=r"workload tests.agents.toy:NoHeldOutWorkload: tasks\('eval'\) raised "
                                         r"KeyError: 'eval_file'; fix the workload's tasks\(\)"):
        check_data(WorkloadConfig(name="tests.agents.toy:NoHeldOutWorkload", workflow="agent"))


def test_an_agentic_workload_whose_params_are_not_agent_params_is_named_with_its_fix(tmp_path):
    """A user's ``Params`` of plain pydantic has none of the episode limits the run reads:
    exit 2 naming ``AgentParams``, not an ``AttributeError`` traceback."""
    module = textwrap.dedent(USER_MODULE.format(**GOOD)) + textwrap.dedent('''
        from pydantic import BaseModel


        class PlainParams(BaseModel):
            num_train: int = 10


        class MyWorkload(MyWorkload):
            Params = PlainParams
        ''')
    proc = _user_check(tmp_path, module)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "its params are a PlainParams, not an astraflow.agents.workload.AgentParams" in out, out
    assert "Traceback" not in out, out


@pytest.mark.parametrize("init", [{"warm_start_steps": 5}, {"tokenizer": "bpe"}])
def test_a_model_to_build_from_an_environment_without_an_expert_is_refused_by_check(tmp_path, init):
    """A warm start and a BPE tokenizer learn from the expert's demonstrations: without
    ``expert_action`` the run would fail once started, so ``astraflow check`` refuses it."""
    (tmp_path / "mymod.py").write_text(textwrap.dedent(USER_MODULE.format(**GOOD)))
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0].update(model=str(tmp_path / "model"), init={"preset": "tiny", **init})
    data["workload"] = {"name": "mymod:MyWorkload", "workflow": "agent", "group_size": 4}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "astraflow", "check", "config.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "MyEnv (mymod:MyWorkload) has none: add it" in out and "Traceback" not in out, out
