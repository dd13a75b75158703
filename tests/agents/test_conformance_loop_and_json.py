"""The conformance suite refuses what the episode loop cannot catch itself: an environment call
that blocks the event loop all of a node's episodes share, and observations or ``info`` that are
not JSON (they are stored with the episode); each problem names the fix."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from astraflow.agents.conformance import check_environment
from astraflow.agents.env import StepResult
from astraflow.agents.tools import ToolBox, tool
from tests.agents.test_conformance import EchoEnv, broken

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    from astraflow.models import build_tokenizer

    return build_tokenizer()


async def _sleepy_step(self, action):
    time.sleep(1.5)  # the bug: a blocking sleep in an async def
    return await EchoEnv.step(self, action)


async def _polite_step(self, action):
    await asyncio.sleep(1.5)  # as long, but the loop runs on meanwhile
    return await EchoEnv.step(self, action)


async def _sleepy_reset(self, task):
    time.sleep(1.5)
    return await EchoEnv.reset(self, task)


@tool
async def slow_echo(text: str) -> str:
    """Repeat the text, slowly."""
    time.sleep(1.5)
    return text


def _sleepy_tool_init(self):
    EchoEnv.__init__(self)
    self.tools = ToolBox([tool(slow_echo.fn, name="echo")])


def _problems(workload, tok):
    return check_environment(workload, n_tasks=2, tokenizer=tok)


@pytest.mark.parametrize("methods,where", [
    ({"step": _sleepy_step}, "Broken.step blocked the event loop"),
    ({"reset": _sleepy_reset}, "Broken.reset blocked the event loop"),
    ({"__init__": _sleepy_tool_init}, "Broken's tool echo blocked the event loop"),
])
def test_a_call_that_blocks_the_event_loop_is_reported_with_the_fix(methods, where, tok):
    problems = _problems(broken(**methods, step_timeout_s=30.0), tok)  # a deadline far from the sleeps
    hits = [p for p in problems if where in p]
    assert len(hits) == 1, problems  # said once, not once per episode
    assert "await asyncio.sleep" in hits[0] and "asyncio.to_thread" in hits[0]


def test_awaiting_as_long_is_not_blocking(tok):
    assert _problems(broken(step=_polite_step, step_timeout_s=30.0), tok) == []


async def _set_in_info(self, action):
    result = await EchoEnv.step(self, action)
    return StepResult(result.observation, result.reward, result.done, {**result.info, "seen": {"a"}})


async def _array_in_message(self, task):
    first = await EchoEnv.reset(self, task)
    return [{**first[0], "image": np.zeros(3)}]


async def _nan_in_info(self, action):
    result = await EchoEnv.step(self, action)
    return StepResult(result.observation, result.reward, result.done, {**result.info, "score": float("nan")})


@pytest.mark.parametrize("methods,needle", [
    ({"step": _set_in_info}, "Broken.step returned info['seen'] of type set, which is not JSON"),
    ({"reset": _array_in_message}, "Broken.reset returned observation message 0['image'] of type ndarray, "
                                   "which is not JSON"),
    ({"step": _nan_in_info}, "Broken.step returned info['score'] of type float (nan), which is not JSON"),
])
def test_a_payload_that_is_not_json_is_refused_naming_the_field(methods, needle, tok):
    problems = _problems(broken(**methods), tok)
    hits = [p for p in problems if needle in p]
    assert len(hits) == 1, problems
    assert "give str keys and only str, finite numbers, booleans, None, lists and dicts" in hits[0]


async def _numpy_info(self, action):
    result = await EchoEnv.step(self, action)
    return StepResult(result.observation, np.float32(result.reward), np.bool_(result.done),
                      {"success": np.float64(result.info["success"]), "path": ["a", 1, None, {"b": True}]})


def test_numpy_scalars_and_nested_json_pass(tok):
    assert _problems(broken(step=_numpy_info), tok) == []


def test_astraflow_check_runs_an_agentic_workloads_conformance_suite(tmp_path, monkeypatch, tiny_model):
    """`astraflow check` runs the environment as a node would (scripted turns) and refuses one
    that does not conform, with exit code 2 and the problem; a conforming one is said to."""
    import yaml
    from click.testing import CliRunner

    from astraflow.cli import main

    (tmp_path / "blocking_guess.py").write_text(
        "import time\n"
        "from examples.custom_env.guess import GuessEnv, GuessWorkload\n\n"
        "class SlowEnv(GuessEnv):\n"
        "    async def step(self, action):\n"
        "        time.sleep(1.5)\n"
        "        return await super().step(action)\n\n"
        "class SlowGuess(GuessWorkload):\n"
        "    def environment(self):\n"
        "        return SlowEnv(self.params.probe_cost)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT))
    data = yaml.safe_load((ROOT / "examples" / "custom_env" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init")
    for name, code, said in (("examples.custom_env.guess:GuessWorkload", 0, "its environment conforms"),
                             ("blocking_guess:SlowGuess", 2, "SlowEnv.step blocked the event loop")):
        data["workload"]["name"] = name
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
        res = CliRunner().invoke(main, ["check", str(tmp_path / "c.yaml")])
        assert res.exit_code == code and said in res.output, res.output[-2000:]


def test_an_environment_that_changes_the_working_directory_or_environ_is_reported_and_put_back(tok, tmp_path,
                                                                                              monkeypatch):
    """A RaaS node runs many episodes in one process: an ``os.chdir`` or an ``os.environ`` change in
    one (a tool preparing a subprocess) is every other's, and the node's. A variable only added
    (an import may add some) is not reported."""
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ASTRAFLOW_TEST_KEPT", "yes")
    monkeypatch.delenv("ASTRAFLOW_TEST_ADDED", raising=False)

    async def moving_step(self, action):
        os.chdir("/")
        os.environ["ASTRAFLOW_TEST_KEPT"] = "changed"
        os.environ["ASTRAFLOW_TEST_ADDED"] = "1"
        return await EchoEnv.step(self, action)

    problems = _problems(broken(step=moving_step), tok)
    assert any(f"Broken (or a tool of it) changed the process's working directory from {tmp_path} to /" in p
               and "use absolute paths, or cwd= in subprocess calls" in p for p in problems), problems
    assert any("changed or removed os.environ['ASTRAFLOW_TEST_KEPT']: " in p and "pass env= to subprocess" in p
               for p in problems), problems
    assert not any("ASTRAFLOW_TEST_ADDED" in p for p in problems), problems
    assert os.getcwd() == str(tmp_path) and os.environ["ASTRAFLOW_TEST_KEPT"] == "yes"  # put back
    monkeypatch.delenv("ASTRAFLOW_TEST_ADDED", raising=False)
