"""Prompt formats of the second roles (verifier, selector) and how their answers are read.

They live apart from the workflows so that a module that must not import the rollout side
(the warm start in ``astraflow.training``) can build exactly the prompts the workflows send.
``astraflow.workloads.workflows`` re-exports them.
"""

from __future__ import annotations


def verify_prompt(question_prompt: str, answer_text: str) -> str:
    """What the verifier sees: the solver's prompt and answer, then ``?`` (it answers Y/N)."""
    return f"{question_prompt}{answer_text.strip()}?"


def retry_prompt(question_prompt: str, rejected_answer: str) -> str:
    """What the solver sees on its retry after a reject: its answer, the verdict, the question again."""
    return f"{question_prompt}{rejected_answer.strip()} no. {question_prompt}"


def parse_verdict(text: str) -> bool | None:
    """``True`` for an accepting verdict (first letter Y), ``False`` for N, else ``None``."""
    t = text.strip().upper()
    return True if t.startswith("Y") else False if t.startswith("N") else None


def select_prompt(question_prompt: str, first: str, second: str) -> str:
    """What the selector sees: the two candidate answers; it answers 1 or 2."""
    return f"{question_prompt}{first.strip()}|{second.strip()}?"
