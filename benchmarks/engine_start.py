"""How long a RaaS node takes to start its engines when it runs several (replicas of a policy,
one per GPU on a GPU node; or several policies), each in a process of its own.

Side by side in one run, alternating, on the same model and the same replica plans:

* **one_by_one** (baseline): each engine process is waited for (its model loaded) before the
  next is started, as a node started them before;
* **side_by_side**: ``engines.make_engines``, what a node does now: every engine process is
  started, then each is waited for.

On the CPU the engine processes share the machine's cores (their imports and model loads are
CPU work), so the gain here is bounded by the cores; on a GPU node each replica loads onto
its own GPU.

    python benchmarks/engine_start.py [--replicas 2] [--rounds 3] [--preset tiny]

Ends with ``RESULT {json}``: median start seconds of both and ``start_ratio`` (side_by_side
over one_by_one; below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def one_by_one(model_dir: str, replicas: int) -> float:
    """Seconds until ``replicas`` engine processes serve, each started once the one before loaded."""
    from astraflow.rollout.process_engine import ProcessEngine

    t0 = time.perf_counter()
    engines = []
    try:
        for i in range(replicas):
            engines.append(ProcessEngine(model_dir, max_batch_size=8, seed=i, device="cpu", threads=1))
        return time.perf_counter() - t0
    finally:
        for engine in engines:
            engine.close()


def side_by_side(model_dir: str, replicas: int) -> float:
    """Seconds until a node's ``replicas`` engine processes serve, as ``make_engines`` starts them."""
    from astraflow.rollout.config import EngineConfig
    from astraflow.rollout.engine_pool import replicas_of
    from astraflow.rollout.engines import make_engines

    t0 = time.perf_counter()
    engines = make_engines(EngineConfig(device="cpu", replicas=replicas, threads=replicas, max_batch=8),
                           {"policy": model_dir})
    seconds = time.perf_counter() - t0
    for engine in replicas_of(engines["policy"]):
        engine.close()
    return seconds


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2, help="engine processes a node starts")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both (medians reported)")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="model size preset")
    args = ap.parse_args(argv)
    if args.replicas < 1 or args.rounds < 1:
        ap.error("--replicas and --rounds must be at least 1")

    from rich.console import Console
    from rich.table import Table

    from astraflow.models import init_model

    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine-start-", dir=ROOT / "benchmarks" / "out"))
    times: dict[str, list[float]] = {"one_by_one": [], "side_by_side": []}
    try:  # the scratch model goes on a failure or Ctrl-C too
        model_dir = str(init_model(work / "model", preset=args.preset, seed=0))
        ways = {"one_by_one": one_by_one, "side_by_side": side_by_side}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                times[name].append(ways[name](model_dir, args.replicas))
            print(f"round {r + 1}/{args.rounds}: one by one {times['one_by_one'][-1]:.1f} s, "
                  f"side by side {times['side_by_side'][-1]:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"a node starting {args.replicas} engine processes ({args.preset} model, CPU)")
    for col in ("round", "one by one (s)", "side by side (s)", "ratio"):
        table.add_column(col, justify="right")
    for r, (a, b) in enumerate(zip(times["one_by_one"], times["side_by_side"])):
        table.add_row(str(r + 1), f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}")
    Console().print(table)
    base, new = statistics.median(times["one_by_one"]), statistics.median(times["side_by_side"])
    result = {"replicas": args.replicas, "one_by_one_s": round(base, 2), "side_by_side_s": round(new, 2),
              "start_ratio": round(new / base, 3)}
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
