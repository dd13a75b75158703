"""``benchmarks/control_plane.py`` at tiny sizes runs end to end as a script (emulated nodes
against a data-layer actor on a real Dask worker, the index-growth part in-process) and ends
with a ``RESULT`` line holding sane numbers. No timing is asserted: the run is too small (and
the machine too shared) for its numbers to mean anything."""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_bounded(cmd: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own: past ``timeout_s`` it prints where its threads wait
    (SIGUSR1, which the benchmark hands to faulthandler), then the whole session is killed, its
    spawned emulator processes too, and the test fails with what it printed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        import psutil

        # its emulator, probe and trainer processes print their stacks too (``trainer_start``)
        pools = [c for c in psutil.Process(proc.pid).children() if "multiprocessing.spawn" in " ".join(c.cmdline())]
        for p in [*pools, psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the benchmark did not end within {timeout_s:g} s; its processes' threads then:\n{err[-24000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_tiny_run_prints_sane_rows_and_a_result_line(tmp_path):
    out = tmp_path / "rows.json"
    proc = _run_bounded(
        [sys.executable, "benchmarks/control_plane.py", "--nodes", "10", "--seconds", "2", "--warmup", "2",
         "--batch-size", "64", "--index-sizes", "1e3,1e4", "--index-trajectories", "300", "--json-out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT {"), proc.stdout[-2000:]
    result = json.loads(last[len("RESULT "):])
    assert result["cost_growth_1e4_to_1e7"] > 0 and result["index_range"] == [1000, 10000]
    # the headline is the default call pattern's; the opt-in lease stock's figures are named
    assert result["headline_calls"] == "grouped" and "stocked_p99_lease_ms_10_nodes" in result
    assert result["p99_lease_stocked_vs_grouped"] > 0
    rows = json.loads(out.read_text())
    assert [(r["nodes"], r["calls"]) for r in rows["scale"]] == [(10, "per-node"), (10, "grouped"), (10, "stocked")]
    for r in rows["scale"]:
        assert r["traj_per_s"] > 0 and r["dl_cpu_us_per_traj"] > 0 and r["lease_calls"] > 0
        assert math.isfinite(r["lease_p99_ms"]) and r["lease_p99_ms"] >= r["lease_p50_ms"] > 0
        # the emulator processes' loop lag and the idle caller's latency were measured in the window
        assert r["loop_lag_calls"] > 0 and r["probe_calls"] > 0 and r["probe_p99_ms"] >= r["probe_p50_ms"] > 0
        assert r["emulator_cpu_cores"] > 0
    grouped, stocked = rows["scale"][1], rows["scale"][2]
    assert grouped["gathered"]["lease"] >= 1  # node calls per gathered call
    # the stocked nodes' leases were answered by their workers' stocks, which refilled
    assert stocked["gathered"]["stock"] > 0 and 0 <= stocked["lease_empty_frac"] <= 1
    assert [r["index_entries"] for r in rows["index"]] == [1000, 10000]
    assert all(r["trajectories"] >= 300 and r["dl_cpu_us_per_traj"] > 0 for r in rows["index"])


def test_the_emulated_nodes_refs_are_what_a_node_makes():
    """The emulator computes a shared sequence's summary once: its references are still
    ``TrajectoryRef.of``'s, field for field."""
    import random

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from control_plane_nodes import refs_of, tiny_trajectory

    from astraflow.contracts import RolloutTask, TrajectoryRef
    from storage.trajectories import EntryRef

    rng = random.Random(0)
    tasks = [RolloutTask(task_id=f"g{i}/0", group_id=f"g{i}", policies=("p",), workflow="single_turn",
                         prompt={}, kind="train", attempt=i % 2) for i in range(40)]
    trajs = [tiny_trajectory(t, f"n{i % 3}", i % 4, rng) for i, t in enumerate(tasks)]
    entries = [EntryRef(segment="w0", index=i) for i in range(40)]
    assert refs_of(trajs, entries) == [TrajectoryRef.of(t, [e]) for t, e in zip(trajs, entries)]
