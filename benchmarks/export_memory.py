"""Peak memory of ``astraflow export`` against the size of the model it writes, before and after.

Why it exists: a user exports a trained 7B-70B model on whatever node they have, so what the
export holds at once decides whether it runs there at all. This builds a Llama of a few hundred
MB locally, publishes a committed version into a run's weight store the way the torch trainer
does (``TorchBackend.publish``), and exports it in a fresh process per case, for the baseline
(``--baseline REV``, extracted with ``git archive``; by default the last revision whose export held
the whole version and a loaded copy at once) and for the working tree, side by side. A process that
only imports what the export imports gives the floor, subtracted from each peak so the ratio is
about the weights.

    python benchmarks/export_memory.py [--hidden 768] [--layers 16] [--quick] [--baseline REV] [--out DIR]

Ends with ``RESULT {json}``: per case, peak RSS above the floor over the model's size in the
target dtype, before (the baseline) and after (working tree), and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_checks import at_least  # noqa: E402

#: (name, dtype the trainer publishes, --dtype of the export)
CASES = (("fp32->fp32", "fp32", "auto"), ("fp32->bf16", "fp32", "bf16"), ("bf16->bf16", "bf16", "auto"))

#: the child: runs one export (or, with no run directory, only the imports) and prints its peak RSS
CHILD = r"""
import resource, sys
import torch, transformers
from transformers import AutoModelForCausalLM, LlamaForCausalLM
import astraflow.model_export as mx, astraflow.model_loading
print("CODE", mx.__file__)
torch.set_num_threads(2)
if len(sys.argv) > 1:
    t0 = __import__("time").perf_counter()
    mx.export_version(sys.argv[1], sys.argv[2], dtype=sys.argv[3], say=lambda _: None)
    print("SECONDS", __import__("time").perf_counter() - t0)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print("PEAK_KB", hwm)
"""


#: the revision measured as "before": the last whose export read the whole version at once
BASELINE = "870ff998b204"


def make_model(out: Path, hidden: int, layers: int) -> tuple[Path, int]:
    """A Llama with a separate head, ``layers`` blocks of width ``hidden`` (random weights), saved
    to ``out``; and its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.models import build_tokenizer, make_config

    tok = build_tokenizer()
    config = make_config("tiny", "llama", tok, tie_word_embeddings=False)
    config.update(dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def make_run(root: Path, model_dir: Path, publish_dtype: str) -> Path:
    """A run directory whose policy ``solver`` committed version 1, trained away from ``model_dir``
    (as tests/test_model_export.py makes one)."""
    import torch
    import yaml

    from astraflow.training.torch_backend import TorchBackend
    from storage.paths import RunPaths
    from storage.weights import WeightStore

    run = root / f"run-{publish_dtype}"
    RunPaths(run).make()
    RunPaths(run).config.write_text(yaml.safe_dump({"policies": [{"name": "solver", "model": str(model_dir)}]}))
    be = TorchBackend(str(model_dir), lr=1e-3, publish_dtype=publish_dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    be.publish(WeightStore(RunPaths(run).weights), "solver", 1)
    return run


def peak_mb(code: Path, *args: str) -> tuple[float, float]:
    """Peak RSS (MB) of a fresh process running ``CHILD`` with ``code`` first on the path, and
    the export's seconds (0 for the imports alone)."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "2"}
    res = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=code, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"export under {code} failed:\n{res.stdout}\n{res.stderr}")
    found = dict(line.split() for line in res.stdout.splitlines() if line.startswith(("CODE", "PEAK_KB", "SECONDS")))
    assert Path(found["CODE"]).is_relative_to(code), f"{found['CODE']} is not the code under {code}"
    return int(found["PEAK_KB"]) / 1024, float(found.get("SECONDS", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768, help="model width (a multiple of 128)")
    ap.add_argument("--layers", type=at_least(1), default=16)
    ap.add_argument("--quick", action="store_true", help="a smaller model (8 layers of 512), fp32->bf16 only")
    ap.add_argument("--baseline", default=BASELINE, help="the git revision measured as 'before'")
    ap.add_argument("--out", type=Path, default=None, help="scratch dir (default: benchmarks/out/<tmp>)")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers = 512, 8
    if args.hidden < 128 or args.hidden % 128:
        ap.error(f"--hidden {args.hidden}: must be a multiple of 128 (64-wide heads, a KV head per two)")
    cases = CASES[1:2] if args.quick else CASES
    base = args.out or ROOT / "benchmarks" / "out"
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="export_memory-", dir=base))
    head = scratch / "head"
    head.mkdir()
    got = subprocess.run(["git", "archive", args.baseline], cwd=ROOT, capture_output=True)
    if got.returncode != 0:
        raise SystemExit(f"--baseline {args.baseline}: git cannot archive it ({got.stderr.decode().strip()}); "
                         "a shallow clone lacks it: fetch the history or name another revision")
    archive = got.stdout
    subprocess.run(["tar", "-x", "-C", str(head)], input=archive, check=True)
    codes = {"before": head, "after": ROOT}
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rows, result = [], {}
    t_start = time.perf_counter()
    try:
        model_dir, n_params = make_model(scratch / "model", args.hidden, args.layers)
        runs = {d: make_run(scratch, model_dir, d) for d in sorted({c[1] for c in cases})}
        floor = {k: peak_mb(code)[0] for k, code in codes.items()}
        for name, published, dtype in cases:
            target = published if dtype == "auto" else dtype
            model_mb = n_params * (4 if target == "fp32" else 2) / 2**20
            got = {}
            for k, code in codes.items():
                out = scratch / f"out-{name.replace('>', '')}-{k}"
                peak, secs = peak_mb(code, str(runs[published]), str(out), dtype)
                shutil.rmtree(out, ignore_errors=True)
                got[k] = (peak, secs, (peak - floor[k]) / model_mb)
            rows.append((name, model_mb, got))
            result[name] = {"model_mb": round(model_mb, 1), "before": round(got["before"][2], 2),
                            "after": round(got["after"][2], 2),
                            "after_over_before": round(got["after"][2] / got["before"][2], 3)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"astraflow export peak RSS: Llama {n_params / 1e6:.0f}M params, {args.layers} layers of "
                    f"{args.hidden}; floor (imports only) {floor['before']:.0f} MB before, "
                    f"{floor['after']:.0f} MB after")
    for c in ("case", "model MB", "before MB", "before x", "after MB", "after x", "after/before", "before s",
              "after s"):
        t.add_column(c, justify="right")
    for name, model_mb, got in rows:
        b, a = got["before"], got["after"]
        t.add_row(name, f"{model_mb:.0f}", f"{b[0]:.0f}", f"{b[2]:.2f}", f"{a[0]:.0f}", f"{a[2]:.2f}",
                  f"{a[2] / b[2]:.2f}", f"{b[1]:.1f}", f"{a[1]:.1f}")
    Console(width=120).print(t)
    print(f"MB: peak RSS; x: (peak RSS - floor) / model MB, the model's size in the target dtype; "
          f"{time.perf_counter() - t_start:.0f} s in all")
    print("RESULT " + json.dumps({"params": n_params, "floor_mb": {k: round(v) for k, v in floor.items()}, **result}))


if __name__ == "__main__":
    main()
