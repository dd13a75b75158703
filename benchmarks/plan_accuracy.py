"""``astraflow plan`` against a real run: the main example's steps/s and trainer wait fraction,
measured and predicted.

Why: a capacity plan is only worth what its simulation predicts. Side by side in one run:

* **measured**: the main example (``examples/math/config.yaml``) run for real for ``--steps``
  trainer steps (no held-out evaluation), through ``astraflow run``;
* **predicted**: the same config planned on a ``local`` pool of one node — this machine's engine
  and trainer calibrated on the config's model (``astraflow plan --calibrate``, just before the
  real run) — simulated for as many steps at ``--time-scale``.

Both are measured by the same code (``astraflow.plan.simulate.measure``: the steady part of the
run, the first steps left out). The local pool is calibrated again after the real run: on a
shared machine the load moves between the two, and the calibrated step before and after, with
the real run's own step (its period less its wait, from its records), shows how much of the
error is the load's drift rather than the simulation. Printed: both, and the relative errors; the last line is
``RESULT {json}`` with ``steps_per_s_error`` and ``trainer_wait_error`` (|predicted - measured| /
measured) and the numbers themselves.

Run from the repository root: ``python benchmarks/plan_accuracy.py [--steps 120] [--pairs 1]
[--time-scale 1] [--set KEY=VALUE ...]``; ``--set`` moves the operating point for both sides (e.g. a
smaller engine batch, so that the trainer waits on rollouts for a real share of its time);
``--pairs N`` repeats the whole comparison and reports the median errors (a single reading moves
with the machine's load between its calibration and its real run); the RESULT's ``measured``,
``predicted`` and ``step_s`` are the last pair's, ``each`` every pair's errors.
The main example's model (``runs/models/math-mini-llama``) is built first if it is missing, as
``astraflow run`` builds it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.run_checks import above, at_least  # noqa: E402

CONFIG = ROOT / "examples" / "math" / "config.yaml"


def real_run(work: Path, steps: int, overrides: list[str]) -> dict:
    from astraflow.plan.simulate import measure

    run_dir = work / "real"
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "astraflow", "run", str(CONFIG), "--run-dir", str(run_dir), "--quiet",
                    "--set", f"run.max_steps={steps}", "--set", "workload.eval.every=0",
                    "--set", "cluster.dashboard_port=0", *overrides], cwd=ROOT, check=True, timeout=1800)
    res = measure(run_dir, {"local": 1}, 1.0)
    return {"steps_per_s": res.steps_per_s, "trainer_wait": res.trainer_wait, "staleness": res.staleness,
            "trajectories_per_s": res.trajectories_per_s, "seconds": time.time() - t0, **trainer_step(run_dir)}


def trainer_step(run_dir: Path) -> dict:
    """The real trainer's step over the steady part of its run: its period less its wait (the
    calibrated step's counterpart), its ``train_s`` and the sequences it trained (of a batch)."""
    from astraflow.plan.simulate import WARMUP_SHARE, WARMUP_STEPS

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "loss" in x]
    w = steps[min(max(WARMUP_STEPS, int(len(steps) * WARMUP_SHARE)), len(steps) - 2):]
    period = (w[-1]["time"] - w[0]["time"]) / max(len(w) - 1, 1)
    mean = lambda k: sum(x.get(k, 0.0) for x in w[1:]) / max(len(w) - 1, 1)  # noqa: E731
    return {"step_s": period - mean("wait_s"), "train_s": mean("train_s"),
            "trained_sequences": mean("trained_sequences"), "batch": mean("num_sequences")}


def calibration(overrides: list[str]):
    from astraflow.config import load_config
    from astraflow.plan.calibrate import calibrate
    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress

    cfg = load_config(CONFIG, [o for o in overrides if o != "--set"])
    prepare_models(cfg, Progress())  # a missing model built as ``astraflow run`` builds it: calibrating needs it
    return cfg, calibrate(cfg, progress=lambda s: print(f"  calibrate: {s}", flush=True))


def predicted(work: Path, steps: int, time_scale: float, cfg, cal) -> dict:
    from astraflow.plan.planner import PlanOptions, run_plan
    from astraflow.plan.pools import parse_pool

    t0 = time.time()
    report = run_plan(cfg, [parse_pool("local=1", 1, cal.engine)],
                      PlanOptions(minutes=steps * cal.step_seconds / 60, time_scale=time_scale, search=False,
                                  calibration=cal, workdir=work / "plan"),
                      progress=lambda s: print(f"  {s}", flush=True) if "step " not in s else None)
    r = report.result
    return {"steps_per_s": r.steps_per_s, "trainer_wait": r.trainer_wait, "staleness": r.staleness,
            "trajectories_per_s": r.trajectories_per_s, "seconds": time.time() - t0}


def one_pair(work: Path, steps: int, time_scale: float, overrides: list[str]) -> dict:
    """Calibrate, run for real, calibrate again, plan with the first calibration: both sides
    and the errors."""
    load = os.getloadavg()[0]
    print(f"calibrating the local pool (load {load:.2f})", flush=True)
    cfg, cal = calibration(overrides)
    load_run = os.getloadavg()[0]
    print(f"measured: the main example for {steps} steps (load {load_run:.2f})", flush=True)
    real = real_run(work, steps, overrides)
    load_real = os.getloadavg()[0]
    print(f"calibrating again after the real run (load {load_real:.2f})", flush=True)
    _, after = calibration(overrides)
    load_plan = os.getloadavg()[0]
    print(f"predicted: plan --pool local=1, the first calibration (load {load_plan:.2f})", flush=True)
    pred = predicted(work, steps, time_scale, cfg, cal)
    err = {k: abs(pred[k] - real[k]) / max(real[k], 1e-9) for k in ("steps_per_s", "trainer_wait")}
    return {"real": real, "pred": pred, "err": err, "after_step_s": after.step_seconds,
            "cal": {"step_seconds": cal.step_seconds, **cal.engine.model_dump(), "response_mean": cal.response_mean},
            "load": {"calibration": round(load, 2), "real": round(load_run, 2),
                     "calibration_after": round(load_real, 2), "plan": round(load_plan, 2)}}


def show(pair: dict) -> None:
    real, pred, err, cal = pair["real"], pair["pred"], pair["err"], pair["cal"]
    print(f"\n{'':<12}{'steps/s':>10}{'trainer wait':>14}{'trajectories/s':>16}{'staleness p50/p90/max':>24}"
          f"{'seconds':>9}")
    for name, row in (("measured", real), ("predicted", pred)):
        st = row["staleness"]
        print(f"{name:<12}{row['steps_per_s']:>10.3f}{row['trainer_wait']:>14.1%}{row['trajectories_per_s']:>16.1f}"
              f"{st['p50']:>14}/{st['p90']}/{st['max']}{row['seconds']:>12.0f}")
    print(f"{'error':<12}{err['steps_per_s']:>10.1%}{err['trainer_wait']:>14.1%}")
    print(f"calibration: {json.dumps({k: round(v, 4) for k, v in cal.items()})}")
    load = pair["load"]
    print(f"trainer step: calibrated {cal['step_seconds']:.3f} s before (load {load['calibration']:.2f}), "
          f"{pair['after_step_s']:.3f} s after (load {load['calibration_after']:.2f}); the real run's "
          f"{real['step_s']:.3f} s (period less wait; train_s {real['train_s']:.3f} s, "
          f"{real['trained_sequences']:.0f} of {real['batch']:.0f} sequences trained)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=120, help="trainer steps of each run")
    ap.add_argument("--pairs", type=int, default=1,
                    help="repetitions of calibrate, real run, plan; the errors reported are their medians")
    ap.add_argument("--time-scale", type=above(0), default=1.0, help="the plan's simulated seconds per real second")
    ap.add_argument("--model", default=None, help="the model directory (default: the config's)")
    ap.add_argument("--keep", default=None, help="keep the runs in this directory (default: a temporary one)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the real run and the plan alike (repeatable), e.g. "
                         "rollout.engine.max_batch=16 for a run whose trainer waits on rollouts")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be 1 or more")
    overrides = ["--set", f"policies.0.model={args.model}"] if args.model else []
    for item in args.sets:
        overrides += ["--set", item]
    pairs = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        for i in range(args.pairs):
            if args.pairs > 1:
                print(f"\n== pair {i + 1} of {args.pairs}", flush=True)
            pairs.append(one_pair(Path(args.keep or tmp) / f"pair-{i}", args.steps, args.time_scale, overrides))
            show(pairs[-1])
    med = {k: statistics.median(p["err"][k] for p in pairs) for k in ("steps_per_s", "trainer_wait")}
    if args.pairs > 1:
        print(f"\nmedian errors over {args.pairs} pairs: steps/s {med['steps_per_s']:.1%}, "
              f"trainer wait {med['trainer_wait']:.1%} (each: "
              + ", ".join(f"{p['err']['steps_per_s']:.1%}/{p['err']['trainer_wait']:.1%}" for p in pairs) + ")")
    last = pairs[-1]
    print("RESULT " + json.dumps({"steps_per_s_error": round(med["steps_per_s"], 4),
                                  "trainer_wait_error": round(med["trainer_wait"], 4),
                                  "pairs": args.pairs,
                                  "each": [{k: round(v, 4) for k, v in p["err"].items()} for p in pairs],
                                  "measured": {k: last["real"][k] for k in ("steps_per_s", "trainer_wait")},
                                  "predicted": {k: last["pred"][k] for k in ("steps_per_s", "trainer_wait")},
                                  "step_s": {"calibrated": round(last["cal"]["step_seconds"], 4),
                                             "calibrated_after": round(last["after_step_s"], 4),
                                             "real": round(last["real"]["step_s"], 4)},
                                  "steps": args.steps, "time_scale": args.time_scale, "overrides": args.sets,
                                  "load": last["load"]}))


if __name__ == "__main__":
    main()
