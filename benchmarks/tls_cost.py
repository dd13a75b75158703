"""What mutual TLS on the run's Dask traffic costs the main example.

The main example (``examples/math/config.yaml``, embedded default: local Dask workers, CPU
model) runs through ``astraflow.runtime.launch`` (the code path of ``astraflow run``) twice per
repeat: with ``cluster.tls`` on (the default) and off (plain TCP), alternating which goes first.
Reported per run: trainer steps per second between the first and the last step (model loading
and the first evaluation excluded), episodes generated per second, held-out accuracy at the end.
The last line is ``RESULT {json}`` with the mean steps/s of TLS over plain TCP.

Run from the repository root: ``python benchmarks/tls_cost.py [--steps 200] [--repeats 1]``.
The first run builds the main example's model (``runs/models/math-mini-llama``) if missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.main_example_runs import run_main_example, work_directory  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402


def run_one(work: Path, tls: bool, steps: int, repeat: int) -> dict:
    row = run_main_example(work / f"{'tls' if tls else 'tcp'}-{repeat}", {"cluster.tls.enabled": tls}, steps, repeat)
    return {"tls": tls, "repeat": repeat, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=at_least(2), default=200, help="trainer steps per run (its pace needs two)")
    ap.add_argument("--repeats", type=at_least(1), default=1, help="TLS/plain pairs, alternating which goes first")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the run directories here (default: a temporary directory, removed at the end)")
    args = ap.parse_args()

    rows, t0 = [], time.time()
    with work_directory(args.workdir, "astraflow-tls-") as work:
        for repeat in range(args.repeats):
            for tls in ((True, False) if repeat % 2 == 0 else (False, True)):
                row = run_one(work, tls, args.steps, repeat)
                rows.append(row)
                print(f"[{time.time() - t0:6.0f}s] {'TLS' if tls else 'plain TCP':<9} "
                      f"{row['steps_per_s']:.2f} steps/s  {row['episodes_per_s']:.1f} episodes/s  "
                      f"acc {row['acc_after']:.3f}  ({row['address']})", flush=True)

    print()
    print(f"{'traffic':<10} {'repeat':>6} {'steps':>6} {'steps/s':>8} {'episodes/s':>10} {'held-out':>8}")
    for r in rows:
        print(f"{'TLS' if r['tls'] else 'plain TCP':<10} {r['repeat']:>6} {r['steps']:>6} {r['steps_per_s']:>8.2f} "
              f"{r['episodes_per_s']:>10.1f} {r['acc_after']:>8.3f}")

    def mean(tls: bool, key: str) -> float:
        vals = [r[key] for r in rows if r["tls"] == tls]
        return sum(vals) / len(vals)

    print("RESULT " + json.dumps({
        "steps_per_s_ratio_tls_vs_plain": round(mean(True, "steps_per_s") / mean(False, "steps_per_s"), 3),
        "episodes_per_s_ratio_tls_vs_plain": round(mean(True, "episodes_per_s") / mean(False, "episodes_per_s"), 3),
        "tls_steps_per_s": round(mean(True, "steps_per_s"), 3), "plain_steps_per_s": round(mean(False, "steps_per_s"), 3),
        "steps": args.steps, "repeats": args.repeats,
    }))


if __name__ == "__main__":
    main()
