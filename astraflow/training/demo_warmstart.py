"""Supervised warm start on a workload's reference solutions (the ``dataset`` workload's
``demonstration``): SFT in exactly the token layout RL rollouts will have.

Each example is the prompt as the workflows render it (``astraflow.agents.chat.prompt_ids``:
the chat template with its generation prompt where the tokenizer has one) followed by the
demonstration and the token that ends a model turn; only the demonstration and that token carry
loss. Held-out success is the workload's own reward on greedy completions, so the warm start's
target means what the run's evaluation means.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import random
from pathlib import Path
from typing import Any, Callable

import torch

from astraflow.agents.chat import end_of_turn_ids, prompt_ids
from astraflow.models import load_model, pad_id
from astraflow.training.warmstart import pad_batch, supervised_loop


def encode_examples(tok: Any, workload: Any, payloads: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, target ids)`` per payload; the target ends with the end-of-turn token."""
    stop = end_of_turn_ids(tok)[-1:]  # the template's end-of-turn token when it has one, else eos
    return [(prompt_ids(tok, workload, p), list(tok.encode(workload.demonstration(p), add_special_tokens=False)) + stop)
            for p in payloads]


def collate(pairs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pad_batch`` of ``prompt + target`` pairs (the mask covers the targets only)."""
    return pad_batch([(p + t, [False] * len(p) + [True] * len(t)) for p, t in pairs], pad)


@torch.no_grad()
def greedy_texts(model: Any, tok: Any, prompts: list[list[int]], max_new_tokens: int,
                 batch_size: int = 128) -> list[str]:
    """Greedy completions of token-id prompts (left-padded batches), decoded without special tokens."""
    was_training = model.training
    model.eval()
    pad = pad_id(tok)
    stops = end_of_turn_ids(tok)
    out: list[str] = []
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s : s + batch_size]
        T = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (T - len(p)) + p for p in chunk])
        att = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in chunk])
        gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stops, pad_token_id=pad)
        out.extend(tok.batch_decode(gen[:, T:], skip_special_tokens=True))
    model.train(was_training)
    return out


def success_rate(model: Any, tok: Any, workload: Any, payloads: list[dict[str, Any]], max_new_tokens: int) -> float:
    """Mean reward of greedy completions of ``payloads`` (held-out accuracy)."""
    if not payloads:
        return 0.0
    texts = greedy_texts(model, tok, [prompt_ids(tok, workload, p) for p in payloads], max_new_tokens)
    # a few at once: a reward that runs a program waits on its sandbox (which bounds the concurrency)
    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(workload.reward, texts, payloads)) / len(payloads)


def demo_warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    workload: Any,
    *,
    max_new_tokens: int,
    steps: int | None = None,
    seconds: float | None = None,
    lr: float = 1e-3,
    batch_size: int = 64,
    target_acc: float | None = None,
    eval_every: int = 50,
    eval_size: int = 100,
    warmup_steps: int = 20,
    seed: int = 0,
    progress: bool = True,
    on_eval: Callable[[dict[str, float]], None] | None = None,
    label: str = "reference solutions",
) -> dict[str, Any]:
    """SFT ``model_dir`` on ``workload.demonstration`` of its train tasks, saved to ``out_dir``
    (``label`` names them on the progress bar).

    Stops at the first of ``steps``, ``seconds`` and held-out greedy success >= ``target_acc``
    (every ``eval_every`` steps, on ``eval_size`` held-out tasks, completions of up to
    ``max_new_tokens``). Returns ``{"steps", "seconds", "loss", "acc", "history"}`` like
    ``warmstart.warm_start``."""
    if not hasattr(workload, "demonstration"):
        raise ValueError(f"{type(workload).__name__} gives no demonstrations (a demonstration(payload) method); "
                         "it cannot be warm-started: remove init.warm_start_* or start from a trained model")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tok = load_model(model_dir)
    examples = encode_examples(tok, workload, workload.tasks("train"))
    held_out = workload.tasks("eval")[:eval_size]
    pad = pad_id(tok)
    return supervised_loop(
        model, tok, out_dir,
        lambda: collate([examples[rng.randrange(len(examples))] for _ in range(batch_size)], pad),
        lambda: success_rate(model, tok, workload, held_out, max_new_tokens),
        label=label, steps=steps, seconds=seconds, lr=lr, target_acc=target_acc,
        eval_every=eval_every, warmup_steps=warmup_steps, progress=progress, on_eval=on_eval)
