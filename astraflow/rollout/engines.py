"""Engine factory keyed by ``rollout.engine.type`` (the types are ``config.EngineType``)."""

from __future__ import annotations

import logging
import multiprocessing
from typing import get_args

from astraflow.rollout.config import EngineConfig, EngineType
from astraflow.rollout.engine import InferenceEngine

log = logging.getLogger("astraflow.rollout")

#: the engine types this factory builds: one list, the config's
KNOWN: tuple[str, ...] = get_args(EngineType)


def make_engine(cfg: EngineConfig, model_path: str, seed: int = 0) -> InferenceEngine:
    if cfg.type == "hf":
        from astraflow.rollout.hf_engine import HFEngine

        import torch

        torch.set_num_threads(cfg.threads)
        # version 0: the model directory is what the trainer publishes as v0
        if cfg.process:
            if multiprocessing.current_process().daemon:
                log.warning("rollout.engine.process: this worker process is daemonic (a Dask nanny with "
                            "distributed.worker.daemon: true) and cannot start the engine process; the engine "
                            "runs in the worker process instead")
            else:
                from astraflow.rollout.process_engine import ProcessEngine

                return ProcessEngine(model_path, max_batch_size=cfg.max_batch, seed=seed, device=cfg.device,
                                     threads=cfg.threads, version=0, swap_min_remaining=cfg.swap_min_remaining,
                                     dtype=cfg.dtype)
        return HFEngine(model_path, max_batch_size=cfg.max_batch, version=0, seed=seed, device=cfg.device,
                        swap_min_remaining=cfg.swap_min_remaining, dtype=cfg.dtype)
    if cfg.type == "vllm":
        from astraflow.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, options=cfg.vllm, max_batch_size=cfg.max_batch, seed=seed, version=0,
                          tensor_parallel=cfg.tensor_parallel, dtype=cfg.dtype, threads=cfg.threads,
                          swap_min_remaining=cfg.swap_min_remaining)
    raise ValueError(f"unknown engine type {cfg.type!r}; known: {', '.join(KNOWN)}")
