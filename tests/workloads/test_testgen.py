"""The test generator's format and reward rule (``astraflow.workloads.testgen``).

The rule is pure: it reads sandbox results. Here they are stand-ins built per case (what the
sandbox would report for each assert), so that every branch of the rule is pinned, timeouts
and sandbox errors included; that the real sandbox gives such results is covered by
``tests/rollout/test_testgen_workflow.py``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from astraflow.workloads import testgen as tg
from astraflow.workloads.testgen import MAX_ASSERTS, VALID_REWARD, Suite, hidden_asserts, parse_suite

PAYLOAD = {"id": "add:k=3:x", "prompt": 'def add_3(x):\n    """Return x plus 3."""\n', "entry_point": "add_3",
           "reference": "    return x + 3\n",
           "tests": "def test_0():\n    assert add_3(5) == 8\n\ndef test_1():\n    assert add_3(-2) == 1\n\n"
                    "def test_2():\n    assert add_3(0) == 3\n\ndef test_3():\n    assert add_3(7) == 10\n"}


@dataclass
class Outcome:
    name: str
    passed: bool
    error: str | None = None


@dataclass
class Result:
    """What the sandbox reports for one run: a status and one outcome per test."""
    status: str
    tests: tuple[Outcome, ...] = ()


def run(pattern: str, status: str | None = None) -> Result:
    """A run of a suite: one character per assert, ``P`` passed, ``F`` failed (status ``ok``
    when all passed, else ``failure``), or ``status`` with no outcomes (``timeout``...)."""
    if status is not None:
        return Result(status)
    tests = tuple(Outcome(f"test_gen_{i}", c == "P") for i, c in enumerate(pattern))
    return Result("ok" if all(t.passed for t in tests) else "failure", tests)


TWO = "assert add_3(5) == 8\nassert add_3(0) == 3\n"


@pytest.mark.parametrize("text, error", [
    (TWO, None),
    ("\n  assert add_3(5) == 8  \n\n", None),                       # blank lines and spaces ignored
    ("assert add_3([1, 2], 'a') == {'k': (1, None)}", None),       # any literals
    ("", "no asserts"),
    ("assert add_3(5) == 8\nprint(1)", "line 2: not an assert statement"),
    ("assert add_3(5) ==", "line 1: not Python"),                  # cut off by the token budget
    ("assert add_3(5) != 8", "line 1: not `<call> == <expected>`"),
    ("assert add_3(5) == add_3(5)", "line 1: the arguments and the expected value must be literals"),
    ("assert add_3(x=5) == 8", "line 1: the arguments and the expected value must be literals"),
    ("assert add_3(5 + y) == 8", "line 1: the arguments and the expected value must be literals"),
    ("assert True", "line 1: not `<call> == <expected>`"),
    ("assert add_4(5) == 9", "line 1: the left side is not a call of add_3"),
    ("assert add_3(5) == 8; import os", "line 1: not an assert statement"),
    # the message is code, run in the judge where the assert fails (it could forge the report)
    ("assert add_3(5) == 0, __import__('os')._exit(0)", "line 1: an assert with a message (`assert ..., msg`)"),
    ("assert add_3(5) == 8, 'why'", "line 1: an assert with a message (`assert ..., msg`)"),
    ("\n".join(["assert add_3(1) == 4"] * (MAX_ASSERTS + 1)), f"{MAX_ASSERTS + 1} lines, more than {MAX_ASSERTS} asserts"),
])
def test_suite_format(text, error):
    suite = parse_suite(text, "add_3")
    assert suite.error == error
    assert suite.valid == (error is None)
    assert (len(suite.asserts) > 0) == suite.valid


def test_a_suite_becomes_one_sandbox_test_per_assert():
    src = parse_suite(TWO, "add_3").source()
    ns: dict = {"add_3": lambda x: x + 3}
    exec(src, ns)
    assert sorted(k for k in ns if k.startswith("test_")) == ["test_gen_0", "test_gen_1"]
    ns["test_gen_0"](), ns["test_gen_1"]()


R = VALID_REWARD
VALID = parse_suite(TWO, "add_3")
INVALID = parse_suite("assert add_3(5) ==", "add_3")


@pytest.mark.parametrize("suite, reference, candidates, reward, wrong, rejected, unjudged", [
    # (a) invalid, no reference, or failing on the reference: 0, whatever the candidates
    (INVALID, run("PP"), [run("FF")], 0.0, 0, 0, 0),
    (VALID, None, [run("FF")], 0.0, 0, 0, 0),
    (VALID, run("PF"), [run("FF")], 0.0, 0, 0, 0),                  # one assert is wrong
    (VALID, run("", "timeout"), [run("FF")], 0.0, 0, 0, 0),          # the reference hangs on it
    (VALID, run("", "memory"), [], 0.0, 0, 0, 0),
    (VALID, run("", "sandbox_error"), [], 0.0, 0, 0, 0),             # cannot be checked: nothing
    (VALID, run("P"), [], 0.0, 0, 0, 0),                             # an assert with no result
    # (b) passes on the reference: 0.2 + 0.8 * rejected / wrong
    (VALID, run("PP"), [], 1.0, 0, 0, 0),                             # no wrong candidate
    (VALID, run("PP"), [run("PP")], R, 1, 0, 0),                      # rejects none
    (VALID, run("PP"), [run("PP"), run("PF")], R + (1 - R) / 2, 2, 1, 0),   # rejects some
    (VALID, run("PP"), [run("FP"), run("FF"), run("PF")], 1.0, 3, 3, 0),   # rejects all
    # a candidate that hangs or hits a limit under the suite is rejected ...
    (VALID, run("PP"), [run("", "timeout"), run("PP")], R + (1 - R) / 2, 2, 1, 0),
    (VALID, run("PP"), [run("", "output_limit")], 1.0, 1, 1, 0),
    # ... one the sandbox failed on is unjudged: left out of the fraction
    (VALID, run("PP"), [run("", "sandbox_error"), run("PP")], R, 1, 0, 1),
    (VALID, run("PP"), [run("", "sandbox_error")], 1.0, 0, 0, 1),
])
def test_suite_reward_rule(suite, reference, candidates, reward, wrong, rejected, unjudged):
    got, info = tg.suite_reward(suite, reference, candidates)
    assert got == pytest.approx(reward)
    assert 0.0 <= got <= 1.0
    assert (info["wrong"], info["rejected"], info["unjudged"]) == (wrong, rejected, unjudged)
    assert info["valid"] == suite.valid
    assert info["passes_reference"] == (suite.valid and reference is not None and got > 0)


def test_per_assert_details_are_recorded():
    _, info = tg.suite_reward(VALID, run("PP"), [run("FP"), run("FF"), run("PP")])
    assert info["asserts"] == ["assert add_3(5) == 8", "assert add_3(0) == 3"]
    assert info["reference_outcomes"] == [True, True]
    assert info["rejects_per_assert"] == [2, 1]
    _, bad = tg.suite_reward(VALID, run("PF"), [])
    assert bad["reference_outcomes"] == [True, False] and bad["reference_status"] == "failure"
    _, inv = tg.suite_reward(INVALID, None, [])
    assert inv["error"] == "line 1: not Python" and inv["asserts"] == []


def test_prompt_and_demonstration_come_from_the_task():
    assert tg.suite_prompt(PAYLOAD) == 'def add_3(x):\n    """Return x plus 3."""\n# tests\n'
    assert hidden_asserts(PAYLOAD) == ["assert add_3(5) == 8", "assert add_3(-2) == 1", "assert add_3(0) == 3",
                                       "assert add_3(7) == 10"]
    demo = tg.suite_demonstration(PAYLOAD)
    assert demo == "assert add_3(5) == 8\nassert add_3(0) == 3\n"  # the two shortest, in order
    assert parse_suite(demo, "add_3").valid  # what the warm start teaches is a valid suite
    with pytest.raises(ValueError, match="no `assert f"):
        tg.suite_demonstration({**PAYLOAD, "tests": "def test_check():\n    check(add_3)\n"})


def test_suite_is_a_value():
    assert Suite(("assert f(1) == 2",)).valid and not Suite((), "no asserts").valid


def test_the_tester_warm_start_needs_a_code_workload(tmp_path):
    import yaml

    from astraflow.config import config_from_dict
    from tests.conftest import ROOT

    data = yaml.safe_load((ROOT / "examples" / "code" / "config_testgen.yaml").read_text())
    for pol in data["policies"]:
        pol["model"] = str(tmp_path / pol["name"])
    config_from_dict(data)  # the example itself is valid
    data["workload"] = {"name": "math", "workflow": "solver_verifier"}
    with pytest.raises(ValueError, match="'test' teaches the test generator of a code workload"):
        config_from_dict(data)
