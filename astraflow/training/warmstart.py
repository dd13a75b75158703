"""Supervised warm start (SFT) on the math workload's train split.

RL from a random model gets no reward signal: a policy must solve a few problems before
group-normalised advantages are non-zero. A short SFT run gives it that start. Stopping it
*early* (by steps, seconds, or once held-out greedy accuracy reaches ``target_acc``) leaves a
partly competent policy, the regime where RL's gain is visible and measurable.

Loss: next-token cross-entropy on the answer and the end-of-turn token only (the prompt
carries no loss); the prompt format is the workload's (``format_prompt``).

``task`` picks the role being warmed up, for multi-policy runs whose second policy should
also start partly competent (the prompts are exactly the workflows', from
``astraflow.workloads.prompts``):

* ``"solve"``: ``"12+34="`` -> ``"46"`` (the default);
* ``"solve_retry"``: the solver of a ``solver_verifier`` run: half ``"solve"``, half its retry
  turn after a reject, ``retry_prompt(q, near_miss)`` (``"12+34=47 no. 12+34="``) -> ``"46"``
  (a solver never shown that format answers the retry at random);
* ``"verify"``: ``verify_prompt(q, candidate)`` (``"12+34=47?"``) -> ``"46N"``: the verifier
  works the sum out itself, then compares (``"46Y"`` for ``"12+34=46?"``); the candidate is the
  right answer half of the time, else off by a small amount (1..3). A verdict alone (``"N"``)
  has no signal a small model can start from (it must find ``units(a + b) == units(c)`` in one
  step: the loss sat at chance for 1,600 steps, also from a solver's weights); writing the sum
  first gives it one (that of ``solve``), and the comparison after it is then learnt;
* ``"select"``: ``select_prompt(q, a1, a2)`` (``"12+34=46|47?"``) -> ``"46>1"``: as the
  verifier, the selector writes the sum first, then the position of the candidate equal to it;
  exactly one candidate is right, at a random position, the other off by 1..3.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from astraflow.models import greedy_complete, load_model, pad_id
from astraflow.workloads.math import MathConfig, accuracy, format_prompt, format_target, make_dataset
from astraflow.workloads.prompts import (
    SELECT_NEW_TOKENS, VERIFY_NEW_TOKENS, parse_pick, parse_verdict, retry_prompt, select_prompt, verify_prompt,
)

#: roles a warm start can teach (see the module docstring).
TASKS = ("solve", "solve_retry", "verify", "select")


def _near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer`` (off by 1..3; kept non-negative when possible)."""
    a = int(answer)
    d = rng.randint(1, 3) * rng.choice((-1, 1))
    if a + d < 0 <= a:
        d = -d
    return str(a + d)


def task_examples(task: str, items: list[Mapping[str, Any]], rng: random.Random) -> list[tuple[str, str]]:
    """``(prompt, target)`` pairs of ``task`` built from math problems (one pair per item)."""
    if task not in TASKS:
        raise ValueError(f"warm start: unknown task {task!r}; known tasks: {list(TASKS)}")
    out = []
    for it in items:
        q = format_prompt(it)
        if task == "solve" or (task == "solve_retry" and rng.random() < 0.5):
            out.append((q, format_target(it)))
        elif task == "solve_retry":
            out.append((retry_prompt(q, _near_miss(str(it["answer"]), rng)), format_target(it)))
        elif task == "verify":
            right = rng.random() < 0.5
            cand = str(it["answer"]) if right else _near_miss(str(it["answer"]), rng)
            out.append((verify_prompt(q, cand), format_target(it) + ("Y" if right else "N")))
        else:
            first_right = rng.random() < 0.5
            good, bad = str(it["answer"]), _near_miss(str(it["answer"]), rng)
            a1, a2 = (good, bad) if first_right else (bad, good)
            out.append((select_prompt(q, a1, a2), format_target(it) + (">1" if first_right else ">2")))
    return out


def pad_batch(rows: Sequence[tuple[Sequence[int], Sequence[bool]]],
              pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch every warm start trains on: right-padded ``ids, attention, loss mask`` of
    ``rows`` (each its token ids and a loss mask of the same length), padded with ``pad``."""
    T = max(len(tokens) for tokens, _ in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    att = torch.zeros((len(rows), T), dtype=torch.long)
    lm = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, (tokens, mask) in enumerate(rows):
        n = len(tokens)
        ids[i, :n] = torch.tensor(list(tokens), dtype=torch.long)
        att[i, :n] = 1
        lm[i, :n] = torch.tensor(list(mask), dtype=torch.bool)
    return ids, att, lm


def _encode_pairs(tok, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pad_batch`` of ``prompt + target + eos`` (the loss on the target and eos); padded with
    ``pad_id`` (the pad token, else eos), so a tokenizer needs no pad token."""
    rows = []
    for prompt, target in pairs:
        p = tok(prompt)["input_ids"]
        a = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # no BOS mid-sequence
        rows.append((p + a, [False] * len(p) + [True] * len(a)))
    return pad_batch(rows, pad_id(tok))


def require_eos(tok, model_dir: str | Path) -> None:
    """``ValueError`` naming the fix when ``tok`` (of ``model_dir``) has no eos token: a warm start ends
    every target with it, teaching the policy where its answer stops, and generation stops on it."""
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_dir} has no eos token, which a warm start ends every answer "
                         "with; set eos_token in its tokenizer_config.json to the token the model ends a turn "
                         "with (<|im_end|>, <|eot_id|>, </s>, ...), or start from a checkpoint whose tokenizer has one")


def evaluate(model, tok, items: list[Mapping[str, Any]], max_new_tokens: int = 8) -> float:
    """Held-out greedy exact-match accuracy."""
    return accuracy(greedy_complete(model, tok, [format_prompt(i) for i in items], max_new_tokens), items)


def evaluate_task(model, tok, task: str, items: list[Mapping[str, Any]], seed: int = 0) -> float:
    """Held-out greedy accuracy on ``task``: for ``solve`` exact match of the answer, for
    ``verify`` whether the verdict (``parse_verdict``) is right, for ``select`` whether the
    pick (``parse_pick``) is (the candidates are drawn from a fixed ``seed``, so repeated calls
    see the same examples)."""
    if task in ("solve", "solve_retry"):  # the first turn's accuracy: what the run starts from
        return evaluate(model, tok, items)
    pairs = task_examples(task, items, random.Random(f"eval:{seed}"))
    if not pairs:
        return 0.0
    if task == "verify":
        outs = greedy_complete(model, tok, [p for p, _ in pairs], VERIFY_NEW_TOKENS)
        return sum(parse_verdict(o) == parse_verdict(t) for o, (_, t) in zip(outs, pairs)) / len(pairs)
    outs = greedy_complete(model, tok, [p for p, _ in pairs], SELECT_NEW_TOKENS)
    return sum(parse_pick(o) == parse_pick(t) for o, (_, t) in zip(outs, pairs)) / len(pairs)


def warm_start(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    steps: int | None = None,
    seconds: float | None = None,
    lr: float = 1e-3,
    batch_size: int = 64,
    workload: MathConfig | Mapping[str, Any] | None = None,
    target_acc: float | None = None,
    eval_every: int = 50,
    eval_size: int = 200,
    warmup_steps: int = 20,
    seed: int = 0,
    progress: bool = True,
    task: str = "solve",
    on_eval: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """SFT ``model_dir`` on the math train split and save the result to ``out_dir`` (HF dir).

    ``task`` is the role taught (``TASKS``: ``solve``, ``verify``, ``select``; see the module
    docstring); accuracy is then that role's (``evaluate_task``).

    Stops at the first of: ``steps`` optimiser steps, ``seconds`` of wall time, held-out greedy
    accuracy >= ``target_acc``. Held-out greedy accuracy is measured every ``eval_every`` steps
    (0: only at the end) on ``eval_size`` test problems. Returns ``{"steps", "seconds", "loss", "acc",
    "history"}`` where ``acc`` is the last measured held-out accuracy (measured once more at the end)
    and ``history`` the evals. A tokenizer without an eos token is refused (``require_eos``).
    """
    if batch_size < 1 or lr <= 0:
        raise ValueError(f"warm_start: batch_size must be >= 1 and lr > 0 (got {batch_size}, {lr})")
    if task not in TASKS:
        raise ValueError(f"warm_start: unknown task {task!r}; known tasks: {list(TASKS)}")
    cfg = MathConfig.from_any(workload)
    train = make_dataset(cfg, "train")
    test = make_dataset(cfg, "test")[:eval_size]
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tok = load_model(model_dir)
    require_eos(tok, model_dir)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        items = [train[rng.randrange(len(train))] for _ in range(batch_size)]
        return _encode_pairs(tok, task_examples(task, items, rng))

    return supervised_loop(model, tok, out_dir, next_batch, lambda: evaluate_task(model, tok, task, test, seed),
                           label=task, steps=steps, seconds=seconds, lr=lr, target_acc=target_acc,
                           eval_every=eval_every, warmup_steps=warmup_steps, progress=progress, on_eval=on_eval)


def supervised_loop(model: Any, tok: Any, out_dir: str | Path,
                    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    evaluate: Callable[[], float], *, label: str, steps: int | None, seconds: float | None,
                    lr: float, target_acc: float | None, eval_every: int, warmup_steps: int, progress: bool,
                    on_eval: Callable[[dict[str, float]], None] | None) -> dict[str, Any]:
    """The SFT loop of every warm start: next-token cross-entropy on the loss-masked tokens of
    ``next_batch()`` (``ids, attention, loss mask``), AdamW with a linear warmup, until ``steps``,
    ``seconds`` or ``evaluate() >= target_acc`` (measured every ``eval_every`` steps and once at
    the end); the model and tokenizer are saved to ``out_dir``: the weights of the best
    evaluation, so a loop that ends at its bound on a worse evaluation keeps the better model it
    had. Returns ``{"steps", "seconds", "loss", "acc", "history", "kept_step"}`` (``acc`` and
    ``kept_step``: the saved model's)."""
    if steps is None and seconds is None and target_acc is None:
        raise ValueError(f"warm start ({label}) needs a stopping rule: steps=, seconds= or target_acc=")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup_steps, 1)))
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    step, loss_v, acc = 0, float("nan"), float("nan")

    best: dict[str, Any] = {"acc": float("-inf"), "step": 0, "state": None}

    def do_eval() -> float:
        a = evaluate()
        rec = {"step": step, "seconds": time.perf_counter() - t0, "loss": loss_v, "acc": a}
        history.append(rec)
        if a > best["acc"]:
            # kept on the CPU: a model on a GPU is not doubled there
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            best.update(acc=a, step=step, state=state)
        if on_eval is not None:
            on_eval(rec)
        return a

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn(f"warm start ({label})"), BarColumn(), TextColumn("step {task.completed:.0f}"),
               TextColumn("loss {task.fields[loss]} acc {task.fields[acc]}"),  # '-' until measured
               TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=False) as bar:
        bar_task = bar.add_task("sft", total=steps, loss="-", acc="-")
        while (steps is None or step < steps) and (seconds is None or time.perf_counter() - t0 < seconds):
            ids, att, lm = next_batch()
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
                    bar.update(bar_task, completed=step, loss=f"{loss_v:.3f}", acc=f"{acc:.2f}")
                    break
            bar.update(bar_task, completed=step, loss=f"{loss_v:.3f}", acc="-" if acc != acc else f"{acc:.2f}")
    if not history or history[-1]["step"] != step:
        acc = do_eval()
    kept_step = step
    if best["state"] is not None and best["acc"] > acc:
        model.load_state_dict(best["state"])
        acc, kept_step = best["acc"], best["step"]
    model.eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"steps": step, "seconds": time.perf_counter() - t0, "loss": loss_v, "acc": acc, "history": history,
            "kept_step": kept_step}
