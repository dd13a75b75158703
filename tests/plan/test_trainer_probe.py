"""The calibration's trainer in a child process (``astraflow.plan.trainer_probe``): a real torch
trainer on a tiny model takes its steps there, publishes each version as the trainer does and
tells the parent before each step; a child that fails or dies is a `PlanError` that says so."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import numpy as np
import pytest

from astraflow.batches import BatchItem
from astraflow.contracts import Sequence
from astraflow.plan.pools import PlanError
from astraflow.plan.trainer_probe import TrainerProbe, trainer_steps
from astraflow.training.config import TrainerConfig
from storage.weights import WeightStore


def _items(tokenizer, rewards=(1.0, 0.0, 0.0, 1.0)) -> tuple[BatchItem, ...]:
    """One GRPO group: four answers to one prompt with their rewards and the group's statistics."""
    prompt = tokenizer("12+34=")["input_ids"]
    seqs = []
    for answer, r in zip(("46", "47", "5", "46"), rewards):
        tokens = np.array(prompt + tokenizer(answer)["input_ids"])
        gen = np.arange(len(tokens)) >= len(prompt)
        seqs.append(Sequence.build(tokens, gen, np.where(gen, -1.0, 0.0), np.where(gen, 0, -1),
                                   np.where(gen, 0, -1), r))
    mean, std = float(np.mean(rewards)), float(np.std(rewards))
    return tuple(BatchItem(sequence=s, loss_mask=s.loss_mask, group_mean=mean, group_std=std, group_size=len(seqs),
                           staleness=0, task_id=f"g/{i}") for i, s in enumerate(seqs))


def _probe(model, tmp_path, repeats=2) -> TrainerProbe:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return TrainerProbe(trainer=TrainerConfig(backend="torch", lr=1e-4, threads=1), model=str(model), seed=0,
                        policy="p", items=_items(tok), repeats=repeats, weights_root=str(tmp_path / "weights"))


@pytest.mark.timeout(180)
def test_trainer_steps_in_a_child_process(tiny_model, tmp_path):
    probe = _probe(tiny_model, tmp_path)
    seen: list[int] = []

    async def beside(step: int) -> None:
        seen.append(step)

    steps = asyncio.run(trainer_steps(probe, beside))
    assert len(steps) == probe.repeats and all(s > 0 for s in steps)
    assert seen == list(range(probe.repeats + 1))  # told before every step, the warm-up included
    # every step's version was published (and committed) by the child, as the trainer does
    assert WeightStore(tmp_path / "weights").versions("p")[-1] == probe.repeats + 1
    assert not mp.active_children()


@pytest.mark.timeout(120)
def test_a_failing_child_is_a_clear_error(tmp_path, tiny_model):
    probe = _probe(tiny_model, tmp_path)
    bad = TrainerProbe(**{**probe.__dict__, "model": str(tmp_path / "no-such-model")})

    async def beside(step: int) -> None:
        raise AssertionError("no step should start")

    with pytest.raises(PlanError, match="the trainer process failed: .*no-such-model"):
        asyncio.run(trainer_steps(bad, beside))
    assert not mp.active_children()


@pytest.mark.timeout(120)
def test_a_child_that_dies_is_a_clear_error(tmp_path, tiny_model):
    probe = _probe(tiny_model, tmp_path)

    async def kill_it(step: int) -> None:  # the child dies as under the OOM killer
        for child in mp.active_children():
            if child.name == "astraflow-calibrate-trainer":
                child.kill()

    with pytest.raises(PlanError, match="exited with code -9 before it reported its steps"):
        asyncio.run(trainer_steps(probe, kill_it))
    assert not mp.active_children()
