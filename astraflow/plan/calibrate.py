"""Calibration: this machine's real engine and trainer on the config's model, measured for a few
seconds, as the hardware profile and step time of a ``local`` pool.

The engine is the run's own (``make_engine`` with ``rollout.engine``) on the workload's own
prompts, asked for as a run asks (GRPO groups of ``group_size`` samples of a task) with the
run's sampling; the trainer the run's backend stepping on a batch of ``dataflow.batch_size`` of
the sequences the engine generated, scored by the workload's reward with their groups'
statistics, and publishing each version as the trainer does. With real rewards the step does
the run's work: a group whose samples all scored alike has advantage 0, and a backend that
skips those sequences (``skip_zero_advantage``) skips them here too.

Alone, the engine gives one request's decode rate, a full batch's (``engine.max_batch``
requests) time to its first tokens (``ttft_s``, prefill included) and the rest of its time
(the peak decode rate). A local pool is this machine, where engine and trainer share the cores,
so the trainer's steps are then timed as a run that keeps up has them: the trainer in a process
of its own (``trainer_probe``), as a run places it, each step beside the engine
here generating one trainer batch after loading the newest version the trainer published, as
a node's weight watcher does. Those batches' times over the full batch's time alone is the
contention both see; ``ttft_s`` and the peak rate are scaled by it. Each version is published
as the trainer publishes it (see ``trainer_probe``). The single-request
rate is at least ``peak / max_batch``: responses of a few tokens time it too coarsely to trust
a lower value, and the engine reaches its peak at a full batch either way.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from astraflow.agents.chat import prompt_ids
from astraflow.config import RunConfig
from astraflow.batches import BatchItem, group_stats
from astraflow.plan.planner import Calibration
from astraflow.plan.pools import PlanError
from astraflow.plan.trainer_probe import TrainerProbe, trainer_steps
from astraflow.rollout.engine import Generation, SamplingParams
from astraflow.rollout.engines import make_engine
from astraflow.rollout.sim_config import HardwareProfile
from astraflow.rollout.weight_sync import WeightPuller
from astraflow.rollout.workflows import turn_sequence
from astraflow.sandbox import configure
from astraflow.workloads.base import make_workload

#: timed repetitions of each measurement (after one untimed warm-up)
REPEATS = 5


def calibrate(cfg: RunConfig, progress: Callable[[str], None] = lambda s: None, repeats: int = REPEATS) -> Calibration:
    """The local pool's `Calibration` (``repeats`` timed repetitions of each measurement)."""
    pol = cfg.policies[0]
    model = str(pol.model)
    if not (Path(model) / "config.json").exists():
        raise PlanError(f"--calibrate: no model at {model}; build it first (`astraflow run` builds a config's "
                         "model on first use, or `astraflow model init`)")
    if cfg.rollout.engine.type == "vllm":
        from astraflow.rollout.vllm_setup import require_vllm

        try:
            require_vllm()
        except ValueError as err:
            raise PlanError(f"--calibrate: {err}") from None
    workload = make_workload(cfg.workload.name, cfg.workload.params, cfg.workload.seed)
    tasks = workload.tasks("train")
    s = cfg.workload.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
    batch = min(cfg.rollout.engine.max_batch, cfg.rollout.node_capacity(0))
    engine = make_engine(cfg.rollout.engine, model, seed=cfg.run.seed)
    try:
        # the groups of a whole trainer batch (an engine batch may hold fewer): the engine is
        # timed on the first engine batch of them, the trainer steps on all
        payloads = _group_payloads(tasks, max(batch, cfg.dataflow.batch_size), cfg.workload.group_size, cfg.run.seed)
        all_prompts = [prompt_ids(engine.tokenizer, workload, x) for x in payloads]
        prompts = all_prompts[:batch]
        progress("engine alone: one request, then full batches")
        alone = asyncio.run(_alone(engine, prompts, params, repeats))
        gens = alone.gens + asyncio.run(_generate(engine, all_prompts[batch:], params, batch))
        configure(cfg.sandbox)  # a reward that runs code does so under the run's sandbox limits
        rewards = [_reward(workload, engine.tokenizer.decode(g.tokens, skip_special_tokens=True), x)
                   for g, x in zip(gens, payloads)]
        items = _batch_items(all_prompts, gens, rewards, cfg.dataflow.batch_size, cfg.workload.group_size)
        alike = sum(1 for it in items if it.advantage == 0)
        progress(f"{alike} of {len(items)} sequences in groups that scored alike (not trained, as in a run)")
        progress(f"trainer steps of {cfg.dataflow.batch_size} sequences ({pol.trainer.backend}) in a process of "
                 f"their own, beside engine batches of {batch}")
        with tempfile.TemporaryDirectory(prefix="astraflow-calibrate-") as tmp:
            steps, fulls = _side_by_side(cfg, engine, prompts, params, items, repeats, Path(tmp))
    finally:
        engine.close()
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


async def _generate(engine, prompts, params, batch: int) -> list[Generation]:
    """``prompts`` generated ``batch`` at a time (untimed: the trainer batch's other groups)."""
    out: list[Generation] = []
    for i in range(0, len(prompts), batch):
        out += (await _timed(engine, prompts[i:i + batch], params))[1]
    return out


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


def _reward(workload, completion: str, payload) -> float:
    """The workload's reward of one sample; 0 for a program the code sandbox failed to run
    (``SandboxFailed``): a run fails that episode and rolls it out again, while the calibration
    only needs which groups scored alike, not to end with a traceback after its generations."""
    from astraflow.workloads.code import SandboxFailed

    try:
        return float(workload.reward(completion, payload))
    except SandboxFailed:
        return 0.0


def _group_payloads(tasks: list, batch: int, group_size: int, seed: int) -> list:
    """``batch`` payloads as a run asks for them: GRPO groups of ``group_size`` samples of one
    task each, the tasks drawn from the train split (by ``seed``)."""
    groups = math.ceil(batch / group_size)
    picked = np.random.default_rng(seed).choice(len(tasks), size=groups, replace=len(tasks) < groups)
    return [tasks[int(picked[i // group_size])] for i in range(batch)]


def _batch_items(prompts, gens, rewards, n: int, group_size: int) -> tuple[BatchItem, ...]:
    """A trainer batch of ``n`` sequences from the generated groups with their own rewards and
    group statistics, so the step trains (or skips, advantage 0) what a run's step would."""
    seqs = [turn_sequence(p, g, 0, r) for p, g, r in zip(prompts, gens, rewards)]
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    stats = [(*group_stats(x), len(x)) for x in groups]
    out = []
    for k in range(n):
        i = k % len(seqs)
        mean, std, size = stats[i // group_size]
        out.append(BatchItem(sequence=seqs[i], loss_mask=seqs[i].loss_mask, group_mean=mean, group_std=std,
                             group_size=size, staleness=0, task_id=f"c{k // group_size}/{k % group_size}"))
    return tuple(out)


def _side_by_side(cfg, engine, prompts, params, items, repeats, weights_root: Path):
    """Trainer steps (``repeats`` timed after a warm-up) in a process of their own, the engine
    here generating one trainer batch (``batch_size`` sequences, in full batches) beside each
    after loading the newest version the trainer published, as a run's node does: the step
    times and the full batches' times."""
    pol = cfg.policies[0]
    n = len(items)
    probe = TrainerProbe(trainer=pol.trainer, model=str(pol.model), seed=cfg.run.seed, policy=pol.name,
                         items=items, repeats=repeats, weights_root=str(weights_root))
    puller = WeightPuller(str(weights_root), {pol.name: engine})
    fulls: list[float] = []

    async def beside(step: int) -> None:
        await asyncio.to_thread(puller.poll)  # as a node's weight watcher, in a thread
        for _ in range(math.ceil(n / len(prompts))):
            fulls.append((await _timed(engine, prompts, params))[0])

    steps = asyncio.run(trainer_steps(probe, beside))
    return steps, fulls
