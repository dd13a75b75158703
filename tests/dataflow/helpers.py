"""A scripted RaaS node for data-layer tests: real trajectories into a real store."""

from __future__ import annotations

import numpy as np

from astraflow.contracts import NOT_GENERATED, Provenance, RolloutTask, Sequence, Trajectory, TrajectoryRef


def make_trajectory(task: RolloutTask, reward: float, version: int = 0, node: str = "n0",
                    policy_index: int = 0, n_prompt: int = 3, n_gen: int = 4) -> Trajectory:
    seq = Sequence.build(
        tokens=np.arange(n_prompt + n_gen),
        loss_mask=[0] * n_prompt + [1] * n_gen,
        logprobs=[0.0] * n_prompt + [-0.5] * n_gen,
        policy_ids=[NOT_GENERATED] * n_prompt + [policy_index] * n_gen,
        versions=[NOT_GENERATED] * n_prompt + [version] * n_gen,
        reward=reward,
    )
    return Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt,
                      (seq,), Provenance(node=node))


def store_and_ref(writer, trajs: list[Trajectory]) -> list[TrajectoryRef]:
    rows = [r for t in trajs for r in t.to_stored()]
    refs = writer.write(rows)
    out, i = [], 0
    for t in trajs:
        out.append(TrajectoryRef.of(t, refs[i : i + len(t.sequences)]))
        i += len(t.sequences)
    return out
