"""The workload boundary.

A *workload* is a dataset plus a verifiable reward (``math``, ``mix``): the prompts of a split,
how a prompt is rendered and how a completion is scored. It is registered by name and chosen in
the config. Workloads are a leaf: they import no engine and no component; the episode logic
that drives engines over a workload's tasks (workflows) lives on the rollout side.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from astraflow.registry import Registry


class Workload(Protocol):
    """A dataset of prompts with a verifiable reward."""

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """The payloads of a split (``"train"`` or ``"eval"``), deterministic by seed."""

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        """The text the policy sees for a payload."""

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        """Verifiable reward of a completion (1.0 correct, 0.0 wrong)."""

    def source_weights(self) -> dict[str, float]:
        """The workload's sources and their mixing weights. A workload made of several sources
        (``mix``) tags each payload with ``"source": <name>`` and the data layer mixes the
        sources by these weights; a single-source workload returns ``{"": 1.0}``."""


WORKLOADS: Registry = Registry("workload")


def make_workload(name: str, params: Mapping[str, Any], seed: int) -> Workload:
    import astraflow.workloads.math  # noqa: F401  (registers the shipped workloads)
    import astraflow.workloads.mix  # noqa: F401

    return WORKLOADS.get(name)(seed=seed, **dict(params))
