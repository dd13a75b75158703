"""``SimBackend`` (``trainer.backend: sim``): a trainer backend without a model.

A step takes ``sim_step_seconds`` (or, from a step of ``sim_step_schedule`` on, that entry's
seconds) plus ``sim_seconds_per_token`` per loss token of the batch
(sleeping, no tensor work) and reports GRPO-shaped metrics computed from the batch itself
(rewards, advantages, staleness), so the run's metrics and progress lines stay meaningful. A
published version is a one-tensor checkpoint (the step count) with ``meta["sim"]``: a real
committed version in the weight store, which the sim engines take by its number and manifest.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from astraflow.contracts import Batch


class SimBackend:
    """A trainer backend that only takes time (see the module docstring)."""

    supports_snapshot = False
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
        return {"loss": float(-np.mean(adv)) if len(adv) else 0.0, "grad_norm": float(np.abs(adv).mean()) if len(adv) else 0.0,
                "tokens": float(tokens), "trained_tokens": float(tokens), "step_s": seconds,
                "clip_frac": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0}

    def base_seconds(self, step: int) -> float:
        """The time step ``step`` (from 0) takes before its per-token time."""
        out = self.step_seconds
        for start, seconds in self.schedule.items():
            if step >= start:
                out = seconds
        return out

    def publish(self, store, policy: str, version: int, state: dict | None = None):
        import torch

        return store.publish(policy, version, {"sim.steps": torch.tensor([self.steps], dtype=torch.int64)},
                             meta={"sim": True, "train_steps": self.steps})

    def snapshot(self) -> dict:
        raise NotImplementedError("the sim backend publishes from its step count (supports_snapshot is False)")

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
