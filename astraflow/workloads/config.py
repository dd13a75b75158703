"""Config of what a run rolls out: the workload, its groups, sampling and evaluation."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from astraflow.configbase import Strict
from astraflow.workloads.base import check_params, workload_class


class SamplingConfig(Strict):
    temperature: float = Field(default=1.0, ge=1e-3)
    """Sampling temperature of training rollouts (below 0.001 the scaled logits overflow; greedy
    decoding is the evaluation's). The log-probs the engine records and the trainer computes are
    the model's own (temperature 1, every token), so away from 1 the loss's importance ratio does
    not see how the tokens were drawn (an on-policy ratio is still 1)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold (below 1: the same caveat as ``temperature``)."""
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
    """Workload parameters, checked against the workload's params model (math:
    ``astraflow.workloads.math.MathConfig``: ``digits``, ``ops``, ``num_train``, ``num_test``,
    ...; mix: ``astraflow.workloads.mix.MixParams``: ``sources: {name: {workload, weight,
    params}}``, mixed by weight). Kept as written, so the resolved config reads like the file."""
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seed of the generated dataset: which problems there are and which are held out (another
    seed evaluates on other problems), and of its order (0 to 2**32 - 1)."""
    group_size: int = Field(default=8, ge=1)
    """Samples per prompt (a GRPO group)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling of training rollouts."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation through the same RaaS path."""

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        workload_class(name)  # an unknown name raises, listing the known ones
        return name

    @field_validator("params")
    @classmethod
    def _params_fit(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in info.data:  # else the name failed: that is the error to fix first
            check_params(info.data["name"], params)  # errors name the field: workload.params.<field>
        return params
