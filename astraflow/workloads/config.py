"""Config of what a run rolls out: the workload, its groups, sampling and evaluation."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from astraflow.configbase import Strict


class SamplingConfig(Strict):
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of training rollouts."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Token budget of one generation."""


class EvalConfig(Strict):
    every: int = Field(default=10, ge=0)
    """Evaluate held-out accuracy every N trainer steps of the first policy (0: never), and
    before training."""
    num_prompts: int = Field(default=100, ge=1)
    """Held-out prompts per evaluation."""
    k: int = Field(default=1, ge=1)
    """Samples per prompt: avg@k and pass@k are reported; k=1 decodes greedily."""


class WorkloadConfig(Strict):
    """What the RaaS nodes roll out (owned by ``astraflow.workloads``)."""

    name: str = "math"
    """Registered workload (dataset + reward)."""
    workflow: str = "single_turn"
    """Registered workflow driving the episode (``astraflow.rollout.workflows``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Workload parameters (for math: ``digits``, ``ops``, ``num_train``, ``num_eval``; for
    ``mix``: ``sources: {name: {workload, weight, params}}``, mixed by weight)."""
    seed: int = 0
    """Seed of the generated dataset and of prompt order."""
    group_size: int = Field(default=8, ge=1)
    """Samples per prompt (a GRPO group)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling of training rollouts."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation through the same RaaS path."""
