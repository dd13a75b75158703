"""Arithmetic with a calculator tool: the smallest agentic workload.

Each task is a generated multi-operand expression (``37*12+5``); the model may call the
``calc`` tool, which evaluates an expression safely, and then answers with the integer as a
plain-text turn, scored by exact match. It exercises the whole agent path (a tool call, an
error observation, a final answer) with text short enough for a byte-level tiny model, and its
environment offers a scripted expert (one ``calc`` call, then the answer) for warm starts and
the conformance suite.

Problems are generated, not downloaded; the train and held-out splits are fixed by a hash of
the problem and the seed, so they are deterministic and disjoint whatever sizes are asked for.
``difficulty`` is the number of operators (``operands - 1``).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any, Literal, Mapping, get_args

import simpleeval
from pydantic import Field, model_validator

from astraflow.agents.env import Action, EnvironmentBase, Message, StepResult
from astraflow.agents.tools import ToolBox, format_call, tool
from astraflow.agents.workload import AgentParams, AgentWorkload
from astraflow.workloads.base import WORKLOADS
from astraflow.workloads.split import is_held_out

#: the longest expression ``calc`` evaluates (a tiny model's turn is short; so is the bound on
#: the size of a number it can build)
MAX_EXPRESSION_CHARS = 64

#: the operators a generated problem can use (``calc`` also divides)
Op = Literal["+", "-", "*"]
OPS: tuple[str, ...] = get_args(Op)

_CHARS = re.compile(r"[0-9+\-*/(). ]*")
_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.UAdd)
_EVAL = simpleeval.SimpleEval(
    operators={ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.USub: operator.neg, ast.UAdd: operator.pos},
    functions={}, names={})


class CalcError(ValueError):
    """An expression ``calc`` refuses or cannot evaluate (the message is what the model sees)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` of numbers, ``+ - * /`` and parentheses, or
    ``CalcError`` saying why not. Three layers, none of them ``eval``: a length limit and a
    character whitelist, a whitelist of syntax nodes, and ``simpleeval`` with only those
    operators and no names or functions."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not _CHARS.fullmatch(expression):
        bad = sorted(set(re.sub(r"[0-9+\-*/(). ]", "", expression)))
        raise CalcError(f"only numbers, + - * / and parentheses are allowed, not {''.join(bad)!r}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError("not a valid expression") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise CalcError("only numbers are allowed")
        elif not isinstance(node, _NODES):
            raise CalcError(f"{type(node).__name__} is not allowed: use numbers, + - * / and parentheses")
    try:
        value = _EVAL.eval(expression.strip())
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except (simpleeval.InvalidExpression, OverflowError) as err:
        raise CalcError(f"cannot evaluate: {err}") from None
    if isinstance(value, float) and not (abs(value) < 1e300):
        raise CalcError("the result is too large")
    return value


def format_number(value: int | float) -> str:
    """``value`` as the model reads and writes it: an integral value without a decimal point."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


@tool(timeout_s=2.0)
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses)."""
    try:
        return format_number(evaluate(expression))
    except CalcError as err:
        return f"error: {err}"


class CalculatorParams(AgentParams):
    """The calculator workload's ``params``: the episode limits and what problems to generate."""

    max_turns: int = Field(default=4, ge=1)
    """Model turns per episode at most (the expert takes two: a ``calc`` call, the answer)."""
    max_context_tokens: int = Field(default=256, ge=16)
    """Tokens per episode at most, observations included (then it is truncated)."""
    digits: int = Field(default=2, ge=1, le=6)
    """Maximum digits of each operand (operands are drawn from ``0 .. 10**digits - 1``)."""
    min_operands: int = Field(default=2, ge=2, le=6)
    """Fewest operands of a problem (difficulty ``min_operands - 1``)."""
    max_operands: int = Field(default=3, ge=2, le=6)
    """Most operands of a problem; each problem draws its count uniformly in between."""
    ops: tuple[Op, ...] = Field(default=("+", "-", "*"), min_length=1)
    """Operators to draw from, a non-empty subset of ``+ - *`` (the answer is always an integer)."""
    test_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Fraction of all problems that belong to the held-out split."""
    instructions: bool = False
    """Open each episode with a system message describing ``calc`` and the answer format (for
    a model that was not warm-started on the expert; costs context)."""

    @model_validator(mode="after")
    def _enough_problems(self) -> "CalculatorParams":
        if self.min_operands > self.max_operands:
            raise ValueError(f"min_operands ({self.min_operands}) must not exceed max_operands ({self.max_operands})")
        n = 10**self.digits
        space = sum(n**k * len(self.ops) ** (k - 1) for k in range(self.min_operands, self.max_operands + 1))
        for split, want, share in (("train", self.num_train, 1 - self.test_fraction),
                                   ("test", self.num_test, self.test_fraction)):
            if want > space * share / 2:
                raise ValueError(f"num_{split}={want} is more than half of the ~{int(space * share)} {split} "
                                 "problems these params allow: raise digits or max_operands, or lower it")
        return self


def _split_of(question: str, p: CalculatorParams) -> str:
    return "eval" if is_held_out(question, p.seed, p.test_fraction) else "train"


def make_problems(p: CalculatorParams, split: str) -> list[dict[str, Any]]:
    """``num_train`` or ``num_test`` problems of ``split`` (``"train"`` or ``"eval"``) as
    ``{"question": "37*12+5", "answer": "449", "difficulty": 2}``, in a seed-determined order."""
    want = p.num_train if split == "train" else p.num_test
    rng = random.Random(f"calculator:{p.seed}:{split}")
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    attempts = 0
    while len(out) < want:
        attempts += 1
        assert attempts < 100 * want + 10_000, "the params validator keeps the problem space large enough"
        k = rng.randint(p.min_operands, p.max_operands)
        terms = [str(rng.randrange(10**p.digits)) for _ in range(k)]
        question = terms[0] + "".join(rng.choice(p.ops) + t for t in terms[1:])
        if question in seen or _split_of(question, p) != split:
            continue
        seen.add(question)
        out.append({"question": question, "answer": format_number(evaluate(question)), "difficulty": k - 1})
    return out


_INSTRUCTIONS = ("Compute the expression. You may call calc: "
                 + format_call("calc", {"expression": "2*3+1"}) + " Then reply with the number only.")


class CalculatorEnv(EnvironmentBase):
    """One problem: ``calc`` calls are free, the first plain-text turn is the answer (exact
    match: reward and ``success`` 1.0, else 0.0; either way the episode ends)."""

    step_timeout_s = 5.0

    def __init__(self, instructions: bool = False):
        super().__init__()
        self.tools = ToolBox([calc])
        self.instructions = instructions
        self.task: Mapping[str, Any] | None = None
        self._expert_turns = 0

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        self.task, self._expert_turns = task, 0
        first = [{"role": "user", "content": str(task["question"])}]
        return ([{"role": "system", "content": _INSTRUCTIONS}] if self.instructions else []) + first

    async def step(self, action: Action) -> StepResult:
        assert self.task is not None, "step before reset"
        ok = float(action.text.strip() == self.task["answer"])
        return StepResult(observation=[], reward=ok, done=True, info={"success": ok})

    def expert_action(self) -> str:
        """The scripted expert's next turn: a ``calc`` call on the question, then the answer."""
        assert self.task is not None, "expert_action before reset"
        self._expert_turns += 1
        if self._expert_turns == 1:
            return format_call("calc", {"expression": self.task["question"]})
        return str(self.task["answer"])


@WORKLOADS.register("calculator")
class CalculatorWorkload(AgentWorkload):
    """Generated multi-operand arithmetic with a ``calc`` tool and an exact-match final answer
    (``workload.params`` are ``CalculatorParams`` fields)."""

    Params = CalculatorParams

    def tasks(self, split: str) -> list[dict[str, Any]]:
        if split not in ("train", "eval"):
            raise ValueError(f"calculator workload: split must be 'train' or 'eval', got {split!r}")
        return make_problems(self.params, split)

    def environment(self) -> CalculatorEnv:
        return CalculatorEnv(instructions=self.params.instructions)
