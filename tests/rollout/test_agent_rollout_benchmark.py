"""``benchmarks/agent_rollout.py --quick`` runs end to end as a script (a RaaS node on real Dask
workers and the bare engine) and ends with a ``RESULT`` line holding the reported numbers. No
timing is asserted: the smoke run is too small for its numbers to mean anything."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"ratio_vs_bare_engine", "episodes_per_s", "generated_tokens_per_s", "generated_tokens",
        "env_time_fraction", "bare_episodes_per_s", "bare_generated_tokens_per_s", "bare_generated_tokens"}


def test_quick_run_prints_a_result_line():
    proc = subprocess.run([sys.executable, "benchmarks/agent_rollout.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT {"), proc.stdout[-2000:]
    result = json.loads(last[len("RESULT "):])
    assert KEYS <= set(result), KEYS - set(result)
    # a fixed number of turns per episode whatever the model writes: both sides generate
    assert result["episodes"] == 8 and result["turns"] == 2
    assert result["generated_tokens"] > 0 and result["bare_generated_tokens"] > 0
    assert 0 <= result["env_time_fraction"] <= 1
