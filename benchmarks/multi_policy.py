"""Multi-policy collaborative training against the trainer-centred baseline, side by side.

Same machine, same models, same task (2-digit addition), same number of trainer steps:

(a) solver only (``single_turn``, asynchronous);
(b) solver + verifier, ``run.mode: sync`` (one driver loop: roll out a full batch for every
    policy, train each policy in turn, push weights, repeat);
(c) solver + verifier, AstraFlow's asynchronous mode (each policy advances on its own, bounded
    by ``max_staleness``).

Per-iteration time: (b) the median ``iteration_s`` of ``summary.json``; (a) and (c) the wall
time of the steady-state training phase (from the moment every policy had trained version
max_steps/2 to the moment every policy had trained its last, from ``metrics.jsonl``) divided by
the iterations in it: the first steps of an asynchronous run consume batches rolled out ahead
during start-up and would flatter it. The table also shows the all-steps figures (first to
last step line; for (b) the mean ``iteration_s``) and RESULT carries their ratio as
``speedup_all_steps``. Held-out accuracy: one greedy evaluation at the end
(``eval.every = max_steps``; the data layer also evaluates v0 before training), counting the
episode ``score`` = final-answer correctness. The ideal overlap speedup is computed from (b)'s
measured rollout R, training T and sync/idle S: median over iterations of
``(R + T + S) / max(R, T)``; ``fraction_of_ideal`` is (b)/(c) divided by it.

The ideal assumes that rollout and training, overlapped, cost no more than the longer of the
two. On a machine where (b)'s rollout phase alone keeps more than one core busy that is not
reachable: the benchmark also measures the CPU seconds an iteration costs (every process of the
run together, ``CpuSampler``) and reports the ideal with ``CPU seconds / cores`` as a further
floor under an iteration's time (``cpu_bound_ideal_speedup``, ``fraction_of_cpu_bound_ideal``),
next to, not instead of, the ideal above.

``--repeats`` (default 3) runs (a), (b) and (c) that many times, interleaved (a b c, then
c b a, ...), each repeat with its own seed: this machine's speed drifts by 10-30 % within
minutes, and one (b) and one (c) run minutes apart measured the drift as much as the overlap
(single pairs gave 0.82-1.12 of the ideal on the same code). Speedups and fractions are taken
within each repeat, RESULT carries their medians (and every repeat under ``per_repeat``);
accuracies are means over the repeats (one 200-prompt evaluation is +-0.03).

The models are built once and copied read-only into every run: the solver (tiny preset) by a
short supervised warm start (``--solver-steps``; its best evaluation is kept, 0.1-0.2 held-out accuracy
depending on the CPU's kernels), the verifier from
the solver's model (``init.start_from``: one base model for both roles) by a warm start on its
own role (``task: verify``, ``"12+34=47?"`` -> ``"46N"``) stopped at ``--verifier-target``
held-out verdict accuracy. Learning to verify teaches the verifier the sum as well, so it ends
a better solver than the solver: that is the regime in which a verifier can help (a verifier
built from the same base that is no better than the solver shares its mistakes and accepts
them, see the README).

    python benchmarks/multi_policy.py [--steps 16] [--batch 64] [--solver-target 0.3] [--verifier-target 0.9] [--max-staleness 4]
        [--rollout-nodes 1] [--repeats 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from astraflow.config import config_from_dict  # noqa: E402

from astraflow.training.config import ModelInit  # noqa: E402

from astraflow.workloads.config import WorkloadConfig  # noqa: E402
from astraflow.runtime.launch import launch  # noqa: E402
from astraflow.runtime.model_build import build_model  # noqa: E402
from benchmarks.run_checks import at_least, require_completed  # noqa: E402


def make_config(args, workdir: Path, models: dict[str, Path], mode: str, two: bool, seed: int = 0) -> dict:
    policies = [{"name": "solver", "model": str(models["solver"]), "trainer": {"lr": args.lr, "threads": 1}}]
    if two:
        policies.append({"name": "verifier", "model": str(models["verifier"]), "trainer": {"lr": args.lr, "threads": 1}})
    return {
        "run": {"name": f"mp-{mode}-{len(policies)}", "max_steps": args.steps, "mode": mode, "timeout_s": 600,
                "seed": seed},
        "policies": policies,
        "workload": {"name": "math", "workflow": "solver_verifier" if two else "single_turn",
                     "params": {"digits": args.digits, "num_test": args.eval_prompts},
                     "group_size": args.group, "sampling": {"temperature": 1.0, "max_new_tokens": 5},
                     "eval": {"every": args.steps, "num_prompts": args.eval_prompts}},
        "dataflow": {"batch_size": args.batch, "max_staleness": args.max_staleness, "prefetch_groups": args.batch // args.group},
        # episodes in flight per node (asynchronous modes; the sync driver rolls out one batch)
        # weight_poll_seconds: a step takes ~0.5 s here; polling every 0.5 s (the default, kind to
        # a shared filesystem) left rollouts a version older and dropped 9 % of them as stale (3 %)
        "rollout": {"capacity": args.capacity or 2 * args.batch, "engine": {"max_batch": args.batch},
                    "weight_poll_seconds": 0.1},
        "partitions": [
            {"name": "data", "scheduler": "local", "role": "data", "nodes": 1},
            # one trainer process per policy, so that two trainers can step at the same time
            {"name": "trainer", "scheduler": "local", "role": "trainer", "nodes": len(policies)},
            {"name": "rollout", "scheduler": "local", "role": "rollout", "nodes": args.rollout_nodes},
        ],
        "cluster": {"dashboard_port": 0},
    }


def step_span(lines: list[dict], from_step: int = 1) -> tuple[float, int]:
    """Seconds from the moment every policy had trained version ``from_step`` to the moment
    every policy had trained its last, and the number of iterations in between (an iteration:
    every policy one step, as one iteration of the sync driver)."""
    steps = [x for x in lines if "loss" in x]
    last = max(x["step"] for x in steps)
    start = max(x["time"] for x in steps if x["step"] == from_step)
    end = max(x["time"] for x in steps)
    return end - start, last - from_step


def verifier_at_start(models: dict[str, Path], digits: int, n: int) -> dict:
    """What the verifier brings before RL, greedy on ``n`` held-out problems: how often its
    verdict on the solver's own answer is right, and how often the sum it writes first is."""
    from astraflow.models import greedy_complete, load_model
    from astraflow.workloads.math import format_prompt, make_dataset
    from astraflow.workloads.prompts import VERIFY_NEW_TOKENS, parse_verdict, verify_prompt

    items = make_dataset({"digits": digits, "num_test": n}, "test")
    qs, answers = [format_prompt(i) for i in items], [str(i["answer"]) for i in items]
    firsts = [a.strip() for a in greedy_complete(*load_model(models["solver"]), qs, 8)]
    outs = greedy_complete(*load_model(models["verifier"]), [verify_prompt(q, a) for q, a in zip(qs, firsts)],
                           VERIFY_NEW_TOKENS)
    right = [f == a for f, a in zip(firsts, answers)]
    return {"solver_acc": sum(right) / n,
            "verdict_acc": sum(parse_verdict(o) == r for o, r in zip(outs, right)) / n,
            "own_sum_acc": sum(o.strip().rstrip("YNyn").strip() == a for o, a in zip(outs, answers)) / n}


class CpuSampler(threading.Thread):
    """CPU seconds used by every process this one started (Dask scheduler and workers, their
    engine processes), sampled every ``interval`` s together with the step every policy has
    reached (read from the run's ``metrics.jsonl`` as it grows): the CPU an iteration costs,
    whichever processes spend it. On a machine with C cores no schedule runs an iteration in
    less than its CPU seconds / C, however well rollout and training overlap."""

    def __init__(self, run_dir: Path, num_policies: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.metrics, self.num_policies, self.interval = run_dir / "metrics.jsonl", num_policies, interval
        self.samples: list[tuple[float, int]] = []  # (CPU seconds, step every policy reached)
        self._steps: dict[str, int] = {}
        self._pos, self._halt = 0, threading.Event()

    def _cpu(self) -> float:
        total = 0.0
        for proc in psutil.Process().children(recursive=True):
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # exited between the listing and the read
                pass
        return total

    def _step(self) -> int:
        if self.metrics.exists():
            with self.metrics.open() as f:
                f.seek(self._pos)
                chunk = f.read()
            done = chunk.rfind("\n") + 1  # complete lines only
            self._pos += done
            for line in chunk[:done].splitlines():
                rec = json.loads(line)
                if "loss" in rec:
                    self._steps[rec["policy"]] = max(self._steps.get(rec["policy"], 0), rec["step"])
        return min(self._steps.values()) if len(self._steps) == self.num_policies else 0

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.samples.append((self._cpu(), self._step()))

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def per_iteration(self, from_step: int) -> float | None:
        """CPU seconds per iteration from the first sample at ``from_step`` or later to the
        first at the last step reached."""
        if not self.samples:
            return None
        end = self.samples[-1][1]
        first = next(((c, s) for c, s in self.samples if s >= from_step), None)
        last = next((c, s) for c, s in self.samples if s >= end)
        if first is None or last[1] <= first[1]:
            return None
        return (last[0] - first[0]) / (last[1] - first[1])


def run_one(label: str, cfg_dict: dict, run_dir: Path, console: Console) -> dict:
    cfg = config_from_dict(cfg_dict)
    sampler = CpuSampler(run_dir, len(cfg.policies))
    sampler.start()
    t0 = time.time()
    try:
        result = launch(cfg, run_dir, quiet=True)
    finally:
        sampler.stop()
    wall = time.time() - t0
    summary = require_completed(result, run_dir, cfg.run.max_steps, f"{label} (run {run_dir})")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval_accuracy" in x]
    final = max(evals, key=lambda x: x["step"])
    span, n = step_span(lines)
    # steady state: the second half of the steps, after the batches rolled out ahead during
    # start-up (at most max_staleness + prefetch) are used up
    half = max(1, cfg.run.max_steps // 2)
    span2, n2 = step_span(lines, half)
    out = {"label": label, "wall_s": wall, "steps": result.steps, "acc": final["eval_accuracy"],
           "acc_v0": min(evals, key=lambda x: x["step"])["eval_accuracy"], "eval_step": final["step"],
           "span_s": span, "span_steps": n, "per_iter_all_s": span / max(n, 1),
           "per_iter_s": span2 / max(n2, 1), "cpu_per_iter_s": sampler.per_iteration(half),
           "iterations": summary.get("iterations", [])}
    if out["iterations"]:
        its = out["iterations"]
        out["per_iter_s"] = statistics.median(it["iteration_s"] for it in its)
        out["per_iter_all_s"] = statistics.mean(it["iteration_s"] for it in its)
        out["R"] = statistics.median(it["rollout_s"] for it in its)
        out["T"] = statistics.median(it["train_s"] for it in its)
        out["S"] = statistics.median(it["sync_s"] for it in its)
        out["ideal"] = statistics.median(
            (it["rollout_s"] + it["train_s"] + it["sync_s"]) / max(it["rollout_s"], it["train_s"]) for it in its)
    console.print(f"[bold]{label}[/]: {wall:.0f}s wall, {out['per_iter_s']:.2f}s/iteration, "
                  f"held-out accuracy {out['acc_v0']:.3f} (v0) -> {out['acc']:.3f} (v{out['eval_step']})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=at_least(1), default=16,
                    help="trainer steps per policy and run (the same in every mode)")
    ap.add_argument("--batch", type=at_least(1), default=64, help="sequences per trainer batch (also the engine batch)")
    ap.add_argument("--group", type=at_least(1), default=8, help="samples per prompt (GRPO group size)")
    ap.add_argument("--digits", type=at_least(1), default=2, help="digits of the addition problems")
    ap.add_argument("--lr", type=float, default=1e-4, help="RL lr (>= 5e-4 wrecks a partly trained tiny policy)")
    ap.add_argument("--eval-prompts", type=at_least(1), default=200, help="held-out problems per evaluation")
    ap.add_argument("--preset", default="tiny", help="model size preset of both policies")
    # bounds in steps, not seconds: the warm starts are seeded, so a slow machine builds the models a fast one does
    ap.add_argument("--solver-steps", type=int, default=1226,
                    help="upper bound of the solver's warm start (optimiser steps; 0.1-0.2 held-out by 1,226)")
    ap.add_argument("--solver-target", type=float, default=0.3,
                    help="stop the solver's warm start earlier at this held-out accuracy")
    ap.add_argument("--verifier-steps", type=int, default=6000, help="upper bound of the verifier's warm start")
    ap.add_argument("--verifier-target", type=float, default=0.9,
                    help="stop the verifier's warm start at this held-out verdict accuracy (3,550 steps)")
    ap.add_argument("--max-staleness", type=at_least(0), default=4,
                    help="versions a sequence may lag its trainer (every mode); each episode gives the solver "
                         "1-2 sequences and the verifier 1, so the solver's surplus ages in its buffer: at 2 "
                         "about 40 %% of its sequences were dropped as stale, rolled out for nothing")
    ap.add_argument("--rollout-nodes", type=at_least(1), default=1,
                    help="RaaS nodes (each runs its engine in its own process; on 2 cores one leaves the trainers a core)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="episodes in flight per RaaS node (default: 2x --batch, the next batch queued "
                         "in the engine; the sync driver rolls out one batch either way)")
    ap.add_argument("--repeats", type=at_least(1), default=3,
                    help="run (a), (b) and (c) this many times, interleaved, each repeat with its own seed; "
                         "speedups are medians of the per-repeat pairs, accuracies means")
    ap.add_argument("--workdir", type=Path, default=None, help="reuse the models built under this directory")
    args = ap.parse_args()
    console = Console(width=130)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mp-bench-"))
    workload = WorkloadConfig(name="math", params={"digits": args.digits})
    t0 = time.time()
    inits = {
        "solver": ModelInit(preset=args.preset, warm_start_steps=args.solver_steps,
                            warm_start_target=args.solver_target, warm_start_lr=3e-3, seed=0, task="solve_retry"),
        "verifier": ModelInit(preset=args.preset, warm_start_steps=args.verifier_steps,
                              warm_start_target=args.verifier_target, warm_start_lr=1e-3, seed=1, task="verify",
                              start_from="solver"),
    }
    models: dict[str, Path] = {}
    for role, init in inits.items():
        out = work / "models" / role
        # a --workdir of an earlier run: its models are reused (same warm starts, less waiting)
        base = models[init.start_from] if init.start_from else None
        models[role] = out if (out / "config.json").exists() else build_model(out, init, workload, base=base)
    console.print(f"models built in {time.time() - t0:.0f}s under {work / 'models'}")
    vstart = verifier_at_start(models, args.digits, args.eval_prompts)
    console.print(f"before RL, greedy on {args.eval_prompts} held-out problems: solver right {vstart['solver_acc']:.3f}; "
                  f"verifier's verdict on the solver's answer right {vstart['verdict_acc']:.3f}, "
                  f"the sum it writes first right {vstart['own_sum_acc']:.3f}")
    runs = work / time.strftime("runs-%Y%m%d-%H%M%S")  # fresh run directories, also in a reused workdir
    # Repeats, interleaved: the machine's speed drifts by 10-30 % within minutes, and a pair of
    # runs minutes apart measured that drift as much as the overlap. Every repeat runs (a), (b)
    # and (c) with its own seed, the order reversed every other repeat, so that neither mode
    # always runs on the busier side; the speedups are taken pair by pair.
    reps: list[dict[str, dict]] = []
    for i in range(args.repeats):
        order = ("a", "b", "c") if i % 2 == 0 else ("c", "b", "a")
        rep = {}
        for key in order:
            label, mode, two = {"a": ("(a) solver only", "async", False), "b": ("(b) solver+verifier sync", "sync", True),
                                "c": ("(c) solver+verifier async", "async", True)}[key]
            tag = f", repeat {i + 1}/{args.repeats}" if args.repeats > 1 else ""
            rep[key] = run_one(label + tag, make_config(args, work, models, mode, two, seed=i), runs / f"{key}{i}", console)
        reps.append(rep)

    def med(key: str, field: str) -> float:
        return statistics.median(r[key][field] for r in reps)

    def mean(key: str, field: str) -> float:
        return statistics.fmean(r[key][field] for r in reps)

    cores = len(os.sched_getaffinity(0))
    pairs = [{"speedup": r["b"]["per_iter_s"] / r["c"]["per_iter_s"], "ideal": r["b"]["ideal"]} for r in reps]
    for r, p in zip(reps, pairs):
        p["fraction"] = p["speedup"] / p["ideal"]
        # the same ideal with the machine's CPU as a further bound: an iteration of (b)'s work
        # cannot take less than its CPU seconds / cores, however rollout and training overlap
        b = r["b"]
        floor = max(b["R"], b["T"], (b["cpu_per_iter_s"] or 0.0) / cores)
        p["cpu_ideal"] = b["per_iter_s"] / floor
        p["cpu_fraction"] = p["speedup"] / p["cpu_ideal"]
    speedup, ideal = statistics.median(p["speedup"] for p in pairs), statistics.median(p["ideal"] for p in pairs)
    fraction = statistics.median(p["fraction"] for p in pairs)
    cpu_ideal, cpu_fraction = (statistics.median(p[k] for p in pairs) for k in ("cpu_ideal", "cpu_fraction"))
    table = Table(title=f"multi-policy, {args.steps} steps x {args.batch} seqs, {args.preset} models, "
                        f"{args.digits}-digit addition, {args.repeats} repeat(s)")
    for col in ("rep", "run", "s/it", "s/it (all)", "R", "T", "S", "CPU s/it", "acc v0", f"acc v{args.steps}",
                "wall s", "speedup", "of ideal", "fraction", "of CPU-bound", "fraction"):
        table.add_column(col, justify="right")
    for i, (rep, p) in enumerate(zip(reps, pairs)):
        for key in ("a", "b", "c"):
            r = rep[key]
            extra = (f"{p['speedup']:.2f}x", f"{p['ideal']:.2f}x", f"{p['fraction']:.2f}", f"{p['cpu_ideal']:.2f}x",
                     f"{p['cpu_fraction']:.2f}") if key == "c" else ("",) * 5
            cpu = f"{r['cpu_per_iter_s']:.2f}" if r["cpu_per_iter_s"] is not None else "-"
            table.add_row(str(i + 1), {"a": "(a) solver", "b": "(b) sync", "c": "(c) async"}[key], f"{r['per_iter_s']:.2f}",
                          f"{r['per_iter_all_s']:.2f}", *(f"{r[k]:.2f}" if k in r else "-" for k in ("R", "T", "S")), cpu,
                          f"{r['acc_v0']:.3f}", f"{r['acc']:.3f}", f"{r['wall_s']:.0f}", *extra)
    console.print(table)
    per_repeat = ", ".join(f"{p['fraction']:.2f}" for p in pairs)
    console.print(f"median over {args.repeats} repeat(s): speedup (b)/(c) {speedup:.2f}x; ideal overlap speedup from (b) "
                  f"{ideal:.2f}x; fraction of ideal {fraction:.2f} (per repeat: "
                  f"{per_repeat}); with the CPU as a further bound ((b)'s CPU seconds per iteration / {cores} cores) the "
                  f"ideal is {cpu_ideal:.2f}x and (c) reaches {cpu_fraction:.2f} of it; "
                  f"mean held-out accuracy (a) {mean('a', 'acc'):.3f}, (b) {mean('b', 'acc'):.3f}, (c) {mean('c', 'acc'):.3f}")
    res = {"speedup": round(speedup, 3), "ideal_speedup": round(ideal, 3), "fraction_of_ideal": round(fraction, 3),
           "acc_solver_only": round(mean("a", "acc"), 4), "acc_sync": round(mean("b", "acc"), 4),
           "acc_async": round(mean("c", "acc"), 4),
           "cpu_bound_ideal_speedup": round(cpu_ideal, 3), "fraction_of_cpu_bound_ideal": round(cpu_fraction, 3),
           "cores": cores, "repeats": args.repeats,
           "per_repeat": [{"fraction_of_ideal": round(p["fraction"], 3), "speedup": round(p["speedup"], 3),
                           "ideal_speedup": round(p["ideal"], 3), "cpu_bound_ideal_speedup": round(p["cpu_ideal"], 3),
                           "fraction_of_cpu_bound_ideal": round(p["cpu_fraction"], 3),
                           "cpu_per_iter_s": {k: r[k]["cpu_per_iter_s"] and round(r[k]["cpu_per_iter_s"], 3)
                                              for k in ("a", "b", "c")},
                           "acc": {k: r[k]["acc"] for k in ("a", "b", "c")}} for r, p in zip(reps, pairs)],
           "s_per_iter": {"solver_only": round(med("a", "per_iter_s"), 3), "sync": round(med("b", "per_iter_s"), 3),
                          "async": round(med("c", "per_iter_s"), 3)},
           "speedup_all_steps": round(med("b", "per_iter_all_s") / med("c", "per_iter_all_s"), 3),
           "sync_R_T_S": [round(med("b", k), 3) for k in ("R", "T", "S")],
           "steps": args.steps, "batch": args.batch, "preset": args.preset, "digits": args.digits,
           "rollout_nodes": args.rollout_nodes, "max_staleness": args.max_staleness,
           "verifier_at_start": {k: round(v, 3) for k, v in vstart.items()}}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
