"""Evaluations asked for (``workload.eval.every > 0``) of an empty held-out split would never run:
``check_data`` (``astraflow check`` and ``run``, before anything starts) refuses it, naming
``workload.eval.every`` and the split; ``eval.num_prompts`` above the held-out prompts there
are gets a line saying each evaluation takes those."""

from __future__ import annotations

import pytest

from astraflow.runtime.launch import check_data
from astraflow.workloads.config import WorkloadConfig
from tests.test_cli_errors import _config, _invoke


def _math(num_test: int, every: int = 2, num_prompts: int = 20) -> WorkloadConfig:
    return WorkloadConfig(name="math", params={"digits": 1, "num_test": num_test},
                          eval={"every": every, "num_prompts": num_prompts})


def test_evaluations_of_an_empty_held_out_split_are_refused():
    with pytest.raises(ValueError, match=r"workload.eval.every 2: workload math has no held-out prompts, so no "
                                         r"evaluation would ever run; set workload.eval.every: 0 .*"
                                         r"\(workload.params.num_test\)"):
        check_data(_math(0))


def test_without_evaluations_an_empty_held_out_split_is_fine():
    assert "0 held-out prompts" in check_data(_math(0, every=0))


def test_more_prompts_asked_for_than_held_out_is_said():
    lines = check_data(_math(20, num_prompts=100)).splitlines()
    held = int(lines[0].split(" and ")[1].split()[0])
    assert 0 < held < 100
    assert f"workload.eval.num_prompts 100: the held-out split has {held} prompts, so each evaluation takes " \
           f"those {held}" in lines
    assert len(check_data(_math(20, num_prompts=held)).splitlines()) == 1


def test_check_exits_2_naming_the_key(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", "workload.params.num_test=0")
    assert res.exit_code == 2, res.output
    assert "workload.eval.every 2: workload math has no held-out prompts" in " ".join(res.output.split())


def test_held_out_prompts_that_are_also_training_prompts_are_warned_about(tmp_path):
    """A test file that repeats rows of the train file: evaluations would count problems the policy
    trains on. Said once, with how many and the first one's row; disjoint files say nothing."""
    import json

    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(12)]
    train, test, other = tmp_path / "train.jsonl", tmp_path / "test.jsonl", tmp_path / "other.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    test.write_text("".join(json.dumps(r) + "\n" for r in rows[8:] + [{"question": "new?", "answer": "#### 1"}]))
    other.write_text("".join(json.dumps(dict(r, question=r["question"] + " Really?")) + "\n" for r in rows[8:]))
    wl = WorkloadConfig(name="dataset", params={"path": str(train), "test_path": str(test), "preset": "gsm8k"},
                        eval={"every": 2, "num_prompts": 4})
    (line,) = [x for x in check_data(wl).splitlines() if x.startswith("warning:")]
    assert line.startswith("warning: 4 of the 5 held-out prompts are also training prompts (the first: ")
    assert "test.jsonl line " in line and "a test file without them" in line
    apart = wl.model_copy(update={"params": dict(wl.params, test_path=str(other))})
    assert "warning:" not in check_data(apart)
