"""The ``sim`` workload: prompts and a reward for simulated runs, no text to understand.

Each prompt has a seeded hardness (standard normal; ``difficulty`` is its easy/medium/hard
label). A completion is correct with probability
``sigmoid(skill(version) - hardness)``, where the policy's skill rises with the weight
version that generated it (``base_skill + skill_per_version * version``, at most ``max_skill``),
and the draw is a seeded hash of the prompt and the completion: the same completion of the same
prompt always scores the same, samples of one group differ, and a run "learns" as versions
advance. The ``sim`` workflow passes the version (``reward_at``); ``reward`` alone scores as
version 0.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from astraflow.workloads.base import WORKLOADS


class SimParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_train: int = Field(default=2000, ge=1)
    """Train prompts."""
    num_test: int = Field(default=100, ge=1)
    """Held-out prompts."""
    prompt_tokens: int = Field(default=64, ge=1)
    """Mean prompt length in tokens (uniform between half and one and a half times it)."""
    base_skill: float = -1.0
    """Skill of version 0 (logit units; hardness is standard normal)."""
    skill_per_version: float = Field(default=0.02, ge=0)
    """Skill gained per weight version."""
    max_skill: float = 3.0
    """The skill no version goes beyond."""
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seed of the prompts' hardness and lengths and of the rewards' draws (``workload.seed`` unless
    set here; 0 to 2**32 - 1, the seeds numpy takes)."""


def _bucket(hardness: float) -> str:
    """The label held-out accuracy is broken down by (``difficulty``, as other workloads have)."""
    return "easy" if hardness < -0.5 else "hard" if hardness > 0.5 else "medium"


@WORKLOADS.register("sim")
class SimWorkload:
    Params = SimParams

    def __init__(self, **params: Any):
        self.p = SimParams(**params)

    def tasks(self, split: str) -> list[dict[str, Any]]:
        n = self.p.num_train if split == "train" else self.p.num_test
        rng = np.random.default_rng([self.p.seed, 0 if split == "train" else 1])
        difficulty = rng.standard_normal(n)
        half = self.p.prompt_tokens // 2
        lengths = rng.integers(max(self.p.prompt_tokens - half, 1), self.p.prompt_tokens + half + 1, size=n)
        return [{"id": f"{split}-{i}", "hardness": float(difficulty[i]), "length": int(lengths[i]),
                 "difficulty": _bucket(float(difficulty[i]))} for i in range(n)]

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        head = f"task {payload['id']}:"  # cut with the rest: a prompt is exactly its length, a short one too
        return (head + " x" * int(payload["length"]))[: max(int(payload["length"]), 1)]

    def skill(self, version: int) -> float:
        return min(self.p.base_skill + self.p.skill_per_version * max(version, 0), self.p.max_skill)

    def success_probability(self, payload: Mapping[str, Any], version: int) -> float:
        return 1.0 / (1.0 + math.exp(-(self.skill(version) - float(payload["hardness"]))))

    def reward_at(self, completion: str, payload: Mapping[str, Any], version: int) -> float:
        """1.0 with probability ``success_probability(payload, version)``, drawn from a hash of
        the seed, the prompt and the completion; else 0.0."""
        key = f"{self.p.seed}\0{payload['id']}\0{completion}".encode()
        u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0 ** 64
        return 1.0 if u < self.success_probability(payload, version) else 0.0

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        return self.reward_at(completion, payload, 0)

    def source_weights(self) -> dict[str, float]:
        return {"": 1.0}
