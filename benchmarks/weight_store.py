"""Weight-store publish + load time against a raw copy of the same bytes on the same disk.

Why it exists: a weight version goes through DCP (planning, metadata), a sha256 of every file,
fsyncs, a rename and a commit marker; RaaS nodes then load it back through DCP. This measures
that overhead next to the floor: the same tensor bytes written to one plain file, fsynced, and
read back into preallocated tensors (no torch.save), in the same run.

    python benchmarks/weight_store.py [--params 50e6] [--dtype fp32|bf16] [--repeat 3] [--out DIR]

Ends with ``RESULT {json}``; ``time_vs_raw`` = (publish + load) / (raw write + read), medians
over ``--repeat`` versions (goal <= 2).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_checks import above, at_least  # noqa: E402
from storage.weights import WeightStore  # noqa: E402


def make_state(params: float, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """A transformer-shaped state dict: embedding plus layers of 4 d x d and 3 d x 4d/..."""
    g = torch.Generator().manual_seed(seed)
    d, vocab = 1024, 8192
    state = {"embed.weight": torch.randn(vocab, d, generator=g, dtype=torch.float32).to(dtype)}
    layer = 0
    while sum(t.numel() for t in state.values()) < params:
        for name, shape in (("attn.qkv", (3 * d, d)), ("attn.out", (d, d)), ("mlp.fc1", (2 * d, d)),
                            ("mlp.fc2", (d, 2 * d)), ("norm", (d,))):
            state[f"layers.{layer}.{name}.weight"] = torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
        layer += 1
    return state


def raw_round_trip(state: dict[str, torch.Tensor], path: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in state.values():
            f.write(t.contiguous().view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = {k: torch.empty_like(t) for k, t in state.items()}
    with open(path, "rb") as f:
        for t in back.values():
            f.readinto(t.view(torch.uint8).numpy().data)
    read_s = time.perf_counter() - t0
    assert all(torch.equal(back[k], state[k]) for k in state)
    return write_s, read_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=above(0), default=50e6)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--repeat", type=at_least(1), default=3)
    ap.add_argument("--threads", type=at_least(1), default=1, help="DCP writer threads")
    ap.add_argument("--out", type=Path, default=None, help="scratch dir (default: benchmarks/out/<tmp>)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    base = args.out or Path(__file__).resolve().parent / "out"
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="weight_store-", dir=base))
    state = make_state(args.params, dtype, 0)
    n_params = sum(t.numel() for t in state.values())
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    rows = []
    try:
        store = WeightStore(root / "weights", keep_last=2)
        store.publish("warmup", 0, {"x": torch.zeros(4)})  # DCP's first call imports and plans
        store.load("warmup", 0)
        for v in range(args.repeat):
            t0 = time.perf_counter()
            store.publish("actor", v, state, thread_count=args.threads)
            pub = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = store.load("actor", v)
            load = time.perf_counter() - t0
            assert all(torch.equal(back[k], state[k]) for k in state)
            del back
            rw, rr = raw_round_trip(state, root / f"raw-{v}.bin")
            (root / f"raw-{v}.bin").unlink()
            rows.append((pub, load, rw, rr))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pub, load, rw, rr = (statistics.median(c) for c in zip(*rows))
    result = {
        "params": n_params, "dtype": args.dtype, "mb": round(mb, 1), "repeat": args.repeat,
        "publish_s": round(pub, 3), "load_s": round(load, 3), "raw_write_s": round(rw, 3), "raw_read_s": round(rr, 3),
        "publish_vs_raw_write": round(pub / rw, 2), "load_vs_raw_read": round(load / rr, 2),
        "time_vs_raw": round((pub + load) / (rw + rr), 3),
    }
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"weight store vs raw file: {n_params / 1e6:.1f} M params {args.dtype} ({mb:.0f} MB), "
                    f"median of {args.repeat}")
    for c in ("", "write s", "write MB/s", "read s", "read MB/s", "total s"):
        t.add_column(c, justify="right")
    t.add_row("weight store (DCP + sha256 + fsync + commit)", f"{pub:.3f}", f"{mb / pub:,.0f}", f"{load:.3f}",
              f"{mb / load:,.0f}", f"{pub + load:.3f}")
    t.add_row("raw file + fsync, readinto", f"{rw:.3f}", f"{mb / rw:,.0f}", f"{rr:.3f}", f"{mb / rr:,.0f}", f"{rw + rr:.3f}")
    Console().print(t)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
