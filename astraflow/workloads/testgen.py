"""The test-generator role of the ``code`` workload: what it sees, the tests it writes, the
demonstrations its warm start trains on and the rule that rewards it.

The tester sees the problem (the task's signature and docstring, then ``# tests``) and writes a
*suite*: one assert per line, each pinning the output of the function on literal arguments,

    assert add_3(5) == 8
    assert add_3(-2) == 1

Each assert becomes one ``test_gen_<i>`` function for the sandbox. The rule (``suite_reward``)
is pure: it reads the sandbox results of the suite run against the reference solution and
against the episode's wrong candidates; the workflow (``astraflow.rollout.testgen``) runs them.
It lives here, not on the rollout side, so that the warm start (``astraflow.training``) builds
exactly the prompts and demonstrations the workflow uses.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

#: what follows the problem in the tester's prompt
TESTS_HEADER = "# tests\n"
#: a suite with more asserts than this is invalid (it bounds the sandbox work of one suite)
MAX_ASSERTS = 8
#: asserts in a warm-start demonstration (the shortest of the task's hidden tests)
DEMO_ASSERTS = 2
#: the tester's completion budget in tokens (the node's ``max_new_tokens`` is the solver's)
SUITE_NEW_TOKENS = 64
#: the reward of a valid suite that passes the reference but rejects none of the wrong
#: candidates: above an invalid or incorrect suite (0), below one that rejects them (1)
VALID_REWARD = 0.2
#: prefix of the sandbox test functions made from the asserts
TEST_PREFIX = "test_gen_"


@dataclass(frozen=True)
class Suite:
    """A parsed tester completion: its asserts (normalised source) or why it is invalid."""

    asserts: tuple[str, ...]
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None

    def source(self) -> str:
        """The asserts as sandbox tests: one top-level ``test_gen_<i>`` function each."""
        return "".join(f"def {TEST_PREFIX}{i}():\n    {a}\n\n" for i, a in enumerate(self.asserts))


def _literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _check_assert(line: str, entry_point: str) -> str | None:
    """Why ``line`` is not ``assert <entry_point>(<literals>) == <literal>``; None if it is."""
    try:
        tree = ast.parse(line)
    except (SyntaxError, ValueError):
        return "not Python"
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return "not an assert statement"
    if tree.body[0].msg is not None:  # evaluated when the assert fails: code the judge would run
        return "an assert with a message (`assert ..., msg`)"
    test = tree.body[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return "not `<call> == <expected>`"
    call, expected = test.left, test.comparators[0]
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == entry_point):
        return f"the left side is not a call of {entry_point}"
    if call.keywords or not all(_literal(a) for a in call.args) or not _literal(expected):
        return "the arguments and the expected value must be literals"
    return None


def parse_suite(text: str, entry_point: str) -> Suite:
    """The suite a tester completion writes. Valid: 1..``MAX_ASSERTS`` non-empty lines, each
    ``assert <entry_point>(<literal args>) == <literal>`` (a literal is anything
    ``ast.literal_eval`` reads: numbers, strings, lists, tuples, dicts, sets, booleans, None);
    blank lines are ignored; any other line makes the whole suite invalid."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return Suite((), "no asserts")
    if len(lines) > MAX_ASSERTS:
        return Suite((), f"{len(lines)} lines, more than {MAX_ASSERTS} asserts")
    for i, line in enumerate(lines):
        why = _check_assert(line, entry_point)
        if why is not None:
            return Suite((), f"line {i + 1}: {why}")
    return Suite(tuple(ast.unparse(ast.parse(ln).body[0]) for ln in lines))


# -- what the tester sees and is taught --------------------------------------------------------


def suite_prompt(payload: Mapping[str, Any]) -> str:
    """The tester's prompt: the problem (signature and docstring) and ``# tests``."""
    return payload["prompt"].rstrip("\n") + "\n" + TESTS_HEADER


def hidden_asserts(payload: Mapping[str, Any]) -> list[str]:
    """The asserts of the task's hidden tests that are in the tester's format, in order."""
    try:
        tree = ast.parse(payload["tests"])
    except SyntaxError:
        return []
    out = []
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test"):
            for node in fn.body:
                if isinstance(node, ast.Assert):
                    line = ast.unparse(node)
                    if _check_assert(line, payload["entry_point"]) is None:
                        out.append(line)
    return out


def suite_demonstration(payload: Mapping[str, Any], n: int = DEMO_ASSERTS) -> str:
    """A correct suite for ``payload``: the ``n`` shortest of its hidden tests' asserts that are
    in the tester's format (the generated tasks' hidden tests all are), in their order; short,
    so that it fits ``SUITE_NEW_TOKENS``. ``ValueError`` naming the task when it has none."""
    found = hidden_asserts(payload)
    keep = set(sorted(range(len(found)), key=lambda i: (len(found[i]), i))[:n])
    lines = [a for i, a in enumerate(found) if i in keep]
    if not lines:
        raise ValueError(f"task {payload.get('id')}: its hidden tests have no `assert f(...) == ...` line to "
                         "teach the tester; warm-start the tester on tasks that do (the generated families)")
    return "\n".join(lines) + "\n"


class TesterView:
    """A workload seen from the tester's seat: its tasks, the tester's prompt, the tester's
    demonstration and, as ``reward``, whether a suite is valid and passes on the reference
    solution (the warm start's held-out success; blocking, it runs the sandbox)."""

    def __init__(self, workload: Any):
        if not (callable(getattr(workload, "program", None)) and hasattr(workload, "demonstration")):
            raise ValueError(f"the tester role needs a code workload (one with program() and reference "
                             f"solutions); {type(workload).__name__} has neither: use workload.name: code")
        self.workload = workload

    def tasks(self, split: str) -> list[dict[str, Any]]:
        return self.workload.tasks(split)

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        return suite_prompt(payload)

    def demonstration(self, payload: Mapping[str, Any]) -> str:
        return suite_demonstration(payload)

    def reference_program(self, payload: Mapping[str, Any]) -> str | None:
        """The reference solution as the sandbox runs it; None when the task has none."""
        ref = payload.get("reference")
        return self.workload.program(ref, payload) if ref else None

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        from astraflow.sandbox import default_sandbox

        suite, ref = parse_suite(completion, payload["entry_point"]), self.reference_program(payload)
        if not suite.valid or ref is None:
            return 0.0
        return float(passes(default_sandbox().run(ref, suite.source()), suite))

    def source_weights(self) -> dict[str, float]:
        return self.workload.source_weights()


# -- the reward rule ---------------------------------------------------------------------------


def outcomes(result: Any, suite: Suite) -> list[bool | None]:
    """Per assert of ``suite``: whether it passed in ``result`` (a ``SandboxResult``); None when
    the run reported nothing for it (the program did not load, the run timed out)."""
    by_name = {t.name: bool(t.passed) for t in result.tests}
    return [by_name.get(f"{TEST_PREFIX}{i}") for i in range(len(suite.asserts))]


def passes(result: Any, suite: Suite) -> bool:
    """Whether the program passed every assert of ``suite``: the run ended ``ok`` and each
    assert's test passed."""
    return result.status == "ok" and all(o is True for o in outcomes(result, suite))


def suite_reward(suite: Suite, reference: Any | None, candidates: Sequence[Any]) -> tuple[float, dict[str, Any]]:
    """The tester's reward for ``suite`` and what it is made of (see ``docs/multi_policy.md``).

    ``reference``: the sandbox result of the suite run against the reference solution (None:
    the task has none); ``candidates``: its results against the episode's wrong candidates
    (distinct solver programs that fail the hidden tests).

    * 0 if the suite is invalid (``parse_suite``), the task has no reference, or the suite does
      not pass on the reference (an assert fails, the run times out, hits a limit or the sandbox
      itself fails: a suite that cannot be checked earns nothing);
    * else ``VALID_REWARD + (1 - VALID_REWARD) * rejected / wrong``, where ``wrong`` counts the
      candidates whose run the sandbox judged (a ``sandbox_error`` run is *unjudged*: left out)
      and ``rejected`` those of them that did not pass every assert (a failed assert, an error,
      a timeout or a limit all reject); ``rejected / wrong`` is 1 when ``wrong`` is 0.
    """
    info: dict[str, Any] = {"valid": suite.valid, "asserts": list(suite.asserts), "error": suite.error,
                            "passes_reference": False, "reference_status": None, "wrong": 0, "rejected": 0,
                            "unjudged": 0, "reference_outcomes": [], "rejects_per_assert": []}
    if not suite.valid:
        return 0.0, info
    if reference is None:
        info["error"] = "the task has no reference solution"
        return 0.0, info
    info["reference_status"] = reference.status
    info["reference_outcomes"] = outcomes(reference, suite)
    if not passes(reference, suite):
        return 0.0, info
    info["passes_reference"] = True
    judged = [c for c in candidates if c.status != "sandbox_error"]
    info["unjudged"] = len(candidates) - len(judged)
    info["wrong"] = len(judged)
    info["rejected"] = sum(not passes(c, suite) for c in judged)
    info["rejects_per_assert"] = [sum(outcomes(c, suite)[i] is False for c in judged)
                                  for i in range(len(suite.asserts))]
    frac = info["rejected"] / info["wrong"] if info["wrong"] else 1.0
    return VALID_REWARD + (1.0 - VALID_REWARD) * frac, info
