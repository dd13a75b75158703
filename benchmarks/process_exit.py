"""How long AstraFlow's processes take to go once told to: workers that hold a model, as a run's
trainer and RaaS workers do, from SIGTERM to exited; and a RaaS node's engine process, from
``close()`` to reaped.

Side by side in one run, alternating rounds on the same pool size and the same scheduler:

* **baseline**: ``python -m distributed.cli.dask_worker`` (the stock command), whose interpreter
  tears down every module at exit;
* **dask_main**: ``python -m schedulers.dask_main worker`` (what AstraFlow starts), which runs
  the exit handlers and then ends.

Each worker loads the tiny example's model through transformers in a ``--preload`` (what a
trainer or a RaaS worker has imported and holds when a run stops). The engine process is
``ProcessEngine`` on the same model: its close is timed with the current code only (an engine
that returns from its loop ends at once); the baseline column for it is a child process that
loads the same model and exits normally.

    python benchmarks/process_exit.py [--workers 3] [--rounds 3]

Ends with ``RESULT {json}``: the median leave times and ``leave_ratio`` (dask_main over
baseline; below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")

from distributed import Client  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.run_checks import at_least  # noqa: E402
from tests.schedulers.dask_fixtures import start_dask_scheduler, stop, wait_for_workers  # noqa: E402

COMMANDS = {"baseline": ["-m", "distributed.cli.dask_worker"], "dask_main": ["-m", "schedulers.dask_main", "worker"]}

PRELOAD = """
import torch
from transformers import AutoModelForCausalLM

MODEL = AutoModelForCausalLM.from_pretrained({model!r})
with torch.no_grad():
    MODEL(torch.tensor([[1, 2, 3]]))
"""

NORMAL_EXIT = PRELOAD + "\nimport sys, time\nprint(time.time(), flush=True)\n"


def tiny_model() -> str:
    """The tiny example's model directory, built as ``astraflow run`` builds it when missing."""
    from astraflow.config import load_config
    from astraflow.runtime.model_build import prepare_models
    from astraflow.runtime.progress import Progress

    cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", [])
    prepare_models(cfg, Progress())
    return str(cfg.policies[0].model)


def workers_leave(kind: str, address: str, client: Client, preload: Path, n: int, tag: str, logs: Path) -> float:
    """Start ``n`` workers with ``kind``'s command, wait until all joined, SIGTERM them all:
    seconds until the last one exited."""
    names = [f"{kind}-{tag}-{i}" for i in range(n)]
    procs = []
    for name in names:
        with open(logs / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, *COMMANDS[kind], address, "--name", name, "--nthreads", "1", "--no-nanny",
                 "--no-dashboard", "--death-timeout", "60", "--preload", str(preload)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    try:
        if not set(names) <= wait_for_workers(client, set(names), present=True, deadline_s=180):
            raise RuntimeError(f"workers did not join; see {logs}")
        t0 = time.perf_counter()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=120)
        return time.perf_counter() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def engine_close(model: str) -> float:
    """Seconds ``ProcessEngine.close()`` takes once the engine process is serving."""
    from astraflow.rollout.process_engine import ProcessEngine

    engine = ProcessEngine(model, max_batch_size=4)
    t0 = time.perf_counter()
    engine.close()
    return time.perf_counter() - t0


def normal_exit(model: str) -> float:
    """Seconds a child that loaded the model takes from its last statement to exited."""
    p = subprocess.Popen([sys.executable, "-c", NORMAL_EXIT.format(model=model)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    last = float(p.stdout.readline())
    p.wait(timeout=120)
    return time.time() - last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=at_least(1), default=3, help="workers started and stopped together")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="alternating rounds of each")
    args = ap.parse_args()
    model = tiny_model()
    tmp = Path(tempfile.mkdtemp(prefix="af-exit-"))
    preload = tmp / "hold_model.py"
    preload.write_text(PRELOAD.format(model=model))
    proc, address, _ = start_dask_scheduler(tmp)
    client = Client(address, timeout=20)
    leave: dict[str, list[float]] = {k: [] for k in COMMANDS}
    engine: dict[str, list[float]] = {"baseline": [], "dask_main": []}
    try:
        for r in range(args.rounds):
            for kind in (COMMANDS if r % 2 == 0 else reversed(list(COMMANDS))):
                leave[kind].append(workers_leave(kind, address, client, preload, args.workers, str(r), tmp))
                print(f"round {r + 1}: {kind} workers left in {leave[kind][-1]:.2f} s "
                      f"(load {os.getloadavg()[0]:.2f})", flush=True)
            engine["baseline"].append(normal_exit(model))
            engine["dask_main"].append(engine_close(model))
    finally:
        client.close()
        stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in leave.items()}
    eng = {k: statistics.median(v) for k, v in engine.items()}
    table = Table(title=f"leaving: {args.workers} workers holding a model, SIGTERM → all exited; an engine process "
                        f"(median of {args.rounds})")
    for col in ("", "baseline (s)", "AstraFlow (s)", "ratio"):
        table.add_column(col)
    table.add_row("workers", f"{med['baseline']:.2f}", f"{med['dask_main']:.2f}",
                  f"{med['dask_main'] / med['baseline']:.2f}")
    table.add_row("engine process", f"{eng['baseline']:.2f}", f"{eng['dask_main']:.2f}",
                  f"{eng['dask_main'] / eng['baseline']:.2f}")
    Console().print(table)
    print("RESULT " + json.dumps({
        "workers": args.workers, "rounds": args.rounds,
        "workers_leave_s": {k: round(v, 3) for k, v in med.items()},
        "leave_ratio": round(med["dask_main"] / med["baseline"], 3),
        "engine_exit_s": {"normal_exit": round(eng["baseline"], 3), "process_engine_close": round(eng["dask_main"], 3)},
        "engine_ratio": round(eng["dask_main"] / eng["baseline"], 3),
    }))


if __name__ == "__main__":
    main()
