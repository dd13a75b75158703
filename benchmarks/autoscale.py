"""The autoscaler against fixed rollout pools, on simulated nodes (no model, local workers).

One scenario, `examples/sim/autoscale.yaml`: a sim trainer that starts slow, speeds up (it then
needs more rollout than one worker makes) and slows down again. It runs three times through the
real CLI, side by side:

* ``fixed-min``: one rollout worker throughout (the autoscaler off);
* ``fixed-max``: the maximum, ``--max-nodes`` workers throughout (the autoscaler off);
* ``autoscaled``: starts at one, the autoscaler moves it within ``[1, --max-nodes]``.

Reported per run: wall seconds of the run (start to summary), rollout worker-seconds (the
rollout capacity paid for: each RaaS node's lifetime, from its heartbeat counters), trainer
wait fraction over the run, sequences generated per sequence trained, and the autoscaler's
changes. The ratios compare autoscaled with the two fixed pools: it should cost fewer worker
seconds than ``fixed-max`` and finish sooner than ``fixed-min``.

    python benchmarks/autoscale.py [--max-nodes 2] [--steps 14] [--slow-step 3.0] [--window 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_checks import above, at_least  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def config(kind: str, args: argparse.Namespace, out: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples/sim/autoscale.yaml").read_text())
    data["run"].update(max_steps=args.steps, timeout_s=600)
    data["policies"][0]["trainer"]["sim_step_schedule"] = {2: 0.05, args.steps // 2 + 1: args.slow_step}
    data["autoscale"].update(window_s=args.window, enabled=kind == "autoscaled")
    data["autoscale"].pop("memory_s", None)  # the default memory (the example shortens it for its demo)
    rollout = data["partitions"][2]
    rollout["nodes"] = args.max_nodes if kind == "fixed-max" else 1
    rollout["autoscale"] = {"min_nodes": 1, "max_nodes": args.max_nodes, "cooldown_s": 2}
    path = out / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(kind: str, args: argparse.Namespace, tmp: Path) -> dict:
    run_dir = tmp / kind
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(config(kind, args, tmp)), "--run-dir",
                           str(run_dir), "--quiet"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{kind}: exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    dl = summary["data_layer"]
    # a node's lifetime: its heartbeats carry lifetime tokens and tokens/s
    node_s = sum(n["tokens"] / n["generated_tokens_per_s"] for n in dl["nodes"].values()
                 if n.get("tokens") and n.get("generated_tokens_per_s"))
    trainer = next(iter(summary["trainers"].values()))
    log = run_dir / "control" / "autoscale.jsonl"
    changes = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    consumed = sum(c.get("consumed", 0) for c in dl["counts"].values())
    return {"kind": kind, "run_s": summary["seconds"], "wall_s": wall, "worker_s": node_s,
            "trainer_wait": trainer["wait_fraction"],
            "generated_per_trained": dl["sequences_generated"] / max(consumed, 1),
            "changes": " ".join(f"{c['action']}@{c['t'] - changes[0]['t']:.0f}s" for c in changes) or "-"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-nodes", type=at_least(1), default=2, help="the pool's maximum (fixed-max runs with it)")
    ap.add_argument("--steps", type=at_least(4), default=14, help="trainer steps; the slow phase is the second half")
    ap.add_argument("--slow-step", type=above(0), default=3.0, help="seconds a step takes in the slow phase")
    ap.add_argument("--window", type=above(0), default=3.0, help="autoscale.window_s")
    args = ap.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="af-autoscale-") as d:
        rows = [run(kind, args, Path(d)) for kind in ("fixed-min", "fixed-max", "autoscaled")]
    table = Table(title=f"autoscale vs fixed pools (load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    for col in ("run", "run s", "rollout worker-s", "trainer wait", "generated/trained", "changes"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["kind"], f"{r['run_s']:.1f}", f"{r['worker_s']:.1f}", f"{r['trainer_wait']:.0%}",
                      f"{r['generated_per_trained']:.2f}", r["changes"])
    Console().print(table)
    by = {r["kind"]: r for r in rows}
    auto = by["autoscaled"]
    result = {
        "worker_s_vs_fixed_max": auto["worker_s"] / by["fixed-max"]["worker_s"],
        "run_s_vs_fixed_min": auto["run_s"] / by["fixed-min"]["run_s"],
        "run_s_vs_fixed_max": auto["run_s"] / by["fixed-max"]["run_s"],
        "changes": auto["changes"], "load_1m": load[0],
        "args": vars(args),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
