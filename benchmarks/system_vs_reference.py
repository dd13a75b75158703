"""The decoupled system against the single-process GRPO reference, per minute of RL.

Issue #3's bar: the main example (data layer, trainer and RaaS node as Dask actors) must learn
at least as well per minute as a well-tuned single-process GRPO trainer on the same machine
(``benchmarks/grpo_reference.py``: the same engine, loss, model directory, learning rate and
batch, on-policy, in one process with 2 threads). One reading of one pair is noise (a
200-prompt evaluation moves by +-3.5 points; this machine's speed by +-10 %), so this script
runs ``--pairs`` rounds, alternating a system run and a reference run (reference run ``i`` with
seed ``i``), and compares every system run with every reference run:

* ``mean_acc_ratio``: mean held-out accuracy over the common span of RL minutes, system /
  reference (both curves interpolated on one time grid; ``grpo_reference.compare_with_run``);
* ``gain30``: the first minute each is 30 points above its start of RL, on single evaluations
  and on a 3-evaluation moving average; a pair counts as "ahead" when the system gets there no
  later than the reference.

The model is the config's (built and warm-started by the first system run when missing), so
both start RL from the same weights. Prints a table of every pair and ends with one
``RESULT {json}`` line (``mean_acc_ratio``: the mean over all pairs).

    python benchmarks/system_vs_reference.py [--pairs 2] [--config examples/math/config.yaml]
        [--system-run RUN_DIR ...] [--reference-result LOG ...]   (fold in earlier runs)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from itertools import product
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from astraflow.config import load_config  # noqa: E402
from astraflow.runtime.monitoring import read_metrics  # noqa: E402
from benchmarks.grpo_reference import compare_with_run  # noqa: E402
from benchmarks.run_checks import at_least  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/math/config.yaml", help="the system's run config")
    p.add_argument("--pairs", type=at_least(0), default=2,
                   help="rounds of (system run, reference run); 0: only compare the runs given below")
    p.add_argument("--system-run", action="append", default=[], metavar="RUN_DIR",
                   help="also compare this earlier `astraflow run` directory (repeatable)")
    p.add_argument("--reference-result", action="append", default=[], metavar="LOG",
                   help="also compare this earlier reference run (a file holding its RESULT line; repeatable)")
    p.add_argument("--workdir", default=None,
                   help="run directories and logs go here (default: a fresh runs/system_vs_reference/<timestamp>; "
                        "an existing one must not hold the run directories already)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides for the system runs (as `astraflow run --set`)")
    p.add_argument("--reference-extra-seconds", type=float, default=20.0,
                   help="the reference's RL runs this much longer than the first system run's (so the "
                        "common span is the system's whole run)")
    args = p.parse_args(argv)
    if args.pairs == 0 and not (args.system_run and args.reference_result):
        p.error("nothing to compare: --pairs 0 needs at least one --system-run and one --reference-result")
    return args


def _result(log: Path) -> dict:
    lines = [x for x in log.read_text().splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"no RESULT line in {log}: see its end for the error")
    return json.loads(lines[-1][len("RESULT "):])


def _run(cmd: list[str], log: Path, console: Console, what: str) -> None:
    console.print(f"[bold]{what}[/bold]: {' '.join(cmd[1:])}  (log {log})")
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"{what} failed (exit {rc}); the end of {log}:\n{tail}")


def _system_summary(run_dir: Path) -> dict:
    """Held-out accuracy before and after RL, RL seconds and trainer steps/s of a run directory
    (its first policy's curves, as ``astraflow plot`` reads them)."""
    view = read_metrics(run_dir)
    if not view.policies:
        raise SystemExit(f"{run_dir}/metrics.jsonl holds no step: is it an `astraflow run` directory?")
    c = next(iter(view.policies.values()))
    if len(c.eval_time) < 2:
        raise SystemExit(f"{run_dir} has {len(c.eval_time)} evaluations: run it longer (workload.eval.every)")
    rl_s = c.eval_time[-1] - c.eval_time[0]
    steps = max(c.step, default=0)
    return {"acc_before": c.eval_accuracy[0], "acc_after": c.eval_accuracy[-1], "rl_seconds": round(rl_s, 1),
            "steps": steps, "steps_per_s": round(steps / max(rl_s, 1e-9), 2)}


def _no_later(system: float | None, reference: float | None) -> bool:
    """The system reached +30 points, and no later than the reference (which may never have)."""
    return system is not None and (reference is None or system <= reference)


def compare_pairs(systems: list[tuple[str, Path]], references: list[tuple[str, dict]],
                  console: Console) -> dict:
    """Every system run directory against every reference ``RESULT`` (its ``curve``): per pair
    the ``compare_with_run`` numbers and whether the system reached +30 no later; overall the
    mean and lowest accuracy ratio and the fraction of pairs ahead. Prints a table."""
    if not systems or not references:
        raise ValueError("compare_pairs needs at least one system run and one reference run")
    quiet = Console(quiet=True)
    pairs = []
    table = Table(title="system vs single-process reference, per minute of RL (every pair)")
    for col in ("system", "reference", "minutes", "mean acc sys / ref", "ratio", "+30 at (min) sys / ref",
                "moving avg sys / ref"):
        table.add_column(col, justify="right")
    for (sname, run_dir), (rname, res) in product(systems, references):
        c = compare_with_run(run_dir, [(x["seconds"] / 60, x["acc"]) for x in res["curve"]], quiet)
        pairs.append({"system": sname, "reference": rname, **{k: c[k] for k in (
            "common_minutes", "mean_acc_system", "mean_acc_reference", "mean_acc_ratio", "gain30_min_system",
            "gain30_min_reference", "gain30_min_system_smoothed3", "gain30_min_reference_smoothed3")},
            "gain30_ahead": _no_later(c["gain30_min_system"], c["gain30_min_reference"]),
            "gain30_ahead_smoothed3": _no_later(c["gain30_min_system_smoothed3"],
                                                c["gain30_min_reference_smoothed3"])})
        table.add_row(sname, rname, f"{c['common_minutes']:.1f}",
                      f"{c['mean_acc_system']:.3f} / {c['mean_acc_reference']:.3f}", f"{c['mean_acc_ratio']:.3f}",
                      f"{c['gain30_min_system']} / {c['gain30_min_reference']}",
                      f"{c['gain30_min_system_smoothed3']} / {c['gain30_min_reference_smoothed3']}")
    console.print(table)
    n = len(pairs)
    return {
        "pairs": n,
        "mean_acc_ratio": round(sum(p["mean_acc_ratio"] for p in pairs) / n, 3),
        "min_acc_ratio": min(p["mean_acc_ratio"] for p in pairs),
        "gain30_ahead_fraction": round(sum(p["gain30_ahead"] for p in pairs) / n, 3),
        "gain30_ahead_fraction_smoothed3": round(sum(p["gain30_ahead_smoothed3"] for p in pairs) / n, 3),
        "pair_details": pairs,
    }


def fresh_workdir(parent: Path) -> Path:
    """A new directory under ``parent`` named by the time (``-2``, ... when taken), so that every
    run without ``--workdir`` has run directories of its own."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    while True:
        work = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            work.mkdir()
            return work
        except FileExistsError:
            n += 1


def main(argv=None) -> dict:
    a = parse_args(argv)
    console = Console()
    cfg = load_config(ROOT / a.config, a.overrides)
    pol = cfg.policies[0]
    model_dir = Path(pol.model)
    work = ROOT / a.workdir if a.workdir else fresh_workdir(ROOT / "runs" / "system_vs_reference")
    work.mkdir(parents=True, exist_ok=True)
    if a.pairs:
        console.print(f"run directories and logs under {work}")
    sets = [x for o in a.overrides for x in ("--set", o)]
    ref_args = [
        "--preset", pol.init.preset if pol.init else "mini", "--arch", pol.init.arch if pol.init else "llama",
        "--lr", str(pol.trainer.lr), "--precision", pol.trainer.precision, "--engine-dtype", cfg.rollout.engine.dtype,
        "--prompts", str(cfg.dataflow.batch_size // cfg.workload.group_size),
        "--group", str(cfg.workload.group_size), "--threads", "2",
        "--digits", str(cfg.workload.params.get("digits", 2)),
        "--data-seed", str(cfg.workload.params.get("seed", cfg.workload.seed)),
        "--eval-size", str(cfg.workload.eval.num_prompts), "--eval-every", str(cfg.workload.eval.every),
        "--max-new-tokens", str(cfg.workload.sampling.max_new_tokens),
        "--temperature", str(cfg.workload.sampling.temperature), "--model-dir", str(model_dir),
    ]
    systems: list[tuple[str, Path, dict]] = []
    refs: list[tuple[str, dict]] = []
    ref_seconds = None
    for i in range(a.pairs):
        name = f"system{i + 1}"
        run_dir = work / name
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: pass another --workdir or remove it")
        _run([sys.executable, "-m", "astraflow.cli", "run", a.config, "--run-dir", str(run_dir), *sets],
             work / f"{name}.log", console, f"system run {i + 1}/{a.pairs}")
        summary = _system_summary(run_dir)
        systems.append((name, run_dir, summary))
        console.print(f"  {summary}")
        if ref_seconds is None:
            ref_seconds = summary["rl_seconds"] + a.reference_extra_seconds
        name = f"reference{i + 1}"
        # a seed of its own (prompt order, sampling): the pairs then cover the reference's learning
        # noise, not only its speed (with one seed its curve per step is the same in every run)
        _run([sys.executable, "benchmarks/grpo_reference.py", *ref_args, "--rl-seconds", f"{ref_seconds:.0f}",
              "--seed", str(i)],
             work / f"{name}.log", console, f"reference run {i + 1}/{a.pairs}")
        res = _result(work / f"{name}.log")
        refs.append((name, res))
        console.print(f"  acc {res['acc_before']:.3f} -> {res['acc_after']:.3f}, {res['rl_steps']} steps in "
                      f"{res['rl_seconds']} s, +30 at {res['seconds_to_gain30']} s")

    systems += [(Path(d).name, Path(d), _system_summary(Path(d))) for d in a.system_run]
    refs += [(Path(f).name, _result(Path(f))) for f in a.reference_result]
    if not systems or not refs:
        raise SystemExit("nothing to compare: --pairs 0 needs at least one --system-run and one --reference-result")
    result = compare_pairs([(n, d) for n, d, _ in systems], refs, console)
    result.update({
        "system_steps_per_s": [s["steps_per_s"] for _, _, s in systems],
        "reference_steps_per_s": [round(r["rl_steps"] / r["rl_seconds"], 2) for _, r in refs],
        "system_acc": [[s["acc_before"], s["acc_after"]] for _, _, s in systems],
        "reference_acc": [[r["acc_before"], r["acc_after"]] for _, r in refs],
    })
    console.print(f"mean accuracy ratio {result['mean_acc_ratio']} (lowest {result['min_acc_ratio']}); "
                  f"system at +30 no later than the reference in {result['gain30_ahead_fraction']:.0%} of pairs "
                  f"({result['gain30_ahead_fraction_smoothed3']:.0%} on the moving average)")
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
