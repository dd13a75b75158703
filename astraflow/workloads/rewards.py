"""Rewards chosen by name: how a completion is scored against a task's reference answer.

A reward is a function ``(completion, answer, payload) -> float`` registered in ``REWARDS``
(``exact``, ``numeric``, ``math_verify``, ``regex``) or a user's ``"package.module:name"``.
``answer`` is the reference answer as the dataset workload extracted it (``#### 42`` of a
GSM8K solution is ``"42"``, the last ``\\boxed{}`` of a MATH solution its contents).

Each reward also has a *checker* for reference answers, used when a dataset is read: an
answer the reward can never match (a ``numeric`` reward over ``"seven"``) is bad data, counted
and reported with its row, not a task that silently scores 0.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, Callable, Mapping

from astraflow.registry import Registry
from astraflow.workloads import mathcheck
from astraflow.workloads.mathcheck import MINUS as _MINUS, gold

RewardFn = Callable[[str, str, Mapping[str, Any]], float]


def _check_reward(obj: object) -> str | None:
    """Why ``obj`` cannot be a reward: not callable, or not callable as ``(completion, answer,
    payload)`` (every rollout would fail with a ``TypeError``)."""
    if not callable(obj):
        return "is not a function"
    try:
        inspect.signature(obj).bind("", "", {})
    except TypeError:
        return "cannot be called as fn(completion, answer, payload): give it those three arguments"
    except ValueError:  # no signature to read: calling it will tell
        pass
    return None


REWARDS: Registry = Registry("reward", _check_reward)


class RewardError(RuntimeError):
    """A user's reward failed on a completion: it raised, or returned something that is not a
    finite number. The message names the reward, so a failed rollout says whose code it was."""


class UserReward:
    """A user's ``"package.module:name"`` reward, called as the function itself; what it raises
    and a return that is not a finite number become a ``RewardError`` naming it. A class, not a
    closure, so a workload holding it still pickles."""

    def __init__(self, name: str, fn: RewardFn):
        self.name, self.fn = name, fn
        self.check_answer = getattr(fn, "check_answer", None)

    def __call__(self, completion: str, answer: str, payload: Mapping[str, Any]) -> float:
        try:
            out = self.fn(completion, answer, payload)
        except Exception as err:
            raise RewardError(f"reward {self.name} raised {type(err).__name__}: {err}") from err
        try:
            value = float(out)
        except (TypeError, ValueError, OverflowError):
            value = math.nan
        if not math.isfinite(value):
            raise RewardError(f"reward {self.name} returned {repr(out)[:60]}: it must return a finite number")
        return value


def resolve_reward(name: str) -> RewardFn:
    """The reward registered as ``name`` or a user's ``"package.module:name"`` function, the
    latter wrapped to name itself when it fails (``UserReward``); ``ValueError`` listing the known
    ones."""
    fn = REWARDS.resolve(name)
    return UserReward(name, fn) if ":" in name else fn


def answer_problem(name: str, answer: str) -> str | None:
    """Why reward ``name`` cannot score against ``answer`` (``None``: it can)."""
    check = getattr(resolve_reward(name), "check_answer", None)
    return check(answer) if check is not None else None


def _checker(fn: Callable[[str], str | None]) -> Callable[[RewardFn], RewardFn]:
    def attach(reward: RewardFn) -> RewardFn:
        reward.check_answer = fn  # type: ignore[attr-defined]
        return reward
    return attach


# -- answers in text ---------------------------------------------------------------------------

#: a number as written in an answer: thousands separators only between groups of three digits,
#: an optional fraction and exponent
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\d,]*\d)|-?\.\d+(?:[eE][-+]?\d+)?")
#: the characters an answer is read from: after the last ``####``, else at the end of the completion
ANSWER_CHARS = 2000
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
#: a thousands separator as LaTeX writes it (MATH's ``10,\\!000``, ``1{,}200``, a thin space ``1\\,200``)
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\[,!]|\{\\,\})(?=\d{3}(?!\d))")


def _plain(text: str) -> str:
    """``text`` with a Unicode minus as ``-`` and LaTeX thousands separators as ``,``."""
    return _LATEX_THOUSANDS.sub(",", text.translate(_MINUS))


def final_text(text: str) -> str | None:
    """The text after the last ``####`` of ``text``, from its first non-blank character to the end
    of that line (``""`` when nothing follows it); ``None`` when ``text`` has no ``####``. The last
    one even on a line that writes two (``"#### 7 #### 18"`` -> ``"18"``)."""
    at = text.rfind("####")
    return None if at < 0 else text[at + 4:].lstrip().split("\n", 1)[0]


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K-style solution: the text after the last ``####`` (``final_text``),
    thousands separators and a trailing period dropped (``"... #### 1,200"`` -> ``"1200"``; empty
    when nothing follows that ``####``); the solution stripped when it has no ``####``."""
    final = final_text(solution)
    text = _plain(solution if final is None else final)
    return _THOUSANDS.sub("", text.strip()).rstrip(".").strip()


def boxed_answer(solution: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``solution``, braces
    balanced (escaped ``\\{``, ``\\}`` are text); the brace-less ``\\boxed 5`` form gives its
    token. ``None`` if there is none."""
    start = max(solution.rfind("\\boxed"), solution.rfind("\\fbox"))
    if start < 0:
        return None
    rest = solution[start + (6 if solution.startswith("\\boxed", start) else 5):]
    body = rest.lstrip()
    if not body.startswith("{"):
        token = re.match(r"[^\s$]+", body) if rest[:1].isspace() else None
        return token.group(0).rstrip(".") if token else None
    depth, j = 0, 0
    while j < len(body):
        c = body[j]
        if c == "\\":
            j += 2  # an escaped character (\{, \}) is not a brace
            continue
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            return body[1:j].strip()
        j += 1
    return None


def to_number(text: str) -> float | None:
    """``text`` as a number (thousands separators, LaTeX's too, an exponent, a Unicode minus
    allowed), or ``None``."""
    text = _plain(text.strip())
    if "," in text:
        if not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?:[eE][-+]?\d+)?", text):
            return None
        text = text.replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def final_number(completion: str) -> float | None:
    """The number a completion answers with: the one after its last ``####`` if it writes one
    (the GSM8K convention), else the last number in it; ``None`` if it has none. Read within
    ``ANSWER_CHARS`` (after the ``####``, else at the end): ``_NUMBER`` takes time quadratic in
    a run of digits and commas, which a degenerate completion (``1,1,1,...``) repeats for
    thousands of tokens, and holds the GIL meanwhile."""
    completion = _plain(completion)
    final = final_text(completion)
    if final and (numbers := _NUMBER.findall(final[:ANSWER_CHARS])):
        return to_number(numbers[0])
    numbers = _NUMBER.findall(completion[-ANSWER_CHARS:])
    return to_number(numbers[-1]) if numbers else None


def same_number(got: float, want: float) -> bool:
    """An integer reference ``want`` matches only itself; others match to 1e-6 relative. Not
    the tolerance for integers: ``1000000.5`` is within 1e-6 of both 1000000 and 1000001, one
    answer credited for two."""
    if want.is_integer():
        return got == want
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=0.0)


# -- the rewards ------------------------------------------------------------------------------------


def _exact_problem(answer: str) -> str | None:
    return None if gsm8k_answer(answer) else "empty answer"


@REWARDS.register("exact")
@_checker(_exact_problem)
def exact_match(completion: str, answer: str, payload: Mapping[str, Any]) -> float:
    """1.0 when the completion's final answer (after its last ``####``, else the whole
    completion) equals the reference, both normalised alike (``gsm8k_answer``: stripped,
    thousands separators and a trailing period dropped, as a reference read from a solution is)."""
    return 1.0 if gsm8k_answer(completion) == gsm8k_answer(answer) else 0.0


def _numeric_problem(answer: str) -> str | None:
    value = to_number(answer)
    return None if value is not None and math.isfinite(value) else f"answer {answer[:40]!r} is not a finite number"


@REWARDS.register("numeric")
@_checker(_numeric_problem)
def numeric_match(completion: str, answer: str, payload: Mapping[str, Any]) -> float:
    """1.0 when the completion's number (``final_number``) equals the reference number
    (``same_number``: an integer reference exactly, others to 1e-6 relative), else 0.0."""
    want, got = to_number(answer), final_number(completion)
    if want is None or got is None:
        return 0.0
    return 1.0 if same_number(got, want) else 0.0


#: an answer math-verify always parses (GSM8K's all, most of MATH's): checked without its parser,
#: which takes milliseconds an answer, hours over a dataset of millions of rows
_PLAIN_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")


def _math_verify_problem(answer: str) -> str | None:
    if _PLAIN_NUMBER.fullmatch(answer):
        return None
    return None if gold(answer) else f"math-verify cannot parse answer {answer[:40]!r}"


@REWARDS.register("math_verify")
@_checker(_math_verify_problem)
def math_verify_match(completion: str, answer: str, payload: Mapping[str, Any]) -> float:
    """1.0 when HF's ``math-verify`` finds the completion's answer mathematically equal to the
    reference (``\\frac{1}{2}``, ``0.5`` and ``1/2`` agree; ``\\boxed{}`` answers and GSM8K's
    ``#### N`` are extracted), else 0.0. Compared in a worker process under a deadline
    (``mathcheck``): an answer sympy cannot evaluate in time (``10^{10^{10}}``) scores 0."""
    text = final_text(completion) or completion[-ANSWER_CHARS:]  # nothing after a ####: the answer is elsewhere
    return 1.0 if mathcheck.equal(answer, text) else 0.0


def _regex_problem(answer: str) -> str | None:
    try:
        pattern = re.compile(answer)
    except re.error as err:
        return f"answer {answer[:40]!r} is not a regular expression ({err})"
    return f"answer {answer[:40]!r} matches every completion" if pattern.search("") else None


@REWARDS.register("regex")
@_checker(_regex_problem)
def regex_match(completion: str, answer: str, payload: Mapping[str, Any]) -> float:
    """1.0 when the reference answer, read as a regular expression, matches the completion
    (``re.search``), else 0.0: references such as ``"(?i)paris"`` or ``"^4[02]$"``."""
    try:
        return 1.0 if re.search(answer, completion.strip()) else 0.0
    except re.error:
        return 0.0
