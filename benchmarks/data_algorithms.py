"""Data algorithms side by side, through the real run path, at the same budget of trainer steps.

Why: the data layer's claim is that data algorithms compose without touching trainers, RaaS
nodes or orchestration; this benchmark shows what each costs and buys on one system. Every
variant is a ``dataflow`` section of the same config, run with ``astraflow.runtime.launch``
(the code path of ``astraflow run``) from the same warm-started tiny model (a supervised warm
start of a fixed number of steps, ``astraflow.training.warmstart``, the function
``build_model`` calls):

* ``vanilla``: keep every group (FIFO, accept all prompts);
* ``dynamic sampling``: ``drop_zero_advantage`` (groups whose rewards are all equal are
  dropped and replaced by new rollouts, so batches stay full);
* ``dynamic sampling + replay 0.25 / 0.5``: a fraction of each batch is recently consumed
  samples (``dataflow.replay_ratio``);
* ``dynamic sampling + greso``: the GRESO-style curator skips prompts whose groups keep
  having zero reward variance *before* rolling them out;
* ``fifo`` vs ``edf`` under a tight staleness bound (``max_staleness: 1``, a deep prefetch so
  that the buffer holds groups of several versions).

Reported per variant: training rollouts generated (sequences), rollouts per consumed
sequence, held-out accuracy (greedy exact match) before and after, stale-dropped sequences and
wall time. The last line is ``RESULT {json}`` with ratios to vanilla.

Run from the repository root: ``python benchmarks/data_algorithms.py [--steps N]``. About
10-15 minutes on 2 shared CPU cores (each run starts its own local Dask cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.run_checks import at_least  # noqa: E402

#: the warm start sees every training problem; RL cycles over a fixed subset of them, so that
#: prompts come back (several epochs in a run) and a curator has a history to act on.
WARM = {"digits": 1, "ops": ["+", "-"], "test_fraction": 0.25, "num_test": 50}
WORKLOAD = {**WARM, "num_train": 48}
#: the main comparison bounds staleness loosely, so that the rollouts generated measure the
#: data algorithms rather than the rollout-ahead bound; EDF vs FIFO uses a tight bound.
LOOSE = {"max_staleness": 4}
DS = {**LOOSE, "group_filter": {"type": "drop_zero_advantage"}}
VARIANTS: list[tuple[str, dict]] = [
    ("vanilla", LOOSE),
    ("dynamic_sampling", DS),
    ("ds+replay0.25", {**DS, "replay_ratio": 0.25}),
    ("ds+replay0.5", {**DS, "replay_ratio": 0.5}),
    ("ds+greso", {**DS, "curator": {"type": "greso", "params": {"floor": 0.1, "target_skip": 0.5}}}),
    ("fifo_stale1", {"ordering": {"type": "fifo"}, "max_staleness": 1, "prefetch_groups": 8}),
    ("edf_stale1", {"ordering": {"type": "edf"}, "max_staleness": 1, "prefetch_groups": 8}),
]


def make_config(model: Path, name: str, dataflow: dict, steps: int, seed: int, lr: float):
    from astraflow.config import config_from_dict

    return config_from_dict({
        "run": {"name": name, "max_steps": steps, "seed": seed, "timeout_s": 600},
        "policies": [{"name": "solver", "model": str(model), "trainer": {"lr": lr, "batch_timeout_s": 180}}],
        "workload": {
            "name": "math", "params": WORKLOAD, "group_size": 8,
            "sampling": {"max_new_tokens": 4},
            "eval": {"every": steps, "num_prompts": 50},
        },
        "dataflow": {"batch_size": 32, "lease_seconds": 30, "prefetch_groups": 4, **dataflow},
        "rollout": {"capacity": 32},
        "cluster": {"dashboard_port": 0},
    })


def last_step_line(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "accepted" in x]
    return steps[-1] if steps else {}


def run_variant(model: Path, work: Path, name: str, dataflow: dict, steps: int, seed: int, lr: float) -> dict:
    from astraflow.runtime.launch import launch
    from benchmarks.run_checks import require_completed

    run_dir = work / name
    t0 = time.perf_counter()
    result = launch(make_config(model, name, dataflow, steps, seed, lr), run_dir, quiet=True)
    wall = time.perf_counter() - t0
    require_completed(result, run_dir, steps, f"variant {name}")
    last = last_step_line(run_dir)
    evals = sorted(result.eval, key=lambda e: e["step"])
    return {
        "variant": name,
        "steps": result.steps.get("solver", 0),
        "rollouts": last.get("rollouts_generated", 0),
        "consumed": last.get("consumed", 0),
        "rollouts_per_consumed": last.get("rollouts_per_consumed", 0.0),
        "filtered": last.get("filtered", 0),
        "curator_skipped": last.get("curator_skipped", 0),
        "replayed": last.get("replayed", 0),
        "stale_dropped": last.get("stale_dropped", 0),
        "staleness_hist": last.get("staleness_hist", {}),
        "acc_before": evals[0]["eval_accuracy"] if evals else float("nan"),
        "acc_after": evals[-1]["eval_accuracy"] if evals else float("nan"),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=40, help="trainer steps per variant (the same budget)")
    ap.add_argument("--warm-start-steps", type=at_least(0), default=220, help="steps of supervised warm start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4, help="trainer learning rate")
    names = [n for n, _ in VARIANTS]
    ap.add_argument("--only", nargs="+", choices=names, metavar="VARIANT",
                    help=f"variants to run (default: all): {', '.join(names)}; vanilla, the baseline of the "
                         "ratios, always runs")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args()
    if args.only and "vanilla" not in args.only:
        args.only.append("vanilla")  # the ratios are to vanilla: without it RESULT would have none

    from rich.console import Console
    from rich.table import Table

    from astraflow.models import init_model
    from astraflow.training.warmstart import warm_start

    console = Console(width=160)
    work = Path(tempfile.mkdtemp(prefix="astraflow-data-algos-"))
    try:
        t0 = time.perf_counter()
        # a warm start by a fixed number of steps (not seconds) gives the same model on a busy machine
        init_model(work / "init", preset="tiny", arch="qwen2", seed=args.seed)
        ws = warm_start(work / "init", work / "model", steps=args.warm_start_steps, workload=WARM,
                        seed=args.seed, progress=False)
        model = work / "model"
        console.print(f"warm start: {ws['steps']} steps in {time.perf_counter() - t0:.0f}s, held-out accuracy "
                      f"{ws['acc']:.3f}; {args.steps} trainer steps per variant")
        rows = []
        for name, df in VARIANTS:
            if args.only and name not in args.only:
                continue
            row = run_variant(model, work, name, df, args.steps, args.seed, args.lr)
            rows.append(row)
            console.print(f"  {name}: {json.dumps({k: row[k] for k in ('rollouts', 'acc_after', 'wall_s')}, default=float)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.print(f"runs kept in {work}")

    table = Table(title=f"Data algorithms at {args.steps} trainer steps (tiny model, 1-digit +/-)")
    for col in ("variant", "rollouts", "rollouts/consumed", "filtered", "skipped", "replayed",
                "stale dropped", "acc before", "acc after", "wall s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], str(r["rollouts"]), f"{r['rollouts_per_consumed']:.2f}", str(r["filtered"]),
                      str(r["curator_skipped"]), str(r["replayed"]), str(r["stale_dropped"]),
                      f"{r['acc_before']:.3f}", f"{r['acc_after']:.3f}", f"{r['wall_s']:.0f}")
    console.print(table)

    by = {r["variant"]: r for r in rows}
    base = by.get("vanilla")
    ratios = {}
    if base:
        for r in rows:
            ratios[r["variant"]] = {
                "rollouts_vs_vanilla": r["rollouts"] / max(base["rollouts"], 1),
                "acc_gain_vs_vanilla": r["acc_after"] - base["acc_after"],
                "wall_vs_vanilla": r["wall_s"] / max(base["wall_s"], 1e-9),
            }
    edf_vs_fifo = None
    if "edf_stale1" in by and "fifo_stale1" in by:
        e, f = by["edf_stale1"], by["fifo_stale1"]
        edf_vs_fifo = {"edf_acc": e["acc_after"], "fifo_acc": f["acc_after"],
                       "edf_stale_dropped": e["stale_dropped"], "fifo_stale_dropped": f["stale_dropped"],
                       "acc_diff": e["acc_after"] - f["acc_after"]}
    print("RESULT " + json.dumps({"steps": args.steps, "variants": rows, "ratios": ratios,
                                  "edf_vs_fifo": edf_vs_fifo}, default=float))


if __name__ == "__main__":
    main()
