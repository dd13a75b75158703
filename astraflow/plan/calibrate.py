"""Calibration: this machine's real engine and trainer on the config's model, measured for a few
seconds, as the hardware profile and step time of a ``local`` pool.

The engine is the run's own (``make_engine`` with ``rollout.engine``) on the workload's own
prompts with the run's sampling, the trainer the run's backend stepping on a batch of
``dataflow.batch_size`` of the sequences the engine generated (GRPO groups, rewards
alternating) and publishing each version as the trainer does. A local pool is this machine,
where engine and trainer share the cores, so they are measured side by side, as they run:
while the trainer steps, the engine decodes full batches (``engine.max_batch`` requests at
once) and batches of first tokens. From that: the step time (median), ``ttft_s`` (a full
batch's time to its first tokens, prefill included) and the peak decode rate (a full batch's
remaining tokens over the rest of its time). One request alone (before) gives the
single-request rate, at least ``peak / max_batch``: responses of a few tokens time it too
coarsely to trust a lower value, and the engine reaches its peak at a full batch either way.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import threading
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
REPEATS = 5


def calibrate(cfg: RunConfig, progress: Callable[[str], None] = lambda s: None, repeats: int = REPEATS) -> Calibration:
    """The local pool's `Calibration` (``repeats`` timed repetitions of each measurement)."""
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
    backend = None
    try:
        prompts = [prompt_ids(engine.tokenizer, workload, tasks[i % len(tasks)]) for i in range(batch)]
        progress("engine: one request alone")
        single, first_alone, gens = asyncio.run(_alone(engine, prompts, params, repeats))
        seqs = [turn_sequence(p, g, 0, float(i % 2)) for i, (p, g) in enumerate(zip(prompts, gens))]
        backend = make_backend(pol.trainer, model, cfg.run.seed)
        progress(f"trainer steps of {cfg.dataflow.batch_size} sequences ({pol.trainer.backend}) beside engine "
                 f"batches of {batch}")
        steps, fulls, firsts = _side_by_side(cfg, engine, backend, prompts, params, seqs, repeats)
    finally:
        engine.close()
        if backend is not None:
            backend.close()
    step = statistics.median(steps)
    full_time, gen = sorted(fulls, key=lambda x: x[0])[len(fulls) // 2]
    first = statistics.median(firsts)
    peak = max(sum(len(g.tokens) - 1 for g in gen) / max(full_time - first, 1e-6), 1.0)
    single_rate = max((len(single[1].tokens) - 1) / max(single[0] - first_alone, 1e-6), peak / batch)
    peak = max(peak, single_rate)
    profile = HardwareProfile(single_tokens_per_s=single_rate, peak_tokens_per_s=peak, ttft_s=first,
                              prefill_tokens_per_s=1e9, max_batch=batch, load_seconds=0.0)
    progress(f"trainer {step:.3f} s a step; engine single {single_rate:.0f} tokens/s, peak {peak:.0f} tokens/s, "
             f"first tokens of a full batch {first * 1000:.0f} ms")
    return Calibration(engine=profile, step_seconds=step, prompt_tokens=round(np.mean([len(p) for p in prompts])),
                       response_mean=float(np.mean([len(g.tokens) for g in gen])))


async def _timed(engine, prompts, params):
    t0 = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(x, params) for x in prompts))
    return time.perf_counter() - t0, out


async def _alone(engine, prompts, params, repeats):
    """(time, generation) of one request alone (median), its time to a first token, and a full
    batch's generations (after an untimed warm-up batch)."""
    await _timed(engine, prompts, params)  # warm-up
    singles = [await _timed(engine, prompts[:1], params) for _ in range(repeats)]
    firsts = [(await _timed(engine, prompts[:1], replace(params, max_new_tokens=1)))[0] for _ in range(repeats)]
    t, out = sorted(singles, key=lambda x: x[0])[repeats // 2]
    _, full = await _timed(engine, prompts, params)
    return (t, out[0]), statistics.median(firsts), full


def _side_by_side(cfg, engine, backend, prompts, params, seqs, repeats):
    """Trainer steps (``repeats`` timed after a warm-up) in a thread while the engine decodes
    full batches and first-token batches in turn: step times, (time, generations) of the full
    batches, first-token times."""
    pol = cfg.policies[0]
    n, g = cfg.dataflow.batch_size, cfg.workload.group_size
    chosen = [seqs[i % len(seqs)] for i in range(n)]
    items = tuple(BatchItem(sequence=sq, loss_mask=sq.loss_mask, group_mean=0.5, group_std=0.5, group_size=g,
                            staleness=0, task_id=f"c{i // g}/{i % g}") for i, sq in enumerate(chosen))
    steps: list[float] = []
    failed: list[BaseException] = []

    def train() -> None:
        try:
            _train()
        except BaseException as err:  # re-raised in the calling thread
            failed.append(err)

    def _train() -> None:
        with tempfile.TemporaryDirectory(prefix="astraflow-calibrate-") as tmp:
            store = WeightStore(Path(tmp))
            for v in range(repeats + 1):
                t0 = time.perf_counter()
                backend.train_step(Batch(policy=pol.name, version=v, items=items))
                backend.publish(store, pol.name, v + 1)
                if v:  # the first is a warm-up
                    steps.append(time.perf_counter() - t0)

    async def decode(trainer: threading.Thread):
        fulls, firsts = [], []
        while trainer.is_alive() or len(fulls) < 1:
            fulls.append(await _timed(engine, prompts, params))
            firsts.append((await _timed(engine, prompts, replace(params, max_new_tokens=1)))[0])
        return fulls, firsts

    trainer = threading.Thread(target=train, name="calibrate-trainer")
    trainer.start()
    try:
        fulls, firsts = asyncio.run(decode(trainer))
    finally:
        trainer.join()
    if failed:
        raise failed[0]
    return steps, fulls, firsts
