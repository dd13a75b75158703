"""Generated arithmetic problems: the workload of the first real RL run.

A task a tiny model can learn on two CPU cores, with a reward that cannot be argued with:
``a <op> b`` with operands of up to ``digits`` digits, graded by exact match of the first
integer in the completion. Problems are generated, not downloaded; the train and held-out
splits are fixed by a hash of the problem and the seed, so they are deterministic and
disjoint whatever sizes are asked for.

Interface (kept small on purpose): ``make_dataset(cfg, split) -> list[{"question", "answer"}]``,
``format_prompt(item) -> str`` and ``math_reward(completion_text, answer) -> float``.
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal, Mapping, get_args

from pydantic import Field, ValidationError

from astraflow.configbase import Strict
from astraflow.workloads.base import WORKLOADS, explain
from astraflow.workloads.split import is_held_out

SPLITS = ("train", "test")
#: up to this many distinct problems the generator enumerates all of them (then shuffles).
_ENUMERATE_LIMIT = 300_000


#: the operators a problem can use
Op = Literal["+", "-", "*"]
OPS: tuple[str, ...] = get_args(Op)


class MathConfig(Strict):
    """What problems to generate: the math workload's ``params`` (frozen). Read by
    ``make_dataset``."""

    digits: int = Field(default=2, ge=1, le=9)
    """Maximum digits of each operand (operands are drawn from ``0 .. 10**digits - 1``)."""
    ops: tuple[Op, ...] = Field(default=("+",), min_length=1)
    """Operators to draw from, a non-empty subset of ``OPS``."""
    test_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Fraction of all problems that belong to the held-out split."""
    num_train: int | None = Field(default=None, ge=0)
    """Problems in the train split; ``None``: every problem of the split."""
    num_test: int | None = Field(default=200, ge=0)
    """Problems in the held-out split; ``None``: every problem of the split."""
    seed: int = 0
    """Seed of the split assignment and of the order of the problems (as a workload's param:
    ``workload.seed`` unless set here)."""

    @classmethod
    def from_any(cls, cfg: "MathConfig | Mapping[str, Any] | None") -> "MathConfig":
        """``cfg`` itself, the defaults for ``None``, or a mapping validated (``ValueError``
        naming the bad or unknown field)."""
        if cfg is None:
            return cls()
        if isinstance(cfg, MathConfig):
            return cfg
        try:
            return cls.model_validate(cfg)
        except ValidationError as err:
            raise ValueError(explain("math", err, cls)) from None


def _solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def _split_of(a: int, op: str, b: int, cfg: MathConfig) -> str:
    return "test" if is_held_out(f"{a}{op}{b}", cfg.seed, cfg.test_fraction) else "train"


def make_dataset(cfg: MathConfig | Mapping[str, Any] | None, split: str) -> list[dict[str, str]]:
    """Problems of ``split`` (``"train"`` or ``"test"``) as ``{"question": "12+34", "answer": "46"}``,
    in a seed-determined order. The two splits never share a problem."""
    if split not in SPLITS:
        raise ValueError(f"math workload: split must be one of {SPLITS}, got {split!r}")
    cfg = MathConfig.from_any(cfg)
    want = cfg.num_train if split == "train" else cfg.num_test
    n_ops = 10**cfg.digits
    space = n_ops * n_ops * len(cfg.ops)
    rng = random.Random(f"{cfg.seed}:{split}")
    if space <= _ENUMERATE_LIMIT:
        probs = [
            (a, op, b)
            for op in cfg.ops
            for a in range(n_ops)
            for b in range(n_ops)
            if _split_of(a, op, b, cfg) == split
        ]
        rng.shuffle(probs)
        if want is not None:
            probs = probs[:want]
    else:
        if want is None:
            raise ValueError(
                f"math workload: {space} possible problems are too many to list; set num_{split}"
            )
        share = cfg.test_fraction if split == "test" else 1 - cfg.test_fraction
        holds = int(space * share)  # about: the split is drawn by a hash
        if want > holds // 2:  # drawn at random without repeats: past half the split it slows, past all never ends
            raise ValueError(f"math workload: num_{split} {want} is more than half the ~{holds} problems the {split} "
                             f"split holds ({space} in all, test_fraction {cfg.test_fraction}); lower num_{split}, "
                             "or widen the problems (digits, ops) or the split (test_fraction)")
        seen: set[tuple[int, str, int]] = set()
        probs = []
        while len(probs) < want:
            p = (rng.randrange(n_ops), rng.choice(cfg.ops), rng.randrange(n_ops))
            if p not in seen and _split_of(*p, cfg) == split:
                seen.add(p)
                probs.append(p)
    return [{"question": f"{a}{op}{b}", "answer": str(_solve(a, op, b))} for a, op, b in probs]


def format_prompt(item: Mapping[str, Any]) -> str:
    """The plain prompt the models see (short on purpose: ``"12+34="``)."""
    return f"{item['question']}="


def format_target(item: Mapping[str, Any]) -> str:
    """The supervised completion for warm starts (the end-of-turn token is added by the caller)."""
    return str(item["answer"])


_INT = re.compile(r"-?\d+")


def parse_answer(completion_text: str) -> int | None:
    """The first integer in the completion (leading spaces, ``=`` and trailing text tolerated),
    or ``None`` if there is none."""
    m = _INT.search(completion_text)
    return int(m.group()) if m else None


def math_reward(completion_text: str, answer: str | int) -> float:
    """1.0 if the first integer of the completion equals ``answer`` exactly, else 0.0."""
    got = parse_answer(completion_text)
    return 1.0 if got is not None and got == int(answer) else 0.0


def accuracy(completions: list[str], items: list[Mapping[str, Any]]) -> float:
    """Mean ``math_reward`` of completions against their items' answers."""
    if len(completions) != len(items):
        raise ValueError(f"accuracy: {len(completions)} completions for {len(items)} items")
    if not items:
        return 0.0
    return sum(math_reward(c, it["answer"]) for c, it in zip(completions, items)) / len(items)


# -- the registered workload ---------------------------------------------------------------------


@WORKLOADS.register("math")
class MathWorkload:
    """Generated arithmetic with an exact-match reward (``workload.params`` are ``MathConfig``
    fields; ``workload.seed`` seeds it unless ``params`` sets ``seed``)."""

    Params = MathConfig

    def __init__(self, seed: int = 0, **params: Any):
        self.cfg = type(self).Params.model_validate({"seed": seed, **params})  # a subclass's own Params too

    def tasks(self, split: str) -> list[dict[str, Any]]:
        return make_dataset(self.cfg, "test" if split == "eval" else split)

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        return format_prompt(payload)

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        return math_reward(completion, payload["answer"])

    def demonstration(self, payload: Mapping[str, Any]) -> str:
        """The supervised completion of ``payload`` (its answer)."""
        return format_target(payload)

    def source_weights(self) -> dict[str, float]:
        return {"": 1.0}
