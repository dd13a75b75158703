"""The torch trainer's step with each distinct prompt forwarded once (``share_prompt``, the
default) against one that forwards every sequence whole (the baseline), on the main example's
batch: 16 prompts x 8 samples of 2-digit addition, the ``mini`` Llama model, completions the HF
engine sampled (5 new tokens), every sequence trained (as in a batch whose groups all have
signal), one torch thread as in the example's trainer.

    python benchmarks/trainer_prefix.py [--steps 10] [--model DIR] [--prompts 16] [--samples 8]

Two backends start from the same weights and take the same batches, alternating which goes
first. Ends with ``RESULT {json}``: seconds per step, shared over baseline, and the relative gap
between the two first steps' losses and gradient norms (taken from the same weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed one

import numpy as np  # noqa: E402
import torch  # noqa: E402

from astraflow.batches import Batch, BatchItem  # noqa: E402
from astraflow.contracts import Sequence  # noqa: E402
from astraflow.models import init_model  # noqa: E402
from astraflow.rollout.engine import SamplingParams  # noqa: E402
from astraflow.rollout.hf_engine import HFEngine  # noqa: E402
from astraflow.training.torch_backend import TorchBackend  # noqa: E402
from astraflow.workloads.base import make_workload  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402


def example_batch(engine: HFEngine, workload, problems, samples: int, new_tokens: int, seed: int) -> Batch:
    """A GRPO batch as the trainer gets it: each prompt's samples with their behaviour log-probs,
    rewards and group statistics (seeded 0/1 rewards: a fresh model would score every sample 0,
    and the step's work does not depend on the rewards' values)."""
    rng = np.random.default_rng(seed)
    prompts = [engine.tokenizer(workload.render_prompt(p))["input_ids"] for p in problems]

    async def go():
        return await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed * 10_000 + i))
            for i, p in enumerate(q for q in prompts for _ in range(samples))])

    gens = asyncio.run(go())
    items = []
    for g, (problem, prompt) in enumerate(zip(problems, prompts)):
        group = gens[g * samples:(g + 1) * samples]
        rewards = rng.integers(0, 2, samples).astype(float).tolist()
        mean, std = float(np.mean(rewards)), float(np.std(rewards))
        for i, (x, r) in enumerate(zip(group, rewards)):
            gen = np.arange(len(prompt) + len(x.tokens)) >= len(prompt)
            lp = np.concatenate([np.zeros(len(prompt)), x.logprobs])
            seq = Sequence.build(prompt + list(x.tokens), gen, lp, np.where(gen, 0, -1), np.where(gen, 0, -1), r)
            items.append(BatchItem(sequence=seq, loss_mask=seq.loss_mask, group_mean=mean, group_std=std,
                                   group_size=samples, staleness=0, task_id=f"{seed}/{g}/{i}"))
    return Batch(policy="solver", version=0, items=tuple(items))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=10, help="timed steps per setting")
    ap.add_argument("--prompts", type=at_least(1), default=16)
    ap.add_argument("--samples", type=at_least(1), default=8)
    ap.add_argument("--new-tokens", type=at_least(1), default=5)
    ap.add_argument("--model", type=Path, help="an HF model directory (default: a fresh mini Llama)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or init_model(Path(tmp) / "mini", preset="mini", arch="llama")
        engine = HFEngine(model, seed=0, max_batch_size=args.prompts * args.samples, device="cpu")
        workload = make_workload("math", {"digits": 2}, 0)
        problems = workload.tasks("train")
        # every sequence trained (as when every group has signal: a fresh model scores alike)
        backends = {share: TorchBackend(str(model), lr=5e-5, device="cpu", share_prompt=share,
                                        skip_zero_advantage=False) for share in (True, False)}
        times: dict[bool, list[float]] = {True: [], False: []}
        gap, tokens = 0.0, {True: 0.0, False: 0.0}
        for b in range(args.steps + 1):  # the first step of each warms up
            batch = example_batch(engine, workload, problems[b * args.prompts:(b + 1) * args.prompts], args.samples,
                           args.new_tokens, b)
            out = {}
            for share in (True, False) if b % 2 else (False, True):
                t0 = time.perf_counter()
                out[share] = backends[share].train_step(batch)
                if b:
                    times[share].append(time.perf_counter() - t0)
                    tokens[share] += out[share]["forwarded_tokens"]
            for k in ("loss", "grad_norm") if b == 0 else ():  # from the same weights (later, Adam's steps part them)
                # relative, but not to a loss that is next to 0 (a batch whose advantages cancel)
                gap = max(gap, abs(out[True][k] - out[False][k]) / max(abs(out[True][k]), abs(out[False][k]), 1e-3))
    shared, whole = statistics.median(times[True]), statistics.median(times[False])
    print(f"{'prompt':>8} {'median s/step':>14} {'tokens/step':>12} {'steps':>6}")
    for name, share, secs in (("whole", False, whole), ("shared", True, shared)):
        print(f"{name:>8} {secs:>14.4f} {tokens[share] / len(times[share]):>12.0f} {len(times[share]):>6}")
    print(f"relative gap in the first step's loss / grad norm: {gap:.2e}")
    result = {"seconds_per_step_shared": round(shared, 4), "seconds_per_step_whole": round(whole, 4),
              "time_ratio_shared_vs_whole": round(shared / whole, 3),
              "forwarded_tokens_ratio": round(tokens[True] / tokens[False], 3), "max_relative_gap": float(f"{gap:.2e}")}
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
