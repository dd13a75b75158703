"""Engine factory keyed by ``rollout.engine.type`` (the types are ``config.EngineType``)."""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path
from typing import Mapping, get_args

from astraflow.rollout.config import EngineConfig, EngineType
from astraflow.rollout.engine import InferenceEngine
from astraflow.rollout.engine_pool import EnginePool, ReplicaPlan, plan_replicas
from astraflow.rollout.host_memory import available_bytes

log = logging.getLogger("astraflow.rollout")

#: the engine types this factory builds: one list, the config's
KNOWN: tuple[str, ...] = get_args(EngineType)
#: the share of the host memory available that engine processes loading side by side may take
LOAD_MEMORY_SHARE = 0.8


def make_engine(cfg: EngineConfig, model_path: str, seed: int = 0, gpus: int = 0) -> InferenceEngine:
    """The engine of one policy on a node whose partition gives it ``gpus`` GPUs: one engine,
    or an ``EnginePool`` of ``plan_replicas``' engines (one per GPU by default)."""
    return make_engines(cfg, {"policy": model_path}, seed=seed, gpus=gpus)["policy"]


def make_engines(cfg: EngineConfig, models: Mapping[str, str], seed: int = 0,
                 gpus: int = 0) -> dict[str, InferenceEngine]:
    """The engine of every policy of a node (``models``: policy -> model directory), each as
    ``make_engine`` builds it. Engines in processes of their own load side by side, as many at
    once as the host memory holds (``load_slots``): a node of eight GPUs loads its eight
    replicas together, not one after the other. A failure stops every engine started."""
    if cfg.type not in KNOWN:
        raise ValueError(f"unknown engine type {cfg.type!r}; known: {', '.join(KNOWN)}")
    if cfg.type == "sim":  # no model, no torch: one simulated engine per replica
        return {policy: _make_sim(cfg, seed, gpus) for policy in models}
    import torch

    cuda_seen = torch.cuda.device_count() if gpus and cfg.device in ("auto", "cuda") else 0
    plans = plan_replicas(cfg, gpus, cuda_seen, os.environ.get("CUDA_VISIBLE_DEVICES"), seed=seed)
    torch.set_num_threads(cfg.threads)  # this process's own (an engine here; replicas in processes split it)
    started: dict[str, list[InferenceEngine]] = {}
    total = len(models) * len(plans)
    # engines built in this process (in-process hf, vLLM) load in their constructors, one by one
    slots = load_slots(list(models.values()), total) if cfg.type == "hf" and cfg.process else total
    # an engine loading beside others shares the disk and the CPU with them: its start may take
    # as many times longer (the node waits no longer than for the same loads one after another)
    patience = min(slots, total)
    loading: list[InferenceEngine] = []  # processes started, not yet waited for
    shares = gpu_sharers(plans, len(models))
    try:
        for k, (policy, path) in enumerate(models.items()):
            started[policy] = []
            for plan in plans:
                if len(loading) >= slots:
                    loading.pop(0).wait_started(patience)
                # a policy's engines take the CPUs after the previous policies' (vLLM's CPU build binds them)
                engine = _make_one(cfg, path, plan, order=k * len(plans) + plan.index, sharers=shares[plan.index])
                started[policy].append(engine)
                if hasattr(engine, "wait_started"):  # a process loading its model
                    loading.append(engine)
        while loading:
            loading.pop(0).wait_started(patience)
    except BaseException:  # an engine that fails to start: stop the ones already started
        for engines in started.values():
            for engine in engines:
                engine.close()
        raise
    if len(plans) > 1:
        for path in dict.fromkeys(models.values()):
            log.info("%d engine replicas of %s: %s", len(plans), path,
                     ", ".join(p.visible_devices or p.device for p in plans))
    return {policy: engines[0] if len(engines) == 1 else EnginePool(engines) for policy, engines in started.items()}


def gpu_sharers(plans: list[ReplicaPlan], policies: int) -> list[int]:
    """Per replica plan, how many of the node's engines (``policies`` of them per plan) share
    its most crowded GPU: each policy's replicas take the same GPUs, more replicas than GPUs
    wrap around, an explicit ``cuda:N`` or none planned (every engine on the worker's default
    device) puts every engine on one GPU (on a CPU build the share is not used)."""
    def where(plan: ReplicaPlan) -> tuple:  # no GPUs of its own: the device the worker gives it
        return plan.gpus or (plan.device if plan.device.startswith("cuda:") else "default",)

    on: dict[object, int] = {}
    for plan in plans:
        for g in where(plan):
            on[g] = on.get(g, 0) + policies
    return [max(on[g] for g in where(plan)) for plan in plans]


def load_slots(model_paths: list[str], engines: int) -> int:
    """How many of a node's ``engines`` may load their models at once: an engine process builds
    its model in fp32 in host memory before moving it to its device (about twice its weight
    files' bytes for bf16 files); as many as fit in ``LOAD_MEMORY_SHARE`` of the host memory
    this process may still take (``host_memory``), at least one."""
    need = 2 * max((weight_bytes(p) for p in model_paths), default=0)
    if need <= 0:
        return max(engines, 1)
    return max(1, min(engines, int(available_bytes() * LOAD_MEMORY_SHARE) // need))


def weight_bytes(model_path: str) -> int:
    """The bytes of a model directory's weight files (its safetensors, else its PyTorch ones)."""
    p = Path(model_path)
    for pattern in ("*.safetensors", "*.bin"):
        files = [f for f in p.glob(pattern) if f.is_file()]
        if files:
            return sum(f.stat().st_size for f in files)
    return 0


def _make_sim(cfg: EngineConfig, seed: int, gpus: int) -> InferenceEngine:
    """``rollout.engine.replicas`` sim engines (default: one per GPU of the worker, or one),
    each seeded differently; version 0 as with a model directory."""
    from astraflow.rollout.sim_engine import SimEngine

    count = cfg.sim_engines(gpus)
    engines: list[InferenceEngine] = [SimEngine(cfg.sim, seed=seed * 1009 + i, version=0) for i in range(count)]
    return engines[0] if count == 1 else EnginePool(engines)


def _make_one(cfg: EngineConfig, model_path: str, plan: ReplicaPlan, order: int = 0,
              sharers: int = 1) -> InferenceEngine:
    """One engine of ``plan``: the node's ``order``-th (its first CPU, where engines bind CPUs);
    ``sharers`` engines on its GPU split ``gpu_memory_utilization``."""
    # version 0: the model directory is what the trainer publishes as v0
    if cfg.type == "hf":
        from astraflow.rollout.hf_engine import HFEngine

        if cfg.process:
            if multiprocessing.current_process().daemon:
                log.warning("rollout.engine.process: this worker process is daemonic (a Dask nanny with "
                            "distributed.worker.daemon: true) and cannot start the engine process; the engine "
                            "runs in the worker process instead")
            else:
                from astraflow.rollout.process_engine import ProcessEngine

                return ProcessEngine(model_path, max_batch_size=cfg.max_batch, seed=plan.seed, device=plan.device,
                                     threads=plan.threads, version=0, swap_min_remaining=cfg.swap_min_remaining,
                                     dtype=cfg.dtype, visible_devices=plan.visible_devices, wait=False)
        return HFEngine(model_path, max_batch_size=cfg.max_batch, version=0, seed=plan.seed, device=plan.device_in_node,
                        swap_min_remaining=cfg.swap_min_remaining, dtype=cfg.dtype)
    if cfg.type == "vllm":
        from astraflow.rollout.vllm_engine import VLLMEngine

        visible = vllm_visible_devices(plan, os.environ.get("CUDA_VISIBLE_DEVICES"))
        options = cfg.vllm
        if sharers > 1:  # each asks vLLM for its part: the first would otherwise leave the others too little
            options = options.model_copy(update={"gpu_memory_utilization": options.gpu_memory_utilization / sharers})
            log.info("%d vLLM engines share GPU(s) %s: each takes %.3f of its memory (of %.2f)", sharers,
                     visible or plan.device, options.gpu_memory_utilization, cfg.vllm.gpu_memory_utilization)
        return VLLMEngine(model_path, options=options, max_batch_size=cfg.max_batch, seed=plan.seed, version=0,
                          tensor_parallel=cfg.tensor_parallel, dtype=cfg.dtype, threads=plan.threads,
                          swap_min_remaining=cfg.swap_min_remaining, visible_devices=visible,
                          first_cpu=order * plan.threads * cfg.tensor_parallel)
    raise ValueError(f"unknown engine type {cfg.type!r}; known: {', '.join(KNOWN)}")


def vllm_visible_devices(plan: ReplicaPlan, node_visible: str | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of a vLLM engine, which takes its GPUs from the environment, not
    from a device name: its replica's GPUs; for an explicit ``cuda:N`` the node's GPU N (as the
    node's ``CUDA_VISIBLE_DEVICES``, ``node_visible``, names it); None: all the node sees."""
    if plan.visible_devices is not None or not plan.device.startswith("cuda:"):
        return plan.visible_devices
    index = int(plan.device.partition(":")[2])
    ids = [d.strip() for d in node_visible.split(",") if d.strip()] if node_visible else []
    if not ids:
        return str(index)
    if index >= len(ids):
        raise ValueError(f"rollout.engine.device {plan.device}: this node sees {len(ids)} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={node_visible}); name one of cuda:0..cuda:{len(ids) - 1} or use auto")
    return ids[index]
