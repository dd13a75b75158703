"""Weight sync on a ~46M-parameter Llama: full checkpoint shards vs sparse bf16 deltas.

What runs (all offline, CPU):

* trainer: the real ``MegatronBackend`` (TP=1, fp32 master weights, AdamW at ``--lr``, default
  2e-6) starting from a randomly initialised HF Llama (hidden 512, 12 layers, 8 heads / 4 KV heads,
  SwiGLU 1536, vocab 8192). Each step is a GRPO policy-gradient step on *random tokens with random
  rewards* (an RL-shaped update of realistic size, not a learning task); v0 is the start, v1..vN
  one step each, every version published as Megatron ``torch_dist`` shards + a commit marker.
* publisher side: for each new version, the bf16 view of the HF-layout weights and a sparse delta
  ``v-1 -> v`` written with ``storage.deltas.write_delta``.
* reader side (a RaaS node holding v-1 in an HF ``LlamaForCausalLM`` in bf16), commit-to-serving:
  **full** = plain-DCP read of the shards + Megatron->HF conversion + bf16 cast +
  ``model.load_state_dict``; **delta** = ``apply_delta`` on the held bf16 weights (checksums
  verified) + ``model.load_state_dict``.
* baseline for publish+load: writing and reading back the same number of bytes as one raw file.
* pure-bf16 control: the same kind of step applied directly to bf16 parameters (no fp32 master)
  on an HF model, to show how many bf16 elements an lr of this size changes without a master copy.

RESULT keys: ``delta_compression`` (median full/delta bytes), ``publish_load_vs_raw`` (median
(publish+load)/(raw write+read)), ``commit_to_serving_s_full`` / ``_delta`` (medians),
plus densities.
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


class DirStore:
    """Minimal writer half of the weight store (``staging``/``commit``), used until
    ``storage.weights.WeightStore`` is merged; same layout via ``storage.paths``."""

    def __init__(self, root: Path):
        self.root = root

    def staging(self, policy, version):
        from storage import paths

        d = paths.staging_dir(self.root, policy, version)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def commit(self, policy, version, meta):
        from astraflow.contracts import WeightVersion
        from storage import paths

        final = paths.version_dir(self.root, policy, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.staging(policy, version), final)
        manifest = paths.manifest_file(self.root, policy, version)
        manifest.write_text(json.dumps({"meta": meta}))
        paths.commit_file(self.root, policy, version).write_text("ok")
        return WeightVersion(policy=policy, version=version, manifest_path=str(manifest), committed_at=time.time())


def config(vocab=8192, hidden=512, layers=12, ffn=1536):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def random_batch(tokens, rewards, lp):
    """A GRPO batch over random tokens with random rewards; ``lp`` = behaviour log-probs [B, T-1]."""
    from astraflow.batches import Batch, BatchItem
    from astraflow.contracts import Sequence

    b, t = tokens.shape
    items = []
    for i in range(b):
        gen = np.arange(t) >= t // 4
        l = np.zeros(t, np.float32)
        l[1:] = lp[i]
        l[~gen] = 0
        seq = Sequence.build(tokens[i], gen, l, np.where(gen, 0, -1), np.where(gen, 0, -1), rewards[i])
        items.append(BatchItem(sequence=seq, loss_mask=gen, group_mean=float(rewards.mean()),
                               group_std=float(rewards.std()), group_size=b, staleness=0, task_id=str(i)))
    return Batch(policy="p", version=0, items=tuple(items))


def grpo_loss(new_logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """Used only when astraflow.training.grpo is not on this branch yet (same signature)."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    adv = advantages[:, None]
    obj = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)
    return -(obj * mask).sum() / mask.sum().clamp_min(1)


def raw_copy_s(nbytes: int, d: Path) -> float:
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    with open(d / "raw.bin", "wb") as fh:
        fh.write(buf.tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    back = np.fromfile(d / "raw.bin", dtype=np.uint8)
    dt = time.perf_counter() - t0
    assert back.nbytes == nbytes
    (d / "raw.bin").unlink()
    return dt


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def pure_bf16_density(cfg, lr, steps, rng) -> list[float]:
    """Density of changed bf16 elements per AdamW step on bf16 parameters (no fp32 master)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for _ in range(steps):
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        toks = torch.as_tensor(rng.integers(0, cfg.vocab_size, (4, 64)))
        loss = model(toks, labels=toks).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        after = model.state_dict()
        changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in before)
        out.append(changed / sum(v.numel() for v in before.values()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=3,
                    help="trainer steps: versions published after v0 (at least 1)")
    ap.add_argument("--lr", type=float, default=2e-6, help="AdamW learning rate of the fp32-master trainer")
    ap.add_argument("--batch", type=at_least(1), default=4,
                    help="sequences per step, one GRPO group with random rewards (at least 2)")
    ap.add_argument("--seq", type=at_least(1), default=64, help="tokens per sequence")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch threads")
    args = ap.parse_args()
    if args.batch < 2:  # one sequence's reward is its group's mean: no advantage, no update, an empty delta
        ap.error(f"--batch {args.batch}: a GRPO group of one has no advantage (nothing would change); use 2 or more")
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: at least one step is needed to publish a version to sync")
    torch.set_num_threads(args.threads)

    from rich.console import Console
    from rich.table import Table
    from transformers import LlamaForCausalLM

    from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig
    from astraflow.weightconv import megatron_to_hf
    from storage import paths
    from storage.deltas import apply_delta, write_delta
    from storage.checkpoint import read_checkpoint

    try:
        import astraflow.training.grpo  # noqa: F401
        loss_fn = "astraflow.training.grpo:grpo_loss"
    except ModuleNotFoundError:
        loss_fn = "benchmarks.weight_sync:grpo_loss"

    rng = np.random.default_rng(0)
    cfg = config()
    work = Path(tempfile.mkdtemp(prefix="astraflow-bench-ws-"))
    try:
        torch.manual_seed(0)
        hf_dir = work / "hf"
        LlamaForCausalLM(cfg).save_pretrained(hf_dir)
        n_params = sum(v.numel() for v in LlamaForCausalLM(cfg).state_dict().values())
        store = DirStore(work / "weights")
        rows = []
        with MegatronBackend(MegatronBackendConfig(
            hf_checkpoint=str(hf_dir), tp_size=1, lr=args.lr, loss_fn=loss_fn,
            threads_per_rank=args.threads, max_grad_norm=0.0,
        )) as be:
            # reader: holds v0 in bf16 in an HF model
            be.publish(store, "p", 0)
            reader = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
            held = {k: v.to(torch.bfloat16) for k, v in
                    megatron_to_hf(read_checkpoint(paths.version_dir(store.root, "p", 0)), cfg).items()}
            reader.load_state_dict(held, strict=True)
            for v in range(1, args.steps + 1):
                # behaviour log-probs = the trainer's own on these tokens (on-policy, ratio 1)
                tokens = rng.integers(0, cfg.vocab_size, (args.batch, args.seq))
                batch = random_batch(tokens, rng.normal(size=args.batch), be.logprobs(tokens))
                m = be.train_step(batch)
                t0 = time.perf_counter()
                be.publish(store, "p", v)
                publish_s = time.perf_counter() - t0
                vdir = paths.version_dir(store.root, "p", v)
                nbytes = dir_bytes(vdir)
                raw_s = raw_copy_s(nbytes, work)
                # reader, full: DCP read + convert + bf16 + load_state_dict
                t0 = time.perf_counter()
                sd = read_checkpoint(vdir)
                load_s = time.perf_counter() - t0
                new_bf16 = {k: x.to(torch.bfloat16) for k, x in megatron_to_hf(sd, cfg).items()}
                reader.load_state_dict(new_bf16, strict=True)
                full_serving_s = time.perf_counter() - t0
                # publisher: delta v-1 -> v on the bf16 view
                t0 = time.perf_counter()
                stats = write_delta(held, new_bf16, paths.delta_dir(store.root, "p", v - 1, v))
                delta_write_s = time.perf_counter() - t0
                # reader, delta: apply to held bf16 weights + load_state_dict
                t0 = time.perf_counter()
                applied = apply_delta(held, paths.delta_dir(store.root, "p", v - 1, v))
                reader.load_state_dict(applied, strict=True)
                delta_serving_s = time.perf_counter() - t0
                assert all(torch.equal(applied[k].view(torch.int16), new_bf16[k].view(torch.int16)) for k in applied)
                held = applied
                rows.append(dict(version=v, loss=m["loss"], step_s=m["step_s"], shard_bytes=nbytes,
                                 publish_s=publish_s, load_s=load_s, raw_s=raw_s,
                                 full_serving_s=full_serving_s, delta_write_s=delta_write_s,
                                 delta_serving_s=delta_serving_s, density=stats.density,
                                 full_bf16_bytes=stats.full_bytes, delta_bytes=stats.delta_bytes))
        bf16_density = pure_bf16_density(cfg, args.lr, 2, rng)
    finally:
        shutil.rmtree(work)

    table = Table(title=f"weight sync, Llama {n_params / 1e6:.1f}M params, lr {args.lr:g}, fp32 master (Megatron TP=1)")
    for col in ("v", "step s", "shards MB", "publish s", "DCP load s", "raw wr+rd s", "full serve s",
                "delta write s", "delta serve s", "bf16 changed", "full/delta bytes"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["version"]), f"{r['step_s']:.2f}", f"{r['shard_bytes'] / 1e6:.1f}", f"{r['publish_s']:.2f}",
                      f"{r['load_s']:.2f}", f"{r['raw_s']:.2f}", f"{r['full_serving_s']:.2f}", f"{r['delta_write_s']:.2f}",
                      f"{r['delta_serving_s']:.2f}", f"{100 * r['density']:.2f}%", f"{r['full_bf16_bytes'] / r['delta_bytes']:.1f}x")
    console = Console(width=170)
    console.print(table)
    console.print(f"pure bf16 parameters (no fp32 master), same lr: changed elements per step "
                  f"{', '.join(f'{100 * d:.3f}%' for d in bf16_density)}")
    med = statistics.median
    result = {
        "params_m": round(n_params / 1e6, 1),
        "lr": args.lr,
        "steps": args.steps,
        "delta_compression": round(med(r["full_bf16_bytes"] / r["delta_bytes"] for r in rows), 2),
        "delta_density_fp32_master": round(med(r["density"] for r in rows), 5),
        "delta_density_pure_bf16": round(med(bf16_density), 6),
        "publish_load_vs_raw": round(med((r["publish_s"] + r["load_s"]) / r["raw_s"] for r in rows), 2),
        "commit_to_serving_s_full": round(med(r["full_serving_s"] for r in rows), 3),
        "commit_to_serving_s_delta": round(med(r["delta_serving_s"] for r in rows), 3),
        "delta_write_s": round(med(r["delta_write_s"] for r in rows), 3),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
