"""Calibration: this machine's real engine and trainer on the config's model, measured for a few
seconds, as the hardware profile and step time of a ``local`` pool.

The engine is the run's own (``make_engine`` with ``rollout.engine``) on the workload's own
prompts with the run's sampling, the trainer the run's backend stepping on a batch of
``dataflow.batch_size`` of the sequences the engine generated (GRPO groups, rewards
alternating) and publishing each version as the trainer does.

Alone, the engine gives one request's decode rate, a full batch's (``engine.max_batch``
requests) time to its first tokens (``ttft_s``, prefill included) and the rest of its time
(the peak decode rate). A local pool is this machine, where engine and trainer share the cores,
so the trainer's steps are then timed as a run that keeps up has them: each step beside the
engine generating one trainer batch. Those batches' times over the full batch's time alone is
the contention both see; ``ttft_s`` and the peak rate are scaled by it. Each version is
published as the trainer publishes it: by a backend that ``supports_snapshot``, in a thread
overlapping the next step (the step timed is its training, snapshot and the wait for the
previous publish: the trainer's critical path), by any other in line. The single-request
rate is at least ``peak / max_batch``: responses of a few tokens time it too coarsely to trust
a lower value, and the engine reaches its peak at a full batch either way.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from astraflow.agents.chat import prompt_ids
from astraflow.config import RunConfig
from astraflow.contracts import Batch, BatchItem
from astraflow.plan.planner import Calibration
from astraflow.plan.pools import PlanError
from astraflow.rollout.engine import Generation, SamplingParams
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
        progress("engine alone: one request, then full batches")
        alone = asyncio.run(_alone(engine, prompts, params, repeats))
        seqs = [turn_sequence(p, g, 0, float(i % 2)) for i, (p, g) in enumerate(zip(prompts, alone.gens))]
        backend = make_backend(pol.trainer, model, cfg.run.seed)
        progress(f"trainer steps of {cfg.dataflow.batch_size} sequences ({pol.trainer.backend}) beside engine "
                 f"batches of {batch}")
        steps, fulls = _side_by_side(cfg, engine, backend, prompts, params, seqs, repeats)
    finally:
        engine.close()
        if backend is not None:
            backend.close()
    step = statistics.median(steps)
    contention = max(statistics.median(fulls) / alone.full_s, 1.0) if fulls else 1.0
    first = alone.first_full_s * contention
    tokens = sum(len(g.tokens) - 1 for g in alone.gens)
    peak = max(tokens / max((alone.full_s - alone.first_full_s) * contention, 1e-6), 1.0)
    single_rate = max((len(alone.single.tokens) - 1) / max(alone.single_s - alone.first_s, 1e-6), peak / batch)
    peak = max(peak, single_rate)
    profile = HardwareProfile(single_tokens_per_s=single_rate, peak_tokens_per_s=peak, ttft_s=first,
                              prefill_tokens_per_s=1e9, max_batch=batch, load_seconds=0.0)
    progress(f"trainer {step:.3f} s a step; engine single {single_rate:.0f} tokens/s, peak {peak:.0f} tokens/s, "
             f"first tokens of a full batch {first * 1000:.0f} ms (contention x{contention:.2f})")
    return Calibration(engine=profile, step_seconds=step, prompt_tokens=round(np.mean([len(p) for p in prompts])),
                       response_mean=float(np.mean([len(g.tokens) for g in alone.gens])))


async def _timed(engine, prompts, params):
    t0 = time.perf_counter()
    out = await asyncio.gather(*(engine.generate(x, params) for x in prompts))
    return time.perf_counter() - t0, out


@dataclass
class _Alone:
    """The engine's timings alone (medians)."""

    single_s: float
    single: Generation
    first_s: float
    full_s: float
    first_full_s: float
    gens: list[Generation]


async def _alone(engine, prompts, params, repeats) -> _Alone:
    one = replace(params, max_new_tokens=1)
    await _timed(engine, prompts, params)  # warm-up
    singles = sorted([await _timed(engine, prompts[:1], params) for _ in range(repeats)], key=lambda x: x[0])
    firsts = [(await _timed(engine, prompts[:1], one))[0] for _ in range(repeats)]
    fulls = sorted([await _timed(engine, prompts, params) for _ in range(repeats)], key=lambda x: x[0])
    first_fulls = [(await _timed(engine, prompts, one))[0] for _ in range(repeats)]
    single_s, single = singles[repeats // 2]
    full_s, gens = fulls[repeats // 2]
    return _Alone(single_s, single[0], statistics.median(firsts), full_s, statistics.median(first_fulls), gens)


def _side_by_side(cfg, engine, backend, prompts, params, seqs, repeats):
    """Trainer steps (``repeats`` timed after a warm-up) in a thread, the engine generating one
    trainer batch (``batch_size`` sequences, in full batches) beside each: the step times and
    the full batches' times."""
    pol = cfg.policies[0]
    n, g = cfg.dataflow.batch_size, cfg.workload.group_size
    chosen = [seqs[i % len(seqs)] for i in range(n)]
    items = tuple(BatchItem(sequence=sq, loss_mask=sq.loss_mask, group_mean=0.5, group_std=0.5, group_size=g,
                            staleness=0, task_id=f"c{i // g}/{i % g}") for i, sq in enumerate(chosen))
    steps: list[float] = []
    failed: list[BaseException] = []
    started = threading.Event()

    def train() -> None:
        try:
            _train()
        except BaseException as err:  # re-raised in the calling thread
            failed.append(err)

    def _train() -> None:
        with tempfile.TemporaryDirectory(prefix="astraflow-calibrate-") as tmp:
            store = WeightStore(Path(tmp))
            publishing: threading.Thread | None = None
            for v in range(repeats + 1):
                started.set()
                t0 = time.perf_counter()
                backend.train_step(Batch(policy=pol.name, version=v, items=items))
                if backend.supports_snapshot:  # as the trainer: the publish overlaps the next step
                    state = backend.snapshot()
                    if publishing is not None:
                        publishing.join()
                    publishing = threading.Thread(target=backend.publish, args=(store, pol.name, v + 1),
                                                  kwargs={"state": state}, name="calibrate-publish")
                    publishing.start()
                else:
                    backend.publish(store, pol.name, v + 1)
                if v:  # the first is a warm-up
                    steps.append(time.perf_counter() - t0)
            if publishing is not None:
                publishing.join()

    async def decode(trainer: threading.Thread) -> list[float]:
        fulls: list[float] = []
        while trainer.is_alive():
            if not await asyncio.to_thread(started.wait, 0.2):
                continue
            started.clear()
            for _ in range(math.ceil(n / len(prompts))):
                fulls.append((await _timed(engine, prompts, params))[0])
        return fulls

    trainer = threading.Thread(target=train, name="calibrate-trainer")
    trainer.start()
    try:
        fulls = asyncio.run(decode(trainer))
    finally:
        trainer.join()
    if failed:
        raise failed[0]
    return steps, fulls
