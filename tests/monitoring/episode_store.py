"""A run directory with a real trajectory store for the episode viewer's tests: agentic episodes
run by the agent loop on scripted model turns (``SumEnv`` of the agent tests) and single-turn
entries without an episode log, written through ``Trajectory.to_stored`` and a ``SegmentWriter``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import yaml

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.episode import AgentLimits, run_agent_episode
from astraflow.agents.tools import format_call
from astraflow.contracts import Provenance, Sequence, Trajectory
from astraflow.rollout.agent import episode_sequence
from storage.paths import RunPaths
from storage.trajectories import open_trajectory_store

from tests.agents.test_episode import SumEnv, scripted

#: model text that would be markup if a page put it into innerHTML
HOSTILE = '<img src=x onerror="window.pwned=1"><b>bold</b>'


def agentic(tok, task_id: str, turns: list[str], task: dict, *, version: int = 3, max_turns: int = 8,
            kind: str = "train") -> Trajectory:
    """One episode of ``SumEnv`` on ``task``, stored as the ``agent`` workflow stores it."""
    log = asyncio.run(run_agent_episode(scripted(tok, turns, version), ChatRenderer(tok), SumEnv(shaped=0.25),
                                        task, AgentLimits(max_turns=max_turns)))
    return Trajectory(task_id=task_id, group_id=f"g-{task_id}", policies=("solver",), workflow="agent", kind=kind,
                      attempt=0, sequences=(episode_sequence(log),),
                      provenance=Provenance(node="rollout-0", started_at=time.time()),
                      score=log.success, stats=log.stats(),
                      episode={"task": dict(task), "turns": log.turns, "truncated": log.truncated,
                               "final_reward": log.final_reward})


def single_turn(task_id: str, reward: float, policy: str = "solver", kind: str = "train") -> Trajectory:
    seq = Sequence.build(tokens=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.1, -0.2],
                         policy_ids=[-1, -1, 0, 0], versions=[-1, -1, 2, 2], reward=reward)
    return Trajectory(task_id=task_id, group_id=f"g-{task_id}", policies=(policy,), workflow="single_turn",
                      kind=kind, attempt=0, sequences=(seq,), provenance=Provenance(node="rollout-1"))


def write_run(run_dir: Path, tok, *, old_batches: int = 6) -> Path:
    """A run directory whose config names workload ``sums`` and whose store holds, oldest first:
    ``old_batches`` single-turn batches (segment ``rollout-1``, rewards 0.0, 0.1, ...), then on
    segment ``rollout-0`` a tool-using solved episode (source ``arith``), an unsolved one with a
    hostile model turn, and a truncated one (``max_turns``)."""
    paths = RunPaths(run_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(yaml.safe_dump({"workload": {"name": "sums"}, "policies": [{"name": "solver"}],
                                            "storage": {"trajectories": None}}))
    store = open_trajectory_store(str(paths.trajectories), "a", durable=False)
    with store.writer("rollout-1") as w:
        for b in range(old_batches):
            w.write([row for i in range(2) for row in single_turn(f"st-{b}-{i}", reward=b / 10).to_stored()])
            time.sleep(0.002)  # distinct publication times
    solved = agentic(tok, "ag-solved", [format_call("add", {"a": 2, "b": 3}), "5"],
                     {"a": 2, "b": 3, "source": "arith", "difficulty": 1})
    hostile = agentic(tok, "ag-hostile", ["hmm", HOSTILE], {"a": 1, "b": 1, "difficulty": 2})
    truncated = agentic(tok, "ag-truncated", ["hmm", "hmm"], {"a": 4, "b": 4}, max_turns=2, version=4)
    with store.writer("rollout-0") as w:
        for traj in (solved, hostile, truncated):
            w.write(traj.to_stored())
            time.sleep(0.002)
    return run_dir
