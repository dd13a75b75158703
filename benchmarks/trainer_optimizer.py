"""The torch trainer with its AdamW fused (``training.optim.adamw``, what the trainers use)
against torch's default AdamW (the baseline), on the main example's model and batch (the
``mini`` Llama, 16 prompts x 8 samples of 2-digit addition, one torch thread as in the
example's trainer): the optimiser's step alone and the whole training step.

    python benchmarks/trainer_optimizer.py [--steps 10] [--model DIR]

Two backends start from the same weights and take the same batches, alternating which goes
first. Ends with ``RESULT {json}``: seconds per optimiser step and per training step, fused
over the baseline, and the largest difference between the two models' weights at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from astraflow.models import init_model  # noqa: E402
from astraflow.rollout.hf_engine import HFEngine  # noqa: E402
from astraflow.training.torch_backend import TorchBackend  # noqa: E402
from astraflow.workloads.base import make_workload  # noqa: E402
from benchmarks.trainer_prefix import example_batch  # noqa: E402

KINDS = ("fused", "default")


def _optimizer_seconds(backend: TorchBackend, repeats: int) -> float:
    """Median seconds of the backend's optimiser step alone (gradients as the last step left them)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.optimizer.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per optimiser")
    ap.add_argument("--model", type=Path, help="an HF model directory (default: a fresh mini Llama)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    torch.set_num_threads(1)
    prompts, samples = 16, 8
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or init_model(Path(tmp) / "mini", preset="mini", arch="llama")
        engine = HFEngine(model, seed=0, max_batch_size=prompts * samples, device="cpu")
        workload = make_workload("math", {"digits": 2}, 0)
        problems = workload.tasks("train")
        backends = {kind: TorchBackend(str(model), lr=5e-5, device="cpu", skip_zero_advantage=False) for kind in KINDS}
        base = backends["default"]
        base.optimizer = torch.optim.AdamW(base.model.parameters(), lr=5e-5, betas=base.optimizer.defaults["betas"],
                                           weight_decay=base.optimizer.defaults["weight_decay"])
        assert backends["fused"].optimizer.defaults["fused"] and not base.optimizer.defaults["fused"]
        step_s: dict[str, list[float]] = {k: [] for k in KINDS}
        for b in range(args.steps + 1):  # the first step of each warms up
            batch = example_batch(engine, workload, problems[b * prompts:(b + 1) * prompts], samples, 5, b)
            for kind in KINDS if b % 2 else KINDS[::-1]:
                t0 = time.perf_counter()
                backends[kind].train_step(batch)
                if b:
                    step_s[kind].append(time.perf_counter() - t0)
        gap = max(float((p - q).abs().max()) for p, q in zip(backends["fused"].model.state_dict().values(),
                                                                base.model.state_dict().values()))
        opt_s = {kind: _optimizer_seconds(backends[kind], 20) for kind in KINDS}  # after the gap: it moves them
    step = {k: statistics.median(v) for k, v in step_s.items()}
    print(f"{'AdamW':>8} {'optimiser s':>12} {'train step s':>13}")
    for kind in KINDS[::-1]:
        print(f"{kind:>8} {opt_s[kind]:>12.5f} {step[kind]:>13.4f}")
    print(f"largest weight difference after {args.steps + 1} steps: {gap:.2e}")
    result = {"optimizer_seconds_fused": round(opt_s["fused"], 5),
              "optimizer_seconds_default": round(opt_s["default"], 5),
              "optimizer_ratio_fused_vs_default": round(opt_s["fused"] / opt_s["default"], 3),
              "step_seconds_fused": round(step["fused"], 4), "step_seconds_default": round(step["default"], 4),
              "step_ratio_fused_vs_default": round(step["fused"] / step["default"], 3),
              "max_weight_difference": float(f"{gap:.2e}")}
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
