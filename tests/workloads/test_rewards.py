"""Rewards chosen by name: exact, numeric, math_verify (HF math-verify), regex, and the
answer extraction of the GSM8K and MATH layouts."""

import json
import math
import pickle
import subprocess
import sys
import threading
import time

import pytest

from astraflow.workloads import mathcheck
from astraflow.workloads.rewards import (
    RewardError, answer_problem, boxed_answer, final_number, gsm8k_answer, resolve_reward,
)


def score(name: str, completion: str, answer: str) -> float:
    return resolve_reward(name)(completion, answer, {})


@pytest.mark.parametrize("completion", ["0.5", "1/2", "\\frac{1}{2}", "$\\frac{1}{2}$", "The answer is \\boxed{\\frac12}.",
                                        "so it is 0.50", "working...\n#### 1/2"])
def test_math_verify_accepts_equivalent_forms(completion):
    assert score("math_verify", completion, "\\frac{1}{2}") == 1.0


@pytest.mark.parametrize("completion", ["0.6", "2", "\\frac{1}{3}", "no idea", "", "#### 5"])
def test_math_verify_rejects_wrong_answers(completion):
    assert score("math_verify", completion, "\\frac{1}{2}") == 0.0


def test_math_verify_runs_off_the_main_thread():
    """A RaaS node scores in worker threads, where math-verify's SIGALRM timeout is unavailable."""
    out = []
    t = threading.Thread(target=lambda: out.append(score("math_verify", "x = 0.5", "1/2")))
    t.start()
    t.join()
    assert out == [1.0]


#: a power tower, a factorial of a billion, a binomial of a trillion: sympy computes them in C code that
#: holds the GIL, so a reward thread's deadline cannot stop them and its whole process stalls
_UNEVALUABLE = ["\\boxed{10^{10^{10}}}", "\\boxed{(10^{9})!}", "\\boxed{\\binom{10^{12}}{10^6}}", "#### 9**9**9"]


def test_math_verify_answer_sympy_cannot_evaluate_scores_0_without_stalling_the_process():
    """Scored on a thread, as a RaaS node scores: each scores 0 within its deadline, compared in a
    worker process, so sympy (whose C code holds the GIL) never runs in the scoring process (a
    child Python, so a stall fails the test instead of hanging it)."""
    code = f"""if True:
        import json, sys, threading
        from astraflow.workloads import mathcheck
        from astraflow.workloads.rewards import math_verify_match
        out = []
        th = threading.Thread(target=lambda: out.extend(math_verify_match(c, "46", {{}}) for c in {_UNEVALUABLE!r}))
        th.start()
        th.join()
        mathcheck.close()
        print(json.dumps([out, sorted(m for m in ("sympy", "math_verify") if m in sys.modules)]))
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    scores, imported = json.loads(run.stdout)
    assert scores == [0.0] * len(_UNEVALUABLE)
    assert imported == [], f"{imported} ran in the scoring process: their C code there stalls all its threads"


def test_a_math_verify_worker_ends_itself_past_its_cpu_limit_as_an_orphan_would():
    """Nothing kills a worker whose node died mid-comparison: the kernel ends it at its CPU limit.
    On a loaded machine math-verify's own wall-clock timeout may answer first: the same request
    again then goes on from the CPU the worker used so far."""
    import json
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "astraflow.workloads.mathcheck", "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                proc.stdin.write(json.dumps(["46", "\\boxed{(1+x)^{100000}}"]) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # ended meanwhile
                break
            assert proc.stdout.readline().strip() in ("0", "")  # "": ended while it compared
        assert proc.wait(timeout=10) == -signal.SIGXCPU
    finally:
        proc.kill()
        proc.wait()


def test_math_verify_comparison_past_its_deadline_is_killed_and_the_next_one_scores(monkeypatch):
    monkeypatch.setattr(mathcheck, "DEADLINE_S", 0.5)
    assert score("math_verify", "\\boxed{(1+x)^{100000}}", "46") == 0.0
    assert score("math_verify", "\\boxed{46}", "46") == 1.0


def test_math_verify_worker_that_cannot_start_is_an_error_not_a_zero(monkeypatch):
    pool = mathcheck.Pool(1)
    monkeypatch.setattr(mathcheck.sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="math-verify worker .* did not start"):
        pool.equal("46", "46")
    pool.close()


def test_numeric_reads_the_final_answer():
    assert score("numeric", "12 + 7 = 19\n#### 19", "19") == 1.0
    assert score("numeric", "#### 1,200", "1200") == 1.0
    assert score("numeric", "first 3 then 19", "19") == 1.0  # the last number without ####
    assert score("numeric", "#### 18 (not 19)", "19") == 0.0  # the number after #### wins
    assert score("numeric", "nothing", "19") == 0.0
    assert final_number("-4.5 is it") == -4.5


def test_exact_and_regex():
    assert score("exact", " Paris ", "Paris") == 1.0
    assert score("exact", "paris", "Paris") == 0.0
    assert score("exact", "thinking\n#### Paris", "Paris") == 1.0
    # a completion written like the dataset's own solution: normalised as its reference was
    assert score("exact", "She pays 1,200 in total.\n#### 1,200", gsm8k_answer("...\n#### 1,200")) == 1.0
    assert score("exact", "So it is 42.\n#### 42.", "42") == 1.0
    assert score("regex", "It is PARIS.", "(?i)paris") == 1.0
    assert score("regex", "London", "(?i)paris") == 0.0


def test_answer_checks_name_what_a_reward_cannot_score():
    assert answer_problem("numeric", "seven") is not None
    assert answer_problem("numeric", "1,200") is None
    assert answer_problem("numeric", "nan") is not None and answer_problem("numeric", "inf") is not None
    assert answer_problem("math_verify", "\\frac{1}{2}") is None
    assert answer_problem("math_verify", "") is not None
    assert answer_problem("regex", "(unclosed") is not None
    assert answer_problem("exact", "  ") is not None


def test_plain_number_answers_are_checked_without_the_math_verify_parser(monkeypatch):
    """Reading a dataset checks every answer: math-verify's parser takes milliseconds an answer,
    hours over millions of GSM8K-style rows, and always parses a plain number."""
    from astraflow.workloads import rewards

    parsed = []
    monkeypatch.setattr(rewards, "gold", lambda answer: parsed.append(answer) or [answer])
    for answer in ("42", "-7", "2.50", ".5", "007"):
        assert answer_problem("math_verify", answer) is None
    assert parsed == []
    assert answer_problem("math_verify", "\\frac{1}{2}") is None and parsed == ["\\frac{1}{2}"]


def test_extraction_of_public_layouts():
    assert gsm8k_answer("She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7") == "7"
    assert gsm8k_answer("#### 1,234.") == "1234"
    assert boxed_answer("so $x = \\boxed{\\frac{a}{b^{2}}}$ and \\boxed{3}") == "3"
    assert boxed_answer("only \\boxed{\\frac{a}{b^{2}}}") == "\\frac{a}{b^{2}}"
    assert boxed_answer("no box here") is None


def user_reward(completion, answer, payload):
    """A user's reward named by module:name in a config."""
    return 1.0 if answer in completion else 0.5


def numeric(completion, answer, payload):
    """A user's reward that shares a built-in's name."""
    return 0.25


def test_user_reward_by_module_name():
    assert resolve_reward("tests.workloads.test_rewards:user_reward")("abc", "b", {}) == 1.0
    assert resolve_reward("tests.workloads.test_rewards:numeric")("5", "5", {}) == 0.25  # the module's, not the built-in
    with pytest.raises(ValueError, match="known: exact, math_verify, numeric, regex"):
        resolve_reward("no_such_reward")
    with pytest.raises(ValueError, match="'tests.workloads.test_rewards' has no 'nosuch'"):
        resolve_reward("tests.workloads.test_rewards:nosuch")


@pytest.mark.parametrize("reward,completion,answer,expected", [
    ("numeric", "The answer is 1e3", "1000", 1.0),
    ("numeric", "x = 2.5e-3", "-3", 0.0),
    ("numeric", "\u22125", "-5", 1.0),
    ("numeric", "\u22125", "5", 0.0),
    ("numeric", "#### 2000001", "2000000", 0.0),
    ("numeric", "#### 2000000.5", "2000000", 0.0),  # else it matches 2000001 too: one answer for two
    ("numeric", "#### 2000000.5", "2000001", 0.0),
    ("numeric", "#### 46.00001", "46", 0.0),
    ("numeric", "#### 0.30000000000000004", "0.3", 1.0),
    ("numeric", "#### 0", "0.0000005", 0.0),
    ("numeric", "#### 7,2", "72", 0.0),
    ("numeric", "#### 1,234,567", "1234567", 1.0),
    ("numeric", "so \\boxed{10,\\!000}.", "10000", 1.0),  # LaTeX thousands separators: MATH writes 10,\!000
    ("numeric", "so \\boxed{1{,}200}.", "1200", 1.0),
    ("numeric", "so \\boxed{1\\,200}.", "1,200", 1.0),
    ("numeric", "#### 1200", "1{,}200", 1.0),
    ("numeric", "so \\boxed{1{,}20}.", "120", 0.0),
    ("exact", "#### 10,\\!000", "10000", 1.0),
    ("numeric", "3.0", "3", 1.0),
    ("exact", "#### (12)", "(1,2)", 0.0),
    ("exact", "#### 1,200.", "1200", 1.0),
    ("math_verify", "\\boxed{4}", "4a", 0.0),
    ("math_verify", "\\boxed{4a}", "4a", 1.0),
    ("math_verify", "He pays 3 \\times 5 = 15 dollars and keeps 2: 17", "17", 1.0),
    ("math_verify", "\\frac{1}{2}", "0.5", 1.0),
    ("math_verify", "#### \u22123", "-3", 1.0),
])
def test_answers_written_every_which_way_score_as_they_should(reward, completion, answer, expected):
    assert score(reward, completion, answer) == expected


def test_answers_that_cannot_be_scored_are_refused():
    assert answer_problem("exact", "...") and answer_problem("regex", "") and answer_problem("regex", "a*")
    assert answer_problem("math_verify", "(2,3)") is None and answer_problem("math_verify", "\\$18.90") is None
    assert boxed_answer("$\\boxed 5$. (Here $\\frac{1}{2}$ ...)") == "5" and boxed_answer("\\boxed{5\\}}") == "5\\}"


def test_the_answer_is_after_the_last_marker_even_on_one_line():
    """Two ``####`` on one line: every reward reads the text after the later one, as the
    reference extraction does."""
    for reward in ("numeric", "exact", "math_verify"):
        assert score(reward, "#### 7 #### 18", "18") == 1.0, reward
        assert score(reward, "#### 7 #### 18", "7") == 0.0, reward
        assert score(reward, "first #### 7\nthen #### 18", "18") == 1.0, reward


@pytest.mark.parametrize("run", ["12,345,", "1,"])
def test_numeric_reads_a_degenerate_completion_in_bounded_time(run, monkeypatch):
    """A policy stuck repeating digits and commas: reading its number took time quadratic in the
    completion's length (seconds at 60k characters, the GIL held), now bounded by ANSWER_CHARS:
    the number pattern (the quadratic part) is never given more than that."""
    from astraflow.workloads import rewards

    searched: list[int] = []

    class Noted:
        def findall(self, text):
            searched.append(len(text))
            return number.findall(text)

    number = rewards._NUMBER
    monkeypatch.setattr(rewards, "_NUMBER", Noted())
    for completion in (run * (60_000 // len(run)) + " so 46", "#### " + run * (60_000 // len(run))):
        score("numeric", completion, "46")
    assert searched and max(searched) <= rewards.ANSWER_CHARS, searched
    assert score("numeric", run * (60_000 // len(run)) + " so 46", "46") == 1.0


def test_reference_and_completion_extraction_read_the_last_marker():
    assert gsm8k_answer("x #### 4 #### 5") == "5"
    assert gsm8k_answer("3 + 4 = 7\n####") == "" and gsm8k_answer("3 + 4 = 7\n#### ") == ""
    assert gsm8k_answer("####\n 12\nmore") == "12" and gsm8k_answer(" no marker. ") == "no marker"
    assert final_number("#### 7 #### 18") == 18.0
    assert final_number("#### 7 #### none") == 7.0  # no number after the last ####: the last number


def user_raising(completion, answer, payload):
    return {}["no_such_key"]


def user_word(completion, answer, payload):
    return "yes"


def user_nan(completion, answer, payload):
    return math.nan


def test_a_user_reward_that_fails_is_named():
    """What a user's reward raises, or a return that is not a finite number, names the reward:
    the rollout's failure reason says whose code to fix."""
    mod = "tests.workloads.test_rewards"
    with pytest.raises(RewardError, match=f"^reward {mod}:user_raising raised KeyError: 'no_such_key'$"):
        resolve_reward(f"{mod}:user_raising")("c", "a", {})
    with pytest.raises(RewardError, match=f"^reward {mod}:user_word returned 'yes': it must return a finite number"):
        resolve_reward(f"{mod}:user_word")("c", "a", {})
    with pytest.raises(RewardError, match=f"^reward {mod}:user_nan returned nan: it must return a finite number"):
        resolve_reward(f"{mod}:user_nan")("c", "a", {})
    fn = pickle.loads(pickle.dumps(resolve_reward(f"{mod}:user_reward")))  # a workload holding it still pickles
    assert fn("abc", "b", {}) == 1.0 and answer_problem(f"{mod}:user_reward", "x") is None


def user_two_args(completion, answer):
    """A user's reward missing the payload argument."""
    return 1.0


def test_a_user_reward_with_the_wrong_arguments_is_refused_when_named():
    """A reward that cannot take ``(completion, answer, payload)`` would fail every rollout with
    a TypeError once the run started: resolving it names the fix (``astraflow check``, exit 2)."""
    with pytest.raises(ValueError, match="user_two_args cannot be called as fn\\(completion, answer, payload\\)"):
        resolve_reward("tests.workloads.test_rewards:user_two_args")
    with pytest.raises(ValueError, match="test_rewards:math is not a function"):
        resolve_reward("tests.workloads.test_rewards:math")
