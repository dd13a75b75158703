"""The chaos run: does a run survive its parts being killed, losing nothing and training
nothing twice, and what does each kill cost?

1. A baseline: a clean run of the main example (``examples/math/config.yaml``, fewer steps)
   through the real CLI in a subprocess.
2. The chaos run: the same command while a seeded killer (``chaos_killer.py``) SIGKILLs RaaS
   node workers, engine processes, the trainer's worker, the data layer's worker, and once the
   ``astraflow run`` process itself, followed by the resume a user would do (the same command
   on the same run directory); it waits for each part to come back before the next kill.
3. The audit of both run directories (``chaos_audit.py``): every task ended exactly once,
   nothing trained twice, no committed trajectory lost, steps and versions contiguous, held-out
   accuracy before and after, the run completed.

Seconds lost per kill = (chaos wall time - baseline wall time) / kills, both from the first
``astraflow run`` to the exit of the last (model loading and the resume's bring-up included).
Restart limits are raised for both runs (``cluster.trainer_restarts``,
``cluster.data_layer_restarts``, ``rollout.engine_restarts``) so that many kills fit.

Run from the repository root: ``python benchmarks/chaos.py [--kills 20] [--seed 0] [--steps 400]``.
The last line is ``RESULT {json}``; the exit code is 1 when the audit of the chaos run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.chaos_audit import audit_run  # noqa: E402
from benchmarks.chaos_killer import KINDS, CliRun, Killer  # noqa: E402
from benchmarks.run_checks import above, at_least  # noqa: E402


def overrides(steps: int, eval_every: int, restarts: int) -> list[str]:
    """The ``--set`` overrides both runs share."""
    return [f"run.max_steps={steps}", f"workload.eval.every={eval_every}", "cluster.dashboard_port=0",
            f"cluster.trainer_restarts={restarts}", f"cluster.data_layer_restarts={restarts}",
            f"rollout.engine_restarts={restarts}", "run.timeout_s=7200"]


def prepare_model(config: Path, sets: list[str]) -> None:
    """Build the config's model once, before timing anything (a first run would build it)."""
    from astraflow.config import load_config
    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress

    prepare_models(load_config(config, sets), Progress())


def finish(run: CliRun, deadline_s: float) -> int | None:
    """Wait for the run's last incarnation to exit (None: it did not within ``deadline_s``)."""
    return run.wait(max(deadline_s, 1.0))


def clean_run(config: Path, work: Path, sets: list[str], deadline_s: float) -> dict:
    run = CliRun(config, work / "baseline", sets, work / "baseline.log")
    t0 = time.time()
    run.start()
    try:
        rc = finish(run, deadline_s)
    finally:
        wall = time.time() - t0
        left = run.stop()
    return {"rc": rc, "wall_s": wall, "left": left, "audit": audit_run(work / "baseline")}


def chaos_run(config: Path, work: Path, sets: list[str], args: argparse.Namespace) -> dict:
    run = CliRun(config, work / "chaos", sets, work / "chaos.log")
    t0 = time.time()
    run.start()
    killer = Killer(run, kills=args.kills, seed=args.seed, mean_gap_s=args.mean_gap,
                    recovery_timeout_s=args.recovery_timeout, kinds=tuple(args.kinds))
    killer.t0 = t0
    try:
        kills = killer.run_all()
        # a part that did not come back: the run is most likely stuck; a short wait tells
        remaining = args.deadline - (time.time() - t0)
        rc = finish(run, remaining if all(k.recovered for k in kills) else min(remaining, 120.0))
    finally:
        wall = time.time() - t0
        left = run.stop()  # a run that did not end (a hang) is stopped here, by PID
    return {"rc": rc, "wall_s": wall, "left": left, "kills": kills, "skipped": killer.skipped,
            "unplanned": killer.unplanned_losses(),
            "orphans": killer.orphans, "incarnations": len(run.incarnations), "audit": audit_run(work / "chaos")}


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def report(base: dict, chaos: dict, args: argparse.Namespace) -> dict:
    kills = chaos["kills"]
    print()
    print(f"{'kind':<13} {'kills':>5} {'recovered':>9} {'mean s back':>11} {'max s back':>10}")
    for kind in KINDS:
        ks = [k for k in kills if k.kind == kind]
        back = [k.recovery_s for k in ks if k.recovery_s is not None]
        print(f"{kind:<13} {len(ks):>5} {sum(k.recovered for k in ks):>9} "
              f"{fmt(sum(back) / len(back) if back else None, '.1f'):>11} {fmt(max(back, default=None), '.1f'):>10}")
    print(f"{'all':<13} {len(kills):>5} {sum(k.recovered for k in kills):>9}")
    for note in chaos["skipped"] + [k.note for k in kills if k.kind == "orchestrator"]:
        print(f"  note: {note.lstrip('; ')}")
    for loss in chaos["unplanned"]:
        print(f"  a worker lost without being killed: {loss}")
    lost_per_kill = (chaos["wall_s"] - base["wall_s"]) / len(kills) if kills else None
    print()
    print(f"{'':<28} {'baseline':>10} {'chaos':>10}")
    b, c = base["audit"], chaos["audit"]
    rows = [("exit code", base["rc"], chaos["rc"], "d"), ("wall seconds", base["wall_s"], chaos["wall_s"], ".0f"),
            ("final step", b["final_step"], c["final_step"], "d"),
            ("held-out acc before", b["acc_before"], c["acc_before"], ".3f"),
            ("held-out acc after", b["acc_after"], c["acc_after"], ".3f"),
            ("tasks created", b["tasks"], c["tasks"], "d"),
            ("tasks never ended", b["never_ended"], c["never_ended"], "d"),
            ("tasks ended twice", b["ended_twice"], c["ended_twice"], "d"),
            ("duplicated trainings", b["duplicated_trainings"], c["duplicated_trainings"], "d"),
            ("lost trajectories", b["lost_trajectories"], c["lost_trajectories"], "d"),
            ("tasks stored twice", b["stored_more_than_once"], c["stored_more_than_once"], "d"),
            ("recovered metric lines", b["recovered_metric_lines"], c["recovered_metric_lines"], "d"),
            ("processes left at the end", len(base["left"]), len(chaos["left"]), "d")]
    for name, x, y, spec in rows:
        print(f"{name:<28} {fmt(x, spec):>10} {fmt(y, spec):>10}")
    for name, a in (("baseline", b), ("chaos", c)):
        print(f"{name}: outcomes {a['outcomes']}; dropped {a['dropped_by_reason']}; failed {a['failed_by_reason']}; "
              f"weights kept {a['weights_kept']}; eval steps {a['eval_steps']}")
        for p in a["problems"]:
            print(f"  {name} audit problem: {p}")
    print(f"seconds lost per kill: {fmt(lost_per_kill, '.1f')}; orphans at resume: {chaos['orphans']}")
    return {
        "kills": len(kills), "kills_requested": args.kills, "recovered": sum(k.recovered for k in kills),
        "kills_by_kind": dict(Counter(k.kind for k in kills)),
        "lost_trajectories": c["lost_trajectories"], "duplicated_trainings": c["duplicated_trainings"],
        "tasks_never_ended": c["never_ended"], "tasks_ended_twice": c["ended_twice"],
        "final_step": c["final_step"], "acc_before": c["acc_before"], "acc_after": c["acc_after"],
        "baseline_acc_after": b["acc_after"],
        "seconds_lost_per_kill": None if lost_per_kill is None else round(lost_per_kill, 1),
        "baseline_wall_s": round(base["wall_s"], 1), "chaos_wall_s": round(chaos["wall_s"], 1),
        "orphans_at_resume": chaos["orphans"]["workers"], "orphan_engines_at_resume": chaos["orphans"]["engines"],
        "processes_left": len(base["left"]) + len(chaos["left"]), "unplanned_worker_losses": len(chaos["unplanned"]),
        "audit_ok": c["ok"] and chaos["rc"] == 0, "baseline_audit_ok": b["ok"],
        "steps": args.steps, "seed": args.seed,
    }


def stop_on_signals() -> None:
    """SIGTERM (and SIGINT, ignored in a job started in the background) end the benchmark
    through its cleanup: the run it started is stopped and its processes killed by PID."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "math" / "config.yaml")
    ap.add_argument("--steps", type=at_least(1), default=400, help="run.max_steps of both runs")
    ap.add_argument("--eval-every", type=at_least(1), default=50, help="workload.eval.every of both runs")
    ap.add_argument("--kills", type=at_least(0), default=20, help="kills in the chaos run")
    ap.add_argument("--seed", type=int, default=0, help="the killer's random stream")
    ap.add_argument("--mean-gap", type=at_least(0, float), default=5.0,
                    help="mean seconds between a recovery and the next kill")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="what may be killed")
    ap.add_argument("--restarts", type=at_least(0), default=100, help="the restart limits of both runs")
    ap.add_argument("--recovery-timeout", type=above(0), default=300.0, help="seconds a killed part has to come back")
    ap.add_argument("--deadline", type=above(0), default=3600.0, help="seconds each run may take in all")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the run directories and logs here")
    args = ap.parse_args()
    stop_on_signals()

    work = (args.workdir or Path(tempfile.mkdtemp(prefix="astraflow-chaos-"))).absolute()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # the example's model path is relative to the repository root
    sets = overrides(args.steps, args.eval_every, args.restarts)
    prepare_model(args.config, sets)
    print(f"run directories and logs in {work}", flush=True)
    t0 = time.time()
    base = clean_run(args.config, work, sets, args.deadline)
    print(f"[{time.time() - t0:6.0f}s] baseline: exit {base['rc']} in {base['wall_s']:.0f}s, "
          f"audit {'ok' if base['audit']['ok'] else base['audit']['problems']}", flush=True)
    chaos = chaos_run(args.config, work, sets, args)
    print(f"[{time.time() - t0:6.0f}s] chaos: exit {chaos['rc']} in {chaos['wall_s']:.0f}s over "
          f"{chaos['incarnations']} incarnation(s), audit {'ok' if chaos['audit']['ok'] else 'FAILED'}", flush=True)
    result = report(base, chaos, args)
    print("RESULT " + json.dumps(result))
    sys.exit(0 if result["audit_ok"] else 1)


if __name__ == "__main__":
    main()
