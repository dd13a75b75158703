"""The README's user workflow (``examples/custom_workflow/flows.py``), named as
``module:name``: registered on import, a second try only after a wrong answer, each try a
sequence rewarded by its own correctness."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from astraflow.contracts import RolloutTask
from astraflow.models import load_model
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.workflows import workflow_class
from astraflow.workloads.base import make_workload
from tests.rollout.test_role_workflows import Scripted


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_model(tiny_model)[1]


def _episode(tok, answers):
    cls = workflow_class("examples.custom_workflow.flows:two_tries")
    wf = cls(make_workload("math", {"digits": 2}, 0), SamplingParams(max_new_tokens=5), "n")
    engine = Scripted(tok, {"12+34=": answers})
    task = RolloutTask(task_id="g/0", group_id="g", policies=("solver",), workflow="two_tries",
                       prompt={"question": "12+34", "answer": 46}, kind="train")
    return asyncio.run(wf.run_episode({"solver": engine}, task)), engine


def test_a_right_first_answer_ends_the_episode(tok):
    traj, engine = _episode(tok, ["46"])
    assert [s.reward for s in traj.sequences] == [1.0] and len(engine.seen) == 1


def test_a_wrong_answer_gets_one_more_try(tok):
    traj, _ = _episode(tok, ["45", "46"])
    assert [s.reward for s in traj.sequences] == [0.0, 1.0]
    traj, _ = _episode(tok, ["45", "44"])
    assert [s.reward for s in traj.sequences] == [0.0, 0.0] and traj.episode_score() == 0.0


def test_an_unimportable_module_names_the_fix():
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.flows'.*run from the directory"):
        workflow_class("no_such_pkg.flows:x")


@pytest.mark.parametrize("line,needle", [
    ("import no_such_dep_", "'flows_dep' was found, but it imports 'no_such_dep_', which is not installed"),
    ("from json import no_such_name_", "'flows_dep' was found, but an import in it fails (cannot import name"),
])
def test_a_module_whose_own_import_fails_is_not_said_to_be_missing(tmp_path, monkeypatch, line, needle):
    """The module is there: moving it or the working directory would not help; its import would."""
    (tmp_path / "flows_dep.py").write_text(f"{line}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        workflow_class("flows_dep:x")
    assert needle in str(err.value) and "run from the directory" not in str(err.value)


def test_a_name_missing_from_the_modules_own_package_is_not_said_to_be_a_missing_module(tmp_path, monkeypatch):
    (tmp_path / "flowpkg").mkdir()
    (tmp_path / "flowpkg" / "__init__.py").write_text("")
    (tmp_path / "flowpkg" / "flows.py").write_text("from flowpkg import renamed_helper\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as err:
        workflow_class("flowpkg.flows:x")
    assert "'flowpkg.flows' was found, but an import in it fails" in str(err.value)
    assert "run from the directory" not in str(err.value)


def test_a_dependency_missing_on_a_worker_names_the_worker_s_environment(tmp_path, monkeypatch):
    """On a worker the orchestrator's environment may have the dependency: the fix is where the
    worker's jobs start."""
    (tmp_path / "flows_dep2.py").write_text("import no_such_dep_2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ASTRAFLOW_WORKER_NAME", "rollout-gpu-local-cpu-0")
    with pytest.raises(ValueError) as err:
        workflow_class("flows_dep2:x")
    assert "install it in the Python environment worker rollout-gpu-local-cpu-0's jobs start in" in str(err.value)



def test_the_readme_workflow_prompts_a_chat_model_through_its_template(tmp_path):
    """A user copying the example for a chat model and a dataset trains on the prompt the model
    is served with: the template's, as the built-in workflows make it (``prompt_ids``)."""
    import json

    from astraflow.agents.chat import prompt_ids
    from astraflow.models import build_bpe_tokenizer

    chat = build_bpe_tokenizer([f"{a}+{b}={a + b}" for a in range(40) for b in range(40)], vocab_size=300)
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}", "answer": str(2 * a)}) + "\n"
                                                 for a in range(20)))
    workload = make_workload("dataset", {"path": str(tmp_path / "sums.jsonl"), "reward": "numeric",
                                         "system_prompt": "Add."}, seed=0)
    task = RolloutTask(task_id="g/0", group_id="g", policies=("solver",), workflow="two_tries",
                       prompt=workload.tasks("train")[0], kind="train")
    served = chat.decode(prompt_ids(chat, workload, task.prompt), skip_special_tokens=True)
    assert "Add." in served  # the template's messages, the system prompt among them
    engine = Scripted(chat, {served: [str(task.prompt["answer"])]})
    cls = workflow_class("examples.custom_workflow.flows:two_tries")
    traj = asyncio.run(cls(workload, SamplingParams(max_new_tokens=5), "n").run_episode({"solver": engine}, task))
    assert [s.reward for s in traj.sequences] == [1.0] and engine.seen[0][0] == served


def test_a_sequence_of_lists_names_sequence_build():
    """A user's workflow that makes a ``Sequence`` of plain lists (as its tokens come) failed every
    episode with "'>=' not supported between instances of 'list' and 'int'"."""
    from astraflow.contracts import Sequence

    with pytest.raises(ValueError, match=r"^Sequence.tokens is a list, not a NumPy array: make the sequence with "
                                         r"Sequence.build\(...\), which takes lists"):
        Sequence(tokens=[1, 2], loss_mask=[False, True], logprobs=[0.0, -1.0], policy_ids=[-1, 0],
                 versions=[-1, 0], reward=1.0)
    seq = Sequence.build(tokens=[1, 2], loss_mask=[False, True], logprobs=[0.0, -1.0], policy_ids=[-1, 0],
                         versions=[-1, 0], reward=1.0)
    assert seq.loss_mask.dtype == bool and seq.tokens.dtype == np.int32
