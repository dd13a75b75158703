"""Single-process GRPO reference run: does the ML stack really learn, and how fast, on this CPU?

No Dask, no stores: the same pieces the distributed run uses (``HFEngine`` for rollouts,
``grpo_loss`` through ``TorchBackend`` for updates, ``warm_start`` for the SFT start), wired
in one synchronous loop. It is the baseline the distributed example is measured against and
the place to tune hyperparameters.

    init model -> warm start (partial, to ~target accuracy) -> GRPO steps
    (P prompts x G samples each, on-policy, weights pushed to the engine after every step),
    held-out greedy accuracy every ``--eval-every`` steps.

The baseline is the policy at the start of RL (its held-out accuracy is measured with the same
evaluation); the result is the gain in accuracy points and the time RL took to reach it.
``--compare-run RUN_DIR`` puts an ``astraflow run`` directory's curve next to this one's, per
minute of RL (RESULT key ``compare``).
Prints a table and ends with one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from astraflow.batches import Batch, BatchItem  # noqa: E402
from astraflow.contracts import Sequence  # noqa: E402
from astraflow.models import init_model, num_parameters  # noqa: E402
from astraflow.rollout.engine import SamplingParams  # noqa: E402
from astraflow.rollout.hf_engine import HFEngine  # noqa: E402
from astraflow.training.torch_backend import TorchBackend  # noqa: E402
from astraflow.training.warmstart import warm_start  # noqa: E402
from astraflow.workloads.math import MathConfig, format_prompt, make_dataset, math_reward  # noqa: E402
from benchmarks.run_checks import above, at_least  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--arch", default="qwen2")
    p.add_argument("--digits", type=at_least(1), default=2)
    p.add_argument("--threads", type=at_least(1), default=2)
    p.add_argument("--device", default="cpu", help="engine and trainer device (cpu: the 2-core reference)")
    p.add_argument("--seed", type=int, default=0, help="model init, warm start, prompt order and sampling")
    p.add_argument("--data-seed", type=int, default=0,
                   help="the problems' train/held-out split (MathConfig.seed; the main example's workload.seed "
                        "is 0): keep it when comparing runs of different --seed")
    p.add_argument("--ws-target", type=float, default=0.25, help="stop the warm start at this held-out acc")
    p.add_argument("--ws-max-seconds", type=at_least(0, float), default=240.0)
    p.add_argument("--ws-lr", type=float, default=1e-3)
    p.add_argument("--ws-batch", type=at_least(1), default=64)
    p.add_argument("--ws-eval-every", type=at_least(1), default=25)
    p.add_argument("--lr", type=float, default=3e-4, help="RL learning rate")
    p.add_argument("--prompts", type=at_least(1), default=8, help="prompts per RL step")
    p.add_argument("--group", type=at_least(1), default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=at_least(1), default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="the trainer's forward/backward (TorchBackend precision)")
    p.add_argument("--engine-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the engine's weights and forward passes (rollout.engine.dtype)")
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--rl-seconds", type=above(0), default=600.0)
    p.add_argument("--rl-cpu-seconds", type=float, default=None,
                   help="also end RL after this many CPU seconds of this process (a proxy for an idle "
                        "machine's wall time when tuning with --threads 1 on a busy one)")
    p.add_argument("--eval-every", type=at_least(1), default=20, help="RL steps between held-out evals")
    p.add_argument("--eval-size", type=at_least(1), default=400)
    p.add_argument("--stop-at-gain", type=float, default=None,
                   help="end RL early once the gain (points) reaches this")
    p.add_argument("--model-dir", default=None, help="reuse a warm-started HF dir (skips init + warm start)")
    p.add_argument("--save-warm", default=None, help="save the warm-started model here")
    p.add_argument("--compare-run", default=None, metavar="RUN_DIR",
                   help="an `astraflow run` directory (e.g. the main example's): compare its held-out "
                        "accuracy curve with this run's per minute of RL")
    args = p.parse_args(argv)
    from benchmarks.run_checks import cuda_problem

    problem = cuda_problem(args.device)
    if problem:  # else the engine fails with a traceback after the warm start
        p.error(problem)
    return args


def _gain30_minutes(curve: list[tuple[float, float]], smooth: int = 1) -> float | None:
    """First minute at which accuracy (a ``smooth``-point moving average) is 30 points above the start."""
    acc = np.array([a for _, a in curve])
    if smooth > 1:
        acc = np.convolve(acc, np.ones(smooth) / smooth, mode="valid")
        times = [t for t, _ in curve][smooth // 2 : smooth // 2 + len(acc)]
    else:
        times = [t for t, _ in curve]
    return next((round(t, 2) for t, a in zip(times, acc) if a - curve[0][1] >= 0.30), None)


def compare_with_run(run_dir: Path, reference: list[tuple[float, float]], console: Console) -> dict:
    """Both curves (minutes of RL, held-out accuracy) on one time grid over their common span:
    mean accuracy overall and per window, and when each first gained 30 points. The run's clock
    starts at its first evaluation (v0, before RL), as this script's does."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = sorted((x for x in lines if "eval_accuracy" in x), key=lambda x: x["time"])
    if len(evals) < 2:
        raise ValueError(f"{run_dir}/metrics.jsonl has {len(evals)} evaluation lines: run it longer (eval.every)")
    system = [((e["time"] - evals[0]["time"]) / 60, e["eval_accuracy"]) for e in evals]
    span = min(system[-1][0], reference[-1][0])
    grid = np.linspace(0.0, span, 600)
    on_grid = {name: np.interp(grid, [t for t, _ in c], [a for _, a in c])
               for name, c in (("system", system), ("reference", reference))}
    edges = [0.0, span / 3, 2 * span / 3, span]
    windows = []
    table = Table(title=f"held-out accuracy per minute of RL: {run_dir.name} vs this reference")
    for col in ("minutes", "system", "reference"):
        table.add_column(col, justify="right")
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (grid >= lo) & (grid <= hi)
        w = {"from_min": round(lo, 2), "to_min": round(hi, 2),
             "system": round(float(on_grid["system"][m].mean()), 4),
             "reference": round(float(on_grid["reference"][m].mean()), 4)}
        windows.append(w)
        table.add_row(f"{lo:.1f}-{hi:.1f}", f"{w['system']:.3f}", f"{w['reference']:.3f}")
    out = {
        "run_dir": str(run_dir), "common_minutes": round(span, 2), "windows": windows,
        "mean_acc_system": round(float(on_grid["system"].mean()), 4),
        "mean_acc_reference": round(float(on_grid["reference"].mean()), 4),
        "gain30_min_system": _gain30_minutes(system), "gain30_min_reference": _gain30_minutes(reference),
        "gain30_min_system_smoothed3": _gain30_minutes(system, 3),
        "gain30_min_reference_smoothed3": _gain30_minutes(reference, 3),
    }
    out["mean_acc_ratio"] = round(out["mean_acc_system"] / max(out["mean_acc_reference"], 1e-9), 3)
    table.add_row(f"0-{span:.1f}", f"{out['mean_acc_system']:.3f}", f"{out['mean_acc_reference']:.3f}")
    console.print(table)
    console.print(f"+30 points first at {out['gain30_min_system']} min (system) vs "
                  f"{out['gain30_min_reference']} min (reference); on a 3-evaluation moving average "
                  f"{out['gain30_min_system_smoothed3']} vs {out['gain30_min_reference_smoothed3']} min")
    return out


async def _rollout(engine, tok, items, group, params):
    reqs = []
    for it in items:
        prompt = tok(format_prompt(it))["input_ids"]
        for _ in range(group):
            reqs.append((it, prompt, engine.generate(prompt, params)))
    gens = await asyncio.gather(*[r[2] for r in reqs])
    return [(it, prompt, g) for (it, prompt, _), g in zip(reqs, gens)]


def make_batch(results, tok, group, version) -> tuple[Batch, float]:
    items, rewards = [], []
    for gi in range(0, len(results), group):
        chunk = results[gi : gi + group]
        seqs = []
        for it, prompt, g in chunk:
            text = tok.decode(g.tokens.tolist(), skip_special_tokens=True)
            r = math_reward(text, it["answer"])
            n_p, n_c = len(prompt), len(g.tokens)
            seqs.append(Sequence.build(
                tokens=np.concatenate([np.asarray(prompt, dtype=np.int32), g.tokens]),
                loss_mask=np.r_[np.zeros(n_p, bool), np.ones(n_c, bool)],
                logprobs=np.r_[np.zeros(n_p, np.float32), g.logprobs],
                policy_ids=np.r_[np.full(n_p, -1), np.zeros(n_c)],
                versions=np.r_[np.full(n_p, -1), g.versions],
                reward=r, finish_reason=g.finish_reason,
            ))
        rs = np.array([s.reward for s in seqs])
        rewards.extend(rs.tolist())
        for j, s in enumerate(seqs):
            items.append(BatchItem(sequence=s, loss_mask=s.loss_mask, group_mean=float(rs.mean()),
                                   group_std=float(rs.std()), group_size=len(seqs), staleness=0,
                                   task_id=f"{gi}/{j}"))
    return Batch(policy="policy", version=version, items=tuple(items)), float(np.mean(rewards))


async def _evaluate(engine, tok, test, max_new_tokens):
    params = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    gens = await asyncio.gather(*[engine.generate(tok(format_prompt(it))["input_ids"], params) for it in test])
    texts = [tok.decode(g.tokens.tolist(), skip_special_tokens=True) for g in gens]
    return float(np.mean([math_reward(t, it["answer"]) for t, it in zip(texts, test)]))


def main(argv=None) -> dict:
    a = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="grpo_ref_"))  # the models it builds; gone at the end, Ctrl-C included
    try:
        return run(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(a: argparse.Namespace, tmp: Path) -> dict:
    """The warm start (unless ``--model-dir``), then RL with evaluations; the RESULT."""
    torch.set_num_threads(a.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    console = Console()
    wl = MathConfig(digits=a.digits, num_test=a.eval_size, seed=a.data_seed)
    train = make_dataset(wl, "train")
    test = make_dataset(wl, "test")
    t_start = time.perf_counter()

    ws_seconds, ws_steps, ws_cpu = 0.0, 0, 0.0
    if a.model_dir is None:
        c0 = time.process_time()
        init_dir = init_model(tmp / "init", preset=a.preset, arch=a.arch, seed=a.seed)
        model_dir = Path(a.save_warm) if a.save_warm else tmp / "warm"
        ws = warm_start(init_dir, model_dir, seconds=a.ws_max_seconds, target_acc=a.ws_target,
                        lr=a.ws_lr, batch_size=a.ws_batch, workload=wl, eval_every=a.ws_eval_every,
                        eval_size=a.eval_size, seed=a.seed, progress=console.is_terminal)
        ws_seconds, ws_steps, ws_cpu = ws["seconds"], ws["steps"], time.process_time() - c0
        console.print(f"warm start: {ws_steps} steps, {ws_seconds:.1f} s, held-out acc {ws['acc']:.3f}")
    else:
        model_dir = Path(a.model_dir)

    engine = HFEngine(str(model_dir), version=0, seed=a.seed, device=a.device, dtype=a.engine_dtype)
    backend = TorchBackend(str(model_dir), lr=a.lr, clip_low=a.clip_low, clip_high=a.clip_high, seed=a.seed,
                           precision=a.precision,
                           device=a.device)
    tok = engine.tokenizer
    console.print(f"model: {a.preset}/{a.arch}, {num_parameters(backend.model) / 1e6:.2f} M params, "
                  f"{a.threads} threads")
    params = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens)
    rng = random.Random(a.seed + 1)

    table = Table(title=f"GRPO reference ({a.preset}, {a.prompts}x{a.group}, lr {a.lr:g})")
    for c in ("rl s", "step", "train reward", "held-out acc", "gain pts", "s/step", "clip", "kl"):
        table.add_column(c, justify="right")

    loop = asyncio.new_event_loop()
    t0 = time.perf_counter()
    c0 = time.process_time()
    acc0 = loop.run_until_complete(_evaluate(engine, tok, test, a.max_new_tokens))
    curve = [{"seconds": 0.0, "step": 0, "acc": acc0, "train_reward": None}]
    table.add_row("0", "0", "-", f"{acc0:.3f}", "0.0", "-", "-", "-")
    console.print(f"acc before RL: {acc0:.3f}")
    step, rewards_window, t_gain30 = 0, [], None
    last_stats: dict = {}
    acc = acc0
    step_t = time.perf_counter()
    while time.perf_counter() - t0 < a.rl_seconds and (
        a.rl_cpu_seconds is None or time.process_time() - c0 < a.rl_cpu_seconds
    ):
        items = [train[rng.randrange(len(train))] for _ in range(a.prompts)]
        results = loop.run_until_complete(_rollout(engine, tok, items, a.group, params))
        batch, mean_r = make_batch(results, tok, a.group, step)
        rewards_window.append(mean_r)
        last_stats = backend.train_step(batch)
        step += 1
        engine.load_weights(backend.state_dict(), step)
        if step % a.eval_every == 0:
            acc = loop.run_until_complete(_evaluate(engine, tok, test, a.max_new_tokens))
            el = time.perf_counter() - t0
            gain = 100 * (acc - acc0)
            if t_gain30 is None and gain >= 30:
                t_gain30 = el
            tr = float(np.mean(rewards_window))
            sps = (time.perf_counter() - step_t) / a.eval_every
            step_t = time.perf_counter()
            rewards_window = []
            curve.append({"seconds": round(el, 1), "cpu_seconds": round(time.process_time() - c0, 1),
                          "step": step, "acc": acc, "train_reward": round(tr, 4)})
            # a step that trained no row (every advantage 0) measured no ratio
            clip, kl = (last_stats.get(k, float("nan")) for k in ("clip_frac", "approx_kl"))
            table.add_row(f"{el:.0f}", str(step), f"{tr:.3f}", f"{acc:.3f}", f"{gain:+.1f}", f"{sps:.2f}",
                          f"{clip:.3f}", f"{kl:.4f}")
            console.print(f"[{el:6.0f}s cpu {time.process_time() - c0:5.0f}s] step {step:5d}  train reward {tr:.3f}  held-out acc {acc:.3f}  "
                          f"gain {gain:+.1f} pts  clip {clip:.3f} "
                          f"kl {kl:.4f} |A| {last_stats['advantage_abs_mean']:.2f}",
                          highlight=False)
            if a.stop_at_gain is not None and gain >= a.stop_at_gain:
                break
    if step % a.eval_every:
        acc = loop.run_until_complete(_evaluate(engine, tok, test, a.max_new_tokens))
        curve.append({"seconds": round(time.perf_counter() - t0, 1), "step": step, "acc": acc,
                      "train_reward": None})
    rl_seconds = time.perf_counter() - t0
    rl_cpu = time.process_time() - c0
    loop.close()
    console.print(table)
    best = max(c["acc"] for c in curve)
    result = {
        "acc_before": acc0,
        "acc_after": acc,
        "acc_best": best,
        "gain_points": round(100 * (acc - acc0), 2),
        "gain_ratio": round(acc / acc0, 3) if acc0 > 0 else None,
        "rl_seconds": round(rl_seconds, 1),
        "rl_steps": step,
        "seconds_to_gain30": round(t_gain30, 1) if t_gain30 is not None else None,
        # CPU seconds of this process: with --threads 1 on a busy machine, about the wall time
        # the same run takes on an idle one
        "rl_cpu_seconds": round(rl_cpu, 1),
        "warmstart_seconds": round(ws_seconds, 1),
        "warmstart_cpu_seconds": round(ws_cpu, 1),
        "warmstart_steps": ws_steps,
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "engine": engine.stats(),
        "settings": {k: v for k, v in vars(a).items() if k not in ("model_dir", "save_warm")},
        "curve": curve,
    }
    if a.compare_run:
        result["compare"] = compare_with_run(Path(a.compare_run), [(c["seconds"] / 60, c["acc"]) for c in curve],
                                             console)
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
