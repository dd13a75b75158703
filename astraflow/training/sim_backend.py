"""``SimBackend`` (``trainer.backend: sim``): a trainer backend without a model.

A step takes ``sim_step_seconds`` (or, from a step of ``sim_step_schedule`` on, that entry's
seconds) plus ``sim_seconds_per_token`` per loss token of the batch
(sleeping, no tensor work) and reports GRPO-shaped metrics computed from the batch itself
(rewards, advantages, staleness), so the run's metrics and progress lines stay meaningful. A
published version is a one-tensor checkpoint (the step count) with ``meta["sim"]``: a real
committed version in the weight store, which the sim engines take by its number and manifest.
It publishes as the ``torch`` backend does (``supports_snapshot``): the trainer commits a version
in a helper thread while the next step sleeps, so a simulated step costs what a real one costs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from astraflow.batches import Batch


class SimBackend:
    """A trainer backend that only takes time (see the module docstring)."""

    supports_snapshot = True
    supports_resume = True
    supports_optimizer_state = False

    def __init__(self, step_seconds: float = 1.0, seconds_per_token: float = 0.0,
                 sleep=time.sleep, schedule: dict[int, float] | None = None) -> None:
        self.step_seconds = step_seconds
        #: ``{from_step: seconds}``: the step time from that step on (steps counted from 0)
        self.schedule = dict(sorted((schedule or {}).items()))
        self.seconds_per_token = seconds_per_token
        self._sleep = sleep
        self.steps = 0

    def train_step(self, batch: Batch) -> dict[str, float]:
        tokens = int(sum(int(item.loss_mask.sum()) for item in batch.items))
        seconds = self.base_seconds(self.steps) + self.seconds_per_token * tokens
        self._sleep(seconds)
        self.steps += 1
        adv = np.array([item.advantage for item in batch.items], dtype=np.float64)
        return {"loss": float(-np.mean(adv)) if len(adv) else 0.0,
                "grad_norm": float(np.abs(adv).mean()) if len(adv) else 0.0,
                "tokens": float(tokens), "trained_tokens": float(tokens), "step_s": seconds,
                "num_sequences": float(len(batch.items)),
                "clip_frac": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0}

    def base_seconds(self, step: int) -> float:
        """The time step ``step`` (from 0) takes before its per-token time."""
        out = self.step_seconds
        for start, seconds in self.schedule.items():
            if step >= start:
                out = seconds
        return out

    def publish(self, store, policy: str, version: int, state: dict | None = None):
        """Commit ``version``: the step count of ``state`` (a ``snapshot()``), else the current one."""
        state = self.state_dict() if state is None else state
        return store.publish(policy, version, state, meta={"sim": True, "train_steps": int(state["sim.steps"][0])})

    def snapshot(self) -> dict:
        return self.state_dict()

    def state_dict(self) -> dict:
        import torch

        return {"sim.steps": torch.tensor([self.steps], dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        steps = state.get("sim.steps")
        self.steps = int(steps[0]) if steps is not None else 0

    def optimizer_state(self) -> dict[str, Any]:
        return {}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
