"""Shared by the benchmarks that compare two settings of the main example side by side.

``run_main_example`` runs ``examples/math/config.yaml`` (embedded default: local Dask workers,
CPU model) through ``astraflow.runtime.launch`` (the code path of ``astraflow run``) with
``--set``-style overrides and reads back, from its run directory, trainer steps per second
between the first and the last step (model loading and the first evaluation excluded),
episodes per second, the held-out accuracy at the end, and the summary.

A run that stopped early (Ctrl-C, ``astraflow stop``) ends the benchmark (``require_completed``).
``work_directory`` holds the runs: the ``--workdir`` given (kept), else a temporary directory that
goes when the benchmark ends, a failure or Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.run_checks import require_completed  # noqa: E402


@contextlib.contextmanager
def work_directory(workdir: Path | None, prefix: str) -> Iterator[Path]:
    """``workdir`` (created if missing, kept), or a fresh temporary directory removed on exit."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir
        return
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_main_example(run_dir: Path, overrides: dict[str, Any], steps: int, seed: int) -> dict[str, Any]:
    """One run of the main example (``steps`` trainer steps, one evaluation at the end)."""
    from astraflow.config import load_config
    from astraflow.runtime.launch import launch

    os.chdir(ROOT)  # the example's model path is relative to the repository root
    sets = {"run.max_steps": steps, "workload.eval.every": steps, "cluster.dashboard_port": 0, "run.seed": seed,
            **overrides}
    cfg = load_config(ROOT / "examples" / "math" / "config.yaml", [f"{k}={v}" for k, v in sets.items()])
    result = launch(cfg, run_dir, quiet=True)
    summary = require_completed(result, run_dir, steps, f"the run in {run_dir}")
    address = json.loads((run_dir / "control" / "orchestrator.json").read_text()).get("scheduler", "")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step_lines = [x for x in lines if "accepted" in x]
    evals = [x for x in lines if "eval_accuracy" in x]
    first, last = step_lines[0], step_lines[-1]
    seconds = max(last["time"] - first["time"], 1e-9)
    return {"address": address, "steps": last["step"],
            "steps_per_s": (last["step"] - first["step"]) / seconds,
            "episodes_per_s": (last["rollouts_generated"] - first["rollouts_generated"]) / seconds,
            "acc_after": evals[-1]["eval_accuracy"] if evals else float("nan"),
            "summary": summary}
