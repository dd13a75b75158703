"""vLLM engine vs HF engine: generated tokens/s on the same model, prompts and sampling.

Both engines run alone in this process behind the same ``InferenceEngine`` protocol, built
as a RaaS node builds them (``engines.make_engine``): ``capacity`` requests in flight, each
``max_new_tokens`` long at temperature 1 (stop tokens end some early: both count what they
generated). The HF engine decodes padded batches of up to ``max_batch`` with its own loop in
its own process; vLLM batches continuously in its engine core. Repetitions alternate the two
(load drifts hit both alike); the median ratio is the result. Engine start-up is not timed.
Both run on the machine's first GPU where there is one (``device`` in the result), else on
the CPU (vLLM's CPU build).

Needs vLLM (e.g. the venv ``bash tests/run_vllm.sh --setup-only`` builds). Prints a table and
ends with one line ``RESULT {json}``.

    python benchmarks/engine_compare.py [--prompts 512] [--capacity 128] [--max-batch 64]
        [--max-new-tokens 64] [--preset tiny|small] [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_checks import at_least  # noqa: E402


def run_engine(engine_type: str, model_dir: Path, prompts: list[list[int]], args) -> dict:
    """Build the engine, generate every prompt with ``capacity`` in flight, close it."""
    import torch

    from astraflow.rollout.config import EngineConfig
    from astraflow.rollout.engine import SamplingParams
    from astraflow.rollout.engines import make_engine

    torch.set_num_threads(args.threads)
    # device auto: the first GPU where there is one (where vLLM's CUDA build runs), else the CPU
    cfg = EngineConfig(type=engine_type, max_batch=args.max_batch, threads=args.threads, device="auto")
    engine = make_engine(cfg, str(model_dir), seed=args.seed)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)

    async def go() -> int:
        sem = asyncio.Semaphore(args.capacity)

        async def one(p):
            async with sem:
                return len((await engine.generate(p, params)).tokens)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))

    try:
        asyncio.run(go_warm(engine, prompts[:4], params))
        t0 = time.perf_counter()
        tokens = asyncio.run(go())
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


async def go_warm(engine, prompts, params) -> None:
    """A few requests before timing (first-call allocations, the engine's loop start)."""
    await asyncio.gather(*(engine.generate(p, params) for p in prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=at_least(1), default=512, help="requests per engine and repetition")
    ap.add_argument("--capacity", type=at_least(1), default=128, help="requests in flight")
    ap.add_argument("--max-batch", type=at_least(1), default=64, help="engine batch size (both engines)")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64, help="tokens generated per request at most")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="model size preset")
    ap.add_argument("--threads", type=at_least(1), default=1,
                    help="engine threads (torch for hf, OpenMP for vLLM's CPU build)")
    ap.add_argument("--seed", type=int, default=0, help="model init and sampling seed")
    ap.add_argument("--reps", type=at_least(1), default=3,
                    help="alternating hf/vLLM repetitions (median ratio reported)")
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from astraflow.models import init_model, load_tokenizer
    from astraflow.rollout.vllm_setup import build_name, require_vllm
    from astraflow.workloads.base import make_workload

    try:
        require_vllm()
    except ValueError as err:
        ap.error(str(err))  # exit 2, no traceback
    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine-compare-", dir=ROOT / "benchmarks" / "out"))
    try:  # the scratch model goes on a failure or Ctrl-C too
        model_dir = init_model(work / "model", preset=args.preset, seed=args.seed)
        tok = load_tokenizer(model_dir)
        wl = make_workload("math", {"digits": 2}, 0)
        train = wl.tasks("train")
        prompts = [tok.encode(wl.render_prompt(train[i % len(train)])) for i in range(args.prompts)]

        rows = []
        for rep in range(args.reps):
            order = ("hf", "vllm") if rep % 2 == 0 else ("vllm", "hf")
            res = {e: run_engine(e, model_dir, prompts, args) for e in order}
            rows.append(res)
            print(f"rep {rep + 1}/{args.reps}: hf {res['hf']['tokens_per_s']:.0f} tok/s, "
                  f"vllm {res['vllm']['tokens_per_s']:.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"engines ({args.prompts} prompts, {args.capacity} in flight, batch {args.max_batch}, "
                        f"{args.max_new_tokens} new tokens, {args.preset} model, {args.threads} thread(s); {build_name()})")
    for col in ("rep", "engine", "tokens", "seconds", "tokens/s", "vllm / hf"):
        table.add_column(col, justify="right")
    ratios = []
    for i, res in enumerate(rows):
        ratio = res["vllm"]["tokens_per_s"] / res["hf"]["tokens_per_s"]
        ratios.append(ratio)
        for e in ("hf", "vllm"):
            r = res[e]
            table.add_row(str(i + 1) if e == "hf" else "", e, str(r["tokens"]), f"{r['seconds']:.2f}",
                          f"{r['tokens_per_s']:.0f}", f"{ratio:.2f}" if e == "vllm" else "")
    Console().print(table)
    print("RESULT " + json.dumps({
        "vllm_vs_hf_tokens_per_s": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "hf_tokens_per_s": round(statistics.median(r["hf"]["tokens_per_s"] for r in rows), 1),
        "vllm_tokens_per_s": round(statistics.median(r["vllm"]["tokens_per_s"] for r in rows), 1),
        "vllm_build": build_name(), "preset": args.preset, "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens, "capacity": args.capacity, "max_batch": args.max_batch,
        "threads": args.threads, "device": "cuda" if torch.cuda.is_available() else "cpu",
    }))


if __name__ == "__main__":
    main()
