"""Data-parallel scaling of the Megatron trainer backend: the same batches at DP=1 and DP=2.

What runs (offline): the real ``MegatronBackend`` (``--tp`` tensor-parallel ranks per replica,
fp32, AdamW) starting from a randomly initialised HF Llama (default ~21M parameters: hidden 512,
4 layers, 8 heads / 4 KV heads, SwiGLU 1536, vocab 8192, untied). Every step is a GRPO step on
a batch of ``--batch`` random-token sequences of random length in ``[--min-len, --max-len]``
(groups of 4 with random rewards, so every row has an advantage); behaviour log-probs are the
DP=1 model's before its first step, so both configurations train on identical inputs. After
``--warmup`` untimed steps, ``--steps`` steps are timed as the trainer sees them (wall time of
``train_step``, control channel and the split included). Throughput is real (unpadded) tokens
per second; scaling efficiency is ``tokens/s at DP=2 / (2 x tokens/s at DP=1)``. As a check,
the largest weight difference between the two runs after the same steps is reported (the
replicas' summed gradients give the DP=1 step up to fp32 rounding).

Device: one GPU per rank when torch sees at least ``2 x --tp`` GPUs (NCCL), otherwise CPU
processes over gloo with ``--threads`` torch threads per rank. On a CPU the number measures how
much of a second core's worth of compute the backend turns into throughput: DP=2 uses twice the
cores of DP=1, so it reaches 1.0 only when two cores are free for it. On a machine whose cores
are shared with other work (the load average is printed), the second replica competes for a
core and the efficiency falls for that reason, not because of the backend; the model is sized
so that a step's compute dominates the gradient all-reduce over loopback.

Run from the repository root: ``python benchmarks/trainer_scaling.py``. Prints a table; the last
line is ``RESULT {json}`` with ``dp1_tokens_per_s``, ``dp2_tokens_per_s`` and ``dp2_efficiency``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.run_checks import at_least  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

GROUP = 4


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=max(256, args.max_len), rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def make_batches(args, rng: np.random.Generator) -> list[tuple[np.ndarray, list[int], np.ndarray]]:
    """Per step: right-padded tokens, row lengths, rewards (the prompt is the first 16 tokens)."""
    out = []
    for _ in range(args.warmup + args.steps):
        lengths = rng.integers(args.min_len, args.max_len + 1, args.batch).tolist()
        tokens = np.zeros((args.batch, max(lengths)), np.int64)
        for i, n in enumerate(lengths):
            tokens[i, :n] = rng.integers(0, args.vocab, n)
        out.append((tokens, lengths, rng.normal(size=args.batch)))
    return out


def grpo_batch(tokens: np.ndarray, lengths: list[int], rewards: np.ndarray, behaviour: np.ndarray, prompt: int = 16):
    from astraflow.batches import Batch, BatchItem
    from astraflow.contracts import Sequence

    items = []
    for i, n in enumerate(lengths):
        g = rewards[i - i % GROUP: i - i % GROUP + GROUP]
        gen = np.arange(n) >= prompt
        lp = np.zeros(n, np.float32)
        lp[1:] = behaviour[i, : n - 1]
        lp[~gen] = 0.0
        seq = Sequence.build(tokens[i, :n], gen, lp, np.where(gen, 0, -1), np.where(gen, 0, -1), float(rewards[i]))
        items.append(BatchItem(sequence=seq, loss_mask=gen, group_mean=float(g.mean()), group_std=float(g.std()),
                               group_size=GROUP, staleness=0, task_id=f"g{i // GROUP}/{i}"))
    return Batch(policy="p", version=0, items=tuple(items))


def run(args, hf_dir: Path, dp: int, data, behaviour: list | None):
    """Train every batch at data-parallel size ``dp``; per timed step (seconds, tokens), the
    behaviour log-probs (computed here when not given) and the final weights."""
    from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig

    with MegatronBackend(MegatronBackendConfig(
        hf_checkpoint=str(hf_dir), tp_size=args.tp, dp_size=dp, lr=1e-5, threads_per_rank=args.threads,
        start_timeout_s=600, step_timeout_s=1200,
    )) as be:
        if behaviour is None:
            behaviour = [be.logprobs(tokens) for tokens, _, _ in data]
        timed = []
        for step, ((tokens, lengths, rewards), lp) in enumerate(zip(data, behaviour)):
            batch = grpo_batch(tokens, lengths, rewards, lp)
            t0 = time.perf_counter()
            be.train_step(batch)
            if step >= args.warmup:
                timed.append((time.perf_counter() - t0, sum(lengths)))
        return timed, behaviour, be.state_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=3, help="timed steps per configuration")
    ap.add_argument("--warmup", type=at_least(0), default=1, help="untimed steps before them")
    ap.add_argument("--batch", type=at_least(1), default=16, help="sequences per batch")
    ap.add_argument("--min-len", type=at_least(1), default=64)
    ap.add_argument("--max-len", type=at_least(1), default=160)
    ap.add_argument("--hidden", type=at_least(1), default=512)
    ap.add_argument("--layers", type=at_least(1), default=4)
    ap.add_argument("--vocab", type=at_least(1), default=8192)
    ap.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel ranks per replica")
    ap.add_argument("--threads", type=at_least(1), default=1, help="torch threads per rank (CPU)")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table
    from transformers import LlamaForCausalLM

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < 2 * args.tp:
        sys.exit(f"DP=2 x TP={args.tp} needs {2 * args.tp} GPUs (one per rank) and torch sees {gpus}; "
                 "run it on a node with more GPUs, or with CUDA_VISIBLE_DEVICES= on the CPUs")
    device = f"{gpus} GPU(s), NCCL" if gpus else f"CPU, gloo, {args.threads} thread(s) per rank"
    cfg = llama_config(args)
    work = Path(tempfile.mkdtemp(prefix="astraflow-bench-scaling-"))
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        n_params = sum(v.numel() for v in model.state_dict().values())
        model.save_pretrained(work / "hf")
        del model
        data = make_batches(args, np.random.default_rng(0))
        results = {}
        behaviour = None
        for dp in (1, 2):
            timed, behaviour, weights = run(args, work / "hf", dp, data, behaviour)
            tokens, seconds = sum(t for _, t in timed), sum(s for s, _ in timed)
            results[dp] = {"ranks": dp * args.tp, "s_per_step": statistics.median(s for s, _ in timed),
                           "tokens_per_step": tokens / len(timed), "tokens_per_s": tokens / seconds, "weights": weights}
    finally:
        shutil.rmtree(work)

    w1, w2 = results[1].pop("weights"), results[2].pop("weights")
    max_diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    efficiency = results[2]["tokens_per_s"] / (2 * results[1]["tokens_per_s"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table = Table(title=f"Megatron trainer, Llama {n_params / 1e6:.1f}M params, {device}, "
                        f"{os.cpu_count()} CPU(s), load average {load:.1f}")
    for col in ("config", "ranks", "tokens/step", "s/step (median)", "tokens/s", "efficiency"):
        table.add_column(col, justify="right")
    for dp, r in results.items():
        table.add_row(f"TP={args.tp} DP={dp}", str(r["ranks"]), f"{r['tokens_per_step']:.0f}", f"{r['s_per_step']:.2f}",
                      f"{r['tokens_per_s']:.0f}", "1.00" if dp == 1 else f"{efficiency:.2f}")
    console = Console(width=140)
    console.print(table)
    console.print(f"max |weight DP=2 - weight DP=1| after {args.warmup + args.steps} steps: {max_diff:.2e}")
    result = {
        "device": "cuda" if gpus else "cpu",
        "params_m": round(n_params / 1e6, 1),
        "tp": args.tp,
        "batch": args.batch,
        "steps": args.steps,
        "cpus": os.cpu_count(),
        "load_avg": round(load, 2),
        "dp1_tokens_per_s": round(results[1]["tokens_per_s"], 1),
        "dp2_tokens_per_s": round(results[2]["tokens_per_s"], 1),
        "dp2_efficiency": round(efficiency, 3),
        "max_weight_diff": max_diff,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
