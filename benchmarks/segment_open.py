"""What opening a trajectory segment costs as a run's history grows: one segment per node for
the node's life (the baseline) against bounded segments (``rollout.segment_max_entries``).

A reader opening a segment parses its whole commit log, so a resume, a restarted trainer or the
episode viewer pays for everything the segment ever held. This writes ``--entries`` small
trajectories (the commit-log metadata of a real run's rows) both ways into a scratch store,
then, in a fresh process each, opens the store and reads the newest row: seconds and peak
memory. Prints a table and a ``RESULT`` line with the ratios.

    python benchmarks/segment_open.py [--entries 1000000] [--bound 50000]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run_checks import at_least  # noqa: E402
from storage.trajectories import EntryRef, StoredSequence, open_trajectory_store  # noqa: E402
from storage.trajectories.rotating import RotatingWriter  # noqa: E402

META = json.dumps({"attempt": 0, "kind": "train", "policies": ["solver"], "rewards": {}, "score": None,
                   "provenance": {"engine_seconds": 0.0932, "finished_at": 1796484761.47, "hardware": "cpu",
                                  "node": "rollout-rollout-local-cpu-1", "partition": "rollout", "region": "local",
                                  "started_at": 1796484761.17}, "stats": {}, "workflow": "single_turn"})


def _row(i: int) -> StoredSequence:
    t = np.arange(8, dtype=np.int32)
    return StoredSequence(f"g{i // 8:08d}/{i % 8}", f"g{i // 8:08d}", 0, 1, t, np.ones(8, np.uint8),
                          np.zeros(8, np.float32), np.zeros(8, np.int16), np.zeros(8, np.int32), 0.0, "stop", META)


def write(root: str, entries: int, bound: int | None, batch: int = 64) -> str:
    """``entries`` rows into one segment (``bound`` None) or a bounded series; the newest one's segment."""
    store = open_trajectory_store(root, "a", durable=False)
    w = store.writer("node") if bound is None else RotatingWriter(store, "node", batch, bound)
    for k in range(0, entries, batch):
        w.write([_row(i) for i in range(k, min(entries, k + batch))])
    last = w.segment
    w.close()
    return last


def measure(root: str, segment: str) -> None:
    """In this (fresh) process: open the store and read the newest row of ``segment``; the memory
    is what the open added to the process's peak."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    store = open_trajectory_store(root, "r")
    store.read_columns([EntryRef(segment, store.count(segment) - 1)])
    print(json.dumps({"s": time.perf_counter() - t0,
                      "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))


def _in_fresh_process(root: str, segment: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure", root, segment], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--entries", type=at_least(1), default=1_000_000, help="trajectories written, both ways")
    ap.add_argument("--bound", type=at_least(1), default=50_000,
                    help="rollout.segment_max_entries of the bounded side (entries per segment)")
    ap.add_argument("--measure", nargs=2, metavar=("ROOT", "SEGMENT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        return measure(*args.measure)
    scratch = Path(tempfile.mkdtemp(prefix="segment_open."))
    try:
        rows = {}
        for name, bound in (("one segment (baseline)", None), (f"segments of {args.bound}", args.bound)):
            root = str(scratch / ("one" if bound is None else "bounded"))
            t0 = time.perf_counter()
            last = write(root, args.entries, bound)
            print(f"wrote {args.entries} entries ({name}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            rows[name] = _in_fresh_process(root, last)
        base, bounded = rows.values()
        print(f"{'layout':<28}{'open + read newest (s)':>24}{'added peak memory (MB)':>24}")
        for name, r in rows.items():
            print(f"{name:<28}{r['s']:>24.2f}{r['peak_mb']:>24.0f}")
        print("RESULT " + json.dumps({"entries": args.entries, "bound": args.bound,
                                      "open_s_baseline": round(base["s"], 3), "open_s_bounded": round(bounded["s"], 3),
                                      "open_time_ratio": round(base["s"] / bounded["s"], 2),
                                      "peak_mb_baseline": round(base["peak_mb"]),
                                      "peak_mb_bounded": round(bounded["peak_mb"]),
                                      "peak_memory_ratio": round(base["peak_mb"] / max(bounded["peak_mb"], 1), 2)}))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
