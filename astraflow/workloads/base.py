"""The workload and workflow boundaries.

A *workload* is a dataset plus a verifiable reward (``math``); a *workflow* is the episode
logic that drives one or more policies' engines over a task (``single_turn``,
``solver_verifier``, ...). Both are registered by name and chosen in the config; a new one is
a new class and nothing else changes: RaaS nodes only call ``run_episode``.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from astraflow.contracts import RolloutTask, Trajectory
from astraflow.registry import Registry
from astraflow.rollout.engine import InferenceEngine, SamplingParams


class Workload(Protocol):
    """A dataset of prompts with a verifiable reward."""

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """The payloads of a split (``"train"`` or ``"eval"``), deterministic by seed."""

    def render_prompt(self, payload: Mapping[str, Any]) -> str:
        """The text the policy sees for a payload."""

    def reward(self, completion: str, payload: Mapping[str, Any]) -> float:
        """Verifiable reward of a completion (1.0 correct, 0.0 wrong)."""

    # Optional: ``source_weights() -> dict[str, float]`` for a workload made of several
    # sources (``mix``); its payloads then carry ``"source": <name>`` and the data layer
    # mixes the sources by these weights. Without it a workload is one source of weight 1.


class Workflow(Protocol):
    """Episode logic. ``engines`` maps every policy of the task to its engine."""

    async def run_episode(
        self, engines: Mapping[str, InferenceEngine], task: RolloutTask
    ) -> Trajectory: ...


WORKLOADS: Registry = Registry("workload")
WORKFLOWS: Registry = Registry("workflow")


def make_workload(name: str, params: Mapping[str, Any], seed: int) -> Workload:
    import astraflow.workloads.math  # noqa: F401  (registers the shipped workloads)
    import astraflow.workloads.mix  # noqa: F401

    return WORKLOADS.get(name)(seed=seed, **dict(params))


def workflow_class(name: str):
    """The workflow class registered as ``name``. ``"package.module:name"`` imports a user
    module first (which registers its workflows), so a new workflow needs no change here."""
    import importlib

    import astraflow.workloads.workflows  # noqa: F401  (registers the shipped workflows)

    if ":" in name:
        module, name = name.split(":", 1)
        importlib.import_module(module)
    return WORKFLOWS.get(name)


def make_workflow(name: str, workload: Workload, sampling: SamplingParams, node: str) -> Workflow:
    return workflow_class(name)(workload=workload, sampling=sampling, node=node)
