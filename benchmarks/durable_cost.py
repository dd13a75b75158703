"""What the data layer's durable state costs the main example.

The data layer writes a snapshot of its state before every call that changed it answers (calls
that arrive together share one write; ``astraflow/dataflow/durable.py``). This runs the main
example (``examples/math/config.yaml``, embedded default) with ``dataflow.durable`` on (the
default) and off, alternating which goes first, and reports per run the trainer's steps per
second between the first and the last step, episodes per second, the held-out accuracy at the
end, and, for the durable runs, how many snapshots were written, for how many calls, their
total write time and the size of the last one. The last line is ``RESULT {json}`` with the mean
steps/s of durable over not durable.

Run from the repository root: ``python benchmarks/durable_cost.py [--steps 200] [--repeats 1]``.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=at_least(2), default=200, help="trainer steps per run (its pace needs two)")
    ap.add_argument("--repeats", type=at_least(1), default=1, help="on/off pairs, alternating which goes first")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the run directories here (default: a temporary directory, removed at the end)")
    args = ap.parse_args()

    rows, t0 = [], time.time()
    with work_directory(args.workdir, "astraflow-durable-") as work:
        for repeat in range(args.repeats):
            for durable in ((True, False) if repeat % 2 == 0 else (False, True)):
                row = run_main_example(work / f"{'on' if durable else 'off'}-{repeat}", {"dataflow.durable": durable},
                                       args.steps, repeat)
                snaps = row.pop("summary")["data_layer"].get("snapshots") or {}
                rows.append({"durable": durable, "repeat": repeat, **row, **{f"snap_{k}": v for k, v in snaps.items()}})
                print(f"[{time.time() - t0:6.0f}s] durable {'on ' if durable else 'off'} "
                      f"{row['steps_per_s']:.2f} steps/s  {row['episodes_per_s']:.1f} episodes/s  "
                      f"acc {row['acc_after']:.3f}", flush=True)

    print()
    print(f"{'durable':<8} {'repeat':>6} {'steps':>6} {'steps/s':>8} {'episodes/s':>10} {'held-out':>8} "
          f"{'snapshots':>9} {'calls':>7} {'write s':>8} {'KiB':>6}")
    for r in rows:
        print(f"{'on' if r['durable'] else 'off':<8} {r['repeat']:>6} {r['steps']:>6} {r['steps_per_s']:>8.2f} "
              f"{r['episodes_per_s']:>10.1f} {r['acc_after']:>8.3f} {r.get('snap_writes', 0):>9} "
              f"{r.get('snap_commits', 0):>7} {r.get('snap_write_s', 0.0):>8.2f} {r.get('snap_last_bytes', 0) / 1024:>6.1f}")

    def mean(durable: bool, key: str) -> float:
        vals = [r.get(key, 0) for r in rows if r["durable"] == durable]
        return sum(vals) / len(vals)

    print("RESULT " + json.dumps({
        "steps_per_s_ratio_durable_vs_not": round(mean(True, "steps_per_s") / mean(False, "steps_per_s"), 3),
        "episodes_per_s_ratio_durable_vs_not": round(mean(True, "episodes_per_s") / mean(False, "episodes_per_s"), 3),
        "durable_steps_per_s": round(mean(True, "steps_per_s"), 3), "plain_steps_per_s": round(mean(False, "steps_per_s"), 3),
        # per step actually taken (a run's last step line), not per step asked for
        "snapshots_per_step": round(mean(True, "snap_writes") / max(mean(True, "steps"), 1), 1),
        "calls_per_snapshot": round(mean(True, "snap_commits") / max(mean(True, "snap_writes"), 1), 2),
        "steps": args.steps, "repeats": args.repeats,
    }))


if __name__ == "__main__":
    main()
