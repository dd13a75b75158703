"""The HF engine's prefill shared by a group's samples against a prefill of every row (the
baseline: ``share_prefill`` off), on the main example's batch: 16 prompts x 8 samples, the
``mini`` Llama model, 5 new tokens, one torch thread as in the engine process.

    python benchmarks/engine_prefill.py [--batches 10] [--model DIR]

Batches alternate between the two settings (the same prompts and seeds: the same tokens). Ends
with ``RESULT {json}``: engine seconds per batch, shared over baseline.
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

import torch  # noqa: E402

from astraflow.models import init_model  # noqa: E402
from astraflow.rollout.engine import SamplingParams  # noqa: E402
from astraflow.rollout.hf_engine import HFEngine  # noqa: E402
from astraflow.workloads.base import make_workload  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402


def _batch(engine: HFEngine, prompts: list[list[int]], samples: int, new_tokens: int, seed: int):
    async def go():
        return await asyncio.gather(*[
            engine.generate(p, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed * 10_000 + i))
            for i, p in enumerate(q for q in prompts for _ in range(samples))])

    t0 = time.perf_counter()
    gens = asyncio.run(go())
    return time.perf_counter() - t0, [g.tokens.tolist() for g in gens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=at_least(1), default=10, help="batches per setting")
    ap.add_argument("--prompts", type=at_least(1), default=16)
    ap.add_argument("--samples", type=at_least(1), default=8)
    ap.add_argument("--new-tokens", type=at_least(1), default=5)
    ap.add_argument("--model", type=Path, help="an HF model directory (default: a fresh mini Llama)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or init_model(Path(tmp) / "mini", preset="mini", arch="llama")
        engine = HFEngine(model, seed=0, max_batch_size=args.prompts * args.samples, device="cpu")
        workload = make_workload("math", {"digits": 2}, 0)
        problems = workload.tasks("train")
        times: dict[bool, list[float]] = {True: [], False: []}
        same = True
        for b in range(args.batches + 1):  # the first pair warms up
            qs = problems[b * args.prompts:(b + 1) * args.prompts]
            prompts = [engine.tokenizer(workload.render_prompt(p))["input_ids"] for p in qs]
            out = {}
            for share in (True, False) if b % 2 else (False, True):
                engine.share_prefill = share
                seconds, out[share] = _batch(engine, prompts, args.samples, args.new_tokens, b)
                if b:
                    times[share].append(seconds)
            same &= out[True] == out[False]
    shared, full = statistics.median(times[True]), statistics.median(times[False])
    print(f"{'prefill':>10} {'median s/batch':>15} {'batches':>8}")
    print(f"{'per row':>10} {full:>15.4f} {len(times[False]):>8}")
    print(f"{'shared':>10} {shared:>15.4f} {len(times[True]):>8}")
    print(f"same tokens in every batch: {same}")
    print("RESULT " + json.dumps({"seconds_per_batch_shared": round(shared, 4), "seconds_per_batch_per_row":
                                  round(full, 4), "time_ratio_shared_vs_per_row": round(shared / full, 3),
                                  "same_tokens": same}))


if __name__ == "__main__":
    main()
