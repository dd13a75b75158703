"""Admission by version vs the groups-ahead bound alone, on the main example's workload.

Why: every sequence that ages past ``max_staleness`` before a trainer takes it is rollout
compute paid for nothing. ``dataflow.admission: version`` starts a group only if it can still
be trained on; ``prefetch`` (the former rule) only bounds the groups ahead. Both run through
``astraflow.runtime.launch`` (the code path of ``astraflow run``) from the main example's
warm-started model, in two settings:

* ``fast``: the main example's RaaS node (256 episodes in flight, engine batches of 128):
  rollout outpaces the trainer, which is where rollouts age;
* ``slow``: a node with 32 episodes in flight and engine batches of 16: the trainer waits.

Reported per run: training rollouts generated per sequence trained, the fraction of generated
rollouts dropped as stale, trainer steps per second, held-out accuracy at the last step. The
last line is ``RESULT {json}`` with the new rule's worst stale-drop fraction and
generated-per-trained over both settings, and its steps/s relative to the old rule's (the
smaller of the two settings).

Run from the repository root: ``python benchmarks/admission.py [--steps 200] [--repeats 1]``.
The first run builds the main example's model (``runs/models/math-mini-llama``) if missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.main_example_runs import work_directory  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402

SETTINGS = {
    "fast": {"rollout.capacity": 256, "rollout.engine.max_batch": 128},
    "slow": {"rollout.capacity": 32, "rollout.engine.max_batch": 16},
}


def run_one(work: Path, setting: str, admission: str, steps: int, repeat: int) -> dict:
    from astraflow.config import load_config
    from astraflow.runtime.launch import launch
    from benchmarks.run_checks import require_completed

    overrides = {**SETTINGS[setting], "dataflow.admission": admission, "run.max_steps": steps,
                 "workload.eval.every": steps, "cluster.dashboard_port": 0, "run.seed": repeat}
    cfg = load_config(ROOT / "examples" / "math" / "config.yaml", [f"{k}={v}" for k, v in overrides.items()])
    run_dir = work / f"{setting}-{admission}-{repeat}"
    require_completed(launch(cfg, run_dir, quiet=True), run_dir, steps, f"{setting} {admission} (run {run_dir})")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step_lines = [x for x in lines if "accepted" in x]
    evals = [x for x in lines if "eval_accuracy" in x]
    last = step_lines[-1]
    # steps per second between the first and the last step (model loading and the first
    # evaluation excluded, as the trainer's own pace)
    first = step_lines[0]
    pace = (last["step"] - first["step"]) / max(last["time"] - first["time"], 1e-9)
    generated, trained = last["rollouts_generated"], last["consumed"]
    return {
        "setting": setting, "admission": admission, "repeat": repeat, "steps": last["step"],
        "generated": generated, "trained": trained, "stale_dropped": last["stale_dropped"],
        "generated_per_trained": generated / max(trained, 1),
        "stale_drop_fraction": last["stale_dropped"] / max(generated, 1),
        "steps_per_s": pace, "acc_after": evals[-1]["eval_accuracy"] if evals else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=at_least(2), default=200, help="trainer steps per run (its pace needs two)")
    ap.add_argument("--repeats", type=at_least(1), default=1, help="alternating old/new pairs per setting")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the run directories here (default: a temporary directory, removed at the end)")
    args = ap.parse_args()

    os.chdir(ROOT)  # the example's model path is relative to the repository root
    with work_directory(args.workdir, "astraflow-admission-") as work:
        rows = run_all(work, args.steps, args.repeats)
    report(rows, args.steps, args.repeats)


def run_all(work: Path, steps: int, repeats: int) -> list[dict]:
    """Every setting with both admissions, ``repeats`` times, alternating which goes first."""
    rows = []
    t0 = time.time()
    for repeat in range(repeats):
        for setting in SETTINGS:
            order = ("prefetch", "version") if repeat % 2 == 0 else ("version", "prefetch")
            for admission in order:
                row = run_one(work, setting, admission, steps, repeat)
                rows.append(row)
                print(f"[{time.time() - t0:6.0f}s] {setting:<5} {admission:<8} "
                      f"generated/trained {row['generated_per_trained']:.3f}  stale {row['stale_drop_fraction']:.3f}  "
                      f"{row['steps_per_s']:.2f} steps/s  acc {row['acc_after']:.3f}", flush=True)
    return rows


def report(rows: list[dict], steps: int, repeats: int) -> None:
    """The table of every run, then the RESULT line."""
    print()
    print(f"{'setting':<7} {'admission':<9} {'generated':>9} {'trained':>8} {'gen/trained':>11} "
          f"{'stale drop':>10} {'steps/s':>8} {'held-out':>8}")
    for r in rows:
        print(f"{r['setting']:<7} {r['admission']:<9} {r['generated']:>9} {r['trained']:>8} "
              f"{r['generated_per_trained']:>11.3f} {r['stale_drop_fraction']:>10.3f} {r['steps_per_s']:>8.2f} "
              f"{r['acc_after']:>8.3f}")

    def mean(setting: str, admission: str, key: str) -> float:
        vals = [r[key] for r in rows if r["setting"] == setting and r["admission"] == admission]
        return sum(vals) / len(vals)

    result = {
        "stale_drop_fraction": max(mean(s, "version", "stale_drop_fraction") for s in SETTINGS),
        "generated_per_trained": max(mean(s, "version", "generated_per_trained") for s in SETTINGS),
        "steps_per_s_ratio_new_vs_old": min(mean(s, "version", "steps_per_s") / mean(s, "prefetch", "steps_per_s")
                                            for s in SETTINGS),
        "old_stale_drop_fraction": max(mean(s, "prefetch", "stale_drop_fraction") for s in SETTINGS),
        "old_generated_per_trained": max(mean(s, "prefetch", "generated_per_trained") for s in SETTINGS),
        **{f"{s}_{a}_{k}": round(mean(s, a, k), 4) for s in SETTINGS for a in ("prefetch", "version")
           for k in ("stale_drop_fraction", "generated_per_trained", "steps_per_s", "acc_after")},
        "steps": steps, "repeats": repeats,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
