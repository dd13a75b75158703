"""The agent loop on scripted turns: token layout, masks, tools, rewards, truncation, failures."""

from __future__ import annotations

import asyncio
import enum
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import pytest
from pydantic import BaseModel

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.env import Action, EnvironmentBase, EpisodeError, StepResult
from astraflow.agents.episode import AgentLimits, run_agent_episode
from astraflow.agents.tools import ToolBox, format_call, parse_action, tool
from astraflow.models import build_tokenizer


@tool(timeout_s=5)
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@tool(timeout_s=0.3)
def nap(seconds: float) -> str:
    """Sleep, then answer (a slow tool)."""
    time.sleep(seconds)
    return "awake"


#: set by the episode that must finish while another waits on `until_released`
RELEASED = threading.Event()


@tool(timeout_s=30)
def until_released() -> str:
    """Wait until another episode lets go (a tool slower than a whole other episode)."""
    RELEASED.wait(30)
    return "released"


class SumEnv(EnvironmentBase):
    """Answer ``a+b``; a per-turn reward of 0.1 for each tool call the env is told about."""

    step_timeout_s = 2.0

    def __init__(self, shaped: float = 0.0):
        super().__init__()
        self.tools = ToolBox([add, nap, until_released])
        self.shaped = shaped
        self.closed = 0

    async def reset(self, task):
        self.task = task
        return [{"role": "user", "content": f"{task['a']}+{task['b']}?"}]

    async def step(self, action: Action) -> StepResult:
        if action.text.strip() == "hmm":
            return StepResult([{"role": "user", "content": "answer please"}], reward=self.shaped)
        ok = action.text.strip() == str(self.task["a"] + self.task["b"])
        return StepResult([{"role": "user", "content": "ok" if ok else "no"}], reward=float(ok), done=True,
                          info={"success": float(ok)})

    async def close(self):
        self.closed += 1


@dataclass
class Gen:
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    engine_seconds: float = 0.01


def scripted(tok, turns: list[str], version: int = 3, stop: int | None = None):
    """A ``generate`` that writes ``turns`` in order (each ending with ``stop``, by default the
    end-of-turn token)."""
    it = iter(turns)
    seen: list[list[int]] = []

    async def generate(tokens, max_new):
        seen.append(list(tokens))
        ids = tok.encode(next(it), add_special_tokens=False) + [tok.eos_token_id if stop is None else stop]
        finish = "stop"
        if len(ids) > max_new:
            ids, finish = ids[:max_new], "length"
        n = len(ids)
        return Gen(np.array(ids), np.full(n, -0.5, np.float32), np.full(n, version, np.int32), finish)

    generate.seen = seen
    return generate


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def run(gen, tok, env, task=None, **limits):
    return asyncio.run(run_agent_episode(gen, ChatRenderer(tok), env, task or {"a": 2, "b": 3},
                                         AgentLimits(**limits)))


def test_tool_then_answer_layout_and_masks(tok):
    env = SumEnv()
    gen = scripted(tok, [format_call("add", {"a": 2, "b": 3}), "5"])
    log = run(gen, tok, env)
    assert log.done and log.success == 1.0 and log.final_reward == 1.0 and env.closed == 1
    assert log.tool_calls == 1 and log.invalid_calls == 0 and log.truncated is None
    a = log.arrays()
    # each turn's context is exactly the tokens stored before it
    assert gen.seen[1] == log.tokens[: len(gen.seen[1])]
    # trained tokens are exactly the generated ones, in order, with their versions
    model_turns = [t for t in log.turns if t["kind"] == "model"]
    generated = [tok for t in model_turns for tok in log.tokens[t["start"]:t["end"]]]
    assert list(a["tokens"][a["loss_mask"]]) == generated
    assert set(a["versions"][a["loss_mask"]]) == {3} and set(a["versions"][~a["loss_mask"]]) == {-1}
    assert np.all(a["logprobs"][~a["loss_mask"]] == 0)
    text = tok.decode(log.tokens)
    assert "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n5<|im_end|>" in text
    assert text.startswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>")


def test_a_turn_ending_on_another_stop_token_is_read_without_it(tok):
    """The engines also stop on ``<|endoftext|>``: the turn's text and the reward are the same,
    and the context holds one closing, not two."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    log = run(scripted(tok, [format_call("add", {"a": 2, "b": 3}), "5"], stop=eot), tok, SumEnv())
    assert [t["text"] for t in log.turns if t["kind"] == "model"] == [format_call("add", {"a": 2, "b": 3}), "5"]
    assert log.success == 1.0 and log.invalid_calls == 0
    text = tok.decode(log.tokens)
    assert "<|im_end|><|im_end|>" not in text and "<|endoftext|>\n<|im_start|>tool" in text


@pytest.mark.parametrize("turn,why", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "not valid JSON"),
    # json's message "Unterminated string starting at" is not followed by a second "at"
    ('<tool_call>{"name": "add</tool_call>', "not valid JSON (Unterminated string starting at: character 9)"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "must end with"),
    ('<tool_call>{"name": "mul", "arguments": {"a": 1, "b": 2}}</tool_call>', "unknown tool 'mul'"),
    ('<tool_call>{"name": "add", "arguments": {"a": "x", "b": 2}}</tool_call>', "wrong arguments for add"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>', "wrong arguments for add"),
    # checked strictly against the schema the model sees: text or a bool is no integer, NaN no number
    ('<tool_call>{"name": "add", "arguments": {"a": "1", "b": 2}}</tool_call>', "a: Input should be a valid integer"),
    ('<tool_call>{"name": "add", "arguments": {"a": true, "b": 2}}</tool_call>', "a: Input should be a valid integer"),
    ('<tool_call>["add"]</tool_call>', '"name"'),
    # a misspelt key is no call with default arguments
    ('<tool_call>{"name": "add", "argumens": {"a": 1, "b": 2}}</tool_call>', "(not ['argumens'])"),
])
def test_bad_calls_become_error_observations(tok, turn, why):
    log = run(scripted(tok, [turn, "5"]), tok, SumEnv())
    tool_turn = next(t for t in log.turns if t["kind"] == "tool")
    assert why in tool_turn["messages"][0]["content"] and tool_turn["messages"][0]["content"].startswith("error:")
    assert log.invalid_calls == 1 and log.done and log.success == 1.0


def test_a_number_argument_takes_numbers_only():
    """A float parameter takes an integer, but not text, a bool, NaN or infinity, which its schema's
    "number" does not describe."""
    @tool
    def half(x: float) -> str:
        """Half of x."""
        return str(x / 2)

    box = ToolBox([half])
    for x, valid in [(3, True), (1.5, True), ("3", False), (True, False), (float("nan"), False), (float("inf"), False)]:
        call = parse_action(format_call("half", {"x": x})).tool_calls[0]
        assert asyncio.run(box.run(call)).valid is valid, x


class Line(BaseModel):
    name: str
    qty: int = 1


class Basket(BaseModel):
    lines: list[Line]
    note: Optional[str] = None


class Size(str, enum.Enum):
    small = "small"
    large = "large"


def test_describe_names_the_types_of_optional_enum_list_and_model_arguments():
    """``ToolBox.describe`` (the tools' lines of a system prompt) wrote ``any`` for an ``Optional``,
    enum, list-or-None or pydantic-model argument and left out defaults: the model was told
    nothing of what such a tool takes."""
    @tool
    def buy(basket: Basket, size: Optional[Size] = None, unit: Literal["kg", "g"] = "kg",
            tags: list[str] | None = None, k: int = 3) -> str:
        """Buy a basket."""
        return "ok"

    assert ToolBox([buy]).describe() == (
        'buy(basket: {lines: array of {name: string, qty: integer}, note: string | null}, '
        'size: "small" | "large" | null = null, unit: "kg" | "g" = "kg", tags: array of string | null = null, '
        'k: integer = 3): Buy a basket.')


def test_per_turn_rewards_add_to_the_return(tok):
    log = run(scripted(tok, ["hmm", "hmm", "5"]), tok, SumEnv(shaped=0.25))
    assert log.turn_rewards == [0.25, 0.25] and log.final_reward == 1.0 and log.reward == 1.5


def test_max_turns_and_context_truncate(tok):
    log = run(scripted(tok, ["hmm"] * 3), tok, SumEnv(), max_turns=3)
    assert log.truncated == "max_turns" and not log.done and log.reward == 0.0
    log = run(scripted(tok, ["hmm"] * 50), tok, SumEnv(), max_context_tokens=80)
    assert log.truncated == "context" and len(log.tokens) <= 80 and log.stats()["truncated"] == 1.0
    assert log.turns[-1]["start"] == log.turns[-1]["end"] == len(log.tokens)  # the answer it could not take
    assert log.turns[-1]["messages"] == [{"role": "user", "content": "answer please"}]
    log = run(scripted(tok, ["a long answer " * 10]), tok, SumEnv(), max_new_tokens=8)
    assert log.turns[1]["finish"] == "length" and log.done  # a cut turn is still an action



def test_a_turn_cut_by_the_context_budget_stays_within_it_with_its_closing(tok):
    """The budget leaves room for the closing a cut turn is given: what is stored, the closing
    included, never exceeds ``max_context_tokens`` (which may be the model's positions)."""
    class Chatty(SumEnv):  # never done: every turn is answered
        async def step(self, action: Action) -> StepResult:
            return StepResult([{"role": "user", "content": "go on"}], reward=0.0)

    first = len(ChatRenderer(tok).start([{"role": "user", "content": "2+3?"}]))
    for budget in range(first + 4, first + 40, 3):
        log = run(scripted(tok, ["hmm" * 20] * 4), tok, Chatty(), max_context_tokens=budget, max_new_tokens=64)
        assert len(log.tokens) <= budget, (budget, len(log.tokens))


def test_env_failures_fail_the_episode_and_close_it(tok):
    class Raising(SumEnv):
        async def step(self, action):
            raise KeyError("boom")

    class Hanging(SumEnv):
        step_timeout_s = 0.2

        async def step(self, action):
            await asyncio.sleep(10)

    class Garbage(SumEnv):
        async def step(self, action):
            return {"reward": 1}

    class NoReward(SumEnv):
        async def step(self, action):
            return StepResult([{"role": "user", "content": "ok"}], reward=None, done=True)

    class BoolReward(SumEnv):  # reward=(answer == secret): was "not a finite number"
        async def step(self, action):
            return StepResult([{"role": "user", "content": "ok"}], reward=np.bool_(True), done=True)

    class BadInfo(SumEnv):
        async def step(self, action):
            return StepResult([{"role": "user", "content": "ok"}], reward=np.float32(1.0), done=True, info=["x"])

    class BadSuccess(SumEnv):
        def __init__(self, success):
            super().__init__()
            self.success = success

        async def step(self, action):
            return StepResult([{"role": "user", "content": "ok"}], reward=1.0, done=True,
                              info={"success": self.success})

    for cls, why in ((Raising, "raised KeyError"), (Hanging, "deadline"), (Garbage, "not a StepResult"),
                     (NoReward, "NoReward.step returned reward None, not a finite number"),
                     (BoolReward, r"BoolReward.step returned reward True, a bool: give a number, reward=float\(...\)"),
                     (BadInfo, "BadInfo.step returned info of type list"),
                     (lambda: BadSuccess(None), r"info\['success'\] None, not a finite number"),
                     (lambda: BadSuccess("yes"), r"info\['success'\] 'yes'"),
                     (lambda: BadSuccess(float("nan")), r"info\['success'\] nan")):
        env = cls()
        with pytest.raises(EpisodeError, match=why):
            run(scripted(tok, ["5"]), tok, env)
        assert env.closed == 1
    env = SumEnv()
    with pytest.raises(EpisodeError, match="timeout"):
        run(scripted(tok, [format_call("nap", {"seconds": 2})]), tok, env)
    assert env.closed == 1


@pytest.mark.parametrize("templated", [True, False])
def test_a_reset_with_no_message_is_named_not_blamed_on_the_chat_template(tok, templated):
    """An empty first observation failed in the chat template ("cannot apply chat template to an
    empty conversation ... set the tokenizer's chat_template"), sending the user to fix the
    tokenizer; without a template the model was sampled from nothing."""
    class Silent(SumEnv):
        async def reset(self, task):
            self.task = task
            return []

    plain = build_tokenizer()
    plain.chat_template = None
    env = Silent()
    with pytest.raises(EpisodeError, match=r"^Silent.reset returned no message: return the first observation"):
        run(scripted(tok, ["5"]), tok if templated else plain, env)
    assert env.closed == 1


@pytest.mark.parametrize("extra", [{"meta": {1: "a", "b": 2}}, {("x", 1): "tuple key"}])
def test_a_message_that_cannot_be_stored_fails_its_episode_not_the_nodes_write(tok, extra):
    """An observation message is stored with the episode as sorted JSON: a key that cannot be
    (mixed int and str keys, a tuple) raised in the node's trajectory write, which failed the node
    and every episode of its write batch instead of this one."""

    class Odd(SumEnv):
        async def reset(self, task):
            return [{"role": "user", "content": "2+3?", **extra}]

    env = Odd()
    with pytest.raises(EpisodeError, match="Odd.reset returned a message that cannot be stored as JSON .*key as a str"):
        run(scripted(tok, ["5"]), tok, env)
    assert env.closed == 1


def test_sys_exit_in_a_tool_or_the_environment_fails_the_episode_not_the_process(tok, caplog):
    """A tool wrapping an argparse CLI exits on bad input; ``SystemExit`` must end that episode
    (named), not ``astraflow check``, a warm start or a node's loop."""

    @tool(timeout_s=5)
    def cli(args: str) -> str:
        """A command-line program."""
        raise SystemExit(2)

    @tool(timeout_s=5)
    async def acli(args: str) -> str:
        """The same, async."""
        sys.exit(2)

    class WithCli(SumEnv):
        def __init__(self):
            super().__init__()
            self.tools = ToolBox([cli, acli])

    class ExitingReset(SumEnv):
        async def reset(self, task):
            sys.exit(1)

    class ExitingClose(SumEnv):
        async def close(self):
            await super().close()
            sys.exit(4)

    for name in ("cli", "acli"):
        env = WithCli()
        with pytest.raises(EpisodeError, match=f"tool {name} raised SystemExit: 2"):
            run(scripted(tok, [format_call(name, {"args": "-x"})]), tok, env)
        assert env.closed == 1
    env = ExitingReset()
    with pytest.raises(EpisodeError, match="ExitingReset.reset raised SystemExit: 1"):
        run(scripted(tok, ["5"]), tok, env)
    assert env.closed == 1
    env = ExitingClose()
    with caplog.at_level("WARNING", logger="astraflow.agents"):
        log = run(scripted(tok, ["5"]), tok, env)
    assert log.done and log.success == 1.0 and env.closed == 1  # the episode's outcome stands
    assert "ExitingClose.close raised SystemExit: 4" in caplog.text


def test_slow_tool_does_not_delay_another_episode(tok):
    """One episode waits in a tool's thread until the other has finished: the other runs meanwhile
    (a tool that blocked the loop would hold both until the tool's timeout)."""
    done = []
    RELEASED.clear()

    async def both():
        async def one(name, turns):
            await run_agent_episode(scripted(tok, turns), ChatRenderer(tok), SumEnv(), {"a": 2, "b": 3},
                                    AgentLimits())
            done.append(name)
            RELEASED.set()

        await asyncio.gather(one("slow", [format_call("until_released", {}), "5"]),
                             one("fast", ["hmm", "hmm", "5"]))

    asyncio.run(both())
    assert done == ["fast", "slow"]


def test_plain_text_model_without_template(tok):
    plain = build_tokenizer()
    plain.chat_template = None
    log = run(scripted(plain, ["hmm", "5"]), plain, SumEnv())
    assert plain.decode(log.tokens).startswith("2+3?\nhmm<|im_end|>\nanswer please\n5")
    assert log.done and log.success == 1.0


def test_tools_stuck_past_their_timeout_do_not_starve_the_others():
    """Every slot of a small tool pool taken by a call that never returns in time: abandoned
    calls give their slots back, and a quick tool still answers."""

    from astraflow.agents.env import ToolCall
    from astraflow.agents.tools import ToolBox, _ToolThreads

    release = threading.Event()

    @tool(timeout_s=0.05)
    def stuck() -> str:
        """Never returns in time."""
        release.wait(5)
        return "late"

    box = ToolBox([stuck, add])

    async def go():
        for _ in range(4):
            with pytest.raises(EpisodeError, match="ran past its 0.05 s timeout"):
                await box.run(ToolCall("stuck", {}))
        return await box.run(ToolCall("add", {"a": 1, "b": 2}))

    import astraflow.agents.tools as tools_mod
    saved, tools_mod._THREADS = tools_mod._THREADS, _ToolThreads(size=4)
    try:
        assert asyncio.run(go()).content == "3"
    finally:
        release.set()
        tools_mod._THREADS = saved


def test_a_method_tool_binds_to_its_environment_and_deep_json_is_an_error_observation(tok):
    from astraflow.agents.env import ToolCall
    from astraflow.agents.tools import ToolBox, parse_action

    class Lookup:
        def __init__(self):
            self.kb = {"oslo": "Norway"}
            self.tools = ToolBox([self.country])

        @tool(timeout_s=1)
        def country(self, city: str) -> str:
            """Country of a city."""
            return self.kb.get(city, "unknown")

    box = Lookup().tools
    assert list(box.schemas()[0]["function"]["parameters"]["properties"]) == ["city"]
    assert asyncio.run(box.run(ToolCall("country", {"city": "oslo"}))).content == "Norway"
    deep = "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"
    assert parse_action(deep).errors == ("the tool call's JSON is nested too deeply",)


def test_a_method_tool_read_from_its_class_is_refused_naming_the_fix():
    """``tools = ToolBox([look])`` in the class body holds the method unbound: every valid call
    then failed its episode with "missing 1 required positional argument: 'self'", and the
    conformance suite (whose garbage calls never reach the tool) passed it."""
    with pytest.raises(ValueError, match=r"tool look is a method read from its class .* "
                                         r"self.tools = ToolBox\(\[self.look\]\)"):
        class Looking(EnvironmentBase):
            @tool
            def look(self, what: str) -> str:
                """Look at something."""
                return what

            tools = ToolBox([look])


def test_calls_queued_behind_stuck_tools_run_once_those_are_abandoned():
    """Twice as many stuck calls as a small pool has slots, all at once: the queued ones start
    as the first ones are abandoned and time out in turn, instead of waiting forever (or timing
    out in the queue, never having run: a deadline counts from a call's start)."""

    import astraflow.agents.tools as tools_mod
    from astraflow.agents.env import ToolCall
    from astraflow.agents.tools import ToolBox, _ToolThreads

    release, entered = threading.Event(), []

    @tool(timeout_s=0.1)
    def stuck() -> str:
        """Never returns in time."""
        entered.append(threading.get_ident())
        release.wait(10)
        return "late"

    box = ToolBox([stuck])

    async def one():
        with pytest.raises(EpisodeError, match="ran past its 0.1 s timeout"):
            await asyncio.wait_for(box.run(ToolCall("stuck", {})), 5)

    async def go():
        await asyncio.gather(*(one() for _ in range(8)))

    saved, tools_mod._THREADS = tools_mod._THREADS, _ToolThreads(size=4)
    try:
        asyncio.run(go())
        deadline = time.monotonic() + 10  # a call's deadline runs from its start, a hair before the tool's entry
        while len(entered) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(set(entered)) == 8, f"{len(entered)} of the 8 calls ran"  # each on a thread of its own
    finally:
        release.set()
        tools_mod._THREADS = saved


def test_tool_results_come_back_in_the_order_the_calls_were_written(tok):
    """Calls ``A, <unreadable>, C``: the observation is A's result, the error, C's result (tool
    messages carry no call id, so their order is how the model matches them)."""
    env = SumEnv()
    turn = format_call("add", {"a": 1, "b": 1}) + "<tool_call>x</tool_call>" + format_call("add", {"a": 2, "b": 2})
    log = run(scripted(tok, [turn, "5"]), tok, env, max_new_tokens=256)
    tool_turn = next(t for t in log.turns if t.get("kind") == "tool")
    got = [c.get("result", "error" if "error" in c else None) for c in tool_turn["calls"]]
    assert got == ["2", "error", "4"], tool_turn


def test_a_tools_own_timeout_error_is_not_reported_as_its_deadline():
    """A tool (or an environment call) that raises ``TimeoutError`` itself (a socket timeout)
    long before its deadline: the error names what it raised, not a deadline it never reached."""
    from astraflow.agents.env import ToolCall
    from astraflow.agents.episode import timed
    from astraflow.agents.tools import ToolBox

    @tool(timeout_s=30)
    def fetch() -> str:
        """Times out on its own connection."""
        raise TimeoutError("connect timed out")

    @tool(timeout_s=30)
    async def afetch() -> str:
        """The same, async."""
        raise TimeoutError("read timed out")

    box = ToolBox([fetch, afetch])
    for name, said in (("fetch", "connect timed out"), ("afetch", "read timed out")):
        with pytest.raises(EpisodeError, match=f"tool {name} raised TimeoutError: {said}"):
            asyncio.run(box.run(ToolCall(name, {})))

    async def reset():
        raise TimeoutError("env server")

    with pytest.raises(EpisodeError, match="Env.reset raised TimeoutError: env server"):
        asyncio.run(timed(reset(), 30, "Env.reset"))


async def _retrying_forever() -> None:
    """A retry loop whose bare ``except:`` also catches the cancellation of its deadline."""
    while True:
        try:
            await asyncio.sleep(100)
        except:  # noqa: E722 (the fault under test)
            await asyncio.sleep(0.01)


def test_a_call_that_catches_its_cancellation_is_abandoned_not_waited_for_forever(tok):
    """Under ``asyncio.timeout`` an environment call or async tool that swallows its cancellation
    held its episode (and the node's episode deadline, which cancels the same way) forever."""

    @tool(timeout_s=0.2)
    async def fetch() -> str:
        """Fetch, retrying."""
        await _retrying_forever()

    class Stuck(SumEnv):
        step_timeout_s = 0.2

        def __init__(self):
            super().__init__()
            self.tools = ToolBox([fetch])

        async def step(self, action):
            await _retrying_forever()

    for turn, what in (("5", "Stuck.step ran past its 0.2 s deadline"), (format_call("fetch", {}),
                                                                          "tool fetch ran past its 0.2 s timeout")):
        env, out = Stuck(), {}

        def go():  # on a loop of its own, in a thread the test can stop waiting for
            episode = run_agent_episode(scripted(tok, [turn]), ChatRenderer(tok), env, {"a": 2, "b": 3}, AgentLimits())
            try:
                asyncio.new_event_loop().run_until_complete(episode)
            except EpisodeError as err:
                out["error"] = str(err)

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"{what}: the episode never ended"
        assert f"{what} and did not stop when cancelled: it catches asyncio.CancelledError" in out["error"]
        assert env.closed == 1


@tool
def dump(n: int) -> str:
    """Write ``n`` characters (a tool that prints a huge file)."""
    return "x" * n


class DumpEnv(SumEnv):
    def __init__(self):
        super().__init__()
        self.tools = ToolBox([dump])

    async def step(self, action: Action) -> StepResult:
        if action.text.strip() == "more":
            return StepResult([{"role": "user", "content": "y" * 5000}])
        return await super().step(action)


class _LongestEncoded:
    """``tok``, noting the length of the longest text it was asked to encode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text, **kw)


def test_a_huge_tool_result_or_observation_is_cut_before_it_is_tokenised(tok):
    """A tool that returns megabytes neither stalls the episode's loop tokenising them nor ends
    the episode at the context limit: the model sees the start of it and how much was cut."""
    env = DumpEnv()
    gen = scripted(tok, [format_call("dump", {"n": 4_000_000}), "more", "5"])
    noted = _LongestEncoded(tok)
    log = run(gen, noted, env, max_context_tokens=4096, max_observation_chars=300)
    assert 0 < noted.longest < 5000, f"a text of {noted.longest} characters was tokenised"
    assert log.done and log.truncated is None and log.success == 1.0
    tool_turn = next(t for t in log.turns if t["kind"] == "tool")
    result = tool_turn["calls"][0]["result"]
    assert result.startswith("x" * 300) and "3999700 more characters cut" in result and len(result) < 400
    env_turn = next(t for t in log.turns if t["kind"] == "env" and not t.get("done"))
    assert env_turn["messages"][0]["content"].endswith("[... 4700 more characters cut: the result had 5000]")


_STUCK_TOOL = '''
import asyncio, threading
from astraflow.agents.env import EpisodeError, ToolCall
from astraflow.agents.tools import ToolBox, tool

@tool(timeout_s=0.2)
def hang(x: int) -> str:
    """Never returns."""
    threading.Event().wait()

try:
    asyncio.run(ToolBox([hang]).run(ToolCall("hang", {"x": 1})))
except EpisodeError as err:
    print("failed:", err)
'''


def test_a_process_with_a_tool_stuck_for_good_still_exits(tmp_path):
    """A plain tool that never returns fails its episode at its deadline, and its thread does
    not hold the process up when it exits."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "stuck.py").write_text(_STUCK_TOOL)
    done = subprocess.run([sys.executable, str(tmp_path / "stuck.py")], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "ran past its 0.2 s timeout" in done.stdout, done.stderr


_FUTURE_TOOLS = '''
from __future__ import annotations
from typing import Literal, Optional
from astraflow.agents.tools import tool

@tool
def convert(value: float, unit: Literal["km", "mi"] = "km", note: Optional[str] = None) -> str:
    """Convert a distance."""
    return f"{value * (1.609 if unit == 'mi' else 1.0):.1f}"
'''


def test_a_tool_of_a_module_with_postponed_annotations_gets_its_schema(tmp_path, monkeypatch):
    """Annotations kept as strings (``from __future__ import annotations``) are read in the
    tool's own module: ``Literal`` and the module's own imports work as they do without it."""
    import importlib

    from astraflow.agents.env import ToolCall

    (tmp_path / "future_tools.py").write_text(_FUTURE_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    box = ToolBox([importlib.import_module("future_tools").convert])
    props = box.schemas()[0]["function"]["parameters"]["properties"]
    assert props["unit"]["enum"] == ["km", "mi"]
    assert asyncio.run(box.run(ToolCall("convert", {"value": 2, "unit": "mi"}))).content == "3.2"



@pytest.mark.parametrize("star", ["*names: str", "**options: str"])
def test_a_tool_with_star_parameters_is_refused_when_it_is_made(star):
    """JSON arguments name each parameter: ``*names`` / ``**options`` made a schema no call
    could satisfy (every call an invalid one, or a ``TypeError`` failing the episode)."""
    namespace: dict = {}
    exec(f"def look({star}) -> str:\n    return 'x'", namespace)
    with pytest.raises(TypeError, match=r"tool look: \*{1,2}\w+ cannot be called with JSON arguments"):
        tool(namespace["look"])


def test_a_tool_with_positional_only_parameters_is_refused_when_it_is_made():
    """Tools are called with their JSON arguments by name: a parameter before ``/`` made every
    call a ``TypeError`` that failed the episode."""
    namespace: dict = {}
    exec("def look(room: str, /) -> str:\n    return room", namespace)
    with pytest.raises(TypeError, match=r"tool look: room is positional-only .* drop the '/'"):
        tool(namespace["look"])


def test_parameter_names_pydantic_reserves_are_tool_arguments_like_any_other(tok):
    """A parameter named like a member of pydantic's models (``model_config``, ``model_dump``,
    ``json``) or with a leading underscore was dropped from the schema (every call invalid) or
    failed with pydantic's error naming no tool."""

    def lookup(model_config: int, json: str, _key: str = "k", model_dump: bool = False) -> str:
        """Look it up."""
        return f"{model_config}/{json}/{_key}/{model_dump}"

    t = tool(lookup)
    params = t.schema["function"]["parameters"]
    assert list(params["properties"]) == ["model_config", "json", "_key", "model_dump"]
    assert params["required"] == ["model_config", "json"]
    out = asyncio.run(ToolBox([t]).run(parse_action(format_call("lookup", {"model_config": 3, "json": "j",
                                                                         "_key": "z"})).tool_calls[0]))
    assert out.valid and out.content == "3/j/z/False"
    bad = asyncio.run(ToolBox([t]).run(parse_action(format_call("lookup", {"arg0": 3})).tool_calls[0]))
    assert not bad.valid and "model_config: Field required" in bad.content and "arg0" in bad.content


def test_a_parameter_type_with_no_json_schema_is_refused_naming_the_tool():
    def look(where: threading.Event) -> str:
        """Look."""
        return "x"

    with pytest.raises(TypeError, match=r"tool .*look: its parameters cannot be JSON arguments .*JSON type"):
        tool(look)


@pytest.mark.parametrize("value, text", [(np.float32(1.5), "1.5"), (np.int64(7), "7"), (np.bool_(True), "true"),
                                         (np.arange(3), "[0, 1, 2]"), ({"n": np.int32(2)}, '{"n": 2}'),
                                         (None, "null"), ({"a": [1.0]}, '{"a": [1.0]}')])
def test_a_tool_result_computed_with_numpy_is_the_json_of_its_numbers(value, text):
    """A result that is a NumPy number (what computing it with NumPy gives) failed every episode that
    called the tool, as if it were no JSON."""

    def compute() -> str:
        """Compute."""
        return value

    out = asyncio.run(ToolBox([tool(compute)]).run(parse_action(format_call("compute", {})).tool_calls[0]))
    assert out.valid and out.content == text


def test_a_tool_result_that_is_no_json_fails_the_episode_naming_the_fix():
    def raw() -> str:
        """Raw bytes."""
        return b"\x00"

    with pytest.raises(EpisodeError, match="tool raw returned bytes, neither text nor JSON .*: return a str"):
        asyncio.run(ToolBox([tool(raw)]).run(parse_action(format_call("raw", {})).tool_calls[0]))


class _NumpyEnv(SumEnv):
    """Its reward and success are NumPy scalars (what comparing arrays gives); its first
    observation is as long as ``first_chars``."""

    def __init__(self, first_chars: int = 0):
        super().__init__()
        self.first_chars = first_chars

    async def reset(self, task):
        first = await super().reset(task)
        return [{"role": "user", "content": "x" * self.first_chars + first[0]["content"]}]

    async def step(self, action: Action) -> StepResult:
        got = np.array([action.text.strip()]) == np.array(["5"])
        return StepResult([{"role": "user", "content": "ok"}], reward=np.float32(got[0]), done=True,
                          info={"success": got[0], "score": np.float64(0.5)})


def test_numpy_scalars_for_reward_and_success_are_numbers(tok):
    log = run(scripted(tok, ["5"]), tok, _NumpyEnv())
    assert log.done and log.success == 1.0 and log.final_reward == 1.0
    assert log.turns[-1]["info"] == {"success": True, "score": 0.5}


def test_the_first_observation_is_cut_as_the_others_are(tok):
    log = run(scripted(tok, ["5"]), tok, _NumpyEnv(first_chars=20_000), max_context_tokens=2048,
              max_observation_chars=500)
    assert log.done and len(log.tokens) < 1000 and len(log.turns[0]["messages"][0]["content"]) <= 600
    with pytest.raises(EpisodeError, match="raise workload.params.max_context_tokens"):
        run(scripted(tok, ["5"]), tok, _NumpyEnv(first_chars=5_000), max_context_tokens=256,
            max_observation_chars=16_000)


class _DoneEnv(SumEnv):
    """Ends (or not) with the ``done`` it is given, whatever its type."""

    def __init__(self, done):
        super().__init__()
        self.done = done

    async def step(self, action):
        return StepResult([{"role": "user", "content": "again"}], reward=1.0, done=self.done, info={"success": 1.0})


def test_a_done_that_is_not_a_boolean_fails_the_episode(tok):
    """A string such as "no" is true: taken as done, it would end the episode with the wrong reward."""
    for done, why in (("no", "_DoneEnv.step returned done 'no' of type str, not a boolean"),
                      (None, "returned done None of type NoneType"), (2, "returned done 2 of type int")):
        env = _DoneEnv(done)
        with pytest.raises(EpisodeError, match=why):
            run(scripted(tok, ["5"] * 3), tok, env, max_turns=3)
        assert env.closed == 1
    for fine in (np.bool_(True), 1):  # what comparing arrays gives; a gym-style 0/1
        log = run(scripted(tok, ["5"]), tok, _DoneEnv(fine))
        assert log.done and log.final_reward == 1.0 and log.success == 1.0


class _CloseFails(SumEnv):
    async def close(self):
        self.closed += 1
        raise OSError("socket already gone")


def test_a_close_that_raises_is_logged_and_the_outcome_stands(tok, caplog):
    caplog.set_level("WARNING", logger="astraflow.agents")
    env = _CloseFails()
    log = run(scripted(tok, ["5"]), tok, env)
    assert log.done and log.final_reward == 1.0 and env.closed == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "astraflow.agents"]
    assert len(warnings) == 1, warnings
    assert "_CloseFails.close raised OSError: socket already gone" in warnings[0], warnings


def test_a_close_that_always_raises_is_said_once_with_its_traceback_then_at_powers_of_ten(tok, caplog):
    class AlwaysFailsToClose(_CloseFails):
        pass

    caplog.set_level("WARNING", logger="astraflow.agents")
    for _ in range(12):
        run(scripted(tok, ["5"]), tok, AlwaysFailsToClose())
    said = [r for r in caplog.records if r.name == "astraflow.agents"]
    assert [r.exc_info is not None for r in said] == [True, False], [r.getMessage() for r in said]
    assert said[1].getMessage().endswith("[10 times in this process]")


class _PlainClose(SumEnv):
    def close(self):  # gym style: not a coroutine
        self.closed += 1


def test_a_plain_synchronous_close_runs_without_a_warning(tok, caplog):
    caplog.set_level("WARNING", logger="astraflow.agents")
    env = _PlainClose()
    log = run(scripted(tok, ["5"]), tok, env)
    assert log.done and env.closed == 1
    assert not [r for r in caplog.records if r.name == "astraflow.agents"]

    class StepFails(_CloseFails):
        async def step(self, action):
            raise KeyError("boom")

    caplog.clear()
    with pytest.raises(EpisodeError, match="StepFails.step raised KeyError"):  # the episode's own error, not close's
        run(scripted(tok, ["5"]), tok, StepFails())
    assert [r.getMessage() for r in caplog.records if r.name == "astraflow.agents"] == [
        "StepFails.close raised OSError: socket already gone (the episode's own outcome stands; what the "
        "environment holds may not be released)"]


def test_a_workloads_own_default_keeps_the_base_bounds():
    """``max_turns: int = 5`` in a workload's Params drops the base field's ``ge=1``: the bounds
    still hold (no model turn trains nothing, and a run of such episodes never ends)."""
    from pydantic import ValidationError

    from astraflow.agents.workload import AgentParams

    class Params(AgentParams):
        max_turns: int = 5
        max_context_tokens: int = 512

    assert Params().max_turns == 5
    for bad in ({"max_turns": 0}, {"max_context_tokens": 8}):
        with pytest.raises(ValidationError, match=f"{next(iter(bad))} .*: give at least"):
            Params(**bad)


def test_a_tool_error_is_the_models_mistake_and_any_other_exception_fails_the_episode(tok):
    """``ToolError`` (a call the model got wrong, in the tool's words) is an error observation
    and an invalid call; a tool that raises anything else fails the episode, and the failure
    names ``ToolError`` as the way to let the model see its mistake."""
    from astraflow.agents.env import ToolError

    table = {"a": "1"}

    @tool()
    def lookup(key: str) -> str:
        """Look a key up."""
        if key not in table:
            raise ToolError(f"no key {key!r}; keys: a")
        return table[key]

    @tool()
    def fragile(key: str) -> str:
        """Look a key up, raising on a missing one."""
        return table[key]

    class LookupEnv(SumEnv):
        def __init__(self):
            super().__init__()
            self.tools = ToolBox([lookup, fragile])

    call = '<tool_call>{"name": "%s", "arguments": {"key": "zzz"}}</tool_call>'
    log = run(scripted(tok, [call % "lookup", "5"]), tok, LookupEnv())
    tool_turn = next(t for t in log.turns if t["kind"] == "tool")
    assert tool_turn["messages"][0]["content"] == "error: no key 'zzz'; keys: a"
    assert log.invalid_calls == 1 and log.done
    with pytest.raises(EpisodeError, match=r"tool fragile raised KeyError: 'zzz' \(a tool that raises fails its "
                                           r"episode.*raise astraflow.agents.env.ToolError"):
        run(scripted(tok, [call % "fragile", "5"]), tok, LookupEnv())


def test_the_last_allowed_turn_ends_on_its_closing_and_is_truncated_by_max_turns(tok):
    """No observation follows the last turn max_turns allows (no turn reads it), so however long
    the environment's answer, the episode ends on the turn's closing and is truncated by
    max_turns, not by the context; its per-turn reward still counts."""
    class Wordy(SumEnv):
        async def step(self, action: Action) -> StepResult:
            return StepResult([{"role": "user", "content": "go on " * 200}], reward=0.25)

    log = run(scripted(tok, ["hmm", "hmm"]), tok, Wordy(), max_turns=1, max_context_tokens=200)
    assert log.truncated == "max_turns" and log.turn_rewards == [0.25]
    last = log.turns[-1]  # the viewer still shows what the environment answered, as no tokens
    assert last["start"] == last["end"] == len(log.tokens) and last["messages"][0]["content"].startswith("go on")
    assert tok.decode(log.tokens).endswith("hmm<|im_end|>\n") and "go on" not in tok.decode(log.tokens)
    log = run(scripted(tok, ["hmm", "hmm", "hmm"]), tok, Wordy(), max_turns=2, max_context_tokens=4000)
    # the first observation and one reply
    assert log.truncated == "max_turns" and tok.decode(log.tokens).count("<|im_start|>user") == 2
