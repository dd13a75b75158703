"""Supervised warm start of an agentic workload: SFT on its expert's demonstrations.

The environment's scripted expert plays train tasks (``astraflow.agents.demos``); the model
learns its turns (next-token cross-entropy on the expert's tokens only, the observations carry
no loss), in exactly the token layout RL rollouts will have. As for math, stopping early (steps,
seconds, or a held-out greedy success ``target_acc``) leaves a partly competent policy, where
RL's gain is visible.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import torch

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.demos import demonstrations, greedy_success
from astraflow.agents.episode import EpisodeLog
from astraflow.models import load_model, pad_id
from astraflow.training.warmstart import pad_batch, supervised_loop


def _collate(logs: list[EpisodeLog], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pad_batch`` of episodes: the loss on the expert's tokens only."""
    return pad_batch([(log.tokens, log.loss_mask) for log in logs], pad)


def agent_warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    workload: Any,
    *,
    max_new_tokens: int,
    steps: int | None = None,
    seconds: float | None = None,
    lr: float = 1e-3,
    batch_size: int = 32,
    target_acc: float | None = None,
    eval_every: int = 50,
    eval_size: int = 100,
    num_demos: int = 20000,
    warmup_steps: int = 20,
    demo_noise: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    on_eval: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """SFT ``model_dir`` on demonstrations of ``workload``'s train tasks, saved to ``out_dir``.

    Stops at the first of ``steps``, ``seconds`` and held-out greedy success >= ``target_acc``
    (measured every ``eval_every`` steps on ``eval_size`` eval tasks). Returns ``{"steps",
    "seconds", "loss", "acc", "history", "demos"}`` like ``warmstart.warm_start``. ``demo_noise``:
    the share of expert turns replaced by random plausible ones (``demos.demonstration``)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tok = load_model(model_dir)
    renderer = ChatRenderer(tok)
    limits = workload.limits(max_new_tokens)
    train = workload.tasks("train")
    picked = rng.sample(train, min(num_demos, len(train)))
    demos = demonstrations(workload, renderer, picked, limits, noise=demo_noise, seed=seed)
    if not demos:
        raise ValueError(f"{type(workload).__name__}: the expert succeeded on none of {len(picked)} train "
                         "tasks; nothing to warm start on")
    held_out = workload.tasks("eval")[:eval_size]
    result = supervised_loop(
        model, tok, out_dir,
        lambda: _collate([demos[rng.randrange(len(demos))] for _ in range(batch_size)], pad_id(tok)),
        lambda: greedy_success(model, tok, workload, held_out, limits),
        label="expert demonstrations", steps=steps, seconds=seconds, lr=lr, target_acc=target_acc,
        eval_every=eval_every, warmup_steps=warmup_steps, progress=progress, on_eval=on_eval)
    return {**result, "demos": len(demos)}
