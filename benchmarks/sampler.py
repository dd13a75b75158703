"""The HF engine's token sampler: each request's own seeded stream (``HFEngine._sample``, inverse
CDF at a counter-based uniform) against ``torch.multinomial`` with one generator for the batch
(the baseline: what the engine did before, and what makes tokens depend on the batch).

    python benchmarks/sampler.py [--repeats 50]

One torch thread, as the engine process runs; batch sizes and vocabularies of the tiny models and
of real ones. Ends with ``RESULT {json}``: the per-request sampler's time over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed one

import numpy as np  # noqa: E402
import torch  # noqa: E402

from astraflow.rollout.hf_engine import HFEngine  # noqa: E402
from astraflow.rollout.seeds import uniforms  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402

SHAPES = [(64, 512), (128, 4096), (64, 32_000), (16, 151_936)]
#: top-p 1 (the examples' setting) and 0.95 (both samplers then sort the distribution first)
TOP_PS = (1.0, 0.95)


def _time(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=at_least(1), default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows, ratios = [], {}
    for (batch, vocab), p in ((shape, p) for p in TOP_PS for shape in SHAPES):
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
        temps, top_p, greedy = torch.ones(batch), torch.full((batch,), p), torch.zeros(batch, dtype=torch.bool)
        gen = torch.Generator().manual_seed(0)
        seeds = np.arange(batch, dtype=np.uint64)
        step = np.zeros(batch, dtype=np.uint64)

        def baseline():
            probs = torch.softmax(logits / temps[:, None], dim=-1)
            if p < 1.0:
                sp, si = probs.sort(dim=-1, descending=True)
                sp = sp * ((sp.cumsum(-1) - sp) < top_p[:, None])
                probs = torch.zeros_like(probs).scatter(-1, si, sp)
            return torch.multinomial(probs, 1, generator=gen)[:, 0]

        def per_request():
            return HFEngine._sample(None, logits, temps, greedy, top_p, uniforms(seeds, step))

        old, new = _time(baseline, args.repeats), _time(per_request, args.repeats)
        rows.append((batch, vocab, p, old * 1e3, new * 1e3, new / old))
        ratios[f"{batch}x{vocab}@top_p={p:g}"] = round(new / old, 3)
    print(f"{'batch':>6} {'vocab':>8} {'top_p':>6} {'multinomial ms':>15} {'per-request ms':>15} {'ratio':>6}")
    for batch, vocab, p, old, new, ratio in rows:
        print(f"{batch:>6} {vocab:>8} {p:>6g} {old:>15.3f} {new:>15.3f} {ratio:>6.2f}")
    print("RESULT " + json.dumps({"time_ratio_per_request_vs_multinomial": ratios,
                                  "max_ratio": max(ratios.values())}))


if __name__ == "__main__":
    main()
