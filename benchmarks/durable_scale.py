"""Durability's cost per state-changing call as the work in flight grows, side by side.

In-process: a real ``DataLayer`` (memory store, its durable files in a temp dir) with
``--outstanding`` tasks leased to nodes of capacity 8, then ``--calls`` state-changing calls
that keep that number: a node fails one of its tasks (requeued) and leases it again. The CPU
time per call (all threads) with durability on, less the same with it off, is what
durability costs a call. ``--baseline-root DIR`` runs the same against another checkout's code
in a subprocess (rows marked ``baseline``). Also reported: bytes written per call.

    python benchmarks/durable_scale.py [--outstanding 1000,8000] [--calls 300] [--baseline-root DIR]

Prints a table; ends with ``RESULT {json}`` (cost growth from the smallest to the largest size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path


def _root_from_argv() -> str:
    """``--astraflow-root`` must take effect before ``astraflow`` is imported."""
    if "--astraflow-root" in sys.argv:
        return sys.argv[sys.argv.index("--astraflow-root") + 1]
    return str(Path(__file__).resolve().parents[1])


ROOT = _root_from_argv()
sys.path.insert(0, ROOT)

from astraflow.dataflow.config import DataflowConfig  # noqa: E402
from astraflow.dataflow.layer import DataLayer  # noqa: E402
from astraflow.workloads.config import WorkloadConfig  # noqa: E402


def layer(tmp: Path, outstanding: int, durable: bool) -> DataLayer:
    groups = outstanding // 8
    return DataLayer(
        dataflow=DataflowConfig(batch_size=64, prefetch_groups=groups, lease_seconds=3600.0),
        workload=WorkloadConfig(name="math", params={"digits": 2, "num_test": 10}, group_size=8),
        policies=["p"], store_url=f"memory://{uuid.uuid4().hex}", metrics_path=str(tmp / "metrics.jsonl"),
        max_steps=10**9, snapshot_path=str(tmp / "dataflow.snapshot") if durable else None,
        journal_path=str(tmp / "ledger.jsonl") if durable else None)


async def measure(dl: DataLayer, outstanding: int, calls: int) -> dict:
    nodes = [f"n{i}" for i in range(outstanding // 8)]
    for n in nodes:
        await dl.lease(n, 8)
    held = len(dl.leases.held)
    mine = {n: sorted(dl.leases.by_node.get(n, ())) for n in nodes}
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(calls):
        node = nodes[i % len(nodes)]
        tid = mine[node][i // len(nodes) % len(mine[node])]
        await dl.fail(tid, "bench")
        again = await dl.lease(node, 1)
        assert [t.task_id for t in again] == [tid], (tid, again)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    state = await dl.state()
    await dl.close()
    return {"held": held, "cpu_us_per_call": cpu / (2 * calls) * 1e6, "wall_us_per_call": wall / (2 * calls) * 1e6,
            "snapshots": state.get("snapshots", {})}


def run_sizes(sizes: list[int], calls: int) -> list[dict]:
    rows = []
    for n in sizes:
        row = {"outstanding": n}
        for durable in (False, True):
            with tempfile.TemporaryDirectory(prefix="durable-scale-") as tmp:
                out = asyncio.run(measure(layer(Path(tmp), n, durable), n, calls))
            key = "durable" if durable else "plain"
            row[f"{key}_cpu_us"] = out["cpu_us_per_call"]
            row["held"] = out["held"]
            if durable:
                snaps = out["snapshots"]
                row["bytes_per_write"] = (snaps.get("log_bytes") or 0) / max(snaps.get("writes", 1), 1) \
                    if "log_bytes" in snaps else snaps.get("last_bytes", 0)
                row["writes"] = snaps.get("writes", 0)
        row["durability_us_per_call"] = row["durable_cpu_us"] - row["plain_cpu_us"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--astraflow-root", default=ROOT, help="the checkout whose code is measured (default: this one)")
    ap.add_argument("--outstanding", default="1000,8000", help="tasks leased out at each size, comma-separated")
    ap.add_argument("--calls", type=int, default=300, help="state-changing calls timed at each size")
    ap.add_argument("--baseline-root", default=None, help="also measure another checkout's code (rows 'baseline')")
    ap.add_argument("--json-out", default=None, help="write the rows here as JSON instead of the table")
    args = ap.parse_args()
    # checked here, not with benchmarks.run_checks: --astraflow-root may be a checkout without it
    try:
        sizes = [int(x) for x in args.outstanding.split(",")]
    except ValueError:
        ap.error(f"--outstanding {args.outstanding}: comma-separated integers")
    if min(sizes) < 1 or args.calls < 1:
        ap.error("--outstanding sizes and --calls must be at least 1")
    rows = [{"code": "this", **r} for r in run_sizes(sizes, args.calls)]
    if args.baseline_root:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "--astraflow-root", args.baseline_root, "--outstanding",
                            args.outstanding, "--calls", str(args.calls), "--json-out", f.name], check=True,
                           env={**os.environ, "PYTHONPATH": args.baseline_root}, stdout=subprocess.DEVNULL)
            rows = [{"code": "baseline", **r} for r in json.loads(Path(f.name).read_text())] + rows
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([{k: v for k, v in r.items() if k != "code"} for r in rows]))
        return
    cols = ["code", "outstanding", "held", "plain_cpu_us", "durable_cpu_us", "durability_us_per_call",
            "bytes_per_write", "writes"]
    print("  ".join(f"{c:>22}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>22.1f}" if isinstance(r[c], float) else f"{str(r[c]):>22}" for c in cols))
    result = {"load": os.getloadavg()[0]}
    for code in ("baseline", "this"):
        mine = [r for r in rows if r["code"] == code]
        if len(mine) > 1:
            result[f"{code}_durability_us_per_call"] = {r["outstanding"]: round(r["durability_us_per_call"], 1)
                                                        for r in mine}
            result[f"{code}_cost_growth"] = round(mine[-1]["durability_us_per_call"]
                                                  / max(mine[0]["durability_us_per_call"], 1e-9), 2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
