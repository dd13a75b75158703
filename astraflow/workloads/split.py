"""The seeded held-out split every workload draws its evaluation tasks by.

A task is held out by a hash of the seed and the task's own key, so its split depends on neither
the order tasks are drawn or read in nor on the other tasks, and a run resumed, or a dataset
re-read, puts every task where it was.
"""

from __future__ import annotations

import hashlib


def is_held_out(key: str, seed: object, fraction: float) -> bool:
    """Whether the task ``key`` is held out when a ``fraction`` of the tasks are: a number in
    [0, 1) fixed by ``seed`` and ``key`` falls below ``fraction``."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def evaluated(held_out: list[dict], num_prompts: int) -> list[dict]:
    """The prompts a run evaluates of a workload's ``tasks("eval")``: the first ``num_prompts``
    of its held-out split, and a second set (payloads with ``eval_set``) whole."""
    return [p for p in held_out if "eval_set" not in p][:num_prompts] + [p for p in held_out if "eval_set" in p]
