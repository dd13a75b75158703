"""Supervised warm start of an agentic workload: SFT on its expert's demonstrations.

The environment's scripted expert plays train tasks (``astraflow.agents.demos``); the model
learns its turns (next-token cross-entropy on the expert's tokens only, the observations carry
no loss), in exactly the token layout RL rollouts will have. As for math, stopping early (steps,
seconds, or a held-out greedy success ``target_acc``) leaves a partly competent policy, where
RL's gain is visible.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.demos import demonstrations, greedy_success
from astraflow.agents.episode import EpisodeLog
from astraflow.models import load_model


def _collate(logs: list[EpisodeLog], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(log.tokens) for log in logs)
    ids = torch.full((len(logs), T), pad, dtype=torch.long)
    att = torch.zeros((len(logs), T), dtype=torch.long)
    lm = torch.zeros((len(logs), T), dtype=torch.bool)
    for i, log in enumerate(logs):
        n = len(log.tokens)
        ids[i, :n] = torch.tensor(log.tokens)
        att[i, :n] = 1
        lm[i, :n] = torch.tensor(log.loss_mask)
    return ids, att, lm


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
    num_demos: int = 2000,
    warmup_steps: int = 20,
    seed: int = 0,
    progress: bool = True,
    on_eval: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """SFT ``model_dir`` on demonstrations of ``workload``'s train tasks, saved to ``out_dir``.

    Stops at the first of ``steps``, ``seconds`` and held-out greedy success >= ``target_acc``
    (measured every ``eval_every`` steps on ``eval_size`` eval tasks). Returns ``{"steps",
    "seconds", "loss", "acc", "history", "demos"}`` like ``warmstart.warm_start``."""
    if steps is None and seconds is None and target_acc is None:
        raise ValueError("agent_warm_start needs a stopping rule: steps=, seconds= or target_acc=")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tok = load_model(model_dir)
    renderer = ChatRenderer(tok)
    limits = workload.limits(max_new_tokens)
    train = workload.tasks("train")
    picked = rng.sample(train, min(num_demos, len(train)))
    demos = demonstrations(workload, renderer, picked, limits)
    if not demos:
        raise ValueError(f"{type(workload).__name__}: the expert succeeded on none of {len(picked)} train "
                         "tasks; nothing to warm start on")
    held_out = workload.tasks("eval")[:eval_size]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup_steps, 1)))
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    step, loss_v, acc = 0, float("nan"), float("nan")

    def do_eval() -> float:
        a = greedy_success(model, tok, workload, held_out, limits)
        rec = {"step": step, "seconds": time.perf_counter() - t0, "loss": loss_v, "acc": a}
        history.append(rec)
        if on_eval is not None:
            on_eval(rec)
        return a

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("warm start (expert demonstrations)"), BarColumn(), TextColumn("step {task.completed:.0f}"),
               TextColumn("loss {task.fields[loss]:.3f} success {task.fields[acc]:.2f}"), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        bar_task = bar.add_task("sft", total=steps, loss=float("nan"), acc=float("nan"))
        while (steps is None or step < steps) and (seconds is None or time.perf_counter() - t0 < seconds):
            ids, att, lm = _collate([demos[rng.randrange(len(demos))] for _ in range(batch_size)], tok.pad_token_id)
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
            m = lm[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[m], ids[:, 1:][m])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step, loss_v = step + 1, loss.item()
            if eval_every and step % eval_every == 0:
                acc = do_eval()
                if target_acc is not None and acc >= target_acc:
                    bar.update(bar_task, completed=step, loss=loss_v, acc=acc)
                    break
            bar.update(bar_task, completed=step, loss=loss_v, acc=acc)
    if not history or history[-1]["step"] != step:
        acc = do_eval()
    model.eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"steps": step, "seconds": time.perf_counter() - t0, "loss": loss_v, "acc": acc,
            "history": history, "demos": len(demos)}
