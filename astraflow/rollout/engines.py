"""Engine factory keyed by ``rollout.engine.type``."""

from __future__ import annotations

from astraflow.config import EngineConfig
from astraflow.rollout.engine import InferenceEngine

KNOWN = ("hf",)


def make_engine(cfg: EngineConfig, model_path: str, seed: int = 0) -> InferenceEngine:
    if cfg.type == "hf":
        from astraflow.rollout.hf_engine import HFEngine

        return HFEngine(model_path, max_batch=cfg.max_batch, threads=cfg.threads, seed=seed)
    raise ValueError(f"unknown engine type {cfg.type!r}; known: {', '.join(KNOWN)}")
