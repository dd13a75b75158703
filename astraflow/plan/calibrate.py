"""Calibration: this machine's real engine and trainer on the config's model, measured for a few
seconds, as the hardware profile and step time of a ``local`` pool.

The engine is the run's own (``make_engine`` with ``rollout.engine``) on the workload's own
prompts with the run's sampling: one request alone gives the single-request decode rate; a
full batch (``engine.max_batch`` concurrent requests) gives the time to its first tokens
(``ttft_s``, with the prompts' prefill in it) and, from its remaining tokens, the peak decode
rate. The trainer is the run's backend taking steps on a batch of ``dataflow.batch_size`` of
those generated sequences (GRPO groups, rewards alternating), its weights published after
each as the trainer does; the median step is the step time.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from astraflow.agents.chat import prompt_ids
from astraflow.config import RunConfig
from astraflow.contracts import Batch, BatchItem
from astraflow.plan.planner import Calibration
from astraflow.plan.pools import PlanError
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.engines import make_engine
from astraflow.rollout.sim_config import HardwareProfile
from astraflow.rollout.workflows import turn_sequence
from astraflow.training.trainer import make_backend
from astraflow.workloads.base import make_workload
from storage.weights import WeightStore

#: timed repetitions of each measurement (after one untimed warm-up)
REPEATS = 3


def calibrate(cfg: RunConfig, progress: Callable[[str], None] = lambda s: None) -> Calibration:
    pol = cfg.policies[0]
    model = str(pol.model)
    if not (Path(model) / "config.json").exists():
        raise PlanError(f"--calibrate: no model at {model}; build it first (`astraflow run` builds a config's "
                         "model on first use, or `astraflow model init`)")
    workload = make_workload(cfg.workload.name, cfg.workload.params, cfg.workload.seed)
    tasks = workload.tasks("train")
    s = cfg.workload.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
    batch = min(cfg.rollout.engine.max_batch, cfg.rollout.node_capacity(0))
    engine = make_engine(cfg.rollout.engine, model, seed=cfg.run.seed)
    try:
        prompts = [prompt_ids(engine.tokenizer, workload, tasks[i % len(tasks)]) for i in range(batch)]
        progress(f"engine: one request alone, then {batch} at once")
        single, full, first, gens = asyncio.run(_engine_timings(engine, prompts, params))
    finally:
        engine.close()
    tokens_single = max(len(single[1].tokens) - 1, 1)
    single_rate = tokens_single / max(single[0] - first[0], 1e-6)
    full_tokens = sum(len(g.tokens) for g in gens) - len(gens)
    peak = max(full_tokens / max(full - first[1], 1e-6), single_rate)
    profile = HardwareProfile(single_tokens_per_s=single_rate, peak_tokens_per_s=peak, ttft_s=first[1],
                              prefill_tokens_per_s=1e9, max_batch=batch, load_seconds=0.0)
    progress(f"engine: single {single_rate:.0f} tokens/s, peak {peak:.0f} tokens/s, first token of a full "
             f"batch {first[1] * 1000:.0f} ms")
    seqs = [turn_sequence(p, g, 0, float(i % 2)) for i, (p, g) in enumerate(zip(prompts, gens))]
    step = _step_seconds(cfg, model, seqs, progress)
    return Calibration(engine=profile, step_seconds=step, prompt_tokens=round(np.mean([len(p) for p in prompts])),
                       response_mean=float(np.mean([len(g.tokens) for g in gens])))


async def _engine_timings(engine, prompts, params):
    """(time, generation) of one request alone; the time of a full batch; the time to a first
    token alone and in a full batch; the full batch's generations (medians of ``REPEATS``)."""
    one = replace(params, max_new_tokens=1)

    async def timed(ps, p):
        t0 = time.perf_counter()
        out = await asyncio.gather(*(engine.generate(x, p) for x in ps))
        return time.perf_counter() - t0, out

    await timed(prompts, params)  # warm-up
    singles = [await timed(prompts[:1], params) for _ in range(REPEATS)]
    firsts = [(await timed(prompts[:1], one))[0] for _ in range(REPEATS)]
    fulls = [await timed(prompts, params) for _ in range(REPEATS)]
    firsts_full = [(await timed(prompts, one))[0] for _ in range(REPEATS)]
    single = sorted(singles, key=lambda x: x[0])[REPEATS // 2]
    full = sorted(fulls, key=lambda x: x[0])[REPEATS // 2]
    return ((single[0], single[1][0]), full[0], (statistics.median(firsts), statistics.median(firsts_full)),
            full[1])


def _step_seconds(cfg: RunConfig, model: str, seqs, progress) -> float:
    """Median time of a trainer step plus its publish on a batch of ``dataflow.batch_size``."""
    pol = cfg.policies[0]
    n, g = cfg.dataflow.batch_size, cfg.workload.group_size
    chosen = [seqs[i % len(seqs)] for i in range(n)]
    items = tuple(BatchItem(sequence=sq, loss_mask=sq.loss_mask, group_mean=0.5, group_std=0.5, group_size=g,
                            staleness=0, task_id=f"c{i // g}/{i % g}") for i, sq in enumerate(chosen))
    backend = make_backend(pol.trainer, model, cfg.run.seed)
    progress(f"trainer: {REPEATS} steps of {n} sequences ({pol.trainer.backend})")
    times = []
    try:
        with tempfile.TemporaryDirectory(prefix="astraflow-calibrate-") as tmp:
            store = WeightStore(Path(tmp))
            for v in range(REPEATS + 1):
                t0 = time.perf_counter()
                backend.train_step(Batch(policy=pol.name, version=v, items=items))
                backend.publish(store, pol.name, v + 1)
                if v:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
    finally:
        backend.close()
    step = statistics.median(times)
    progress(f"trainer: {step:.3f} s a step")
    return step
