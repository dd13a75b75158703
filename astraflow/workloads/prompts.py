"""Prompt formats of the second roles (verifier, selector) and how their answers are read.

They live apart from the workflows so that a module that must not import the rollout side
(the warm start in ``astraflow.training``) can build exactly the prompts the workflows send.
``astraflow.rollout.workflows`` uses them.
"""

from __future__ import annotations

import re

#: completion budget of the verifier: its own working (the sum, a few digits), then Y/N.
VERIFY_NEW_TOKENS = 8


def verify_prompt(question_prompt: str, answer_text: str) -> str:
    """What the verifier sees: the solver's prompt and answer, then ``?``. It answers with its
    own working and a verdict, Y or N (``"12+34=47?"`` -> ``"46N"``; see ``parse_verdict``)."""
    return f"{question_prompt}{answer_text.strip()}?"


def retry_prompt(question_prompt: str, rejected_answer: str) -> str:
    """What the solver sees on its retry after a reject: its answer, the verdict, the question again."""
    return f"{question_prompt}{rejected_answer.strip()} no. {question_prompt}"


def parse_verdict(text: str) -> bool | None:
    """The verdict in a verifier's completion: the last ``Y`` (accept, ``True``) or ``N``
    (reject, ``False``), after any working written before it (``"46N"``); ``None`` if neither."""
    for ch in reversed(text.strip().upper()):
        if ch in "YN":
            return ch == "Y"
    return None


#: completion budget of the selector: its own working (the sum), ``>``, then 1 or 2.
SELECT_NEW_TOKENS = 8


def select_prompt(question_prompt: str, first: str, second: str) -> str:
    """What the selector sees: the two candidate answers. It answers with its own working and
    a pick, 1 or 2 (``"12+34=46|47?"`` -> ``"46>1"``; see ``parse_pick``)."""
    return f"{question_prompt}{first.strip()}|{second.strip()}?"


def parse_pick(text: str) -> int | None:
    """The pick in a selector's completion: the 1 or 2 after the last ``>`` (after any working
    written before it, ``"46>1"``), or a completion that is just ``"1"`` or ``"2"``; ``None``
    otherwise (a sum with no ``>`` after it, ``"12"``, is working, not a pick)."""
    pick = text.strip()
    if ">" in pick:
        # the whole number after it: "46>12" picks nothing, not 1
        m = re.match(r"\s*(\d+)", pick.rsplit(">", 1)[1])
        pick = m.group(1) if m else ""
    return int(pick) if pick in ("1", "2") else None
