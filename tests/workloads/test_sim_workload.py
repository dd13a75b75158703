"""The ``sim`` workload: seeded prompts, a reward that is a seeded function of the prompt and
the completion, succeeding more often as the weight version rises."""

from __future__ import annotations

import numpy as np

from astraflow.workloads.base import make_workload


def test_tasks_are_seeded_and_labelled():
    a, b = make_workload("sim", {}, 1), make_workload("sim", {}, 1)
    assert a.tasks("train") == b.tasks("train") and len(a.tasks("eval")) == 100
    assert a.tasks("train") != make_workload("sim", {}, 2).tasks("train")
    assert {t["difficulty"] for t in a.tasks("train")} == {"easy", "medium", "hard"}
    lengths = [len(a.render_prompt(t)) for t in a.tasks("train")]
    assert 32 <= min(lengths) and max(lengths) <= 96 and abs(np.mean(lengths) - 64) < 3


def test_reward_is_a_function_of_prompt_completion_and_version():
    wl = make_workload("sim", {"skill_per_version": 0.05}, 0)
    task = wl.tasks("train")[0]
    other = make_workload("sim", {"skill_per_version": 0.05}, 0)  # the same function, built again
    pairs = [(f"c{i}", t) for i, t in enumerate(wl.tasks("train")[:100])]
    first = [wl.reward_at(c, t, 3) for c, t in pairs]
    assert first == [wl.reward_at(c, t, 3) for c, t in pairs] == [other.reward_at(c, t, 3) for c, t in pairs]
    assert len(set(first)) > 1  # not one constant reward
    assert wl.reward("abc", task) == wl.reward_at("abc", task, 0)
    tasks = wl.tasks("train")[:200]
    completions = [f"c{i}" for i in range(20)]

    def mean_reward(version):
        return np.mean([wl.reward_at(c, t, version) for t in tasks for c in completions])

    early, late = mean_reward(0), mean_reward(60)
    expect_early = np.mean([wl.success_probability(t, 0) for t in tasks])
    assert abs(early - expect_early) < 0.03
    assert late > early + 0.3


def test_a_prompt_is_as_long_as_asked_even_shorter_than_its_header():
    wl = make_workload("sim", {"prompt_tokens": 4}, 0)
    assert {len(wl.render_prompt(t)) for t in wl.tasks("train")[:50]} <= set(range(1, 9))
