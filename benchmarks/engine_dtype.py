"""The inference engine in fp32 against bf16 (``rollout.engine.dtype``), side by side.

The same ``HFEngine``, model, prompts and sampling in one process, one torch thread (what a
RaaS node's engine process gets on the main example's 2-core machine): each repetition decodes
a trainer batch of the main example (16 math prompts x 8 samples, 5 new tokens, one batch of
128) in fp32 and then in bf16, so that load drifts hit both alike. The model is the main
example's when it has been built (``runs/models/math-mini-llama``), else a fresh ``mini``
model of the same architecture (the speed does not depend on what the weights learned).

bf16 pays off where the hardware computes in bf16 natively (recent GPUs; CPUs with AVX512-BF16
or AMX, as on the project's reference machine); elsewhere torch emulates it and it is slower.

    python benchmarks/engine_dtype.py [--reps 5] [--model DIR] [--threads 1]

Prints a table and ends with ``RESULT {json}`` (``bf16_speedup``: median fp32 / bf16 time).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_checks import at_least  # noqa: E402

MAIN_MODEL = ROOT / "runs" / "models" / "math-mini-llama"


def _prompts(tokenizer, n_prompts: int, group: int) -> list[list[int]]:
    from astraflow.workloads.base import make_workload

    wl = make_workload("math", {"digits": 2}, 0)
    out = []
    for task in wl.tasks("train")[:n_prompts]:  # tokenized as the single_turn workflow does
        out += [tokenizer.encode(wl.render_prompt(task))] * group
    return out


def _batch_seconds(engine, prompts: list[list[int]], max_new: int) -> float:
    from astraflow.rollout.engine import SamplingParams

    params = SamplingParams(max_new_tokens=max_new)

    async def go():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    t0 = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=at_least(1), default=5, help="timed batches per dtype (after one warm-up each)")
    p.add_argument("--model", default=None, help="an HF model directory (default: the main example's, or a fresh mini)")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads (a RaaS engine process uses 1)")
    p.add_argument("--prompts", type=at_least(1), default=16)
    p.add_argument("--group", type=at_least(1), default=8)
    p.add_argument("--max-new-tokens", type=at_least(1), default=5)
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error("--reps must be >= 1")

    import torch
    from rich.console import Console
    from rich.table import Table

    from astraflow.models import init_model
    from astraflow.rollout.hf_engine import HFEngine

    torch.set_num_threads(a.threads)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else MAIN_MODEL
        label = a.model or "main example (runs/models/math-mini-llama)"
        if not (model / "config.json").exists():
            if a.model:
                raise SystemExit(f"--model {a.model}: no HF model directory there (config.json missing)")
            console.print(f"{MAIN_MODEL} not built yet: timing a fresh mini Llama model instead")
            model = init_model(Path(tmp) / "mini", preset="mini", arch="llama", seed=0)
            label = "fresh mini Llama"
        engines = {d: HFEngine(str(model), max_batch_size=a.prompts * a.group, device="cpu", dtype=d)
                   for d in ("fp32", "bf16")}
        prompts = _prompts(engines["fp32"].tokenizer, a.prompts, a.group)
        times: dict[str, list[float]] = {d: [] for d in engines}
        for d, eng in engines.items():
            _batch_seconds(eng, prompts, a.max_new_tokens)  # warm-up
        for i in range(a.reps):
            for d, eng in engines.items():
                times[d].append(_batch_seconds(eng, prompts, a.max_new_tokens))
            console.print(f"rep {i + 1}/{a.reps}: fp32 {times['fp32'][-1] * 1e3:.0f} ms, bf16 {times['bf16'][-1] * 1e3:.0f} ms")

    med = {d: statistics.median(t) for d, t in times.items()}
    rows = len(prompts)
    table = Table(title=f"one batch of {rows} sequences x {a.max_new_tokens} new tokens, {a.threads} thread(s)")
    for c in ("dtype", "median ms / batch", "sequences / s", "vs fp32"):
        table.add_column(c, justify="right")
    for d in engines:
        table.add_row(d, f"{med[d] * 1e3:.0f}", f"{rows / med[d]:.0f}", f"{med['fp32'] / med[d]:.2f}x")
    console.print(table)
    result = {
        "bf16_speedup": round(med["fp32"] / med["bf16"], 3),
        "fp32_ms_per_batch": round(med["fp32"] * 1e3, 1),
        "bf16_ms_per_batch": round(med["bf16"] * 1e3, 1),
        "rows": rows, "max_new_tokens": a.max_new_tokens, "threads": a.threads, "reps": a.reps,
        "model": label,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
